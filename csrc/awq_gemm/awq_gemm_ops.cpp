// quantfuse AWQ W4A16: tensor checks and op registration for the CUDA kernels.
//
// The public ops quantfuse::awq_gemm / awq_dequantize are defined in Python
// (compile_backend/ops/awq_gemm.py); their CUDA dispatch (awq_gemm_dispatch.cpp) calls these entry points,
// which tests and benchmarks also reach as private ops.

#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/all.h>

#include <cstdint>
#include <optional>

#include "awq_gemm/awq_gemm.h"
#include "awq_gemm/awq_gemm_torch.h"
#include "common/check.h"
#include "common/pdl.h"

namespace {

using quantfuse::awq::DType;

DType dtype_of(const at::Tensor& t, const char* name) {
  if (t.scalar_type() == at::kHalf) return DType::kHalf;
  if (t.scalar_type() == at::kBFloat16) return DType::kBFloat16;
  quantfuse::fail("quantfuse awq: '%s' has dtype %s; expected float16 or bfloat16", name, c10::toString(t.scalar_type()));
}

void check_cuda_contig(const at::Tensor& t, const char* name) {
  QF_CHECK(t.is_cuda(), "quantfuse awq: '%s' must be a CUDA tensor", name);
  QF_CHECK(t.is_contiguous(), "quantfuse awq: '%s' must be contiguous", name);
}

void check_aligned(const at::Tensor& t, const char* name, int bytes = 16) {
  QF_CHECK(reinterpret_cast<uintptr_t>(t.data_ptr()) % bytes == 0, "quantfuse awq: '%s' must be %d-byte aligned", name,
           bytes);
}

void check_launch(cudaError_t err, const char* what) {
  QF_CHECK(err == cudaSuccess, "quantfuse awq: %s launch failed: %s", what, cudaGetErrorString(err));
}

// qweight [K, N/8] int32 (AWQ order) -> fragment layout, same number of int32s.
}  // namespace

namespace quantfuse {

at::Tensor awq_repack_cuda(const at::Tensor& qweight) {
  check_cuda_contig(qweight, "qweight");
  QF_CHECK(qweight.scalar_type() == at::kInt && qweight.dim() == 2, "quantfuse awq: 'qweight' must be 2-D int32");
  const int64_t K = qweight.size(0), N = qweight.size(1) * 8;
  QF_CHECK(K % 16 == 0 && N % quantfuse::awq::kStripN == 0,
           "quantfuse awq repack: K %% 16 and N %% 64 must be 0 (K=%lld, N=%lld)", (long long)K, (long long)N);
  const c10::cuda::CUDAGuard guard(qweight.device());
  at::Tensor out = at::empty({N / quantfuse::awq::kStripN, K / 16, 32, 4}, qweight.options());
  if (K > 0 && N > 0) {
    check_launch(quantfuse::awq::launch_repack(reinterpret_cast<const uint32_t*>(qweight.data_ptr<int32_t>()),
                                               reinterpret_cast<uint32_t*>(out.data_ptr<int32_t>()), (int)K, (int)N,
                                               at::cuda::getCurrentCUDAStream()),
                 "awq_repack");
  }
  return out;
}

at::Tensor awq_unrepack_cuda(const at::Tensor& packed) {
  check_cuda_contig(packed, "packed");
  QF_CHECK(packed.scalar_type() == at::kInt && packed.dim() == 4 && packed.size(2) == 32 && packed.size(3) == 4,
           "quantfuse awq: 'packed' must be int32 of shape (N/64, K/16, 32, 4)");
  const int64_t K = packed.size(1) * 16, N = packed.size(0) * quantfuse::awq::kStripN;
  const c10::cuda::CUDAGuard guard(packed.device());
  at::Tensor out = at::empty({K, N / 8}, packed.options());
  if (K > 0 && N > 0) {
    check_launch(quantfuse::awq::launch_unrepack(reinterpret_cast<const uint32_t*>(packed.data_ptr<int32_t>()),
                                                 reinterpret_cast<uint32_t*>(out.data_ptr<int32_t>()), (int)K, (int)N,
                                                 at::cuda::getCurrentCUDAStream()),
                 "awq_unrepack");
  }
  return out;
}

}  // namespace quantfuse

