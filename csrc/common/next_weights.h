// Which weights a decode kernel streams next: the L2 hint of common/l2_prefetch.h, learnt from the
// order in which decode launches run on a stream.  A decode step runs its linears in the same
// order every time, so the launch that followed a weight's launch last time is the one that
// follows it now; each launch asks for the first bytes of its successor's weights once it has
// streamed its own.  Nothing is computed from the hint: a wrong or missing successor costs at
// most a useless prefetch, never a wrong result.
#pragma once

#include <ATen/core/Tensor.h>

#include "common/l2_prefetch.h"

namespace quantfuse {

// Called by a decode launch with the tensor its kernel streams (the weight in the kernel's
// layout), on the stream it launches on.  Records `weights` as the successor of the previous
// decode launch on this stream and returns the hint for the weights that followed `weights` the
// last time (none the first time, or when they are gone).  While the stream is captured into a
// CUDA graph compiled under the quantfuse backend, the hinted tensor is kept alive for that
// graph (a graph replays the raw pointer); under any other capture no hint is given.
L2Prefetch next_weights_hint(const at::Tensor& weights);

// A launch on this stream that streams no weights this way (a prefill kernel) ends the chain:
// the next decode launch is nobody's successor.
void next_weights_break(const c10::Device& device);

}  // namespace quantfuse
