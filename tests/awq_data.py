"""Random AWQ test data for the GPU tests (test_cuda_awq_gemm*.py): packed weights with
zeros and scales at their extremes, and activations with a few values near the top of
fp16's range; never all zeros."""

from __future__ import annotations

import torch

from compile_backend.quantize import awq_pack

DEV = "cuda"


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
