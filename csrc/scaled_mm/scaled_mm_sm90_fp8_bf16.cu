// SM90 scaled_mm kernels: cutlass::float_e4m3_t inputs, cutlass::bfloat16_t output, ScaledBias EVT (bias nullable).
#include "scaled_mm/gemm_sm90.cuh"
QF_SM90_ENTRY(sm90_fp8_bf16_bias, cutlass::float_e4m3_t, cutlass::bfloat16_t, ScaledBias)
