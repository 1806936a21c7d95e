// What one CUDA graph captured under the quantfuse backend read from the derived-value cache: each
// source tensor of a value it was served, with the source's version then (derived_cache.h:
// graph_enter checks them before every call of the graph).
//
// The check runs on the host before every replay, and under transformers' `generate` every decode
// step waits for it.  Kept as a map with one entry per served value, each source locked through its
// weak reference to read its version, it costs 0.36 ms per step of a 32-layer AWQ Llama (H100
// host, about 600 sources).  So the reads are one flat vector without repeats, and each holds the
// source's version counter itself (shared with the tensor, as a view shares its base's): a check
// reads two atomics per source, the TensorImpl's reference count (freed or not) and the counter,
// with no weak reference locked.  Header only, with no CUDA: the CPU tests build it into a small
// extension.
#pragma once

#include <c10/core/TensorImpl.h>
#include <c10/util/intrusive_ptr.h>

#include <cstddef>
#include <cstdint>
#include <functional>
#include <unordered_set>
#include <vector>

namespace quantfuse {

class GraphReads {
 public:
  using Ref = c10::weak_intrusive_ptr<c10::TensorImpl>;

  // The graph read a value made from `source` when the source's version was `version`.  A pair
  // already recorded is not added again.  `counter` is the source's version counter (a tensor
  // that tracks versions: not an inference tensor).
  void record(const Ref& source, const c10::VariableVersion& counter, uint32_t version) {
    if (!seen_.insert(Key{source._unsafe_get_target(), version}).second) return;
    reads_.push_back(Read{source, counter, version});
  }

  // The first source recorded that has been freed or written since (its version moved), or null.
  // The weak reference keeps a freed TensorImpl's memory, so its address is not reused while it
  // is recorded here.
  const Ref* first_stale() const {
    for (const auto& r : reads_)
      if (r.source.expired() || r.counter.current_version() != r.version) return &r.source;
    return nullptr;
  }

  size_t size() const { return reads_.size(); }

 private:
  struct Read {
    Ref source;
    c10::VariableVersion counter;
    uint32_t version;
  };
  struct Key {
    const c10::TensorImpl* impl;
    uint32_t version;
    bool operator==(const Key& other) const { return impl == other.impl && version == other.version; }
  };
  struct KeyHash {
    size_t operator()(const Key& k) const {
      return std::hash<const void*>()(k.impl) ^ (static_cast<size_t>(k.version) * 0x9e3779b97f4a7c15ull);
    }
  };
  std::vector<Read> reads_;
  std::unordered_set<Key, KeyHash> seen_;
};

}  // namespace quantfuse
