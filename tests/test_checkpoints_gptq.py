"""``compile_backend.from_pretrained`` on GPTQ checkpoints (``checkpoints/gptq.py``), CPU.

The checkpoints are written here from known random integers packed into the GPTQ layout
(the format is under test, not the GPTQ algorithm): per linear ``qweight`` int32 ``[K/8, N]`` (eight
4-bit values along K per word, lowest nibble first), ``qzeros`` int32 ``[K/G, N/8]`` (along N), ``scales``
float16 ``[K/G, N]``, ``g_idx`` int32 ``[K]``; the ``gptq`` (v1) format stores the zero-point words minus
``0x11111111``, as GPTQModel's ``convert_gptq_v2_to_v1_format_module`` writes them (a zero point of 0
borrows from the next nibble).  The model is test_e2e_hf's 2-layer Llama (hidden 128) in float16.

* every variant: v1 / v2, ``sym`` true / false, group sizes 32, 64, 128 and -1, ``desc_act`` false / true,
  loaded into ``AWQLinear``; each linear's integers ``q - z``, scales and dequantized weight equal a
  float64 dequantization of the written integers (the weight: its float16 rounding, bit for bit), and
  its forward equals ``x @ W`` (act-order: the activation permuted to the stored rows' order);
* compiled with ``backend="quantfuse"`` (one checkpoint with an in-order layer and an act-order one):
  every linear fused, ops sharing an input merged, ``generate`` tokens equal to eager's;
* 8-bit per-channel symmetric (v1 / v2, ``desc_act`` false / true, with biases; four 8-bit values along
  K per word, lowest byte first, zero point 128, v1 storing 127): loaded into ``W8A16Linear``, whose
  int8 weight is ``q - 128`` and whose weight times scale equals the float64 dequantization of the
  written integers exactly; compiled, every linear fused into ``w8a16_gemm``, the logits eager's (up
  to the op's one rounding) and the same tokens;
* an act-order layer's ``state_dict`` round-trips, its column-wise tensor-parallel shards compute its
  outputs (a row-wise split is refused); refusals (2/3-bit, 8-bit with groups or asymmetric, an 8-bit
  zero point other than 128, other formats, a ``g_idx`` no contiguous layout serves) name the key and
  the scheme.
"""

from __future__ import annotations

import itertools
import json
import os

import pytest
import torch

transformers = pytest.importorskip("transformers")
safetensors_torch = pytest.importorskip("safetensors.torch")

from test_e2e_hf import assert_tokens_match, compiled_generate, eager_generate, prompt, tiny_causal_lm  # noqa: E402

from compile_backend.checkpoints import UnsupportedCheckpointError, from_pretrained  # noqa: E402
from compile_backend.ops import awq_unpack  # noqa: E402
from compile_backend.passes import collecting_report  # noqa: E402
from compile_backend.quantize import AWQLinear, W8A16Linear  # noqa: E402

LINEARS = 14  # q, k, v, o, gate, up, down per layer; lm_head stays float
# q/k/v read one input, gate/up another: a real GPTQ act-order gives each such set one order.
SHARED_INPUT = {"q_proj": "attn", "k_proj": "attn", "v_proj": "attn", "gate_proj": "mlp", "up_proj": "mlp"}




