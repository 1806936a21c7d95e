"""``benchmarks/bench_e2e.py``'s own arithmetic and config names, on CPU: the GPU time of a step where
kernels overlap (programmatic dependent launch), and the variants that set environment variables."""

from __future__ import annotations

import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
from torch.autograd import DeviceType

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import bench_e2e  # noqa: E402


def _event(start: float, end: float, device=DeviceType.CUDA):
    return SimpleNamespace(device_type=device, time_range=SimpleNamespace(start=start, end=end))


def test_busy_time_counts_overlapping_kernels_once():
    events = [_event(0, 10), _event(5, 12), _event(14, 20), _event(15, 16), _event(100, 110),
              _event(0, 500, DeviceType.CPU)]
    busy, idle = bench_e2e.kernel_busy_and_gaps_us(events)
    assert busy == 12 + 6 + 10  # [0, 12), [14, 20), [100, 110)
    assert idle == 2  # 12 -> 14; 20 -> 100 is over GAP_LIMIT_US: a host wait, not a launch gap


def test_busy_time_of_kernels_in_sequence_is_their_sum():
    events = [_event(0, 4), _event(5, 9), _event(9, 10)]
    assert bench_e2e.kernel_busy_and_gaps_us(events) == (9, 1)
    assert bench_e2e.kernel_busy_and_gaps_us([]) == (0, 0)


@pytest.mark.parametrize("name, env", [
    ("awq-g128", {}),
    ("awq-g128+no-pdl", {"QUANTFUSE_PDL": "0"}),
    ("awq-g128+pdl-regs", {"QUANTFUSE_PDL_PREFETCH": "regs"}),
    ("int8+pdl-l2+no-pdl", {"QUANTFUSE_PDL_PREFETCH": "l2", "QUANTFUSE_PDL": "0"}),
    ("fp16+no-pdl", {"QUANTFUSE_PDL": "0"}),
])
def test_environment_variants(name, env):
    assert bench_e2e.parse_config(name, SimpleNamespace(qdtype="float16"))["env"] == env


def test_unknown_variant_names_the_known_ones():
    with pytest.raises(ValueError, match="'no-pdl', 'pdl-regs', 'pdl-l2'"):
        bench_e2e.parse_config("awq-g128+pdl-fast", SimpleNamespace(qdtype="float16"))
