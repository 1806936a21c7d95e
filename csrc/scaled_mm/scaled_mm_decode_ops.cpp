// Torch-facing side of the W8A8 decode kernels (M <= 16, scaled_mm_decode.cuh): tensor
// checks, the work split, the current stream, and the registration of
//   quantfuse::_scaled_mm_decode_cuda(a, b, scale_a, scale_b, out_dtype, bias, azp_adj, azp, splits)
// scaled_mm_dispatch.cpp routes quantfuse.scaled_mm / scaled_mm_azp here for
// small M; the op can also be called directly (tests, benchmarks; `splits` > 0 forces the
// number of CTAs per cluster along K, -1 chooses).
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/all.h>
#include <torch/library.h>

#include <cstdint>
#include <cstdio>
#include <optional>
#include <stdexcept>
#include <string>
#include <vector>

#include "common/check.h"
#include "common/pdl.h"
#include "scaled_mm/qdtype_torch.h"
#include "scaled_mm/scaled_mm_decode.h"
#include "scaled_mm/scaled_mm_torch.h"

namespace {

using quantfuse::QDType;
using quantfuse::QEpilogue;
using quantfuse::ScaledMmParams;
namespace qd = quantfuse::decode;

// Argument errors: quantfuse::fail / QF_CHECK (common/check.h), never TORCH_CHECK with values.
#define DECODE_FAIL(...) ::quantfuse::fail("_scaled_mm_decode_cuda: " __VA_ARGS__)

bool aligned16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }
long long ll(int64_t v) { return static_cast<long long>(v); }

void check_vec(const at::Tensor& t, const char* name, at::ScalarType dtype, int64_t n1, int64_t n2,
               const at::Tensor& a) {
  if (t.device() != a.device()) DECODE_FAIL("%s must be on the device of a", name);
  if (t.scalar_type() != dtype || !t.is_contiguous())
    DECODE_FAIL("%s must be a contiguous %s tensor (got %s)", name, c10::toString(dtype), c10::toString(t.scalar_type()));
  if (t.numel() != n1 && t.numel() != n2)
    DECODE_FAIL("%s has %lld elements, expected %lld or %lld", name, ll(t.numel()), ll(n1), ll(n2));
}

}  // namespace

namespace quantfuse {

at::Tensor scaled_mm_decode(const at::Tensor& a, const at::Tensor& b, const at::Tensor& scale_a, const at::Tensor& scale_b,
                  at::ScalarType out_dtype, const std::optional<at::Tensor>& bias,
                  const std::optional<at::Tensor>& azp_adj, const std::optional<at::Tensor>& azp, int64_t splits,
                  int64_t warps, int64_t batch, int64_t pdl) {
  if (!a.is_cuda() || !b.is_cuda() || a.device() != b.device()) DECODE_FAIL("a and b must be on one CUDA device");
  if (a.dim() != 2 || b.dim() != 2 || a.size(1) != b.size(0))
    DECODE_FAIL("a (%lld-D) and b (%lld-D) are not [M, K] x [K, N]", ll(a.dim()), ll(b.dim()));
  if (a.scalar_type() != b.scalar_type() ||
      (a.scalar_type() != at::kChar && a.scalar_type() != at::kFloat8_e4m3fn))
    DECODE_FAIL("a and b must both be int8 or float8_e4m3fn (got %s, %s)", c10::toString(a.scalar_type()),
         c10::toString(b.scalar_type()));
  const int64_t M = a.size(0), K = a.size(1), N = b.size(1);
  if (M > qd::kMaxM) DECODE_FAIL("M = %lld > %d", ll(M), qd::kMaxM);
  if (K % 16 != 0 || K >= (int64_t(1) << 30) || N >= (int64_t(1) << 30))
    DECODE_FAIL("K = %lld must be a multiple of 16 (and K, N < 2^30)", ll(K));
  if (a.stride(1) != 1 || (M > 1 && a.stride(0) % 16 != 0) || !aligned16(a.data_ptr()))
    DECODE_FAIL("a (strides %lld, %lld) must be row-major with 16-byte aligned rows", ll(a.stride(0)), ll(a.stride(1)));
  if (b.stride(0) != 1 || (N > 1 && b.stride(1) % 16 != 0) || !aligned16(b.data_ptr()))
    DECODE_FAIL("b (strides %lld, %lld) must be column-major (an [N, K] weight transposed) with 16-byte aligned rows",
         ll(b.stride(0)), ll(b.stride(1)));
  check_vec(scale_a, "scale_a", at::kFloat, 1, M, a);
  check_vec(scale_b, "scale_b", at::kFloat, 1, N, a);
  if (out_dtype != at::kHalf && out_dtype != at::kBFloat16 && out_dtype != at::kFloat)
    DECODE_FAIL("out_dtype must be float16, bfloat16 or float32");

  const c10::cuda::CUDAGuard guard(a.device());
  const auto* props = at::cuda::getCurrentDeviceProperties();
  const int cc = props->major * 10 + props->minor;
  const bool fp8 = a.scalar_type() == at::kFloat8_e4m3fn;
  if (cc < (fp8 ? 89 : 80)) DECODE_FAIL("%s (this GPU: sm_%d)", fp8 ? "fp8 needs sm_89+" : "int8 needs sm_80+", cc);

  at::Tensor out = at::empty({M, N}, a.options().dtype(out_dtype));
  if (M == 0 || N == 0) return out;
  if (K == 0) DECODE_FAIL("K = 0 is not supported");

  ScaledMmParams p;
  p.a = a.data_ptr();
  p.b = b.data_ptr();
  p.d = out.data_ptr();
  p.M = M;
  p.N = N;
  p.K = K;
  p.lda = M <= 1 ? K : a.stride(0);
  p.ldb = N <= 1 ? K : b.stride(1);
  p.ldd = out.stride(0);
  p.scale_a = scale_a.data_ptr<float>();
  p.scale_a_per_token = scale_a.numel() != 1;
  p.scale_b = scale_b.data_ptr<float>();
  p.scale_b_per_channel = scale_b.numel() != 1;
  p.in_dtype = quantfuse::to_qdtype(a.scalar_type(), "_scaled_mm_decode_cuda");
  p.out_dtype = quantfuse::to_qdtype(out_dtype, "_scaled_mm_decode_cuda");
  p.epilogue = bias.has_value() ? QEpilogue::kScaledBias : QEpilogue::kScaled;
  if (bias.has_value()) {
    check_vec(*bias, "bias", out_dtype, N, N, a);
    p.bias = bias->data_ptr();
  }
  if (azp_adj.has_value()) {
    if (fp8) DECODE_FAIL("zero points apply to int8 activations only");
    check_vec(*azp_adj, "azp_adj", at::kInt, N, N, a);
    p.azp_adj = azp_adj->data_ptr<int32_t>();
    p.epilogue = QEpilogue::kAzp;
    if (azp.has_value()) {
      check_vec(*azp, "azp", at::kInt, M, M, a);
      p.azp = azp->data_ptr<int32_t>();
      p.epilogue = QEpilogue::kAzpToken;
    }
  } else if (azp.has_value()) {
    DECODE_FAIL("azp given without azp_adj");
  }
  p.device = a.get_device();
  p.stream = at::cuda::getCurrentCUDAStream(a.get_device()).stream();
  p.pdl = pdl_for(pdl, p.device);

  const qd::DecodeConfig config = qd::choose_config(N, K, props->multiProcessorCount, cc >= 90, static_cast<int>(splits),
                                                    static_cast<int>(warps), static_cast<int>(batch));
  int cuda_error = 0;
  const int status = fp8 ? qd::launch_fp8(p, config, &cuda_error) : qd::launch_i8(p, config, &cuda_error);
  if (status != quantfuse::kQOk)
    DECODE_FAIL("M=%lld N=%lld K=%lld, splits %d, warps %d, batch %d: %s", ll(M), ll(N), ll(K), config.splits, config.warps,
         config.batch,
         status == quantfuse::kQLaunchFailed ? cudaGetErrorString(static_cast<cudaError_t>(cuda_error))
                                             : "no kernel for this combination");
  return out;
}

}  // namespace quantfuse

