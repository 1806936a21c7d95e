"""``t.data`` of a plain tensor that does not require grad shares ``t``'s version counter.

Values derived from weights (AWQ's repacked layouts, the concatenated q/k/v and gate/up weights,
the column sums of an int8 weight) are cached per source tensor and served while the source's
version counter is unchanged (docs/DESIGN.md, "Values derived from weights"). torch's
``Tensor.data`` is an alias with a counter of its own, so ``layer.weight.data.copy_(new)``, the
way loaders write weights, would leave the weight's counter as it was and the caches serving
values of the old weight. The quantized modules of this package hold ``HeldParameter``s, whose
``.data`` shares the counter (held_parameter.py); other libraries' modules (an AutoAWQ
``WQLinear_GEMM``'s buffers, compressed-tensors' parameters, the tensors inside torchao's) hold
plain tensors, and a tensor handed to ``torch.ops.quantfuse.*`` directly may be any tensor.

So importing ``compile_backend`` gives ``torch.Tensor.data`` a getter that, for a plain tensor or
``nn.Parameter`` that does not require grad, returns ``detach()``: the alias ``.data`` returns in
every respect (same storage, sizes and strides, not requiring grad, no autograd history, not a
view) but the version counter, which it shares. A quantized weight never requires grad. Every
other tensor -- one that requires grad, a tensor subclass, a fake or functional tensor while
tracing -- gets torch's ``.data``. The setter is torch's.

What changes for other code: a write through ``.data`` to a tensor that does not require grad
bumps its version counter. If autograd saved that tensor for a backward pass, the backward raises
as after any in-place write, instead of computing with values that changed after the forward.
Inside a graph Dynamo traces, ``.data`` is Dynamo's own and this getter does not run.
"""

from __future__ import annotations

import torch
from torch import nn

# torch's descriptor, kept for the cases this module leaves alone and for the setter
TORCH_DATA = torch._C.TensorBase.data

# Exactly these classes: a subclass may give .data or detach() a meaning of its own.
_PLAIN = (torch.Tensor, nn.Parameter)


def _get_data(self: torch.Tensor) -> torch.Tensor:
    if type(self) in _PLAIN and not self.requires_grad:
        return torch._C.TensorBase.detach(self)
    return TORCH_DATA.__get__(self)


def _set_data(self: torch.Tensor, value: torch.Tensor) -> None:
    TORCH_DATA.__set__(self, value)


def install() -> None:
    """Puts the getter on ``torch.Tensor`` (once per process)."""
    if getattr(torch.Tensor.__dict__.get("data"), "fget", None) is not _get_data:
        torch.Tensor.data = property(_get_data, _set_data, doc=TORCH_DATA.__doc__)


install()
