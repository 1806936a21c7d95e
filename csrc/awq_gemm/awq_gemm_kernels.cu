// quantfuse AWQ W4A16 CUDA kernels (CUDA headers only; no torch).
//
// * awq_gemm_kernel: streams the repacked int4 weights once (16-byte cp.async.cg per lane,
//   L1 bypassed, a per-warp shared-memory ring of 11 steps in flight), dequantizes them in
//   registers (lop3 + magic number, zeros and scales in half2/bfloat162 math) straight
//   into mma.sync.m16n8k16 B fragments, and accumulates in fp32.  Each warp owns a
//   64-column strip and a contiguous K range; the 8 warps of a block reduce through
//   shared memory; blocks split K when the strips alone cannot fill the GPU, and a
//   second small kernel sums the fp32 partials.
// * awq_dequantize_kernel: the original AWQ layout to a dense [K, N] weight.
// * awq_repack_kernel: the original AWQ layout to the GEMM's fragment layout.

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "awq_gemm/awq_gemm.h"

namespace quantfuse {
namespace awq {
namespace {

constexpr int kDefaultWarps = 4;  // warps per block of the GEMM kernel (4 or 8)
constexpr int kRedStride = kStripN + 8;  // padded row of the reduction buffer (floats)

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

// fp16: per column pair the zero is held as (1024 + z) for the low nibbles and
// -(64 + z) for the high nibbles; both give q - z exactly, one rounding at * s.
template <>
struct Dq<__half> {
  struct Col {
    uint32_t zlo, zhi, s;
  };
  __device__ __forceinline__ static Col make(__half s, int z) {
    Col c;
    c.zlo = as_u32(__half2half2(__float2half_rn(1024.0f + z)));
    c.zhi = as_u32(__half2half2(__float2half_rn(-64.0f - z)));
    c.s = as_u32(__half2half2(s));
    return c;
  }
  // word: 8 nibbles of two n8 fragments; b[c][0..1] = mma B registers of n8 tile c.
  __device__ __forceinline__ static void frag(uint32_t w, const Col& c0, const Col& c1, uint32_t (&b)[2][2]) {
    const __half2 sixteenth = __half2half2(__ushort_as_half(0x2c00));  // 1/16
    const uint32_t w8 = w >> 8;
    const uint32_t lo0 = lop3_and_or<0x000f000fu, 0x64006400u>(w);
    const uint32_t hi0 = lop3_and_or<0x00f000f0u, 0x64006400u>(w);
    const uint32_t lo1 = lop3_and_or<0x000f000fu, 0x64006400u>(w8);
    const uint32_t hi1 = lop3_and_or<0x00f000f0u, 0x64006400u>(w8);
    b[0][0] = as_u32(__hmul2(__hsub2(as_h2(lo0), as_h2(c0.zlo)), as_h2(c0.s)));
    b[0][1] = as_u32(__hmul2(__hfma2(as_h2(hi0), sixteenth, as_h2(c0.zhi)), as_h2(c0.s)));
    b[1][0] = as_u32(__hmul2(__hsub2(as_h2(lo1), as_h2(c1.zlo)), as_h2(c1.s)));
    b[1][1] = as_u32(__hmul2(__hfma2(as_h2(hi1), sixteenth, as_h2(c1.zhi)), as_h2(c1.s)));
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
  struct Col {
    uint32_t zb, s;
  };
  __device__ __forceinline__ static Col make(__nv_bfloat16 s, int z) {
    Col c;
    c.zb = as_u32(__bfloat162bfloat162(__float2bfloat16_rn(128.0f + z)));
    c.s = as_u32(__bfloat162bfloat162(s));
    return c;
  }
  __device__ __forceinline__ static uint32_t sub_mul(uint32_t t, uint32_t zb, uint32_t s) {
    return as_u32(__hmul2(__hsub2(as_b2(t), as_b2(zb)), as_b2(s)));
  }
  __device__ __forceinline__ static void frag(uint32_t w, const Col& c0, const Col& c1, uint32_t (&b)[2][2]) {
    b[0][0] = sub_mul(lop3_and_or<0x000f000fu, 0x43004300u>(w), c0.zb, c0.s);
    b[0][1] = sub_mul(lop3_and_or<0x000f000fu, 0x43004300u>(w >> 4), c0.zb, c0.s);
    b[1][0] = sub_mul(lop3_and_or<0x000f000fu, 0x43004300u>(w >> 8), c1.zb, c1.s);
    b[1][1] = sub_mul(lop3_and_or<0x000f000fu, 0x43004300u>(w >> 12), c1.zb, c1.s);
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

// ----------------------------------------------------------------------------- GEMM

// Per-warp ring of kRing k-steps in shared memory, filled by cp.async (16 bytes per lane
// per step: the lane's own fragments), so that ~kRing-1 steps of weights per warp are in
// flight without holding registers.  (An L2 evict_first cache hint on these cp.async
// faulted with "illegal instruction" on the H100 (driver 580, nvcc 13.0): left out.)  A step that starts a quantization group also
// brings the strip's 64 scales (128 B) and 8 packed zero words (32 B).
constexpr int kRing = 12;
constexpr int kSlotW = 512;                  // weights: 32 lanes x 16 B
constexpr int kSlotS = kStripN * 2;          // scales of the strip (fp16/bf16)
constexpr int kSlotZ = 32;                   // 8 packed zero words
constexpr int kSlot = kSlotW + kSlotS + kSlotZ;
constexpr int smem_bytes(int warps) { return warps * kRing * kSlot; }
static_assert(kRing * kSlot >= 16 * kRedStride * 4, "reduction buffer aliases the ring");

__device__ __forceinline__ void cp_async16(void* smem, const void* gmem) {
  const uint32_t s = (uint32_t)__cvta_generic_to_shared(smem);
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(s), "l"(gmem));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N>
__device__ __forceinline__ void cp_async_wait() { asm volatile("cp.async.wait_group %0;\n" ::"n"(N)); }

// Grid: x = N/64 strips, y = K splits, z = M tiles of 16*MT rows.  Block: W warps, each
// a contiguous share of the block's K range for the block's 64-column strip.
template <typename T, int MT, int W>
__global__ void __launch_bounds__(W * 32) awq_gemm_kernel(
    const T* __restrict__ x, const uint4* __restrict__ wp, const T* __restrict__ scales,
    const uint32_t* __restrict__ qzeros, const T* __restrict__ bias, T* __restrict__ out,
    float* __restrict__ partial, int M, int N, int K, int group_size, int splits) {
  using D = Dq<T>;
  using Col = typename D::Col;
  extern __shared__ __align__(16) unsigned char smem[];

  const int strip = blockIdx.x;
  const int split = blockIdx.y;
  const int m0 = blockIdx.z * 16 * MT;
  const int warp = threadIdx.x >> 5;
  const int lane = threadIdx.x & 31;
  const int KT = K >> 4;
  const int per_block = (KT + splits - 1) / splits;
  const int kb = min(KT, split * per_block);
  const int ke = min(KT, kb + per_block);
  const int per_warp = (ke - kb + W - 1) / W;
  const int wb = min(ke, kb + warp * per_warp);
  const int we = min(ke, wb + per_warp);
  const int steps = we - wb;

  float acc[MT][8][4];
#pragma unroll
  for (int mt = 0; mt < MT; ++mt)
#pragma unroll
    for (int t = 0; t < 8; ++t)
#pragma unroll
      for (int i = 0; i < 4; ++i) acc[mt][t][i] = 0.0f;

  unsigned char* ring = smem + warp * (kRing * kSlot);
  const uint4* wl = wp + (size_t)strip * KT * 32 + lane;
  const T* s_strip = scales + strip * kStripN;
  const uint32_t* z_strip = qzeros + strip * (kStripN / 8);
  const int n8 = N >> 3;

  // Position inside its quantization group of the next step to issue / to consume
  // (steps are issued and consumed in order; a group start needs its scales/zeros).
  const int gsteps = group_size >> 4;
  int issue_pos = wb % gsteps;
  int use_pos = issue_pos;
  auto issue = [&](int i) {
    const bool start = i == 0 || issue_pos == 0;
    issue_pos = issue_pos + 1 == gsteps ? 0 : issue_pos + 1;
    if (i < steps) {
      unsigned char* slot = ring + (i % kRing) * kSlot;
      const int kt = wb + i;
      cp_async16(slot + lane * 16, wl + (size_t)kt * 32);
      if (start && lane < 10) {
        const int g = (kt << 4) / group_size;
        if (lane < 8)
          cp_async16(slot + kSlotW + lane * 16, s_strip + (size_t)g * N + lane * 8);
        else
          cp_async16(slot + kSlotW + kSlotS + (lane - 8) * 16, z_strip + (size_t)g * n8 + (lane - 8) * 4);
      }
    }
    cp_async_commit();  // possibly empty: keeps one group per step
  };

  const int arow = lane >> 2;
  const int acol = 2 * (lane & 3);
  const int zshift = 4 * awq_order(lane >> 2);
  const T* arow_ptr[MT][2];
#pragma unroll
  for (int mt = 0; mt < MT; ++mt)
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int r = m0 + mt * 16 + arow + 8 * h;
      arow_ptr[mt][h] = r < M ? x + (size_t)r * K + acol : nullptr;
    }
  auto load_a = [&](int kt, uint32_t (&a)[MT][4]) {
    const int ko = kt << 4;
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
      a[mt][0] = arow_ptr[mt][0] ? __ldg(reinterpret_cast<const unsigned int*>(arow_ptr[mt][0] + ko)) : 0u;
      a[mt][1] = arow_ptr[mt][1] ? __ldg(reinterpret_cast<const unsigned int*>(arow_ptr[mt][1] + ko)) : 0u;
      a[mt][2] = arow_ptr[mt][0] ? __ldg(reinterpret_cast<const unsigned int*>(arow_ptr[mt][0] + ko + 8)) : 0u;
      a[mt][3] = arow_ptr[mt][1] ? __ldg(reinterpret_cast<const unsigned int*>(arow_ptr[mt][1] + ko + 8)) : 0u;
    }
  };

#pragma unroll
  for (int i = 0; i < kRing - 1; ++i) issue(i);

  Col cols[8];
  uint32_t a_next[MT][4];
  if (steps > 0) load_a(wb, a_next);

  for (int i = 0; i < steps; ++i) {
    cp_async_wait<kRing - 2>();  // this step's group has landed (own copies)
    __syncwarp();                // ... and the other lanes' (scales/zeros), and all lanes left step i-1
    const unsigned char* slot = ring + (i % kRing) * kSlot;
    const uint4 w = *reinterpret_cast<const uint4*>(slot + lane * 16);
    const bool start = i == 0 || use_pos == 0;
    use_pos = use_pos + 1 == gsteps ? 0 : use_pos + 1;
    if (start) {
      const T* ss = reinterpret_cast<const T*>(slot + kSlotW);
      const uint32_t* zz = reinterpret_cast<const uint32_t*>(slot + kSlotW + kSlotS);
#pragma unroll
      for (int c = 0; c < 8; ++c) {  // c = 2*j + half: column 16j + 8*half + lane/4 of the strip
        const int z = (int)((zz[c] >> zshift) & 0xFu);
        cols[c] = D::make(ss[8 * c + (lane >> 2)], z);
      }
    }
    __syncwarp();      // every lane has read slot i before any lane refills slot i-1 ... i
    issue(i + kRing - 1);  // refills slot (i - 1) % kRing
    uint32_t a[MT][4];
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
      for (int r = 0; r < 4; ++r) a[mt][r] = a_next[mt][r];
    if (i + 1 < steps) load_a(wb + i + 1, a_next);
    const uint32_t words[4] = {w.x, w.y, w.z, w.w};
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      uint32_t b[2][2];
      D::frag(words[j], cols[2 * j], cols[2 * j + 1], b);
#pragma unroll
      for (int mt = 0; mt < MT; ++mt) {
        D::mma(acc[mt][2 * j], a[mt], b[0]);
        D::mma(acc[mt][2 * j + 1], a[mt], b[1]);
      }
    }
  }
  cp_async_wait<0>();
  __syncthreads();  // the ring becomes the reduction buffer

