// quantfuse AWQ W4A16: int4 -> fp16 / bf16 dequantization into mma.sync A fragments, and the
// MMA itself, per activation dtype (device code shared by the decode kernels).
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

template <typename T>
struct Dq;

// fp16: per weight row the zero is held as (1024 + z) for the low nibbles and -(64 + z) for
// the high nibbles (bit patterns 0x6400 | z and 0xD400 | z << 4); both give q - z exactly,
// one rounding at * s.
template <>
struct Dq<__half> {
  struct Row {
    uint32_t zlo, zhi, s;  // each duplicated into both halves
  };
  __device__ __forceinline__ static Row make(uint32_t s_bits, uint32_t z) {
    Row r;
    r.zlo = (0x6400u | z) * 0x10001u;
    r.zhi = (0xD400u | (z << 4)) * 0x10001u;
    r.s = s_bits * 0x10001u;
    return r;
  }
  // w: the 8 nibbles of one lane's m16n8k16 A fragment; nibble pairs (0,4) (1,5) are row g at
  // k-slots (2t, 2t+1) and (2t+8, 2t+9), pairs (2,6) (3,7) the same for row g + 8.
  __device__ __forceinline__ static void frag(uint32_t w, const Row& r0, const Row& r8, uint32_t (&a)[4]) {
    const __half2 sixteenth = __half2half2(__ushort_as_half(0x2c00));  // 1/16
    const uint32_t w8 = w >> 8;
    a[0] = as_u32(__hmul2(__hsub2(as_h2(lop3_and_or<0x000f000fu, 0x64006400u>(w)), as_h2(r0.zlo)), as_h2(r0.s)));
    a[2] = as_u32(__hmul2(__hfma2(as_h2(lop3_and_or<0x00f000f0u, 0x64006400u>(w)), sixteenth, as_h2(r0.zhi)),
                          as_h2(r0.s)));
    a[1] = as_u32(__hmul2(__hsub2(as_h2(lop3_and_or<0x000f000fu, 0x64006400u>(w8)), as_h2(r8.zlo)), as_h2(r8.s)));
    a[3] = as_u32(__hmul2(__hfma2(as_h2(lop3_and_or<0x00f000f0u, 0x64006400u>(w8)), sixteenth, as_h2(r8.zhi)),
                          as_h2(r8.s)));
  }
  // Column-ordered pairs (original AWQ layout): pair p = columns 2p, 2p+1 of the word.
  __device__ __forceinline__ static uint32_t pair(uint32_t q, uint32_t z, uint32_t s2) {
    const uint32_t tq = lop3_and_or<0x000f000fu, 0x64006400u>(q);
    const uint32_t tz = lop3_and_or<0x000f000fu, 0x64006400u>(z);
    return as_u32(__hmul2(__hsub2(as_h2(tq), as_h2(tz)), as_h2(s2)));
  }
  __device__ __forceinline__ static void mma(float (&d)[4], const uint32_t (&a)[4], const uint32_t (&b)[2]) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
        "{%8, %9}, {%0, %1, %2, %3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
  }
  __device__ __forceinline__ static __half from_float(float v) { return __float2half_rn(v); }
  __device__ __forceinline__ static float to_float(__half v) { return __half2float(v); }
};

// bf16 (7 mantissa bits): each nibble is shifted to the bottom of its half and ORed into
// 128.0 (0x4300); subtracting (128 + z) gives q - z exactly, one rounding at * s.
template <>
struct Dq<__nv_bfloat16> {
  struct Row {
    uint32_t zb, s;  // (128 + z) = 0x4300 | z, and the scale, each in both halves
  };
  __device__ __forceinline__ static Row make(uint32_t s_bits, uint32_t z) {
    Row r;
    r.zb = (0x4300u | z) * 0x10001u;
    r.s = s_bits * 0x10001u;
    return r;
  }
  __device__ __forceinline__ static uint32_t sub_mul(uint32_t t, uint32_t zb, uint32_t s) {
    return as_u32(__hmul2(__hsub2(as_b2(t), as_b2(zb)), as_b2(s)));
  }
  // Same fragment layout as the fp16 one; nibble pair (i, i+4) is shifted to the bottom.
  __device__ __forceinline__ static void frag(uint32_t w, const Row& r0, const Row& r8, uint32_t (&a)[4]) {
    a[0] = sub_mul(lop3_and_or<0x000f000fu, 0x43004300u>(w), r0.zb, r0.s);
    a[2] = sub_mul(lop3_and_or<0x000f000fu, 0x43004300u>(w >> 4), r0.zb, r0.s);
    a[1] = sub_mul(lop3_and_or<0x000f000fu, 0x43004300u>(w >> 8), r8.zb, r8.s);
    a[3] = sub_mul(lop3_and_or<0x000f000fu, 0x43004300u>(w >> 12), r8.zb, r8.s);
  }
  __device__ __forceinline__ static uint32_t pair(uint32_t q, uint32_t z, uint32_t s2) {
    const uint32_t tq = lop3_and_or<0x000f000fu, 0x43004300u>(q);
    const uint32_t tz = lop3_and_or<0x000f000fu, 0x43004300u>(z);
    return sub_mul(tq, tz, s2);
  }
  __device__ __forceinline__ static void mma(float (&d)[4], const uint32_t (&a)[4], const uint32_t (&b)[2]) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
        "{%8, %9}, {%0, %1, %2, %3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
  }
  __device__ __forceinline__ static __nv_bfloat16 from_float(float v) { return __float2bfloat16_rn(v); }
  __device__ __forceinline__ static float to_float(__nv_bfloat16 v) { return __bfloat162float(v); }
};

}  // namespace awq
}  // namespace quantfuse
