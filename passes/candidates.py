"""Finds matmuls left in a graph whose inputs look quantized, for the report.

Runs after our patterns in the last slot that holds any.  A matmul (``mm``,
``addmm``, ``bmm``, ``baddbmm``, ``_int_mm``, ``_scaled_mm``, ``matmul``, ``linear``) is a
candidate when one of its operands traces back, through element-wise and
layout ops, to an int8 / uint8 / float8 tensor, an int32 tensor that is
unpacked with shifts or masks (packed int4); ``_int_mm`` itself always is.
Tracing stops at GEMM outputs, so float matmuls downstream of a quantized layer
are not candidates, and the backward matmuls of a joint (grad-mode) graph are
not either: the passes fuse the forward only.  Each candidate is reported with the reason a pattern's check
remembered on the node (``report.note_reason``), or, when no pattern matched
its structure at all, with what its inputs look like.

Other libraries' custom ops that read an int32 tensor (GPTQModel's exllama / marlin / triton kernels,
AutoAWQ's and vLLM's packed-weight GEMMs) are opaque: what they compute cannot be seen, so each call
is reported with that reason and where the fused kernels are (``from_pretrained`` on the checkpoint).
"""

from __future__ import annotations

import torch

import compile_backend.ops  # noqa: F401  (torch.ops.quantfuse.*)

from . import report
from .fx_helpers import is_backward, tensor_val

aten = torch.ops.aten

MATMULS = {
    aten.mm.default, aten.addmm.default, aten.bmm.default, aten.baddbmm.default, aten._int_mm.default,
    aten.matmul.default, aten.linear.default, aten._scaled_mm.default, aten._weight_int8pack_mm.default,
}
# Packed quantized matmuls of other libraries that no family takes: always candidates, reported
# with why not.
_TINYGEMM = ("tinygemm int4 (torchao Int4WeightOnlyConfig, tile_packed_to_4d): its weight "
             "dequantizes as q * s + zero with a float zero per group, which awq_gemm's integer "
             "(q - z) * s represents only when (8 * s - zero) / s is an integer in [0, 15]; not "
             "repacked, runs tinygemm as is")
OPAQUE = {
    aten._weight_int4pack_mm.default: _TINYGEMM,
    aten._weight_int4pack_mm_for_cpu.default: _TINYGEMM,
}
QUANT_DTYPES = {torch.int8, torch.uint8, torch.float8_e4m3fn, torch.float8_e5m2}
_UNPACK = {
    aten.bitwise_right_shift.Tensor, aten.bitwise_right_shift.Tensor_Scalar, aten.bitwise_and.Tensor,
    aten.bitwise_and.Scalar, aten.__rshift__.Scalar, aten.__rshift__.Tensor, aten.__and__.Scalar,
    aten.__and__.Tensor,
}
# How far back (in nodes) an operand is followed: a dequantize chain written out op by op
# (stacked nibbles, a reorder, group expansion, casts) is up to a dozen ops long.
MAX_DEPTH = 16
# A GEMM's output is a fresh float tensor, not a quantized one: tracing stops there
# (otherwise every float matmul downstream of a quantized layer would look quantized).
_GEMM_OUTPUTS = MATMULS | {
    torch.ops.quantfuse.scaled_mm.default, torch.ops.quantfuse.scaled_mm_azp.default,
    torch.ops.quantfuse.awq_gemm.default, torch.ops.quantfuse.w8a16_gemm.default,
}


def _dtype(node):
    v = tensor_val(node) if isinstance(node, torch.fx.Node) else None
    return None if v is None else v.dtype


def quantized_source(node, depth: int = MAX_DEPTH, seen=None) -> str | None:
    """A description of the quantized-looking tensor ``node`` derives from, or None."""
    seen = set() if seen is None else seen
    if not isinstance(node, torch.fx.Node) or depth < 0 or node in seen:
        return None
    seen.add(node)
    dtype = _dtype(node)
    if dtype in QUANT_DTYPES:
        return f"{node.name} ({str(dtype).replace('torch.', '')})"
    if node.op == "call_function":
        if node.target in _GEMM_OUTPUTS:
            return None
        if node.target in _UNPACK and dtype in (torch.int32, torch.int64):
            return f"{node.name} (packed int4 unpacked with shifts/masks)"
        for arg in node.all_input_nodes:
            found = quantized_source(arg, depth - 1, seen)
            if found is not None:
                return found
    return None


_REPORTED_NODE = "quantfuse_candidate_reported"
_OWN_NAMESPACES = ("aten", "prims", "quantfuse", "higher_order", "_c10d_functional", "c10d_functional")
_OPAQUE_PACKED = ("an opaque custom op of another library reading packed int32 weights ({source}): quantfuse "
                  "cannot see what it computes; for the fused kernels load the checkpoint with "
                  "compile_backend.from_pretrained (GPTQ, AWQ, compressed-tensors), or for AWQ layers in "
                  "torch form call compile_backend.prepare(model)")


def _opaque_packed(node) -> str | None:
    """The int32 operand of ``node`` when it is another library's custom op reading one, else None."""
    target = node.target
    if not isinstance(target, torch._ops.OpOverload) or target.namespace in _OWN_NAMESPACES:
        return None
    for arg in node.all_input_nodes:
        if _dtype(arg) == torch.int32:
            return f"{arg.name} (int32)"
    return None


def report_unfused(graph: torch.fx.Graph) -> list[tuple[str, str]]:
    """Record every matmul still in ``graph`` whose inputs look quantized; returns (node, reason) pairs."""
    found = []
    for node in graph.nodes:
        if node.op != "call_function":
            continue
        packed = None if node.target in MATMULS | OPAQUE.keys() else _opaque_packed(node)
        if node.target not in MATMULS | OPAQUE.keys() and packed is None:
            continue
        # The backward of a joint graph is eager's own autograd (grad_y @ w_deq and the like);
        # the passes fuse forward matmuls only.  A forward matmul is reported once: the
        # partitioner copies a joint graph's nodes, with their meta, into the forward graph
        # the post-grad slot sees.
        if is_backward(node) or node.meta.get(_REPORTED_NODE):
            continue
        node.meta[_REPORTED_NODE] = True
        if packed is not None:
            source, reasons = packed, [_OPAQUE_PACKED.format(source=packed)]
        elif node.target in OPAQUE:
            source, reasons = node.name, [OPAQUE[node.target]]
        elif node.target is aten._int_mm.default:
            source = f"{node.name} itself (int8 x int8 -> int32)"
        else:
            operands = node.args[1:3] if node.target in (aten.addmm.default, aten.baddbmm.default) else node.args[:2]
            source = next((s for s in (quantized_source(a) for a in operands) if s is not None), None)
        if source is None:
            continue
        if node.target not in OPAQUE and packed is None:
            reasons = report.noted_reasons(node)
        if reasons:
            reason = "; ".join(reasons)
        else:
            reason = (f"no quantfuse pattern matches this form (quantized input: {source}); "
                      "runs unfused under Inductor")
        target = getattr(node.target, "__name__", str(node.target))
        report.record_unfused(node.name, target, reason)
        found.append((node.name, reason))
    return found
