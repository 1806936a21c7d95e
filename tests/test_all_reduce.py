"""The symmetric-memory all-reduce of row-parallel layers (compile_backend/all_reduce.py).

CPU (in CI): which tensors it takes, the environment switch, and that it stays off where it cannot run
(CPU, gloo, one rank).  GPUs (2 and, where present, 4 ranks through NCCL, one process per GPU): the
one-shot and two-shot paths give NCCL's sums exactly (integer-valued inputs: every order of summation
is exact), eagerly and inside a CUDA graph captured by ``torch.compile(mode="reduce-overhead")``, and
sizes past the buffer are not taken.
"""

from __future__ import annotations

import os
import socket

import pytest
import torch
from pass_helpers import dynamo_graph

from compile_backend import all_reduce


def _meta(*shape, dtype=torch.float16, device="meta"):
    return torch.empty(shape, dtype=dtype, device=device)


def test_fits_decode_sizes_only():
    cuda = "cuda" if torch.cuda.is_available() else None
    if cuda is None:  # the device type is what fits() reads; a CUDA-typed fake tensor stands in
        from torch._subclasses.fake_tensor import FakeTensorMode

        with FakeTensorMode(allow_non_fake_inputs=True):
            x = torch.empty(1, 8192, dtype=torch.bfloat16, device="cuda")
            big = torch.empty(4096, 8192, dtype=torch.bfloat16, device="cuda")
            odd = torch.empty(1, 3, dtype=torch.bfloat16, device="cuda")
            assert all_reduce.fits(x) and all_reduce.fits(x.float())
            assert not all_reduce.fits(big)  # 64 MB: NCCL
            assert not all_reduce.fits(odd)  # 6 bytes: the kernels move 16-byte vectors
            assert not all_reduce.fits(x.to(torch.int32))
            half = x.to(torch.float16)  # our one-shot kernel, where it is loaded, up to one-shot sizes
            assert all_reduce.fits(half) == all_reduce._HALF_KERNEL
            assert not all_reduce.fits(torch.empty(all_reduce.ONE_SHOT_MAX_BYTES // 2 + 8, dtype=torch.float16,
                                                   device="cuda"))
    assert not all_reduce.fits(torch.ones(1, 8192, dtype=torch.float16))  # CPU


def test_env_switch(monkeypatch):
    monkeypatch.setenv(all_reduce.ENV, "nccl")
    assert not all_reduce.enabled_by_env()
    monkeypatch.setenv(all_reduce.ENV, "symm_mem")
    assert all_reduce.enabled_by_env()
    monkeypatch.setenv(all_reduce.ENV, "fast")
    with pytest.raises(ValueError, match="QUANTFUSE_ALL_REDUCE='fast'; expected 'nccl'"):
        all_reduce.enabled_by_env()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _gloo_worker(rank: int, port: int, out: str) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        torch.save({"cpu": all_reduce.enable(dist.group.WORLD, torch.device("cpu"))}, os.path.join(out, f"{rank}.pt"))
    finally:
        dist.destroy_process_group()


def test_off_on_cpu_and_gloo(tmp_path):
    import torch.multiprocessing as mp

    mp.spawn(_gloo_worker, args=(_free_port(), str(tmp_path)), nprocs=2, join=True)
    assert [torch.load(tmp_path / f"{r}.pt")["cpu"] for r in range(2)] == [False, False]


# --------------------------------------------------------------------------- GPUs, NCCL

# bytes: one-shot (16 B, one token of hidden 8192 in fp16, its threshold), two-shot (past one-shot, the
# buffer's size), and past the buffer (not taken)
SIZES = (16, 16384, all_reduce.ONE_SHOT_MAX_BYTES, all_reduce.ONE_SHOT_MAX_BYTES + 4096, all_reduce.BUFFER_BYTES)


