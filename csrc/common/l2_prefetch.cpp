#include "common/l2_prefetch_torch.h"

#include <algorithm>

#include "common/check.h"

namespace quantfuse {

L2Prefetch l2_prefetch_span(const void* ptr, uint64_t bytes) {
  L2Prefetch hint;
  const uintptr_t start = reinterpret_cast<uintptr_t>(ptr);
  const uintptr_t begin = (start + 15) & ~uintptr_t(15);
  const uintptr_t end = start + bytes;
  if (ptr == nullptr || end <= begin) return hint;
  hint.ptr = reinterpret_cast<const void*>(begin);
  hint.bytes = static_cast<uint32_t>(std::min<uint64_t>(end - begin, kMaxPrefetchBytes) & ~uint64_t(15));
  return hint;
}

L2Prefetch l2_prefetch_of(const std::optional<at::Tensor>& t, int64_t bytes, const c10::Device& device) {
  QF_CHECK(bytes >= -1, "quantfuse: 'prefetch_bytes' must be -1 (all of 'prefetch') or >= 0, got %lld", (long long)bytes);
  if (!t.has_value() || !t->defined() || t->numel() == 0 || bytes == 0) return {};
  QF_CHECK(t->device() == device, "quantfuse: 'prefetch' must be on %s, got %s", device.str().c_str(),
           t->device().str().c_str());
  QF_CHECK(t->is_contiguous(), "quantfuse: 'prefetch' must be contiguous");
  const uint64_t n = t->nbytes();
  return l2_prefetch_span(t->data_ptr(), bytes > 0 ? std::min<uint64_t>(n, (uint64_t)bytes) : n);
}

}  // namespace quantfuse
