// SM90 scaled_mm kernels: int8_t inputs, cutlass::bfloat16_t output, ScaledBias EVT (bias nullable).
#include "scaled_mm/gemm_sm90.cuh"
QF_SM90_ENTRY(sm90_i8_bf16_bias, int8_t, cutlass::bfloat16_t, ScaledBias)
