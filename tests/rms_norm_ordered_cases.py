"""The Triton kernel of ``quantfuse::rms_norm_ordered`` without a GPU: ``interpret()`` runs it through
Triton's interpreter (with ``TRITON_INTERPRET=1``; tests/test_rms_norm_ordered.py runs it in a
subprocess) against the references, ``compile_for_hopper()`` compiles it for sm_90.  CI runs both in
the environment that compiles csrc/; no pytest here: that environment lacks it."""

from __future__ import annotations

import torch

from compile_backend.ops.rms_norm_ordered import add_reference, reference

SHAPES = ((1, 1, 4096), (3, 1, 96), (2, 3, 1000))


def interpret() -> None:
    """The kernel against the references, with and without the residual: the sum bit for bit, the
    normalized values within one rounding step of the dtype (the sum of squares in another order);
    prints ok."""
    from compile_backend.ops.rms_norm_ordered_triton import rms_norm_ordered_triton

    for shape in SHAPES:
        g = torch.Generator().manual_seed(shape[-1])
        x, r = (torch.randn(*shape, generator=g).half() for _ in range(2))
        w = (1 + 0.1 * torch.randn(shape[-1], generator=g)).half()
        order = torch.randperm(shape[-1], generator=g)
        out, s = rms_norm_ordered_triton(x, r, w, 1e-5, order)
        want, want_s = add_reference(x, r, w, 1e-5, order)
        step = torch.finfo(torch.float16).eps * want.abs().float().clamp_min(1.0)
        assert torch.equal(s, want_s), shape
        assert ((out.float() - want.float()).abs() <= step).all(), shape
        plain, none = rms_norm_ordered_triton(x, None, w, 1e-5, order.int())
        want = reference(x, w, 1e-5, order)
        assert none is None
        assert ((plain.float() - want.float()).abs() <= torch.finfo(torch.float16).eps
                * want.abs().float().clamp_min(1.0)).all(), shape
    print("ok")


def compile_for_hopper() -> None:
    """The kernel compiled for sm_90 (PTX and cubin, by Triton's own ptxas) in float16 and bfloat16,
    with and without the residual, int32 and int64 orders.  Needs no GPU; prints ok."""
    import itertools

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from compile_backend.ops import rms_norm_ordered_triton as kernels

    fn = kernels._rms_norm_ordered
    names = fn.arg_names
    for dtype, residual, order in itertools.product(("fp16", "bf16"), (False, True), ("*i32", "*i64")):
        constexprs = dict(HAS_RESIDUAL=residual, BLOCK=kernels.BLOCK, RBLOCK=kernels.RBLOCK)
        types = dict(x_ptr=f"*{dtype}", r_ptr=f"*{dtype}", w_ptr=f"*{dtype}", order_ptr=order, out_ptr=f"*{dtype}",
                     sum_ptr=f"*{dtype}", eps="fp32")
        signature = {n: "constexpr" if n in constexprs else types.get(n, "i32") for n in names}
        triton.compile(ASTSource(fn=fn, signature=signature,
                                 constexprs={(names.index(k),): v for k, v in constexprs.items()}),
                       target=GPUTarget("cuda", 90, 32), options=dict(num_warps=kernels.NUM_WARPS))
    print("ok")
