// SM90 scaled_mm kernels: int8_t inputs, cutlass::half_t output, ScaledBias EVT (bias nullable).
#include "scaled_mm/gemm_sm90.cuh"
QF_SM90_ENTRY(sm90_i8_f16_bias, int8_t, cutlass::half_t, ScaledBias)
