"""``quantfuse::gqa_decode_rope`` (compile_backend/ops/gqa_decode.py): the decode step's attention from
the projections' outputs, with transformers' rotary embedding and the static cache's write.

CPU: the reference is transformers' ``apply_rotary_pos_emb``, the cache's ``index_copy_`` and the
attention over repeated heads; the caches are written at the position and nowhere else; bad arguments
raise naming the argument; the schema, fake and mutation annotations agree (``opcheck``).  The Triton
kernels run on a CPU through Triton's interpreter where Triton is installed (a subprocess with
``TRITON_INTERPRET=1``; the interpreter has no bfloat16 arithmetic, so float16 only).  GPU: the kernels
against float64, the caches written bit for bit as the reference writes them.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from conftest import assert_interpreted_ok, needs_triton
from gqa_decode_cases import make, out_order

from compile_backend.ops import QuantfuseInputError
from compile_backend.ops.gqa_decode import advance_reference, rope, rope_reference

gqa_decode_rope = torch.ops.quantfuse.gqa_decode_rope
gqa_decode = torch.ops.quantfuse.gqa_decode
gqa_decode_rope_advance = torch.ops.quantfuse.gqa_decode_rope_advance


def transformers_step(q, k, v, k_cache, v_cache, position, cos, sin, mask, scale):
    """What transformers' Llama attention does in a static-cache decode step (float64 here)."""
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb, repeat_kv

    d64 = [t.double() for t in (q, k, v, k_cache, v_cache, cos, sin)]
    q, k, v, k_cache, v_cache, cos, sin = d64
    q, k = apply_rotary_pos_emb(q, k, cos.squeeze(1), sin.squeeze(1))  # it unsqueezes the head dimension
    k_cache.index_copy_(2, position.long(), k)
    v_cache.index_copy_(2, position.long(), v)
    n = q.shape[1] // k_cache.shape[1]
    if mask is not None and mask.dtype != torch.bool:
        mask = mask.double()
    out = F.scaled_dot_product_attention(q, repeat_kv(k_cache, n), repeat_kv(v_cache, n), attn_mask=mask, scale=scale)
    return out, k_cache, v_cache


