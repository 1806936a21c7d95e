"""quantfuse's FX pattern passes (installed as ``compile_backend.passes``).

Each pattern family lives in its own module, named like its op
(``scaled_mm``, ``scaled_mm_azp``, ``awq_gemm``, ``w8a16_gemm``), and exposes
``register(passes: dict[str, PatternMatcherPass]) -> None`` that adds its
search/replace pairs to the pass of each Inductor slot it uses.
``make_graph_passes(options)`` returns the Inductor custom-pass slots to fill
and the pass for each; the backend installs them per compile through
``config_patches``.  ``report`` collects what was fused and what was not.
"""

from __future__ import annotations

from .framework import FAMILIES, QuantfuseGraphPass, make_graph_passes
from .report import FusionReport, collecting_report

__all__ = ["FAMILIES", "FusionReport", "QuantfuseGraphPass", "collecting_report", "make_graph_passes"]
