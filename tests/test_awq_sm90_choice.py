"""The AWQ SM90 prefill kernel's choice of tile configuration and token padding
(csrc/awq_gemm/awq_gemm_sm90_choice.h), compiled with the host C++ compiler and run on the
CPU: the same code the CUDA op runs before every launch (tests/test_cuda_awq_gemm_sm90.py
checks the op on a GPU)."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

CSRC = Path(__file__).resolve().parents[1] / "csrc"
PROGRAM = r"""
#include <cstdio>
#include "awq_gemm/awq_gemm_sm90_choice.h"
namespace qa = quantfuse::awq_sm90;
int main() {
  long long M, N, K;
  int g;
  while (std::scanf("%lld %lld %lld %d", &M, &N, &K, &g) == 4) {
    const int c = qa::choose_config(M, N, K, g, 132);
    const long long padded = qa::padded_tokens(M, N, K, c, 132);
    std::printf("%d %d %d %lld\n", c, qa::kCosts[c].rows, qa::kCosts[c].tokens, padded);
  }
}
"""


@pytest.fixture(scope="module")
def choose(tmp_path_factory):
    compiler = shutil.which("c++") or shutil.which("g++") or shutil.which("clang++")
    assert compiler, "a host C++ compiler (c++, g++ or clang++) is needed to build the choice check"
    out = tmp_path_factory.mktemp("choice") / "choice"
    subprocess.run([compiler, "-std=c++17", "-O1", f"-I{CSRC}", "-x", "c++", "-", "-o", str(out)],
                   input=PROGRAM, text=True, check=True)

    def run(queries):
        """[(M, N, K, group_size)] -> [(config, rows, tokens, padded M)]"""
        text = "".join(f"{m} {n} {k} {g}\n" for m, n, k, g in queries)
        lines = subprocess.run([str(out)], input=text, text=True, capture_output=True, check=True).stdout.split("\n")
        return [tuple(int(v) for v in line.split()) for line in lines if line]

    return run


def test_token_tiles_sized_to_m(choose):
    """4096 x 4096: one wave of 128 tiles at M = 320..768, each tile full (no padding)."""
    got = choose([(m, 4096, 4096, 128) for m in (320, 384, 448, 640, 768)])
    assert [c for c, *_ in got] == [5, 6, 7, 8, 9]
    assert [(rows, tokens) for _, rows, tokens, _ in got] == [(64, 160), (64, 192), (64, 224), (128, 160), (128, 192)]
    assert [p for *_, p in got] == [320, 384, 448, 640, 768]


def test_small_m_token_tiles(choose):
    """At most 64 tokens: one 64-token tile covers M (config 13), unpadded from 36 tokens; up
    to 128 tokens one 128-token tile (a wider tile would only add padding, a narrower one read
    each weight tile twice).  Long K with few tiles takes stream-K (config 4)."""
    got = choose([(m, n, 4096, 128) for m in (33, 36, 48, 64) for n in (4096, 6144, 28672)])
    assert all((c, tokens) == (13, 64) for c, _, tokens, _ in got)
    assert [p for *_, p in got] == [64] * 3 + [36] * 3 + [48] * 3 + [64] * 3
    got = choose([(m, n, 4096, 128) for m in (65, 100, 128) for n in (4096, 6144, 28672)])
    assert all(tokens == 128 for _, _, tokens, _ in got)
    # 4096 x 14336: 32 weight tiles with a long K loop; stream-K spreads it over the SMs
    assert [c for c, *_ in choose([(m, 4096, 14336, 128) for m in (33, 48, 64, 100)])] == [4] * 4
    assert [c for c, *_ in choose([(128, 4096, 4096, 128), (128, 4096, 14336, 128)])] == [1, 4]


def test_group_size_limits_128_deep_tiles(choose):
    """Configs 1, 5-7 and 13 load 128-deep K tiles: only for group sizes that are multiples of
    128 (or per-channel) and K % 128 == 0."""
    k128 = {1, 5, 6, 7, 13}
    queries = [(m, n, k, g) for m in (48, 64, 200, 320, 384, 700, 1152, 3000) for n, k in ((4096, 4096), (6144, 4096))
               for g in (64, 128, k)] + [(m, 4096, 4160, 64) for m in (200, 320, 1000)]
    for (m, n, k, g), (c, *_) in zip(queries, choose(queries)):
        allowed = k % 128 == 0 and (g == k or g % 128 == 0)
        assert allowed or c not in k128, (m, n, k, g, c)


def test_large_m(choose):
    """Above 1024 tokens where 128 x 256 tiles leave a wave part-empty (4096 x 14336 at
    M = 1152: 160 such tiles on 132 SMs), stream-K over 128 x 192 tiles (config 12) fills it;
    from 6144 tokens 128 x 256 tiles, data-parallel (3) or stream-K (11)."""
    assert choose([(1152, 4096, 14336, 128)])[0][0] == 12
    got = choose([(m, n, k, 128) for m in (6144, 8192, 16384)
                  for n, k in ((4096, 4096), (6144, 4096), (28672, 4096), (4096, 14336))])
    assert all(c in (3, 11) and (rows, tokens) == (128, 256) for c, rows, tokens, _ in got)
    assert [c for c, *_ in got[:2]] == [3, 3]


def test_stream_k_counts_fractional_waves(choose):
    """Stream-K configurations (4, 11, 12) are costed by fractional waves plus a fixed fixup,
    so they win where data-parallel tiles leave the last wave mostly empty and lose to the
    same tile data-parallel when the waves come out nearly whole. 128 x 256 tiles:
    4096 x 4096 at M = 4096 is 512 of them, 3.9 waves (config 3); 28672 x 4096 at M = 512 is
    448, 3.4 waves (config 11); 4096 x 14336 at M = 1280 is 160, 1.2 waves (config 11)."""
    got = choose([(4096, 4096, 4096, 128), (512, 28672, 4096, 128), (1280, 4096, 14336, 128)])
    assert [c for c, *_ in got] == [3, 11, 11]


def test_padding_rule(choose):
    """x is padded to whole token tiles when at least 45% of the last tile would be past M,
    on shapes whose calls are long enough for the copy to pay."""
    for m, n, k, g in ((300, 4096, 4096, 128), (1000, 6144, 4096, 128), (33, 28672, 4096, 128), (33, 4096, 4096, 128),
                       (129, 4096, 14336, 128), (65, 6144, 4096, 128)):
        c, rows, tokens, padded = choose([(m, n, k, g)])[0]
        whole = -(-m // tokens) * tokens
        assert padded == (whole if (whole - m) * 100 >= tokens * 45 else m), (m, n, k, c, padded)


def test_short_calls_are_not_padded(choose):
    """Where the cost model puts the whole call under kPadMinUs, copying x (an allocation and a
    copy, about 6 us of host time) costs more than the zero-filled tile: no padding."""
    queries = [(192, 256, 256, 128), (33, 1024, 1024, 128), (300, 640, 1024, 128), (65, 512, 512, 128)]
    for (m, *_), (c, _, tokens, padded) in zip(queries, choose(queries)):
        assert (-(-m // tokens) * tokens - m) * 100 >= tokens * 45, (m, c)  # the fraction alone would pad
        assert padded == m, (m, c, padded)
