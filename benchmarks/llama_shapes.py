"""What the end-to-end benchmarks share about the model: the Llama shapes they run (``MODELS``) and a
layer-by-layer build (``build_layerwise``) that makes a large model without ever holding it dense."""

from __future__ import annotations

import torch

MODELS = {
    "llama-3-8b": dict(layers=32, hidden=4096, intermediate=14336, heads=32, kv_heads=8),
    "llama-3-70b": dict(layers=80, hidden=8192, intermediate=28672, heads=64, kv_heads=8),
}


def build_layerwise(cfg, device, per_layer=None, seed: int = 0, log=None):
    """A ``LlamaForCausalLM`` of ``cfg`` in the default dtype: its skeleton on the meta device, then each part
    made on ``device``, every decoder layer passed to ``per_layer(layer)`` (quantize, shard: it returns the
    module to keep) as soon as it is made, so that one dense layer at a time exists.  Each part is made
    from its own seed (``seed`` and its index): every rank of a tensor-parallel run makes the same weights."""
    from torch import nn
    from transformers import LlamaForCausalLM
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRMSNorm, LlamaRotaryEmbedding

    with torch.device("meta"):
        model = LlamaForCausalLM(cfg)
    with torch.device(device):
        inner = model.model
        torch.manual_seed(seed)
        inner.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size, cfg.pad_token_id)
        inner.norm = LlamaRMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)
        inner.rotary_emb = LlamaRotaryEmbedding(config=cfg)
        model.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        for i in range(cfg.num_hidden_layers):
            torch.manual_seed(seed * 1000003 + i + 1)
            layer = LlamaDecoderLayer(cfg, layer_idx=i).requires_grad_(False)
            if per_layer is not None:
                with torch.no_grad():
                    layer = per_layer(layer)
            inner.layers[i] = layer
            if log is not None and ((i + 1) % 10 == 0 or i + 1 == cfg.num_hidden_layers):
                cuda = torch.device(device).type == "cuda"
                log(f"  built {i + 1}/{cfg.num_hidden_layers} layers"
                    + (f" ({torch.cuda.memory_allocated() / 1e9:.1f} GB allocated)" if cuda else ""))
    meta = [n for n, t in [*model.named_parameters(), *model.named_buffers()] if t.is_meta]
    if meta:
        raise RuntimeError(f"build_layerwise: tensors left on the meta device: {meta[:5]}")
    return model


def step_bytes(model, batch: int, positions: float, kv_heads: int | None = None) -> int:
    """Bytes one decode step must read: every parameter and buffer but the embedding table, the
    embedding rows of its tokens, and the KV cache up to ``positions`` (``kv_heads``: the heads this
    process holds, default the config's; a tensor-parallel rank holds its share).  With the embedding
    tied to the head (SmolLM2), the head reads the whole table: it counts, as the head."""
    embed = model.get_input_embeddings().weight
    head = model.get_output_embeddings()
    tied = head is not None and getattr(head, "weight", None) is embed
    total = sum(t.numel() * t.element_size() for t in [*model.parameters(), *model.buffers()]
                if tied or t is not embed)
    total += batch * embed.shape[1] * embed.element_size()
    c = model.config
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    heads = c.num_key_value_heads if kv_heads is None else kv_heads
    kv = c.num_hidden_layers * 2 * batch * heads * head_dim * positions * embed.element_size()
    return int(total + kv)


# The linears of a decoder layer that read one activation: one act-order each (GPTQ orders a layer's
# input channels by its inputs' statistics, which q/k/v, and gate/up, share).
SAME_INPUT = (("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"), ("self_attn.o_proj",),
              ("mlp.gate_proj", "mlp.up_proj"), ("mlp.down_proj",))


def gptq_act_order(layer, seed: int = 0):
    """A decoder layer quantized to AWQLinear (``quantize_model(layer, "awq-g…")``) as a GPTQ ``desc_act``
    checkpoint loads: each linear rebuilt from its state with a random input-channel order (``perm``; the
    rows as stored, each group contiguous), the linears that read one activation sharing one order, as
    ``compile_backend.checkpoints.gptq`` makes them; then, as ``from_pretrained`` does, down_proj's order
    moved into gate_proj's and up_proj's columns (``quantize/act_order.py``) and their storage merged as
    ``quantize_model``'s is."""
    from compile_backend.quantize.act_order import fold_mlp_orders
    from compile_backend.quantize.merged import share_input_storage
    from compile_backend.quantize.modules import AWQLinear, set_tensors

    gen = torch.Generator().manual_seed(seed)
    for names in SAME_INPUT:
        members = [(n, layer.get_submodule(n)) for n in names]
        if not all(isinstance(m, AWQLinear) for _, m in members):
            raise TypeError(f"gptq_act_order: {names} are not all AWQLinear layers")
        perm = torch.randperm(members[0][1].in_features, generator=gen).to(members[0][1].scales.device)
        held = None
        for name, module in members:
            state = {k: v for k, v in module.state_dict().items() if v is not None}
            rebuilt = AWQLinear.from_state_dict({**state, "perm": perm}, group_size=module.group_size)
            rebuilt.out_dtype = module.out_dtype
            if held is None:
                held = rebuilt.perm
            else:  # one tensor for the group (GPTQFormat.shared_perm)
                set_tensors(rebuilt, perm=held)
            parent, _, attr = name.rpartition(".")
            setattr(layer.get_submodule(parent), attr, rebuilt.to(module.scales.device))
    fold_mlp_orders(layer)
    share_input_storage(layer)
    return layer
