// The public ops' way back to their reference implementation (compile_backend/ops.py), used
// by the CUDA dispatch when no kernel takes an input: quantfuse::_<op>_reference takes the
// op's arguments and the reason, logs the reason and runs the reference, which also raises
// the error that names a malformed argument.
#pragma once

#include <ATen/core/dispatch/Dispatcher.h>

namespace quantfuse {

template <class Signature>
const c10::TypedOperatorHandle<Signature>& reference_op(const char* name) {
  // One lookup per op: the schema is defined when compile_backend.ops is imported, which
  // happens before this library is loaded.
  static const auto handle = c10::Dispatcher::singleton().findSchemaOrThrow(name, "").typed<Signature>();
  return handle;
}

}  // namespace quantfuse
