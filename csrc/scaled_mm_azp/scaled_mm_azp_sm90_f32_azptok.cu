// SM90 scaled_mm_azp kernels: int8 inputs, float output, ScaledBiasAzpToken EVT (bias nullable).
#include "scaled_mm/gemm_sm90.cuh"
QF_SM90_ENTRY(sm90_i8_f32_azptok, int8_t, float, ScaledBiasAzpToken)
