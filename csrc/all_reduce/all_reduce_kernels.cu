// quantfuse one-shot all-reduce of float16 over symmetric memory (all_reduce.h).  torch's
// symmetric-memory kernels take bfloat16 and float32 only; this is the same one-shot algorithm for
// float16: a copy into the rank's registered buffer, a barrier of each block with the same block of
// every peer, the peers' values read over NVLink and summed in float32, and a second barrier.
#include <cuda/atomic>
#include <cuda_fp16.h>

#include "all_reduce/all_reduce.h"

namespace quantfuse {
namespace allreduce {
namespace {

using SysAtomic = cuda::atomic_ref<uint32_t, cuda::thread_scope_system>;

// A signal 0 -> 1 in a peer's pad (release: the block's writes before it are visible to the peer
// that acquires it), and 1 -> 0 in the own pad once the peer's arrives (acquire).  Each pair leaves
// the pads at zero, as torch's own kernels on the same pads expect.
__device__ __forceinline__ void put_signal(uint32_t* addr) {
  SysAtomic a(*addr);
  uint32_t expected = 0;
  while (!a.compare_exchange_strong(expected, 1u, cuda::std::memory_order_release, cuda::std::memory_order_relaxed))
    expected = 0;
}

__device__ __forceinline__ void wait_signal(uint32_t* addr) {
  SysAtomic a(*addr);
  uint32_t expected = 1;
  while (!a.compare_exchange_strong(expected, 0u, cuda::std::memory_order_acquire, cuda::std::memory_order_relaxed))
    expected = 1;
}

// Block b of this rank meets block b of every rank: thread t < world signals rank t and waits for
// rank t's signal.
__device__ __forceinline__ void meet(uint32_t* const* pads, int rank, int world) {
  __syncthreads();
  if ((int)threadIdx.x < world) {
    put_signal(pads[threadIdx.x] + blockIdx.x * world + rank);
    wait_signal(pads[rank] + blockIdx.x * world + threadIdx.x);
  }
  __syncthreads();
}

__device__ __forceinline__ void add_halves(float (&acc)[8], const uint4& v) {
  const __half2* h = reinterpret_cast<const __half2*>(&v);
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const float2 f = __half22float2(h[i]);
    acc[2 * i] += f.x;
    acc[2 * i + 1] += f.y;
  }
}

__global__ void __launch_bounds__(kThreads) one_shot_half_kernel(const uint4* __restrict__ x, uint4* __restrict__ out,
                                                                 void* const* buffers, uint32_t* const* pads,
                                                                 int rank, int world, int64_t vecs) {
  const int64_t stride = (int64_t)gridDim.x * blockDim.x;
  const int64_t first = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
  // The same vectors per block in both loops: block b reads from its peers what their block b wrote.
  uint4* own = static_cast<uint4*>(buffers[rank]);
  for (int64_t i = first; i < vecs; i += stride) own[i] = x[i];
  meet(pads, rank, world);
  for (int64_t i = first; i < vecs; i += stride) {
    float acc[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
    for (int r = 0; r < world; ++r) {  // rank order on every rank: every rank gets the same sums
      // .cv: the peer's line as it is now, not one an earlier call left in this SM's L1
      add_halves(acc, __ldcv(static_cast<const uint4*>(buffers[r]) + i));
    }
    uint4 v;
    __half2* h = reinterpret_cast<__half2*>(&v);
#pragma unroll
    for (int j = 0; j < 4; ++j) h[j] = __floats2half2_rn(acc[2 * j], acc[2 * j + 1]);
    out[i] = v;
  }
  meet(pads, rank, world);
}

}  // namespace

cudaError_t launch_one_shot_half(const void* x, void* out, void* const* buffers, uint32_t* const* pads, int rank,
                                 int world, int64_t vecs, cudaStream_t stream) {
  if (vecs <= 0) return cudaSuccess;
  if (world < 1 || rank < 0 || rank >= world || world > kThreads) return cudaErrorInvalidValue;
  int64_t blocks = (vecs + kThreads - 1) / kThreads;
  if (blocks > kMaxBlocks) blocks = kMaxBlocks;
  one_shot_half_kernel<<<(unsigned)blocks, kThreads, 0, stream>>>(static_cast<const uint4*>(x),
                                                                   static_cast<uint4*>(out), buffers, pads, rank,
                                                                   world, vecs);
  return cudaGetLastError();
}

}  // namespace allreduce
}  // namespace quantfuse
