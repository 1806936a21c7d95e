// SM80 (CUTLASS 2.x) scaled_mm kernels: int8 inputs, cutlass::bfloat16_t output, ScaledBias EVT (bias nullable).
#include "scaled_mm/gemm_sm80.cuh"
QF_SM80_ENTRY(sm80_i8_bf16_bias, cutlass::bfloat16_t, ScaledBias)
