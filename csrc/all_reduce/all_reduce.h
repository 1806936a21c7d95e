// quantfuse one-shot all-reduce over symmetric memory: launcher interface (plain C++, no torch
// headers).  all_reduce_kernels.cu implements it with CUDA only; all_reduce_ops.cpp checks tensors.
#pragma once

#include <cstdint>
#include <cuda_runtime.h>

namespace quantfuse {
namespace allreduce {

constexpr int kMaxBlocks = 32;  // blocks * world signal-pad slots per rank (torch's pads hold 512)
constexpr int kThreads = 512;

// out[i] = sum over ranks r (in rank order) of buffers[r][i], for `vecs` 16-byte vectors of float16:
// each rank first copies its x into its own buffer (buffers[rank]), then every block meets the same
// block of every peer through the signal pads (pads[r], one uint32 per block and peer, zero between
// calls), reads the peers' vectors, sums in float32 and rounds once, and meets them again before it
// returns (so that no rank's next call writes a buffer a peer still reads).  buffers and pads: device
// arrays of `world` device pointers (torch's symmetric-memory handle's buffer_ptrs_dev and
// signal_pad_ptrs_dev).
cudaError_t launch_one_shot_half(const void* x, void* out, void* const* buffers, uint32_t* const* pads, int rank,
                                 int world, int64_t vecs, cudaStream_t stream);

}  // namespace allreduce
}  // namespace quantfuse
