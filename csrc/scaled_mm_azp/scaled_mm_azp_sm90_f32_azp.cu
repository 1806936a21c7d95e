// SM90 scaled_mm_azp kernels: int8 inputs, float output, ScaledBiasAzp EVT (bias nullable).
#include "scaled_mm/gemm_sm90.cuh"
QF_SM90_ENTRY(sm90_i8_f32_azp, int8_t, float, ScaledBiasAzp)
