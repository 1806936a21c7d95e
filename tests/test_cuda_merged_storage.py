"""GPU: the linears that share an input, stored as views of one merged tensor, are concatenated
without a copy (csrc/common/concat_weights.cpp), and a compiled decode step holds no copy of them:
its memory stays within the weights, the activations and a stated workspace."""

from __future__ import annotations

import pytest
import torch

from compile_backend.models.llama import LlamaConfig, tiny_llama
from compile_backend.quantize import AWQLinear, held_tensors, quantize_model

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

CONCAT = torch.ops.quantfuse.concat_weights
# What a compiled step may allocate beyond the weights and its activations (kernel workspaces,
# cuBLAS's, the step's small temporaries).
WORKSPACE_BYTES = 48 << 20


def _model(scheme: str, cfg: LlamaConfig, seed: int = 0):
    dtype = torch.float16 if scheme.startswith("awq") else torch.bfloat16
    return quantize_model(tiny_llama(cfg, seed=seed, dtype=dtype, device="cuda"), scheme)


def _nbytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


@pytest.mark.parametrize("scheme", ["int8", "awq-g128"])
def test_concatenation_reads_the_merged_tensor_and_sees_writes(scheme):
    cfg = LlamaConfig(vocab_size=256, hidden_size=256, intermediate_size=512, num_layers=1, num_heads=4,
                      num_kv_heads=2)
    model = _model(scheme, cfg)
    attn = model.layers[0].attn
    members = (attn.q_proj, attn.k_proj, attn.v_proj)
    name, dim = ("qweight", 0) if scheme.startswith("awq") else ("weight", 0)  # AWQ: the fragment layout
    parts = [held_tensors(m)[name] for m in members]
    merged = CONCAT(parts, dim)
    assert merged.data_ptr() == parts[0].data_ptr()  # no copy
    # A storage object of its own: a custom op's output must not alias its inputs' storages.
    assert merged.untyped_storage()._cdata != parts[0].untyped_storage()._cdata
    assert torch.equal(merged, torch.cat([p.clone() for p in parts], dim))
    # A write to one member is read by the next concatenation, and by what is derived from it.
    k = held_tensors(attn.k_proj)[name]
    k.copy_(torch.randint(0, 2**31 - 1 if name == "qweight" else 127, k.shape, dtype=k.dtype, device="cuda"))
    again = CONCAT(parts, dim)
    assert again.data_ptr() == parts[0].data_ptr()
    assert torch.equal(again, torch.cat([p.clone() for p in parts], dim))
    x = torch.randn(3, cfg.hidden_size, dtype=torch.float16 if name == "qweight" else torch.bfloat16, device="cuda")
    if isinstance(attn.q_proj, AWQLinear):
        t = {n: CONCAT([held_tensors(m)[n] for m in members], 0 if n == "qweight" else 1)
             for n in ("qweight", "scales", "qzeros")}
        fused = torch.ops.quantfuse.awq_gemm(x, t["qweight"], t["scales"], t["qzeros"], 128)
        eager = torch.cat([m(x) for m in members], -1)
        torch.testing.assert_close(fused, eager, rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("scheme", ["int8", "fp8-rowwise", "awq-g128"])
def test_compiled_decode_step_holds_no_copy_of_merged_weights(scheme):
    """After compiling and running a prefill (the Hopper AWQ kernel's layout is made per call) and
    one-token steps, memory allocated beyond the model is at most the workspace: no layout of a
    weight is kept beside the one the module holds; the step's peak adds only its activations."""
    cfg = LlamaConfig(vocab_size=512, hidden_size=1024, intermediate_size=4096, num_layers=4, num_heads=8,
                      num_kv_heads=2)
    model = _model(scheme, cfg)
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    compiled = torch.compile(model, backend="quantfuse")
    tokens = torch.randint(0, cfg.vocab_size, (1, 1), device="cuda")
    with torch.no_grad():
        compiled(torch.randint(0, cfg.vocab_size, (1, 96), device="cuda"))
        for _ in range(3):
            compiled(tokens)
        torch.cuda.synchronize()
        kept = torch.cuda.memory_allocated() - before
        torch.cuda.reset_peak_memory_stats()
        out = compiled(tokens)
        torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - before
    weights = _nbytes([*model.parameters(), *model.buffers()])
    activations = 8 * out.numel() * out.element_size()
    assert kept <= WORKSPACE_BYTES, (scheme, weights, kept)
    assert peak <= activations + WORKSPACE_BYTES, (scheme, weights, peak)
