// SM90 scaled_mm kernels: int8_t inputs, float output, ScaledBias EVT (bias nullable).
#include "scaled_mm/gemm_sm90.cuh"
QF_SM90_ENTRY(sm90_i8_f32_bias, int8_t, float, ScaledBias)
