"""The ``quantfuse`` op library: how every family's op is defined, what they share.

Each family module (``scaled_mm``, ``awq_gemm``, ...) defines its op with ``define_op``: the
schema, the reference implementation (plain torch, any device: the eager fallback), the fake
(meta) implementation, the autograd formula, and the private ``_<name>_reference`` op through
which the C++ dispatch (csrc/*/*_dispatch.cpp) runs the reference with the reason no kernel
takes an input.  Malformed input raises ``QuantfuseInputError`` naming the argument (``fail``);
unsupported-but-valid input never raises.

The CUDA implementations of the public ops are registered in C++ by the kernels' library.  Until
it is loaded, a Python CUDA implementation stands in for each (``add_cuda_bootstrap``): the
first call loads (or builds) the kernels, after which the C++ implementation serves this and
every later call; if they cannot be loaded, the reference runs.
"""

from __future__ import annotations

import logging
import re

import torch

from ..kernels import loader as kernels

log = logging.getLogger("quantfuse.ops")

NAMESPACE = "quantfuse"

# What the fused GEMMs return (and W8A16 takes as activations).
OUT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)

lib = torch.library.Library(NAMESPACE, "DEF")
# The ops defined with an autograd formula (csrc/common/autograd_cuda.cpp serves each on CUDA).
WITH_AUTOGRAD: list[str] = []


class QuantfuseInputError(ValueError):
    """A quantfuse op was called with malformed arguments."""


def describe(t: torch.Tensor) -> str:
    return f"shape {tuple(t.shape)}, dtype {t.dtype}"


def fail(op: str, arg: str, t, expected: str):
    got = describe(t) if isinstance(t, torch.Tensor) else repr(t)
    raise QuantfuseInputError(f"quantfuse.{op}: argument '{arg}' has {got}; expected {expected}")


def check_devices(op: str, first: str, tensors: dict) -> None:
    """Every tensor in ``tensors`` (name -> tensor or None) on the device of ``tensors[first]``.

    Strict on purpose, 1-element scales included: torch accepts a 0-dim CPU scalar
    next to CUDA operands in element-wise ops, but a kernel handed a host pointer
    (or a fake/meta implementation handed a mix) reads or returns garbage, and a
    silent copy per call would hide a host-to-device transfer in every step.
    """
    device = tensors[first].device
    for name, t in tensors.items():
        if t is not None and t.device != device:
            raise QuantfuseInputError(
                f"quantfuse.{op}: argument '{name}' has {describe(t)}, device {t.device}; expected "
                f"device {device} (the device of '{first}'): all tensor arguments must be on one device")


# --------------------------------------------------------------------------- definition


def reference_schema(schema: str) -> str:
    """The schema of ``_<name>_reference`` for an op's schema: the same arguments without their
    defaults, then ``str reason`` (what the C++ dispatch calls when no kernel takes an input)."""
    name, rest = schema.split("(", 1)
    args, returns = rest.split(")", 1)  # no argument type holds a parenthesis
    args = re.sub(r"=[^,]*", "", args)
    return f"_{name.strip()}_reference({args}, str reason){returns}"


def logged_reference(name, reference):
    """``reference`` as the implementation of ``quantfuse::_<name>_reference``: it takes the op's
    arguments and the reason the C++ dispatch gives, logs the reason and runs the reference."""

    def impl(*args):
        *args, reason = args
        log.debug("quantfuse.%s: reference runs: %s", name, reason)
        return reference(*args)

    impl.__name__ = f"_{name}_reference"
    return impl


# What Inductor may hand an op, by the strides its kernels read (``define_op``'s ``strides``):
# "fixed"  the stride order of the graph's values (the GEMMs' kernels read fixed layouts);
# "exact"  exactly the strides tracing saw (torch's default for custom ops);
# "any"    whatever layout its inputs already have, views included (the kernels take strides as
#          arguments and check the rest themselves): no copy to match a layout the graph's metadata names.
LAYOUT_TAGS = {"fixed": (torch.Tag.needs_fixed_stride_order,), "exact": (), "any": (torch.Tag.flexible_layout,)}


