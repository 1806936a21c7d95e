// SM90 scaled_mm kernels: cutlass::float_e4m3_t inputs, float output, ScaledBias EVT (bias nullable).
#include "scaled_mm/gemm_sm90.cuh"
QF_SM90_ENTRY(sm90_fp8_f32_bias, cutlass::float_e4m3_t, float, ScaledBias)
