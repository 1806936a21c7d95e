"""The ``quantfuse`` torch.compile backend: Inductor with quantfuse's passes installed.

``torch.compile(model, backend="quantfuse", options={...})`` runs Inductor's
``compile_fx`` with our pattern passes placed in Inductor's custom-pass slots
through ``config_patches`` (per compile; global Inductor config is never
changed).  Options:

``passes`` (bool, default True)
    Install the quantfuse passes.  False gives plain Inductor.
``families`` (sequence of str, default all)
    Pattern families to enable: ``scaled_mm``, ``scaled_mm_azp``, ``awq_gemm``.
``fallback`` (bool, default True)
    If compiling with our passes fails, warn once and compile with plain
    Inductor; if that fails too, run the graph in eager.  False re-raises.
any other key
    Passed to Inductor as a config patch (e.g. ``"max_autotune": True``,
    ``"freezing": True``), like ``torch.compile(options=...)`` for Inductor.

``mode`` works as for Inductor ("reduce-overhead" turns on CUDA graphs,
"max-autotune" max-autotune).
"""

from __future__ import annotations

import logging
import warnings
from typing import Any

import torch
from torch._dynamo.backends import registry
from torch._inductor.custom_graph_pass import CustomGraphPass

log = logging.getLogger("compile_backend")

OUR_OPTIONS = ("passes", "families", "fallback")
_warned: set[str] = set()


def _warn_once(key: str, message: str) -> None:
    if key not in _warned:
        _warned.add(key)
        warnings.warn(message, RuntimeWarning, stacklevel=3)


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


def _split_options(options: dict | None, mode: str | None) -> tuple[dict, dict]:
    ours = {"passes": True, "fallback": True}
    inductor: dict[str, Any] = {}
    if mode and mode != "default":
        from torch._inductor import list_mode_options

        inductor.update(list_mode_options(mode))
    for key, value in (options or {}).items():
        (ours if key in OUR_OPTIONS else inductor)[key] = value
    return ours, inductor


def quantfuse(gm: torch.fx.GraphModule, example_inputs, options: dict | None = None, mode: str | None = None):
    """Dynamo backend entry point."""
    from torch._inductor.compile_fx import compile_fx

    ours, inductor_patches = _split_options(options, mode)
    if not ours["passes"]:
        return compile_fx(gm, example_inputs, config_patches=inductor_patches)

    from compile_backend.passes import make_graph_passes

    patches = install_passes(inductor_patches, make_graph_passes(ours))
    try:
        return compile_fx(gm, example_inputs, config_patches=patches)
    except Exception as exc:
        # Dynamo's restart signals (e.g. TensorifyScalarRestartAnalysis under dynamic=True) are control flow.
        if not ours["fallback"] or isinstance(exc, torch._dynamo.exc.RestartAnalysis):
            raise
        log.debug("quantfuse: compile with passes failed", exc_info=True)
        _warn_once("passes", f"quantfuse: compiling with the quantfuse passes failed ({exc!r}); "
                             "falling back to Inductor without them.")
    try:
        return compile_fx(gm, example_inputs, config_patches=inductor_patches)
    except Exception as exc:
        if isinstance(exc, torch._dynamo.exc.RestartAnalysis):
            raise
        log.debug("quantfuse: plain Inductor compile failed", exc_info=True)
        _warn_once("inductor", f"quantfuse: Inductor failed on this graph too ({exc!r}); running it in eager.")
        return gm.forward


# The ``torch_dynamo_backends`` entry point makes the name known without an import.
# Register here only when that entry point has not been seen (e.g. an uninstalled
# checkout): registering twice is an error in dynamo's registry.
if "quantfuse" not in registry._BACKENDS:
    registry.register_backend(quantfuse, name="quantfuse")
