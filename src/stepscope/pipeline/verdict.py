"""Which side of an inference→training pipeline starves the other, in words with the figures.

The capacities decide: inference capacity I (what the engines could produce with training infinitely fast) against
training capacity T (what the trainer could consume with inference infinitely fast). Within ``tolerance`` of each
other the pipeline is ``balanced``; T > I is ``inference``-bound, I > T ``training``-bound. The trainer's dispatch
wait and the pool's trend are the independent evidence: an inference-bound pipeline makes the trainer wait with
the pool near empty; a training-bound one fills the pool while the trainer never waits. Confidence is high when
they agree with the capacities, medium when they do not, low on few events.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from stepscope.pipeline.monitor import PipelineSnapshot

MIN_EVENTS = 3  # engine calls and training steps in the window below which the verdict has low confidence
WAITING = 0.05  # the trainer "waits" from 5% of its time spent waiting for samples
# The pool "fills" (or "drains") when it changes by more than 10% of the inflow: a batch or two more at the window's
# edge is not a trend.
POOL_TREND = 0.10
IDLE_SLOTS = 0.8  # engines busy less than 80% of slot time: the slots are not kept fed


@dataclass
class PipelineVerdict:
    bottleneck: str = "unknown"  # "inference" | "training" | "balanced" | "unknown"
    confidence: str = "low"
    training_side: str | None = None  # "data" | "compute": what dominates a training step (from a linked Scope)
    evidence: list[str] = field(default_factory=list)


def training_side(data_s: float, compute_s: float) -> tuple[str | None, str | None]:
    """Whether data fetch and transfer or compute dominate the training steps (a linked Scope's phase times, s),
    and the sentence saying so; (None, None) without them."""
    total = data_s + compute_s
    if total <= 0:
        return None, None
    if data_s > compute_s:
        return "data", (
            f"within training, data fetch and host-to-device transfer take {data_s / total:.0%} of the timed phases "
            "against compute: the training side is data-loading/transfer-bound"
        )
    return "compute", (
        f"within training, compute (forward, backward, optimizer) takes {compute_s / total:.0%} of the timed phases "
        "against data fetch and transfer"
    )


def _rate(value: float) -> str:
    return f"{value:.1f} samples/s"


def decide(
    snap: PipelineSnapshot, tolerance: float, wait_share: float | None, data_s: float = 0.0, compute_s: float = 0.0
) -> PipelineVerdict:
    """The bottleneck of the window ``snap`` describes (its bottleneck fields are not read): capacities within
    ``tolerance`` (0..1) of each other are balanced. ``wait_share``: of the trainer's time (steps + waits), the
    share spent waiting for samples, 0..1; ``data_s`` and ``compute_s``: training time in data fetch and transfer
    and in forward, backward and the optimizer (a linked Scope's phases), s."""
    infer, train = snap.infer_capacity, snap.train_capacity
    errors = (
        [f"{snap.infer_errors} engine call(s) raised in the window and are left out of the inference capacity"]
        if snap.infer_errors
        else []
    )
    if infer is None or train is None:
        missing = []
        if infer is None:
            missing.append("no engine call produced samples")
        if train is None:
            missing.append("no training step with samples")
        return PipelineVerdict(evidence=[f"{' and '.join(missing)} in the last window: not enough data", *errors])
    enough = snap.infer_calls >= MIN_EVENTS and snap.train_steps >= MIN_EVENTS
    waiting = wait_share is not None and wait_share >= WAITING
    trend, inflow = snap.pool_trend, snap.inflow
    steady = trend is None or (inflow is not None and abs(trend) <= POOL_TREND * inflow)
    filling = not steady and trend is not None and trend > 0
    draining = not steady and trend is not None and trend < 0
    wait_text = (
        f"the trainer waited {snap.dispatch_wait_s * 1e3:.0f} ms per step for samples ({wait_share:.0%} of its time)"
        if snap.dispatch_wait_s is not None and wait_share is not None
        else "the trainer's dispatch wait was not measured"
    )
    trend_text = "unknown" if trend is None else f"{trend:+.1f} samples/s"
    pool_text = f"the pool holds {snap.pool:.0f} samples (trend {trend_text})"
    capacities = f"inference capacity I={_rate(infer)}, training capacity T={_rate(train)}"
    if abs(infer - train) <= tolerance * max(infer, train):
        verdict = PipelineVerdict(
            "balanced",
            "high" if enough else "low",
            evidence=[f"{capacities}: within {tolerance:.0%} of each other", wait_text, pool_text],
        )
    elif train > infer:
        evidence = [
            f"{capacities}: training could consume {train / infer:.2f}x what inference produces",
            wait_text,
            pool_text,
            "add engines or raise the inference batch",
        ]
        if snap.slot_busy is not None and snap.slot_busy < IDLE_SLOTS:
            evidence.append(
                f"the engines were busy only {snap.slot_busy:.0%} of their slot time: requests do not keep every "
                "slot fed, so dispatch more requests concurrently before adding engines"
            )
        agree = waiting and not filling
        verdict = PipelineVerdict("inference", "high" if agree else "medium", evidence=evidence)
    else:
        evidence = [
            f"{capacities}: inference could produce {infer / train:.2f}x what training consumes",
            wait_text,
            pool_text,
        ]
        agree = not waiting and not draining
        verdict = PipelineVerdict("training", "high" if agree else "medium", evidence=evidence)
        side, sentence = training_side(data_s, compute_s)
        verdict.training_side = side
        evidence.append(
            sentence or "link a Scope (PipelineMonitor(scope=...)) to see whether data or compute dominates training"
        )
    if not enough:
        verdict.confidence = "low"
        verdict.evidence.append(
            f"only {snap.infer_calls} engine call(s) and {snap.train_steps} training step(s) in the window"
        )
    verdict.evidence += errors
    return verdict