@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """The tensors here are small (at most 256 x 256): torch's thread pool only costs them time,
    much of it on a busy machine."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


# --------------------------------------------------------------------------- the GPTQ layout, written here


def _int32(words: torch.Tensor) -> torch.Tensor:
    """Unsigned 32-bit words (int64) as the int32 a checkpoint stores."""
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def pack_along_k(q: torch.Tensor, bits: int = 4) -> torch.Tensor:
    """[K, N] values in [0, 2^bits) -> qweight [K/p, N], p = 32/bits: row p·r + j in bits ``bits·j`` of word r."""
    K, N = q.shape
    p = 32 // bits
    q = q.to(torch.int64).reshape(K // p, p, N)
    return _int32(sum(q[:, j] << (bits * j) for j in range(p)))


def pack_along_n(z: torch.Tensor, v1: bool, bits: int = 4) -> torch.Tensor:
    """[R, N] zero points -> qzeros [R, N/p]: column p·c + j in bits ``bits·j``; v1: the word minus one per
    value (0x11111111 for 4 bits, 0x01010101 for 8)."""
    R, N = z.shape
    p = 32 // bits
    z = z.to(torch.int64).reshape(R, N // p, p)
    words = sum(z[..., j] << (bits * j) for j in range(p))
    ones = sum(1 << (bits * j) for j in range(p))
    return _int32((words - ones) & 0xFFFFFFFF if v1 else words)


def act_order_g_idx(K: int, G: int, gen: torch.Generator) -> torch.Tensor:
    """GPTQ's act-order ``g_idx``: channels quantized in a random order, ``G`` at a time."""
    order = torch.randperm(K, generator=gen)
    g_idx = torch.empty(K, dtype=torch.int64)
    g_idx[order] = torch.arange(K) // G
    return g_idx


