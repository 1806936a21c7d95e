// AWQ W4A16 prefill GEMM on Hopper (see awq_gemm_sm90.cuh): the int4 weight and zero
// preparation, the choice of tile configuration, and the dispatch to the configurations'
// kernels (instantiated in awq_gemm_sm90_tiles_c<C>.cu).
#include "awq_gemm/awq_gemm_sm90.cuh"

namespace quantfuse::awq_sm90 {

namespace {

// One thread per packed int32 of qweight [K, N/8]: its 8 values q[k, 8c..8c+7], one byte
// each, to their place in the prepared layout (tmp, one byte per value).
template <class LayoutQ>
__global__ void scatter_kernel(const uint32_t* __restrict__ qweight, uint8_t* __restrict__ tmp, int K, int N,
                               LayoutQ layout) {
  const int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  const int C = N / 8;
  if (i >= int64_t(K) * C) return;
  const int k = static_cast<int>(i / C), c = static_cast<int>(i % C);
  const uint32_t w = qweight[i];
#pragma unroll
  for (int j = 0; j < 8; ++j) {
    tmp[layout(8 * c + j, k, 0)] = static_cast<uint8_t>((w >> (4 * awq_nibble(j))) & 0xFu);
  }
}

// Two values per byte, element 2i in the low nibble (CUTLASS's sub-byte order).
__global__ void pack_kernel(const uint8_t* __restrict__ tmp, uint8_t* __restrict__ out, int64_t nbytes) {
  const int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= nbytes) return;
  out[i] = static_cast<uint8_t>((tmp[2 * i] & 0xF) | (tmp[2 * i + 1] << 4));
}

// The decode kernel's fragment layout (awq_gemm.h) to the prepared layout.  A (strip, k-step)
// of the fragment layout, 128 words, holds the 64 x 16 (n, k) values of four 16x16 atoms that
// sit side by side in the prepared layout (n-blocks fastest: 512 contiguous bytes).  Word j =
// 2jh + jl of lane l = 4g + t holds in nibble i = 4ih + 2im + il the value at n = 32jh + 16il +
// 8im + g, k = 4t + 2jl + ih of the block (awq_repack_kernel), whose place in the four atoms is
// 256 * (n / 16) + QuantAtom(n % 16, k % 16) (awq_gemm_sm90.cuh):
//   256 (2jh + il) + 32g + im + 4ih + 8 ((2t + jl) % 4) + 2 (t / 2).
// Values are placed in shared memory one byte each, then written out as whole words: reads and
// writes coalesced.  kTilesPerBlock blocks of the fragment layout per thread block.
constexpr int kTilesPerBlock = 2;

__global__ void from_fragments_kernel(const uint32_t* __restrict__ fragments, uint32_t* __restrict__ out, int64_t tiles,
                                      int KT, int n_blocks) {
  __shared__ __align__(16) uint8_t values[kTilesPerBlock][1024];
  const int sub = threadIdx.x >> 7, o = threadIdx.x & 127;
  const int64_t tile = int64_t(blockIdx.x) * kTilesPerBlock + sub;
  const bool active = tile < tiles;
  if (active) {
    const uint32_t w = __ldcs(fragments + tile * 128 + o);
    const int lane = o >> 2, j = o & 3, g = lane >> 2, t = lane & 3, jh = j >> 1, jl = j & 1;
    const int fixed = 512 * jh + 32 * g + 8 * ((2 * t + jl) & 3) + 2 * (t >> 1);
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      const int ih = i >> 2, im = (i >> 1) & 1, il = i & 1;
      values[sub][fixed + 256 * il + im + 4 * ih] = static_cast<uint8_t>((w >> (4 * i)) & 0xFu);
    }
  }
  __syncthreads();
  if (!active) return;
  const uint2 b = *reinterpret_cast<const uint2*>(&values[sub][8 * o]);
  // Bytes 0..7 (one value each, little-endian) to nibbles 0..7.
  const uint32_t lo = (b.x & 0xFu) | ((b.x >> 4) & 0xF0u) | ((b.x >> 8) & 0xF00u) | ((b.x >> 12) & 0xF000u);
  const uint32_t hi = (b.y & 0xFu) | ((b.y >> 4) & 0xF0u) | ((b.y >> 8) & 0xF00u) | ((b.y >> 12) & 0xF000u);
  const int strip = static_cast<int>(tile / KT), kt = static_cast<int>(tile % KT);
  // The block's first atom: n-block 4 * strip, k-block kt; 256 values = 32 words per atom.
  const int64_t base = (int64_t(kt) * n_blocks + 4 * strip) * 32;
  __stcs(out + base + o, lo | (hi << 16));
}

}  // namespace