def define_op(schema: str, reference, fake, *, autograd=None, cuda_fallback=None, kernel_dispatch: bool = True,
              strides: str = "fixed"):
    """Defines ``quantfuse::<name>`` from its schema and returns the op.

    ``autograd``: ``(backward, setup_context)`` for ``torch.library.register_autograd``.
    ``kernel_dispatch``: the kernels' library registers the CUDA implementation (which calls
    ``_<name>_reference`` with a reason where no kernel takes an input); until it is loaded, the
    bootstrap stands in, running ``cuda_fallback`` (default: the reference) if it cannot load.
    ``strides``: which layouts Inductor may hand the op (``LAYOUT_TAGS``).
    """
    name = schema.split("(", 1)[0].strip()
    if strides not in LAYOUT_TAGS:
        raise ValueError(f"define_op: 'strides' must be one of {sorted(LAYOUT_TAGS)}, got {strides!r}")
    lib.define(schema, tags=LAYOUT_TAGS[strides])
    lib.impl(name, reference, "CompositeExplicitAutograd")
    torch.library.register_fake(f"{NAMESPACE}::{name}", fake, lib=lib)
    if autograd is not None:
        backward, setup_context = autograd
        torch.library.register_autograd(f"{NAMESPACE}::{name}", backward, setup_context=setup_context, lib=lib)
        WITH_AUTOGRAD.append(name)
    if kernel_dispatch:
        lib.define(reference_schema(schema))
        lib.impl(f"_{name}_reference", logged_reference(name, reference), "CompositeExplicitAutograd")
        add_cuda_bootstrap(name, cuda_fallback or reference)
    return getattr(torch.ops.quantfuse, name)


# --------------------------------------------------------------------------- first-call loading


def _cuda_bootstrap(name):
    """The CUDA implementation until the kernels are loaded: the first call loads (or builds)
    them, after which the C++ implementation serves this and every later call; if they
    cannot be loaded, the fallback runs."""
    fallback = _BOOTSTRAPPED[name]

    def impl(*args, **kwargs):
        # Loading replaces this implementation with the library's C++ one (kernels.on_load below).
        if kernels.ensure_loaded():
            return getattr(torch.ops.quantfuse, name)(*args, **kwargs)
        log.debug("quantfuse.%s: reference runs: the CUDA kernels are not available", name)
        return fallback(*args, **kwargs)

    impl.__name__ = f"{name}_cuda_bootstrap"
    return impl


_bootstrap_lib: torch.library.Library | None = None
# Op name -> the implementation that runs on CUDA when the kernels cannot be loaded.
_BOOTSTRAPPED: dict = {}


def _install_bootstrap() -> None:
    global _bootstrap_lib
    if _bootstrap_lib is not None:
        return
    _bootstrap_lib = torch.library.Library(NAMESPACE, "IMPL", "CUDA")
    for name in _BOOTSTRAPPED:
        _bootstrap_lib.impl(name, _cuda_bootstrap(name))


def add_cuda_bootstrap(name: str, fallback) -> None:
    """Gives the quantfuse op ``name``, whose CUDA implementation lives in the kernels' library,
    the first-call loading, with ``fallback`` when they can't load."""
    _BOOTSTRAPPED[name] = fallback
    if _bootstrap_lib is not None:
        _bootstrap_lib.impl(name, _cuda_bootstrap(name))


def _remove_bootstrap() -> None:
    global _bootstrap_lib
    if _bootstrap_lib is not None:
        _bootstrap_lib._destroy()
        _bootstrap_lib = None


# Looked up at call time, so that a replaced function (tests) is the one that runs.
kernels.on_load(lambda: _remove_bootstrap(), lambda: _install_bootstrap())
_install_bootstrap()
