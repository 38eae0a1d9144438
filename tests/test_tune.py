"""`stepscope tune`: the search on a model of a machine whose speed per setting is known (a fake A/B runner, as
a fake clock gives exact statistics), and once end to end on a real script whose step sleeps per intra-op
thread (a known answer under any load)."""

from __future__ import annotations

import json
import random
import statistics
import subprocess
import sys
from pathlib import Path

import pytest

from stepscope.analyses.ab import FASTER, SLOWER, RunFigures, Settings, ab_result, variant_result
from stepscope.instrument.launch import script_target
from stepscope.instrument.tune import Search, candidates, keep_lines, run_line, search
from stepscope.summary import Fix, LoaderInfo, Meta, PhaseStats, RunSummary, Throughput

SCRIPTS = Path(__file__).parent / "scripts"
WORKERS = "loader.num_workers"


def _settings_of(apply: list[dict]) -> tuple[int, int]:
    chosen = {f["id"]: f["value"] for f in apply}
    return chosen.get(WORKERS, 0), chosen.get("host.threads", 2)


# The machine: a CPU-bound loader on 2 cores beside torch's 2 intra-op threads. One worker is slower, two
# are no faster, fewer threads alone are slower; two workers with one thread are 1.29x faster. ms per step:
STEP_MS = {(0, 2): 11.0, (1, 2): 14.5, (2, 2): 11.0, (4, 2): 12.5, (0, 1): 13.0, (1, 1): 10.5, (2, 1): 8.5, (4, 1): 9.5}


def model_runner(step_ms: dict[tuple[int, int], float], calls: list[list[str]], prefetch_ms: float = 0.0):
    """An A/B runner for a machine whose step time per (workers, threads) is ``step_ms`` (12 ms elsewhere), less
    ``prefetch_ms`` with loader.prefetch and workers, with 2% noise per step and 1% per run; ``calls`` records the
    variants of each A/B."""
    rng = random.Random(7)

    def ms(apply: list[dict]) -> float:
        workers, threads = _settings_of(apply)
        prefetch = workers > 0 and any(f["id"] == "loader.prefetch" for f in apply)
        return step_ms.get((workers, threads), 12.0) - (prefetch_ms if prefetch else 0.0)

    def run(variants, settings, log=print, budget_s=None, run_timeout_s=None):
        calls.append([v.name for v in variants])
        runs = {v.name: [] for v in variants}
        for order in range(1, settings.repeats * len(variants) + 1):
            variant = variants[(order - 1) % len(variants)]
            sec = ms(variant.apply) / 1e3 * rng.lognormvariate(0, 0.01)
            steps = [sec * rng.lognormvariate(0, 0.02) for _ in range(settings.steps)]
            figures = RunFigures(
                order=order, exit_code=0, exit_reason="stopped", measured_steps=len(steps),
                sec_per_step=statistics.fmean(steps), samples_per_s=8 / sec, peak_mem_mb=None, peak_mem_source=None,
                per_rank_batch=8, global_batch=8, world_size=1, backend="single process", step_s=steps,
            )  # fmt: skip
            runs[variant.name].append(figures)
        return ab_result(settings, [variant_result(v.name, v.command, v.env, runs[v.name]) for v in variants])

    return run


def diagnosis(workers: int, threads: int, advice: str | None = None) -> RunSummary:
    """What the doctor says of the script with ``workers`` loader workers and ``threads`` intra-op threads on 2
    cores: data-bound, the loader its first fix (``advice``)."""
    fixes = []
    if advice:
        fixes.append(Fix(WORKERS, "More workers", "", [], "", "config", 0.4, apply=advice))
    return RunSummary(
        phases={"data_wait": PhaseStats(5.0, 5.0, 6.0, 0.45, 100), "forward": PhaseStats(4.0, 4.0, 5.0, 0.4, 100)},
        throughput=Throughput(steps_per_s=1e3 / STEP_MS.get((workers, threads), 12.0)),
        meta=Meta(device="cpu"),
        loaders=[LoaderInfo(0, "Slow", 8, workers, False, workers > 0, None, False, False, 100)],
        facts={"threads": {"torch_threads": threads, "cores": 2, "local_ranks": 1}},
        fixes=fixes,
    )


