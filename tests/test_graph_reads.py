"""``GraphReads`` (csrc/common/graph_reads.h): what a CUDA graph captured under the backend read
from the derived-value cache, checked before every call of the graph.

The record is plain C++ with no CUDA, so it is built here into a small CPU extension and driven
from Python: a source written in place (through itself, a view, or its
``.data``) or freed since it was recorded is reported, by the same TensorImpl; unchanged sources
are not; a (source, version) pair is kept once.  On a GPU,
``tests/test_cuda_dispatch.py::test_reduce_overhead_refuses_changed_weights`` runs the same class
through ``_derived_graph_enter``.
"""

from __future__ import annotations

import gc
import os
import sys

import pytest
import torch

from compile_backend.derived.held_parameter import HeldParameter

CSRC = os.path.join(os.path.dirname(__file__), os.pardir, "csrc")

SOURCE = r"""
#include <torch/extension.h>

#include "common/graph_reads.h"

struct Reads {
  quantfuse::GraphReads reads;
  void record(const at::Tensor& t) {
    reads.record(c10::weak_intrusive_ptr<c10::TensorImpl>(t.getIntrusivePtr()),
                 t.unsafeGetTensorImpl()->version_counter(), static_cast<uint32_t>(t._version()));
  }
  int64_t stale() const {
    const auto* source = reads.first_stale();
    return source ? reinterpret_cast<int64_t>(source->_unsafe_get_target()) : 0;
  }
  int64_t size() const { return static_cast<int64_t>(reads.size()); }
};

int64_t impl_of(const at::Tensor& t) { return reinterpret_cast<int64_t>(t.unsafeGetTensorImpl()); }

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  pybind11::class_<Reads>(m, "Reads")
      .def(pybind11::init<>())
      .def("record", &Reads::record)
      .def("stale", &Reads::stale)
      .def("size", &Reads::size);
  m.def("impl_of", &impl_of);
}
"""


@pytest.fixture(scope="module")
def ext(tmp_path_factory):
    from torch.utils import cpp_extension

    # torch runs `ninja` from PATH; the dev extra installs it beside this interpreter.
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("PATH", os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", ""))
        return cpp_extension.load_inline(
            name="quantfuse_graph_reads_test", cpp_sources=SOURCE, extra_include_paths=[os.path.abspath(CSRC)],
            build_directory=str(tmp_path_factory.mktemp("graph_reads")), verbose=False)


def test_unchanged_sources_pass_and_pairs_are_kept_once(ext):
    a, b = torch.zeros(4, dtype=torch.int32), torch.ones(8, dtype=torch.int8)
    reads = ext.Reads()
    for t in (a, b, a, b[:4].view(torch.int32)):  # the view is its own TensorImpl
        reads.record(t)
    assert reads.size() == 3
    assert reads.stale() == 0
    a.clone().add_(1)  # a copy's write is not a write of the source
    assert reads.stale() == 0


@pytest.mark.parametrize("how", ["in place", "through a view", "copy_"])
def test_written_source_is_reported(ext, how):
    a, b = torch.zeros(4, dtype=torch.int32), torch.zeros(6, dtype=torch.int8)
    reads = ext.Reads()
    reads.record(a)
    reads.record(b)
    if how == "in place":
        b.add_(1)
    elif how == "through a view":
        b[2:4].fill_(7)  # a view shares its base's version counter
    else:
        b.copy_(torch.full_like(b, 3))
    assert reads.stale() == ext.impl_of(b)


def test_freed_source_is_reported(ext):
    a, b = torch.zeros(4, dtype=torch.int32), torch.zeros(4, dtype=torch.int32)
    reads = ext.Reads()
    reads.record(a)
    reads.record(b)
    gone = ext.impl_of(b)
    del b
    gc.collect()
    assert reads.stale() == gone


def test_a_source_read_at_two_versions_is_stale(ext):
    """Two captures of one graph that read a source at different versions: the graph holds values
    of the older one, so the pair recorded first no longer matches."""
    a = torch.zeros(4, dtype=torch.int32)
    reads = ext.Reads()
    reads.record(a)
    a.add_(1)
    reads.record(a)
    assert reads.size() == 2
    assert reads.stale() == ext.impl_of(a)


def test_write_through_data_is_reported(ext):
    """A loader's ``layer.weight.data.copy_(new)`` bumps the weight's own counter, on the quantized
    modules' parameters (derived/held_parameter.py) and on any plain tensor that does not require grad
    (derived/tensor_data.py): both are reported, each on its own."""
    held = HeldParameter(torch.zeros(4, dtype=torch.int8), requires_grad=False)
    plain = torch.nn.Parameter(torch.zeros(4, dtype=torch.int8), requires_grad=False)
    reads = ext.Reads()
    reads.record(held)
    reads.record(plain)
    assert reads.stale() == 0
    plain.data.copy_(torch.ones(4, dtype=torch.int8))
    assert reads.stale() == ext.impl_of(plain)
    reads = ext.Reads()
    reads.record(held)
    held.data.copy_(torch.ones(4, dtype=torch.int8))
    assert reads.stale() == ext.impl_of(held)
