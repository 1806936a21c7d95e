// quantfuse::_one_shot_all_reduce_cuda: the float16 one-shot all-reduce (all_reduce_kernels.cu) on a
// buffer registered with torch's symmetric memory, called by compile_backend/all_reduce.py with the
// device addresses of its handle's pointer arrays.
#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include <cstdint>

#include "all_reduce/all_reduce.h"
#include "common/check.h"

namespace quantfuse {
namespace {

at::Tensor one_shot_all_reduce_cuda(const at::Tensor& x, const at::Tensor& buffer, int64_t buffer_ptrs,
                                    int64_t signal_pad_ptrs, int64_t rank, int64_t world) {
  QF_CHECK(x.is_cuda() && x.scalar_type() == at::kHalf && x.is_contiguous(),
           "quantfuse _one_shot_all_reduce_cuda: 'x' must be a contiguous CUDA float16 tensor");
  const int64_t nbytes = x.numel() * 2;
  QF_CHECK(nbytes % 16 == 0 && reinterpret_cast<uintptr_t>(x.data_ptr()) % 16 == 0,
           "quantfuse _one_shot_all_reduce_cuda: 'x' must be 16-byte aligned with a multiple of 16 bytes, got %lld",
           (long long)nbytes);
  QF_CHECK(buffer.is_cuda() && buffer.device() == x.device() && buffer.numel() * buffer.element_size() >= nbytes,
           "quantfuse _one_shot_all_reduce_cuda: 'buffer' must be on the device of 'x' and hold %lld bytes",
           (long long)nbytes);
  QF_CHECK(world >= 1 && rank >= 0 && rank < world && buffer_ptrs != 0 && signal_pad_ptrs != 0,
           "quantfuse _one_shot_all_reduce_cuda: rank %lld of %lld ranks, or null pointer arrays", (long long)rank,
           (long long)world);
  const c10::cuda::CUDAGuard guard(x.device());
  at::Tensor out = at::empty_like(x);
  const cudaError_t err = allreduce::launch_one_shot_half(
      x.data_ptr(), out.data_ptr(), reinterpret_cast<void* const*>(buffer_ptrs),
      reinterpret_cast<uint32_t* const*>(signal_pad_ptrs), (int)rank, (int)world, nbytes / 16,
      at::cuda::getCurrentCUDAStream());
  QF_CHECK(err == cudaSuccess, "quantfuse _one_shot_all_reduce_cuda: launch failed: %s", cudaGetErrorString(err));
  return out;
}

}  // namespace
}  // namespace quantfuse

TORCH_LIBRARY_FRAGMENT(quantfuse, m) {
  m.def("_one_shot_all_reduce_cuda(Tensor x, Tensor buffer, int buffer_ptrs, int signal_pad_ptrs, int rank, "
        "int world) -> Tensor");
}

TORCH_LIBRARY_IMPL(quantfuse, CUDA, m) { m.impl("_one_shot_all_reduce_cuda", &quantfuse::one_shot_all_reduce_cuda); }
