"""The ``quantfuse`` torch.compile backend: Inductor with quantfuse's passes installed.

``torch.compile(model, backend="quantfuse", options={...})`` runs Inductor's
``compile_fx`` with our pattern passes placed in Inductor's custom-pass slots
through ``config_patches`` (per compile; global Inductor config is never
changed).  Options:

``passes`` (bool, default True)
    Install the quantfuse passes.  False gives plain Inductor.
``families`` (a family name or a sequence of them, default all)
    Pattern families to enable: ``scaled_mm``, ``scaled_mm_azp``, ``awq_gemm``,
    ``w8a16_gemm``.
``horizontal`` (bool, default True)
    Merge fused ops of one family that read the same activation (q/k/v, gate/up
    projections) into one op over their weights concatenated along N, made once
    per weight (``passes/horizontal.py``).  False keeps one op per linear.
``fallback`` (bool, default True)
    If compiling with our passes fails, compile with plain Inductor; if that
    fails too, run the graph in eager.  Each such fallback logs a WARNING on
    this module's logger and counts in
    ``torch._dynamo.utils.counters["quantfuse"]`` (``fallback_inductor``,
    ``fallback_eager``), every time it happens.  False re-raises.
any other key
    Passed to Inductor as a config patch (e.g. ``"max_autotune": True``,
    ``"freezing": True``), like ``torch.compile(options=...)`` for Inductor.

Options are checked before anything compiles, as Inductor checks its own: an
unknown key (a typo such as ``max_autotunez``), a mistyped value or an unknown
family raises ``ValueError`` naming it and the valid ones (Dynamo reports it
as ``BackendCompilerFailed``); fallback is for real compile failures only.

``pdl`` (bool, default True)
    Programmatic dependent launch on sm_90 and later, in graphs that run as CUDA graphs: Inductor's
    Triton kernels are generated with it (``triton.enable_pdl``, where this torch has it; an explicit
    ``triton.enable_pdl`` option wins), so that each kernel launches while the one before finishes,
    as our decode kernels do (``csrc/common/pdl.cuh``; each waits for the one before to complete
    before it reads).  The environment's ``QUANTFUSE_PDL=0`` turns it off here and in the kernels'
    launches; results are the same either way.  Outside CUDA graphs it stays off (a launch with it costs the host more).

``mode`` works as for Inductor ("reduce-overhead" turns on CUDA graphs,
"max-autotune" max-autotune).  A graph run as a CUDA graph refuses to run once a weight it
read derived values of has changed since it was captured (``derived/captured_graphs.py``).
"""

from __future__ import annotations

import contextlib
import logging
from typing import Any

import torch
from torch._dynamo.backends import registry
from torch._inductor.custom_graph_pass import CustomGraphPass

log = logging.getLogger("quantfuse")

OUR_OPTIONS = ("passes", "families", "horizontal", "gqa_decode", "rms_norm_ordered", "fallback", "pdl")
# Every option but "families" is a switch, on unless turned off.
_SWITCHES = tuple(o for o in OUR_OPTIONS if o != "families")
# torch._dynamo.utils.counters[COUNTERS]: "fallback_inductor" (compiled without our passes) and
# "fallback_eager" (ran in eager), one per failed compile, next to Dynamo's own counters;
# "gqa_decode": one-token attentions rewritten by passes/gqa_decode.py; "rms_norm_ordered": act-order input
# orders stored by their RMSNorm (passes/rms_norm_ordered.py).
COUNTERS = "quantfuse"


def _fell_back(kind: str, message: str) -> None:
    """A real compile failure: counted and logged at WARNING every time it happens, so that
    a model silently running without fusion (or without Inductor) shows up per compile."""
    from torch._dynamo.utils import counters

    counters[COUNTERS][kind] += 1
    log.warning("%s", message)
    log.debug("quantfuse: the failed compile's traceback", exc_info=True)


def _slot_accepts_list() -> bool:
    """Inductor 2.13+ takes a list of passes per custom slot; earlier versions one pass."""
    from torch._inductor import custom_graph_pass

    return hasattr(custom_graph_pass, "get_custom_graph_passes")