namespace {

void check_awq_args(const at::Tensor& scales, const at::Tensor& qzeros, int64_t K, int64_t N, int64_t group_size) {
  check_cuda_contig(scales, "scales");
  check_cuda_contig(qzeros, "qzeros");
  QF_CHECK(group_size > 0 && K % group_size == 0, "quantfuse awq: group_size %lld must divide K = %lld",
           (long long)group_size, (long long)K);
  const int64_t groups = K / group_size;
  QF_CHECK(scales.dim() == 2 && scales.size(0) == groups && scales.size(1) == N,
           "quantfuse awq: 'scales' must have shape (%lld, %lld)", (long long)groups, (long long)N);
  QF_CHECK(qzeros.scalar_type() == at::kInt && qzeros.dim() == 2 && qzeros.size(0) == groups && qzeros.size(1) == N / 8,
           "quantfuse awq: 'qzeros' must be int32 of shape (%lld, %lld)", (long long)groups, (long long)(N / 8));
}

}  // namespace

namespace quantfuse {

at::Tensor awq_dequantize_cuda(const at::Tensor& qweight, const at::Tensor& scales, const at::Tensor& qzeros,
                               int64_t group_size) {
  check_cuda_contig(qweight, "qweight");
  QF_CHECK(qweight.scalar_type() == at::kInt && qweight.dim() == 2, "quantfuse awq: 'qweight' must be 2-D int32");
  const int64_t K = qweight.size(0), N = qweight.size(1) * 8;
  check_awq_args(scales, qzeros, K, N, group_size);
  check_aligned(scales, "scales");
  const DType dt = dtype_of(scales, "scales");
  const c10::cuda::CUDAGuard guard(qweight.device());
  at::Tensor out = at::empty({K, N}, scales.options());
  if (K > 0 && N > 0) {
    check_launch(quantfuse::awq::launch_dequantize(
                     dt, reinterpret_cast<const uint32_t*>(qweight.data_ptr<int32_t>()), scales.data_ptr(),
                     reinterpret_cast<const uint32_t*>(qzeros.data_ptr<int32_t>()), out.data_ptr(), (int)K, (int)N,
                     (int)group_size, at::cuda::getCurrentCUDAStream()),
                 "awq_dequantize");
  }
  return out;
}

}  // namespace quantfuse

namespace {

// x [M, K] @ W (repacked by awq_repack_cuda) + bias.
}  // namespace

