// Torch-facing side of the W8A8 CUTLASS kernels: tensor checks, current stream,
// dispatch to the per-dtype launchers (plain C++, see scaled_mm_launch.h), and the
// registration of the private op quantfuse::_scaled_mm_cutlass.  The public ops
// quantfuse::scaled_mm / scaled_mm_azp are defined in Python (compile_backend/ops/scaled_mm.py);
// scaled_mm_dispatch.cpp decides when it runs.
#include <torch/all.h>
#include <torch/library.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>

#include <cstdio>
#include <stdexcept>
#include <vector>

#include "common/check.h"
#include "scaled_mm/qdtype_torch.h"
#include "scaled_mm/scaled_mm_launch.h"
#include "scaled_mm/scaled_mm_torch.h"
#include "scaled_mm_azp/scaled_mm_azp_launch.h"

namespace quantfuse {

const char* status_string(int status) {
  switch (status) {
    case kQOk: return "ok";
    case kQUnsupported: return "no kernel instantiated for this combination";
    case kQCannotImplement: return "CUTLASS can_implement refused the arguments";
    case kQInitFailed: return "CUTLASS initialize failed";
    case kQLaunchFailed: return "CUTLASS kernel launch failed";
    default: return "unknown status";
  }
}

int scaled_mm_sm90(const ScaledMmParams& p) {
  const bool i8 = p.in_dtype == QDType::kInt8;
  const QDType o = p.out_dtype;
#define QF_PICK(prefix)                                        \
  switch (o) {                                                 \
    case QDType::kF16: return prefix##_f16_bias(p);            \
    case QDType::kBF16: return prefix##_bf16_bias(p);          \
    case QDType::kF32: return prefix##_f32_bias(p);            \
    default: return kQUnsupported;                             \
  }
  switch (p.epilogue) {
    case QEpilogue::kScaled:  // bias-free ScaledBias (null bias broadcasts zero)
    case QEpilogue::kScaledBias:
      if (i8) { QF_PICK(sm90_i8) } else if (p.in_dtype == QDType::kFp8E4M3) { QF_PICK(sm90_fp8) }
      return kQUnsupported;
    case QEpilogue::kAzp:
      if (!i8) return kQUnsupported;
      switch (o) {
        case QDType::kF16: return sm90_i8_f16_azp(p);
        case QDType::kBF16: return sm90_i8_bf16_azp(p);
        case QDType::kF32: return sm90_i8_f32_azp(p);
        default: return kQUnsupported;
      }
    case QEpilogue::kAzpToken:
      if (!i8) return kQUnsupported;
      switch (o) {
        case QDType::kF16: return sm90_i8_f16_azptok(p);
        case QDType::kBF16: return sm90_i8_bf16_azptok(p);
        case QDType::kF32: return sm90_i8_f32_azptok(p);
        default: return kQUnsupported;
      }
  }
#undef QF_PICK
  return kQUnsupported;
}

// CUTLASS 2.x kernels (sm_80 and later; int8 only).  One tree per output dtype covers
// Scaled/ScaledBias, another ScaledBiasAzp/ScaledBiasAzpToken (see epilogue_sm80.cuh).
int scaled_mm_sm80(const ScaledMmParams& p) {
  if (p.in_dtype != QDType::kInt8) return kQUnsupported;
  const bool azp = p.epilogue == QEpilogue::kAzp || p.epilogue == QEpilogue::kAzpToken;
  switch (p.out_dtype) {
    case QDType::kF16: return azp ? sm80_i8_f16_azp(p) : sm80_i8_f16_bias(p);
    case QDType::kBF16: return azp ? sm80_i8_bf16_azp(p) : sm80_i8_bf16_bias(p);
    case QDType::kF32: return azp ? sm80_i8_f32_azp(p) : sm80_i8_f32_bias(p);
    default: return kQUnsupported;
  }
}

namespace {

void* alloc_workspace(std::size_t bytes, void* ctx) {
  auto* keep = static_cast<std::vector<at::Tensor>*>(ctx);
  keep->push_back(at::empty({static_cast<int64_t>(bytes)},
                            at::TensorOptions().dtype(at::kByte).device(at::kCUDA)));
  return keep->back().data_ptr();
}

// arch: 0 = best for this GPU (sm_90: 90, other sm_80+: 80), 90 = the SM90 kernels, 80 = the
// CUTLASS 2.x SM80 kernels (int8 only; they also run on Hopper, for tests and benchmarks).
// config: -1 = choose by M/N, else a tile configuration index (tests, benchmarks).
// swizzle, raster: the SM90 tile scheduler's raster swizzle and order (0 = the tile config's;
// tests, benchmarks; ScaledMmParams).  The SM80 kernels ignore them.
}  // namespace

at::Tensor scaled_mm_cutlass(const at::Tensor& a, const at::Tensor& b, const at::Tensor& scale_a,
                             const at::Tensor& scale_b, at::ScalarType out_dtype,
                             const std::optional<at::Tensor>& bias,
                             const std::optional<at::Tensor>& azp_adj,
                             const std::optional<at::Tensor>& azp, int64_t arch, int64_t config,
                             int64_t swizzle, int64_t raster) {
  QF_CHECK(a.is_cuda() && b.is_cuda(), "_scaled_mm_cutlass: CUDA tensors expected");
  QF_CHECK(a.dim() == 2 && b.dim() == 2 && a.size(1) == b.size(0), "_scaled_mm_cutlass: bad shapes");
  QF_CHECK(a.scalar_type() == b.scalar_type(), "_scaled_mm_cutlass: a and b dtypes differ");
  QF_CHECK(a.stride(1) == 1 && b.stride(0) == 1,
              "_scaled_mm_cutlass: a must be row-major and b column-major");
  QF_CHECK(scale_a.scalar_type() == at::kFloat && scale_b.scalar_type() == at::kFloat &&
                  scale_a.is_contiguous() && scale_b.is_contiguous(),
              "_scaled_mm_cutlass: contiguous float32 scales expected");
  const int64_t M = a.size(0), K = a.size(1), N = b.size(1);
  QF_CHECK(scale_a.numel() == 1 || scale_a.numel() == M, "_scaled_mm_cutlass: scale_a size");
  QF_CHECK(scale_b.numel() == 1 || scale_b.numel() == N, "_scaled_mm_cutlass: scale_b size");
  c10::cuda::CUDAGuard guard(a.device());
  at::Tensor out = at::empty({M, N}, a.options().dtype(out_dtype));
  if (M == 0 || N == 0) return out;

  ScaledMmParams p;
  p.a = a.data_ptr();
  p.b = b.data_ptr();
  p.d = out.data_ptr();
  p.M = M;
  p.N = N;
  p.K = K;
  p.lda = a.stride(0);
  p.ldb = b.stride(1);
  p.ldd = out.stride(0);
  p.scale_a = scale_a.data_ptr<float>();
  p.scale_a_per_token = scale_a.numel() != 1;
  p.scale_b = scale_b.data_ptr<float>();
  p.scale_b_per_channel = scale_b.numel() != 1;
  if (bias.has_value()) {
    QF_CHECK(bias->scalar_type() == out_dtype && bias->numel() == N && bias->is_contiguous(),
                "_scaled_mm_cutlass: bias must be a contiguous [N] tensor in out_dtype");
    p.bias = bias->data_ptr();
  }
  p.in_dtype = to_qdtype(a.scalar_type(), "quantfuse._scaled_mm_cutlass");
  p.out_dtype = to_qdtype(out_dtype, "quantfuse._scaled_mm_cutlass");
  p.epilogue = bias.has_value() ? QEpilogue::kScaledBias : QEpilogue::kScaled;
  if (azp_adj.has_value()) {
    QF_CHECK(azp_adj->scalar_type() == at::kInt && azp_adj->numel() == N && azp_adj->is_contiguous(),
                "_scaled_mm_cutlass: azp_adj must be contiguous int32 [N]");
    p.azp_adj = azp_adj->data_ptr<int32_t>();
    p.epilogue = QEpilogue::kAzp;
    if (azp.has_value()) {
      QF_CHECK(azp->scalar_type() == at::kInt && azp->numel() == M && azp->is_contiguous(),
                  "_scaled_mm_cutlass: azp must be contiguous int32 [M]");
      p.azp = azp->data_ptr<int32_t>();
      p.epilogue = QEpilogue::kAzpToken;
    }
  } else {
    QF_CHECK(!azp.has_value(), "_scaled_mm_cutlass: azp given without azp_adj");
  }
  p.config = static_cast<int>(config);
  QF_CHECK(swizzle == 0 || swizzle == 1 || swizzle == 2 || swizzle == 4 || swizzle == 8,
           "_scaled_mm_cutlass: swizzle must be 0 (the config's), 1, 2, 4 or 8, got %lld", static_cast<long long>(swizzle));
  QF_CHECK(raster >= 0 && raster <= 2, "_scaled_mm_cutlass: raster must be 0 (the config's), 1 (along M) or 2 (along N), got %lld",
           static_cast<long long>(raster));
  p.swizzle = static_cast<int>(swizzle);
  p.raster = static_cast<int>(raster);
  p.device = a.get_device();
  p.stream = at::cuda::getCurrentCUDAStream(a.get_device()).stream();
  std::vector<at::Tensor> keep;
  p.alloc = &alloc_workspace;
  p.alloc_ctx = &keep;

  const auto* props = at::cuda::getCurrentDeviceProperties();
  const int cc = props->major * 10 + props->minor;
  if (arch == 0) arch = cc >= 90 && cc < 100 ? 90 : 80;
  int status = kQUnsupported;
  if (arch == 90) {
    QF_CHECK(cc >= 90 && cc < 100, "_scaled_mm_cutlass: SM90 kernels need a Hopper GPU");
    status = scaled_mm_sm90(p);
  } else if (arch == 80) {
    QF_CHECK(cc >= 80, "_scaled_mm_cutlass: SM80 kernels need compute capability 8.0 or later (got %d.%d)",
             props->major, props->minor);
    QF_CHECK(p.in_dtype == QDType::kInt8,
             "_scaled_mm_cutlass: the SM80 kernels take int8 inputs only, got %s (fp8 runs on the SM90 kernels, "
             "arch=90, or the reference)", c10::toString(a.scalar_type()));
    status = scaled_mm_sm80(p);
  } else {
    quantfuse::fail("_scaled_mm_cutlass: arch must be 0, 80 or 90, got %lld", static_cast<long long>(arch));
  }
  QF_CHECK(status == kQOk, "_scaled_mm_cutlass (arch %d, config %d, M=%lld N=%lld K=%lld): %s", static_cast<int>(arch),
           static_cast<int>(config), static_cast<long long>(M), static_cast<long long>(N), static_cast<long long>(K),
           status_string(status));
  return out;
}

}  // namespace quantfuse

TORCH_LIBRARY_FRAGMENT(quantfuse, m) {
  m.def(
      "_scaled_mm_cutlass(Tensor a, Tensor b, Tensor scale_a, Tensor scale_b, ScalarType out_dtype, "
      "Tensor? bias=None, Tensor? azp_adj=None, Tensor? azp=None, int arch=0, int config=-1, int swizzle=0, "
      "int raster=0) -> Tensor");
}

TORCH_LIBRARY_IMPL(quantfuse, CUDA, m) {
  m.impl("_scaled_mm_cutlass", &quantfuse::scaled_mm_cutlass);
}
