"""passes/gqa_decode.py: a one-token attention over keys and values repeated per query head (HF's
``repeat_kv``) runs on the key/value heads instead, with results equal to eager's; anything else
is left as traced.  ``counters["quantfuse"]["gqa_decode"]`` counts the rewrites."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from pass_helpers import dynamo_graph
from torch._dynamo.utils import counters

pytestmark = pytest.mark.compile

B, HKV, N, L, D = 2, 2, 3, 7, 16


def repeat_kv(x, n):
    b, h, s, d = x.shape
    return x[:, :, None, :, :].expand(b, h, n, s, d).reshape(b, h * n, s, d)


class Attention(torch.nn.Module):
    def __init__(self, **sdpa_kwargs):
        super().__init__()
        self.sdpa_kwargs = sdpa_kwargs

    def forward(self, q, k, v, mask):
        out = F.scaled_dot_product_attention(q, repeat_kv(k, N), repeat_kv(v, N), attn_mask=mask, **self.sdpa_kwargs)
        return out.transpose(1, 2).reshape(q.shape[0], q.shape[2], -1) * 2


def inputs(q_len=1, mask_heads=1, bool_mask=False, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, HKV * N, q_len, D, generator=g)
    k, v = (torch.randn(B, HKV, L, D, generator=g) for _ in range(2))
    if mask_heads is None:
        return q, k, v, None
    mask = torch.randn(B, mask_heads, q_len, L, generator=g)
    mask = mask > -0.5 if bool_mask else mask
    return q, k, v, mask


def run(module, args, **options):
    torch._dynamo.reset()
    counters.clear()
    with torch.no_grad():
        got = torch.compile(module, backend="quantfuse", options=options or None)(*args)
        want = module(*args)
    return got, want, counters["quantfuse"]["gqa_decode"]


@pytest.mark.parametrize("mask_heads,bool_mask", [(1, False), (1, True), (HKV * N, False), (None, False)],
                         ids=["shared-float", "shared-bool", "per-head", "none"])
def test_one_token_attention_is_rewritten_and_equal(mask_heads, bool_mask):
    got, want, rewritten = run(Attention(), inputs(1, mask_heads, bool_mask))
    assert rewritten == 1
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("case", ["two tokens", "causal", "dropout", "option off"])
def test_other_attentions_are_left_as_traced(case):
    module = Attention(**{"causal": {"is_causal": True}, "dropout": {"dropout_p": 0.5}}.get(case, {}))
    args = inputs(2 if case == "two tokens" else 1, None if case == "causal" else 1)
    options = {"gqa_decode": False} if case == "option off" else {}
    if case == "dropout":
        module.train()  # no comparison: dropout draws differ; only that nothing is rewritten
        torch._dynamo.reset()
        counters.clear()
        torch.compile(module, backend="quantfuse")(*args)
        assert counters["quantfuse"]["gqa_decode"] == 0
        return
    got, want, rewritten = run(module, args, **options)
    assert rewritten == 0
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_hf_llama_static_cache_decode_step():
    """transformers' own attention (sdpa, static cache: a mask is always passed, so it repeats the
    keys and values): every layer's decode attention is rewritten, the logits equal eager's."""
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
                                   attn_implementation="sdpa")
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg).eval()

    def decode_step(forward):
        """Prefill 5 tokens eagerly into a fresh static cache, then one decode step by ``forward``."""
        cache = transformers.StaticCache(config=cfg, max_cache_len=16)
        ids = torch.randint(0, 64, (1, 5), generator=torch.Generator().manual_seed(1))
        with torch.no_grad():
            model(ids, past_key_values=cache, cache_position=torch.arange(5), use_cache=True)
            return forward(torch.tensor([[7]]), past_key_values=cache, cache_position=torch.tensor([5])).logits

    want = decode_step(model)
    torch._dynamo.reset()
    counters.clear()
    got = decode_step(torch.compile(model, backend="quantfuse"))
    assert counters["quantfuse"]["gqa_decode"] == cfg.num_hidden_layers
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("dynamic", ["batch and length", "all"])
def test_dynamic_shapes(dynamic):
    """A symbolic batch and cache length (as automatic dynamic shapes make them): rewritten, equal
    to eager at two sizes.  Everything symbolic (``dynamic=True``, head counts too): equal to eager,
    rewritten or not."""
    module = Attention()
    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(module, backend="quantfuse", dynamic=True if dynamic == "all" else None)
    with torch.no_grad():
        for seed, (b, length) in enumerate([(2, 7), (3, 11)]):
            g = torch.Generator().manual_seed(seed)
            q = torch.randn(b, HKV * N, 1, D, generator=g)
            k, v = (torch.randn(b, HKV, length, D, generator=g) for _ in range(2))
            mask = torch.randn(b, 1, 1, length, generator=g)
            if dynamic != "all":
                for t in (q, k, v, mask):
                    torch._dynamo.mark_dynamic(t, 0)
                for t in (k, v):
                    torch._dynamo.mark_dynamic(t, 2)
                torch._dynamo.mark_dynamic(mask, 3)
            torch.testing.assert_close(compiled(q, k, v, mask), module(q, k, v, mask), rtol=1e-5, atol=1e-6)
    if dynamic != "all":
        assert counters["quantfuse"]["gqa_decode"] == 1  # one graph, rewritten once


# quantfuse::gqa_decode, the op the pass uses on CUDA graphs (compile_backend/gqa_decode.py)

from compile_backend.ops import QuantfuseInputError  # noqa: E402
from compile_backend.ops.gqa_decode import gqa_decode  # noqa: E402
from compile_backend.passes import gqa_decode as gqa_pass  # noqa: E402

MASKS = [(1, False), (1, True), (HKV * N, False), (HKV * N, True), (None, False)]
MASK_IDS = ["shared-float", "shared-bool", "per-head-float", "per-head-bool", "none"]


def sdpa_repeated(q, k, v, mask, scale):
    """The attention as transformers writes it: keys and values repeated per query head."""
    return F.scaled_dot_product_attention(q, repeat_kv(k, q.shape[1] // k.shape[1]),
                                          repeat_kv(v, q.shape[1] // k.shape[1]), attn_mask=mask, scale=scale)


@pytest.mark.parametrize("mask_heads,bool_mask", MASKS, ids=MASK_IDS)
def test_op_reference_is_attention_over_repeated_heads(mask_heads, bool_mask):
    q, k, v, mask = inputs(1, mask_heads, bool_mask)
    torch.testing.assert_close(gqa_decode(q, k, v, mask, 0.3), sdpa_repeated(q, k, v, mask, 0.3), rtol=1e-5, atol=1e-6)


def test_op_rejects_bad_arguments():
    q, k, v, mask = inputs(1, 1)
    cases = [
        ("'q' must be 4-D", (q[0], k, v, mask, 0.3)),
        ("'q' must hold one query token", (torch.cat([q, q], 2), k, v, mask, 0.3)),
        ("'k' and 'v' must be", (q, k, v[:, :, :3], mask, 0.3)),
        ("'k' heads", (q, k[:, :1].expand(B, 4, L, D), v[:, :1].expand(B, 4, L, D), mask, 0.3)),
        ("'q', 'k' and 'v' must share one floating dtype", (q, k.double(), v, mask, 0.3)),
        ("'attn_mask' must be", (q, k, v, mask[..., :3], 0.3)),
        ("'attn_mask' must be bool or floating", (q, k, v, mask.long(), 0.3)),
        ("'scale' must be a finite float", (q, k, v, mask, float("nan"))),
    ]
    for message, args in cases:
        with pytest.raises(QuantfuseInputError, match=message):
            gqa_decode(*args)


def test_kernel_refusal_names_what_the_kernels_do_not_take():
    from compile_backend.ops.gqa_decode import kernel_refusal

    def args(dtype=torch.float16, d=64, n=4, mask_dtype=None, transposed=False):
        q = torch.zeros(1, 2 * n, 1, d, dtype=dtype)
        k = torch.zeros(1, 2, 5, d, dtype=dtype)
        if transposed:
            k = torch.zeros(1, 2, d, 5, dtype=dtype).transpose(2, 3)
        mask = None if mask_dtype is None else torch.zeros(1, 1, 1, 5, dtype=mask_dtype)
        return q, k, k, mask

    assert "dtype torch.float32" in kernel_refusal(*args(dtype=torch.float32))
    assert "head size 48" in kernel_refusal(*args(d=48))
    assert "32 query heads per key/value head" in kernel_refusal(*args(n=32))
    assert "not contiguous" in kernel_refusal(*args(transposed=True))
    assert "mask dtype torch.int64" in kernel_refusal(*args(mask_dtype=torch.int64))
    ok = kernel_refusal(*args(mask_dtype=torch.bool))
    assert ok is None or ok == "Triton is not installed"


def _call(gm, args):
    """``gm`` on ``Attention``'s arguments, matched to its placeholders by name (Dynamo orders
    them by first use)."""
    by_name = dict(zip(("q", "k", "v", "mask"), args))
    placeholders = [node.name for node in gm.graph.nodes if node.op == "placeholder"]
    return gm(*(by_name[name.removeprefix("l_").rstrip("_")] for name in placeholders))[0]


def _op_calls(gm):
    return sum(node.target is torch.ops.quantfuse.gqa_decode.default for node in gm.graph.nodes)


@pytest.mark.parametrize("mask_heads,bool_mask", MASKS, ids=MASK_IDS)
def test_pass_writes_the_op_where_it_runs(monkeypatch, mask_heads, bool_mask):
    """Where the op runs (CUDA, CUDA graphs, no gradient: stood in for here), the attention
    becomes one call of it on the unrepeated keys and values; elsewhere it stays
    scaled_dot_product_attention on the key/value heads. Both equal eager."""
    module, args = Attention(), inputs(1, mask_heads, bool_mask)
    with torch.no_grad():
        want = module(*args)
        gm = dynamo_graph(module, *args)
        assert gqa_pass.pack_gqa_decode(gm, on_cuda_graphs=True) == 1
        assert _op_calls(gm) == 0  # a CPU graph
        torch.testing.assert_close(_call(gm, args), want, rtol=1e-5, atol=1e-6)
        monkeypatch.setattr(gqa_pass, "_takes_op", lambda nodes, on_cuda_graphs: on_cuda_graphs)
        gm = dynamo_graph(module, *args)
        assert gqa_pass.pack_gqa_decode(gm, on_cuda_graphs=False) == 1 and _op_calls(gm) == 0
        gm = dynamo_graph(module, *args)
        assert gqa_pass.pack_gqa_decode(gm, on_cuda_graphs=True) == 1 and _op_calls(gm) == 1
        assert not any(node.target in gqa_pass.SDPA for node in gm.graph.nodes)
        torch.testing.assert_close(_call(gm, args), want, rtol=1e-5, atol=1e-6)


def test_op_not_used_where_a_gradient_is_wanted():
    q, k, v, mask = inputs(1, 1)
    gm = dynamo_graph(Attention(), q, k, v, mask)
    for node in gm.graph.nodes:
        if node.op == "placeholder":
            node.meta["example_value"] = node.meta["example_value"].requires_grad_()
    assert not gqa_pass._takes_op([n for n in gm.graph.nodes if n.op == "placeholder"], True)


# On a GPU: the Triton kernels against float64

CUDA = torch.cuda.is_available()
gpu = pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")


def ref64(q, k, v, mask, scale):
    n = q.shape[1] // k.shape[1]
    s = q.double() @ k.double().repeat_interleave(n, 1).transpose(-1, -2) * scale
    if mask is not None:
        s = s + (torch.where(mask, 0.0, float("-inf")).double() if mask.dtype == torch.bool else mask.double())
    return torch.softmax(s, -1) @ v.double().repeat_interleave(n, 1)


def _rel(got, want):
    return ((got.double() - want).norm() / want.norm()).item()


@gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("b,hkv,n,length,d", [(1, 8, 4, 679, 128), (3, 2, 1, 17, 64), (2, 4, 8, 2048, 128),
                                               (1, 8, 4, 1, 128), (1, 1, 16, 300, 256), (1, 2, 5, 70, 32)])
@pytest.mark.parametrize("mask_kind", ["float-min", "float", "bool", "per-head", "none"])
def test_gpu_kernel_matches_float64(dtype, b, hkv, n, length, d, mask_kind):
    """Keys and values are the first ``length`` positions of a longer cache (strided, as a static
    cache's slice would be); the mask hides the positions past ``length * 3 // 4`` as
    transformers' float mask does (the dtype's minimum), or is random."""
    g = torch.Generator(device="cuda").manual_seed(b * 1000 + length)
    q = torch.randn(b, hkv * n, 1, d, device="cuda", dtype=dtype, generator=g)
    cache = torch.randn(2, b, hkv, length + 5, d, device="cuda", dtype=dtype, generator=g)
    k, v = cache[0, :, :, :length], cache[1, :, :, :length]
    mask = None
    if mask_kind == "float-min":
        mask = torch.zeros(b, 1, 1, length, device="cuda", dtype=dtype)
        mask[..., max(1, length * 3 // 4):] = torch.finfo(dtype).min
    elif mask_kind == "float":
        mask = torch.randn(b, 1, 1, length, device="cuda", generator=g)
    elif mask_kind in ("bool", "per-head"):
        mask = torch.rand(b, 1 if mask_kind == "bool" else hkv * n, 1, length, device="cuda", generator=g) < 0.7
        mask[..., 0] = True
    scale = d ** -0.5
    got = gqa_decode(q, k, v, mask, scale)
    want = ref64(q, k, v, mask, scale)
    assert got.dtype == dtype and got.shape == q.shape
    bound = 2e-3 if dtype == torch.float16 else 1.6e-2
    assert _rel(got, want) < bound, _rel(got, want)


@gpu
def test_gpu_reference_runs_where_the_kernel_cannot_and_says_why(caplog):
    g = torch.Generator(device="cuda").manual_seed(3)
    q = torch.randn(1, 8, 1, 48, device="cuda", generator=g)  # float32, head size 48
    k, v = (torch.randn(1, 2, 9, 48, device="cuda", generator=g) for _ in range(2))
    with caplog.at_level("DEBUG", logger="quantfuse.gqa_decode"):
        got = gqa_decode(q, k, v, None, 0.1)
    assert "reference runs: dtype torch.float32" in caplog.text
    assert _rel(got, ref64(q, k, v, None, 0.1)) < 1e-5


@gpu
def test_gpu_reduce_overhead_runs_the_op():
    """Compiled with CUDA graphs, the attention is the op (seen by the profiler in the warm-up
    call), and every replay equals eager."""
    module = Attention()
    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(module, backend="quantfuse", mode="reduce-overhead")
    g = torch.Generator(device="cuda").manual_seed(0)
    with torch.no_grad():
        for i in range(3):
            q = torch.randn(B, HKV * N, 1, D, device="cuda", dtype=torch.float16, generator=g)
            k, v = (torch.randn(B, HKV, L, D, device="cuda", dtype=torch.float16, generator=g) for _ in range(2))
            mask = torch.randn(B, 1, 1, L, device="cuda", dtype=torch.float16, generator=g)
            torch.compiler.cudagraph_mark_step_begin()
            if i == 0:
                with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
                    got = compiled(q, k, v, mask)
                assert any(e.name == "quantfuse::gqa_decode" for e in prof.events())
            else:
                got = compiled(q, k, v, mask)
            torch.testing.assert_close(got, module(q, k, v, mask), rtol=2e-3, atol=2e-3)
    assert counters["quantfuse"]["gqa_decode"] == 1
    torch._dynamo.reset()