def _nccl_worker(rank: int, world: int, port: int, out: str) -> None:
    import torch.distributed as dist
    from torch.distributed import _functional_collectives as funcol

    dev = torch.device("cuda", rank)
    torch.cuda.set_device(dev)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            device_id=dev)
    res = {"mismatch": []}
    try:
        group = dist.group.WORLD
        res["enabled"] = all_reduce.enable(group, dev)
        name = group.group_name
        res["half_kernel"] = all_reduce._HALF_KERNEL
        for dtype in all_reduce.DTYPES:
            for nbytes in SIZES:
                if dtype == torch.float16 and nbytes > all_reduce.ONE_SHOT_MAX_BYTES:
                    continue  # float16: one-shot only (past it, NCCL)
                n = nbytes // torch.empty((), dtype=dtype).element_size()
                gen = torch.Generator().manual_seed(rank * 100 + n)
                x = torch.randint(-64, 64, (n,), generator=gen).to(dev, dtype)  # integer sums: exact in any order
                want = x.clone()
                dist.all_reduce(want, group=group)
                got = all_reduce.symm_all_reduce(x, name)
                if not torch.equal(got, want):
                    res["mismatch"].append(("eager", str(dtype), nbytes))
                if not torch.equal(x, torch.randint(-64, 64, (n,), generator=torch.Generator().manual_seed(
                        rank * 100 + n)).to(dev, dtype)):
                    res["mismatch"].append(("input changed", str(dtype), nbytes))
        res["past_buffer_fits"] = all_reduce.fits(torch.empty(all_reduce.BUFFER_BYTES // 2 + 8, dtype=torch.bfloat16,
                                                              device=dev))

        # A chain of all-reduces with work between, the way a decoder layer calls them, captured once.
        def layer_chain(x):
            y = funcol.all_reduce(x * 2, "sum", group)  # NCCL, as RowParallelLinear beyond the buffer
            z = all_reduce.symm_all_reduce(x * 3, name)
            w = all_reduce.symm_all_reduce(z + 1, name)
            return y, z, w

        for gdtype in (torch.bfloat16, torch.float16):  # torch's one-shot kernel, and ours
            torch._dynamo.reset()
            compiled = torch.compile(layer_chain, mode="reduce-overhead", fullgraph=True)
            for step, tokens in enumerate((1, 1, 1, 8, 8, 8)):  # warm-up, capture, replays; two shapes
                gen = torch.Generator().manual_seed(rank + 10 * step)
                x = torch.randint(-8, 8, (tokens, 4096), generator=gen).to(dev, gdtype)
                got = [t.clone() for t in compiled(x)]
                want = [layer_chain(x)[0]]
                z = x * 3
                dist.all_reduce(z, group=group)
                w = z + 1
                dist.all_reduce(w, group=group)
                want += [z, w]
                if not all(torch.equal(g, w_) for g, w_ in zip(got, want)):
                    res["mismatch"].append(("graph", str(gdtype), tokens, step))
        res["graph_ops"] = sorted(str(n.target) for n in dynamo_graph(layer_chain, x, fullgraph=True).graph.nodes
                                  if n.op == "call_function" and "all_reduce" in str(n.target))
    finally:
        torch.save(res, os.path.join(out, f"{rank}.pt"))
        dist.destroy_process_group()


@pytest.mark.gpu
@pytest.mark.parametrize("world", [2, 4])
def test_symm_all_reduce_equals_nccl(world, tmp_path):
    if torch.cuda.device_count() < world:
        pytest.skip(f"needs {world} CUDA GPUs")
    import torch.multiprocessing as mp

    mp.spawn(_nccl_worker, args=(world, _free_port(), str(tmp_path)), nprocs=world, join=True)
    for rank in range(world):
        res = torch.load(tmp_path / f"{rank}.pt")
        assert res["enabled"] and res["half_kernel"], rank
        assert not res["mismatch"], (rank, res["mismatch"])
        assert not res["past_buffer_fits"], rank
        # both symmetric-memory calls and the NCCL one are in the traced graph
        assert sum("symm_all_reduce" in op for op in res["graph_ops"]) == 2, res["graph_ops"]
