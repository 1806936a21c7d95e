"""GPU tests of the L2 hint for the next linear's weights (csrc/common/next_weights.*,
csrc/common/l2_prefetch.*): the decode launches of quantfuse.scaled_mm / awq_gemm learn which
weights follow which on a stream and ask the L2 for them once their own are streamed.  The hint
changes no result; a prefill launch ends the chain; a hint is never given for freed weights; a
CUDA graph compiled under the backend keeps the weights it hints alive.

Skipped without CUDA.
"""

from __future__ import annotations

import gc

import pytest
import torch
from awq_data import check_close, make_awq, make_x, op_exact, reference64
from conftest import DEV, check_w8a8, rand_q, w8a8_reference64

from compile_backend.quantize import quantize_model

pytestmark = pytest.mark.gpu

ops = torch.ops.quantfuse


@pytest.fixture(autouse=True)
def _hints_on(cuda_kernels):
    previous = ops._next_weights_enable(True)
    yield
    ops._next_weights_enable(previous)


def w8a8_weight(N, K):
    """(b, scale_b): an int8 [N, K] weight as the op reads it (its transpose), per-channel scales."""
    return rand_q((N, K)).t(), (torch.rand(N, device=DEV) + 0.5) * 1e-2


def decode(w, M=1):
    b, sb = w
    a = rand_q((M, b.shape[0]))
    sa = (torch.rand(M, device=DEV) + 0.5) * 1e-2
    return a, sa, ops.scaled_mm(a, b, sa, sb, torch.float16)


def test_decode_launches_learn_their_successor():
    ws = [w8a8_weight(256, 512) for _ in range(3)]
    for w in ws + ws[:1]:
        decode(w)
    for i, (b, _) in enumerate(ws):
        assert ops._next_weights_peek(b) == ws[(i + 1) % 3][0].data_ptr(), i


def test_prefill_launch_ends_the_chain():
    wa, wb, wc = (w8a8_weight(256, 512) for _ in range(3))
    decode(wa)
    decode(wb, M=64)  # not a decode launch: nobody's successor, and the chain ends
    decode(wc)
    assert ops._next_weights_peek(wa[0]) == 0
    assert ops._next_weights_peek(wb[0]) == 0
    decode(wa)
    assert ops._next_weights_peek(wc[0]) == wa[0].data_ptr()


@pytest.mark.parametrize("hints", (False, True))
def test_w8a8_results_do_not_depend_on_the_hint(hints):
    ops._next_weights_enable(hints)
    ws = [w8a8_weight(N, K) for N, K in ((4096, 4096), (1024, 4096), (4096, 1024))]
    for _ in range(2):  # the second round runs with every successor known
        for b, sb in ws:
            a, sa, out = decode((b, sb), M=3)
            check_w8a8(out, w8a8_reference64(a, b, sa, sb), torch.float16, what=f"hints={hints}")


def test_awq_results_with_hints():
    gen = torch.Generator(device=DEV).manual_seed(5)
    layers = [make_awq(K, N, 128, torch.float16, gen) for K, N in ((1024, 2048), (2048, 1024), (1024, 1024))]
    for step in range(3):
        for i, (qw, s, qz, G, q, z) in enumerate(layers):
            x = make_x(2, qw.shape[0], torch.float16, gen)
            out = ops.awq_gemm(x, qw, s, qz, G)
            ref, mag = reference64(x, q, z, s, G, exact=op_exact(2, s.shape[1]))
            check_close(out, ref, mag, torch.float16, f"step {step} layer {i}")


def test_freed_successor_gets_no_hint():
    wa = w8a8_weight(512, 512)
    wb = w8a8_weight(8192, 512)
    decode(wa)
    decode(wb)
    assert ops._next_weights_peek(wa[0]) == wb[0].data_ptr()
    del wb
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()  # the freed weight's memory goes back to the driver
    a, sa, out = decode(wa)
    torch.cuda.synchronize()  # a prefetch of unmapped memory would fault here
    check_w8a8(out, w8a8_reference64(a, wa[0], sa, wa[1]), torch.float16, what="after the successor was freed")


def test_private_op_prefetch_argument():
    gen = torch.Generator(device=DEV).manual_seed(7)
    qw, s, qz, G, q, z = make_awq(1024, 1024, 128, torch.float16, gen)
    wp = ops._awq_repack_cuda(qw)
    other = torch.empty(3 << 20, dtype=torch.uint8, device=DEV)
    x = make_x(1, 1024, torch.float16, gen)
    ref, mag = reference64(x, q, z, s, G, exact=op_exact(1, 1024))
    for nbytes in (-1, 0, 4096, 100):
        out = ops._awq_gemm_cuda(x, wp, s, qz, G, None, 0, 0, True, other, nbytes)
        check_close(out, ref, mag, torch.float16, f"prefetch_bytes={nbytes}")
    with pytest.raises(RuntimeError, match="'prefetch' must be on cuda"):
        ops._awq_gemm_cuda(x, wp, s, qz, G, None, 0, 0, True, other.cpu(), -1)
    with pytest.raises(RuntimeError, match="'prefetch_bytes' must be -1"):
        ops._awq_gemm_cuda(x, wp, s, qz, G, None, 0, 0, True, other, -2)


@pytest.mark.parametrize("scheme", ("int8", "awq"))
def test_captured_graph_with_hints(scheme):
    """A model compiled with mode="reduce-overhead": its graph replays the hints it was captured
    with, and keeps what they point to alive."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(*(torch.nn.Linear(512, 512, bias=False) for _ in range(4))).to(DEV, torch.float16)
    quantize_model(model, scheme)
    x = torch.randn(1, 512, device=DEV, dtype=torch.float16)
    with torch.no_grad():
        expected = model(x)
        compiled = torch.compile(model, backend="quantfuse", mode="reduce-overhead")
        for _ in range(4):
            out = compiled(x).clone()
            torch.testing.assert_close(out, expected, rtol=2e-2, atol=2e-2)
    torch._dynamo.reset()
