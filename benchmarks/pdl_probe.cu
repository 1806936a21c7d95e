// Probe: what programmatic dependent launch (csrc/common/pdl.h) buys the two decode kernels.
//
// Standalone (CUDA only, no torch): includes the kernel files, so both kernels are timed as the
// ops launch them, with the launch attribute off and on (quantfuse::pdl_mode()), in a CUDA graph
// replayed over enough weight copies to exceed twice the L2 (METHOD.md's rotation), median of 21
// replays.  Two sequences per case:
// * "alone": the kernel back to back with itself (what the benchmarks time);
// * "after norm": each call preceded by a small kernel launched without the attribute that
//   writes the activations (a stand-in for an RMSNorm), as in a model, where the kernel before
//   a GEMM is Inductor's.  The pair is timed; the norm alone is printed for reference.
// The kernels' prologue is a build knob: -DQF_PDL_PROLOGUE=0 waits before any load, 1 (the
// default) asks L2 for the first weight batches first, 2 loads them into registers first
// (unsafe in general: for this probe only, as the upper bound).
//
//   nvcc -O3 -std=c++17 -gencode=arch=compute_90a,code=sm_90a -Icsrc \
//        benchmarks/pdl_probe.cu -o pdl_probe && ./pdl_probe
//
// Output: one line per (kernel, shape, M, sequence, attribute): µs per call (per pair).

#include "awq_gemm/awq_gemm_kernels.cu"
#include "scaled_mm/scaled_mm_decode_i8.cu"

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <vector>

#define CK(x)                                                                                  \
  do {                                                                                         \
    cudaError_t e_ = (x);                                                                      \
    if (e_ != cudaSuccess) {                                                                   \
      std::fprintf(stderr, "%s:%d %s: %s\n", __FILE__, __LINE__, #x, cudaGetErrorString(e_)); \
      std::exit(1);                                                                            \
    }                                                                                          \
  } while (0)

namespace {

__global__ void fill_random(uint32_t* p, size_t n, uint32_t seed) {
  for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x) {
    uint32_t x = (uint32_t)i * 2654435761u ^ seed;
    x ^= x >> 13; x *= 0x5bd1e995u; x ^= x >> 15;
    p[i] = x;
  }
}

// The stand-in for the kernel before a GEMM: one block rewrites `n` 16-bit activations.
__global__ void norm_standin(uint16_t* x, int n) {
  for (int i = threadIdx.x; i < n; i += blockDim.x) x[i] = (uint16_t)((x[i] & 0x03ffu) | 0x3000u);
}

std::vector<void*> copies_of(size_t bytes, unsigned seed) {
  const int copies = std::max(2, (int)((2.0 * 50 * (1 << 20) + bytes - 1) / bytes));
  std::vector<void*> w(copies);
  for (int c = 0; c < copies; ++c) {
    CK(cudaMalloc(&w[c], bytes));
    fill_random<<<1024, 256>>>(static_cast<uint32_t*>(w[c]), bytes / 4, 31u * c + seed);
  }
  CK(cudaDeviceSynchronize());
  return w;
}

float time_graph(int copies, const std::function<void(int, cudaStream_t)>& launch) {
  cudaStream_t st;
  CK(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking));
  for (int c = 0; c < copies; ++c) launch(c, st);  // warm up
  CK(cudaStreamSynchronize(st));
  cudaGraph_t g;
  cudaGraphExec_t ge;
  CK(cudaStreamBeginCapture(st, cudaStreamCaptureModeThreadLocal));
  for (int c = 0; c < copies; ++c) launch(c, st);
  CK(cudaStreamEndCapture(st, &g));
  CK(cudaGraphInstantiate(&ge, g, 0));
  cudaEvent_t a, b;
  CK(cudaEventCreate(&a));
  CK(cudaEventCreate(&b));
  std::vector<float> t;
  for (int r = 0; r < 24; ++r) {
    CK(cudaEventRecord(a, st));
    CK(cudaGraphLaunch(ge, st));
    CK(cudaEventRecord(b, st));
    CK(cudaEventSynchronize(b));
    float ms = 0;
    CK(cudaEventElapsedTime(&ms, a, b));
    if (r >= 3) t.push_back(ms * 1000.0f / copies);
  }
  std::sort(t.begin(), t.end());
  CK(cudaGraphExecDestroy(ge));
  CK(cudaGraphDestroy(g));
  CK(cudaEventDestroy(a));
  CK(cudaEventDestroy(b));
  CK(cudaStreamDestroy(st));
  return t[t.size() / 2];
}

// Times `call` alone and after the norm stand-in, attribute off and on, twice (interleaved).
void compare(const char* what, int N, int K, int M, int copies, uint16_t* act, int act_elems,
             const std::function<void(int, cudaStream_t)>& call) {
  auto norm = [&](cudaStream_t st) { norm_standin<<<1, 256, 0, st>>>(act, act_elems); };
  quantfuse::pdl_mode() = 0;
  const float norm_us = time_graph(copies, [&](int, cudaStream_t st) { norm(st); });
  for (int rep = 0; rep < 2; ++rep)
    for (int pdl : {0, 1}) {
      quantfuse::pdl_mode() = pdl;
      const float alone = time_graph(copies, call);
      const float pair = time_graph(copies, [&](int c, cudaStream_t st) {
        norm(st);
        call(c, st);
      });
      std::printf("%-5s N=%5d K=%5d M=%2d pdl=%d  alone %6.1f us  after norm %6.1f us (norm alone %4.1f)\n", what,
                  N, K, M, pdl, alone, pair, norm_us);
      CK(cudaGetLastError());
    }
  quantfuse::pdl_mode() = -1;
}

}  // namespace

