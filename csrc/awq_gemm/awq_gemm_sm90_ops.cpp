// quantfuse AWQ W4A16 prefill on Hopper: tensor checks and op registration for the
// CUTLASS mixed-input kernels (awq_gemm_sm90*.cu).  Called from
// awq_gemm_dispatch.cpp (and, as private ops, tests and benchmarks):
//   _awq_prepare_sm90_cuda(qweight, scales, qzeros, group_size)
//       -> (wq uint8 [N, K/2] in the kernel's int4 layout, scales [K/g, N] (a copy),
//           zeros [K/g, N] = -z * s), once per weight;
//   _awq_gemm_sm90_cuda(x, wq, scales, zeros, group_size, bias=None, config=-1, pad=-1) -> out [M, N]
//       (config -1: chosen by awq_gemm_sm90_choice.h; pad -1: its padding rule, 0: never pad,
//       1: pad whenever the last token tile is at least 45% empty).

#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/all.h>

#include <cstdint>
#include <optional>
#include <tuple>

#include "awq_gemm/awq_gemm_sm90.h"
#include "awq_gemm/awq_gemm_torch.h"
#include "common/check.h"
#include "common/device_attribute.h"

namespace {

namespace qa = quantfuse::awq_sm90;

qa::DType dtype_of(const at::Tensor& t, const char* name) {
  if (t.scalar_type() == at::kHalf) return qa::DType::kHalf;
  if (t.scalar_type() == at::kBFloat16) return qa::DType::kBFloat16;
  quantfuse::fail("quantfuse awq_sm90: '%s' has dtype %s; expected float16 or bfloat16", name,
                  c10::toString(t.scalar_type()));
}

// The per-group scales [groups, N] and AWQ-packed zero points [groups, N/8] both preparations
// take; returns the dtype of scales.
qa::DType check_group_tensors(const at::Tensor& scales, const at::Tensor& qzeros, int64_t groups, int64_t N) {
  const qa::DType dt = dtype_of(scales, "scales");
  QF_CHECK(scales.dim() == 2 && scales.size(0) == groups && scales.size(1) == N,
           "quantfuse awq_sm90: 'scales' must have shape (%lld, %lld)", (long long)groups, (long long)N);
  QF_CHECK(qzeros.scalar_type() == at::kInt && qzeros.dim() == 2 && qzeros.size(0) == groups && qzeros.size(1) == N / 8,
           "quantfuse awq_sm90: 'qzeros' must be int32 of shape (%lld, %lld)", (long long)groups, (long long)(N / 8));
  return dt;
}

void check_cuda_contig(const at::Tensor& t, const char* name) {
  QF_CHECK(t.is_cuda(), "quantfuse awq_sm90: '%s' must be a CUDA tensor", name);
  QF_CHECK(t.is_contiguous(), "quantfuse awq_sm90: '%s' must be contiguous", name);
}

void check_aligned(const at::Tensor& t, const char* name) {
  QF_CHECK(reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 == 0, "quantfuse awq_sm90: '%s' must be 16-byte aligned",
           name);
}

void check_shapes(int64_t K, int64_t N, int64_t group_size) {
  QF_CHECK(K % qa::kTileK == 0 && N % qa::kAlignN == 0, "quantfuse awq_sm90: K (%lld) must be a multiple of %d and N (%lld) of %d",
           (long long)K, (int)qa::kTileK, (long long)N, (int)qa::kAlignN);
  QF_CHECK(group_size > 0 && K % group_size == 0 && (group_size % qa::kTileK == 0 || group_size == K),
           "quantfuse awq_sm90: group_size %lld must divide K = %lld and be a multiple of %d (or equal K)",
           (long long)group_size, (long long)K, (int)qa::kTileK);
  QF_CHECK(N * K < (int64_t(1) << 31), "quantfuse awq_sm90: N * K too large for 32-bit indexing");
}

void check_cuda(cudaError_t err, const char* what) {
  QF_CHECK(err == cudaSuccess, "quantfuse awq_sm90: %s failed: %s", what, cudaGetErrorString(err));
}

}  // namespace

