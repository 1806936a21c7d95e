"""Programmatic dependent launch (PDL, sm_90+): whether kernels launch with it.

A kernel launched with programmatic stream serialization may start while the kernel before it on
the stream finishes; it waits (``griddepcontrol.wait``) before it reads what that one wrote.  The
decode kernels in ``csrc/`` (``common/pdl.h`` decides there, from the same variable) and, under CUDA
graphs, Inductor's own Triton kernels (the backend's ``pdl`` option) launch with it where the GPU has
it; the decode attention's Triton kernels launch without it (with it, the decode step measured 2-3%
slower: benchmarks/RESULTS.md, "Programmatic dependent launch").  ``QUANTFUSE_PDL=0`` turns all of it
off; it is read at each launch and compile, so that one process may compare both.  ``QUANTFUSE_PDL_PREFETCH``
(``csrc/common/pdl.h``) is a measurement knob for what the decode kernels do before they wait: nothing
(unset or ``0``, the default), ``regs`` (the AWQ kernel loads its first weights into registers) or
``l2`` (the kernels ask their weights into L2).  Neither measured faster, and ``regs`` reads weights
while the kernel before may still run: wrong where that kernel writes them.
"""

from __future__ import annotations

import os

import torch

ENV = "QUANTFUSE_PDL"


def allowed_by_env() -> bool:
    """False where ``QUANTFUSE_PDL=0``; raises ValueError naming the variable on another value."""
    value = os.environ.get(ENV, "").strip()
    if value not in ("", "0", "1"):
        raise ValueError(f"{ENV}={value!r}; expected '0' (off) or '1' (on where the GPU has it, the default)")
    return value != "0"


def supported(device: torch.device) -> bool:
    """Whether ``device`` is a GPU with PDL (sm_90 or later)."""
    return device.type == "cuda" and torch.cuda.get_device_capability(device)[0] >= 9


def enabled(device: torch.device) -> bool:
    """Whether kernels launch with PDL on ``device``."""
    return allowed_by_env() and supported(device)
