// The Autograd step of the public quantfuse ops on CUDA, in C++.
//
// The ops' derivatives are Python formulas (each family module of compile_backend/ops/, registered with
// torch.library.register_autograd for the Autograd alias key).  A Python autograd kernel costs
// every call a trip through the interpreter, whether or not a gradient is wanted; at decode
// without CUDA graphs that was the largest part of the host time above the kernel's own.  This
// kernel, registered for AutogradCUDA (which takes precedence over the alias on CUDA tensors),
// decides in C++:
//
// * no gradient wanted (grad mode off, or no tensor argument requires grad): straight to the
//   op's CUDA kernel, below autograd;
// * a gradient wanted: on to the Python formula, which the alias registered for AutogradOther
//   as well; redispatching there with the CUDA backend keys kept makes the formula's own
//   redispatch land on the CUDA kernel as before.
#include <ATen/core/dispatch/Dispatcher.h>
#include <c10/core/DispatchKeySet.h>
#include <c10/core/GradMode.h>
#include <torch/library.h>

namespace quantfuse {
namespace {

bool requires_grad(const c10::IValue& v) {
  if (v.isTensor()) {
    const at::Tensor& t = v.toTensor();
    return t.defined() && t.requires_grad();
  }
  if (v.isTensorList()) {
    for (const at::Tensor& t : v.toTensorList().vec()) {
      if (t.defined() && t.requires_grad()) return true;
    }
  }
  return false;
}

void autograd_cuda(const c10::OperatorHandle& op, c10::DispatchKeySet ks, torch::jit::Stack* stack) {
  const size_t n = op.schema().arguments().size();
  bool wanted = false;
  if (c10::GradMode::is_enabled()) {
    for (size_t i = stack->size() - n; i < stack->size() && !wanted; ++i) wanted = requires_grad((*stack)[i]);
  }
  const c10::DispatchKeySet below = ks & c10::after_autograd_keyset;
  op.redispatchBoxed(wanted ? below | c10::DispatchKeySet(c10::DispatchKey::AutogradOther) : below, stack);
}

}  // namespace

// Every public op with a derivative in compile_backend/ops/ (ops.library.WITH_AUTOGRAD).
TORCH_LIBRARY_IMPL(quantfuse, AutogradCUDA, m) {
  for (const char* name : {"scaled_mm", "scaled_mm_azp", "awq_gemm", "awq_dequantize", "w8a16_gemm"}) {
    m.impl(name, torch::CppFunction::makeFromBoxedFunction<&autograd_cuda>());
  }
}

}  // namespace quantfuse
