// The public ops' way back to their reference implementation (compile_backend/ops/, define_op in library.py), used
// by the CUDA dispatch when no kernel takes an input: quantfuse::_<op>_reference takes the
// op's arguments and the reason, logs the reason and runs the reference, which also raises
// the error that names a malformed argument.
#pragma once

#include <ATen/core/dispatch/Dispatcher.h>

namespace quantfuse {

// Looked up per call: this is the path of inputs no kernel takes, where the reference's own
// cost dwarfs a schema lookup.
template <class Signature>
c10::TypedOperatorHandle<Signature> reference_op(const char* name) {
  return c10::Dispatcher::singleton().findSchemaOrThrow(name, "").typed<Signature>();
}

}  // namespace quantfuse
