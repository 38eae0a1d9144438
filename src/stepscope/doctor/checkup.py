"""`stepscope doctor`'s conclusion from a measured run: the verdict, the lint of the script, the ranked fixes.

A pure function of a RunSummary (with its runtime facts) and the script's source, so that it also works on a
summary measured elsewhere. The lint findings are kept in ``facts["lint"]`` so that the JSON says what the
rules saw.
"""

from __future__ import annotations

from pathlib import Path

from stepscope.analyses.loader import combine_ranks
from stepscope.analyses.params import combine
from stepscope.doctor.lint import LintError, LintHit, lint_file
from stepscope.doctor.rules import Case, diagnose
from stepscope.doctor.verdict import classify
from stepscope.summary import RunSummary


def script_path(argv: list[str]) -> Path | None:
    """The training script in a command line: its first ``.py`` argument that exists (``python train.py``,
    ``torchrun ... train.py``), or the file of a ``-m package.module`` found under the current directory (read
    from disk, never imported); None when there is neither."""
    for i, word in enumerate(argv):
        if word == "-m" and i + 1 < len(argv):
            base = Path.cwd().joinpath(*argv[i + 1].split("."))
            for candidate in (base.with_suffix(".py"), base / "__main__.py"):
                if candidate.is_file():
                    return candidate
            continue  # an installed module (python -m torch.distributed.run train.py): look on for the script
        if word.endswith(".py") and Path(word).is_file():
            return Path(word)
    return None


def lint_script(path: Path | None) -> tuple[list[LintHit], list[str]]:
    """The lint of the script, and a note when it could not be read (the doctor goes on without it)."""
    if path is None:
        return [], ["no script file to lint (a module or a launcher without a .py argument): runtime facts only"]
    try:
        return lint_file(path), []
    except LintError as error:
        return [], [f"the script was not linted: {error}"]


def examine(summary: RunSummary, lint: list[LintHit]) -> RunSummary:
    """Fill the summary's verdict, fixes and ``facts["lint"]``; returns the same summary."""
    if summary.ranks:
        audits = {r.meta.rank or 0: r.params for r in summary.ranks}
        combined = combine(audits)
        summary.params = [combined] if combined.get("models") else []
    ranks = summary.ranks or [summary]
    ceilings = {r.meta.rank or 0: r.dataloader for r in ranks if r.dataloader}
    if ceilings:
        summary.dataloader = combine_ranks(ceilings, summary.throughput.samples_per_s)
    summary.facts["lint"] = [hit.to_dict() for hit in lint]
    summary.verdict = classify(summary)
    fixes, notes = diagnose(Case(summary, lint))
    summary.fixes = fixes
    summary.notes += notes
    return summary
