// AWQ W4A16 prefill GEMM on Hopper, float16 activations (see awq_gemm_sm90.cuh), plus the
// dtype-independent pieces: the int4 weight preparation and the config choice.
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

}  // namespace

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
  return prepare_zeros_bf16(qzeros, scales, zeros_out, groups, N, stream);
}

// Between 256 and 1024 tokens, an odd number of 128-token tiles: config 4 (128-token tiles,
// stream-K).  The 256-token tiles of configs 2 and 3 then run with a half-empty last tile,
// and configs 0 and 1 with an extra wave.  H100, fp16, group 128, the four Llama shapes at
// M = 320, 384 and 640 (benchmarks/probe/awq_sm90_streamk_2026-11-24.txt): 10-35% faster than
// the cost model's choice at 11 of the 12 points, 9% slower at the other (4096 x 4096, M = 320).
// At an even number (M = 448, 512, 768) config 4 measured slower than the model's choice.
// Otherwise a cost model: a persistent kernel's time ~ (waves of tiles over the SMs) x (time
// of one wave of that tile), the latter measured on an H100 at K = 4096 (µs; each config's
// per-wave time scales alike with K): 64x128x128 19, 64x128x64 22, 64x256 26.5,
// 128x256 cluster 2x1 47.  Of configs 0-3 it picks the measured-fastest in 23 of the 24
// benchmarked (shape, M) points (fp16, group 128, M 128..8192), and one 0.2% slower in the other.
int choose_config(int64_t M, int64_t N, int64_t K, int group_size, int sm_count) {
  if (M > 256 && M < 1024 && ((M + 127) / 128) % 2 == 1) return 4;
  const int64_t sms = sm_count > 0 ? sm_count : 132;
  auto waves = [&](int64_t tiles) { return double((tiles + sms - 1) / sms); };
  auto tiles = [&](int64_t tm, int64_t tn) { return ((N + tm - 1) / tm) * ((M + tn - 1) / tn); };
  const bool k128 = K % 128 == 0 && (group_size == K || group_size % 128 == 0);
  const double t_small = waves(tiles(64, 128)) * (k128 ? 19.0 : 22.0);
  const double t_medium = waves(tiles(64, 256)) * 26.5;
  const double t_large = waves(tiles(128, 256)) * 47.0;
  if (t_large <= t_medium && t_large <= t_small) return 3;
  if (t_medium <= t_small) return 2;
  return k128 ? 1 : 0;
}

int gemm_f16(const GemmParams& p) { return dispatch<cutlass::half_t>(p); }

}  // namespace quantfuse::awq_sm90
