// See derived_cache.h.
#include "common/derived_cache.h"

#include <ATen/cuda/CUDAContext.h>
#include <ATen/cuda/CUDAEvent.h>
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/util/intrusive_ptr.h>
#include <torch/all.h>

#include <exception>
#include <map>
#include <mutex>
#include <string>
#include <thread>

#include "common/check.h"
#include "common/graph_reads.h"

namespace quantfuse {
namespace {

struct Entry {
  std::vector<c10::weak_intrusive_ptr<c10::TensorImpl>> refs;
  std::vector<int64_t> versions;
  std::vector<at::Tensor> values;
  bool captured = false;  // served to a CUDA graph being captured
};

std::mutex g_mutex;
std::map<std::vector<int64_t>, Entry> g_entries;
// Values a captured CUDA graph reads, kept when their entry is replaced (the weight changed in
// place) or cleared: a graph keeps raw pointers.  Such a graph reads the values of the old
// weight until it is captured again.  Entries whose weights were freed are dropped outright:
// a graph reading a freed weight is invalid anyway.
std::vector<at::Tensor> g_retired;
int64_t g_computed = 0, g_hits = 0;

// What each CUDA graph captured under the quantfuse backend read from here: the sources of every
// value served while it was captured, and their versions then (see derived_cache.h).
std::map<int64_t, GraphReads> g_graph_reads;
// The compiled graph this thread runs (graph_enter), 0 outside one.
thread_local int64_t t_graph = 0;

std::string describe(const c10::weak_intrusive_ptr<c10::TensorImpl>& ref) {
  auto impl = ref.lock();
  if (!impl) return "a weight that has since been freed";
  std::string text = "a weight of shape [";
  for (int64_t d = 0; d < impl->dim(); ++d) text += (d ? ", " : "") + std::to_string(impl->size(d));
  // ScalarType's name, not TypeMeta's stream formatting (iostream: see common/check.h).
  return text + "] (" + c10::toString(impl->dtype().toScalarType()) + ")";
}

void retire(Entry& e) {
  if (e.captured)
    for (auto& v : e.values) g_retired.push_back(v);
}

void append_where(std::vector<int64_t>& key, const at::Tensor& t) {
  key.push_back(reinterpret_cast<int64_t>(t.data_ptr()));
  key.push_back(t.dim());
  for (int64_t d = 0; d < t.dim(); ++d) {
    key.push_back(t.size(d));
    key.push_back(t.stride(d));
  }
  key.push_back(static_cast<int64_t>(t.scalar_type()));
  key.push_back(static_cast<int64_t>(t.device().type()) * 1024 + t.device().index());
}

bool alive(const Entry& e) {
  for (const auto& r : e.refs)
    if (r.expired()) return false;
  return true;
}

bool made_from(const Entry& e, const c10::TensorImpl* impl) {
  for (const auto& r : e.refs)
    if (r._unsafe_get_target() == impl) return true;
  return false;
}

// Entries whose sources are gone (or going: `dying`, a tensor being freed) can never be served
// again (their memory may be reused): their values are freed, and then the entries whose sources
// were among those values (a repacked layout of a concatenation), until none is left.  Called
// without g_mutex: the values are released after it is unlocked, since freeing a tensor may run
// Python code (a finalizer of compile_backend/derived/freed_weights.py) that calls back in.
void drop_dead_entries(const c10::TensorImpl* dying = nullptr) {
  for (;;) {
    std::vector<std::vector<at::Tensor>> freed;
    {
      std::lock_guard<std::mutex> lock(g_mutex);
      for (auto it = g_entries.begin(); it != g_entries.end();) {
        if (alive(it->second) && (dying == nullptr || !made_from(it->second, dying))) {
          ++it;
          continue;
        }
        freed.push_back(std::move(it->second.values));
        it = g_entries.erase(it);
      }
    }
    if (freed.empty()) return;
  }
}

bool capturing(const at::Tensor& t) {
  cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
  const cudaError_t err = cudaStreamIsCapturing(at::cuda::getCurrentCUDAStream(t.device().index()).stream(), &status);
  return err != cudaSuccess || status != cudaStreamCaptureStatusNone;
}

// make() on a worker thread and a side stream ordered after the caller's stream, so that its
// allocations come from the ordinary pool even while the caller's thread allocates into a
// CUDA graph's private pool (see derived_cache.h).
std::vector<at::Tensor> make_outside_graph_pool(const at::Tensor& first, const DerivedMaker& make) {
  const c10::Device device = first.device();
  const c10::cuda::CUDAGuard device_guard(device);
  const auto caller = at::cuda::getCurrentCUDAStream(device.index());
  const auto side = at::cuda::getStreamFromPool(false, device.index());
  at::cuda::CUDAEvent sources_ready;
  sources_ready.record(caller);
  std::vector<at::Tensor> values;
  std::exception_ptr error;
  std::thread worker([&] {
    try {
      const c10::cuda::CUDAGuard guard(device);
      const c10::cuda::CUDAStreamGuard stream_guard(side);
      const at::NoGradGuard no_grad;
      sources_ready.block(side);
      values = make();
    } catch (...) {
      error = std::current_exception();
    }
  });
  worker.join();
  if (error) std::rethrow_exception(error);
  at::cuda::CUDAEvent made;
  made.record(side);
  made.block(caller);
  for (const auto& v : values)
    if (v.defined()) c10::cuda::CUDACachingAllocator::recordStream(v.storage().data_ptr(), caller);
  return values;
}

}  // namespace

std::vector<at::Tensor> derived(int kind, std::initializer_list<at::Tensor> sources, int64_t extra,
                                const DerivedMaker& make) {
  return derived_list(kind, c10::ArrayRef<at::Tensor>(sources.begin(), sources.size()), c10::ArrayRef<int64_t>(extra),
                      make);
}

std::vector<at::Tensor> derived_list(int kind, c10::ArrayRef<at::Tensor> sources, c10::ArrayRef<int64_t> extra,
                                     const DerivedMaker& make) {
  const at::Tensor& first = sources.front();
  const bool in_capture = capturing(first);
  bool cacheable = true;
  std::vector<int64_t> key{kind, static_cast<int64_t>(extra.size())};
  key.insert(key.end(), extra.begin(), extra.end());
  std::vector<int64_t> versions;
  for (const auto& t : sources) {
    append_where(key, t);
    // Inference tensors keep no version counter: an in-place write could not be seen.
    if (t.is_inference()) cacheable = false;
    versions.push_back(t.is_inference() ? -1 : static_cast<int64_t>(t._version()));
  }
  {
    std::lock_guard<std::mutex> lock(g_mutex);
    auto it = cacheable ? g_entries.find(key) : g_entries.end();
    if (it != g_entries.end() && it->second.versions == versions && alive(it->second)) {
      ++g_hits;
      // A graph being captured now reads these values on every replay: they must outlive the
      // entry (see retire()).
      if (in_capture) {
        it->second.captured = true;
        if (t_graph != 0) {
          GraphReads& reads = g_graph_reads[t_graph];
          const Entry& e = it->second;
          for (size_t i = 0; i < e.refs.size(); ++i)
            // A hit: every source is alive (the lock cannot fail) and at its version.
            if (const auto impl = e.refs[i].lock())
              reads.record(e.refs[i], impl->version_counter(), static_cast<uint32_t>(e.versions[i]));
        }
      }
      return it->second.values;
    }
    ++g_computed;
  }
  // A deleted model's values make room for the ones this miss is about to allocate.
  if (cacheable && !in_capture) drop_dead_entries();
  // While capturing, a value made now belongs to the graph (its pool, its replays).
  if (!cacheable || in_capture) return make();

  std::vector<at::Tensor> values = make_outside_graph_pool(first, make);
  Entry entry;
  for (const auto& t : sources) entry.refs.emplace_back(t.getIntrusivePtr());
  entry.versions = std::move(versions);
  entry.values = values;
  Entry replaced;  // released after g_mutex (see drop_dead_entries)
  std::lock_guard<std::mutex> lock(g_mutex);
  auto old = g_entries.find(key);
  if (old != g_entries.end()) {
    retire(old->second);
    replaced = std::move(old->second);
  }
  g_entries[key] = std::move(entry);
  return values;
}

void clear_derived() {
  std::map<std::vector<int64_t>, Entry> cleared;  // released after g_mutex (see drop_dead_entries)
  std::lock_guard<std::mutex> lock(g_mutex);
  for (auto& [key, e] : g_entries) retire(e);
  cleared.swap(g_entries);
  g_computed = g_hits = 0;
}

void graph_enter(int64_t graph) {
  std::string stale;
  {
    std::lock_guard<std::mutex> lock(g_mutex);
    auto reads = g_graph_reads.find(graph);
    if (reads != g_graph_reads.end())
      if (const GraphReads::Ref* changed = reads->second.first_stale()) stale = describe(*changed);
  }
  // fail() rather than TORCH_CHECK: see common/check.h.
  if (!stale.empty())
    fail("quantfuse: this compiled model's CUDA graph was captured reading values derived from %s (its column "
         "sums, repacked or concatenated layout), and that weight has changed since: a replay would compute with "
         "the old weight.  After changing weights of a model compiled with mode=\"reduce-overhead\", call "
         "torch._dynamo.reset() and compile it again.",
         stale.c_str());
  t_graph = graph;
}

void graph_exit() { t_graph = 0; }

void graph_forget(int64_t graph) {
  std::lock_guard<std::mutex> lock(g_mutex);
  g_graph_reads.erase(graph);
}

void drop_source(int64_t impl) { drop_dead_entries(reinterpret_cast<const c10::TensorImpl*>(impl)); }

std::vector<int64_t> derived_stats() {
  drop_dead_entries();
  std::lock_guard<std::mutex> lock(g_mutex);
  return {g_computed, g_hits, static_cast<int64_t>(g_entries.size())};
}

}  // namespace quantfuse

TORCH_LIBRARY_FRAGMENT(quantfuse, m) {
  m.def("_derived_cache_clear() -> ()", &quantfuse::clear_derived);
  m.def("_derived_cache_stats() -> int[]", &quantfuse::derived_stats);
  m.def("_derived_cache_drop_source(int impl) -> ()", &quantfuse::drop_source);
  m.def("_derived_graph_enter(int graph) -> ()", &quantfuse::graph_enter);
  m.def("_derived_graph_exit() -> ()", &quantfuse::graph_exit);
  m.def("_derived_graph_forget(int graph) -> ()", &quantfuse::graph_forget);
}