namespace quantfuse {

std::tuple<at::Tensor, at::Tensor, at::Tensor> awq_prepare_sm90_cuda(const at::Tensor& qweight,
                                                                     const at::Tensor& scales,
                                                                     const at::Tensor& qzeros, int64_t group_size) {
  check_cuda_contig(qweight, "qweight");
  check_cuda_contig(scales, "scales");
  check_cuda_contig(qzeros, "qzeros");
  QF_CHECK(qweight.scalar_type() == at::kInt && qweight.dim() == 2, "quantfuse awq_sm90: 'qweight' must be 2-D int32");
  const int64_t K = qweight.size(0), N = qweight.size(1) * 8;
  check_shapes(K, N, group_size);
  const int64_t groups = K / group_size;
  const qa::DType dt = check_group_tensors(scales, qzeros, groups, N);
  const c10::cuda::CUDAGuard guard(qweight.device());
  auto stream = at::cuda::getCurrentCUDAStream();
  at::Tensor wq = at::empty({N, K / 2}, qweight.options().dtype(at::kByte));
  at::Tensor zeros = at::empty({groups, N}, scales.options());
  at::Tensor scales_out = scales.clone();
  if (K > 0 && N > 0) {
    at::Tensor tmp = at::empty({N * K}, qweight.options().dtype(at::kByte));
    check_cuda(qa::launch_prepare_weight(reinterpret_cast<const uint32_t*>(qweight.data_ptr<int32_t>()),
                                         tmp.data_ptr<uint8_t>(), wq.data_ptr<uint8_t>(), (int)K, (int)N, stream),
               "awq_prepare_sm90 (weight)");
    check_cuda(qa::launch_prepare_zeros(dt, reinterpret_cast<const uint32_t*>(qzeros.data_ptr<int32_t>()),
                                        scales.data_ptr(), zeros.data_ptr(), (int)groups, (int)N, stream),
               "awq_prepare_sm90 (zeros)");
  }
  return {wq, scales_out, zeros};
}

std::tuple<at::Tensor, at::Tensor> awq_prepare_sm90_from_fragments_cuda(const at::Tensor& fragments,
                                                                        const at::Tensor& scales,
                                                                        const at::Tensor& qzeros, int64_t group_size) {
  check_cuda_contig(fragments, "fragments");
  check_cuda_contig(scales, "scales");
  check_cuda_contig(qzeros, "qzeros");
  QF_CHECK(fragments.scalar_type() == at::kInt && fragments.dim() == 4 && fragments.size(2) == 32 &&
               fragments.size(3) == 4,
           "quantfuse awq_sm90: 'fragments' must be int32 of shape (N/64, K/16, 32, 4)");
  const int64_t K = fragments.size(1) * 16, N = fragments.size(0) * 64;
  check_shapes(K, N, group_size);
  const int64_t groups = K / group_size;
  const qa::DType dt = check_group_tensors(scales, qzeros, groups, N);
  const c10::cuda::CUDAGuard guard(fragments.device());
  auto stream = at::cuda::getCurrentCUDAStream();
  at::Tensor wq = at::empty({N, K / 2}, fragments.options().dtype(at::kByte));
  at::Tensor zeros = at::empty({groups, N}, scales.options());
  if (K > 0 && N > 0) {
    check_cuda(qa::launch_prepare_weight_from_fragments(reinterpret_cast<const uint32_t*>(fragments.data_ptr<int32_t>()),
                                                        wq.data_ptr<uint8_t>(), (int)K, (int)N, stream),
               "awq_prepare_sm90 (fragments)");
    check_cuda(qa::launch_prepare_zeros(dt, reinterpret_cast<const uint32_t*>(qzeros.data_ptr<int32_t>()),
                                        scales.data_ptr(), zeros.data_ptr(), (int)groups, (int)N, stream),
               "awq_prepare_sm90 (zeros)");
  }
  return {wq, zeros};
}

}  // namespace quantfuse