def _plan(runner, budget_s: float = 600.0) -> tuple[Search, list[list[str]]]:
    diagnosed: list[list[str]] = []

    def diagnose(arguments: list[str]) -> RunSummary:
        diagnosed.append(arguments)
        fixes = [f for a in arguments for f in a.split(",")]
        workers = next((int(f.split("=")[1]) for f in fixes if f.startswith(WORKERS + "=")), 0)
        threads = next((int(f.split("=")[1]) for f in fixes if f.startswith("host.threads=")), 2)
        return diagnosis(workers, threads)

    plan = Search(
        target=script_target(str(SCRIPTS / "threads_sleep.py"), []),
        settings=Settings(repeats=3, steps=100, warmup=5),
        budget_s=budget_s,
        allow_numerics=False,
        diagnose=diagnose,
        runner=runner,
        log=lambda line: None,
    )
    return plan, diagnosed


def test_workers_and_threads_are_found_together_where_neither_helps_alone():
    calls: list[list[str]] = []
    plan, diagnosed = _plan(model_runner(STEP_MS, calls))
    result = search(plan, diagnosis(0, 2, advice=f"{WORKERS}=1,loader.persistent_workers"))
    best = f"{WORKERS}=2,loader.persistent_workers,host.threads=1"
    assert result.best_apply == [best]
    assert result.speedup == pytest.approx(11.0 / 8.5, rel=0.03) and result.ci_low > 1
    # The doctor's advice (1 worker) was measured and rejected as slower; the pair was kept once, in full runs.
    advised = [t for t in result.trials if t.candidate == f"{WORKERS}=1,loader.persistent_workers"]
    assert advised and advised[0].verdict == SLOWER and not any(t.kept for t in advised)
    (kept,) = [t for t in result.trials if t.kept]
    assert (kept.candidate, kept.stage, kept.verdict) == (best, "confirm", FASTER)
    # Successive halving: all 8 settings screened in one A/B, the fastest third confirmed in full runs.
    screened = [t for t in result.trials if t.stage == "screen" and t.round == 1]
    assert len(screened) == len(calls[0]) - 1 == 8
    assert len(calls[1]) - 1 == 3 and kept.candidate in calls[1]
    assert all(t.reason for t in result.trials)
    # The doctor ran again on the kept setting; nothing new was left to try, and the one kept setting's own A/B
    # against the baseline is the headline (no last A/B).
    assert diagnosed == [[best]] and len(calls) == 2
    assert result.notes == ["round 2: no setting left to try on this diagnosis."]
    assert result.keep == [
        "DataLoader(..., num_workers=2)",
        "DataLoader(..., persistent_workers=True)",
        "torch.set_num_threads(1) before training (or OMP_NUM_THREADS=1 in the environment)",
    ]
    data = result.to_dict()
    assert data["best"]["apply"] == [best] and data["baseline"]["steps_per_s"] == pytest.approx(1e3 / 11)
    assert {"round", "stage", "candidate", "apply", "speedup", "ci_low", "ci_high", "kept", "reason"} <= set(
        data["trials"][0]
    )


def test_a_second_round_builds_on_the_first_and_the_headline_is_measured_against_the_baseline():
    # Round 1 keeps 2 workers with 1 thread (8.5 ms); prefetching, which needs workers, is a candidate only from
    # round 2's diagnosis on, and saves 1.5 ms more there.
    calls: list[list[str]] = []
    plan, diagnosed = _plan(model_runner(STEP_MS, calls, prefetch_ms=1.5))
    result = search(plan, diagnosis(0, 2))
    assert result.best_apply == [f"{WORKERS}=2,loader.persistent_workers,host.threads=1", "loader.prefetch=4"]
    assert [t.round for t in result.trials if t.kept] == [1, 2] and len(diagnosed) == 2
    # The last A/B ran the baseline against the best: its speedup is 11 / 7, not a product of the rounds'.
    assert calls[-1] == ["baseline", "best"]
    assert result.speedup == pytest.approx(11.0 / 7.0, rel=0.03) and result.ci_low > 1


