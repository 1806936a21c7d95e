// The per-token activation quantization kernel (contract: quantize_per_token.h).  One CTA per
// row: a first pass reduces the row (amax, or min and max), a second reads it again (from L2)
// and writes the quantized values.  Every step is the float32 arithmetic torch's element-wise
// kernels do on CUDA for the form in compile_backend/ops/quantize_per_token.py, so q, the scale and
// the zero point equal the form's bit for bit: IEEE division by the scale, t * (1 / c) where the
// form divides by a Python number c, round half to even, and torch's own float -> e4m3 rounding.
#include <c10/util/Float8_e4m3fn.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "quantize_per_token/quantize_per_token.h"

namespace quantfuse::quantize_per_token {
namespace {

constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;
constexpr float kMinScale = 1e-8f;

__device__ __forceinline__ float to_float(float v) { return v; }
__device__ __forceinline__ float to_float(__half v) { return __half2float(v); }
__device__ __forceinline__ float to_float(__nv_bfloat16 v) { return __bfloat162float(v); }

// torch's max / min reductions and clamps propagate NaN; fmaxf / fminf would drop it.
__device__ __forceinline__ float nan_max(float a, float b) { return (a != a || a > b) ? a : b; }
__device__ __forceinline__ float nan_min(float a, float b) { return (a != a || a < b) ? a : b; }
__device__ __forceinline__ float clamp(float v, float lo, float hi) { return v < lo ? lo : (v > hi ? hi : v); }

// V consecutive elements of a row as float32: one 16-byte load when V * sizeof(T) == 16.
template <class T, int V>
__device__ __forceinline__ void load(const T* p, float (&f)[V]) {
  if constexpr (V * sizeof(T) == 16) {
    const uint4 raw = *reinterpret_cast<const uint4*>(p);
    const T* e = reinterpret_cast<const T*>(&raw);
#pragma unroll
    for (int i = 0; i < V; ++i) f[i] = to_float(e[i]);
  } else {
#pragma unroll
    for (int i = 0; i < V; ++i) f[i] = to_float(p[i]);
  }
}

// V bytes to a V-aligned address in one store.
template <int V>
__device__ __forceinline__ void store(uint8_t* p, const uint8_t (&b)[V]) {
  if constexpr (V == 8) {
    *reinterpret_cast<uint2*>(p) = *reinterpret_cast<const uint2*>(b);
  } else if constexpr (V == 4) {
    *reinterpret_cast<uint32_t*>(p) = *reinterpret_cast<const uint32_t*>(b);
  } else {
#pragma unroll
    for (int i = 0; i < V; ++i) p[i] = b[i];
  }
}

// The block's reduction of (lo, hi): warp shuffles, then every thread combines the warps' values.
__device__ __forceinline__ void block_reduce(float& lo, float& hi) {
  __shared__ float s_lo[kWarps], s_hi[kWarps];
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
    lo = nan_min(lo, __shfl_xor_sync(0xffffffffu, lo, o));
    hi = nan_max(hi, __shfl_xor_sync(0xffffffffu, hi, o));
  }
  const int warp = threadIdx.x / 32;
  if (threadIdx.x % 32 == 0) {
    s_lo[warp] = lo;
    s_hi[warp] = hi;
  }
  __syncthreads();
  lo = s_lo[0];
  hi = s_hi[0];
#pragma unroll
  for (int w = 1; w < kWarps; ++w) {
    lo = nan_min(lo, s_lo[w]);
    hi = nan_max(hi, s_hi[w]);
  }
}

template <class T, bool kFp8, bool kSymmetric, int V>
__global__ void __launch_bounds__(kThreads)
    quantize_per_token_kernel(const T* __restrict__ x, int64_t ldx, uint8_t* __restrict__ q,
                              float* __restrict__ scale_out, float* __restrict__ zp_out, int K, float inv_qmax) {
  const int64_t row = blockIdx.x;
  const T* xr = x + row * ldx;
  uint8_t* qr = q + row * static_cast<int64_t>(K);

  // Symmetric: hi = amax |x| (lo unused); asymmetric: lo = min, hi = max.
  float lo = INFINITY, hi = kSymmetric ? 0.f : -INFINITY;
  for (int k = threadIdx.x * V; k < K; k += kThreads * V) {
    float f[V];
    load<T, V>(xr + k, f);
#pragma unroll
    for (int i = 0; i < V; ++i) {
      if constexpr (kSymmetric) {
        hi = nan_max(hi, fabsf(f[i]));
      } else {
        lo = nan_min(lo, f[i]);
        hi = nan_max(hi, f[i]);
      }
    }
  }
  block_reduce(lo, hi);

  // Symmetric: hi is the row's amax and the range [0, hi] (hi - 0 is hi, NaN included);
  // asymmetric: [lo, hi] widened to hold 0.
  const float xmin = kSymmetric || lo > 0.f ? 0.f : lo;
  const float xmax = !kSymmetric && hi < 0.f ? 0.f : hi;
  float scale = (xmax - xmin) * inv_qmax;
  scale = scale < kMinScale ? kMinScale : scale;
  const float zp = kSymmetric ? 0.f : clamp(rintf(-128.f - xmin / scale), -128.f, 127.f);
  if (threadIdx.x == 0) {
    scale_out[row] = scale;
    zp_out[row] = zp;
  }

  for (int k = threadIdx.x * V; k < K; k += kThreads * V) {
    float f[V];
    load<T, V>(xr + k, f);
    alignas(V) uint8_t b[V];
#pragma unroll
    for (int i = 0; i < V; ++i) {
      const float v = f[i] / scale;
      if constexpr (kFp8) {
        b[i] = c10::Float8_e4m3fn(clamp(v, -448.f, 448.f)).x;
      } else {
        float r = rintf(v);
        if constexpr (!kSymmetric) r = r + zp;
        b[i] = static_cast<uint8_t>(static_cast<int8_t>(clamp(r, -128.f, 127.f)));
      }
    }
    store<V>(qr + k, b);
  }
}

template <class T, bool kFp8, bool kSymmetric>
int launch_typed(const Params& p, int* cuda_error) {
  constexpr int V = 16 / sizeof(T);
  const auto* x = static_cast<const T*>(p.x);
  // One 16-byte load per V elements needs 16-byte aligned rows and whole vectors per row.
  const bool vector = p.K % V == 0 && (p.ldx * static_cast<int64_t>(sizeof(T))) % 16 == 0 &&
                      reinterpret_cast<uintptr_t>(p.x) % 16 == 0;
  const float inv_qmax = kSymmetric ? 1.0f / (kFp8 ? 448.0f : 127.0f) : 1.0f / 255.0f;
  const dim3 grid(static_cast<unsigned>(p.M));
  auto* stream = static_cast<cudaStream_t>(p.stream);
  auto* q = static_cast<uint8_t*>(p.q);
  const int K = static_cast<int>(p.K);
  if (vector) {
    quantize_per_token_kernel<T, kFp8, kSymmetric, V>
        <<<grid, kThreads, 0, stream>>>(x, p.ldx, q, p.scale, p.zero_point, K, inv_qmax);
  } else {
    quantize_per_token_kernel<T, kFp8, kSymmetric, 1>
        <<<grid, kThreads, 0, stream>>>(x, p.ldx, q, p.scale, p.zero_point, K, inv_qmax);
  }
  const cudaError_t err = cudaGetLastError();
  *cuda_error = static_cast<int>(err);
  return err == cudaSuccess ? kOk : kLaunchFailed;
}

template <class T>
int launch_mode(const Params& p, int* cuda_error) {
  if (p.fp8) return p.symmetric ? launch_typed<T, true, true>(p, cuda_error) : kUnsupported;
  return p.symmetric ? launch_typed<T, false, true>(p, cuda_error) : launch_typed<T, false, false>(p, cuda_error);
}

}  // namespace

int launch(const Params& p, int* cuda_error) {
  *cuda_error = 0;
  if (p.M == 0) return kOk;
  if (p.K <= 0 || p.M >= (int64_t(1) << 31) || p.K >= (int64_t(1) << 31)) return kUnsupported;
  switch (p.dtype) {
    case Dt::kF16: return launch_mode<__half>(p, cuda_error);
    case Dt::kBF16: return launch_mode<__nv_bfloat16>(p, cuda_error);
    case Dt::kF32: return launch_mode<float>(p, cuda_error);
  }
  return kUnsupported;
}

}  // namespace quantfuse::quantize_per_token
