// quantfuse AWQ W4A16: int4 values into mma.sync A fragments (for mma_m16n8k16, common/mma.cuh)
// and the dequantize kernel's pair conversion, per activation dtype (device code shared by the
// decode kernels).
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>

namespace quantfuse {
namespace awq {

// Logical column 8c+i of a packed int32 sits at nibble kOrder(i) = [0,4,1,5,2,6,3,7][i].
__host__ __device__ __forceinline__ int awq_order(int i) { return (i >> 1) + 4 * (i & 1); }

// (a & MASK) | MAGIC in one instruction.
template <uint32_t MASK, uint32_t MAGIC>
__device__ __forceinline__ uint32_t lop3_and_or(uint32_t a) {
  uint32_t r;
  asm("lop3.b32 %0, %1, %2, %3, 0xEA;\n" : "=r"(r) : "r"(a), "n"(MASK), "n"(MAGIC));
  return r;
}

__device__ __forceinline__ uint32_t as_u32(__half2 v) { return *reinterpret_cast<uint32_t*>(&v); }
__device__ __forceinline__ uint32_t as_u32(__nv_bfloat162 v) { return *reinterpret_cast<uint32_t*>(&v); }
__device__ __forceinline__ __half2 as_h2(uint32_t v) { return *reinterpret_cast<__half2*>(&v); }
__device__ __forceinline__ __nv_bfloat162 as_b2(uint32_t v) { return *reinterpret_cast<__nv_bfloat162*>(&v); }

// ----------------------------------------------------------------------------- per-dtype math
//
// The decode kernel has two paths (awq_gemm_kernels.cu: fold_path).  The fold path feeds the MMA
// raw quantized values and applies zeros and scales once per group, in fp32, to the accumulators
// (awq_gemm_strip.cuh: fold_group):
//
//   tile j of a k-step holds  v = kOffset + q / inv_unit(j)   (exact in the activation dtype)
//   acc_j = sum x * v          sx = sum x  (one more MMA, with an all-ones A fragment)
//   sum x * (q - z) * s  =  s * inv_unit(j) * acc_j  -  s * (z + kOffset) * sx
//
// so a lane's 16 weight bytes become four A fragments with 5 (fp16) or 7 (bf16) integer
// instructions and no half-precision arithmetic.  The scaled path (frags_scaled) makes the
// fragments (q - z) * s, rounded once to the activation dtype, from per-row constants (Row).
//
// Fragment layout (the repacked weight, awq_repack_kernel): words (w.x, w.y) of a lane make tiles
// 0 and 1 of the strip, (w.z, w.w) tiles 2 and 3.  Of word u (registers a0, a1; the second word
// gives a2, a3, k-slots + 8): nibbles (0, 4) are a0 of the even tile, (2, 6) its a1, (1, 5) a0 of
// the odd tile, (3, 7) its a1.  So the even tile takes the low nibble of each byte, the odd tile
// the high one.

template <typename T>
struct Dq;

// fp16: a nibble left in place in a half's low bits is an fp16 subnormal: the low nibble of a
// byte reads as q * 2^-24, the high nibble as q * 2^-20; both exact, both taken as they are by
// the tensor cores, and their products with fp16 activations are normal fp32 numbers.  One AND
// per pair of values, one shift per word.
template <>
struct Dq<__half> {
  static constexpr float kOffset = 0.0f;
  static constexpr uint32_t kOne2 = 0x3c003c00u;  // (1.0, 1.0)
  __host__ __device__ __forceinline__ static constexpr float inv_unit(int tile) {
    return (tile & 1) ? 1048576.0f : 16777216.0f;  // 2^20 (high nibbles), 2^24 (low nibbles)
  }
  __device__ __forceinline__ static void frags(const uint4& w, uint32_t (&a)[4][4]) {
    const uint32_t words[4] = {w.x, w.y, w.z, w.w};
#pragma unroll
    for (int p = 0; p < 2; ++p) {
      const uint32_t u = words[2 * p], v = words[2 * p + 1];
      const uint32_t u8 = u >> 8, v8 = v >> 8;
      a[2 * p][0] = u & 0x000f000fu;
      a[2 * p][1] = u8 & 0x000f000fu;
      a[2 * p][2] = v & 0x000f000fu;
      a[2 * p][3] = v8 & 0x000f000fu;
      a[2 * p + 1][0] = u & 0x00f000f0u;
      a[2 * p + 1][1] = u8 & 0x00f000f0u;
      a[2 * p + 1][2] = v & 0x00f000f0u;
      a[2 * p + 1][3] = v8 & 0x00f000f0u;
    }
  }
  // The scaled path: per row, the zero as (1024 + z) for the low nibbles and -(64 + z) for the
  // high ones (bit patterns 0x6400 | z and 0xD400 | z << 4), and the scale, each in both halves;
  // both give q - z exactly, one rounding at * s.
  struct Row {
    uint32_t zlo, zhi, s;
  };
  __device__ __forceinline__ static Row make(uint32_t s_bits, uint32_t z) {
    return Row{(0x6400u | z) * 0x10001u, (0xD400u | (z << 4)) * 0x10001u, s_bits * 0x10001u};
  }
  // The four A fragments of frags(), dequantized: rows[j][h] holds row g + 8h of tile j.
  __device__ __forceinline__ static void frags_scaled(const uint4& w, const Row (&rows)[4][2], uint32_t (&a)[4][4]) {
    const __half2 sixteenth = __half2half2(__ushort_as_half(0x2c00));  // 1/16
    const uint32_t words[4] = {w.x, w.y, w.z, w.w};
#pragma unroll
    for (int p = 0; p < 2; ++p) {
      const uint32_t src[4] = {words[2 * p], words[2 * p] >> 8, words[2 * p + 1], words[2 * p + 1] >> 8};
#pragma unroll
      for (int r = 0; r < 4; ++r) {  // register r: row g + 8 (r & 1)
        const Row& lo = rows[2 * p][r & 1];
        const Row& hi = rows[2 * p + 1][r & 1];
        a[2 * p][r] = as_u32(
            __hmul2(__hsub2(as_h2(lop3_and_or<0x000f000fu, 0x64006400u>(src[r])), as_h2(lo.zlo)), as_h2(lo.s)));
        a[2 * p + 1][r] = as_u32(__hmul2(
            __hfma2(as_h2(lop3_and_or<0x00f000f0u, 0x64006400u>(src[r])), sixteenth, as_h2(hi.zhi)), as_h2(hi.s)));
      }
    }
  }
  // Column-ordered pairs (original AWQ layout, the dequantize kernel): pair p = columns 2p, 2p+1
  // of the word; (1024 + q) - (1024 + z) is q - z exactly, one rounding at * s.
  __device__ __forceinline__ static uint32_t pair(uint32_t q, uint32_t z, uint32_t s2) {
    const uint32_t tq = lop3_and_or<0x000f000fu, 0x64006400u>(q);
    const uint32_t tz = lop3_and_or<0x000f000fu, 0x64006400u>(z);
    return as_u32(__hmul2(__hsub2(as_h2(tq), as_h2(tz)), as_h2(s2)));
  }
  __device__ __forceinline__ static __half from_float(float v) { return __float2half_rn(v); }
  __device__ __forceinline__ static float to_float(__half v) { return __half2float(v); }
  __device__ __forceinline__ static float bits_to_float(uint32_t b) {
    return __half2float(__ushort_as_half((unsigned short)b));
  }
};

// bf16 (7 mantissa bits; its subnormals would make fp32 subnormal products): each nibble is
// shifted to the bottom of its half and ORed into 128.0 (0x4300), which reads as 128 + q exactly;
// the 128 is folded with the zero.  One shift and one lop3 per pair of values.
template <>
struct Dq<__nv_bfloat16> {
  static constexpr float kOffset = 128.0f;
  static constexpr uint32_t kOne2 = 0x3f803f80u;  // (1.0, 1.0)
  __host__ __device__ __forceinline__ static constexpr float inv_unit(int) { return 1.0f; }
  __device__ __forceinline__ static void frags(const uint4& w, uint32_t (&a)[4][4]) {
    const uint32_t words[4] = {w.x, w.y, w.z, w.w};
#pragma unroll
    for (int p = 0; p < 2; ++p) {
      const uint32_t u = words[2 * p], v = words[2 * p + 1];
      a[2 * p][0] = lop3_and_or<0x000f000fu, 0x43004300u>(u);
      a[2 * p][1] = lop3_and_or<0x000f000fu, 0x43004300u>(u >> 8);
      a[2 * p][2] = lop3_and_or<0x000f000fu, 0x43004300u>(v);
      a[2 * p][3] = lop3_and_or<0x000f000fu, 0x43004300u>(v >> 8);
      a[2 * p + 1][0] = lop3_and_or<0x000f000fu, 0x43004300u>(u >> 4);
      a[2 * p + 1][1] = lop3_and_or<0x000f000fu, 0x43004300u>(u >> 12);
      a[2 * p + 1][2] = lop3_and_or<0x000f000fu, 0x43004300u>(v >> 4);
      a[2 * p + 1][3] = lop3_and_or<0x000f000fu, 0x43004300u>(v >> 12);
    }
  }
  // The scaled path: per row, (128 + z) = 0x4300 | z and the scale, each in both halves;
  // (128 + q) - (128 + z) is q - z exactly, one rounding at * s.
  struct Row {
    uint32_t zb, s;
  };
  __device__ __forceinline__ static Row make(uint32_t s_bits, uint32_t z) {
    return Row{(0x4300u | z) * 0x10001u, s_bits * 0x10001u};
  }
  __device__ __forceinline__ static uint32_t sub_mul(uint32_t t, const Row& r) {
    return as_u32(__hmul2(__hsub2(as_b2(t), as_b2(r.zb)), as_b2(r.s)));
  }
  // The four A fragments of frags(), dequantized: rows[j][h] holds row g + 8h of tile j.  (The
  // bf16 fragments are 128 + q already, so dequantizing them is one subtraction and multiply.)
  __device__ __forceinline__ static void frags_scaled(const uint4& w, const Row (&rows)[4][2], uint32_t (&a)[4][4]) {
    frags(w, a);
#pragma unroll
    for (int j = 0; j < 4; ++j)
#pragma unroll
      for (int r = 0; r < 4; ++r) a[j][r] = sub_mul(a[j][r], rows[j][r & 1]);  // register r: row g + 8 (r & 1)
  }
  __device__ __forceinline__ static uint32_t pair(uint32_t q, uint32_t z, uint32_t s2) {
    const uint32_t tq = lop3_and_or<0x000f000fu, 0x43004300u>(q);
    const uint32_t tz = lop3_and_or<0x000f000fu, 0x43004300u>(z);
    return as_u32(__hmul2(__hsub2(as_b2(tq), as_b2(tz)), as_b2(s2)));
  }
  __device__ __forceinline__ static __nv_bfloat16 from_float(float v) { return __float2bfloat16_rn(v); }
  __device__ __forceinline__ static float to_float(__nv_bfloat16 v) { return __bfloat162float(v); }
  __device__ __forceinline__ static float bits_to_float(uint32_t b) { return __uint_as_float(b << 16); }
};

}  // namespace awq
}  // namespace quantfuse
