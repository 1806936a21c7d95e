"""Quantized models in plain PyTorch: the modules the passes fuse and how to make them.

* ``modules``: ``W8A8Linear``, ``AWQLinear`` and ``W8A16Linear``, the forms users have in their models;
* ``weights``: round-to-nearest quantizers and the AWQ packing;
* ``model``: ``quantize_model`` and its ``SCHEMES``;
* ``awq_search``: the activation-aware AWQ search ``quantize_model(..., calibration=...)`` runs;
* ``merged``: the linears that share an input stored as views of one merged tensor.
"""

from ..ops.awq_gemm import AWQ_ORDER
from .awq_search import InputScaled, awq_search
from .merged import share_input_storage
from .model import SCHEMES, Scheme, quantize_model
from .modules import AWQLinear, W8A8Linear, W8A16Linear, calls_op_eagerly, held_tensors, set_tensors
from .weights import (
    awq_pack,
    awq_unpack_values,
    fake_quantize_awq,
    quantize_weight_awq,
    quantize_weight_fp8,
    quantize_weight_int8,
)

__all__ = [
    "AWQ_ORDER", "AWQLinear", "InputScaled", "SCHEMES", "Scheme", "W8A8Linear", "W8A16Linear", "awq_pack",
    "awq_search", "awq_unpack_values", "calls_op_eagerly", "fake_quantize_awq", "held_tensors", "quantize_model",
    "quantize_weight_awq", "quantize_weight_fp8", "quantize_weight_int8", "set_tensors", "share_input_storage",
]