def test_nothing_faster_keeps_the_script_as_it_is():
    flat = dict.fromkeys(STEP_MS, 11.0)
    calls: list[list[str]] = []
    plan, diagnosed = _plan(model_runner(flat, calls))
    result = search(plan, diagnosis(0, 2))
    assert result.best_apply == [] and result.speedup is None and diagnosed == []
    assert not any(t.kept for t in result.trials)
    assert result.notes and "no setting" in result.notes[0]


def test_a_spent_budget_starts_no_round():
    calls: list[list[str]] = []
    plan, _ = _plan(model_runner(STEP_MS, calls), budget_s=1e-9)
    result = search(plan, diagnosis(0, 2))
    assert calls == [] and result.best_apply == [] and "budget" in result.stopped


def test_candidates_follow_the_diagnosis():
    data_bound = candidates(diagnosis(0, 2), [], allow_numerics=False)
    assert f"{WORKERS}=2,loader.persistent_workers,host.threads=1" in data_bound
    assert "host.threads=1" in data_bound and "precision.bf16" not in data_bound
    # No loader and no waiting on data: no worker count is worth a run; numerics only when allowed.
    compute = diagnosis(0, 2)
    compute.loaders, compute.phases = [], {"forward": PhaseStats(9.0, 9.0, 9.5, 0.9, 100)}
    assert not any(WORKERS in c for c in candidates(compute, [], allow_numerics=False))
    assert "precision.bf16" in candidates(compute, [], allow_numerics=True)
    # What the best already holds is not a candidate; one that --apply would refuse beside it is not either.
    assert "optimizer.foreach" not in candidates(compute, ["optimizer.fused"], allow_numerics=False)


def test_keep_lines_and_the_run_line():
    assert keep_lines(["optimizer.foreach", "debug.anomaly=off"]) == [
        "torch.optim.<Optimizer>(..., foreach=True)",
        "torch.autograd.set_detect_anomaly(False) (remove the call that turns it on)",
    ]
    line = run_line(["host.threads=1"], ["train.py", "--lr", "0.1 0.2"])
    assert line == "stepscope run --apply host.threads=1 train.py --lr '0.1 0.2'"


def test_every_appliable_fix_says_how_to_keep_it():
    from stepscope.instrument.apply import APPLIABLE
    from stepscope.instrument.tune import KEEP

    assert set(KEEP) == set(APPLIABLE)


def test_tune_finds_the_thread_count_of_a_real_script(tmp_path):
    out = tmp_path / "tune.json"
    done = subprocess.run(
        [sys.executable, "-m", "stepscope.cli", "tune", "--warmup", "3", "--steps", "20", "--repeats", "2",
         "--json", str(out), str(SCRIPTS / "threads_sleep.py"), "--ms-per-thread", "6"],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    data = json.loads(out.read_text())
    assert data["best"]["apply"] == ["host.threads=1"], data
    assert data["best"]["ci_low"] > 1.3 and data["best"]["speedup"] == pytest.approx(2.0, rel=0.25), data
    assert [t["candidate"] for t in data["trials"] if t["kept"]] == ["host.threads=1"], data["trials"]
    script = SCRIPTS / "threads_sleep.py"
    assert f"stepscope run --apply host.threads=1 {script} --ms-per-thread 6" in done.stdout, done.stdout
    assert "torch.set_num_threads(1)" in done.stdout
    assert "round 1: full runs of host.threads=1" in done.stderr, done.stderr