namespace quantfuse {

at::Tensor awq_gemm_cuda(const at::Tensor& x, const at::Tensor& wpacked, const at::Tensor& scales,
                         const at::Tensor& qzeros, int64_t group_size, const std::optional<at::Tensor>& bias,
                         int64_t warps, int64_t splits, bool cluster, int64_t pdl) {
  QF_CHECK(warps == 0 || warps == 4 || warps == 8 || warps == 16,
           "quantfuse awq_gemm: warps must be 0, 4, 8 or 16, got %lld", (long long)warps);
  QF_CHECK(splits >= 0 && splits <= 8, "quantfuse awq_gemm: splits must be 0 (automatic) or 1..8, got %lld",
           (long long)splits);
  check_cuda_contig(x, "x");
  check_cuda_contig(wpacked, "wpacked");
  QF_CHECK(x.dim() == 2, "quantfuse awq_gemm: 'x' must be 2-D [M, K]");
  const DType dt = dtype_of(x, "x");
  QF_CHECK(scales.scalar_type() == x.scalar_type(), "quantfuse awq_gemm: 'scales' dtype must match 'x'");
  const int64_t M = x.size(0), K = x.size(1);
  QF_CHECK(warps != 16 || M <= 8,
           "quantfuse awq_gemm: warps=16 takes at most 8 rows of 'x' (one token tile), got %lld",
           (long long)M);
  QF_CHECK(wpacked.scalar_type() == at::kInt && wpacked.dim() == 4 && wpacked.size(1) == K / 16 &&
               wpacked.size(2) == 32 && wpacked.size(3) == 4,
           "quantfuse awq_gemm: 'wpacked' must be int32 of shape (N/64, %lld, 32, 4)", (long long)(K / 16));
  const int64_t N = wpacked.size(0) * quantfuse::awq::kStripN;
  QF_CHECK(K % 16 == 0 && group_size % 16 == 0, "quantfuse awq_gemm: K (%lld) and group_size (%lld) must be multiples of 16",
           (long long)K, (long long)group_size);
  check_awq_args(scales, qzeros, K, N, group_size);
  check_aligned(x, "x", 8);
  check_aligned(wpacked, "wpacked");
  check_aligned(scales, "scales");
  check_aligned(qzeros, "qzeros");
  const void* bias_ptr = nullptr;
  if (bias.has_value()) {
    check_cuda_contig(*bias, "bias");
    QF_CHECK(bias->dim() == 1 && bias->size(0) == N && bias->scalar_type() == x.scalar_type(),
                "quantfuse awq_gemm: 'bias' must be [N] in the dtype of 'x'");
    bias_ptr = bias->data_ptr();
  }
  QF_CHECK(M * K < (int64_t(1) << 31) && K * N < (int64_t(1) << 31) && M * N < (int64_t(1) << 31),
              "quantfuse awq_gemm: sizes too large for 32-bit indexing");
  const c10::cuda::CUDAGuard guard(x.device());
  at::Tensor out = at::empty({M, N}, x.options());
  if (M == 0 || N == 0) return out;
  if (K == 0) return bias.has_value() ? bias->unsqueeze(0).expand({M, N}).contiguous() : out.zero_();
  const int device = x.get_device();
  const int nsplit =
      splits > 0 ? (int)splits : quantfuse::awq::gemm_splits(dt, (int)M, (int)N, (int)K, device, (int)warps);
  at::Tensor partial;
  if (quantfuse::awq::gemm_needs_workspace(nsplit, device, cluster))
    partial = at::empty({nsplit, M, N}, x.options().dtype(at::kFloat));
  check_launch(quantfuse::awq::launch_gemm(dt, x.data_ptr(), reinterpret_cast<const uint32_t*>(wpacked.data_ptr<int32_t>()),
                                           scales.data_ptr(), reinterpret_cast<const uint32_t*>(qzeros.data_ptr<int32_t>()),
                                           bias_ptr, out.data_ptr(), partial.defined() ? partial.data_ptr<float>() : nullptr,
                                           (int)M, (int)N, (int)K, (int)group_size, nsplit, (int)warps, device, cluster,
                                           pdl_for(pdl, device), at::cuda::getCurrentCUDAStream()),
               "awq_gemm");
  return out;
}

}  // namespace quantfuse

namespace {

int64_t awq_gemm_splits(int64_t M, int64_t N, int64_t K, bool bf16, int64_t device, int64_t warps) {
  return quantfuse::awq::gemm_splits(bf16 ? DType::kBFloat16 : DType::kHalf, (int)M, (int)N, (int)K, (int)device,
                                     (int)warps);
}

bool awq_gemm_folds(int64_t M, int64_t N, int64_t device, int64_t warps) {
  return quantfuse::awq::gemm_folds((int)M, (int)N, (int)device, (int)warps);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(quantfuse, m) {
  m.def("_awq_repack_cuda(Tensor qweight) -> Tensor");
  m.def("_awq_unrepack_cuda(Tensor packed) -> Tensor");
  m.def("_awq_dequantize_cuda(Tensor qweight, Tensor scales, Tensor qzeros, int group_size) -> Tensor");
  m.def("_awq_gemm_cuda(Tensor x, Tensor wpacked, Tensor scales, Tensor qzeros, int group_size, "
        "Tensor? bias=None, int warps=0, int splits=0, bool cluster=True, int pdl=-1) -> Tensor");
  m.def("_awq_gemm_splits(int M, int N, int K, bool bf16, int device, int warps=0) -> int", &awq_gemm_splits);
  m.def("_awq_gemm_folds(int M, int N, int device, int warps=0) -> bool", &awq_gemm_folds);
}

TORCH_LIBRARY_IMPL(quantfuse, CUDA, m) {
  m.impl("_awq_repack_cuda", &quantfuse::awq_repack_cuda);
  m.impl("_awq_unrepack_cuda", &quantfuse::awq_unrepack_cuda);
  m.impl("_awq_dequantize_cuda", &quantfuse::awq_dequantize_cuda);
  m.impl("_awq_gemm_cuda", &quantfuse::awq_gemm_cuda);
}