int main() {
  int dev = 0;
  CK(cudaSetDevice(dev));
  cudaDeviceProp prop;
  CK(cudaGetDeviceProperties(&prop, dev));
  std::printf("%s, %d SMs; QF_PDL_PROLOGUE=%d\n", prop.name, prop.multiProcessorCount, QF_PDL_PROLOGUE);
  const int shapes[4][2] = {{28672, 4096}, {4096, 14336}, {4096, 4096}, {6144, 4096}};
  constexpr int kMaxTokens = 16;
  for (auto& sh : shapes) {
    const int N = sh[0], K = sh[1], G = 128;
    uint16_t* act;  // the activations the norm stand-in writes and the GEMMs read
    CK(cudaMalloc(&act, (size_t)kMaxTokens * K * 2));
    fill_random<<<64, 256>>>(reinterpret_cast<uint32_t*>(act), (size_t)kMaxTokens * K / 2, 5u);
    norm_standin<<<1, 256>>>(act, kMaxTokens * K);  // finite fp16 values
    void* out;
    CK(cudaMalloc(&out, (size_t)kMaxTokens * N * 4));
    float* partial;
    CK(cudaMalloc(&partial, (size_t)quantfuse::awq::kMaxCluster * kMaxTokens * N * 4));

    {  // AWQ W4A16, group 128, fp16
      const std::vector<void*> w = copies_of((size_t)N * K / 2, 17u);
      const int copies = (int)w.size();
      std::vector<uint16_t> hs((size_t)(K / G) * N);
      for (size_t i = 0; i < hs.size(); ++i) hs[i] = (uint16_t)(0x1000 | (i * 2654435761u >> 20 & 0x3ff));
      void *sc, *zr;
      CK(cudaMalloc(&sc, hs.size() * 2));
      CK(cudaMemcpy(sc, hs.data(), hs.size() * 2, cudaMemcpyHostToDevice));
      CK(cudaMalloc(&zr, (size_t)(K / G) * N / 2));
      fill_random<<<64, 256>>>(static_cast<uint32_t*>(zr), (size_t)(K / G) * N / 8, 3u);
      CK(cudaDeviceSynchronize());
      for (int M : {1, 16}) {
        const int s = quantfuse::awq::gemm_splits(quantfuse::awq::DType::kHalf, M, N, K, dev);
        compare("awq", N, K, M, copies, act, kMaxTokens * K, [&](int c, cudaStream_t st) {
          CK(quantfuse::awq::launch_gemm(quantfuse::awq::DType::kHalf, act, static_cast<const uint32_t*>(w[c]), sc,
                                         static_cast<const uint32_t*>(zr), nullptr, out, partial, M, N, K, G, s, 0,
                                         dev, true, st));
        });
      }
      for (void* p : w) CK(cudaFree(p));
      CK(cudaFree(sc));
      CK(cudaFree(zr));
    }
    {  // W8A8 int8, per-token x per-channel + bias, bf16 out
      const std::vector<void*> w = copies_of((size_t)N * K, 7u);
      const int copies = (int)w.size();
      float *sa, *sb;
      uint16_t* bias;
      CK(cudaMalloc(&sa, kMaxTokens * 4));
      CK(cudaMalloc(&sb, (size_t)N * 4));
      CK(cudaMalloc(&bias, (size_t)N * 2));
      CK(cudaMemset(sa, 0, kMaxTokens * 4));  // zero scales: finite output, the same bytes read
      CK(cudaMemset(sb, 0, (size_t)N * 4));
      CK(cudaMemset(bias, 0, (size_t)N * 2));
      const quantfuse::decode::DecodeConfig cfg = quantfuse::decode::choose_config(N, K, prop.multiProcessorCount, true);
      for (int M : {1, 16}) {
        // int8 activations: the first M * K bytes of the norm's buffer
        compare("w8a8", N, K, M, copies, act, kMaxTokens * K / 2, [&](int c, cudaStream_t st) {
          quantfuse::ScaledMmParams p;
          p.a = act;
          p.b = w[c];
          p.d = out;
          p.M = M;
          p.N = N;
          p.K = K;
          p.lda = K;
          p.ldb = K;
          p.ldd = N;
          p.scale_a = sa;
          p.scale_a_per_token = true;
          p.scale_b = sb;
          p.scale_b_per_channel = true;
          p.bias = bias;
          p.out_dtype = quantfuse::QDType::kBF16;
          p.epilogue = quantfuse::QEpilogue::kScaledBias;
          p.device = dev;
          p.stream = st;
          int err = 0;
          if (quantfuse::decode::launch_i8(p, cfg, &err) != quantfuse::kQOk) {
            std::fprintf(stderr, "decode launch failed: %d\n", err);
            std::exit(1);
          }
        });
      }
      for (void* p : w) CK(cudaFree(p));
      CK(cudaFree(sa));
      CK(cudaFree(sb));
      CK(cudaFree(bias));
    }
    CK(cudaFree(act));
    CK(cudaFree(out));
    CK(cudaFree(partial));
  }
  return 0;
}