@pytest.mark.parametrize("mask_kind", ["float", "bool", "none"])
@pytest.mark.parametrize("pos", [0, 17, 39])
@pytest.mark.parametrize("shared_rope", [False, True], ids=["cos-per-row", "cos-shared"])
def test_reference_is_transformers_decode_step(mask_kind, pos, shared_rope):
    args = make(pos=pos, mask_kind=mask_kind, shared_rope=shared_rope)
    want, want_k, want_v = transformers_step(*args)
    got = rope_reference(*args)
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(args[3].double(), want_k, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(args[4].double(), want_v, rtol=0, atol=0)


def test_caches_written_at_the_position_only():
    args = make(pos=5)
    k_before, v_before = args[3].clone(), args[4].clone()
    gqa_decode_rope(*args)
    others = [i for i in range(args[3].shape[2]) if i != 5]
    assert torch.equal(args[3][:, :, others], k_before[:, :, others])
    assert torch.equal(args[4][:, :, others], v_before[:, :, others])
    assert torch.equal(args[3][:, :, 5:6], rope(args[1], args[6], args[7]))
    assert torch.equal(args[4][:, :, 5:6], args[2])


def test_rope_rounds_once():
    """float16: computed in float32, rounded to float16 once (not after each of its four operations)."""
    x = torch.randn(4, 1, 1, 64).half()
    angle = torch.rand(4, 1, 1, 32) * 6
    cos, sin = (torch.cat([f(angle)] * 2, -1).half() for f in (torch.cos, torch.sin))
    half = torch.cat((-x.float()[..., 32:], x.float()[..., :32]), -1)
    assert torch.equal(rope(x, cos, sin), (x.float() * cos.float() + half * sin.float()).half())


@pytest.mark.parametrize(("change", "match"), [
    (lambda a: {1: a[1][:, :, :, :-1]}, "'k' must be the new token's"),
    (lambda a: {2: a[2].half()}, "'v' must be torch.float32"),
    (lambda a: {5: torch.tensor([1, 2])}, "'position' must be one int32 or int64 element"),
    (lambda a: {5: torch.tensor([1.0])}, "'position' must be one int32 or int64 element"),
    (lambda a: {6: a[6].squeeze(1)}, "'cos' must be floating"),
    (lambda a: {7: a[7].int()}, "'sin' must be floating"),
    (lambda a: {3: a[3][:, :1]}, "'k_cache' and 'v_cache' must be"),
    (lambda a: {0: a[0][..., :63], 3: a[3][..., :63], 4: a[4][..., :63], 1: a[1][..., :63], 2: a[2][..., :63],
                6: a[6][..., :63], 7: a[7][..., :63]}, "head size must be even"),
])
def test_bad_arguments_are_named(change, match):
    args = list(make())
    for i, t in change(args).items():
        args[i] = t
    with pytest.raises(QuantfuseInputError, match=match):
        gqa_decode_rope(*args)


def test_opcheck():
    """Schema (the caches mutated), fake and dispatch agree."""
    torch.library.opcheck(gqa_decode_rope, make(), test_utils=("test_schema", "test_faketensor"))


@pytest.mark.parametrize("name", ["gqa_decode", "gqa_decode_rope", "gqa_decode_rope_advance"])
def test_cuda_kernel_takes_the_call_without_its_defaults(name):
    """The dispatcher hands a Python kernel only the arguments its caller gave: the CUDA implementation of
    each op accepts a call that leaves out every argument with a default (here ``out_order``)."""
    import functools
    import inspect

    import compile_backend.ops.gqa_decode as mod

    kernel = {"gqa_decode": mod._cuda, "gqa_decode_rope": functools.partial(mod._rope_cuda, advance=False),
              "gqa_decode_rope_advance": functools.partial(mod._rope_cuda, advance=True)}[name]
    schema = getattr(torch.ops.quantfuse, name).default._schema
    required = [a.name for a in schema.arguments if not a.has_default_value()]
    assert len(required) < len(schema.arguments)
    inspect.signature(kernel).bind(*required)


# --------------------------------------------------------------------------- the pass


def _stand_in_for_cuda_graphs(monkeypatch):
    """The op is written where the graph runs on CUDA as a CUDA graph; on a CPU, say that it does."""
    import compile_backend.passes.gqa_decode as gqa_pass

    monkeypatch.setattr(gqa_pass, "_takes_op", lambda nodes, on_cuda_graphs: True)


def _decode_steps(model, forward, cfg):
    """Prefill 5 tokens eagerly into a fresh static cache, then two decode steps by ``forward``:
    their logits and the caches (and each layer's position counter, where the cache keeps one) after them."""
    import transformers

    cache = transformers.StaticCache(config=cfg, max_cache_len=16)
    ids = torch.randint(0, cfg.vocab_size, (2, 5), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        model(ids, past_key_values=cache, cache_position=torch.arange(5), use_cache=True)
        logits = [forward(torch.tensor([[7], [3]]), past_key_values=cache, cache_position=torch.tensor([5])).logits,
                  forward(torch.tensor([[9], [1]]), past_key_values=cache, cache_position=torch.tensor([6])).logits]
    counted = [layer.cumulative_length.clone() for layer in cache.layers
               if isinstance(getattr(layer, "cumulative_length", None), torch.Tensor)]
    return logits, [t.clone() for layer in cache.layers for t in (layer.keys, layer.values)] + counted


# Which decoders' attention is transformers' apply_rotary_pos_emb on the whole head (fused) and which
# rotate part of it (Phi3: rotary_ndims, a slice and a concatenation: the attention alone becomes the op).
ARCHS = {"Llama": True, "Qwen2": True, "Qwen3": True, "Gemma": True, "Phi3": False}


@pytest.mark.compile
@pytest.mark.parametrize("arch", list(ARCHS))
def test_pass_fuses_transformers_decode_step(monkeypatch, arch):
    """transformers' decode step with a static cache, compiled where the op runs: each layer's rotary,
    cache writes and attention become one ``gqa_decode_rope``; logits and caches equal eager's."""
    from test_e2e_hf import tiny_causal_lm
    from torch._dynamo.utils import counters

    _stand_in_for_cuda_graphs(monkeypatch)
    model = tiny_causal_lm(arch=arch)
    cfg = model.config
    want_logits, want_caches = _decode_steps(model, model, cfg)
    torch._dynamo.reset()
    counters.clear()
    got_logits, got_caches = _decode_steps(model, torch.compile(model, backend="quantfuse"), cfg)
    layers = cfg.num_hidden_layers
    assert counters["quantfuse"]["gqa_decode"] == layers
    assert counters["quantfuse"]["gqa_decode_rope"] == (layers if ARCHS[arch] else 0), dict(counters["quantfuse"])
    # transformers' per-layer position counter (transformers 5's static cache): read and advanced by the op
    # (its caches' writes land at the next step's position only if it advanced)
    keeps_counters = len(want_caches) == 3 * layers
    assert counters["quantfuse"]["gqa_decode_rope_counter"] == (layers if ARCHS[arch] and keeps_counters else 0)
    for got, want in zip(got_logits, want_logits):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
    for got, want in zip(got_caches, want_caches):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


@pytest.mark.compile
def test_op_reads_the_projections_output_in_place(monkeypatch):
    """With q, k and v projected by one GEMM (the horizontal pass), the op is handed views of that GEMM's
    output: no copy of q, k or v to the strides their unfused projections had (at batch > 1 those differ,
    and each copy would be a kernel launch per layer)."""
    import re

    from test_e2e_hf import tiny_causal_lm
    from torch._dynamo.utils import counters
    from torch._inductor.utils import run_and_get_code

    from compile_backend import quantize_model

    _stand_in_for_cuda_graphs(monkeypatch)
    model = quantize_model(tiny_causal_lm(arch="Llama"), "int8")
    want_logits, want_caches = _decode_steps(model, model, model.config)
    torch._dynamo.reset()
    counters.clear()
    (got_logits, got_caches), codes = run_and_get_code(_decode_steps, model, torch.compile(model, backend="quantfuse"),
                                                       model.config)
    calls = [line for code in codes for line in code.splitlines()
             if re.search(r"gqa_decode_rope(_advance)?\.default\(", line)]
    assert len(calls) == model.config.num_hidden_layers == counters["quantfuse"]["gqa_decode_rope"], calls
    view = r"reinterpret_tensor\({}, \([^)]*\), \([^)]*\), \d+\)"  # (buffer, sizes, strides, offset)
    same_buffer = re.compile(r"gqa_decode_rope(_advance)?\.default\(" + ", ".join(
        [view.format(r"(buf\d+)"), view.format(r"\2"), view.format(r"\2")]))
    for call in calls:
        assert same_buffer.search(call), call
    for got, want in zip([*got_logits, *got_caches], [*want_logits, *want_caches]):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


def _rotate_half(x):
    return torch.cat((-x[..., x.shape[-1] // 2:], x[..., :x.shape[-1] // 2]), dim=-1)


class _Cached(torch.nn.Module):
    """A variant (``variant`` changes one thing) and seeded key/value caches [2, 2, 16, 32]."""

    def __init__(self, variant: str):
        super().__init__()
        self.variant = variant
        self.gen = torch.Generator().manual_seed(0)
        self.register_buffer("k_cache", torch.randn(2, 2, 16, 32, generator=self.gen))
        self.register_buffer("v_cache", torch.randn(2, 2, 16, 32, generator=self.gen))


class CachedAttention(_Cached):
    """transformers' decode attention, written out."""

    def __init__(self, variant="as transformers"):
        super().__init__(variant)
        self.register_buffer("counter", torch.tensor(9))

    def forward(self, q, k, v, cos, sin, position, mask):
        def rope(x, c, s):
            return x * c + _rotate_half(x) * s

        if self.variant.startswith("counter"):  # transformers' StaticLayer: its own position counter
            position = torch.arange(1) + self.counter
            self.counter.add_(1)

        q = rope(q, cos, sin)
        if self.variant == "rotation reversed":
            k = k * cos + torch.cat((k[..., 16:], -k[..., :16]), dim=-1) * sin
        elif self.variant == "k's own cos":
            k = rope(k, cos * 1.0, sin)
        else:
            k = rope(k, cos, sin)
        self.k_cache.index_copy_(2, position, k)
        self.v_cache.index_copy_(2, position, v)
        n = q.shape[1] // 2
        keys = self.k_cache[:, :, None, :, :].expand(2, 2, n, 16, 32).reshape(2, 2 * n, 16, 32)
        values = self.v_cache[:, :, None, :, :].expand(2, 2, n, 16, 32).reshape(2, 2 * n, 16, 32)
        out = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask)
        if self.variant == "cache read elsewhere":
            return out, self.k_cache.sum()
        if self.variant == "counter read after":
            return out, self.counter * 2
        return out


def _cached_attention_inputs():
    """``CachedAttention``'s (q, k, v, cos, sin, position, mask): position 9, which the mask attends."""
    g = torch.Generator().manual_seed(2)
    angle = torch.rand(2, 1, 1, 16, generator=g) * 6
    mask = torch.rand(2, 1, 1, 16, generator=g) < 0.8
    mask[..., 9] = True
    return (torch.randn(2, 6, 1, 32, generator=g), torch.randn(2, 2, 1, 32, generator=g),
            torch.randn(2, 2, 1, 32, generator=g), torch.cat([angle.cos()] * 2, -1), torch.cat([angle.sin()] * 2, -1),
            torch.tensor([9]), mask)


@pytest.mark.compile
def test_a_position_given_to_the_model_is_not_mutated(monkeypatch):
    """Where the position is an input of the graph (a model called with ``cache_position``, as transformers 4
    writes its cache), the op is the one that only reads it: no input mutation, which would make CUDA graph
    trees skip the graph."""
    from torch._dynamo.utils import counters
    from torch._inductor.utils import run_and_get_code

    _stand_in_for_cuda_graphs(monkeypatch)
    args = _cached_attention_inputs()
    torch._dynamo.reset()
    counters.clear()
    with torch.no_grad():
        _, codes = run_and_get_code(torch.compile(CachedAttention(), backend="quantfuse"), *args)
    assert counters["quantfuse"]["gqa_decode_rope"] == 1 and counters["quantfuse"]["gqa_decode_rope_counter"] == 0
    assert any("gqa_decode_rope.default(" in code for code in codes)
    assert not any("gqa_decode_rope_advance" in code for code in codes)
    assert torch.ops.quantfuse.gqa_decode_rope.default._schema.arguments[5].alias_info is None  # position: read


@pytest.mark.compile
@pytest.mark.parametrize(("variant", "fused", "counted"), [
    ("as transformers", True, False), ("rotation reversed", False, False), ("k's own cos", False, False),
    ("cache read elsewhere", False, False), ("counter", True, True), ("counter read after", True, False)])
def test_pass_fuses_only_that_form(monkeypatch, variant, fused, counted):
    """Only the form above is fused; anything else keeps the rotary and the writes, the attention
    alone becomes the op; a position counter goes into the op only where nothing reads it after its
    increment; every result, cache and counter equals eager's."""
    from torch._dynamo.utils import counters

    _stand_in_for_cuda_graphs(monkeypatch)
    args = _cached_attention_inputs()
    eager, compiled = CachedAttention(variant), CachedAttention(variant)
    torch._dynamo.reset()
    counters.clear()
    with torch.no_grad():
        want = eager(*args)
        got = torch.compile(compiled, backend="quantfuse")(*args)
    assert counters["quantfuse"]["gqa_decode"] == 1
    assert counters["quantfuse"]["gqa_decode_rope"] == int(fused)
    assert counters["quantfuse"]["gqa_decode_rope_counter"] == int(counted)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert compiled.counter.item() == eager.counter.item()
    torch.testing.assert_close(compiled.k_cache, eager.k_cache, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(compiled.v_cache, eager.v_cache, rtol=0, atol=0)


# --------------------------------------------------------------------------- the output order (act-order o_proj)


@pytest.mark.parametrize("rotary", [False, True], ids=["gqa_decode", "gqa_decode_rope"])
def test_out_order_stores_each_value_at_its_place(rotary):
    """``out_order``: each batch row's H*D values (heads, then head dimensions) stored at
    ``out_order``'s places, the values themselves those of the op without it."""
    args = make(mask_kind="bool")
    q = args[0]
    order = out_order(q)
    if rotary:
        plain = gqa_decode_rope(*[t.clone() if isinstance(t, torch.Tensor) else t for t in args])
        got = gqa_decode_rope(*args, order)
    else:
        plain = gqa_decode(q, args[3], args[4], args[8], args[9])
        got = gqa_decode(q, args[3], args[4], args[8], args[9], order)
    B = q.shape[0]
    assert got.shape == plain.shape
    assert torch.equal(got.reshape(B, -1)[:, order], plain.reshape(B, -1))


@pytest.mark.parametrize("order", [torch.arange(10), torch.arange(2 * 3 * 64).float(), torch.arange(2 * 3 * 64)[None]])
def test_bad_out_order_is_named(order):
    args = make()
    with pytest.raises(QuantfuseInputError, match="'out_order' must be an int32 or int64 permutation of H\\*D = 384"):
        gqa_decode_rope(*args, order)
    with pytest.raises(QuantfuseInputError, match="quantfuse.gqa_decode: 'out_order'"):
        gqa_decode(args[0], args[3], args[4], args[8], args[9], order)


def test_advance_reads_the_counter_then_advances_it():
    """``gqa_decode_rope_advance``: ``gqa_decode_rope`` at the counter's position, then the counter + 1; the
    plain op leaves its position as it was."""
    args = make(pos=11)
    clones = [t.clone() if isinstance(t, torch.Tensor) else t for t in args]
    want = gqa_decode_rope(*clones)
    got = gqa_decode_rope_advance(*args)
    assert torch.equal(got, want) and torch.equal(args[3], clones[3]) and torch.equal(args[4], clones[4])
    assert args[5].tolist() == [12] and clones[5].tolist() == [11]
    bad = list(args)
    bad[5] = torch.tensor([1.0])
    with pytest.raises(QuantfuseInputError, match="quantfuse.gqa_decode_rope_advance: 'counter' must be one int32"):
        gqa_decode_rope_advance(*bad)


def test_opcheck_with_out_order_and_advance():
    args = make()
    torch.library.opcheck(gqa_decode_rope, (*args, out_order(args[0])), test_utils=("test_schema", "test_faketensor"))
    torch.library.opcheck(gqa_decode_rope_advance, make(), test_utils=("test_schema", "test_faketensor"))
    torch.library.opcheck(gqa_decode, (args[0], args[3], args[4], args[8], args[9], out_order(args[0])),
                          test_utils=("test_schema", "test_faketensor"))


def _act_order_o_proj(model):
    """Each layer's ``o_proj`` as a GPTQ act-order checkpoint loads it (``AWQLinear`` with ``perm``)."""
    from compile_backend.quantize.modules import AWQLinear

    for i, layer in enumerate(model.model.layers):
        o = layer.self_attn.o_proj
        state = {k: v for k, v in o.state_dict().items() if v is not None}
        perm = torch.randperm(o.in_features, generator=torch.Generator().manual_seed(i))
        rebuilt = AWQLinear.from_state_dict({**state, "perm": perm}, group_size=o.group_size)
        rebuilt.out_dtype = o.out_dtype
        layer.self_attn.o_proj = rebuilt
    return model


@pytest.mark.compile
def test_pass_stores_o_projs_input_order(monkeypatch):
    """transformers' decode step with act-order ``o_proj`` layers: each layer's attention stores its result
    in ``o_proj``'s input order (no scatter left before ``o_proj``); logits and caches equal eager's, and
    bit for bit those of the same compile with the scatter left in the graph."""
    from test_e2e_hf import tiny_causal_lm
    from torch._dynamo.utils import counters

    import compile_backend.passes.gqa_decode as gqa_pass
    from compile_backend import quantize_model

    _stand_in_for_cuda_graphs(monkeypatch)
    model = _act_order_o_proj(quantize_model(tiny_causal_lm(arch="Llama", dtype=torch.float16), "awq-g32"))
    cfg = model.config
    want_logits, want_caches = _decode_steps(model, model, cfg)
    results = {}
    for fold in (True, False):
        if not fold:
            monkeypatch.setattr(gqa_pass, "_fold_output_order", lambda graph, op: False)
        torch._dynamo.reset()
        counters.clear()
        results[fold] = _decode_steps(model, torch.compile(model, backend="quantfuse"), cfg)
        assert counters["quantfuse"]["gqa_decode_out_order"] == (cfg.num_hidden_layers if fold else 0)
    got_logits, got_caches = results[True]
    for got, want in zip([*got_logits, *got_caches], [*want_logits, *want_caches]):
        torch.testing.assert_close(got, want, rtol=2e-2, atol=2e-2)
    for got, unfolded in zip([*got_logits, *got_caches], [*results[False][0], *results[False][1]]):
        assert torch.equal(got, unfolded)


class OrderedAttention(_Cached):
    """A one-token attention over repeated keys/values whose result an act-order layer puts in its order
    (``AWQLinear``'s scatter)."""

    def __init__(self, variant="as AWQLinear"):
        super().__init__(variant)
        self.register_buffer("inverse", torch.randperm(4 * 32, generator=self.gen))

    def forward(self, q, mask):
        keys = self.k_cache[:, :, None, :, :].expand(2, 2, 2, 16, 32).reshape(2, 4, 16, 32)
        values = self.v_cache[:, :, None, :, :].expand(2, 2, 2, 16, 32).reshape(2, 4, 16, 32)
        out = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask)
        if self.variant == "dims before heads":
            x = out.transpose(1, 3).reshape(2, 1, -1).contiguous()
        else:
            x = out.transpose(1, 2).contiguous().reshape(2, 1, -1).contiguous()
        inverse = self.inverse + 0 if self.variant == "order computed" else self.inverse
        placed = torch.empty_like(x).index_copy_(-1, inverse, x)
        if self.variant == "result read elsewhere":
            return placed, x.sum()
        return placed


@pytest.mark.compile
@pytest.mark.parametrize(("variant", "folded"), [("as AWQLinear", True), ("dims before heads", False),
                                                 ("order computed", False), ("result read elsewhere", False)])
def test_pass_stores_the_order_only_in_that_form(monkeypatch, variant, folded):
    from torch._dynamo.utils import counters

    _stand_in_for_cuda_graphs(monkeypatch)
    g = torch.Generator().manual_seed(4)
    q, mask = torch.randn(2, 4, 1, 32, generator=g), torch.rand(2, 1, 1, 16, generator=g) < 0.8
    torch._dynamo.reset()
    counters.clear()
    with torch.no_grad():
        want = OrderedAttention(variant)(q, mask)
        got = torch.compile(OrderedAttention(variant), backend="quantfuse")(q, mask)
    assert counters["quantfuse"]["gqa_decode"] == 1
    assert counters["quantfuse"]["gqa_decode_out_order"] == int(folded)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


# --------------------------------------------------------------------------- the kernels, interpreted on a CPU

@needs_triton
def test_kernels_in_the_triton_interpreter():
    """The split kernel with the rotary and the cache write, run by Triton's interpreter: outputs within
    float16's rounding of the reference's, the caches written bit for bit as the reference writes them."""
    assert_interpreted_ok("gqa_decode_cases", timeout=900)


# --------------------------------------------------------------------------- GPU

gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("case", [dict(b=1, hkv=8, n=4, length=679, d=128), dict(b=3, hkv=2, n=1, length=17, d=64),
                                  dict(b=2, hkv=4, n=8, length=2048, d=128), dict(b=1, hkv=1, n=16, length=300, d=256)])
@pytest.mark.parametrize("where", ["first", "middle", "last"])
def test_gpu_kernels_match_float64(dtype, case, where):
    length = case["length"]
    pos = {"first": 0, "middle": length // 2, "last": length - 1}[where]
    args = make(pos=pos, dtype=dtype, device="cuda", **case)
    ref_args = [t.clone() if isinstance(t, torch.Tensor) else t for t in args]
    got = gqa_decode_rope(*args)
    want, _, _ = transformers_step(*ref_args)
    rope_reference(*ref_args)  # the caches as the reference writes them
    assert torch.equal(args[3], ref_args[3]) and torch.equal(args[4], ref_args[4])
    rel = ((got.double() - want).norm() / want.norm()).item()
    assert rel < (2e-3 if dtype == torch.float16 else 1.6e-2), rel


@gpu
@pytest.mark.gpu
def test_gpu_in_a_cuda_graph():
    """Captured once, replayed at successive positions (the position a device tensor the graph reads)."""
    args = list(make(b=1, hkv=8, n=4, length=256, d=128, pos=10, dtype=torch.float16, device="cuda"))
    ref_args = [t.clone() if isinstance(t, torch.Tensor) else t for t in args]
    gqa_decode_rope(*[t.clone() if isinstance(t, torch.Tensor) else t for t in args])  # warm-up (compiles)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = gqa_decode_rope(*args)
    for pos in (10, 11, 12):
        args[5].fill_(pos)
        ref_args[5].fill_(pos)
        graph.replay()
        want = rope_reference(*ref_args)
        assert torch.equal(args[3], ref_args[3]) and torch.equal(args[4], ref_args[4]), pos
        torch.testing.assert_close(out, want, rtol=2e-3, atol=2e-3)


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_gpu_out_order_stores_the_same_values(dtype):
    """With ``out_order`` the kernels store the values they store without it, each at its place, also
    replayed in a CUDA graph."""
    args = make(b=2, hkv=8, n=4, length=300, d=128, pos=40, dtype=dtype, device="cuda")
    order = out_order(args[0])
    plain = gqa_decode(args[0], args[3], args[4], args[8], args[9])
    got = gqa_decode(args[0], args[3], args[4], args[8], args[9], order)
    assert torch.equal(got.reshape(2, -1)[:, order], plain.reshape(2, -1))
    clones = [t.clone() if isinstance(t, torch.Tensor) else t for t in args]
    want = gqa_decode_rope(*clones)
    gqa_decode_rope(*[t.clone() if isinstance(t, torch.Tensor) else t for t in args], order)  # warm-up
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = gqa_decode_rope(*args, order)
    graph.replay()
    assert torch.equal(out.reshape(2, -1)[:, order], want.reshape(2, -1))
    assert torch.equal(args[3], clones[3]) and torch.equal(args[4], clones[4])


@gpu
@pytest.mark.gpu
def test_gpu_advance_in_a_cuda_graph():
    """``gqa_decode_rope_advance`` captured once: each replay writes and attends at the counter's position and
    then advances it, as the reference does step by step."""
    args = list(make(b=1, hkv=8, n=4, length=256, d=128, pos=10, dtype=torch.float16, device="cuda"))
    ref_args = [t.clone() if isinstance(t, torch.Tensor) else t for t in args]
    gqa_decode_rope_advance(*[t.clone() if isinstance(t, torch.Tensor) else t for t in args])  # warm-up
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = gqa_decode_rope_advance(*args)
    for pos in (10, 11, 12):
        graph.replay()
        want = advance_reference(*ref_args)
        assert args[5].item() == ref_args[5].item() == pos + 1
        assert torch.equal(args[3], ref_args[3]) and torch.equal(args[4], ref_args[4]), pos
        torch.testing.assert_close(out, want, rtol=2e-3, atol=2e-3)
