// Values derived from weights (repacked layouts, prepared zeros, column sums), made once per
// weight and served from here on every later call (docs/DESIGN.md, "Values derived from
// weights").
//
// An entry is keyed by where its source tensors' data lives (data pointer, sizes, strides,
// dtype, device) and a kind; it is served only while every source is alive and its version
// counter is unchanged (an in-place write through the tensor or a view of it bumps it).
//
// CUDA graphs: CUDA-graph trees warm a graph up with every allocation of the calling thread
// routed into the graph's private pool, and refuse to record when a pool block outlives the
// warm-up without being an output.  So a value is made on a worker thread, on a side stream
// ordered after the caller's stream, which allocates from the ordinary pool.  While the
// caller's stream is capturing, a cached value is served (and kept alive for the graph, see
// derived_cache.cpp); a missing one is made inline and not kept (it becomes part of the graph,
// made again on every replay).
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/ArrayRef.h>

#include <cstdint>
#include <functional>
#include <initializer_list>
#include <vector>

namespace quantfuse {

using DerivedMaker = std::function<std::vector<at::Tensor>()>;

// The cached values for (kind, sources, extra), or make()'s.  `make` runs with the sources'
// device and a current stream of its own; it must only launch work on the current stream.
std::vector<at::Tensor> derived(int kind, std::initializer_list<at::Tensor> sources, int64_t extra,
                                const DerivedMaker& make);

// The same for a number of sources known only at run time (the parts of a concatenation), with
// any number of extra key values.  `sources` must not be empty.
std::vector<at::Tensor> derived_list(int kind, c10::ArrayRef<at::Tensor> sources, c10::ArrayRef<int64_t> extra,
                                     const DerivedMaker& make);

// Kinds of derived values (one cache, distinct keys).
enum DerivedKind : int { kAwqRepack = 1, kAwqPrepareSm90 = 2, kWeightColsum = 3, kConcatWeights = 4 };

// Drops every entry and zeroes the counts.
void clear_derived();

// CUDA graphs captured under the quantfuse backend (compile_backend/derived/captured_graphs.py): a graph
// replays the values it was captured with, with no host code of ours running, so a weight changed
// in place afterwards would go unseen.  Each compiled graph calls graph_enter(id) before it runs
// and graph_exit() after; values served while it is captured are recorded under its id with their
// sources' versions, and graph_enter raises when any of those sources has changed (or been freed)
// since.  graph_forget(id) drops the record of a graph that is gone.
void graph_enter(int64_t graph);
void graph_exit();
void graph_forget(int64_t graph);

// {values made, values served from the cache, live entries}, after dropping the entries of freed
// sources.
std::vector<int64_t> derived_stats();

// Drops the entries made from the tensor whose TensorImpl is at `impl`, and those of freed sources.
// A weight's finalizer (compile_backend/derived/freed_weights.py) calls it while the weight is being freed:
// Python runs it before the TensorImpl goes, so the entries could not yet tell that it is gone.
void drop_source(int64_t impl);

}  // namespace quantfuse
