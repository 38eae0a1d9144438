"""stepscope: where does my PyTorch training step time go, and what is the one thing to fix first?

The public API is imported on first use (PEP 562), so that ``import stepscope`` and the command line stay quick:
``stepscope trace`` never pays for the training-side modules, nor a training script for the trace reader.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

_EXPORTS = {
    "LoaderError": "stepscope.analyses.loader",
    "LoaderResult": "stepscope.analyses.loader",
    "LoaderSettings": "stepscope.analyses.loader",
    "SweepResult": "stepscope.analyses.loader",
    "SweepTrial": "stepscope.analyses.loader",
    "measure_loader": "stepscope.analyses.loader",
    "sweep_loader": "stepscope.analyses.loader",
    "ParamAudit": "stepscope.analyses.params",
    "audit_params": "stepscope.analyses.params",
    "RankTrace": "stepscope.analyses.trace.analyze",
    "TraceAnalysis": "stepscope.analyses.trace.analyze",
    "analyze_trace": "stepscope.analyses.trace.analyze",
    "TraceReadError": "stepscope.analyses.trace.stream",
    "NsysWindow": "stepscope.instrument.profile",
    "ProfileWindow": "stepscope.instrument.profile",
    "PipelineMonitor": "stepscope.pipeline.monitor",
    "PipelineSnapshot": "stepscope.pipeline.monitor",
    "NULL_SCOPE": "stepscope.scope",
    "NullScope": "stepscope.scope",
    "Scope": "stepscope.scope",
    "Fix": "stepscope.summary",
    "PhaseStats": "stepscope.summary",
    "RunSummary": "stepscope.summary",
    "SummaryError": "stepscope.summary",
    "Verdict": "stepscope.verdict",
}

__all__ = [
    "NULL_SCOPE",
    "Fix",
    "LoaderError",
    "LoaderResult",
    "LoaderSettings",
    "NsysWindow",
    "NullScope",
    "ParamAudit",
    "PhaseStats",
    "PipelineMonitor",
    "PipelineSnapshot",
    "ProfileWindow",
    "RankTrace",
    "RunSummary",
    "Scope",
    "SummaryError",
    "SweepResult",
    "SweepTrial",
    "TraceAnalysis",
    "TraceReadError",
    "Verdict",
    "__version__",
    "analyze_trace",
    "audit_params",
    "measure_loader",
    "sweep_loader",
]

if TYPE_CHECKING:
    from stepscope.analyses.loader import (
        LoaderError,
        LoaderResult,
        LoaderSettings,
        SweepResult,
        SweepTrial,
        measure_loader,
        sweep_loader,
    )
    from stepscope.analyses.params import ParamAudit, audit_params
    from stepscope.analyses.trace.analyze import RankTrace, TraceAnalysis, analyze_trace
    from stepscope.analyses.trace.stream import TraceReadError
    from stepscope.instrument.profile import NsysWindow, ProfileWindow
    from stepscope.pipeline.monitor import PipelineMonitor, PipelineSnapshot
    from stepscope.scope import NULL_SCOPE, NullScope, Scope
    from stepscope.summary import Fix, PhaseStats, RunSummary, SummaryError
    from stepscope.verdict import Verdict


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'stepscope' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return __all__
