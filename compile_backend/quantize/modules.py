"""The quantized modules, in plain torch ops.

These are the forms users have in their models; the passes recognise them and
the ops reproduce their math.  ``quantize_model`` (``model.py``) swaps ``nn.Linear``
layers for them with round-to-nearest quantization (``weights.py``).

* ``W8A8Linear``: int8 or float8_e4m3fn weights ``[N, K]`` with per-tensor or
  per-channel scales; activations quantized per call (dynamic, per-token or
  per-tensor) or with a calibrated scale (static); symmetric, or asymmetric
  int8 with a per-tensor or per-token zero point.  The forward is written in
  the dequantize-then-matmul form (docs/DESIGN.md pass form 2), computed in float32
  and rounded once to the output dtype.
* ``AWQLinear``: AWQ-format ``qweight``/``qzeros``/``scales`` (docs/DESIGN.md's bit
  order), group sizes 32/64/128 or per-channel (group = K), optional bias; ``qweight`` held in
  the kernels' fragment layout, converted from and to the AWQ layout on the way in and out.
* ``W8A16Linear``: int8 weight-only (W8A16): an int8 weight ``[N, K]`` with a per-channel (or
  per-tensor) scale in float32 or the activation dtype, activations left in float; the forward is
  ``F.linear(x, w_q · s, bias)``, the form ``passes/w8a16_gemm.py`` fuses into ``w8a16_gemm``.

They hold their tensors as frozen parameters (``requires_grad=False``): guard evaluation skips
a quantized layer as it skips an ``nn.Linear``, which matters per decode step (docs/DESIGN.md,
"Guards").  They are ``HeldParameter``s, whose ``.data`` shares the version counter, so that the
cache of values derived from weights sees writes through ``.data`` (``compile_backend/derived/held_parameter.py``);
every way a tensor is put in (assignment, ``set_tensors``, ``load_state_dict``, dtype and device
conversions) keeps the class.  ``set_tensors`` replaces them.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..derived import HeldParameter, watch
from ..ops.awq_gemm import (
    AWQ_ACT_DTYPES,
    AWQ_PACK,
    awq_layout,
    awq_unpack,
    awq_values,
    fragment_layout,
    fragment_layout_takes,
)
from ..ops.library import OUT_DTYPES
from ..ops.quantize_per_token import X_DTYPES, activation_params, quantize_per_token, quantize_with
from ..ops.scaled_mm_azp import azp_operands
from ..ops.w8a16_gemm import W8A16_ACT_DTYPES
from .weights import quantize_weight_awq, quantize_weight_fp8, quantize_weight_int8

# --------------------------------------------------------------------------- held tensors


def _frozen(t: torch.Tensor | None) -> HeldParameter | None:
    """``t`` as a held tensor: a frozen ``HeldParameter`` sharing its storage (no copy)."""
    if t is None or isinstance(t, HeldParameter) and not t.requires_grad:
        return t
    held = HeldParameter(t.detach(), requires_grad=False)
    watch((held,))
    return held


def _keep_held(module: nn.Module, before: dict) -> None:
    """After torch's own code replaced ``module``'s tensors (``nn.Module._apply``,
    ``_load_from_state_dict``), make each a ``HeldParameter`` again.  Those paths build plain
    ``nn.Parameter``s where they overwrite a parameter, and under
    ``torch.__future__.set_swap_module_params_on_conversion(True)`` ``swap_tensors`` moves a
    plain ``nn.Parameter``'s class onto the object kept in place: a tensor that was held
    (``before``, name -> tensor) gets its class back and keeps its identity, as the swap meant."""
    for name, t in module._parameters.items():
        if t is None or isinstance(t, HeldParameter):
            continue
        if t is before.get(name) and type(t) is nn.Parameter:
            t.__class__ = HeldParameter
            # The swap gave the kept object another tensor (on a move to the GPU, a CUDA one that
            # values may be derived from); moves that set ``.data`` are watched by its setter.
            watch((t,))
        else:
            module._parameters[name] = _frozen(t)


def set_tensors(module: nn.Module, **tensors: torch.Tensor | None) -> nn.Module:
    """Replace tensors a quantized module (``W8A8Linear``, ``AWQLinear``, ``W8A16Linear``) holds
    (``weight=...``, ``scales=...``) without copying them; each is kept as a frozen parameter (see
    the module doc).  Returns
    ``module``.  A name the module does not hold raises ``KeyError``."""
    for name, t in tensors.items():
        if name not in module._parameters:
            raise KeyError(f"set_tensors: {type(module).__name__} holds no tensor {name!r}; "
                           f"it holds {list(module._parameters)}")
        module._parameters[name] = _frozen(t)
    module._held_changed()
    return module


def held_tensors(module: nn.Module) -> dict[str, torch.Tensor | None]:
    """name -> tensor (None where absent, e.g. no bias) of what a quantized module holds."""
    return dict(module._parameters)


def _is_view_of_more(t: torch.Tensor) -> bool:
    """``t`` covers less than its storage, or not contiguously."""
    return not t.is_contiguous() or t.untyped_storage().nbytes() != t.numel() * t.element_size()


class _HoldsTensors(nn.Module):
    """Assigning any tensor to a held name (``layer.scales = t``) stores it as a frozen
    ``HeldParameter``; ``load_state_dict`` keeps the class (``assign=True`` and swapping put
    plain parameters in)."""

    def __setattr__(self, name: str, value) -> None:
        params = self.__dict__.get("_parameters")
        held = params is not None and name in params and isinstance(value, torch.Tensor)
        if held:
            value = _frozen(value)
        super().__setattr__(name, value)
        if held:
            self._held_changed()

    def _load_from_state_dict(self, *args, **kwargs) -> None:
        before = dict(self._parameters)
        try:
            super()._load_from_state_dict(*args, **kwargs)
        finally:
            _keep_held(self, before)
            self._held_changed()

    def _held_changed(self) -> None:
        """Called after held tensors were replaced or loaded (``set_tensors``, ``load_state_dict``, moves):
        a module keeping values derived from them remakes those here."""

    def _save_to_state_dict(self, destination, prefix, keep_vars) -> None:
        super()._save_to_state_dict(destination, prefix, keep_vars)
        if keep_vars:
            return
        for name, t in self._parameters.items():
            key = prefix + name
            if t is not None and key in destination:
                destination[key] = self._saved(name, destination[key])

    def _saved(self, name: str, t: torch.Tensor) -> torch.Tensor:
        """Held tensor ``name`` (``t``, detached) as ``state_dict`` gives it: the documented format.  A
        tensor stored as a view of a merged one (the projections that share an input: merged.py) goes
        out as a contiguous tensor of its own: savers refuse tensors that share memory (safetensors)
        or are not contiguous.  Costs a copy of those tensors while the state dict is held."""
        return t.clone(memory_format=torch.contiguous_format) if _is_view_of_more(t) else t


def _dtype_attribute(name: str, doc: str) -> property:
    """A ``torch.dtype`` attribute kept in the instance ``__dict__`` (as ``_<name>``) by the
    dtype's name.  Dynamo skips the guards of a module whose ``__dict__`` is unchanged since the
    last call only when every value read from it is immutable (ints, strs, tensors, ...); a
    ``torch.dtype`` is not one, a str is.  ``forward`` reads the str, not the property: Dynamo
    guards a property through the class ``__dict__``, which is not skipped either."""
    key = "_" + name

    def get(self) -> torch.dtype:
        return getattr(torch, getattr(self, key))

    def set_(self, dtype: torch.dtype) -> None:
        if not isinstance(dtype, torch.dtype):
            raise TypeError(f"{type(self).__name__}.{name}: {dtype!r}; expected a torch.dtype")
        setattr(self, key, str(dtype).removeprefix("torch."))

    return property(get, set_, doc=doc)


# --------------------------------------------------------------------------- dtype conversions


def _target(fn, like: torch.Tensor) -> torch.Tensor:
    """What ``fn`` (a function ``nn.Module._apply`` maps over tensors) makes of an empty tensor
    like ``like``: its dtype and device say whether ``fn`` converts dtypes, and to what."""
    return fn(torch.empty(0, dtype=like.dtype, device=like.device))


def _apply_keeping_dtypes(module: nn.Module, fn, recurse: bool, names) -> None:
    """``nn.Module._apply(fn)``, except that each held tensor in ``names`` keeps its dtype.

    Where ``fn`` keeps a tensor's dtype (``.to(device)``, ``.cuda()``, ``share_memory_``,
    ``to_empty``) it is applied as usual; where it would convert the dtype
    (``.to(dtype)``, ``.half()``, ``.bfloat16()``, ``.float()``, ``.type()``) the tensor
    only follows ``fn``'s device.  Nothing changes if ``fn`` raises.
    """
    before, kept = dict(module._parameters), {}
    for name in names:
        t = module._parameters.get(name)
        if t is None:
            continue
        probe = _target(fn, t)
        if probe.dtype != t.dtype:
            kept[name] = (t, t if probe.device == t.device else _frozen(t.to(device=probe.device)))
    for name in kept:
        module._parameters[name] = None  # nn.Module._apply skips None entries; the slot keeps its order

    def applied(t: torch.Tensor) -> torch.Tensor:
        out = fn(t)
        # fn may return the tensor itself (``.to()`` of a tensor already there); the swap and
        # overwrite paths of nn.Module._apply wrap what it returns in nn.Parameter, which takes no
        # subclass of it: they get an alias, sharing storage and version counter.
        return torch._C.TensorBase.detach(out) if isinstance(out, HeldParameter) else out

    try:
        nn.Module._apply(module, applied, recurse)
    except BaseException:
        for name, (old, _) in kept.items():
            module._parameters[name] = old
        _keep_held(module, before)
        raise
    _keep_held(module, before)
    for name, (_, new) in kept.items():
        module._parameters[name] = new


# --------------------------------------------------------------------------- eager calls of the fused ops

def calls_op_eagerly(x: torch.Tensor) -> bool:
    """Whether a quantized layer's ``forward`` calls its fused op itself rather than writing the
    dequantize-then-matmul form: in eager inference on CUDA, where that form would dequantize every
    weight on every call (transformers' ``generate`` runs its prefill eagerly, so a prompt would pay
    it in every layer).  Never while a graph is traced (Dynamo, or any dispatch mode such as
    ``make_fx``'s): the passes match the form and fuse it there.  Never where autograd records the
    call (the form's own derivatives stay).  The op's result is what the compiled model computes.

    Callers write ``not torch.compiler.is_compiling() and calls_op_eagerly(x)``: Dynamo folds
    ``is_compiling()``, so x is never an argument of an inlined call while tracing, which some torch
    versions (2.11) take as x's first use, lifting it as a graph input ahead of the layer's tensors."""
    return (not torch.compiler.is_compiling() and x.is_cuda and type(x) is torch.Tensor
            and not (torch.is_grad_enabled() and x.requires_grad)
            and torch._C._len_torch_dispatch_stack() == 0)


# --------------------------------------------------------------------------- W8A8


class W8A8Linear(_HoldsTensors):
    """y = dequant(quant(x)) @ dequant(w).T + bias, in the dequantize-then-matmul form.

    Float dtype conversions of the module (``.to(dtype)``, ``.half()``, ``.bfloat16()``,
    ``.float()``) change the activation/output dtype only: ``out_dtype`` and ``bias``
    follow the new dtype, while the quantized ``weight`` (int8 or float8) and the float32
    ``weight_scale`` / ``input_scale`` and int32 ``input_zero_point`` keep their dtypes
    (converting them would dequantize FP8 weights or round scales).  Device moves move
    everything.
    """

    _QUANTIZED = ("weight", "weight_scale", "input_scale", "input_zero_point")
    weight_dtype = _dtype_attribute("weight_dtype", "torch.int8 or torch.float8_e4m3fn")
    out_dtype = _dtype_attribute("out_dtype", "the output (and bias) dtype")

    def __init__(
        self,
        in_features: int,
        out_features: int,
        *,
        bias: bool = True,
        weight_dtype: torch.dtype = torch.int8,
        per_channel: bool = True,
        dynamic: bool = True,
        per_token: bool = True,
        symmetric: bool = True,
        out_dtype: torch.dtype = torch.bfloat16,
    ):
        super().__init__()
        if weight_dtype not in (torch.int8, torch.float8_e4m3fn):
            raise ValueError(f"W8A8Linear: weight_dtype {weight_dtype}; expected torch.int8 or torch.float8_e4m3fn")
        if not symmetric and weight_dtype != torch.int8:
            raise ValueError("W8A8Linear: asymmetric activations need weight_dtype=torch.int8")
        if not dynamic and per_token:
            raise ValueError("W8A8Linear: a static (calibrated) activation scale is per-tensor; pass per_token=False")
        self.in_features, self.out_features = in_features, out_features
        self.weight_dtype, self.out_dtype = weight_dtype, out_dtype
        self.per_channel, self.dynamic, self.per_token, self.symmetric = per_channel, dynamic, per_token, symmetric
        for name, t in (
            ("weight", torch.zeros(out_features, in_features, dtype=weight_dtype)),
            ("weight_scale", torch.ones(out_features if per_channel else (), dtype=torch.float32)),
            ("bias", torch.zeros(out_features, dtype=out_dtype) if bias else None),
            # Static quantization: calibrated scale (and zero point when asymmetric).
            ("input_scale", None if dynamic else torch.ones((), dtype=torch.float32)),
            ("input_zero_point", None if dynamic or symmetric else torch.zeros((), dtype=torch.int32)),
        ):
            self.register_parameter(name, _frozen(t))

    @classmethod
    def from_linear(cls, linear: nn.Linear, calibration: torch.Tensor | None = None, **kw):
        w = linear.weight
        mod = cls(linear.in_features, linear.out_features, bias=linear.bias is not None, **kw)
        quant = quantize_weight_int8 if mod.weight_dtype == torch.int8 else quantize_weight_fp8
        q, s = quant(w, per_channel=mod.per_channel)
        mod.weight.copy_(q)
        mod.weight_scale.copy_(s)
        if linear.bias is not None:
            mod.bias.copy_(linear.bias.detach().to(mod.out_dtype))
        if not mod.dynamic:
            if calibration is None:
                raise ValueError("W8A8Linear.from_linear: static quantization needs 'calibration' activations")
            scale, zp = mod._activation_params(calibration.reshape(-1, linear.in_features).float())
            mod.input_scale.copy_(scale.reshape(()))
            if zp is not None:
                mod.input_zero_point.copy_(zp.reshape(()).to(torch.int32))
        return mod.to(w.device)

    def _activation_params(self, x: torch.Tensor):
        """(scale, zero point or None) for float32 activations [M, K]."""
        return activation_params(x, self.weight.dtype, self.symmetric, self.per_token)

    def quantize_input(self, x: torch.Tensor):
        """float activations [M, K] -> (quantized [M, K], float32 scale, zero point or None)."""
        xf = x.to(torch.float32)
        if self.dynamic:
            scale, zp = self._activation_params(xf)
        else:
            scale = self.input_scale
            zp = None if self.symmetric else self.input_zero_point.to(torch.float32)
        return quantize_with(xf, scale, zp, self.weight.dtype), scale, zp

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lead = x.shape[:-1]
        x2 = x.reshape(-1, self.in_features)
        out_dtype = getattr(torch, self._out_dtype)  # not the property: see _dtype_attribute
        if (not torch.compiler.is_compiling() and calls_op_eagerly(x2) and out_dtype in OUT_DTYPES
                and (self.bias is None or self.bias.dtype == out_dtype)):
            return self.forward_op(x2).reshape(*lead, self.out_features)
        q, scale, zp = self.quantize_input(x2)
        xq = q.to(torch.float32)
        if zp is not None:
            xq = xq - zp
        x_dq = xq * scale
        w_scale = self.weight_scale.unsqueeze(-1) if self.per_channel else self.weight_scale
        w_dq = self.weight.to(torch.float32) * w_scale
        bias = None if self.bias is None else self.bias.to(torch.float32)
        y = F.linear(x_dq, w_dq, bias).to(out_dtype)
        return y.reshape(*lead, self.out_features)

    def forward_op(self, x2: torch.Tensor) -> torch.Tensor:
        """``forward`` of ``[M, K]`` activations through ``quantfuse::scaled_mm`` (or ``scaled_mm_azp``
        with zero points), as the passes fuse the form: the quantized activation, the weight's
        transpose, float32 scale vectors, the bias in ``out_dtype``; per-token zero points with the
        weight's column sums, a per-tensor one folded into them.  Dynamic per-token activations
        are quantized by ``quantfuse::quantize_per_token`` (one kernel, the same values); activations
        in a dtype it does not take (float64) by the form."""
        if self.dynamic and self.per_token and x2.dtype in X_DTYPES:
            q, scale, zp = quantize_per_token(x2, self.weight.dtype, self.symmetric)
            zp = None if self.symmetric else zp
        else:
            q, scale, zp = self.quantize_input(x2)
        out_dtype = getattr(torch, self._out_dtype)
        args = (q, self.weight.t(), scale.reshape(-1), self.weight_scale.reshape(-1), out_dtype)
        if zp is None:
            return torch.ops.quantfuse.scaled_mm(*args, self.bias)
        azp_adj, azp = azp_operands(self.weight, zp, per_tensor=not self.per_token)
        return torch.ops.quantfuse.scaled_mm_azp(*args, azp_adj, azp, self.bias)

    def _apply(self, fn, recurse=True):
        target = _target(fn, torch.empty(0, dtype=self.out_dtype, device=self.weight.device)).dtype
        keep = self._QUANTIZED if target.is_floating_point else (*self._QUANTIZED, "bias")
        _apply_keeping_dtypes(self, fn, recurse, keep)
        if target.is_floating_point:
            self.out_dtype = target
        return self

    def extra_repr(self) -> str:
        return (
            f"{self.in_features}, {self.out_features}, weight={self.weight_dtype}, "
            f"per_channel={self.per_channel}, dynamic={self.dynamic}, per_token={self.per_token}, "
            f"symmetric={self.symmetric}, out_dtype={self.out_dtype}, bias={self.bias is not None}"
        )


# --------------------------------------------------------------------------- AWQ


def inverse_order(perm: torch.Tensor) -> torch.Tensor:
    """int64 ``inv`` with ``inv[perm[j]] = j``: ``x.index_select(-1, perm)`` is
    ``torch.empty_like(x).index_copy_(-1, inv, x)``.  Kept on ``perm`` itself while it is unchanged, so
    layers that share one ``perm`` tensor (q/k/v, gate/up) share one inverse and a compiled graph puts
    their shared input in order once.  The cache is keyed by perm's storage as well as its version: a
    module's move (``.to``, ``.cuda``) swaps the data of the same parameter object, and an inverse left on
    the old device would be copied to the new one on every call (refused inside CUDA graph capture)."""
    try:
        version = perm._version
    except RuntimeError:  # an inference tensor keeps no version counter (and cannot be written)
        version = None
    key = (version, perm.device, perm.data_ptr())
    cached = getattr(perm, "_quantfuse_inverse", None)
    if cached is not None and cached[0] == key:
        return cached[1]
    with torch.no_grad():
        inv = torch.empty(perm.shape, dtype=torch.int64, device=perm.device)
        inv[perm.long()] = torch.arange(perm.numel(), device=perm.device)
    perm._quantfuse_inverse = (key, inv)
    return inv


class AWQLinear(_HoldsTensors):
    """W4A16 linear layer holding AWQ-format weights; dequantizes in the activation dtype.

    ``group_size`` is a positive divisor of ``in_features``, or -1 (or 0) for one group
    (per-channel).

    The format keeps ``scales`` (and ``bias``) in the activation dtype, float16 or
    bfloat16.  Dtype conversions of the module follow that: ``.half()`` / ``.bfloat16()``
    / ``.to(float16 or bfloat16)`` convert ``scales`` and ``bias`` (float16 <-> bfloat16
    rounds them: that is what was asked for), and the layer then computes in the new
    dtype.  A conversion to a dtype the format cannot hold (``.float()``, ``.double()``)
    leaves ``scales`` and ``bias`` as they are: the layer keeps computing in their dtype,
    casting its input to it and its output to the new dtype (``out_dtype``).  The packed
    ``qweight`` / ``qzeros`` never change dtype.  Device moves move everything.

    Act-order (``act_order=True``; GPTQ checkpoints with ``desc_act``, ``checkpoints/gptq.py``):
    ``qweight``'s rows are the input channels reordered so that each group is contiguous, and
    ``perm`` (int32 ``[K]``, a held tensor like the others) says which: row ``j`` is input channel
    ``perm[j]``.  ``forward`` puts the input in that order before the AWQ matmul, written as a scatter
    by the inverse order (``perm_inverse``, int64, not saved, made from ``perm`` and shared by the layers
    that share ``perm``; remade when ``perm`` is assigned, set by ``set_tensors`` or loaded, not when it is
    written in place, which a compiled graph then does not see).  Compiled, Inductor computes it in the
    kernel that makes the input (an RMSNorm), which then reads its own inputs in order and stores each
    value at its place, where the gather ``x.index_select(-1, perm)`` would load them through the order.
    The eager CUDA path calls ``quantfuse::awq_gemm`` with ``perm`` (the op gathers first).  In a gated
    MLP ``down_proj``'s order is moved into ``gate_proj``'s and ``up_proj``'s output columns instead
    (``act_order.py``).
    ``dequantized_weight`` is in the stored (reordered) row order.  Without act-order ``perm`` is
    None and the layer is as before (same ``state_dict`` keys).

    One layout per weight: where ``in_features % 16 == 0`` and ``out_features % 64 == 0`` (every
    LLM's linears), ``qweight`` is held in the kernels' fragment layout ``[N/64, K/16, 32, 4]``
    (``ops/awq_gemm.py``), which the AWQ ops read for every M, so the module's tensor is the
    weight's only copy on the GPU.  What goes in and out is the AWQ layout ``[K, N/8]``:
    ``state_dict`` converts on the way out (``keep_vars=True`` gives the held tensors as they
    are), ``load_state_dict`` and ``from_state_dict`` on the way in, and ``awq_qweight()``
    gives it on demand.  Other shapes hold the AWQ layout itself.
    """

    out_dtype = _dtype_attribute("out_dtype", "the output dtype (see the class doc)")
    # How quantize_model made the weights ("round-to-nearest", or "the AWQ search (calibrated)"); None
    # for weights put in otherwise (a checkpoint, load_state_dict).  explain() reports it.
    made_by: str | None = None

    def __init__(self, in_features: int, out_features: int, *, group_size: int = 128,
                 bias: bool = True, dtype: torch.dtype = torch.float16, act_order: bool = False):
        super().__init__()
        for name, value in (("in_features", in_features), ("out_features", out_features)):
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"AWQLinear: {name} {value!r}; expected a positive integer")
        group_size = in_features if group_size in (-1, 0) else group_size
        if not isinstance(group_size, int) or group_size <= 0 or in_features % group_size != 0:
            raise ValueError(f"AWQLinear: group_size {group_size!r}; expected a positive divisor of in_features "
                             f"{in_features}, or -1 for one group per output channel")
        if out_features % AWQ_PACK != 0:
            raise ValueError(f"AWQLinear: out_features {out_features} is not a multiple of {AWQ_PACK}")
        if dtype not in (torch.float16, torch.bfloat16):
            raise ValueError(f"AWQLinear: dtype {dtype}; expected torch.float16 or torch.bfloat16")
        self.in_features, self.out_features, self.group_size = in_features, out_features, group_size
        self.out_dtype = dtype
        groups, packed = in_features // group_size, out_features // AWQ_PACK
        qweight = (torch.zeros(out_features // 64, in_features // 16, 32, 4, dtype=torch.int32)
                   if fragment_layout_takes(in_features, out_features) else
                   torch.zeros(in_features, packed, dtype=torch.int32))
        for name, t in (("qweight", qweight),
                        ("qzeros", torch.zeros(groups, packed, dtype=torch.int32)),
                        ("scales", torch.ones(groups, out_features, dtype=dtype)),
                        ("bias", torch.zeros(out_features, dtype=dtype) if bias else None),
                        ("perm", torch.arange(in_features, dtype=torch.int32) if act_order else None)):
            self.register_parameter(name, _frozen(t))
        self.register_buffer("perm_inverse", None, persistent=False)
        self._held_changed()

    @classmethod
    def from_linear(cls, linear: nn.Linear, group_size: int = 128, dtype: torch.dtype = torch.float16):
        mod = cls(linear.in_features, linear.out_features, group_size=group_size,
                  bias=linear.bias is not None, dtype=dtype)
        qweight, qzeros, scales = quantize_weight_awq(linear.weight, mod.group_size, dtype)
        mod.qweight.copy_(mod.held_layout(qweight))
        mod.qzeros.copy_(qzeros)
        mod.scales.copy_(scales)
        if linear.bias is not None:
            mod.bias.copy_(linear.bias.detach().to(dtype))
        return mod.to(linear.weight.device)

    @classmethod
    def from_state_dict(cls, state: dict, prefix: str = "", group_size: int | None = None):
        """Build from an AutoAWQ-format state dict (``qweight``, ``qzeros``, ``scales``, ``bias``),
        or one of this class's with ``perm`` (act-order, see the class doc).

        The group size is read from the shapes (``K / scales.shape[0]``).  Malformed
        entries raise ``ValueError`` naming the key; so does an act-order ``g_idx`` that
        is not the in-order grouping (a layer with out-of-order groups is stored regrouped,
        with ``perm``: ``checkpoints/gptq.py`` makes one).
        """
        keys = {k: prefix + k for k in ("qweight", "qzeros", "scales", "bias", "g_idx", "perm")}
        try:
            qweight, qzeros, scales = (state[keys[k]] for k in ("qweight", "qzeros", "scales"))
        except KeyError as exc:
            raise KeyError(f"AWQLinear.from_state_dict: missing {exc.args[0]!r} in the state dict") from None

        def bad(key, t, expected):
            raise ValueError(f"AWQLinear.from_state_dict: {keys[key]!r} has shape {tuple(t.shape)}, dtype {t.dtype}; "
                             f"expected {expected}")

        if qweight.dim() != 2 or qweight.dtype != torch.int32 or 0 in qweight.shape:
            bad("qweight", qweight, "a non-empty 2-D int32 tensor [K, N/8]")
        K, N = qweight.shape[0], qweight.shape[1] * AWQ_PACK
        if scales.dim() != 2 or scales.shape[1] != N or scales.dtype not in (torch.float16, torch.bfloat16):
            bad("scales", scales, f"a 2-D float16 or bfloat16 tensor [K/group_size, N] with N = {N} from 'qweight'")
        rows = scales.shape[0]
        if rows == 0 or K % rows != 0:
            bad("scales", scales, f"K/group_size rows, a divisor of K = {K} from 'qweight'")
        inferred = K // rows
        if group_size is not None and group_size != inferred:
            raise ValueError(f"AWQLinear.from_state_dict: group_size {group_size} but {keys['scales']!r} "
                             f"(shape {tuple(scales.shape)}) implies {inferred} for K = {K}")
        if qzeros.dtype != torch.int32 or tuple(qzeros.shape) != (rows, N // AWQ_PACK):
            bad("qzeros", qzeros, f"int32 of shape ({rows}, {N // AWQ_PACK}) = (K/group_size, N/8)")
        bias = state.get(keys["bias"])
        if bias is not None and (bias.dim() != 1 or bias.shape[0] != N):
            bad("bias", bias, f"a 1-D tensor of N = {N} elements")
        g_idx = state.get(keys["g_idx"])
        if g_idx is not None:
            in_order = torch.arange(K, device=g_idx.device) // inferred
            if tuple(g_idx.shape) != (K,) or not torch.equal(g_idx.to(in_order.dtype), in_order):
                raise ValueError(f"AWQLinear.from_state_dict: {keys['g_idx']!r} assigns input channels to groups out "
                                 "of order (act-order / desc_act); AWQLinear groups them in order and cannot load it")
        perm = state.get(keys["perm"])
        if perm is not None and (tuple(perm.shape) != (K,) or perm.dtype not in (torch.int32, torch.int64)
                                 or not torch.equal(perm.sort().values.long(), torch.arange(K, device=perm.device))):
            bad("perm", perm, f"an int32 or int64 permutation of range(K), K = {K} from 'qweight'")
        mod = cls(K, N, group_size=inferred, bias=bias is not None, dtype=scales.dtype, act_order=perm is not None)
        mod.load_state_dict({k: v for k, v in
                             dict(qweight=qweight, qzeros=qzeros, scales=scales, bias=bias,
                                  perm=None if perm is None else perm.to(torch.int32)).items()
                             if v is not None})
        return mod.to(qweight.device)

    def held_layout(self, qweight: torch.Tensor) -> torch.Tensor:
        """An AWQ-layout ``qweight`` ``[K, N/8]`` of this layer's shape in the layout the layer holds."""
        return fragment_layout(qweight) if self.qweight.dim() == 4 else awq_layout(qweight)

    def awq_qweight(self) -> torch.Tensor:
        """``qweight`` in the AWQ layout ``[K, N/8]`` (a conversion where the layer holds fragments)."""
        return awq_layout(self.qweight)

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                              error_msgs) -> None:
        key = prefix + "qweight"
        t = state_dict.get(key)
        if isinstance(t, torch.Tensor) and self.qweight is not None and t.dim() != self.qweight.dim():
            awq_shape = (self.in_features, self.out_features // AWQ_PACK)
            if t.dim() == 2 and tuple(t.shape) != awq_shape:
                error_msgs.append(f"size mismatch for {key}: the AWQ-layout qweight has shape {tuple(t.shape)}; "
                                  f"this layer takes [K, N/8] = {list(awq_shape)}")
            elif t.dtype == torch.int32 and t.device.type != "meta":
                state_dict[key] = self.held_layout(t) if t.dim() == 2 else awq_layout(t)
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                                      error_msgs)

    def _saved(self, name: str, t: torch.Tensor) -> torch.Tensor:
        # The fragment layout goes out in the AWQ layout (a new tensor of its own).
        return awq_layout(t) if name == "qweight" and t.dim() == 4 else super()._saved(name, t)

    def dequantized_weight(self) -> torch.Tensor:
        """[K, N] weight in the activation dtype (rows in the stored order: see ``perm``)."""
        if self.qweight.dim() == 4 and self.scales.dtype in AWQ_ACT_DTYPES:
            # The fragment layout: the op dequantizes it, and the AWQ pass fuses a matmul of it.
            return torch.ops.quantfuse.awq_dequantize(self.qweight, self.scales, self.qzeros, self.group_size)
        w = awq_values(self.qweight)
        z = awq_unpack(self.qzeros).repeat_interleave(self.group_size, dim=0)
        return (w - z).to(self.scales.dtype) * self.scales.repeat_interleave(self.group_size, dim=0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        compute = self.scales.dtype
        out_dtype = getattr(torch, self._out_dtype)  # not the property: see _dtype_attribute
        if out_dtype != compute:  # converted to a dtype the format cannot hold (see the class doc)
            x = x.to(compute)
        if not torch.compiler.is_compiling() and calls_op_eagerly(x) and (
                self.bias is None or self.bias.dtype == compute):
            y = self.forward_op(x.reshape(-1, self.in_features)).reshape(*x.shape[:-1], self.out_features)
            return y if out_dtype == compute else y.to(out_dtype)
        if self.perm is not None:  # act-order: x.index_select(-1, perm) as a scatter (see the class doc)
            # Eagerly the inverse is looked up on perm (remade after an in-place write into it); a
            # compiled graph reads the buffer as an input.
            inv = self.perm_inverse if torch.compiler.is_compiling() else inverse_order(self.perm)
            x = torch.empty_like(x).index_copy_(-1, inv, x)
        y = torch.matmul(x, self.dequantized_weight())
        y = y if self.bias is None else y + self.bias
        return y if out_dtype == compute else y.to(out_dtype)

    def forward_op(self, x2: torch.Tensor) -> torch.Tensor:
        """``forward`` of ``[M, K]`` activations in the scales' dtype through ``quantfuse::awq_gemm``
        (the bias and the act-order gather folded in), as the passes fuse the form."""
        return torch.ops.quantfuse.awq_gemm(x2, self.qweight, self.scales, self.qzeros, self.group_size, self.bias,
                                            self.perm)

    def _held_changed(self) -> None:
        self.perm_inverse = None if self.perm is None else inverse_order(self.perm)

    def _apply(self, fn, recurse=True):
        target = _target(fn, torch.empty(0, dtype=self.out_dtype, device=self.qweight.device)).dtype
        in_format = target in (torch.float16, torch.bfloat16)
        _apply_keeping_dtypes(self, fn, recurse, ("qweight", "qzeros", "perm") if in_format else
                              ("qweight", "qzeros", "perm", "scales", "bias"))
        self._held_changed()
        if target.is_floating_point:
            self.out_dtype = target
        return self

    def extra_repr(self) -> str:
        out = "" if self.out_dtype == self.scales.dtype else f", out_dtype={self.out_dtype}"
        return (f"{self.in_features}, {self.out_features}, group_size={self.group_size}, "
                f"dtype={self.scales.dtype}{out}, bias={self.bias is not None}"
                + (", act_order=True" if self.perm is not None else ""))


# --------------------------------------------------------------------------- W8A16


class W8A16Linear(_HoldsTensors):
    """y = x @ (w_q · s)ᵀ + bias: int8 weight-only (W8A16), computed in the activation dtype.

    ``weight`` int8 ``[N, K]``; ``weight_scale`` ``[N]`` (``per_channel``) or one element
    (per-tensor), in float32 or the activation dtype; ``bias`` ``[N]`` in the activation dtype
    ``out_dtype`` (float16, bfloat16 or float32; an input in another dtype is cast to it).
    ``forward`` writes ``F.linear(x, W, bias)`` with ``W = w_q · s`` computed in float32 and rounded
    once to ``out_dtype`` (``dequantized_weight``): the form ``passes/w8a16_gemm.py`` fuses into
    ``quantfuse::w8a16_gemm``, which applies the scale to the float32 sums instead of the weight
    (docs/DESIGN.md, "The ops"), so the fused result differs from the form by the form's rounding
    of each weight element.  In eager CUDA inference ``forward`` calls that op itself
    (``calls_op_eagerly``).

    Dtype conversions (``.to(dtype)``, ``.half()``, ``.bfloat16()``, ``.float()``) change the
    activation dtype: ``out_dtype`` and ``bias`` follow it, the int8 ``weight`` keeps its dtype, a
    float32 ``weight_scale`` stays float32, and a scale held in the former activation dtype
    becomes float32 (exactly; never rounded to the new dtype).  A dtype the op does not take
    (``.double()``) leaves the layer computing the form in it, unfused.  Device moves move
    everything.
    """

    out_dtype = _dtype_attribute("out_dtype", "the activation, output and bias dtype")

    def __init__(self, in_features: int, out_features: int, *, bias: bool = True, per_channel: bool = True,
                 dtype: torch.dtype = torch.bfloat16, scale_dtype: torch.dtype = torch.float32):
        super().__init__()
        for name, value in (("in_features", in_features), ("out_features", out_features)):
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"W8A16Linear: {name} {value!r}; expected a positive integer")
        if dtype not in W8A16_ACT_DTYPES:
            raise ValueError(f"W8A16Linear: dtype {dtype}; expected torch.float16, torch.bfloat16 or torch.float32")
        if scale_dtype not in (torch.float32, dtype):
            raise ValueError(f"W8A16Linear: scale_dtype {scale_dtype}; expected torch.float32 or the activation "
                             f"dtype {dtype}")
        self.in_features, self.out_features, self.per_channel = in_features, out_features, bool(per_channel)
        self.out_dtype = dtype
        for name, t in (("weight", torch.zeros(out_features, in_features, dtype=torch.int8)),
                        ("weight_scale", torch.ones(out_features if per_channel else (), dtype=scale_dtype)),
                        ("bias", torch.zeros(out_features, dtype=dtype) if bias else None)):
            self.register_parameter(name, _frozen(t))

    @classmethod
    def from_linear(cls, linear: nn.Linear, per_channel: bool = True, dtype: torch.dtype | None = None):
        """Symmetric round-to-nearest int8 of ``linear``'s weight (``quantize_weight_int8``: float32
        scales, per output channel or per tensor); ``dtype``: the activation dtype (default: the
        linear's)."""
        dtype = dtype or linear.weight.dtype
        mod = cls(linear.in_features, linear.out_features, bias=linear.bias is not None, per_channel=per_channel,
                  dtype=dtype)
        q, s = quantize_weight_int8(linear.weight, per_channel=per_channel)
        mod.weight.copy_(q)
        mod.weight_scale.copy_(s)
        if linear.bias is not None:
            mod.bias.copy_(linear.bias.detach().to(dtype))
        return mod.to(linear.weight.device)

    @classmethod
    def from_state_dict(cls, state: dict, prefix: str = "", dtype: torch.dtype | None = None):
        """Build from a state dict of ``weight`` (int8 ``[N, K]``), ``weight_scale`` (N elements, ``[N]`` or
        ``[N, 1]``, or one element; float32, float16 or bfloat16) and an optional ``bias`` ``[N]``.

        ``dtype``: the activation dtype; default the bias's, else a float16 / bfloat16 scale's, else
        bfloat16.  A scale in neither float32 nor ``dtype`` is held in float32 (exact); the bias is
        converted to ``dtype``.  Malformed entries raise ``ValueError`` naming the key, a missing one
        ``KeyError``.  The module is built on the weight's device.
        """
        keys = {k: prefix + k for k in ("weight", "weight_scale", "bias")}
        try:
            weight, scale = state[keys["weight"]], state[keys["weight_scale"]]
        except KeyError as exc:
            raise KeyError(f"W8A16Linear.from_state_dict: missing {exc.args[0]!r} in the state dict") from None

        def bad(key, t, expected):
            raise ValueError(f"W8A16Linear.from_state_dict: {keys[key]!r} has shape {tuple(t.shape)}, dtype {t.dtype}; "
                             f"expected {expected}")

        if weight.dim() != 2 or weight.dtype != torch.int8 or 0 in weight.shape:
            bad("weight", weight, "a non-empty 2-D int8 tensor [N, K]")
        N, K = weight.shape
        per_channel = tuple(scale.shape) in ((N,), (N, 1))
        if scale.dtype not in (torch.float32, torch.float16, torch.bfloat16) or not (per_channel or scale.numel() == 1):
            bad("weight_scale", scale, f"a float32, float16 or bfloat16 tensor of N = {N} elements ([N] or [N, 1]) "
                                       "or of one element")
        bias = state.get(keys["bias"])
        if bias is not None and (bias.dim() != 1 or bias.shape[0] != N or not bias.is_floating_point()):
            bad("bias", bias, f"a 1-D floating-point tensor of N = {N} elements")
        if dtype is None:
            dtype = (bias.dtype if bias is not None else
                     scale.dtype if scale.dtype in (torch.float16, torch.bfloat16) else torch.bfloat16)
        scale_dtype = scale.dtype if scale.dtype in (torch.float32, dtype) else torch.float32
        with torch.device(weight.device):
            mod = cls(K, N, bias=bias is not None, per_channel=per_channel, dtype=dtype, scale_dtype=scale_dtype)
        tensors = dict(weight=weight, weight_scale=scale.reshape(mod.weight_scale.shape).to(scale_dtype))
        if bias is not None:
            tensors["bias"] = bias.to(dtype)
        mod.load_state_dict(tensors)
        return mod

    def dequantized_weight(self) -> torch.Tensor:
        """``[N, K]`` weight in ``out_dtype``: ``w_q · s`` in float32, rounded once."""
        # A half scale is widened by type promotion, not by a cast of its own: the compiled graph's op
        # then reads the held scale itself (one the horizontal pass can concatenate), not a float32
        # copy made on every call.
        return (self.weight.to(torch.float32) * self.weight_scale.reshape(-1, 1)).to(getattr(torch, self._out_dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = getattr(torch, self._out_dtype)  # not the property: see _dtype_attribute
        if x.dtype != dtype:
            x = x.to(dtype)
        if (not torch.compiler.is_compiling() and calls_op_eagerly(x) and dtype in W8A16_ACT_DTYPES
                and self.weight_scale.dtype in (torch.float32, dtype)
                and (self.bias is None or self.bias.dtype == dtype)):
            return self.forward_op(x.reshape(-1, self.in_features)).reshape(*x.shape[:-1], self.out_features)
        return F.linear(x, self.dequantized_weight(), self.bias)

    def forward_op(self, x2: torch.Tensor) -> torch.Tensor:
        """``forward`` of ``[M, K]`` activations in ``out_dtype`` through ``quantfuse::w8a16_gemm`` (the
        scale flattened, the bias folded in), as the pass fuses the form."""
        return torch.ops.quantfuse.w8a16_gemm(x2, self.weight, self.weight_scale.reshape(-1), self.bias)

    def _apply(self, fn, recurse=True):
        target = _target(fn, torch.empty(0, dtype=self.out_dtype, device=self.weight.device)).dtype
        floating = target.is_floating_point
        _apply_keeping_dtypes(self, fn, recurse, ("weight", "weight_scale") if floating else
                              ("weight", "weight_scale", "bias"))
        if floating:
            scale = self.weight_scale
            if scale is not None and scale.dtype not in (torch.float32, target):
                self.weight_scale = scale.to(torch.float32)  # exact; rounding it to target would not be
            self.out_dtype = target
        return self

    def extra_repr(self) -> str:
        scale = "" if self.weight_scale.dtype == torch.float32 else f", scale_dtype={self.weight_scale.dtype}"
        return (f"{self.in_features}, {self.out_features}, per_channel={self.per_channel}, "
                f"dtype={self.out_dtype}{scale}, bias={self.bias is not None}")
