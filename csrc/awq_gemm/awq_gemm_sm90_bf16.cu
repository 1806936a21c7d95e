// AWQ W4A16 prefill GEMM on Hopper, bfloat16 activations (see awq_gemm_sm90.cuh).
#include "awq_gemm/awq_gemm_sm90.cuh"

namespace quantfuse::awq_sm90 {

cudaError_t prepare_zeros_bf16(const uint32_t* qzeros, const void* scales, void* zeros_out, int groups, int N,
                               cudaStream_t stream) {
  return prepare_zeros<cutlass::bfloat16_t>(qzeros, scales, zeros_out, groups, N, stream);
}

int gemm_bf16(const GemmParams& p) { return dispatch<cutlass::bfloat16_t>(p); }

}  // namespace quantfuse::awq_sm90
