"""stepscope: where does my PyTorch training step time go, and what is the one thing to fix first?"""

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
from stepscope.scope import NULL_SCOPE, NullScope, Scope
from stepscope.summary import Fix, PhaseStats, RunSummary, SummaryError, Verdict

__version__ = "0.1.0"

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
