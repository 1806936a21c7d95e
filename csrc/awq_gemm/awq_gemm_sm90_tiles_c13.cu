// AWQ SM90 prefill: tile configuration 13 (awq_gemm_sm90.cuh: ConfigAt<13>), fp16 and bf16.
#include "awq_gemm/awq_gemm_sm90.cuh"

QF_AWQ_SM90_INSTANTIATE(13)
