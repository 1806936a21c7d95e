// quantfuse::concat_weights on CUDA: the weights of linears that share an input, concatenated
// along N once and served from the derived-value cache (common/derived_cache.h) on every later
// call; made again after any in-place write to a part (copy_, load_state_dict), never inside a
// CUDA-graph warm-up's pool.
//
// Parts that lie side by side in one tensor (quantize_model and from_pretrained store them so:
// compile_backend/quantize/merged.py) are not copied: the value is a tensor over that memory
// (over_parts).  It has a storage object of its own, as a custom op's output must not alias its
// inputs' storages, and shares the parts' version counter, so that values derived from it in
// turn (the AWQ repack) are made again after a write to any part.
//
// The cached tensor itself is returned, not a copy: a copy per call would read and write the
// weights again on every step, more traffic than the GEMM that reads them.  The graph pass that
// inserts the op (passes/horizontal.py) keeps Inductor from reusing the result's memory for
// another buffer; the values downstream kernels derive from it (the AWQ repack, column sums)
// are cached against it in turn, as its address is stable.
#include <ATen/ATen.h>
#include <torch/library.h>

#include <optional>
#include <string>
#include <vector>

#include "common/derived_cache.h"
#include "common/reference.h"

namespace quantfuse {
namespace {

using Reference = at::Tensor(at::TensorList, int64_t, at::OptionalIntArrayRef, c10::string_view);

// Why the cached CUDA path does not take these arguments (empty: it does).  The reference
// raises for malformed ones and concatenates well-formed ones it is handed (e.g. parts on
// another device).
std::string refusal(at::TensorList parts, int64_t dim, at::OptionalIntArrayRef sizes) {
  if (parts.empty()) return "no parts";
  const at::Tensor& first = parts.front();
  for (const auto& p : parts) {
    if (!p.is_cuda() || p.device() != first.device()) return "parts not all on one CUDA device";
    if (p.scalar_type() != first.scalar_type()) return "parts of different dtypes";
    if (p.requires_grad()) return "a part requires grad (the cached value would carry no gradient)";
  }
  if (sizes.has_value()) {
    if (dim != 0 || sizes->size() != parts.size()) return "sizes do not give one extent per part along dim 0";
    for (size_t i = 0; i < parts.size(); ++i) {
      const int64_t n = parts[i].numel();
      if ((*sizes)[i] < 0 || (n != 1 && n != (*sizes)[i])) return "a part has neither 1 nor sizes[i] elements";
    }
    return "";
  }
  const int64_t ndim = first.dim();
  if (ndim == 0 || dim < -ndim || dim >= ndim) return "dim out of range";
  const int64_t d = dim < 0 ? dim + ndim : dim;
  for (const auto& p : parts) {
    if (p.dim() != ndim) return "parts of different ranks";
    for (int64_t k = 0; k < ndim; ++k)
      if (k != d && p.size(k) != first.size(k)) return "parts differ in a dimension other than dim";
  }
  return "";
}

// The parts' concatenation as a view when they are adjacent slices of one tensor: one storage,
// the same dtype and strides, equal sizes but along dim, each starting where the one before ends
// (compile_backend/ops/concat_weights.py, adjacent_view: the same rule).
std::optional<at::Tensor> adjacent_view(at::TensorList parts, int64_t dim, at::OptionalIntArrayRef sizes) {
  const at::Tensor& first = parts.front();
  if (first.is_inference()) return std::nullopt;  // no version counter to share
  if (sizes.has_value()) {
    for (size_t i = 0; i < parts.size(); ++i)
      if (parts[i].dim() != 1 || parts[i].numel() != (*sizes)[i]) return std::nullopt;
    dim = 0;
  }
  const int64_t ndim = first.dim();
  if (ndim == 0) return std::nullopt;
  const int64_t d = dim < 0 ? dim + ndim : dim;
  int64_t offset = first.storage_offset();
  for (const auto& p : parts) {
    if (p.scalar_type() != first.scalar_type() || p.dim() != ndim || !p.strides().equals(first.strides()) ||
        p.storage().unsafeGetStorageImpl() != first.storage().unsafeGetStorageImpl() || p.storage_offset() != offset)
      return std::nullopt;
    for (int64_t k = 0; k < ndim; ++k)
      if (k != d && p.size(k) != first.size(k)) return std::nullopt;
    offset += p.size(d) * p.stride(d);
  }
  std::vector<int64_t> shape(first.sizes().begin(), first.sizes().end());
  shape[d] = 0;
  for (const auto& p : parts) shape[d] += p.size(d);
  return first.as_strided(shape, first.strides(), first.storage_offset());
}

// `view`'s elements as a tensor with a storage object of its own that keeps the view's storage
// alive, sharing the view's version counter (see the top of this file).
at::Tensor over_parts(const at::Tensor& view) {
  c10::Storage keep = view.storage();
  at::Tensor out = at::from_blob(view.data_ptr(), view.sizes(), view.strides(), [keep](void*) {}, view.options());
  out.unsafeGetTensorImpl()->set_version_counter(view.unsafeGetTensorImpl()->version_counter());
  return out;
}

at::Tensor concatenate(at::TensorList parts, int64_t dim, at::OptionalIntArrayRef sizes) {
  if (!sizes.has_value()) return at::cat(parts, dim);
  std::vector<at::Tensor> vectors;
  vectors.reserve(parts.size());
  for (size_t i = 0; i < parts.size(); ++i) vectors.push_back(parts[i].reshape({-1}).expand({(*sizes)[i]}));
  return at::cat(vectors, 0);
}

at::Tensor concat_weights_cuda(at::TensorList parts, int64_t dim, at::OptionalIntArrayRef sizes) {
  const std::string reason = refusal(parts, dim, sizes);
  if (!reason.empty()) {
    return reference_op<Reference>("quantfuse::_concat_weights_reference").call(parts, dim, sizes, reason);
  }
  // The key: dim, then whether sizes were given and their values (the parts' shapes, strides,
  // dtypes and data pointers are keyed by the cache itself).
  std::vector<int64_t> extra{dim, sizes.has_value() ? 1 : 0};
  if (sizes.has_value()) extra.insert(extra.end(), sizes->begin(), sizes->end());
  const auto values = derived_list(kConcatWeights, parts, extra, [&] {
    if (auto view = adjacent_view(parts, dim, sizes)) return std::vector<at::Tensor>{over_parts(*view)};
    return std::vector<at::Tensor>{concatenate(parts, dim, sizes)};
  });
  return values[0];
}

}  // namespace
}  // namespace quantfuse

TORCH_LIBRARY_IMPL(quantfuse, CUDA, m) {
  m.impl("concat_weights", &quantfuse::concat_weights_cuda);
}
