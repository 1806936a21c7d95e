// SM80 (CUTLASS 2.x) scaled_mm_azp kernels: int8 inputs, float output, ScaledBiasAzp EVT
// (per-token zero points; per-tensor ones through a null azp; bias nullable).
#include "scaled_mm/gemm_sm80.cuh"
QF_SM80_ENTRY(sm80_i8_f32_azp, float, ScaledBiasAzp)
