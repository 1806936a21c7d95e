"""The custom graph pass that carries quantfuse's patterns into Inductor.

Families register their search/replace pairs into one ``PatternMatcherPass``
per Inductor slot they need (``SLOTS``); ``make_graph_passes`` wraps each in a
``CustomGraphPass`` whose ``uuid()`` hashes the pass sources (and the op
definitions they insert), so Inductor's FX graph cache is invalidated whenever
a pattern changes.

Slots: ``joint_custom_pre_pass`` is where every family matches first: it runs
before ``freezing`` constant-folds weight dequant chains into dense weights,
and before Inductor's own joint/post-grad rewrites (``view_to_reshape``,
``mm + add → addmm``, pointless-convert removal), and for inference graphs
Inductor runs it on the forward graph as well.  Under grad mode it sees
AOTAutograd's joint forward + backward graph: the families fuse its forward
and leave the backward as traced (``fx_helpers``, "joint graphs").
``post_grad_custom_pre_pass``
holds the same patterns as a second chance for graphs the joint passes did not
see; it sees ``aten.reshape`` where the joint graph has ``aten.view``, which
every pattern accepts.  A slot no family uses gets no pass.  The first of our
passes that runs on a graph reports its unfused candidates (``candidates``).
"""

from __future__ import annotations

import functools
import importlib
from pathlib import Path

import torch
from torch._inductor.custom_graph_pass import CustomGraphPass, get_hash_for_files
from torch._inductor.pattern_matcher import PatternMatcherPass

# Families in matching order: the more specific forms first.
FAMILIES = ("scaled_mm_azp", "scaled_mm", "awq_gemm", "w8a16_gemm")
# Inductor config slots our passes may occupy, in the order Inductor runs them.
SLOTS = ("joint_custom_pre_pass", "post_grad_custom_pre_pass")


_PASS_DIR = Path(__file__).resolve().parent


def _source_files() -> tuple[str, ...]:
    # The passes and the ops they insert (their schemas and fakes shape the graphs they make).
    files = sorted(str(p) for p in _PASS_DIR.glob("*.py"))
    ops_dir = Path(importlib.import_module("compile_backend.ops").__file__).resolve().parent
    files += sorted(str(p) for p in ops_dir.glob("*.py"))
    return tuple(files)


@functools.cache
def patterns_for(families: tuple[str, ...]) -> dict[str, PatternMatcherPass]:
    """Trace and register the patterns of ``families`` (once per process)."""
    import compile_backend.ops  # noqa: F401  (the replacement ops must exist)

    passes = {slot: PatternMatcherPass(pass_name=f"quantfuse_{slot}") for slot in SLOTS}
    for family in families:
        if family not in FAMILIES:
            raise ValueError(f"quantfuse: unknown pattern family {family!r}; expected some of {FAMILIES}")
        importlib.import_module(f"{__name__.rsplit('.', 1)[0]}.{family}").register(passes)
    return passes


class QuantfuseGraphPass(CustomGraphPass):
    """Applies the registered patterns of one slot to a graph, to a fixed point.

    The pass of the first slot that runs on a graph also reports the unfused
    candidates left in it (``candidates.report_unfused``): the joint slot when
    Inductor runs joint passes (it sees the weight chains before ``freezing``
    folds them), else the post-grad slot.  It marks the graph module so that a
    later slot does not report the same matmuls again.

    ``horizontal``: then merge fused ops of one family that read the same
    activation into one op over concatenated weights (``horizontal``).
    """

    def __init__(self, slot: str, families: tuple[str, ...], horizontal: bool = True):
        self.slot, self.families, self.horizontal = slot, families, horizontal

    def __call__(self, graph: torch.fx.Graph) -> None:
        patterns = patterns_for(self.families)[self.slot]
        while patterns.apply(graph):
            pass
        graph.eliminate_dead_code()
        if self.horizontal:
            from .horizontal import merge_shared_input

            merge_shared_input(graph)
        owner = graph.owning_module
        meta = owner.meta if owner is not None else {}
        if not meta.get(_REPORTED):
            from .candidates import report_unfused

            report_unfused(graph)
            meta[_REPORTED] = True

    def uuid(self):
        return (self.slot, self.families, self.horizontal, get_hash_for_files(_source_files()).hex())


_REPORTED = "quantfuse_candidates_reported"


def make_graph_passes(options: dict | None = None) -> dict[str, CustomGraphPass]:
    """Inductor slot name -> our pass for it, for the families ``options['families']`` names,
    merging ops that share an input unless ``options['horizontal']`` is False.

    Only slots that hold patterns of those families get a pass (the joint slot
    always does: it reports the unfused candidates).
    """
    options = options or {}
    families = tuple(options.get("families", FAMILIES))
    registered = patterns_for(families)
    horizontal = options.get("horizontal", True)
    return {slot: QuantfuseGraphPass(slot, families, horizontal) for slot in SLOTS
            if registered[slot].patterns or slot == SLOTS[0]}
