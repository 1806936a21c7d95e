// The zero-point epilogues' entry points, one per file of this folder: the CUTLASS kernels of
// scaled_mm (scaled_mm/gemm_sm90.cuh, gemm_sm80.cuh) instantiated with the ScaledBiasAzp and
// ScaledBiasAzpToken epilogue trees; scaled_mm/scaled_mm_ops.cpp picks one by output dtype.
#pragma once

#include "scaled_mm/scaled_mm_launch.h"

namespace quantfuse {

// SM90: *_azp = ScaledBiasAzp (per-tensor zero point folded into azp_adj), *_azptok =
// ScaledBiasAzpToken (per-token zero points).
int sm90_i8_f16_azp(const ScaledMmParams& p);
int sm90_i8_bf16_azp(const ScaledMmParams& p);
int sm90_i8_f32_azp(const ScaledMmParams& p);
int sm90_i8_f16_azptok(const ScaledMmParams& p);
int sm90_i8_bf16_azptok(const ScaledMmParams& p);
int sm90_i8_f32_azptok(const ScaledMmParams& p);

// SM80: one tree for both (a null azp is the per-tensor case).
int sm80_i8_f16_azp(const ScaledMmParams& p);
int sm80_i8_bf16_azp(const ScaledMmParams& p);
int sm80_i8_f32_azp(const ScaledMmParams& p);

}  // namespace quantfuse
