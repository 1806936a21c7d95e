"""Inputs of ``quantfuse::gqa_decode_rope`` for its tests, and two checks of the decode attention's Triton
kernels (with and without the rotary and the cache write) that need no GPU: ``interpret()`` runs them
under Triton's interpreter (``TRITON_INTERPRET=1``, set before Triton is imported:
tests/test_gqa_decode_rope.py runs it in a subprocess), ``compile_for_hopper()`` compiles them for
sm_90.  CI runs both in the environment that compiles csrc/; no pytest here: that environment lacks it."""

from __future__ import annotations

import torch

from compile_backend.ops.gqa_decode import HEAD_DIMS, placed, reference, rope_reference


def make(b=2, hkv=2, n=3, length=40, d=64, pos=17, dtype=torch.float32, device="cpu", mask_kind="float", seed=0,
         shared_rope=False):
    """The op's arguments; ``shared_rope``: one ``cos``/``sin`` row for the whole batch."""
    g = torch.Generator(device=device).manual_seed(seed)

    def randn(*shape):
        return torch.randn(*shape, generator=g, device=device).to(dtype)

    q, k, v = randn(b, hkv * n, 1, d), randn(b, hkv, 1, d), randn(b, hkv, 1, d)
    k_cache, v_cache = randn(b, hkv, length, d), randn(b, hkv, length, d)
    angle = torch.rand(1 if shared_rope else b, 1, 1, d // 2, generator=g, device=device) * 6
    cos, sin = (torch.cat([f(angle)] * 2, -1).to(dtype) for f in (torch.cos, torch.sin))
    mask = None
    if mask_kind == "float":
        mask = torch.where(torch.rand(b, 1, 1, length, generator=g, device=device) < 0.7, 0.0,
                           torch.finfo(dtype).min).to(dtype)
    elif mask_kind == "bool":
        mask = torch.rand(b, 1, 1, length, generator=g, device=device) < 0.7
    if mask is not None:
        mask[..., pos] = 0 if mask.dtype != torch.bool else True
    return q, k, v, k_cache, v_cache, torch.tensor([pos], device=device), cos, sin, mask, d ** -0.5



def out_order(q: torch.Tensor, seed: int = 3) -> torch.Tensor:
    """A random ``out_order`` for ``q``'s heads and head size (int64, ``q``'s device)."""
    B, H, _, D = q.shape
    return torch.randperm(H * D, generator=torch.Generator().manual_seed(seed)).to(q.device)


# Float16 only: the interpreter has no bfloat16 arithmetic.
INTERPRET_CASES = [
    dict(b=1, hkv=2, n=4, length=40, d=64, mask_kind="none"),
    dict(b=2, hkv=2, n=3, length=130, d=64, mask_kind="bool"),
    dict(b=2, hkv=1, n=8, length=257, d=128, mask_kind="float"),
    dict(b=1, hkv=3, n=3, length=64, d=32, mask_kind="float"),
    dict(b=3, hkv=2, n=2, length=100, d=64, mask_kind="bool", shared_rope=True),
]


def interpret() -> None:
    """The kernels against the references: ``gqa_decode``'s within float16's rounding; with the rotary and
    the cache write (``rope_reference``) the same, and the caches bit for bit; prints ok."""
    from compile_backend.ops import gqa_decode_triton as kernels

    # The launcher sizes its grid by the GPU's SMs; the interpreter has none.
    torch.cuda.get_device_properties = lambda device: type("Properties", (), {"multi_processor_count": 4})()
    for case in INTERPRET_CASES:
        for pos in (0, case["length"] // 2, case["length"] - 1):
            args = make(pos=pos, dtype=torch.float16, **case)
            k_cache, v_cache = args[3].clone(), args[4].clone()
            want = rope_reference(*args)
            q, k, v, _, _, position, cos, sin, mask, scale = args
            got = kernels.gqa_decode_triton(q, k_cache, v_cache, mask, scale, rope=(k, v, position, cos, sin))
            err = (got.float() - want.float()).abs().max().item()
            assert err < 2e-3, (case, pos, err)
            assert torch.equal(k_cache, args[3]) and torch.equal(v_cache, args[4]), (case, pos, "the caches differ")
            plain = kernels.gqa_decode_triton(q, k_cache, v_cache, mask, scale)
            err = (plain.float() - reference(q, k_cache, v_cache, mask, scale).float()).abs().max().item()
            assert err < 2e-3, (case, pos, "without the rotary", err)
            # The values stored in another order: exactly the same values, each at its place.
            order = out_order(q)
            for stored, expected in (
                    (kernels.gqa_decode_triton(q, k_cache, v_cache, mask, scale, out_order=order),
                     placed(plain, order)),
                    (kernels.gqa_decode_triton(q, args[3].clone(), args[4].clone(), mask, scale,
                                               rope=(k, v, position, cos, sin), out_order=order), placed(got, order))):
                assert torch.equal(stored, expected), (case, pos, "out_order")
            # The position advanced after the op has read it: the same output, the same caches.
            counter, k_again, v_again = position.clone(), args[3].clone(), args[4].clone()
            again = kernels.gqa_decode_triton(q, k_again, v_again, mask, scale, rope=(k, v, counter, cos, sin),
                                              advance=1)
            assert torch.equal(again, got) and torch.equal(k_again, args[3]) and torch.equal(v_again, args[4])
            assert counter.item() == pos + 1, (case, pos, "advance", counter.item())
            # Another launch (benchmarks/bench_gqa_decode.py --sweep): more, shorter splits; the same result.
            other = kernels.gqa_decode_triton(q, k_cache, v_cache, mask, scale, launch=kernels.Launch(8, 32, 4, 1))
            err = (other.float() - plain.float()).abs().max().item()
            assert err < 2e-3, (case, pos, "another launch", err)
    print("ok")


def compile_for_hopper() -> None:
    """Both Triton kernels compiled for sm_90 (PTX and cubin, by Triton's own ptxas) in every
    specialization the launcher asks for: float16 and bfloat16, with and without the rotary, each kind
    of mask, each head size with the op's launch (within an SM's shared memory), with and without an output
    order, advancing the position or not.  Needs no GPU; prints ok."""
    import itertools

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from compile_backend.ops import gqa_decode_triton as kernels

    target = GPUTarget("cuda", 90, 32)

    def build(fn, types: dict, constexprs: dict, options: dict | None = None):
        names = fn.arg_names
        signature = {n: "constexpr" if n in constexprs else types.get(n, "i32") for n in names}
        # Pointers and integers divisible by 16, as the launcher specializes them for aligned tensors
        # and strides: the specialization whose loads are pipelined through shared memory, the most it takes.
        aligned = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(names) if signature[n][0] in "*i"}
        return triton.compile(ASTSource(fn=fn, signature=signature, attrs=aligned,
                                        constexprs={(names.index(k),): v for k, v in constexprs.items()}),
                              target=target, options=options)

    for dtype, rope, (has_mask, mask_bool), d in itertools.product(
            ("fp16", "bf16"), (False, True), ((False, False), (True, True), (True, False)), HEAD_DIMS):
        act, mask = f"*{dtype}", ("*i1" if mask_bool else f"*{dtype}") if has_mask else f"*{dtype}"
        launch = kernels.LAUNCH
        compiled = build(kernels._gqa_decode_split,
                         dict(q_ptr=act, k_ptr=act, v_ptr=act, m_ptr=mask, part_o="*fp32", part_ml="*fp32",
                              qk_scale="fp32", kn_ptr=act, vn_ptr=act, pos_ptr="*i64", cos_ptr=act, sin_ptr=act),
                         dict(N=16, NP=16, D=d, BL=launch.block_l, HAS_MASK=has_mask, MASK_BOOL=mask_bool, ROPE=rope),
                         dict(num_warps=launch.num_warps, num_stages=launch.num_stages))
        # An SM has 227 KB of shared memory for a block (sm_90); a launch asking more fails on the GPU only.
        assert compiled.metadata.shared <= 227 * 1024, (d, launch, compiled.metadata.shared)
    for dtype, order, advance in itertools.product(("fp16", "bf16"), (False, True), (0, 1)):
        build(kernels._gqa_decode_combine,
              dict(part_o="*fp32", part_ml="*fp32", out_ptr=f"*{dtype}", order_ptr="*i64" if order else "*fp32",
                   pos_ptr="*i64" if advance else "*fp32"),
              dict(N=4, NP=16, D=128, SP=16, ORDER=order, ADVANCE=advance))
    print("ok")
