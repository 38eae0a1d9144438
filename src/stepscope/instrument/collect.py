"""Gather the rank summaries of one job from files and folders: what ``stepscope merge`` and ``run --out`` read.

A job's summaries arrive in many shapes: one file per rank in a shared ``--out`` folder, one merged summary per
node (``run --json`` on each node), or both at once (a folder that also holds an earlier merge's output). Every
input is flattened to rank summaries; the same process's summary seen twice (a rank file and a node summary that
holds it, a checkpoint and the final write) counts once; and summaries of different jobs are refused with the
reason, because merging them would make a rank table of two jobs and name a straggler that never existed.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from stepscope.summary import RunSummary, SummaryError, is_final, summary_files

RANK_FILES = "rank*-pid*.json"


class MergeError(ValueError):
    """The inputs cannot be merged into one job (different jobs, nothing readable); the message says why, and
    ``notes`` says why each file was skipped (one sentence each)."""

    def __init__(self, message: str, notes: list[str] | None = None) -> None:
        super().__init__(message)
        self.notes = notes or []


@dataclass
class Gathered:
    """The rank summaries found, where each came from, and what could not be read."""

    ranks: list[RunSummary] = field(default_factory=list)
    sources: dict[int, str] = field(default_factory=dict)  # id(rank summary) -> the file it was read from
    notes: list[str] = field(default_factory=list)
    lint: list[dict[str, Any]] | None = None  # a `doctor` summary's static findings: the job gets a doctor's report


def _rank(summary: RunSummary) -> int:
    return summary.meta.rank if summary.meta.rank is not None else 0


def rank_problem(summary: RunSummary) -> str | None:
    """Why ``summary``'s rank cannot be one of its job's (outside ``[0, world_size)``), or None when it can."""
    rank, world = summary.meta.rank, summary.meta.world_size
    if world is not None and world < 1:
        return f"it says the job has {world} process(es) (world size); a job has at least 1"
    if rank is None:
        return None
    if world is not None and not 0 <= rank < world:
        return f"it says rank {rank}, outside the job's ranks 0 to {world - 1} (world size {world})"
    if rank < 0:
        return f"it says rank {rank}; a rank is 0 or more"
    return None


def _files(inputs: Iterable[str | Path]) -> list[Path]:
    """Every summary file named, or found directly in a named folder (``*.json``, sorted), each once; MergeError
    for a path that does not exist (a folder without summaries is left to the caller's "nothing readable")."""
    files, problems = summary_files(inputs)
    for path, why in problems:
        if not Path(path).exists():
            raise MergeError(why)
    return files


def _key(summary: RunSummary) -> tuple[str | None, int, str, int | None]:
    meta = summary.meta
    return meta.job_id, _rank(summary), meta.hostname, meta.pid


def gather(inputs: Iterable[str | Path]) -> Gathered:
    """Read the summaries in ``inputs`` (files, and folders of them) as rank summaries. A file that is not a
    stepscope summary, is broken, or names a rank outside ``[0, world_size)`` is a note and is skipped; raises
    MergeError (with those notes) when a named path does not exist or nothing could be read."""
    inputs = list(inputs)
    found = Gathered()
    chosen: dict[tuple[str | None, int, str, int | None], RunSummary] = {}
    files = _files(inputs)
    for path in files:
        try:
            summary = RunSummary.from_json(path)
        except SummaryError as error:
            found.notes.append(f"{path} was skipped: {error}")
            continue
        problem = next(filter(None, map(rank_problem, summary.ranks or [summary])), None)
        if problem:
            found.notes.append(f"{path} was skipped: {problem}.")
            continue
        if summary.fixes or "lint" in summary.facts:
            found.lint = found.lint or summary.facts.get("lint", [])
        for rank in summary.ranks or [summary]:
            key = _key(rank)
            kept = chosen.get(key)
            # The same process twice: its final summary over a checkpoint, then the one with more steps.
            if kept is None or (is_final(rank), rank.steps.measured) > (is_final(kept), kept.steps.measured):
                chosen[key] = rank
                found.sources[id(rank)] = str(path)
    folders = [Path(p) for p in inputs if Path(p).is_dir()]
    if folders:
        chosen = {_key(rank): rank for rank in with_streams(folders, list(chosen.values()))}
    if not chosen:
        raise MergeError(
            f"no stepscope summary could be read from {', '.join(map(str, inputs))}"
            + (f" ({len(files)} file(s) skipped, each for the reason above)" if files else " (no .json files there)")
            + ".",
            found.notes,
        )
    found.ranks = sorted(chosen.values(), key=_rank)
    return found


def with_streams(folders: list[Path], ranks: list[RunSummary]) -> list[RunSummary]:
    """``ranks`` with each process of their job that left a step stream in ``folders`` but no final summary (killed,
    ``os._exit``, or still running) given one from its stream (see follow.py). With no summary at all, the newest
    job's streams."""
    from stepscope.instrument.follow import Follow, complete, job_key

    jobs = {job_key({"job_id": r.meta.job_id, "launch_id": r.meta.launch_id}) for r in ranks} or None
    for folder in folders:
        follow = Follow(folder, jobs=jobs)
        follow.poll()
        ranks = complete(ranks, follow, code=None, launcher=False, ended=False)
    return ranks


def check_one_job(found: Gathered) -> int | None:
    """Raise MergeError when the summaries are not one job's: different job ids, different world sizes, or one
    rank reported by two processes. Returns the job's world size (None when no summary says)."""
    ranks, where = found.ranks, found.sources

    def described(rank: RunSummary) -> str:
        return f"{where.get(id(rank), '?')}"

    jobs: dict[str, list[RunSummary]] = {}
    for r in ranks:
        if r.meta.job_id is not None:
            jobs.setdefault(r.meta.job_id, []).append(r)
    if len(jobs) > 1:
        parts = [f"{job} ({len(members)} rank(s), e.g. {described(members[0])})" for job, members in jobs.items()]
        raise MergeError(
            f"these summaries are from {len(jobs)} different jobs: {'; '.join(parts)}. Merge each job's summaries "
            "on their own."
        )
    worlds = {r.meta.world_size for r in ranks if r.meta.world_size is not None}
    if len(worlds) > 1:
        raise MergeError(
            f"these summaries disagree on the job's world size ({', '.join(map(str, sorted(worlds)))}): they are from "
            "different jobs (or runs of one job at different scales: compare those with `stepscope scale`)."
        )
    seen: dict[int, RunSummary] = {}
    for r in ranks:
        other = seen.setdefault(_rank(r), r)
        if other is not r:
            raise MergeError(
                f"rank {_rank(r)} was reported by two processes ({other.meta.node} pid {other.meta.pid} in "
                f"{described(other)}; {r.meta.node} pid {r.meta.pid} in {described(r)}): these are two jobs, or two "
                "runs of one, and merging them would mix them. Merge each run's summaries on their own."
            )
    return next(iter(worlds), None)


def wait_for_ranks(folder: Path, job_id: str | None, world: int, timeout_s: float, poll_s: float = 0.5) -> list[int]:
    """Wait up to ``timeout_s`` until every rank of the job has written its final summary into ``folder`` (the
    job's other nodes may still be finishing when this node's command ends). Returns the ranks still missing."""
    deadline = time.monotonic() + timeout_s
    done: set[int] = set()
    read: dict[Path, float] = {}
    while True:
        for path in folder.glob(RANK_FILES):
            try:
                mtime = path.stat().st_mtime
                if read.get(path) == mtime:
                    continue
                read[path] = mtime
                summary = RunSummary.from_json(path)
            except (OSError, SummaryError):
                continue  # being replaced right now: read it next time
            if summary.meta.job_id == job_id and is_final(summary):
                done.add(_rank(summary))
        missing = sorted(set(range(world)) - done)
        if not missing or time.monotonic() >= deadline:
            return missing
        time.sleep(poll_s)
