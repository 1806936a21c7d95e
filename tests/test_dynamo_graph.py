"""``passes/dynamo_graph.act_order_scatters``: the act-order scatter that ``rms_norm_ordered`` and
``gqa_decode`` move into their ops, recognised on hand-made graphs of Dynamo's form."""

from __future__ import annotations

import pytest
import torch
from torch.fx import Graph

from compile_backend.passes.dynamo_graph import act_order_scatters

K = 8


def _graph(order_op="placeholder", order=None, dim=-1, scatters=1, second_order=False, extra_reader=False,
           empty_kwargs=None):
    """x -> ``torch.empty_like(x).index_copy_(dim, order, x)`` ``scatters`` times; the near misses by
    argument."""
    g = Graph()
    x = g.placeholder("x")
    x.meta["example_value"] = torch.randn(2, 1, K)
    order_value = torch.randperm(K) if order is None else order

    def order_node(name):
        node = g.placeholder(name) if order_op == "placeholder" else g.get_attr(name)
        node.meta["example_value"] = order_value
        return node

    orders = [order_node("order")]
    if second_order:
        orders.append(order_node("other_order"))
    outs = []
    for i in range(scatters):
        empty = g.call_function(torch.empty_like, (x,), empty_kwargs or {})
        outs.append(g.call_method("index_copy_", (empty, dim, orders[min(i, len(orders) - 1)], x)))
    if extra_reader:
        outs.append(g.call_function(torch.neg, (x,)))
    g.output(tuple(outs))
    return x, orders[0], outs


@pytest.mark.parametrize("order_op", ["placeholder", "get_attr"])
@pytest.mark.parametrize("scatters", [1, 2])
def test_recognises_the_scatters(order_op, scatters):
    x, order, outs = _graph(order_op=order_op, scatters=scatters)
    found = act_order_scatters(x)
    assert found is not None
    got_order, pairs = found
    assert got_order is order
    assert [scatter for _, scatter in pairs] == outs
    assert all(empty.target is torch.empty_like and empty.args == (x,) for empty, _ in pairs)


@pytest.mark.parametrize("change", [
    dict(dim=0),                                   # another dimension
    dict(dim=2),                                   # the last one, by index: accepted below
    dict(scatters=2, second_order=True),           # two orders
    dict(extra_reader=True),                       # x read by something else
    dict(empty_kwargs={"dtype": torch.float32}),   # not an empty of x's kind
    dict(order=torch.randperm(K).to(torch.int16)),  # not an index dtype
    dict(order=torch.randperm(K + 1)),             # not x's last dimension's length
    dict(order=torch.randperm(K).view(2, 4)),      # not 1-D
])
def test_near_misses(change):
    x, _, _ = _graph(**change)
    found = act_order_scatters(x)
    assert (found is not None) == (change == dict(dim=2))


def test_an_order_computed_in_the_graph_is_not_one():
    g = Graph()
    x = g.placeholder("x")
    x.meta["example_value"] = torch.randn(2, K)
    base = g.placeholder("base")
    base.meta["example_value"] = torch.randperm(K)
    order = g.call_function(torch.flip, (base, (0,)))
    order.meta["example_value"] = torch.randperm(K)
    empty = g.call_function(torch.empty_like, (x,))
    g.output(g.call_method("index_copy_", (empty, -1, order, x)))
    assert act_order_scatters(x) is None
