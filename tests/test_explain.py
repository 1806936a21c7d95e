"""``compile_backend.explain``: fused subgraphs and unfused quantized-looking matmuls, with reasons."""

from __future__ import annotations

import logging

import pytest
import torch
import torch.nn.functional as F

import compile_backend
from compile_backend.quantize import W8A8Linear

pytestmark = pytest.mark.compile

K, N = 32, 24


class Mixed(torch.nn.Module):
    """One fusable W8A8 layer, one near-miss (per-group activation scales), one float layer."""

    def __init__(self):
        super().__init__()
        gen = torch.Generator().manual_seed(0)
        self.fused = W8A8Linear.from_linear(torch.nn.Linear(K, N), out_dtype=torch.float32)
        self.register_buffer("w", torch.randint(-128, 128, (N, N), dtype=torch.int8, generator=gen))
        self.register_buffer("w_scale", torch.rand(N, 1, generator=gen) * 1e-2)
        self.dense = torch.nn.Linear(N, N)

    def forward(self, x):
        h = self.fused(x)
        # Per-group activation quantization (groups of 8 along K): not expressible as scale_a.
        g = h.reshape(-1, N // 8, 8)
        s = g.abs().amax(-1, keepdim=True) / 127
        q = (g / s).round().clamp(-128, 127).to(torch.int8)
        h2 = F.linear((q.float() * s).reshape(-1, N), self.w.float() * self.w_scale)
        return self.dense(torch.relu(h2))


def test_explain_lists_fused_and_unfused_with_reasons(caplog):
    model = Mixed().eval()
    x = torch.randn(5, K, generator=torch.Generator().manual_seed(1))
    with caplog.at_level(logging.INFO, logger="quantfuse"):
        report = compile_backend.explain(model, x)
    assert report.counts() == {"scaled_mm": 1}
    (fused,) = report.fused
    assert fused.form == "dequant-addmm" and "per-token x per-channel" in fused.detail
    # The near-miss is reported with the failed check; the float layer is not a candidate.
    (unfused,) = report.unfused
    assert unfused.target in ("mm.default", "addmm.default"), unfused
    # Groups of 8 along K look per-token on the [5, 3, 8] view; the reshape back to [5, 24]
    # (which merges the groups into one row) is what the checks reject.
    assert "does not match activation of shape [5, 3, 8]" in unfused.reason, unfused.reason
    text = str(report)
    assert "fused    scaled_mm" in text and "unfused" in text and "does not match activation" in text
    # The report also goes to the quantfuse logger.
    assert any("fused 1 subgraph(s), left 1 candidate(s)" in r.getMessage() for r in caplog.records)
