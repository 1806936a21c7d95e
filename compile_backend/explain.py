"""``explain``: which subgraphs quantfuse fuses in a model, and which it leaves and why.

``explain`` compiles the model the way the caller's ``torch.compile(model,
backend="quantfuse")`` would, and must leave nothing behind that changes that
compile.  Dynamo keeps what it compiles on the code object of each frame it
compiled, guarded per backend, with a limit of ``recompile_limit`` (8) entries
per code object; entries made by ``explain`` on the model's own ``forward``
would count against the caller's compile (from the 9th call on, Dynamo gives up
and runs the model eagerly, unfused).  So:

* ``explain`` compiles a function of its own — a fresh code object per call,
  which calls the model — so that Dynamo inlines the model into a frame nobody
  else runs, and everything compiled for it goes away with it;
* under a graph break Dynamo also compiles the model's frames themselves; that
  compile runs in a recompile region of its own (``isolate_recompiles``, where
  torch has it), so those entries never count against the caller's compile,
  and they are removed afterwards (``_drop_entries``);
* the per-code-object shape state Dynamo keeps for automatic dynamic shapes is
  forgotten for the fresh code object.
"""

from __future__ import annotations

import functools
import inspect
import itertools
import logging
import types
import warnings

import torch

log = logging.getLogger("quantfuse")

_calls = itertools.count()


def _model_caller():
    """A function that calls its first argument with the rest, with a code object of its own."""

    def call(model, *args):
        return model(*args)

    code = call.__code__.replace(co_name=f"quantfuse_explain_{next(_calls)}")
    return types.FunctionType(code, call.__globals__, code.co_name)


def _supports_isolate_recompiles() -> bool:
    return "isolate_recompiles" in inspect.signature(torch.compile).parameters


def _drop_entries(backend) -> None:
    """Remove the Dynamo cache entries compiled with ``backend`` (frames compiled after graph breaks).

    A code object holding nothing else (or only entries already dead) is reset, which
    removes its entries; one that also holds someone else's live entries keeps ours as
    invalidated entries of ``explain``'s own recompile region: they hold no code or
    guards and never match, and that region is nobody's recompile limit.
    """
    from torch._dynamo import convert_frame
    from torch._dynamo.eval_frame import _debug_get_cache_entry_list, reset_code
    from torch._dynamo.guards import DeletedGuardManagerWrapper

    def ours(entry) -> bool:
        return getattr(entry.backend, "compiler_fn", entry.backend) is backend

    for ref in list(convert_frame.input_codes.seen):
        code = ref()
        if code is None:
            continue
        entries = _debug_get_cache_entry_list(code)
        if not any(ours(e) for e in entries):
            continue
        if all(ours(e) or isinstance(e.guard_manager, DeletedGuardManagerWrapper) for e in entries):
            reset_code(code)
            continue
        for entry in entries:
            extra_state = getattr(entry.guard_manager, "extra_state", None)
            if ours(entry) and extra_state is not None:
                extra_state.invalidate(entry, DeletedGuardManagerWrapper("compiled by quantfuse.explain"))


def _compiled_elsewhere(model) -> bool:
    """Whether Dynamo holds compiled entries for the model's own forward."""
    from torch._dynamo.eval_frame import _debug_get_cache_entry_list

    forward = getattr(type(model), "forward", None)
    code = getattr(forward, "__code__", None)
    return code is not None and bool(_debug_get_cache_entry_list(code))


def _forget_shape_state(code: types.CodeType) -> None:
    from torch._dynamo import pgo

    state = pgo.get_code_state()
    state.pop(pgo.CodeId.make(code), None)


def explain(model, *example_inputs, dynamic=None, options=None):
    """Compile ``model`` with the quantfuse backend, run it once on ``example_inputs``
    and return the ``FusionReport`` (printable): every fused subgraph, and every
    matmul with quantized-looking inputs that was not fused, with the reason.

    The model runs under the caller's grad mode (``torch.no_grad()`` or not), as the
    caller's own compile would.  Inductor's caches are bypassed so that the passes
    really run.  Calls are independent of each other and of the caller's own
    compiles of ``model`` (see the module docstring).
    """
    from compile_backend.passes import collecting_report

    from .backend import quantfuse

    if not _supports_isolate_recompiles() and _compiled_elsewhere(model):
        # Without recompile regions, Dynamo serves the frames a graph break resumes in from the
        # caller's own compile of the model: this report would miss what those frames fuse.
        warnings.warn("quantfuse.explain: this torch has no isolate_recompiles and the model was already "
                      "compiled; subgraphs after a graph break may be missing from the report "
                      "(call explain before compiling the model, or torch._dynamo.reset() first)",
                      RuntimeWarning, stacklevel=2)
    opts = {"fx_graph_cache": False, "fallback": False, **(options or {})}
    backend = functools.partial(quantfuse, options=opts)
    caller = _model_caller()
    isolate = {"isolate_recompiles": True} if _supports_isolate_recompiles() else {}
    try:
        with collecting_report() as report, torch._functorch.config.patch(enable_autograd_cache=False):
            compiled = torch.compile(caller, backend=backend, dynamic=dynamic, **isolate)
            # Under the caller's grad mode: with an input or parameter that requires grad, Inductor
            # compiles a joint forward + backward graph, and the report says what that compile fuses.
            compiled(model, *example_inputs)
    finally:
        _drop_entries(backend)
        _forget_shape_state(caller.__code__)
    report.notes += _awq_provenance(model)
    log.info("%s", report)
    return report


def _awq_provenance(model) -> list[str]:
    """How ``quantize_model`` made the model's AWQ weights: round-to-nearest is not activation-aware."""
    from collections import Counter

    from .quantize import AWQLinear

    made = Counter(m.made_by for m in model.modules() if isinstance(m, AWQLinear) and m.made_by)
    notes = []
    if made.get("round-to-nearest"):
        notes.append(f"awq: {made['round-to-nearest']} layer(s) quantized round-to-nearest by quantize_model "
                     "(no calibration data: not activation-aware; quantize_model(..., calibration=...) runs the "
                     "AWQ search)")
    for how, n in made.items():
        if how != "round-to-nearest":
            notes.append(f"awq: {n} layer(s) quantized by {how}")
    return notes
