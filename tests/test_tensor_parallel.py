"""Tensor parallelism: two processes (gloo on CPU, in CI; on a GPU machine both ranks on GPU 0 through
gloo), and two or four through NCCL where there are as many GPUs (their decode-size all-reduces through
symmetric memory, compile_backend/all_reduce.py), a tiny Hugging Face Llama quantized (attention int8 W8A8, MLP
AWQ g32, biases on every linear), sharded with
``tensor_parallel`` (q/k/v/gate/up column-wise, o/down row-wise) and compiled with ``backend="quantfuse"``.

The ranks run one spawn (``tp_results``: one compile per process, the bulk of the time) and report;
the tests check what they reported:

* every sharded linear of the compiled graph (dynamic shapes: one graph serves two input shapes) is
  fused on every rank and the graph holds the row-parallel all-reduces;
* the logits equal the unsharded eager model's (the same on every rank); the row-parallel bias is
  added once (a bias added on each rank would be off by the bias, far beyond the tolerance);
* the shards' buffers follow their weights; an AWQ group across two shards raises, naming the layer,
  the group size and the shard size, and leaves the model unchanged; so does sharding a model twice.
"""

from __future__ import annotations

import os
import socket

import pytest
import torch

transformers = pytest.importorskip("transformers")

pytestmark = pytest.mark.compile

# Heads: 8 query / 4 key-value, so that 2 and 4 ranks split them evenly.
HEADS, KV_HEADS, VOCAB = 8, 4, 64
# (hidden, intermediate): tiny on CPU; on a GPU, sizes every shard's fused op runs a CUDA kernel for
# (K and N multiples of 128 or more per rank) rather than the reference
SIZES = {"cpu": (64, 128), "cuda": (256, 512)}
# How the ranks run: backend and device of each rank.  "cuda-shared": both ranks on GPU 0 through gloo
# (which all-reduces CUDA tensors through the host), for machines with one GPU.
MODES = {"cpu": ("gloo", "cpu"), "cuda-shared": ("gloo", "cuda"), "cuda-nccl": ("nccl", "cuda")}
# Relative L2 of the logits (bf16 model).  Sharded vs unsharded eager: the row-parallel int8 layer
# quantizes each rank's half of its input with its own per-token scale, and partial sums are rounded
# to bf16 before the all-reduce (measured ~1e-2).  Compiled vs sharded eager: the fused ops' single
# rounding from float32 against eager's bf16 steps, re-quantized activations (measured ~1e-2).
TOL_SHARDED = 4e-2
TOL_COMPILED = 4e-2


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _model(hidden: int, intermediate: int, mesh=None):
    from compile_backend.quantize import quantize_model

    cfg = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=hidden, intermediate_size=intermediate, num_hidden_layers=1,
        num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, max_position_embeddings=64,
        attn_implementation="sdpa", tie_word_embeddings=False, attention_bias=True, mlp_bias=True,
        bos_token_id=None, eos_token_id=None, pad_token_id=0, initializer_range=0.1)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg).eval()
    with torch.no_grad():  # HF initialises biases to zero: make them count
        for m in model.modules():
            if isinstance(m, torch.nn.Linear) and m.bias is not None:
                m.bias.normal_(0, 0.5)
    model = model.to(torch.bfloat16)
    quantize_model(model, "int8", skip=("lm_head", "mlp"))  # attention: W8A8 int8
    quantize_model(model, "awq-g32", mesh=mesh)  # MLP: AWQ; the row-parallel shards hold whole groups
    return model


def _rel(a, b) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm())


def _worker(rank: int, world: int, port: int, out: str, mode: str) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    backend, device = MODES[mode]
    dev = torch.device("cuda", rank if backend == "nccl" else 0) if device == "cuda" else torch.device("cpu")
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        _run(rank, out, dev)
    finally:
        dist.destroy_process_group()


