"""`Verdict`, the bottleneck and its evidence: a part of every RunSummary and of every trace analysis.

In a module of its own so that `stepscope trace`, which never reads a summary, does not import stepscope.summary
(~8 ms of the ~0.2 s a small trace takes).
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Verdict:
    """The bottleneck and the figures it rests on."""

    bound: str = "unknown"
    confidence: str = "low"  # "high" | "medium" | "low"
    evidence: list[str] = field(default_factory=list)
