// The mma.sync tensor-core instructions of the decode kernels (w8a16_gemm, scaled_mm decode,
// awq_gemm), written once.  Every one is a warp-wide D = A * B + C with D = C in place:
// four accumulator registers per lane (c), an A fragment of four 32-bit registers (16 x K,
// row-major) and a B fragment of two (K x 8, column-major).
//
//   mma_m16n8k16<T>  T = __half or __nv_bfloat16, f32 accumulators (sm_80+)
//   mma_m16n8k32<T>  T = int8_t (s32 accumulators, sm_80+) or __nv_fp8_e4m3 (f32, sm_89+)
//
// Built for an architecture without the instruction, a call traps.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>

#include <cstdint>
#include <type_traits>

namespace quantfuse {

// Accumulator type of operand type T: s32 for int8, f32 for the floating-point types.
template <class T>
using MmaAcc = std::conditional_t<std::is_same_v<T, int8_t>, int32_t, float>;

// One mma.sync named by SHAPE_TYPES ("<shape>.row.col.<d>.<a>.<b>.<c>"), accumulators in
// registers of constraint ACC ("f" or "r").
#define QUANTFUSE_MMA_SYNC(SHAPE_TYPES, ACC, c, a0, a1, a2, a3, b0, b1)                                   \
  asm("mma.sync.aligned." SHAPE_TYPES " {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};" \
      : "+" ACC(c[0]), "+" ACC(c[1]), "+" ACC(c[2]), "+" ACC(c[3])                                        \
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1))

template <class T>
__device__ __forceinline__ void mma_m16n8k16(float (&c)[4], uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3,
                                             uint32_t b0, uint32_t b1) {
  static_assert(std::is_same_v<T, __half> || std::is_same_v<T, __nv_bfloat16>, "m16n8k16: __half or __nv_bfloat16");
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  if constexpr (std::is_same_v<T, __half>) {
    QUANTFUSE_MMA_SYNC("m16n8k16.row.col.f32.f16.f16.f32", "f", c, a0, a1, a2, a3, b0, b1);
  } else {
    QUANTFUSE_MMA_SYNC("m16n8k16.row.col.f32.bf16.bf16.f32", "f", c, a0, a1, a2, a3, b0, b1);
  }
#else
  __trap();
#endif
}

template <class T>
__device__ __forceinline__ void mma_m16n8k16(float (&c)[4], const uint32_t (&a)[4], const uint32_t (&b)[2]) {
  mma_m16n8k16<T>(c, a[0], a[1], a[2], a[3], b[0], b[1]);
}

template <class T>
__device__ __forceinline__ void mma_m16n8k32(MmaAcc<T> (&c)[4], uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3,
                                             uint32_t b0, uint32_t b1) {
  static_assert(std::is_same_v<T, int8_t> || std::is_same_v<T, __nv_fp8_e4m3>, "m16n8k32: int8_t or __nv_fp8_e4m3");
  if constexpr (std::is_same_v<T, int8_t>) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
    QUANTFUSE_MMA_SYNC("m16n8k32.row.col.s32.s8.s8.s32", "r", c, a0, a1, a2, a3, b0, b1);
#else
    __trap();
#endif
  } else {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
    QUANTFUSE_MMA_SYNC("m16n8k32.row.col.f32.e4m3.e4m3.f32", "f", c, a0, a1, a2, a3, b0, b1);
#else
    __trap();
#endif
  }
}

#undef QUANTFUSE_MMA_SYNC

}  // namespace quantfuse
