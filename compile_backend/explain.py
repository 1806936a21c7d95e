"""``explain``: which subgraphs quantfuse fuses in a model, and which it leaves and why."""

from __future__ import annotations

import functools
import logging

import torch

log = logging.getLogger("quantfuse")


def explain(model, *example_inputs, dynamic=None, options=None):
    """Compile ``model`` with the quantfuse backend, run it once on ``example_inputs``
    and return the ``FusionReport`` (printable): every fused subgraph, and every
    matmul with quantized-looking inputs that was not fused, with the reason.

    The model runs under the caller's grad mode (``torch.no_grad()`` or not), as the
    caller's own compile would.  Inductor's caches are bypassed so that the passes
    really run.
    """
    from compile_backend.passes import collecting_report

    from .backend import quantfuse

    opts = {"fx_graph_cache": False, "fallback": False, **(options or {})}
    backend = functools.partial(quantfuse, options=opts)
    with collecting_report() as report, torch._functorch.config.patch(enable_autograd_cache=False):
        compiled = torch.compile(model, backend=backend, dynamic=dynamic)
        # Under the caller's grad mode: with an input or parameter that requires grad, Inductor
        # compiles a joint forward + backward graph, and the report says what that compile fuses.
        compiled(*example_inputs)
    log.info("%s", report)
    return report