cudaError_t launch_prepare_weight_from_fragments(const uint32_t* fragments, uint8_t* out, int K, int N,
                                                 cudaStream_t stream) {
  const int64_t tiles = int64_t(N / 64) * (K / 16);
  if (tiles == 0) return cudaSuccess;
  const unsigned blocks = static_cast<unsigned>((tiles + kTilesPerBlock - 1) / kTilesPerBlock);
  from_fragments_kernel<<<blocks, 128 * kTilesPerBlock, 0, stream>>>(fragments, reinterpret_cast<uint32_t*>(out),
                                                                      tiles, K / 16, N / 16);
  return cudaGetLastError();
}

cudaError_t launch_prepare_weight(const uint32_t* qweight, uint8_t* tmp, uint8_t* out, int K, int N,
                                  cudaStream_t stream) {
  const int64_t words = int64_t(K) * (N / 8);
  if (words == 0) return cudaSuccess;
  const int threads = 256;
  const unsigned blocks = static_cast<unsigned>((words + threads - 1) / threads);
  scatter_kernel<<<blocks, threads, 0, stream>>>(qweight, tmp, K, N, make_layout_q_reordered(N, K));
  cudaError_t err = cudaGetLastError();
  if (err != cudaSuccess) return err;
  const int64_t nbytes = int64_t(N) * K / 2;
  pack_kernel<<<static_cast<unsigned>((nbytes + threads - 1) / threads), threads, 0, stream>>>(tmp, out, nbytes);
  return cudaGetLastError();
}

cudaError_t launch_prepare_zeros(DType dtype, const uint32_t* qzeros, const void* scales, void* zeros_out, int groups,
                                 int N, cudaStream_t stream) {
  if (dtype == DType::kHalf) return prepare_zeros<cutlass::half_t>(qzeros, scales, zeros_out, groups, N, stream);
  return prepare_zeros<cutlass::bfloat16_t>(qzeros, scales, zeros_out, groups, N, stream);
}

namespace {
template <class T>
int dispatch(const GemmParams& p) {
  const int cfg = p.config >= 0 ? p.config
                                : choose_config(p.M, p.N, p.K, p.group_size, quantfuse::sm_count(p.device, 0));
  switch (cfg) {
    case 0: return run_config<T, 0>(p);
    case 1: return run_config<T, 1>(p);
    case 2: return run_config<T, 2>(p);
    case 3: return run_config<T, 3>(p);
    case 4: return run_config<T, 4>(p);
    case 5: return run_config<T, 5>(p);
    case 6: return run_config<T, 6>(p);
    case 7: return run_config<T, 7>(p);
    case 8: return run_config<T, 8>(p);
    case 9: return run_config<T, 9>(p);
    case 10: return run_config<T, 10>(p);
    case 11: return run_config<T, 11>(p);
    case 12: return run_config<T, 12>(p);
    case 13: return run_config<T, 13>(p);
    default: return kUnsupported;
  }
}
}  // namespace

int gemm_f16(const GemmParams& p) { return dispatch<cutlass::half_t>(p); }
int gemm_bf16(const GemmParams& p) { return dispatch<cutlass::bfloat16_t>(p); }

}  // namespace quantfuse::awq_sm90
