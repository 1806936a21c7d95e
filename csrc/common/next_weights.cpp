#include "common/next_weights.h"

#include <ATen/cuda/CUDAContext.h>
#include <c10/core/StorageImpl.h>
#include <c10/util/intrusive_ptr.h>

#include <torch/library.h>

#include <atomic>
#include <map>
#include <mutex>
#include <unordered_map>
#include <utility>

#include "common/derived_cache.h"
#include "common/l2_prefetch_torch.h"

namespace quantfuse {
namespace {

// Weights as the bytes a kernel streams: a view of them (a transposed weight) is made afresh by
// every call, so the storage is what stays the same from one call to the next.
struct Span {
  c10::weak_intrusive_ptr<c10::StorageImpl> storage{c10::intrusive_ptr<c10::StorageImpl>()};
  uint64_t offset = 0, bytes = 0;
  const void* data = nullptr;  // where they were when recorded

  static Span of(const at::Tensor& t) {
    Span s;
    s.storage = t.storage().getWeakStorageImpl();
    s.offset = static_cast<uint64_t>(t.storage_offset()) * t.element_size();
    s.bytes = static_cast<uint64_t>(t.numel()) * t.element_size();
    s.data = t.data_ptr();
    return s;
  }
};

using StreamKey = std::pair<int, int64_t>;  // device index, stream id

std::atomic<bool> g_enabled{true};
std::mutex g_mutex;
// The weights the last decode launch on each stream streamed.
std::map<StreamKey, Span> g_last;
// Where a weight's data lives -> the weights streamed after it last time.  Keys of freed weights
// stay until their memory holds another weight (which then relearns its successor) or the map is
// full (then it starts over).
std::unordered_map<const void*, Span> g_next;
constexpr size_t kMaxLinks = size_t(1) << 16;

StreamKey stream_of(const c10::Device& device) {
  return {device.index(), at::cuda::getCurrentCUDAStream(device.index()).id()};
}

bool capturing(const c10::Device& device) {
  cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
  const cudaError_t err = cudaStreamIsCapturing(at::cuda::getCurrentCUDAStream(device.index()).stream(), &status);
  return err != cudaSuccess || status != cudaStreamCaptureStatusNone;
}

// Whether the recorded bytes are still where they were, in live memory.
bool live(const Span& s, const c10::intrusive_ptr<c10::StorageImpl>& storage) {
  return storage && static_cast<const char*>(storage->data()) + s.offset == s.data &&
         s.offset + s.bytes <= storage->nbytes();
}

}  // namespace

L2Prefetch next_weights_hint(const at::Tensor& weights) {
  const c10::Device device = weights.device();
  if (!g_enabled.load(std::memory_order_relaxed)) return {};
  if (!weights.is_non_overlapping_and_dense()) {
    next_weights_break(device);
    return {};
  }
  const Span here = Span::of(weights);
  Span next;
  c10::intrusive_ptr<c10::StorageImpl> storage;
  {
    std::lock_guard<std::mutex> lock(g_mutex);
    Span& last = g_last[stream_of(device)];
    if (last.data != nullptr && last.data != here.data && live(last, last.storage.lock())) {
      if (g_next.size() >= kMaxLinks) g_next.clear();
      g_next.insert_or_assign(last.data, here);
    }
    last = here;
    if (auto it = g_next.find(here.data); it != g_next.end()) {
      next = it->second;
      storage = next.storage.lock();
    }
  }
  if (!live(next, storage) || next.data == here.data || storage->device() != device) return {};
  // A graph replays the pointer: what it points to must live as long as the graph.
  if (capturing(device) && !keep_for_graph(c10::Storage(storage))) return {};
  return l2_prefetch_span(next.data, next.bytes);
}

void next_weights_break(const c10::Device& device) {
  std::lock_guard<std::mutex> lock(g_mutex);
  g_last.erase(stream_of(device));
}

}  // namespace quantfuse

namespace {

// Benchmarks and tests: the hints off (false) or on (true, the default), with nothing learnt;
// returns the previous setting.
bool next_weights_enable(bool enable) {
  std::lock_guard<std::mutex> lock(quantfuse::g_mutex);
  quantfuse::g_last.clear();
  quantfuse::g_next.clear();
  return quantfuse::g_enabled.exchange(enable);
}

// Tests: where the weights learnt to follow `weights` are (0: none), without recording a launch.
int64_t next_weights_peek(const at::Tensor& weights) {
  std::lock_guard<std::mutex> lock(quantfuse::g_mutex);
  auto it = quantfuse::g_next.find(weights.data_ptr());
  return it == quantfuse::g_next.end() ? 0 : reinterpret_cast<int64_t>(it->second.data);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(quantfuse, m) {
  m.def("_next_weights_enable(bool enable) -> bool", &next_weights_enable);
  m.def("_next_weights_peek(Tensor weights) -> int", &next_weights_peek);
}
