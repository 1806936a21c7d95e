"""passes/gqa_decode.py: a one-token attention over keys and values repeated per query head (HF's
``repeat_kv``) runs on the key/value heads instead, with results equal to eager's; anything else
is left as traced.  ``counters["quantfuse"]["gqa_decode"]`` counts the rewrites."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
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