def _run(rank: int, out: str, dev: torch.device) -> None:
    import torch.distributed as dist
    from torch._dynamo.utils import counters

    from compile_backend.passes import collecting_report
    from compile_backend.quantize import AWQLinear, W8A8Linear
    from compile_backend.tensor_parallel import RowParallelLinear, tensor_parallel

    if dev.type == "cuda":  # the fused ops must run the CUDA kernels, never quietly the references
        from conftest import load_cuda_kernels

        load_cuda_kernels()
    res = {}
    ids = torch.randint(0, VOCAB, (2, 8), generator=torch.Generator().manual_seed(1)).to(dev)
    hidden, intermediate = res["sizes"] = SIZES[dev.type]
    model = _model(hidden, intermediate).to(dev)
    full = {name: {k: v.clone() for k, v in m.state_dict().items()} for name, m in model.named_modules()
            if isinstance(m, (W8A8Linear, AWQLinear))}
    with torch.no_grad():
        res["ref"] = model(ids, use_cache=False).logits.float().cpu()

    # An AWQ group across two shards: K = 96 over 2 ranks is 48 per shard, group 32.
    bad = torch.nn.Sequential()
    bad.add_module("proj", AWQLinear(96, 64, group_size=32, dtype=torch.bfloat16))
    try:
        tensor_parallel(bad, plan={"proj": "rowwise"})
        res["straddle"] = None
    except ValueError as exc:
        res["straddle"] = str(exc)
    res["straddle_unchanged"] = type(bad.proj) is AWQLinear

    tensor_parallel(model)
    layer = model.model.layers[0]
    q_shard = layer.self_attn.q_proj
    try:
        tensor_parallel(model)
        res["twice"] = None
    except TypeError as exc:
        res["twice"] = str(exc)
    res["twice_unchanged"] = layer.self_attn.q_proj is q_shard
    o, gate = layer.self_attn.o_proj, layer.mlp.gate_proj
    assert isinstance(o, RowParallelLinear) and isinstance(layer.mlp.down_proj, RowParallelLinear)
    res["shapes"] = dict(q=tuple(layer.self_attn.q_proj.weight.shape), o=tuple(o.local.weight.shape),
                         gate=tuple(gate.awq_qweight().shape),
                         down=tuple(layer.mlp.down_proj.local.awq_qweight().shape))
    f = full["model.layers.0.self_attn.q_proj"]
    world = dist.get_world_size()
    n = f["weight"].shape[0] // world
    res["q_follow"] = all(torch.equal(getattr(layer.self_attn.q_proj, k), f[k][rank * n:(rank + 1) * n])
                          for k in ("weight", "weight_scale", "bias"))
    f = full["model.layers.0.mlp.down_proj"]
    k = f["qweight"].shape[0] // world
    down = layer.mlp.down_proj
    res["down_follow"] = (torch.equal(down.local.awq_qweight(), f["qweight"][rank * k:(rank + 1) * k])
                          and torch.equal(down.local.scales, f["scales"][rank * k // 32:(rank + 1) * k // 32])
                          and torch.equal(down.bias, f["bias"]) and down.local.bias is None)
    with torch.no_grad():
        res["sharded"] = model(ids, use_cache=False).logits.float().cpu()
        other = torch.randint(0, VOCAB, (3, 13), generator=torch.Generator().manual_seed(2)).to(dev)
        res["sharded_other"] = model(other, use_cache=False).logits.float().cpu()
        # quantize_model(..., mesh=...) shards as tensor_parallel does
        via_mesh = _model(hidden, intermediate, mesh=dist.group.WORLD).to(dev)
        res["mesh_rowwise"] = isinstance(via_mesh.model.layers[0].mlp.down_proj, RowParallelLinear)
        mesh_logits = via_mesh(ids, use_cache=False).logits.float().cpu()
        # Sharded on the CPU, then moved: its all-reduces stay on NCCL, where the model sharded on the GPU
        # sums through symmetric memory, in another order from 3 ranks on.
        same_path = via_mesh.model.layers[0].mlp.down_proj.low_latency == layer.mlp.down_proj.low_latency
        res["mesh_equal"] = (torch.equal(mesh_logits, res["sharded"]) if same_path or dist.get_world_size() == 2
                             else _rel(mesh_logits, res["sharded"]) < 1e-2)
    if world == 2:  # the checkpoint's 2 key-value heads split over 2 ranks only
        _run_from_pretrained(rank, out, dev, res)

    torch._dynamo.reset()
    counters.clear()
    code = []
    from torch._inductor.utils import run_and_get_code

    with collecting_report() as report, torch._functorch.config.patch(enable_autograd_cache=False), \
            torch._inductor.config.patch(fx_graph_cache=False, compile_threads=1), torch.no_grad():
        compiled = torch.compile(model, backend="quantfuse", dynamic=True)
        logits, code = run_and_get_code(lambda: compiled(ids, use_cache=False).logits)
        # another batch and length through the same dynamic graph (a recompile would count a graph)
        res["compiled_other"] = compiled(other, use_cache=False).logits.float().cpu()
    res["compiled"] = logits.float().cpu()
    res["graphs"] = counters["stats"]["unique_graphs"]
    res["fused"] = [f"{r.family} ({r.form})" for r in report.fused]
    res["unfused"] = [str(u) for u in report.unfused]
    res["linears"] = sum(isinstance(m, (W8A8Linear, AWQLinear)) for m in model.modules())
    src = "\n".join(code)
    res["all_reduces"] = src.count("torch.ops._c10d_functional.all_reduce_.default(")
    res["symm_all_reduces"] = src.count("torch.ops.quantfuse.symm_all_reduce.default(")
    res["backend"] = dist.get_backend()
    res["quantfuse_mms"] = sum(src.count(f"torch.ops.quantfuse.{op}.default(") for op in ("scaled_mm", "awq_gemm"))
    res["world"] = dist.get_world_size()
    torch.save(res, os.path.join(out, f"rank{rank}.pt"))


def _run_from_pretrained(rank: int, out: str, dev: torch.device, res: dict) -> None:
    """from_pretrained(..., mesh=...): an AWQ checkpoint loaded and sharded on every rank, against the
    same checkpoint loaded unsharded."""
    import torch.distributed as dist
    from test_checkpoints import write_awq

    from compile_backend import from_pretrained
    from compile_backend.tensor_parallel import RowParallelLinear

    folder = os.path.join(out, "awq_checkpoint")
    if rank == 0:
        write_awq(folder, shards=1)
    dist.barrier()
    ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(3)).to(dev)
    with torch.no_grad():
        whole = from_pretrained(folder, device=dev)(ids).logits.float().cpu()
        sharded = from_pretrained(folder, device=dev, mesh=dist.group.WORLD)
        res["ckpt_rowwise"] = isinstance(sharded.model.layers[0].mlp.down_proj, RowParallelLinear)
        res["ckpt_err"] = _rel(sharded(ids).logits.float().cpu(), whole)


def _gpus(n: int):
    return pytest.mark.skipif(torch.cuda.device_count() < n, reason=f"needs {n} CUDA GPU{'s' * (n > 1)}")


@pytest.fixture(scope="module", params=[("cpu", 2), pytest.param(("cuda-shared", 2), marks=_gpus(1)),
                                        pytest.param(("cuda-nccl", 2), marks=_gpus(2)),
                                        pytest.param(("cuda-nccl", 4), marks=_gpus(4))],
                ids=lambda p: f"{p[0]}-{p[1]}")
def tp_results(request, tmp_path_factory):
    import torch.multiprocessing as mp

    mode, world = request.param
    out = str(tmp_path_factory.mktemp("tp"))
    mp.spawn(_worker, args=(world, _free_port(), out, mode), nprocs=world, join=True)
    return [torch.load(os.path.join(out, f"rank{r}.pt")) for r in range(world)]


def test_every_linear_fused_on_every_rank(tp_results):
    for rank, res in enumerate(tp_results):
        assert res["graphs"] == 1, (rank, res["graphs"])
        assert not res["unfused"], (rank, res["unfused"])
        # 7 sharded linears, each one fused subgraph: q/k/v/o int8, gate/up/down AWQ
        assert res["linears"] == 7 and len(res["fused"]) == res["linears"], (rank, res["fused"])
        assert sum(f.startswith("awq_gemm") for f in res["fused"]) == 3, (rank, res["fused"])
        # in the generated code: one matmul op per linear, or fewer where ops sharing an input were
        # merged (q/k/v, gate/up; passes/horizontal.py), and one all-reduce per row-parallel layer
        assert 4 <= res["quantfuse_mms"] <= 7, (rank, res["quantfuse_mms"])
        # NCCL's group on CUDA: the decode-size all-reduces through symmetric memory (compile_backend/all_reduce.py)
        symm = 2 if res["backend"] == "nccl" else 0
        assert (res["all_reduces"], res["symm_all_reduces"]) == (2 - symm, symm), (rank, res["backend"])


def test_outputs_match_unsharded_model(tp_results):
    ref = tp_results[0]["ref"]
    for rank, res in enumerate(tp_results):
        assert torch.equal(res["ref"], ref), rank  # both ranks start from the same model
        assert _rel(res["sharded"], ref) < TOL_SHARDED, (rank, _rel(res["sharded"], ref))
        assert _rel(res["compiled"], res["sharded"]) < TOL_COMPILED, (rank, _rel(res["compiled"], res["sharded"]))
        assert _rel(res["compiled"], ref) < TOL_SHARDED + TOL_COMPILED, (rank, _rel(res["compiled"], ref))
        err = _rel(res["compiled_other"], res["sharded_other"])
        assert err < TOL_COMPILED, (rank, "dynamic shapes: batch 3, length 13", err)
    # the ranks' outputs are replicated after the last all-reduce
    for res in tp_results[1:]:
        assert _rel(res["compiled"], tp_results[0]["compiled"]) < 1e-6


def test_shards_follow_their_weights(tp_results):
    for rank, res in enumerate(tp_results):
        h, i = res["sizes"]
        w = res["world"]
        assert res["shapes"] == dict(q=(h // w, h), o=(h, h // w), gate=(h, i // w // 8),
                                     down=(i // w, h // 8)), (rank, res["shapes"])
        assert res["q_follow"] and res["down_follow"], rank


def test_awq_group_across_shards_raises(tp_results):
    for rank, res in enumerate(tp_results):
        msg = res["straddle"]
        assert msg is not None, f"rank {rank}: no error for an AWQ group across two shards"
        shard = 96 // res["world"]
        assert "'proj'" in msg and "group size 32" in msg and f"{shard} input features" in msg, msg
        assert res["straddle_unchanged"], rank


def test_sharding_twice_raises(tp_results):
    for rank, res in enumerate(tp_results):
        msg = res["twice"]
        assert msg is not None and "already a shard" in msg and "q_proj" in msg, (rank, msg)
        assert res["twice_unchanged"], rank


def test_quantize_model_and_from_pretrained_take_a_mesh(tp_results):
    for rank, res in enumerate(tp_results):
        assert res["mesh_rowwise"] and res["mesh_equal"], rank
        if res["world"] == 2:
            assert res["ckpt_rowwise"], rank
            assert res["ckpt_err"] < TOL_SHARDED, (rank, res["ckpt_err"])