namespace {

void* alloc_workspace(std::size_t bytes, void* ctx) {
  auto* holder = static_cast<at::Tensor*>(ctx);
  *holder = at::empty({static_cast<int64_t>(bytes)}, at::TensorOptions().dtype(at::kByte).device(at::kCUDA));
  return holder->data_ptr();
}

}  // namespace

namespace quantfuse {

at::Tensor awq_gemm_sm90_cuda(const at::Tensor& x, const at::Tensor& wq, const at::Tensor& scales,
                              const at::Tensor& zeros, int64_t group_size, const std::optional<at::Tensor>& bias,
                              int64_t config, int64_t pad) {
  check_cuda_contig(x, "x");
  check_cuda_contig(wq, "wq");
  check_cuda_contig(scales, "scales");
  check_cuda_contig(zeros, "zeros");
  QF_CHECK(x.dim() == 2, "quantfuse awq_sm90: 'x' must be 2-D [M, K]");
  const qa::DType dt = dtype_of(x, "x");
  const int64_t M = x.size(0), K = x.size(1);
  QF_CHECK(wq.scalar_type() == at::kByte && wq.dim() == 2 && wq.size(1) * 2 == K,
           "quantfuse awq_sm90: 'wq' must be uint8 of shape (N, %lld) from _awq_prepare_sm90_cuda", (long long)(K / 2));
  const int64_t N = wq.size(0);
  check_shapes(K, N, group_size);
  const int64_t groups = K / group_size;
  for (const auto& [t, name] : {std::pair<const at::Tensor&, const char*>{scales, "scales"}, {zeros, "zeros"}}) {
    QF_CHECK(t.scalar_type() == x.scalar_type() && t.dim() == 2 && t.size(0) == groups && t.size(1) == N,
             "quantfuse awq_sm90: '%s' must be (%lld, %lld) in the dtype of 'x'", name, (long long)groups, (long long)N);
    check_aligned(t, name);
  }
  check_aligned(x, "x");
  check_aligned(wq, "wq");
  const void* bias_ptr = nullptr;
  if (bias.has_value()) {
    check_cuda_contig(*bias, "bias");
    QF_CHECK(bias->dim() == 1 && bias->size(0) == N && bias->scalar_type() == x.scalar_type(),
                "quantfuse awq_sm90: 'bias' must be [N] in the dtype of 'x'");
    bias_ptr = bias->data_ptr();
  }
  QF_CHECK(M * K < (int64_t(1) << 31) && M * N < (int64_t(1) << 31),
              "quantfuse awq_sm90: sizes too large for 32-bit indexing");
  QF_CHECK(config >= -1 && config < qa::kNumConfigs, "quantfuse awq_sm90: config must be -1 (auto) or 0..%d",
           qa::kNumConfigs - 1);
  QF_CHECK(pad >= -1 && pad <= 1, "quantfuse awq_sm90: pad must be -1 (the rule), 0 (never) or 1 (always)");
  const c10::cuda::CUDAGuard guard(x.device());
  if (M == 0 || N == 0) return at::empty({M, N}, x.options());
  // The configuration is fixed before padding, so a padded call runs the tiles M would.
  const int sms = quantfuse::sm_count(x.get_device(), 0);
  const int cfg = config >= 0 ? static_cast<int>(config) : qa::choose_config(M, N, K, static_cast<int>(group_size), sms);
  int64_t rows = pad < 0 ? qa::padded_tokens(M, N, K, cfg, sms) : pad == 0 ? M : qa::padded_tokens(M, N, K, cfg, sms, 0.0);
  if (rows * K >= (int64_t(1) << 31) || rows * N >= (int64_t(1) << 31)) rows = M;  // 32-bit indexing
  const cudaStream_t stream = at::cuda::getCurrentCUDAStream().stream();
  // A padded call copies x into a buffer of `rows` rows with one copy and leaves the rows past M
  // as they are: output row m reads row m of x only, so they reach only the output rows that
  // are dropped (a zero fill would cost another launch on every padded call).
  at::Tensor xk = x;
  if (rows != M) {
    xk = at::empty({rows, K}, x.options());
    check_cuda(cudaMemcpyAsync(xk.data_ptr(), x.data_ptr(), x.nbytes(), cudaMemcpyDeviceToDevice, stream),
               "copying x into the padded buffer");
  }
  at::Tensor out = at::empty({rows, N}, x.options());
  at::Tensor workspace;
  qa::GemmParams p;
  p.x = xk.data_ptr();
  p.wq = wq.data_ptr();
  p.scales = scales.data_ptr();
  p.zeros = zeros.data_ptr();
  p.bias = bias_ptr;
  p.out = out.data_ptr();
  p.M = rows;
  p.N = N;
  p.K = K;
  p.group_size = static_cast<int>(group_size);
  p.config = cfg;
  p.device = x.get_device();
  p.stream = stream;
  p.alloc = &alloc_workspace;
  p.alloc_ctx = &workspace;
  const int status = dt == qa::DType::kHalf ? qa::gemm_f16(p) : qa::gemm_bf16(p);
  QF_CHECK(status == qa::kOk, "quantfuse awq_sm90: GEMM failed (status %d, config %lld, M=%lld, N=%lld, K=%lld, group_size=%lld)",
           (int)status, (long long)cfg, (long long)M, (long long)N, (long long)K, (long long)group_size);
  // The first M rows, as a tensor of its own rather than a view (narrow costs dispatcher trips):
  // `out` is fresh and not shared, so its sizes may shrink over the same storage.
  if (rows != M) out.unsafeGetTensorImpl()->set_sizes_contiguous({M, N});
  return out;
}

}  // namespace quantfuse