namespace {

at::Tensor scaled_mm_decode_cuda(const at::Tensor& a, const at::Tensor& b, const at::Tensor& scale_a,
                                 const at::Tensor& scale_b, at::ScalarType out_dtype,
                                 const std::optional<at::Tensor>& bias, const std::optional<at::Tensor>& azp_adj,
                                 const std::optional<at::Tensor>& azp, int64_t splits) {
  return quantfuse::scaled_mm_decode(a, b, scale_a, scale_b, out_dtype, bias, azp_adj, azp, splits, -1, -1);
}

// Benchmarks and tests: every knob of the work split forced, and PDL (-1: chosen).
at::Tensor scaled_mm_decode_tune(const at::Tensor& a, const at::Tensor& b, const at::Tensor& scale_a,
                                 const at::Tensor& scale_b, at::ScalarType out_dtype,
                                 const std::optional<at::Tensor>& bias, int64_t splits, int64_t warps, int64_t batch,
                                 int64_t pdl) {
  return quantfuse::scaled_mm_decode(a, b, scale_a, scale_b, out_dtype, bias, std::nullopt, std::nullopt, splits, warps,
                                     batch, pdl);
}

// The work split the op would use (benchmarks, notes): [splits, warps, chunks_per_part, batch].
std::vector<int64_t> scaled_mm_decode_config(int64_t N, int64_t K, int64_t splits) {
  const auto* props = at::cuda::getCurrentDeviceProperties();
  const qd::DecodeConfig c = qd::choose_config(N, K, props->multiProcessorCount,
                                               props->major * 10 + props->minor >= 90, static_cast<int>(splits));
  return {c.splits, c.warps, c.chunks_per_part, c.batch};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(quantfuse, m) {
  m.def(
      "_scaled_mm_decode_cuda(Tensor a, Tensor b, Tensor scale_a, Tensor scale_b, ScalarType out_dtype, "
      "Tensor? bias=None, Tensor? azp_adj=None, Tensor? azp=None, int splits=-1) -> Tensor");
  m.def(
      "_scaled_mm_decode_tune(Tensor a, Tensor b, Tensor scale_a, Tensor scale_b, ScalarType out_dtype, "
      "Tensor? bias=None, int splits=-1, int warps=-1, int batch=-1, int pdl=-1) -> Tensor");
  m.def("_scaled_mm_decode_config(int N, int K, int splits=-1) -> int[]", &scaled_mm_decode_config);
}

TORCH_LIBRARY_IMPL(quantfuse, CUDA, m) {
  m.impl("_scaled_mm_decode_cuda", &scaled_mm_decode_cuda);
  m.impl("_scaled_mm_decode_tune", &scaled_mm_decode_tune);
}
