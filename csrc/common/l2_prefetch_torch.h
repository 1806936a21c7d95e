// The L2 prefetch hint of a decode kernel (common/l2_prefetch.h) from a tensor.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>

#include <cstdint>
#include <optional>

#include "common/l2_prefetch.h"

namespace quantfuse {

// The hint for `t` (none when absent or empty): its first `bytes` (-1: all), at most
// kMaxPrefetchBytes, trimmed to 16-byte alignment.  `t` must be contiguous and on `device`.
L2Prefetch l2_prefetch_of(const std::optional<at::Tensor>& t, int64_t bytes, const c10::Device& device);

// The hint for [ptr, ptr + bytes), at most kMaxPrefetchBytes, trimmed to 16-byte alignment.
L2Prefetch l2_prefetch_span(const void* ptr, uint64_t bytes);

}  // namespace quantfuse
