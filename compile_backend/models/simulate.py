"""A quantized model's scheme computed in float64: the bound the accuracy tests hold eager and compiled
models to.

``simulated(model)`` is a float64 copy of ``model`` whose quantized layers compute their scheme
exactly: AWQ and W8A16 weights dequantized without rounding, W8A8 activations quantized as the layer
does (per token or per tensor, symmetric or not, int8 or float8), every product and sum in float64.
The float model's other layers run in float64 as well.

A W8A8 model's result depends on float32's rounding more than float32's epsilon says: an activation
near a quantization boundary goes one step either way with the last bit of its float32 value or of its
scale, and a trained model carries such a step through every later layer (SmolLM2: about 1% of its
perplexity in fp8-rowwise).  Eager and compiled runs round differently from each other and from the
simulation (accumulation order, a fused kernel's reciprocal of the scale), so what a comparison can be
held to is how far such last-bit changes move the result: ``jitter`` multiplies each quantized layer's
activations by ``1 + jitter * u`` (``u`` uniform in [-1, 1), a fixed ``seed``) before they are
quantized, ``scales=torch.float32`` computes the activation scales in float32; the spread of a few such
simulations is the bound (``sensitivity``).
"""

from __future__ import annotations

import copy

import torch
from torch import nn

from ..ops.awq_gemm import awq_unpack, awq_values
from ..ops.quantize_per_token import activation_params, quantize_with
from ..quantize import AWQLinear, W8A8Linear, W8A16Linear

F64 = torch.float64


class _Simulated(nn.Module):
    """A quantized layer's scheme in float64: ``weight`` ``[K, N]`` exact, activations quantized as
    ``layer`` does (W8A8) with scales in ``scales``."""

    def __init__(self, layer: nn.Module, weight: torch.Tensor, bias, scales: torch.dtype, jitter: float,
                 seed: int):
        super().__init__()
        self.layer = layer if isinstance(layer, W8A8Linear) else None
        self.register_buffer("weight", weight)
        self.register_buffer("bias", None if bias is None else bias.to(F64))
        self.scales, self.jitter = scales, jitter
        self.gen = torch.Generator().manual_seed(seed)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lead, K = x.shape[:-1], x.shape[-1]
        x2 = x.reshape(-1, K)
        layer = self.layer
        if layer is not None:
            if self.jitter:
                u = torch.rand(x2.shape, generator=self.gen, dtype=F64) * 2 - 1
                x2 = x2.to(F64) * (1 + self.jitter * u.to(x2.device))
            xs = x2.to(self.scales)
            if layer.dynamic:
                scale, zp = activation_params(xs, layer.weight.dtype, layer.symmetric, layer.per_token)
            else:
                scale = layer.input_scale.to(self.scales)
                zp = None if layer.symmetric else layer.input_zero_point.to(self.scales)
            q = quantize_with(xs, scale, zp, layer.weight.dtype).to(F64)
            x2 = (q - (0 if zp is None else zp.to(F64))) * scale.to(F64)
        y = x2.to(F64) @ self.weight
        if self.bias is not None:
            y = y + self.bias
        return y.reshape(*lead, -1)


def _exact_weight(layer: nn.Module) -> torch.Tensor:
    """``[K, N]`` float64: the layer's weight as its scheme defines it, with no rounding."""
    if isinstance(layer, AWQLinear):
        G = layer.group_size
        q = awq_values(layer.qweight).to(F64)
        z = awq_unpack(layer.qzeros).to(F64).repeat_interleave(G, 0)
        return (q - z) * layer.scales.to(F64).repeat_interleave(G, 0)
    scale = layer.weight_scale.to(F64)
    if scale.numel() > 1:
        scale = scale.reshape(-1, 1)
    return (layer.weight.to(F64) * scale).t()


def simulated(model: nn.Module, scales: torch.dtype = F64, jitter: float = 0.0, seed: int = 0) -> nn.Module:
    """A float64 copy of ``model`` computing each quantized layer's scheme exactly (module doc)."""
    if scales not in (torch.float32, F64):
        raise ValueError(f"simulated: scales {scales}; expected torch.float32 or torch.float64")
    if not 0 <= jitter < 1e-3:
        raise ValueError(f"simulated: jitter {jitter}; expected a relative change in [0, 1e-3)")
    sim = copy.deepcopy(model)
    for i, (parent, name, child) in enumerate(
            (p, n, c) for p in list(sim.modules()) for n, c in list(p.named_children())
            if isinstance(c, (AWQLinear, W8A8Linear, W8A16Linear))):
        setattr(parent, name, _Simulated(child, _exact_weight(child), child.bias, scales, jitter, seed * 100003 + i))
    for module in sim.modules():  # the float layers: float64 parameters and buffers
        if not isinstance(module, (_Simulated, AWQLinear, W8A8Linear, W8A16Linear)):
            for key, t in list(module._parameters.items()) + list(module._buffers.items()):
                if t is not None and t.is_floating_point():
                    converted = t.detach().to(F64)
                    if key in module._parameters:
                        module._parameters[key] = nn.Parameter(converted, requires_grad=False)
                    else:
                        module._buffers[key] = converted
    return sim



def sensitivity(measure, model: nn.Module, runs: int = 3) -> tuple[float, list[float]]:
    """``measure`` (a model -> float, e.g. a perplexity) of the float64 simulation (module doc), and the
    largest relative distance from it of the simulations with float32 scales and with ``runs``
    jitters of float32's epsilon: (the simulation's value, [relative distances])."""
    exact = measure(simulated(model))
    eps = torch.finfo(torch.float32).eps
    others = [measure(simulated(model, torch.float32))]
    others += [measure(simulated(model, jitter=eps, seed=s)) for s in range(runs)]
    return exact, [abs(v - exact) / exact for v in others]
