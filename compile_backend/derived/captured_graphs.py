"""Weights changed under CUDA graphs: refuse to replay a graph whose derived values are stale.

A graph compiled with ``mode="reduce-overhead"`` is captured once and then replayed with no host
code of ours running.  What it reads of values derived from weights (column sums, repacked
layouts, concatenated weights: docs/DESIGN.md, "Values derived from weights") is fixed at
capture, so a weight changed in place afterwards would go unseen and the replay would compute
with the old one.  Plain Inductor has no such values: its graphs read the weights themselves.

So each such compiled graph runs between ``quantfuse::_derived_graph_enter(id)`` and
``_derived_graph_exit()`` (csrc/common/derived_cache.cpp): the cache records, under the graph's
id, the sources and versions of every value it serves while the graph is captured, and the next
call raises, naming the weight, once any of them has changed or been freed.
"""

from __future__ import annotations

import itertools
import weakref

import torch

from ..kernels import loader as kernels

_graph_ids = itertools.count(1)


def _forget(graph: int) -> None:
    if kernels._state["status"] == "loaded":
        torch.ops.quantfuse._derived_graph_forget(graph)


def uses_cuda_graphs(config_patches: dict) -> bool:
    """Whether Inductor compiles with these patches into CUDA graphs (``mode="reduce-overhead"``
    sets the option; a user may also have set it globally)."""
    from torch._inductor import config

    return bool(config_patches.get("triton.cudagraphs", config.triton.cudagraphs))


def guard_derived_reads(compiled):
    """``compiled`` (a compiled graph that may run as a CUDA graph), checking before every call
    that no weight it read derived values of during capture has changed since."""
    graph = next(_graph_ids)
    state = kernels._state  # read per call: a dict lookup, the cheapest test that the ops exist

    def run(*args):
        # Until the kernels are loaded nothing is cached, so nothing can be captured stale.
        if state["status"] != "loaded":
            return compiled(*args)
        ops = torch.ops.quantfuse
        ops._derived_graph_enter(graph)
        try:
            return compiled(*args)
        finally:
            ops._derived_graph_exit()

    # Not at interpreter exit: the graph's record goes with the process anyway.
    weakref.finalize(run, _forget, graph).atexit = False
    return run
