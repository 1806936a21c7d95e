"""The quantfuse ops (``torch.ops.quantfuse.*``), one module per family.

Each family module holds its op's schema, argument checks, reference and fake
implementations and autograd formula, named like the family's pass (``passes/``), kernels
(``csrc/``) and tests (``tests/``): ``scaled_mm``, ``scaled_mm_azp`` (with ``weight_colsum``),
``awq_gemm`` (with ``awq_dequantize``), ``w8a16_gemm``, ``concat_weights``,
``quantize_per_token``, ``gqa_decode``, ``rms_norm_ordered``.  ``library`` is how they are defined and what they
share.  Every op follows docs/DESIGN.md's contract: the reference is plain torch and runs on
any device, and is what runs whenever the kernels cannot take an input; malformed input raises
``QuantfuseInputError`` naming the argument.  Importing this package registers them all; the ops
themselves are ``torch.ops.quantfuse.<name>`` (here each name is its family's module).
"""

from . import (  # noqa: F401  (each registers its op)
    awq_gemm,
    concat_weights,
    gqa_decode,
    quantize_per_token,
    rms_norm_ordered,
    scaled_mm,
    scaled_mm_azp,
    w8a16_gemm,
)
from .awq_gemm import (
    AWQ_ACT_DTYPES,
    AWQ_ORDER,
    AWQ_PACK,
    AWQ_SHIFTS,
    awq_dequantize_reference,
    awq_gemm_reference,
    awq_unpack,
)
from .concat_weights import concat_weights_reference
from .library import NAMESPACE, OUT_DTYPES, QuantfuseInputError
from .scaled_mm import INT8_EXACT_MAX_K, W8A8_INPUT_DTYPES, exact_product, is_blas_layout, scaled_mm_reference
from .scaled_mm_azp import azp_operands, scaled_mm_azp_reference
from .w8a16_gemm import W8A16_ACT_DTYPES, w8a16_gemm_reference

__all__ = [
    "AWQ_ACT_DTYPES", "AWQ_ORDER", "AWQ_PACK", "AWQ_SHIFTS", "INT8_EXACT_MAX_K", "NAMESPACE", "OUT_DTYPES",
    "QuantfuseInputError", "W8A16_ACT_DTYPES", "W8A8_INPUT_DTYPES", "awq_dequantize_reference", "awq_gemm_reference",
    "awq_unpack", "azp_operands", "concat_weights_reference", "exact_product", "is_blas_layout",
    "scaled_mm_azp_reference", "scaled_mm_reference", "w8a16_gemm_reference",
]