namespace {

// The config the kernel picks by default (benchmarks); sm_count 0: an H100's 132.
int64_t awq_sm90_config(int64_t M, int64_t N, int64_t K, int64_t group_size, int64_t sm_count) {
  return quantfuse::awq_sm90::choose_config(M, N, K, (int)group_size, (int)sm_count);
}

// The token count a call of M tokens runs at under a configuration (x copied into a buffer padded above M);
// sm_count 0: an H100's 132.
int64_t awq_sm90_rows(int64_t M, int64_t N, int64_t K, int64_t config, int64_t sm_count) {
  QF_CHECK(M >= 0 && N > 0 && K > 0 && config >= 0 && config < qa::kNumConfigs,
           "quantfuse awq_sm90: need M >= 0, N > 0, K > 0 and config in 0..%d", qa::kNumConfigs - 1);
  return quantfuse::awq_sm90::padded_tokens(M, N, K, (int)config, (int)sm_count);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(quantfuse, m) {
  m.def("_awq_prepare_sm90_cuda(Tensor qweight, Tensor scales, Tensor qzeros, int group_size) "
        "-> (Tensor, Tensor, Tensor)");
  m.def("_awq_prepare_sm90_from_fragments_cuda(Tensor fragments, Tensor scales, Tensor qzeros, int group_size) "
        "-> (Tensor, Tensor)");
  m.def("_awq_gemm_sm90_cuda(Tensor x, Tensor wq, Tensor scales, Tensor zeros, int group_size, Tensor? bias=None, "
        "int config=-1, int pad=-1) -> Tensor");
  m.def("_awq_sm90_config(int M, int N, int K, int group_size, int sm_count=0) -> int", &awq_sm90_config);
  m.def("_awq_sm90_rows(int M, int N, int K, int config, int sm_count=0) -> int", &awq_sm90_rows);
}

TORCH_LIBRARY_IMPL(quantfuse, CUDA, m) {
  m.impl("_awq_prepare_sm90_cuda", &quantfuse::awq_prepare_sm90_cuda);
  m.impl("_awq_prepare_sm90_from_fragments_cuda", &quantfuse::awq_prepare_sm90_from_fragments_cuda);
  m.impl("_awq_gemm_sm90_cuda", &quantfuse::awq_gemm_sm90_cuda);
}