  float* red = reinterpret_cast<float*>(smem);
  // Reduce the W warps' partial tiles, one 16-row M tile at a time.
#pragma unroll
  for (int mt = 0; mt < MT; ++mt) {
    float* mine = red + warp * 16 * kRedStride;
#pragma unroll
    for (int t = 0; t < 8; ++t) {
      const int col = t * 8 + acol;
      *reinterpret_cast<float2*>(mine + arow * kRedStride + col) = make_float2(acc[mt][t][0], acc[mt][t][1]);
      *reinterpret_cast<float2*>(mine + (arow + 8) * kRedStride + col) = make_float2(acc[mt][t][2], acc[mt][t][3]);
    }
    __syncthreads();
    for (int e = threadIdx.x; e < 16 * (kStripN / 4); e += W * 32) {
      const int row = e >> 4;         // 0..15
      const int col = (e & 15) * 4;   // 0..60
      float4 s = make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll
      for (int w = 0; w < W; ++w) {
        const float4 v = *reinterpret_cast<const float4*>(red + w * 16 * kRedStride + row * kRedStride + col);
        s.x += v.x; s.y += v.y; s.z += v.z; s.w += v.w;
      }
      const int gm = m0 + mt * 16 + row;
      const int gn = strip * kStripN + col;
      if (gm < M) {
        if (partial != nullptr) {
          *reinterpret_cast<float4*>(partial + ((size_t)split * M + gm) * N + gn) = s;
        } else {
          if (bias != nullptr) {
            s.x += D::to_float(bias[gn]); s.y += D::to_float(bias[gn + 1]);
            s.z += D::to_float(bias[gn + 2]); s.w += D::to_float(bias[gn + 3]);
          }
          T o[4] = {D::from_float(s.x), D::from_float(s.y), D::from_float(s.z), D::from_float(s.w)};
          *reinterpret_cast<uint2*>(out + (size_t)gm * N + gn) = *reinterpret_cast<const uint2*>(o);
        }
      }
    }
    __syncthreads();
  }
}

// out[m, n] = sum_s partial[s, m, n] + bias[n], 4 elements per thread (N % 4 == 0).
template <typename T>
__global__ void splitk_reduce_kernel(const float* __restrict__ partial, const T* __restrict__ bias,
                                     T* __restrict__ out, int M, int N, int splits) {
  using D = Dq<T>;
  const size_t total = (size_t)M * N;
  const size_t i = ((size_t)blockIdx.x * blockDim.x + threadIdx.x) * 4;
  if (i >= total) return;
  float4 s = *reinterpret_cast<const float4*>(partial + i);
  for (int p = 1; p < splits; ++p) {
    const float4 v = *reinterpret_cast<const float4*>(partial + (size_t)p * total + i);
    s.x += v.x; s.y += v.y; s.z += v.z; s.w += v.w;
  }
  if (bias != nullptr) {
    const int n = (int)(i % N);
    s.x += D::to_float(bias[n]); s.y += D::to_float(bias[n + 1]);
    s.z += D::to_float(bias[n + 2]); s.w += D::to_float(bias[n + 3]);
  }
  T o[4] = {D::from_float(s.x), D::from_float(s.y), D::from_float(s.z), D::from_float(s.w)};
  *reinterpret_cast<uint2*>(out + i) = *reinterpret_cast<const uint2*>(o);
}

// ----------------------------------------------------------------------------- dequantize

// One thread per packed int32: 8 outputs (16-byte store), 8 scales (16-byte load).
template <typename T>
__global__ void awq_dequantize_kernel(const uint32_t* __restrict__ qweight, const T* __restrict__ scales,
                                      const uint32_t* __restrict__ qzeros, T* __restrict__ out, int K, int N,
                                      int group_size) {
  using D = Dq<T>;
  const int n8 = N >> 3;
  const size_t total = (size_t)K * n8;
  for (size_t idx = (size_t)blockIdx.x * blockDim.x + threadIdx.x; idx < total;
       idx += (size_t)gridDim.x * blockDim.x) {
    const int k = (int)(idx / n8);
    const int c = (int)(idx % n8);
    const int g = k / group_size;
    const uint32_t q = __ldg(qweight + idx);
    const uint32_t z = __ldg(qzeros + (size_t)g * n8 + c);
    const uint4 s = __ldg(reinterpret_cast<const uint4*>(scales + (size_t)g * N + 8 * c));
    uint4 o;
    o.x = D::pair(q, z, s.x);
    o.y = D::pair(q >> 4, z >> 4, s.y);
    o.z = D::pair(q >> 8, z >> 8, s.z);
    o.w = D::pair(q >> 12, z >> 12, s.w);
    *reinterpret_cast<uint4*>(out + (size_t)k * N + 8 * c) = o;
  }
}

// ----------------------------------------------------------------------------- repack

__global__ void awq_repack_kernel(const uint32_t* __restrict__ qweight, uint32_t* __restrict__ out, int K, int N) {
  const int KT = K >> 4;
  const int n8 = N >> 3;
  const size_t total = (size_t)(N / kStripN) * KT * 128;
  for (size_t o = (size_t)blockIdx.x * blockDim.x + threadIdx.x; o < total; o += (size_t)gridDim.x * blockDim.x) {
    const int j = (int)(o & 3);
    const int lane = (int)((o >> 2) & 31);
    const int kt = (int)((o >> 7) % KT);
    const int strip = (int)((o >> 7) / KT);
    uint32_t word = 0;
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      const int k = kt * 16 + 2 * (lane & 3) + (i & 1) + 8 * ((i >> 1) & 1);
      const int n = strip * kStripN + j * 16 + (lane >> 2) + 8 * (i >> 2);
      const uint32_t src = __ldg(qweight + (size_t)k * n8 + (n >> 3));
      const uint32_t q = (src >> (4 * awq_order(n & 7))) & 0xFu;
      word |= q << (4 * awq_order(i));
    }
    out[o] = word;
  }
}

// ----------------------------------------------------------------------------- host side

int sm_count(int device) {
  static int cached[64] = {0};
  if (device < 0 || device >= 64) return 132;
  if (cached[device] == 0) {
    int n = 0;
    if (cudaDeviceGetAttribute(&n, cudaDevAttrMultiProcessorCount, device) != cudaSuccess || n <= 0) n = 132;
    cached[device] = n;
  }
  return cached[device];
}

// Raises the kernel's dynamic shared-memory limit (once) and returns its occupancy.
template <typename T, int MT, int W>
int prepare_kernel() {
  static int cached = 0;
  if (cached == 0) {
    cudaFuncSetAttribute(awq_gemm_kernel<T, MT, W>, cudaFuncAttributeMaxDynamicSharedMemorySize, smem_bytes(W));
    int n = 0;
    if (cudaOccupancyMaxActiveBlocksPerMultiprocessor(&n, awq_gemm_kernel<T, MT, W>, W * 32, smem_bytes(W)) !=
            cudaSuccess || n <= 0)
      n = 1;
    cached = n;
  }
  return cached;
}

int mt_for(int M) { return M <= 16 ? 1 : (M <= 32 ? 2 : 4); }
int warps_for(int warps) { return warps == 8 ? 8 : (warps == 4 ? 4 : kDefaultWarps); }

template <typename T, int W>
int occupancy(int mt) {
  return mt == 1 ? prepare_kernel<T, 1, W>() : (mt == 2 ? prepare_kernel<T, 2, W>() : prepare_kernel<T, 4, W>());
}

// Memory-bound: all blocks resident at once (one round: each warp streams one long
// contiguous K range, paying the pipeline fill once), as many as fit; K splits only to
// fill the slots, each warp keeping at least 4 steps.
template <typename T>
int splits_for(int M, int N, int K, int device, int warps) {
  const int W = warps_for(warps);
  const int mt = mt_for(M);
  const int occ = W == 8 ? occupancy<T, 8>(mt) : occupancy<T, 4>(mt);
  const int tiles = (N / kStripN) * ((M + 16 * mt - 1) / (16 * mt));
  const int slots = sm_count(device) * occ;
  const int KT = K / 16;
  int max_s = KT / (W * 4);
  if (max_s > 16) max_s = 16;
  if (max_s < 1) max_s = 1;
  int s = slots / tiles;
  if (s < 1) s = 1;
  return s > max_s ? max_s : s;
}

template <typename T, int MT, int W>
cudaError_t run_gemm(const void* x, const uint32_t* wp, const void* scales, const uint32_t* qzeros,
                     const void* bias, void* out, float* partial, int M, int N, int K, int group_size, int splits,
                     cudaStream_t stream) {
  prepare_kernel<T, MT, W>();
  dim3 grid(N / kStripN, splits, (M + 16 * MT - 1) / (16 * MT));
  awq_gemm_kernel<T, MT, W><<<grid, W * 32, smem_bytes(W), stream>>>(
      static_cast<const T*>(x), reinterpret_cast<const uint4*>(wp), static_cast<const T*>(scales), qzeros,
      static_cast<const T*>(bias), static_cast<T*>(out), splits > 1 ? partial : nullptr, M, N, K, group_size,
      splits);
  cudaError_t err = cudaGetLastError();
  if (err != cudaSuccess || splits <= 1) return err;
  const size_t quads = (size_t)M * N / 4;
  const int threads = 256;
  splitk_reduce_kernel<T><<<(unsigned)((quads + threads - 1) / threads), threads, 0, stream>>>(
      partial, static_cast<const T*>(bias), static_cast<T*>(out), M, N, splits);
  return cudaGetLastError();
}

template <typename T, int W>
cudaError_t gemm_warps(const void* x, const uint32_t* wp, const void* scales, const uint32_t* qzeros,
                       const void* bias, void* out, float* partial, int M, int N, int K, int group_size, int splits,
                       cudaStream_t stream) {
  switch (mt_for(M)) {
    case 1: return run_gemm<T, 1, W>(x, wp, scales, qzeros, bias, out, partial, M, N, K, group_size, splits, stream);
    case 2: return run_gemm<T, 2, W>(x, wp, scales, qzeros, bias, out, partial, M, N, K, group_size, splits, stream);
    default: return run_gemm<T, 4, W>(x, wp, scales, qzeros, bias, out, partial, M, N, K, group_size, splits, stream);
  }
}

template <typename T>
cudaError_t gemm_dtype(const void* x, const uint32_t* wp, const void* scales, const uint32_t* qzeros,
                       const void* bias, void* out, float* partial, int M, int N, int K, int group_size, int splits,
                       int warps, cudaStream_t stream) {
  if (warps_for(warps) == 8)
    return gemm_warps<T, 8>(x, wp, scales, qzeros, bias, out, partial, M, N, K, group_size, splits, stream);
  return gemm_warps<T, 4>(x, wp, scales, qzeros, bias, out, partial, M, N, K, group_size, splits, stream);
}

unsigned grid_for(size_t work, int threads) {
  size_t blocks = (work + threads - 1) / threads;
  const size_t cap = 132 * 32;
  return (unsigned)(blocks < cap ? (blocks > 0 ? blocks : 1) : cap);
}

}  // namespace

cudaError_t launch_repack(const uint32_t* qweight, uint32_t* out, int K, int N, cudaStream_t stream) {
  const size_t total = (size_t)(N / kStripN) * (K / 16) * 128;
  awq_repack_kernel<<<grid_for(total, 256), 256, 0, stream>>>(qweight, out, K, N);
  return cudaGetLastError();
}

cudaError_t launch_dequantize(DType dtype, const uint32_t* qweight, const void* scales, const uint32_t* qzeros,
                              void* out, int K, int N, int group_size, cudaStream_t stream) {
  const size_t total = (size_t)K * (N / 8);
  const unsigned grid = grid_for(total, 256);
  if (dtype == DType::kHalf)
    awq_dequantize_kernel<__half><<<grid, 256, 0, stream>>>(qweight, static_cast<const __half*>(scales), qzeros,
                                                            static_cast<__half*>(out), K, N, group_size);
  else
    awq_dequantize_kernel<__nv_bfloat16><<<grid, 256, 0, stream>>>(
        qweight, static_cast<const __nv_bfloat16*>(scales), qzeros, static_cast<__nv_bfloat16*>(out), K, N,
        group_size);
  return cudaGetLastError();
}

int gemm_splits(DType dtype, int M, int N, int K, int device, int warps) {
  return dtype == DType::kHalf ? splits_for<__half>(M, N, K, device, warps)
                               : splits_for<__nv_bfloat16>(M, N, K, device, warps);
}

cudaError_t launch_gemm(DType dtype, const void* x, const uint32_t* wpacked, const void* scales,
                        const uint32_t* qzeros, const void* bias, void* out, float* partial, int M, int N, int K,
                        int group_size, int splits, int warps, cudaStream_t stream) {
  if (M <= 0) return cudaSuccess;
  if (dtype == DType::kHalf)
    return gemm_dtype<__half>(x, wpacked, scales, qzeros, bias, out, partial, M, N, K, group_size, splits, warps,
                              stream);
  return gemm_dtype<__nv_bfloat16>(x, wpacked, scales, qzeros, bias, out, partial, M, N, K, group_size, splits,
                                   warps, stream);
}

}  // namespace awq
}  // namespace quantfuse
