"""AWQ test data and float64 references for the GPU tests (test_cuda_awq_gemm*.py,
test_cuda_dispatch.py): packed weights with zeros and scales at their extremes, activations
with a few values near the top of fp16's range (never all zeros), and the error bounds of
the kernels behind quantfuse.awq_gemm."""

from __future__ import annotations

import torch
from conftest import AWQ_DECODE_MAX_M, DEV

from compile_backend.ops import awq_unpack
from compile_backend.quantize import awq_pack


def make_awq(K, N, group, dtype, gen):
    """(qweight, scales, qzeros, group size, q, z); group -1 = per-channel (group = K).
    Zeros include 0 and 15, scales span ~1.6 decades."""
    G = K if group == -1 else group
    q = torch.randint(0, 16, (K, N), generator=gen, device=DEV, dtype=torch.int32)
    z = torch.randint(0, 16, (K // G, N), generator=gen, device=DEV, dtype=torch.int32)
    z[0, : min(N, 8)] = 0
    z[-1, -min(N, 8):] = 15
    s = torch.rand((K // G, N), generator=gen, device=DEV, dtype=torch.float32) * 2e-3 + 1e-4
    s[0, ::7] = 1e-4  # small extreme
    s[-1, 3::11] = 4e-3  # large extreme
    s = s.to(dtype)
    return awq_pack(q), s, awq_pack(z), G, q, z


def make_x(M, K, dtype, gen):
    x = torch.randn((M, K), generator=gen, device=DEV, dtype=torch.float32) * 100
    # a few activations near the top of fp16's range
    idx = torch.randint(0, M * K, (max(1, M * K // 4096),), generator=gen, device=DEV)
    x.view(-1)[idx] = 30000.0 * torch.sign(torch.randn(idx.shape, generator=gen, device=DEV))
    return x.to(dtype)


def unpacked(qweight, qzeros):
    """(q, z): the 4-bit values of packed AWQ tensors, as int32 [K, N] and [K/G, N]."""
    return awq_unpack(qweight), awq_unpack(qzeros)


def reference64(x, q, z, s, G, bias=None, exact=False):
    """float64 of x @ W and the per-element error scale.  W = (q - z) * s rounded once to the
    activation dtype (the op's reference, the SM90 kernel, dequantize + cuBLAS, and the
    streaming kernel's scaled path), or unrounded with ``exact`` (the streaming kernel's fold
    path, which applies zeros and scales to fp32 accumulators: see folds())."""
    zz = z.repeat_interleave(G, dim=0)
    ss = s.repeat_interleave(G, dim=0)
    if exact:
        w = (q - zz).to(torch.float64) * ss.to(torch.float64)
    else:
        w = ((q - zz).to(s.dtype) * ss).to(torch.float64)
    x64 = x.to(torch.float64)
    ref = x64 @ w
    mag = x64.abs() @ w.abs()
    if bias is not None:
        ref = ref + bias.to(torch.float64)
        mag = mag + bias.to(torch.float64).abs()
    return ref, mag


def folds(M, N, warps=0):
    """Whether the streaming kernel takes its fold path at this shape (the C++ dispatch says)."""
    return torch.ops.quantfuse._awq_gemm_folds(M, N, torch.cuda.current_device(), warps)


def op_exact(M, N):
    """Whether quantfuse.awq_gemm computes with the unrounded W at this shape: M up to
    AWQ_DECODE_MAX_M runs the streaming kernel (N a multiple of 64), and so does its fold path."""
    return M <= AWQ_DECODE_MAX_M and N % 64 == 0 and folds(M, N)


def check_close(out, ref, mag, dtype, what):
    assert out.shape == ref.shape, what
    M = out.shape[0]
    o = out.to(torch.float64)
    assert torch.isfinite(o).all(), f"{what}: non-finite (unwritten or overflow) outputs"
    eps = 2.0**-10 if dtype == torch.float16 else 2.0**-7
    # one rounding of the output + fp32 accumulation; above AWQ_DECODE_MAX_M the dequantize +
    # cuBLAS path may reduce split-K partials in the activation dtype (torch's default allows
    # it) and the SM90 kernel rounds q*s and q*s - z*s separately (test_cuda_awq_gemm_sm90.py
    # has that kernel's derived bound)
    acc = 1e-4 if M <= AWQ_DECODE_MAX_M else eps / 2
    bound = eps * ref.abs() + acc * mag + 1e-6
    err = (o - ref).abs()
    bad = err > bound
    assert not bad.any(), (
        f"{what}: {int(bad.sum())} elements out of bounds; worst err {err.max().item():.3g} "
        f"at {divmod(int(err.argmax()), ref.shape[1])}"
    )
    rel = (torch.linalg.norm(o - ref) / torch.linalg.norm(ref)).item()
    assert rel < (2e-3 if dtype == torch.float16 else 8e-3), f"{what}: relative error {rel:.3g}"


def check_op(out, x, qweight, scales, qzeros, G, bias=None, what="", exact=None):
    """``out`` of quantfuse.awq_gemm(x, qweight, scales, qzeros, G, bias) against the float64
    reference of the packed tensors' values, with the bound of the path the op takes (``exact``
    None), or of a computation with W rounded to the activation dtype (False: the op's reference)."""
    q, z = unpacked(qweight, qzeros)
    if exact is None:
        exact = op_exact(x.shape[0], q.shape[1])
    ref, mag = reference64(x, q, z, scales, G, bias, exact=exact)
    check_close(out, ref, mag, x.dtype, what)


def check_sm90(out, x, q, z, s, G, bias, what):
    """``out`` of the SM90 prefill kernel against the float64 reference, with the bound of its
    math: q*s and q*s - z*s rounded separately to the activation dtype, fp32 accumulation."""
    dtype = x.dtype
    u = 2.0**-11 if dtype == torch.float16 else 2.0**-8
    K = x.shape[1]
    assert out.shape == (x.shape[0], q.shape[1]) and out.dtype == dtype, what
    assert out.is_contiguous(), what
    o = out.to(torch.float64)
    assert torch.isfinite(o).all(), f"{what}: NaN/inf in the output"
    zz = z.repeat_interleave(G, dim=0).to(torch.float64)
    ss = s.repeat_interleave(G, dim=0).to(torch.float64)
    qq = q.to(torch.float64)
    w = (qq - zz) * ss
    e = u * (zz * ss.abs() + qq * ss.abs() + w.abs()) * (1 + u)
    x64 = x.to(torch.float64)
    ref = x64 @ w
    if bias is not None:
        ref = ref + bias.to(torch.float64)
    hard = u * ref.abs() + x64.abs() @ e + K * 2.0**-23 * (x64.abs() @ w.abs()) + 1e-6
    err = (o - ref).abs()
    bad = err > hard
    assert not bad.any(), (
        f"{what}: {int(bad.sum())} elements over the bound; worst err {err.max().item():.3g} "
        f"at {divmod(int(err.argmax()), ref.shape[1])}")
    expected = u * torch.linalg.norm(ref) + torch.linalg.norm(torch.sqrt((x64 * x64) @ (e * e)))
    actual = torch.linalg.norm(o - ref)
    assert actual <= expected, (f"{what}: ||err|| = {actual.item():.4g} > {expected.item():.4g} "
                                f"(rel {(actual / torch.linalg.norm(ref)).item():.3g})")