class ChainedGraphPass(CustomGraphPass):
    """Ours, then a pass already configured in the same slot (for one-pass slots)."""

    def __init__(self, first, second):
        self.first, self.second = first, second

    def __call__(self, graph):
        self.first(graph)
        self.second(graph)

    def uuid(self):
        second = self.second.uuid() if hasattr(self.second, "uuid") else None
        # A pass without a uuid already disables Inductor's cache; keep it that way.
        return None if second is None else ("quantfuse-chain", self.first.uuid(), second)


def install_passes(config_patches: dict, passes: dict) -> dict:
    """Config patches that put ``passes`` (slot -> pass) in front of what each slot holds."""
    from torch._inductor import config as inductor_config

    patches = dict(config_patches)
    for slot, our_pass in passes.items():
        existing = patches.get(slot, getattr(inductor_config, slot, None))
        if existing is None:
            patches[slot] = our_pass
        elif isinstance(existing, (list, tuple)):
            patches[slot] = [our_pass, *existing]
        elif _slot_accepts_list():
            patches[slot] = [our_pass, existing]
        else:
            patches[slot] = ChainedGraphPass(our_pass, existing)
    return patches


def _our_option(key: str, value):
    """``value`` of one of OUR_OPTIONS, checked (``families`` normalised to a tuple)."""
    if key in _SWITCHES:
        if not isinstance(value, bool):
            raise ValueError(f"quantfuse: option {key!r} is {value!r}; expected True or False")
        return value
    from compile_backend.passes import FAMILIES

    families = (value,) if isinstance(value, str) else value
    try:
        families = tuple(families)
    except TypeError:
        families = None
    if families is None or not all(isinstance(f, str) for f in families):
        raise ValueError(f"quantfuse: option 'families' is {value!r}; expected family names from {FAMILIES}")
    unknown = [f for f in families if f not in FAMILIES]
    if unknown:
        raise ValueError(f"quantfuse: option 'families' names unknown pattern families {unknown}; "
                         f"the families are {FAMILIES}")
    return families


def _inductor_option(key: str, value, known: dict) -> str:
    """The Inductor config name for ``key``, checked as ``torch.compile(options=...)`` checks
    it for Inductor (dashes read as underscores, the key must exist, plain types must match)."""
    import difflib
    import typing

    from torch._inductor import config as inductor_config

    name = key.replace("-", "_")
    if name not in known:
        close = difflib.get_close_matches(name, [*OUR_OPTIONS, *known], n=3)
        hint = f" (did you mean {' or '.join(repr(c) for c in close)}?)" if close else ""
        raise ValueError(
            f"quantfuse: unknown option {key!r}{hint}. quantfuse's options are {list(OUR_OPTIONS)}; any other key "
            f"must be a torch._inductor.config setting, one of {sorted(known)}")
    expected = inductor_config.get_type(name)
    if typing.get_origin(expected) is None and isinstance(expected, type) and not isinstance(value, expected):
        raise ValueError(f"quantfuse: option {key!r} is {value!r} ({type(value).__name__}); Inductor's "
                         f"{name} takes {expected.__name__}")
    return name


def _split_options(options: dict | None, mode: str | None) -> tuple[dict, dict]:
    """(our options, Inductor config patches); raises ValueError naming an unknown or
    mistyped option, before anything is compiled (a typo must not look like a failed
    compile and run the model without fusion)."""
    ours: dict[str, Any] = dict.fromkeys(_SWITCHES, True)
    inductor: dict[str, Any] = {}
    if mode and mode != "default":
        from torch._inductor import list_mode_options

        inductor.update(list_mode_options(mode))
    known = None
    for key, value in (options or {}).items():
        if key in OUR_OPTIONS:
            ours[key] = _our_option(key, value)
            continue
        if known is None:
            from torch._inductor import config as inductor_config

            known = inductor_config.get_config_copy()
        inductor[_inductor_option(key, value, known)] = value
    return ours, inductor