def write_gptq(folder, *, fmt="gptq", sym=True, group=32, desc_act=False, bias=False, seed=0,
               in_order_layers=(), style="dict", bits=4):
    """A GPTQ checkpoint of test_e2e_hf's tiny Llama; returns ``(folder, layers)``, ``layers``: linear
    name -> (q [K, N], z [K/G, N], scales [K/G, N] float16, g_idx [K], bias or None), the integers written.
    ``in_order_layers``: decoder layers whose ``g_idx`` stays ``k // G`` under ``desc_act``.  ``bits``
    4 or 8 (8: values in [0, 255], symmetric zero points 128)."""
    model = tiny_causal_lm(dtype=torch.float16)
    gen = torch.Generator().manual_seed(seed)
    tensors, layers, orders = {}, {}, {}
    for name, m in model.named_modules():
        if not isinstance(m, torch.nn.Linear) or name == "lm_head":
            continue
        N, K = m.weight.shape
        G = K if group == -1 else group
        top = 2**bits
        q = torch.randint(0, top, (K, N), generator=gen)
        z = torch.full((K // G, N), top // 2) if sym else torch.randint(0, top, (K // G, N), generator=gen)
        s = (torch.rand(K // G, N, generator=gen) * 0.015 + 0.005).to(torch.float16)
        layer = int(name.split(".")[2])
        if desc_act and layer not in in_order_layers:
            share = (layer, SHARED_INPUT.get(name.rpartition(".")[2], name))
            g_idx = orders.setdefault(share, act_order_g_idx(K, G, gen))
        else:
            g_idx = torch.arange(K) // G
        b = (torch.randn(N, generator=gen) * 0.1).to(torch.float16) if bias else None
        layers[name] = (q, z, s, g_idx, b)
        tensors.update({f"{name}.qweight": pack_along_k(q, bits),
                        f"{name}.qzeros": pack_along_n(z, fmt == "gptq", bits),
                        f"{name}.scales": s, f"{name}.g_idx": g_idx.to(torch.int32)})
        if bias:
            tensors[f"{name}.bias"] = b
    for key, t in model.state_dict().items():
        if key.rpartition(".")[0] not in layers:
            tensors[key] = t
    os.makedirs(folder, exist_ok=True)
    config = model.config.to_dict()
    config.update(dtype="float16", attention_bias=bias, mlp_bias=bias)
    if style == "transformers":  # GPTQConfig's keys: format and the legacy checkpoint_format
        config["quantization_config"] = transformers.GPTQConfig(
            bits=bits, group_size=group, desc_act=desc_act, sym=sym, format=fmt).to_dict()
    else:
        config["quantization_config"] = {"quant_method": "gptq", "bits": bits, "group_size": group,
                                         "desc_act": desc_act, "sym": sym, "checkpoint_format": fmt}
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(config, f)
    safetensors_torch.save_file(tensors, os.path.join(folder, "model.safetensors"), metadata={"format": "pt"})
    return folder, layers


def reference_weight(q, z, s, g_idx) -> torch.Tensor:
    """float64 ``W[k, n] = (q[k, n] - z[g_idx[k], n]) * s[g_idx[k], n]``, ``[K, N]``."""
    return (q - z[g_idx]).double() * s.double()[g_idx]


def in_input_order(mod: AWQLinear, rows: torch.Tensor) -> torch.Tensor:
    """Rows of ``mod``'s stored order ([K, ...]) put back in input-channel order."""
    if mod.perm is None:
        return rows
    out = torch.empty_like(rows)
    out[mod.perm] = rows
    return out


def folded_order(layers, name, group, act_order_layers) -> torch.Tensor | None:
    """The order ``from_pretrained`` moved from ``name``'s MLP's ``down_proj`` into its ``gate_proj`` and
    ``up_proj`` columns (``quantize/act_order.py``: the stable sort of down_proj's ``g_idx``), or None."""
    mlp, _, leaf = name.rpartition(".")
    if leaf not in ("gate_proj", "up_proj", "down_proj") or int(name.split(".")[2]) not in act_order_layers:
        return None
    g_idx = layers[f"{mlp}.down_proj"][3]
    K = g_idx.shape[0]
    if K // (K if group == -1 else group) == 1:
        return None
    return torch.sort(g_idx.long(), stable=True).indices


def check_layers(model, layers, group, act_order_layers):
    """Every linear an ``AWQLinear`` holding exactly the written integers and scales (see the module doc);
    where ``down_proj``'s act-order was folded (``folded_order``), ``gate_proj`` and ``up_proj`` hold their
    columns in its order and ``down_proj`` its rows sorted, without ``perm``."""
    mods = {n: m for n, m in model.named_modules() if isinstance(m, AWQLinear)}
    assert sorted(mods) == sorted(layers)
    assert isinstance(model.lm_head, torch.nn.Linear)
    x = torch.randn(3, 256, generator=torch.Generator().manual_seed(7)).to(torch.float16)
    for name, (q, z, s, g_idx, b) in layers.items():
        mod = mods[name]
        K = mod.in_features
        G = K if group == -1 else group
        assert mod.group_size == G, name
        act_order = int(name.split(".")[2]) in act_order_layers and K // G > 1  # one group: nothing to reorder
        order = folded_order(layers, name, group, act_order_layers)
        if order is not None and name.endswith("down_proj"):
            # its rows sorted by group once, multiplying the input as gate/up now produce it
            q, z, s, g_idx = q[order], z, s, g_idx[order]
            act_order = False
        elif order is not None:  # output columns in down_proj's order
            q, z, s, b = q[:, order], z[:, order], s[:, order], None if b is None else b[order]
        assert (mod.perm is not None) == act_order, name
        assert {k for k, v in mod.named_parameters()} == {"qweight", "qzeros", "scales"} | (
            {"perm"} if mod.perm is not None else set()) | ({"bias"} if b is not None else set()), name
        integers = awq_unpack(mod.awq_qweight()) - awq_unpack(mod.qzeros).repeat_interleave(G, 0)
        assert torch.equal(in_input_order(mod, integers), q - z[g_idx]), name
        assert torch.equal(mod.scales, s), name
        if mod.perm is not None:  # groups contiguous in the stored order
            assert torch.equal(g_idx[mod.perm], torch.arange(K) // G), name
        w = reference_weight(q, z, s, g_idx)
        assert torch.equal(in_input_order(mod, mod.dequantized_weight()), w.to(torch.float16)), name
        xk = x[:, :K]
        ref = xk.double() @ w + (0 if b is None else b.double())
        with torch.no_grad():
            got = mod(xk).double()
        # float16 activations, weights rounded once, float16 output: well inside 1e-2 [~4e-4].
        assert ((got - ref).norm() / ref.norm()).item() < 1e-2, name


# --------------------------------------------------------------------------- every variant

VARIANTS = list(itertools.product(["gptq", "gptq_v2"], [True, False], [32, 64, 128, -1], [False, True]))
VARIANT_IDS = [f"{f}-{'sym' if s else 'asym'}-g{g}-{'act' if d else 'inorder'}" for f, s, g, d in VARIANTS]


@pytest.fixture(scope="module")
def variants_root(tmp_path_factory):
    return tmp_path_factory.mktemp("gptq")


@pytest.mark.parametrize("fmt,sym,group,desc_act", VARIANTS, ids=VARIANT_IDS)
def test_gptq_variant_loads(variants_root, fmt, sym, group, desc_act):
    folder, layers = write_gptq(str(variants_root / f"{fmt}-{sym}-{group}-{desc_act}"), fmt=fmt, sym=sym,
                                group=group, desc_act=desc_act, seed=group % 7 + 2 * sym + desc_act)
    model = from_pretrained(folder)
    check_layers(model, layers, group, act_order_layers={0, 1} if desc_act else set())


def test_gptq_transformers_config_and_bias(tmp_path):
    """transformers' ``GPTQConfig.to_dict()`` (``format`` and ``checkpoint_format``) and linears with biases."""
    folder, layers = write_gptq(str(tmp_path / "hf"), fmt="gptq_v2", sym=False, group=64, desc_act=True,
                                bias=True, style="transformers")
    qcfg = json.load(open(os.path.join(folder, "config.json")))["quantization_config"]
    assert qcfg["format"] == qcfg["checkpoint_format"] == "gptq_v2"
    check_layers(from_pretrained(folder), layers, 64, act_order_layers={0, 1})


def test_gptq_act_order_shares_perm(tmp_path):
    """Layers reading one input (q/k/v, gate/up) get one ``perm`` tensor: one gather, merged ops."""
    folder, _ = write_gptq(str(tmp_path / "act"), desc_act=True)
    model = from_pretrained(folder)
    attn, mlp = model.model.layers[0].self_attn, model.model.layers[0].mlp
    assert attn.q_proj.perm is attn.k_proj.perm is attn.v_proj.perm
    assert mlp.gate_proj.perm is mlp.up_proj.perm
    assert attn.o_proj.perm is not attn.q_proj.perm and mlp.down_proj.perm is not mlp.gate_proj.perm


# --------------------------------------------------------------------------- compiled


@pytest.mark.compile
@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_gptq_fused_generate(tmp_path, device, request):
    """One compile: layer 0 in order (``g_idx = k // G`` under ``desc_act``, as ``static_groups`` writes),
    layer 1 act-order.  Every linear fused into ``awq_gemm`` (layer 1's activation gathers folded into
    its ``perm``), q/k/v and gate/up merged in both layers, ``generate`` tokens equal to eager's.  On a GPU
    the model is loaded on the CPU and moved (the layers' inverse orders follow), and decodes with CUDA
    graphs from the first call, layer 1's attention storing its result in ``o_proj``'s order and its RMSNorms
    theirs in q/k/v's and gate/up's (``rms_norm_ordered``)."""
    if device == "cuda":
        request.getfixturevalue("cuda_kernels")
    from torch._dynamo.utils import counters

    folder, layers = write_gptq(str(tmp_path / "mixed"), fmt="gptq", sym=False, group=32, desc_act=True,
                                in_order_layers=(0,))
    model = from_pretrained(folder).to(device)
    assert model.model.layers[0].self_attn.q_proj.perm is None
    assert model.model.layers[1].self_attn.q_proj.perm is not None
    assert model.model.layers[1].self_attn.o_proj.perm_inverse.device.type == device
    model.generation_config.do_sample = False
    model.generation_config.eos_token_id = None
    ids = prompt(model.config.vocab_size, device)
    ref_tokens, ref_logits = eager_generate(model, ids)

    config = transformers.CompileConfig(backend="quantfuse", mode="default" if device == "cpu" else "reduce-overhead")
    config._compile_all_devices = True  # transformers compiles on accelerators only unless told

    def merged_awq(report, graphs):
        assert report.counts() == {"awq_gemm": LINEARS * graphs}, str(report)
        assert len(report.merged) == 4 * graphs, str(report)  # q/k/v and gate/up of each layer

    ((tokens, logits),) = compiled_generate(model, ids, config, LINEARS, "GPTQ act-order", check=merged_awq)
    assert_tokens_match(tokens, logits, ref_tokens, ref_logits, what="GPTQ act-order")
    if device == "cuda":
        assert counters["quantfuse"]["gqa_decode_out_order"] >= 1, dict(counters["quantfuse"])  # of its compile
        # Layer 1's two RMSNorms (each after a residual add) store q/k/v's and gate/up's input in their order.
        assert counters["quantfuse"]["rms_norm_ordered"] >= 2, dict(counters["quantfuse"])


# --------------------------------------------------------------------------- 8-bit per-channel: W8A16Linear


def check_int8_layers(model, layers):
    """Every linear a ``W8A16Linear`` holding ``q - 128`` as its int8 weight and the written scales: its
    weight times its scale is the float64 dequantization of the written integers exactly, and its
    float16 dequantized weight that value's rounding, bit for bit."""
    mods = {n: m for n, m in model.named_modules() if isinstance(m, W8A16Linear)}
    assert sorted(mods) == sorted(layers)
    assert isinstance(model.lm_head, torch.nn.Linear)
    x = torch.randn(3, 256, generator=torch.Generator().manual_seed(7)).to(torch.float16)
    for name, (q, z, s, g_idx, b) in layers.items():
        mod = mods[name]
        assert torch.equal(z, torch.full_like(z, 128)) and not g_idx.any(), name  # what was written
        assert {k for k, _ in mod.named_parameters()} == {"weight", "weight_scale"} | (
            {"bias"} if b is not None else set()), name
        assert mod.out_dtype == torch.float16 and mod.per_channel, name
        assert mod.weight.dtype == torch.int8 and torch.equal(mod.weight.t().long(), q - 128), name
        assert mod.weight_scale.dtype == torch.float16 and torch.equal(mod.weight_scale, s.reshape(-1)), name
        w = reference_weight(q, z, s, g_idx)  # [K, N]
        assert torch.equal(mod.weight.t().double() * mod.weight_scale.double(), w), name
        assert torch.equal(mod.dequantized_weight().t(), w.to(torch.float16)), name
        if b is not None:
            assert torch.equal(mod.bias, b), name
        xk = x[:, :mod.in_features]
        ref = xk.double() @ w + (0 if b is None else b.double())
        with torch.no_grad():
            got = mod(xk).double()
        assert ((got - ref).norm() / ref.norm()).item() < 1e-2, name


@pytest.mark.parametrize("fmt,desc_act,bias,style", [("gptq", False, False, "dict"),
                                                     ("gptq_v2", True, True, "transformers")],
                         ids=["gptq-inorder", "gptq_v2-act-bias-GPTQConfig"])
def test_gptq_int8_per_channel_loads(tmp_path, fmt, desc_act, bias, style):
    """8-bit, group_size -1, sym: int8 weight-only.  ``desc_act`` leaves one group (``g_idx`` all 0)."""
    folder, layers = write_gptq(str(tmp_path / "int8"), fmt=fmt, sym=True, group=-1, desc_act=desc_act,
                                bias=bias, bits=8, style=style, seed=11)
    qcfg = json.load(open(os.path.join(folder, "config.json")))["quantization_config"]
    assert qcfg["bits"] == 8 and qcfg["group_size"] == -1
    check_int8_layers(from_pretrained(folder), layers)


def test_gptq_int8_bfloat16_widens_the_scales(tmp_path):
    """Loaded as bfloat16: the float16 scales are held in float32 (exact) rather than rounded to bfloat16."""
    folder, layers = write_gptq(str(tmp_path / "int8"), fmt="gptq_v2", group=-1, bits=8, bias=True)
    mod = from_pretrained(folder, dtype=torch.bfloat16).model.layers[1].mlp.down_proj
    _, _, s, _, b = layers["model.layers.1.mlp.down_proj"]
    assert mod.out_dtype == torch.bfloat16 and mod.bias.dtype == torch.bfloat16
    assert mod.weight_scale.dtype == torch.float32 and torch.equal(mod.weight_scale, s.reshape(-1).float())


@pytest.mark.compile
def test_gptq_int8_fused(tmp_path):
    """8-bit per-channel (v1, with biases), compiled: every linear fused into ``w8a16_gemm``, q/k/v and
    gate/up merged, the logits those of eager (the fused op scales the float32 sums rather than each
    weight element) and the same next token at every position.  One forward rather than ``generate``,
    which would compile twice (the 4-bit test above covers the decode loop's machinery)."""
    folder, _ = write_gptq(str(tmp_path / "int8"), fmt="gptq", group=-1, bits=8, bias=True, seed=5)
    model = from_pretrained(folder)
    ids = prompt(model.config.vocab_size, "cpu")
    torch._dynamo.reset()
    with torch.no_grad():
        eager = model(ids).logits.float()
        with collecting_report() as report, torch._functorch.config.patch(enable_autograd_cache=False):
            compiled = torch.compile(model, backend="quantfuse", options={"fx_graph_cache": False})(ids).logits.float()
    assert report.unfused == [], str(report)
    assert report.counts() == {"w8a16_gemm": LINEARS}, str(report)
    assert len(report.merged) == 4, str(report)
    rel = float((compiled - eager).norm() / eager.norm())
    assert rel < 1e-2, rel  # float16 model [~2e-3]
    assert torch.equal(compiled.argmax(-1), eager.argmax(-1))


@pytest.mark.parametrize("how,match", [
    ("zeros", r"q_proj\.qzeros' stores zero point 3 for output channel 0; 8-bit symmetric GPTQ \(gptq_v2\) "
              r"stores 128 for every channel"),
    ("g_idx", r"q_proj\.g_idx' holds group indices outside \[0, 1\) \(group_size -1: one group\)"),
])
def test_gptq_int8_bad_tensors(tmp_path, how, match):
    folder, _ = write_gptq(str(tmp_path / "int8"), fmt="gptq_v2", group=-1, bits=8)
    file = os.path.join(folder, "model.safetensors")
    t = safetensors_torch.load_file(file)
    prefix = "model.layers.0.self_attn.q_proj."
    if how == "zeros":
        t[prefix + "qzeros"][0, 0] = (t[prefix + "qzeros"][0, 0] & ~0xFF) | 3  # channel 0's byte
    else:
        t[prefix + "g_idx"][5] = 1
    safetensors_torch.save_file(t, file)
    with pytest.raises(UnsupportedCheckpointError, match=match):
        from_pretrained(folder)


# --------------------------------------------------------------------------- the act-order layer


def test_act_order_layer_state_dict_round_trip(tmp_path):
    folder, layers = write_gptq(str(tmp_path / "sd"), desc_act=True, bias=True)
    mod = from_pretrained(folder).model.layers[0].mlp.up_proj
    sd = mod.state_dict()
    assert list(sd) == ["qweight", "qzeros", "scales", "bias", "perm"] and sd["perm"].dtype == torch.int32
    x = torch.randn(2, 5, 128, generator=torch.Generator().manual_seed(3)).to(torch.float16)
    with torch.no_grad():
        want = mod(x)
        again = AWQLinear.from_state_dict(sd)
        fresh = AWQLinear(128, 256, group_size=32, act_order=True)
        fresh.load_state_dict(sd)
        for other in (again, fresh):
            assert other.perm is not None and torch.equal(other.perm, mod.perm)
            assert torch.equal(other(x), want)
        # dtype conversions keep the order (and its dtype), as they keep qweight's
        for converted in (again.float(), again.type(torch.float32), again.bfloat16()):
            assert converted.perm.dtype == torch.int32 and torch.equal(converted.perm, mod.perm)
    assert "act_order=True" in repr(mod)
    with pytest.raises(ValueError, match=r"'perm'.*permutation"):
        AWQLinear.from_state_dict({**sd, "perm": torch.zeros(128, dtype=torch.int64)})


def test_act_order_layer_tensor_parallel_shards(tmp_path):
    """Column-wise shards keep the whole order (each computes its outputs exactly); a row-wise shard
    of reordered input channels is refused."""
    from compile_backend.tensor_parallel import _shard_awq

    folder, _ = write_gptq(str(tmp_path / "tp"), desc_act=True, bias=True)
    mod = from_pretrained(folder).model.layers[0].self_attn.q_proj
    x = torch.randn(3, 128, generator=torch.Generator().manual_seed(5)).to(torch.float16)
    shards = [_shard_awq(mod, "q_proj", "colwise", rank, 2)[0] for rank in range(2)]
    with torch.no_grad():
        assert torch.equal(torch.cat([s(x) for s in shards], -1), mod(x))
    assert all(torch.equal(s.perm, mod.perm) for s in shards)
    with pytest.raises(ValueError, match=r"'q_proj': an act-order AWQ layer .* cannot be split row-wise"):
        _shard_awq(mod, "q_proj", "rowwise", 0, 2)


# --------------------------------------------------------------------------- refusals


@pytest.fixture(scope="module")
def refusal_source(tmp_path_factory):
    return write_gptq(str(tmp_path_factory.mktemp("gptq_src") / "src"))[0]


def _with_config(src, dst, **changes):
    os.makedirs(dst)
    os.symlink(os.path.join(src, "model.safetensors"), os.path.join(dst, "model.safetensors"))
    cfg = json.load(open(os.path.join(src, "config.json")))
    cfg["quantization_config"].update(changes)
    with open(os.path.join(dst, "config.json"), "w") as f:
        json.dump(cfg, f)
    return dst


REFUSALS = [
    (dict(bits=8, group_size=128), r"bits = 8: 8-bit GPTQ with group size 128 \(int8 weight-only takes one scale"),
    # 8-bit per-channel symmetric is read as such: the 4-bit tensors are not its layout
    (dict(bits=8, group_size=-1, sym=True),
     r"qweight' has shape \(\d+, \d+\), dtype torch.int32; expected dtype torch.int32 or shape \(\d+, \d+\)"),
    (dict(bits=8, group_size=-1, sym=False), r"bits = 8: 8-bit GPTQ, per-channel asymmetric"),
    (dict(bits=3), r"bits = 3: 3-bit GPTQ with group size 32 \(only 4-bit GPTQ, and 8-bit per-channel symmetric, "
                   r"load\)"),
    (dict(bits=2, group_size=-1), r"bits = 2: 2-bit GPTQ with per-channel"),
    (dict(checkpoint_format="marlin"), r"checkpoint_format = 'marlin': the GPTQ 'marlin' weight layout"),
    (dict(pack_dtype="int64"), r"pack_dtype = 'int64'"),
    (dict(dynamic={r"-:.*down_proj": {}}), r"dynamic = .*per-module"),
    (dict(group_size=0), r"group_size = 0"),
]


@pytest.mark.parametrize("changes,match", REFUSALS, ids=[",".join(f"{k}={v}" for k, v in c.items())
                                                         for c, _ in REFUSALS])
def test_gptq_unsupported(refusal_source, tmp_path, changes, match):
    with pytest.raises(UnsupportedCheckpointError, match=match):
        from_pretrained(_with_config(refusal_source, str(tmp_path / "bad"), **changes))


@pytest.mark.parametrize("how,match", [
    ("unequal", r"q_proj\.g_idx' puts 33 input channels in group 0; every group must hold group_size = 32"),
    ("range", r"q_proj\.g_idx' holds group indices outside \[0, 4\)"),
    ("missing", r"q_proj\.g_idx is missing: quantization_config\.desc_act = True"),
])
def test_gptq_bad_g_idx(tmp_path, how, match):
    folder, _ = write_gptq(str(tmp_path / "g"), desc_act=how == "missing")
    file = os.path.join(folder, "model.safetensors")
    t = safetensors_torch.load_file(file)
    key = "model.layers.0.self_attn.q_proj.g_idx"
    if how == "missing":
        del t[key]
    else:
        t[key][-1] = 0 if how == "unequal" else 4
    safetensors_torch.save_file(t, file)
    with pytest.raises(UnsupportedCheckpointError, match=match):
        from_pretrained(folder)
