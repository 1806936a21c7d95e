"""Activation-aware weight quantization (AWQ): the search ``quantize_model(..., calibration=...)`` runs
before it rounds the weights to 4 bits.

What it does (the AWQ paper, Lin et al. 2023; llm-awq / AutoAWQ's ``auto_scale`` and ``auto_clip``):

1. **Activations.**  The float model runs on the calibration tokens; forward hooks record, for each
   linear layer's input, the mean magnitude of every input channel (over all tokens) and a sample
   of up to ``max_tokens`` token rows (evenly spaced) for the searches.
2. **Scales.**  Per input channel ``s = mean|x| ** alpha``, normalised by ``sqrt(max(s) min(s))``,
   for ``alpha`` on a grid of ``n_grid`` points over [0, 1] (``alpha = 0`` is round-to-nearest);
   the weight's columns are multiplied by ``s`` before rounding and the activations divided by
   it, and the ``alpha`` whose quantized output (``x/s · Q(W·s)ᵀ``) is closest to the float output
   (mean squared error over the sampled tokens) is kept.  Linears that read one input (q/k/v;
   gate/up) are searched together, with one scale.  The division of the activations is folded
   into the operation that makes them, where one can carry it:

   ====================  =========================================================================
   linears               ``1/s`` folded into
   ====================  =========================================================================
   q, k, v               the attention RMSNorm's weight (``input_layernorm``)
   o                     v's output rows: one scale per key/value channel, shared by the query
                         heads that read it (grouped-query attention: o's input channel
                         ``h·d + i`` carries v's channel ``(h // (heads/kv_heads))·d + i``)
   gate, up              the MLP RMSNorm's weight (``post_attention_layernorm``)
   down                  up's output rows (``down(act(gate) · up)`` is linear in up's output)
   ====================  =========================================================================

   A norm is used only where the calibration run shows that its output is the linears' input and a
   probe shows that dividing its weight divides its output (an ``x · (1 + w)`` norm does not).
   Any other linear that is quantized (another architecture, a norm that fails those checks) is
   searched alone and its scale applied on the activation: it becomes ``InputScaled(AWQLinear)``,
   ``x · (1/s)`` before the layer, which the passes still fuse (the multiplication stays outside
   the matched weight chain; ``compile_backend.explain`` shows it fused).
3. **Clipping.**  Per linear (q and k excepted, as in AutoAWQ: their errors meet in ``q·kᵀ``,
   which a per-layer output error does not see), the largest magnitude kept per output channel
   and group is searched over ``max · (1 - i/n_grid)`` for ``i < max_shrink · n_grid``, by the
   squared error of that group's contribution to the output summed over every calibration token
   (``Δᵀ H Δ``, ``H`` the Gram matrix of the group's inputs, accumulated during the calibration
   run: exact, and cheaper than the outputs themselves); ``quantize_weight_awq`` then clamps to
   it before rounding.

Folding keeps the float model's function: the folded float model computes what the original did,
up to float rounding (``tests/test_awq_search.py``).  The calibration activations are those of
the float model throughout (as in AutoAWQ), so the layers can be searched in any order.
"""

from __future__ import annotations

import math
import sys
import time
from dataclasses import dataclass, field

import torch
from torch import nn

from .weights import fake_quantize_awq

# Decoder-layer layouts: attribute names of the attention and MLP modules and of the norms before them.
LAYOUTS = (
    # transformers' Llama and the models built like it (Mistral, Qwen2, Qwen3, ...)
    dict(attn="self_attn", mlp="mlp", attn_norm="input_layernorm", mlp_norm="post_attention_layernorm"),
    # compile_backend.models.llama
    dict(attn="attn", mlp="mlp", attn_norm="input_norm", mlp_norm="post_norm"),
)
CLIP_SKIP = ("q_proj", "k_proj")


class InputScaled(nn.Module):
    """``layer(x · input_scale)``: a quantized layer whose AWQ scale could not be folded into the
    operation before it (see the module doc).  ``input_scale`` (``[K]``, ``1/s``) is a buffer: it
    follows the module's dtype and device conversions."""

    def __init__(self, layer: nn.Module, input_scale: torch.Tensor):
        super().__init__()
        self.layer = layer
        self.register_buffer("input_scale", input_scale.detach().clone())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layer(x * self.input_scale)


