"""Shared helpers for the pattern-pass tests: trace a function to the graph our
passes see, run the passes on it, print graphs readably, count ops.

No Inductor code generation happens here: the function is captured with
Dynamo + AOTAutograd using Inductor's decomposition table (the graph Inductor's
``joint_custom_pre_pass`` slot receives for an inference graph), our passes run
on that graph inside the same compile context (fake mode, shape environment),
and the transformed graph is then run eagerly (the quantfuse ops run their
reference implementations).  That keeps each case well under a second.

Stable API (other test modules import it):

* ``apply_passes(fn, *args, dynamic=False, families=None, stage="joint"|"post_grad"|"reshape",
  grad=False) -> PassResult``
* ``graph_str(gm) -> str``: one line per node, for ``assertExpectedInline``
* ``count_calls(gm, *targets) -> int``
* ``QUANTFUSE_OPS``: the quantfuse op overloads
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any

import torch
from torch._dynamo.backends.common import aot_autograd
from torch._inductor.decomposition import select_decomp_table

import compile_backend  # noqa: F401  (registers torch.ops.quantfuse.*)
from compile_backend.passes import FusionReport, collecting_report, make_graph_passes

QUANTFUSE_OPS = (
    torch.ops.quantfuse.scaled_mm.default,
    torch.ops.quantfuse.scaled_mm_azp.default,
    torch.ops.quantfuse.awq_gemm.default,
    torch.ops.quantfuse.awq_dequantize.default,
    torch.ops.quantfuse.w8a16_gemm.default,
)
MATMULS = (
    torch.ops.aten.mm.default,
    torch.ops.aten.addmm.default,
    torch.ops.aten.bmm.default,
    torch.ops.aten._int_mm.default,
)


@dataclass
class PassResult:
    before: torch.fx.GraphModule  # the graph as traced, before our passes
    after: torch.fx.GraphModule  # the same graph after our passes
    report: FusionReport  # what the passes recorded
    output: Any  # the transformed graph's output on the example inputs (eager run)
    expected: Any  # fn(*args) run eagerly, without compiling
    compiled: Any = None  # the compiled callable (runs the transformed graph; call under no_grad)
    forward: torch.fx.GraphModule | None = None  # grad=True: the forward graph the partitioner made

    def count(self, *targets) -> int:
        return count_calls(self.after, *targets)

    @property
    def fused(self) -> int:
        return count_calls(self.after, *QUANTFUSE_OPS)


def _run_slot(slot_pass, gm):
    slot_pass(gm.graph)
    gm.graph.lint()
    gm.recompile()


def apply_passes(fn, *args, dynamic: bool = False, families=None, stage: str = "joint",
                 skip_joint: bool = False, grad: bool = False) -> PassResult:
    """Trace ``fn(*args)`` as Inductor would (inference, no grad), run our passes, run the result.

    ``stage="joint"`` runs the passes Inductor's joint slot gets; ``"post_grad"``
    additionally rewrites ``aten.view`` into ``aten.reshape`` (as Inductor does
    before its post-grad passes) and then runs the post-grad slot's pass;
    ``"reshape"`` rewrites the views first and runs the joint slot's pass on
    that form (patterns must hold on it too).
    ``families`` restricts the pattern families (default: all).  ``skip_joint``
    (with ``stage="post_grad"``) leaves the joint slot out, as when Inductor's
    joint passes do not run on a graph.

    ``grad=True`` traces under grad mode, as Inductor does when an input requires
    grad: AOTAutograd makes one joint forward + backward graph, the joint slot's
    pass runs on it (``before``/``after`` are the joint graph) and the
    partitioner splits it (``forward``: the forward graph); ``output`` and
    ``expected`` are computed with autograd recording, so a test can call
    ``backward`` on them.
    """
    if stage not in ("joint", "post_grad", "reshape"):
        raise ValueError(f"apply_passes: stage {stage!r}; expected 'joint', 'post_grad' or 'reshape'")
    options = {} if families is None else {"families": tuple(families)}
    passes = make_graph_passes(options)
    captured: dict[str, torch.fx.GraphModule] = {}

    def fw_compiler(gm, example_inputs):
        from torch._inductor.fx_passes.post_grad import view_to_reshape

        if stage == "reshape":
            view_to_reshape(gm)
        # Lifted tensor constants are real tensors: copy them outside the fake mode.
        with torch._subclasses.fake_tensor.unset_fake_temporarily():
            captured["before"] = copy.deepcopy(gm)
        if "joint_custom_pre_pass" in passes and not skip_joint:
            _run_slot(passes["joint_custom_pre_pass"], gm)
        if stage == "post_grad":
            view_to_reshape(gm)
            if "post_grad_custom_pre_pass" in passes:
                _run_slot(passes["post_grad_custom_pre_pass"], gm)
        captured["after"] = gm
        return gm.forward

    if grad:
        return _apply_passes_joint(fn, args, passes, dynamic)
    backend = aot_autograd(fw_compiler=fw_compiler, decompositions=select_decomp_table())
    torch._dynamo.reset()
    with torch.no_grad():
        expected = fn(*args)
        compiled = torch.compile(fn, backend=backend, dynamic=dynamic, fullgraph=True)
        with collecting_report() as report:
            output = compiled(*args)
    return PassResult(captured["before"], captured["after"], report, output, expected, compiled)


def _apply_passes_joint(fn, args, passes, dynamic) -> PassResult:
    from torch._functorch.partitioners import min_cut_rematerialization_partition

    captured: dict[str, torch.fx.GraphModule] = {}

    def partition_fn(joint, joint_inputs, **kwargs):
        with torch._subclasses.fake_tensor.unset_fake_temporarily():
            captured["before"] = copy.deepcopy(joint)
        _run_slot(passes["joint_custom_pre_pass"], joint)
        captured["after"] = joint
        return min_cut_rematerialization_partition(joint, joint_inputs, **kwargs)

    def fw_compiler(gm, example_inputs):
        captured["forward"] = gm
        return gm.forward

    def bw_compiler(gm, example_inputs):
        return gm.forward

    backend = aot_autograd(fw_compiler=fw_compiler, bw_compiler=bw_compiler, partition_fn=partition_fn,
                           decompositions=select_decomp_table())
    torch._dynamo.reset()
    expected = fn(*args)
    compiled = torch.compile(fn, backend=backend, dynamic=dynamic, fullgraph=True)
    with collecting_report() as report:
        output = compiled(*args)
    if "before" not in captured:
        raise AssertionError("apply_passes(grad=True): no input requires grad, so no joint graph was traced")
    return PassResult(captured["before"], captured["after"], report, output, expected, compiled,
                      captured["forward"])


def _short(target) -> str:
    if isinstance(target, torch._ops.OpOverload):
        ns, name = target.namespace, target._schema.name.split("::")[-1]
        overload = target._overloadname
        return f"{ns}.{name}" + ("" if overload == "default" else f".{overload}")
    return getattr(target, "__name__", str(target))


def _fmt(arg) -> str:
    if isinstance(arg, torch.fx.Node):
        return arg.name
    if isinstance(arg, (list, tuple)):
        inner = ", ".join(_fmt(a) for a in arg)
        return f"[{inner}]"
    if isinstance(arg, torch.dtype):
        return str(arg).replace("torch.", "")
    return repr(arg)


def _meta(node) -> str:
    val = node.meta.get("val")
    if isinstance(val, torch.Tensor):
        dtype = str(val.dtype).replace("torch.", "")
        return f"{dtype}[{', '.join(str(s) for s in val.shape)}]"
    if isinstance(val, torch.SymInt):
        return "Sym"
    return ""


def graph_str(gm) -> str:
    """One line per node: ``name: dtype[shape] = ns.op(args)``; placeholders listed first."""
    graph = gm.graph if isinstance(gm, torch.fx.GraphModule) else gm
    lines = []
    for node in graph.nodes:
        meta = _meta(node)
        head = f"{node.name}: {meta}" if meta else node.name
        if node.op == "placeholder":
            lines.append(f"input {head}")
        elif node.op == "output":
            lines.append(f"return {_fmt(node.args[0])}")
        elif node.op == "get_attr":
            lines.append(f"{head} = get_attr {node.target}")
        else:
            args = [_fmt(a) for a in node.args] + [f"{k}={_fmt(v)}" for k, v in node.kwargs.items()]
            lines.append(f"{head} = {_short(node.target)}({', '.join(args)})")
    return "\n".join(lines)


def count_calls(gm, *targets) -> int:
    graph = gm.graph if isinstance(gm, torch.fx.GraphModule) else gm
    return sum(1 for n in graph.nodes if n.op == "call_function" and n.target in targets)


def compile_and_run(fn, *args):
    """``fn`` compiled by the backend and called once under no_grad: (the report of what was
    fused, the compiled result, eager's result)."""
    torch._dynamo.reset()
    compiled = torch.compile(fn, backend="quantfuse", options={"fx_graph_cache": False})
    with torch.no_grad(), collecting_report() as report:
        out = compiled(*args)
        expected = fn(*args)
    torch._dynamo.reset()
    return report, out, expected


def dynamo_graph(fn, *args, fullgraph: bool = False):
    """The one FX graph Dynamo captures from ``fn(*args)`` (under ``no_grad``), before any backend pass."""
    graphs = []

    def capture(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    torch._dynamo.reset()
    with torch.no_grad():
        torch.compile(fn, backend=capture, fullgraph=fullgraph)(*args)
    (gm,) = graphs
    return gm
