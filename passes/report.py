"""What the passes fused, and which quantized-looking matmuls they left alone and why.

Passes call ``record_fused`` / ``record_unfused`` while they run; whoever wants
the result (``compile_backend.explain``, tests) opens ``collecting_report()``
around a compile.  Outside such a block the records only go to the
``quantfuse`` logger.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections import Counter
from dataclasses import dataclass, field

log = logging.getLogger("quantfuse")


@dataclass(frozen=True)
class Fused:
    family: str  # the op's name: scaled_mm, scaled_mm_azp, awq_gemm, w8a16_gemm
    form: str  # which source form matched, e.g. "int_mm", "linear", "awq_unpack"
    detail: str = ""


@dataclass(frozen=True)
class Unfused:
    node: str  # the matmul node left in the graph
    target: str
    reason: str


@dataclass(frozen=True)
class Merged:
    """Fused ops of one family that read the same activation, made one op (``horizontal``)."""

    family: str
    members: tuple[str, ...]  # the op nodes merged (or, when not merged, those concerned)
    detail: str  # merged: the members' N; not merged: the reason


@dataclass
class FusionReport:
    fused: list[Fused] = field(default_factory=list)
    unfused: list[Unfused] = field(default_factory=list)
    merged: list[Merged] = field(default_factory=list)
    not_merged: list[Merged] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    def counts(self) -> Counter:
        return Counter(f.family for f in self.fused)

    def __str__(self) -> str:
        lines = [f"quantfuse: fused {len(self.fused)} subgraph(s), left {len(self.unfused)} candidate(s)"]
        lines += [f"  fused    {f.family:<14} from {f.form}{' ' + f.detail if f.detail else ''}" for f in self.fused]
        lines += [f"  unfused  {u.node} ({u.target}): {u.reason}" for u in self.unfused]
        if self.merged or self.not_merged:
            lines[0] += f"; merged {len(self.merged)} group(s) of ops sharing an input"
        lines += [f"  merged   {m.family:<14} {len(m.members)} ops ({', '.join(m.members)}) into one, {m.detail}"
                  for m in self.merged]
        lines += [f"  not merged {m.family} {', '.join(m.members)}: {m.detail}" for m in self.not_merged]
        lines += [f"  note     {n}" for n in self.notes]
        return "\n".join(lines)


_local = threading.local()


def _active() -> list:
    if not hasattr(_local, "stack"):
        _local.stack = []
    return _local.stack


@contextlib.contextmanager
def collecting_report():
    report = FusionReport()
    _active().append(report)
    try:
        yield report
    finally:
        _active().pop()


def record_fused(family: str, form: str, detail: str = "") -> None:
    log.info("quantfuse: fused %s (%s) %s", family, form, detail)
    for report in _active():
        report.fused.append(Fused(family, form, detail))


def record_unfused(node: str, target: str, reason: str) -> None:
    log.info("quantfuse: not fused %s (%s): %s", node, target, reason)
    for report in _active():
        report.unfused.append(Unfused(node, target, reason))


def record_merged(family: str, members: tuple[str, ...], detail: str) -> None:
    log.info("quantfuse: merged %d %s ops sharing an input (%s), %s", len(members), family, ", ".join(members), detail)
    for report in _active():
        report.merged.append(Merged(family, members, detail))


def record_not_merged(family: str, members: tuple[str, ...], reason: str) -> None:
    log.info("quantfuse: not merged %s ops sharing an input (%s): %s", family, ", ".join(members), reason)
    for report in _active():
        report.not_merged.append(Merged(family, members, reason))


# --------------------------------------------------------------------------- per-node reasons
#
# A pattern that matched a subgraph's structure but failed a check remembers why
# on the matmul node it would have replaced; ``candidates.report_unfused`` reads
# it back when that matmul is still in the graph after the passes ran.

REASON_KEY = "quantfuse_unfused_reason"


def note_reason(node, reason: str) -> None:
    """Remember on ``node`` (an FX node) why a pattern rooted at it did not fuse."""
    reasons = node.meta.setdefault(REASON_KEY, [])
    if reason not in reasons:
        reasons.append(reason)


def noted_reasons(node) -> list[str]:
    return list(node.meta.get(REASON_KEY, ()))
