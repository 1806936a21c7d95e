// SM90 scaled_mm kernels: cutlass::float_e4m3_t inputs, cutlass::half_t output, ScaledBias EVT (bias nullable).
#include "scaled_mm/gemm_sm90.cuh"
QF_SM90_ENTRY(sm90_fp8_f16_bias, cutlass::float_e4m3_t, cutlass::half_t, ScaledBias)
