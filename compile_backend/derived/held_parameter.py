"""``HeldParameter``: the tensors of the quantized modules (``compile_backend/quantize/modules.py``),
a parameter whose writes through ``.data`` are seen.

Values derived from a weight (the column sums of an int8 weight, AWQ's repacked layouts) are
cached per weight and served while the weight's version counter is unchanged (docs/DESIGN.md,
"Values derived from weights"): the version counter is the only way the cache learns of a write.
``nn.Parameter.data`` hands out an alias with a version counter of its own, so a write through it
(``layer.weight.data.copy_(new)``, a common loader idiom) leaves the parameter's counter as it was
and the cache keeps serving values of the old weight.  A ``HeldParameter``'s ``.data`` is an alias
that shares the parameter's version counter (``detach()``), so such a write bumps it like any
in-place write (``tensor_data.py`` gives plain tensors that do not require grad the same
``.data``; a ``HeldParameter``'s is this one whatever its ``requires_grad``).  Assigning
``.data = t`` is ``nn.Parameter``'s: the parameter takes ``t``'s storage and keeps its own version
counter.

Otherwise it is an ``nn.Parameter``: the same constructor (``type(p)(t, requires_grad=False)``,
as accelerate writes, builds one), ``__torch_function__`` disabled (operations on it return plain
tensors), ``state_dict`` values plain tensors.  Pickling rebuilds the class, also under
``torch.load(weights_only=True)`` once ``compile_backend`` is imported (the rebuild function is
allowlisted here); without it, that unpickler refuses the rebuild function by name.
``nn.Parameter(p)`` of one raises, as for any subclass of it (``nn.Parameter`` takes a subclass
for a tensor type of its own): ``nn.Parameter(p.detach())`` is the plain parameter over the same
storage.  ``Module._apply`` under ``torch.__future__.set_swap_module_params_on_conversion`` calls
it where a conversion returns the tensor itself (``.to()`` to where it is): the quantized modules
handle that, a module of another class holding one fails to convert.  Dynamo treats a subclass of
``nn.Parameter`` as a tensor subclass: a type guard per tensor and a place in the no-aliasing
check (docs/DESIGN.md, "Guards"); the graphs are the same.  make_fx, which traces only the exact
types it lists, is given this one at import (below).
"""

from __future__ import annotations

import torch
from torch import nn
from torch.fx.experimental import proxy_tensor as _proxy_tensor

from . import freed_weights


class HeldParameter(nn.Parameter):
    """An ``nn.Parameter`` whose ``.data`` shares its version counter (see the module doc)."""

    def __new__(cls, data: torch.Tensor | None = None, requires_grad: bool = True):
        if isinstance(data, HeldParameter):
            # nn.Parameter takes any class but Tensor and Parameter for a tensor subclass of its own
            # (a wrapper whose detach() keeps the class); a HeldParameter is a plain tensor inside.
            data = torch._C.TensorBase.detach(data)
        return super().__new__(cls, data, requires_grad)

    @property
    def data(self) -> torch.Tensor:
        # detach(): an alias of the same storage, not requiring grad, sharing the version counter
        # (the base class's .data makes a fresh counter).
        return torch._C.TensorBase.detach(self)

    @data.setter
    def data(self, value: torch.Tensor) -> None:
        torch._C.TensorBase.data.__set__(self, value)
        # Now perhaps a CUDA weight that values may be derived from (freed_weights.py).
        freed_weights.watch((self,))

    def __reduce_ex__(self, proto):
        # nn.Parameter's rebuilds an nn.Parameter; hooks are not saved, as nn.Parameter saves none.
        state = torch._utils._get_obj_state(self)
        return _rebuild_held_parameter, (self.data, self.requires_grad, state or None)

    def __repr__(self) -> str:
        # Tensor's repr would wrap the values in the class names, "Parameter(HeldParameter([...]))".
        return "Held" + repr(nn.Parameter(torch._C.TensorBase.detach(self), self.requires_grad))


def _rebuild_held_parameter(data: torch.Tensor, requires_grad: bool, state: dict | None) -> HeldParameter:
    param = HeldParameter(data, requires_grad)
    return param if state is None else torch._utils._set_obj_state(param, state)


# torch.load(weights_only=True) calls only allowlisted functions; this one builds nothing but a
# parameter around a tensor the unpickler already made.
torch.serialization.add_safe_globals([_rebuild_held_parameter])

# make_fx traces tensors whose exact type it lists and refuses any other (a subclass it cannot see
# through); a HeldParameter dispatches as a plain tensor (no dispatch key of its own, no
# __torch_function__), so it is listed: a module holding them traces as one holding nn.Parameters.
_traced_types = getattr(_proxy_tensor, "HANDLED_TYPES", None)
if isinstance(_traced_types, tuple) and HeldParameter not in _traced_types:
    _proxy_tensor.HANDLED_TYPES = (*_traced_types, HeldParameter)