@contextlib.contextmanager
def _held_as_plain_parameters(gm: torch.fx.GraphModule, example_inputs, config_patches: dict):
    """Under freezing, torch 2.11's Inductor runs the frozen parameters through FakeTensorMode,
    which takes an exact ``nn.Parameter`` but no subclass of it: the quantized modules'
    ``HeldParameter``s are plain ``nn.Parameter``s while the graph compiles (same objects, so
    the frozen constants are the weights themselves), and ``HeldParameter``s again after."""
    from torch._inductor import config

    from compile_backend.derived import HeldParameter

    held = []
    if config_patches.get("freezing", config.freezing):
        seen = set()
        for t in [*example_inputs, *gm.parameters()]:
            if type(t) is HeldParameter and id(t) not in seen:
                seen.add(id(t))
                held.append(t)
    for t in held:
        t.__class__ = torch.nn.Parameter
    try:
        yield
    finally:
        for t in held:
            t.__class__ = HeldParameter


def quantfuse(gm: torch.fx.GraphModule, example_inputs, options: dict | None = None, mode: str | None = None):
    """Dynamo backend entry point."""
    ours, inductor_patches = _split_options(options, mode)
    with _held_as_plain_parameters(gm, example_inputs, inductor_patches):
        return _compile(gm, example_inputs, ours, inductor_patches)


def with_pdl(patches: dict, example_inputs, wanted: bool) -> dict:
    """``patches`` plus Inductor's ``triton.enable_pdl`` where the graph runs as CUDA graphs on sm_90 or
    later (the ``pdl`` option's doc); unchanged where a patch already says, or this torch lacks it."""
    from torch._inductor import config as inductor_config

    from compile_backend.derived import uses_cuda_graphs
    from compile_backend.kernels import pdl

    if (not wanted or "triton.enable_pdl" in patches or not hasattr(inductor_config.triton, "enable_pdl")
            or not uses_cuda_graphs(patches)):
        return patches
    devices = {t.device for t in example_inputs if isinstance(t, torch.Tensor) and t.is_cuda}
    if not devices or not all(pdl.enabled(d) for d in devices):
        return patches
    return {**patches, "triton.enable_pdl": True}


def _compile(gm: torch.fx.GraphModule, example_inputs, ours: dict, inductor_patches: dict):
    from torch._inductor.compile_fx import compile_fx

    if not ours["passes"]:
        return compile_fx(gm, example_inputs, config_patches=inductor_patches)

    from compile_backend.derived import guard_derived_reads, uses_cuda_graphs, watch
    from compile_backend.passes import make_graph_passes

    patches = install_passes(with_pdl(inductor_patches, example_inputs, ours["pdl"]), make_graph_passes(ours))
    # The values our ops derive from this graph's weights go when the weights do.
    watch([*example_inputs, *gm.parameters(), *gm.buffers()])
    try:
        if ours["gqa_decode"]:
            from torch._dynamo.utils import counters

            from compile_backend.passes.gqa_decode import pack_gqa_decode

            rewritten = pack_gqa_decode(gm, on_cuda_graphs=uses_cuda_graphs(patches))
            if rewritten:
                counters[COUNTERS]["gqa_decode"] += rewritten
        if ours["rms_norm_ordered"]:
            from compile_backend.passes.rms_norm_ordered import fuse_rms_norm_ordered

            fuse_rms_norm_ordered(gm, on_cuda_graphs=uses_cuda_graphs(patches))
        compiled = compile_fx(gm, example_inputs, config_patches=patches)
        return guard_derived_reads(compiled) if uses_cuda_graphs(patches) else compiled
    except Exception as exc:
        # Dynamo's restart signals (e.g. TensorifyScalarRestartAnalysis under dynamic=True) are control flow.
        if not ours["fallback"] or isinstance(exc, torch._dynamo.exc.RestartAnalysis):
            raise
        _fell_back("fallback_inductor", f"quantfuse: compiling with the quantfuse passes failed ({exc!r}); "
                                        "falling back to Inductor without them for this graph.")
    try:
        return compile_fx(gm, example_inputs, config_patches=inductor_patches)
    except Exception as exc:
        if isinstance(exc, torch._dynamo.exc.RestartAnalysis):
            raise
        _fell_back("fallback_eager", f"quantfuse: Inductor failed on this graph too ({exc!r}); running it in eager.")
        return gm.forward


# The ``torch_dynamo_backends`` entry point makes the name known without an import.
# Register here only when that entry point has not been seen (e.g. an uninstalled
# checkout): registering twice is an error in dynamo's registry.
if "quantfuse" not in registry._BACKENDS:
    registry.register_backend(quantfuse, name="quantfuse")