@dataclass
class _Inputs:
    """What the calibration run recorded of one input: the mean magnitude of each channel, sampled
    token rows (every ``stride``-th token) and, per group of ``group`` channels, the Gram matrix
    ``Σ_t x_t x_tᵀ`` over every token (what the clipping search measures errors with)."""

    stride: int
    group: int
    abs_sum: torch.Tensor | None = None
    gram: torch.Tensor | None = None  # [K/G, G, G]
    count: int = 0
    rows: list = field(default_factory=list)
    first: torch.Tensor | None = None  # the first call's input (checked against a norm's output)

    def add(self, x: torch.Tensor) -> None:
        x2 = x.detach().reshape(-1, x.shape[-1]).to(torch.float32)
        if self.first is None:
            self.first = x.detach().reshape(-1, x.shape[-1])[:64].clone()
        total = x2.abs().sum(0, dtype=torch.float64)
        G = _group(self.group, x2.shape[1])
        xg = x2.view(-1, x2.shape[1] // G, G).transpose(0, 1)  # [K/G, M, G]
        gram = torch.bmm(xg.transpose(1, 2), xg)
        self.abs_sum = total if self.abs_sum is None else self.abs_sum + total
        self.gram = gram if self.gram is None else self.gram + gram
        self.rows.append(x2[(-self.count) % self.stride::self.stride].clone())
        self.count += x2.shape[0]

    def mean_abs(self) -> torch.Tensor:
        return (self.abs_sum / max(self.count, 1)).to(torch.float32)

    def samples(self) -> torch.Tensor:
        return torch.cat(self.rows)


@dataclass
class _Group:
    """Linears that read one input, searched with one scale, and where ``1/s`` goes."""

    name: str
    layer: str
    linears: list  # [(qualified name, nn.Linear)]
    fold: str  # "norm", "linear", "heads" or "activation"
    prev: nn.Module | None = None
    kv_heads: int = 0
    rep: int = 1
    head_dim: int = 0
    alpha: float = 0.0
    loss_rtn: float = 0.0
    loss: float = 0.0


@dataclass
class AWQSearchResult:
    """What the search decided, per quantized linear (by ``id``): the clip (``[N, K/G]`` largest
    magnitude kept, or None) and, for linears whose scale is applied on the activation (not folded
    into the float model), the scale ``s``: those are quantized as ``W·s`` behind ``x·(1/s)``."""

    clip: dict = field(default_factory=dict)
    input_scale: dict = field(default_factory=dict)
    groups: list = field(default_factory=list)
    tokens: int = 0
    seconds: float = 0.0

    def summary(self) -> str:
        folds: dict[str, int] = {}
        for g in self.groups:
            folds[g.fold] = folds.get(g.fold, 0) + 1
        return (f"AWQ search on {self.tokens} calibration tokens: {len(self.groups)} scale groups "
                f"({', '.join(f'{v} {k}' for k, v in sorted(folds.items()))}), "
                f"{sum(c is not None for c in self.clip.values())} linears clipped, {self.seconds:.1f} s")


# --------------------------------------------------------------------------- calibration data


def calibration_batches(calibration, tokenizer=None) -> list[torch.Tensor]:
    """The calibration data as a list of model inputs, each one call ``model(input)``.

    ``calibration``: a tensor of token ids (``[S]``, made ``[1, S]``, or ``[B, S]``), a list of such
    tensors, or a string / list of strings, each tokenized with ``tokenizer`` (a transformers
    tokenizer, or any callable returning ``.input_ids`` or a dict with ``"input_ids"``).  A float
    tensor is passed to the model as it is (a model that takes activations, not token ids).
    """
    items = [calibration] if isinstance(calibration, (str, torch.Tensor)) else list(calibration)
    if not items:
        raise ValueError("calibration: no data; pass token ids ([S] or [B, S]) or a list of strings")
    batches = []
    for item in items:
        if isinstance(item, str):
            if tokenizer is None:
                raise ValueError("calibration: strings need tokenizer=... (e.g. the model's transformers tokenizer)")
            enc = tokenizer(item, return_tensors="pt")
            item = enc["input_ids"] if isinstance(enc, dict) or hasattr(enc, "keys") else enc.input_ids
        if not isinstance(item, torch.Tensor) or (not item.is_floating_point() and item.dim() not in (1, 2)):
            raise TypeError(f"calibration: expected token ids ([S] or [B, S] integer tensors), strings or float "
                            f"model inputs; got {type(item).__name__}"
                            + (f" {item.dtype} {tuple(item.shape)}" if isinstance(item, torch.Tensor) else ""))
        if item.numel() == 0:
            continue
        batches.append(item.reshape(1, -1) if item.dim() == 1 and not item.is_floating_point() else item)
    if not batches:
        raise ValueError("calibration: the calibration data is empty")
    return batches


def _tokens(batch: torch.Tensor) -> int:
    """Tokens in one calibration input: its elements (token ids), or its rows (activations)."""
    return batch.numel() // batch.shape[-1] if batch.is_floating_point() else batch.numel()


# --------------------------------------------------------------------------- finding the groups


def _linear(module, name):
    child = getattr(module, name, None)
    return child if isinstance(child, nn.Linear) else None


def _layout_groups(model: nn.Module, quantized: set) -> list[_Group]:
    """The groups of every decoder layer that has one of ``LAYOUTS``."""
    groups = []
    for layer_name, layer in model.named_modules():
        for lay in LAYOUTS:
            attn, mlp = getattr(layer, lay["attn"], None), getattr(layer, lay["mlp"], None)
            attn_norm, mlp_norm = getattr(layer, lay["attn_norm"], None), getattr(layer, lay["mlp_norm"], None)
            if attn is None or mlp is None:
                continue
            prefix = f"{layer_name}." if layer_name else ""
            q, k, v, o = (_linear(attn, n) for n in ("q_proj", "k_proj", "v_proj", "o_proj"))
            gate, up, down = (_linear(mlp, n) for n in ("gate_proj", "up_proj", "down_proj"))
            a, m = f"{prefix}{lay['attn']}.", f"{prefix}{lay['mlp']}."
            if q is not None and k is not None and v is not None and attn_norm is not None:
                groups.append(_Group(f"{a}q/k/v", layer_name, [(a + "q_proj", q), (a + "k_proj", k),
                                                               (a + "v_proj", v)], "norm", attn_norm))
            head_dim = getattr(attn, "head_dim", None)
            if v is not None and o is not None and isinstance(head_dim, int) and head_dim > 0:
                kv, heads = divmod(v.out_features, head_dim), divmod(o.in_features, head_dim)
                if kv[1] == 0 and heads[1] == 0 and kv[0] > 0 and heads[0] % kv[0] == 0:
                    groups.append(_Group(f"{a}o", layer_name, [(a + "o_proj", o)], "heads", v, kv_heads=kv[0],
                                         rep=heads[0] // kv[0], head_dim=head_dim))
            if gate is not None and up is not None and mlp_norm is not None:
                groups.append(_Group(f"{m}gate/up", layer_name, [(m + "gate_proj", gate), (m + "up_proj", up)],
                                     "norm", mlp_norm))
            if up is not None and down is not None and up.out_features == down.in_features:
                groups.append(_Group(f"{m}down", layer_name, [(m + "down_proj", down)], "linear", up))
            break
    # Only groups with a quantized linear; a linear in two groups (shared modules) only once.
    seen, kept = set(), []
    for g in groups:
        ids = [id(lin) for _, lin in g.linears]
        if any(i in seen for i in ids) or not any(i in quantized for i in ids):
            continue
        seen.update(ids)
        kept.append(g)
    return kept


def _norm_divides(norm: nn.Module, width: int) -> bool:
    """Whether dividing ``norm.weight`` (and its bias) by a positive vector divides its output by it."""
    weight = getattr(norm, "weight", None)
    if not isinstance(weight, torch.Tensor) or tuple(weight.shape) != (width,):
        return False
    bias = getattr(norm, "bias", None)
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(4, width, generator=gen).to(device=weight.device, dtype=weight.dtype)
    s = (0.5 + torch.rand(width, generator=gen)).to(device=weight.device, dtype=weight.dtype)
    with torch.no_grad():
        before = norm(x)
        saved = weight.detach().clone(), None if bias is None else bias.detach().clone()
        try:
            weight.div_(s)
            if bias is not None:
                bias.div_(s)
            after = norm(x)
        finally:
            weight.copy_(saved[0])
            if bias is not None:
                bias.copy_(saved[1])
    return isinstance(after, torch.Tensor) and torch.allclose(after * s, before, rtol=1e-2, atol=1e-3)


# --------------------------------------------------------------------------- the searches


def _scale_from(stat: torch.Tensor, alpha: float, w_stat: torch.Tensor | None = None) -> torch.Tensor:
    s = stat.pow(alpha) if w_stat is None else stat.pow(alpha) / (w_stat.pow(1 - alpha) + 1e-4)
    s = s.clamp(min=1e-4)
    return s / (s.max() * s.min()).sqrt()


def _weight_stat(w: torch.Tensor, group_size: int) -> torch.Tensor:
    """Per input channel: the mean over output channels of ``|w|`` relative to its group's largest
    (AutoAWQ's ``w_mean``, for ``duo`` scaling)."""
    N, K = w.shape
    G = _group(group_size, K)
    a = w.abs().view(N, K // G, G)
    return (a / (a.amax(-1, keepdim=True) + 1e-6)).view(N, K).mean(0)


def _search_scale(group: _Group, x: torch.Tensor, stat: torch.Tensor, quantized: set, group_size: int, dtype,
                  n_grid: int, duo: bool = False) -> torch.Tensor:
    """The per-channel scale of ``group`` (over its input, or over v's channels for "heads") with the
    smallest output error of its quantized linears; sets ``group.alpha``, ``loss_rtn``, ``loss``.
    Candidates: ``s = 1`` (round-to-nearest), then ``mean|x|^alpha`` (``duo``: divided by
    ``w_mean^(1-alpha)``, AutoAWQ's ``duo_scaling``) for ``alpha`` on the grid."""
    w = torch.cat([lin.weight.detach().to(torch.float32) for _, lin in group.linears if id(lin) in quantized])
    G = _group(group_size, w.shape[1])
    w_stat = _weight_stat(w, group_size) if duo else None
    if group.fold == "heads":  # one scale per v channel: average the magnitudes of the heads reading it
        stat = stat.view(group.kv_heads, group.rep, group.head_dim).mean(1).reshape(-1)
        if w_stat is not None:
            w_stat = w_stat.view(group.kv_heads, group.rep, group.head_dim).mean(1).reshape(-1)

    def loss_of(s):
        full = _expand(group, s)
        delta = fake_quantize_awq(w * full, G, dtype).div_(full).sub_(w)
        return (x @ delta.t()).pow_(2).mean().item()

    ones = torch.ones_like(stat)
    group.loss_rtn = loss_of(ones)
    best = (group.loss_rtn, 0.0, ones)
    for i in range(1 if w_stat is None else 0, n_grid):  # alpha = 0 without duo is s = 1: done
        alpha = i / (n_grid - 1)
        s = _scale_from(stat, alpha, w_stat)
        loss = loss_of(s)
        if loss < best[0]:
            best = (loss, alpha, s)
    group.loss, group.alpha = best[0], best[1]
    return best[2]


def _expand(group: _Group, s: torch.Tensor) -> torch.Tensor:
    """The scale over the group's input channels (for "heads": v's channel per o input channel)."""
    if group.fold != "heads":
        return s
    return s.view(group.kv_heads, 1, group.head_dim).expand(group.kv_heads, group.rep, group.head_dim).reshape(-1)


def _group(group_size: int, k: int) -> int:
    return k if group_size in (-1, 0) else group_size


@torch.no_grad()
def _fold(group: _Group, s: torch.Tensor) -> None:
    """Divide the group's input by ``s`` where ``group.fold`` says and multiply its linears' columns
    by it: the float model computes the same function (up to rounding: the products are computed
    in float32, or the weights' dtype if wider, and rounded once to the weights' dtype)."""

    def scaled(t: torch.Tensor, by: torch.Tensor, divide: bool) -> torch.Tensor:
        wide = torch.promote_types(t.dtype, torch.float32)
        by = by.to(device=t.device, dtype=wide)
        return (t.to(wide) / by if divide else t.to(wide) * by).to(t.dtype)

    full = _expand(group, s)
    for _, lin in group.linears:
        lin.weight.copy_(scaled(lin.weight, full, divide=False))
    if group.fold in ("norm", "linear", "heads"):
        for name in ("weight", "bias"):
            t = getattr(group.prev, name, None)
            if isinstance(t, torch.Tensor):
                rows = s.view(-1, 1) if name == "weight" and group.fold != "norm" else s
                t.copy_(scaled(t, rows, divide=True))


def _search_clip(gram: torch.Tensor, weight: torch.Tensor, group_size: int, dtype, n_grid: int,
                 max_shrink: float) -> torch.Tensor:
    """``[N, K/G]``: the largest magnitude to keep per output channel and group, by the squared error
    of the group's contribution to the output over every calibration token: ``Δᵀ H Δ`` with ``Δ``
    the group's weight error and ``H`` (``gram``, ``[K/G, G, G]``) the Gram matrix of its inputs."""
    w = weight.detach().to(torch.float32)
    N, K = w.shape
    G = _group(group_size, K)
    ng = K // G
    org_max = w.view(N, ng, G).abs().amax(-1)  # [N, ng]
    best_max, best_err = org_max.clone(), torch.full_like(org_max, math.inf)
    for i in range(max(1, int(max_shrink * n_grid))):
        clip = org_max * (1 - i / n_grid)
        delta = fake_quantize_awq(w, G, dtype, clip=clip).sub_(w).view(N, ng, G).transpose(0, 1)  # [ng, N, G]
        err = torch.bmm(delta, gram).mul_(delta).sum(-1).t()  # [N, ng]
        better = err < best_err
        best_err = torch.where(better, err, best_err)
        best_max = torch.where(better, clip, best_max)
    return best_max


# --------------------------------------------------------------------------- the whole search


def awq_search(model: nn.Module, calibration, linears, group_size: int, *, dtype=torch.float16, tokenizer=None,
               n_grid: int = 20, max_tokens: int = 512, clip: bool = True, max_shrink: float = 0.5,
               clip_skip=CLIP_SKIP, duo: bool = False, progress: bool = True) -> AWQSearchResult:
    """Run the AWQ search on ``model`` (float) for the linears ``linears`` (``[(qualified name,
    nn.Linear)]``, those ``quantize_model`` will quantize with ``group_size`` and scales in
    ``dtype``), folding the scales into the float model in place (its function is kept: only
    weights change, by the scales and their inverses), and return the clips and the scales applied
    on the activation to quantize with (``AWQSearchResult``).

    ``calibration`` / ``tokenizer``: see ``calibration_batches``.  ``n_grid``: points of the
    scale exponent's grid over [0, 1], and the clipping grid's step ``1/n_grid``; ``max_shrink``:
    how far clipping may go (0.5: down to half the group's largest magnitude).  ``max_tokens``:
    token rows sampled per input for the searches (the channel magnitudes use every token).
    ``clip=False`` skips the clipping search; ``clip_skip``: names (last part) of linears not
    clipped.  ``duo``: candidates ``mean|x|^alpha / w_mean^(1-alpha)`` (AutoAWQ's ``duo_scaling``;
    on SmolLM2 neither form is consistently better).  ``progress``: one line per decoder layer on
    stderr.
    """
    start = time.perf_counter()
    batches = calibration_batches(calibration, tokenizer)
    device = next((p.device for p in model.parameters()), torch.device("cpu"))
    total = sum(_tokens(b) for b in batches)
    stride = max(1, math.ceil(total / max_tokens))
    quantized = {id(lin) for _, lin in linears}
    names = {id(lin): name for name, lin in linears}

    groups = _layout_groups(model, quantized)
    covered = {id(lin) for g in groups for _, lin in g.linears}
    for name, lin in linears:
        if id(lin) not in covered:
            covered.add(id(lin))
            groups.append(_Group(name, name.rpartition(".")[0], [(name, lin)], "activation"))

    # 1. The calibration run: every group's input, and the norms' first outputs (to check they are it).
    inputs = {id(g): _Inputs(stride, group_size) for g in groups}
    norm_out: dict[int, torch.Tensor] = {}

    def keep_first(key, out):
        if key not in norm_out and isinstance(out, torch.Tensor):
            norm_out[key] = out.detach().reshape(-1, out.shape[-1])[:64].clone()

    hooks = []
    try:
        for g in groups:
            key = id(g)
            hooks.append(g.linears[0][1].register_forward_pre_hook(
                lambda _m, args, rec=inputs[key]: rec.add(args[0])))
            if g.fold == "norm":
                hooks.append(g.prev.register_forward_hook(lambda _m, _a, out, key=key: keep_first(key, out)))
        if progress:
            print(f"awq: running the float model on {total} calibration tokens ({len(batches)} calls)",
                  file=sys.stderr, flush=True)
        with torch.no_grad():
            for batch in batches:
                model(batch.to(device))
    finally:
        for h in hooks:
            h.remove()
    checked = []
    for g in groups:
        if inputs[id(g)].count == 0:
            raise ValueError(f"awq_search: {g.name} was not called on the calibration data")
        seen, first = norm_out.get(id(g)), inputs[id(g)].first
        if g.fold == "norm" and not (seen is not None and seen.shape == first.shape and torch.equal(seen, first)
                                     and _norm_divides(g.prev, first.shape[-1])):
            # The norm is not what feeds the linears, or cannot carry a scale: scale each on its activation.
            for name, lin in g.linears:
                if id(lin) in quantized:
                    new = _Group(name, g.layer, [(name, lin)], "activation")
                    inputs[id(new)] = inputs[id(g)]
                    checked.append(new)
        else:
            checked.append(g)
    groups = checked

    # 2-3. Per decoder layer: scales (folded), then clipping.
    result = AWQSearchResult(tokens=total)
    layers = list(dict.fromkeys(g.layer for g in groups))
    for n_layer, layer in enumerate(layers, 1):
        t0 = time.perf_counter()
        mine = [g for g in groups if g.layer == layer]
        grams = {}
        for g in mine:
            rec = inputs[id(g)]
            x = rec.samples().to(torch.float32)
            s = _search_scale(g, x, rec.mean_abs(), quantized, group_size, dtype, n_grid, duo)
            if g.fold == "activation":  # quantize_model quantizes W·s and puts x·(1/s) before it
                result.input_scale[id(g.linears[0][1])] = s
            else:
                _fold(g, s)
            full = _expand(g, s).view(-1, rec.gram.shape[-1])  # the inputs are now x / s
            grams[id(g)] = rec.gram / (full.unsqueeze(-1) * full.unsqueeze(-2))
            result.groups.append(g)
        clipped = 0
        for g in mine:
            for name, lin in g.linears:
                if id(lin) not in quantized:
                    continue
                if clip and name.rpartition(".")[2] not in clip_skip:
                    w = lin.weight
                    if g.fold == "activation":
                        w = w.to(torch.float32) * result.input_scale[id(lin)]
                    result.clip[id(lin)] = _search_clip(grams[id(g)], w, group_size, dtype, n_grid, max_shrink)
                    clipped += 1
                else:
                    result.clip[id(lin)] = None
        if progress:
            alphas = ", ".join(f"{g.name.rpartition('.')[2] if g.fold != 'activation' else g.name} "
                               f"{g.alpha:.2f} ({g.loss / g.loss_rtn if g.loss_rtn else 1:.2f})" for g in mine)
            print(f"awq: [{n_layer}/{len(layers)}] {layer or names.get(id(mine[0].linears[0][1]))}: "
                  f"alpha (error vs round-to-nearest) {alphas}; {clipped} clipped; "
                  f"{time.perf_counter() - t0:.1f} s", file=sys.stderr, flush=True)
    result.seconds = time.perf_counter() - start
    if progress:
        print(f"awq: {result.summary()}", file=sys.stderr, flush=True)
    return result
