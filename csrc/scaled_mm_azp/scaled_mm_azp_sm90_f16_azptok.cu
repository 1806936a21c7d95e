// SM90 scaled_mm_azp kernels: int8 inputs, cutlass::half_t output, ScaledBiasAzpToken EVT (bias nullable).
#include "scaled_mm/gemm_sm90.cuh"
QF_SM90_ENTRY(sm90_i8_f16_azptok, int8_t, cutlass::half_t, ScaledBiasAzpToken)
