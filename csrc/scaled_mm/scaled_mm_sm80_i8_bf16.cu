// SM80 (CUTLASS 2.x) scaled_mm kernels: int8 inputs, cutlass::bfloat16_t output, ScaledBias EVT (bias nullable).
#define QF_SM80_TUNING_VARIANTS  // run-1 tuning experiment: forced configs 3-6 (removed before merge)
#include "scaled_mm/gemm_sm80.cuh"
QF_SM80_ENTRY(sm80_i8_bf16_bias, cutlass::bfloat16_t, ScaledBias)
