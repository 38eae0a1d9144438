"""End-to-end `stepscope doctor` runs on scripts with one known cause: the verdict and the first fix."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest
from run_helpers import RunResult, script, stepscope_here, stepscope_run

from stepscope import cli
from stepscope.collectors.signals import cpu_contention
from stepscope.instrument.apply import parse_fixes
from stepscope.summary import RunSummary


def doctor(tmp_path: Path, *args: str, warmup: int = 5, steps: int = 30) -> RunResult:
    """`stepscope doctor` on a script, its training process run in this one (``stepscope_here``)."""
    return stepscope_here(tmp_path, *args, warmup=warmup, steps=steps, verb="doctor")


def first_fix(summary: RunSummary) -> str:
    return summary.fixes[0].id if summary.fixes else "(none)"


def test_slow_loader_is_data_bound_and_workers_come_first(tmp_path):
    r = doctor(tmp_path, script("slow_loader.py"), "--sample-ms", "3")
    assert r.returncode == 0, r.describe()
    s = r.summary
    assert s.verdict.bound == "data", r.describe()
    assert first_fix(s) == "loader.num_workers", r.describe()
    fix = s.fixes[0]
    # The bound is the measured data_wait share (Amdahl): all a faster loader can save.
    assert fix.gain_bound == pytest.approx(s.phases["data_wait"].share, abs=1e-3)
    assert fix.gain_bound > 0.8
    assert fix.cost == "config" and not fix.changes_numerics
    assert any("num_workers=0" in line for line in fix.evidence), fix.evidence
    # The samples sleep (a read): measured alone, the fetch kept the process idle, so the advice is the workers
    # that overlap the waits (at least 2, past the cores), not one per spare core; no long run needed to see it.
    assert "(the fetch mostly waits" in fix.how, fix.how
    assert fix.apply is not None and fix.apply.endswith(",loader.persistent_workers"), fix.apply
    assert int(fix.apply.split(",")[0].removeprefix("loader.num_workers=")) >= 2, fix.apply
    # Most of the fetch is the samples' sleep: the calling thread was on a CPU (or waiting for one) under half the time.
    # Beside a busy loop per core each wake-up also waits for a CPU (50.4% once), which the run measures as contention.
    loader, host = s.dataloader["loader"], s.system["host"]
    assert loader["busy_pct"] < 50 or cpu_contention(host) is not None, (loader, host)
    # num_workers comes from argparse, so only the runtime fact knows it is 0: the lint stays silent.
    assert not [hit for hit in s.facts["lint"] if hit["kind"] == "num_workers_zero"]
    assert s.loaders[0].num_workers == 0
    assert "verdict: data" in r.stdout and "1. Load batches in enough worker processes" in r.stdout, r.stdout


def test_doctor_sweep_ranks_the_loader_settings_by_the_runs_own_step(tmp_path):
    # The loader sleeps 3 ms per sample (a read): after the measured steps the doctor sweeps its settings, ranked by
    # the rate this run's step would reach with each, and advises the sweep's best (what --verify would measure).
    r = doctor(tmp_path, "--sweep", "--sweep-budget-s", "40", script("slow_loader.py"), "--sample-ms", "3")
    assert r.returncode == 0, r.describe()
    s = r.summary
    loader = s.dataloader
    assert 0 < loader["trainer_ms_per_sample"] < 0.5 * s.phases["total"].mean_ms / s.batch_per_rank, loader
    none = next(row for row in loader["sweep"] if row["settings"]["num_workers"] == 0)
    assert none["train_samples_per_s"] < none["samples_per_s"], "without workers the step adds to the load"
    best = loader["best"]
    assert best["settings"]["num_workers"] >= 2 and best["gain"] > 1.0, loader  # sleeping workers overlap the waits
    fix = next(f for f in s.fixes if f.id == "loader.num_workers")
    assert fix.apply.startswith(f"loader.num_workers={best['settings']['num_workers']}"), (fix.apply, best)
    # every setting of the sweep's best, in words --apply takes on this machine (what --verify measures)
    assert parse_fixes([fix.apply]), fix.apply
    assert "(the loader sweep's best: " in fix.how and "samples/s of this run's step" in fix.how, fix.how
    # the run's own figures are its steps': the sweep's worker processes are not among them
    assert s.system["host"]["workers_max"] == 0, s.system["host"]


def test_optimizer_bound_model_gets_the_fused_kernel_first(tmp_path):
    r = doctor(tmp_path, script("doctor_optimizer.py"))
    assert r.returncode == 0, r.describe()
    s = r.summary
    assert s.verdict.bound == "optimizer", r.describe()
    assert first_fix(s) == "optimizer.fused", r.describe()
    fix = s.fixes[0]
    assert fix.gain_bound == pytest.approx(s.phases["optimizer"].share, abs=1e-3)
    assert fix.how == "torch.optim.Adam(params, ..., fused=True)"
    assert any("600 parameter tensors" in line and "per-parameter loop" in line for line in fix.evidence)
    optimizer = s.facts["optimizers"][0]
    assert optimizer["type"] == "Adam" and optimizer["foreach"] is False and optimizer["params"] == 600


def test_anomaly_mode_is_the_first_fix(tmp_path):
    r = doctor(tmp_path, script("doctor_anomaly.py"))
    assert r.returncode == 0, r.describe()
    s = r.summary
    assert s.verdict.bound == "compute", r.describe()
    assert first_fix(s) == "debug.anomaly", r.describe()
    fix = s.fixes[0]
    assert s.facts["torch"]["anomaly"] is True
    compute = s.phases["forward"].share + s.phases["backward"].share
    assert fix.gain_bound == pytest.approx(compute, abs=1e-3)
    assert "line 11: torch.autograd.set_detect_anomaly(True)" in fix.evidence, fix.evidence


def test_item_every_step_is_flagged_with_its_line(tmp_path):
    # The script's step computes for ~6 ms (it was 0.2 ms): one step descheduled on a busy machine (~10 ms) then
    # cannot carry a phase's mean and turn the verdict (beside two busy loops, a 0.2 ms step read "optimizer").
    r = doctor(tmp_path, script("doctor_item.py"))
    assert r.returncode == 0, r.describe()
    s = r.summary
    assert s.verdict.bound in ("compute", "balanced"), r.describe()
    ids = [f.id for f in s.fixes]
    assert "host.sync" in ids, r.describe()
    fix = s.fixes[ids.index("host.sync")]
    # First, unless a fix the measurements bound outranks it: glibc's page-fault churn can (its 2 MB activations
    # are handed back to the kernel every step in some runs: 270-340 faults a step, host.malloc_churn).
    assert all(f.gain_bound is not None for f in s.fixes[: ids.index("host.sync")]), r.describe()
    assert set(ids[: ids.index("host.sync")]) <= {"host.malloc_churn"}, r.describe()
    assert fix.cost == "code"
    assert s.counters["item_calls"] == pytest.approx(1.0)
    assert "line 20: losses.append(loss.item())" in fix.evidence, fix.evidence
    # On a CPU run the scalar read waits for no device: the bound says so instead of promising a gain.
    assert fix.gain_bound is None
    assert "CPU" in fix.gain_reason


def test_script_failing_before_the_first_step_reports_and_keeps_its_exit_code(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text("import torch\ntorch.autograd.set_detect_anomaly(True)\nraise RuntimeError('no data here')\n")
    r = doctor(tmp_path, str(bad))
    assert r.returncode == 1, r.describe()
    assert "Traceback" in r.stderr and "RuntimeError: no data here" in r.stderr
    assert "stepscope" not in r.stderr.split("Traceback")[0], r.stderr  # no error of stepscope's own
    s = r.summary
    assert s.exit is not None and s.exit.reason == "error"
    assert s.verdict.bound == "unknown"
    # What was learned still counts: the lint saw anomaly mode, so its fix is listed (no steps: unbounded).
    assert first_fix(s) == "debug.anomaly", r.describe()
    assert s.fixes[0].gain_bound is None
    assert "the script failed" in r.stdout


def test_unparseable_script_is_a_note_not_a_crash(tmp_path):
    # Python 3.11 runs the script (it fails with its own SyntaxError); the lint says why it was skipped.
    bad = tmp_path / "broken.py"
    bad.write_text("import torch\nfor x in :\n")
    r = doctor(tmp_path, str(bad))
    assert r.returncode == 1, r.describe()
    assert any("was not linted" in note and "line 2" in note for note in r.summary.notes), r.summary.notes


def test_missing_script_is_exit_2(tmp_path, capsys):
    # The command's entry point in this process: nothing is started, so no Python process is needed to see it refuse.
    code = cli.main(["doctor", "--json", str(tmp_path / "s.json"), str(tmp_path / "nope.py")])
    err = capsys.readouterr().err
    assert code == 2
    assert "cannot run" in err and "no such file" in err


def test_torchrun_ddp_find_unused_with_nothing_unused(tmp_path):
    launcher = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        *("--nnodes", "1", "--nproc-per-node", "2", "--rdzv-backend", "c10d", "--rdzv-endpoint", "localhost:0"),
        script("doctor_ddp.py"),
    ]
    r = stepscope_run(tmp_path, "--", *launcher, warmup=5, steps=20, timeout=300, verb="doctor")
    assert r.returncode == 0, r.describe()
    s = r.summary
    assert len(s.ranks) == 2, r.describe()
    ids = [f.id for f in s.fixes]
    assert "ddp.find_unused_parameters" in ids, r.describe()
    # A small MLP: copying its gradients into DDP's buckets and back takes microseconds, too little to list.
    assert "ddp.gradient_as_bucket_view" not in ids, r.describe()
    ddp = s.facts["models"][0]["ddp"]
    assert ddp["find_unused_parameters"] is True and ddp["gradient_as_bucket_view"] is False
    assert s.params and s.params[0]["unused"] == [] and s.params[0]["steps"] >= 1
    fix = next(f for f in s.fixes if f.id == "ddp.find_unused_parameters")
    assert any("found no parameter without a gradient" in line for line in fix.evidence)
    # Where load made one rank the straggler, the job's fixes are that rank's, each line prefixed "rank R: ".
    lines = [re.sub(r"^rank \d+: ", "", line) for line in fix.evidence]
    assert any(line.startswith("line 15: model = DistributedDataParallel(") for line in lines), fix.evidence


def test_compilation_inside_the_measured_steps_is_named(tmp_path):
    r = doctor(tmp_path, script("compiled.py"), warmup=0, steps=10)
    assert r.returncode == 0, r.describe()
    s = r.summary
    assert "dynamo" in s.facts, (s.notes, sorted(s.facts), r.describe())  # failed once in a parallel run: say why
    assert s.facts["dynamo"]["graphs_in_window"] >= 1, s.facts.get("dynamo")
    ids = [f.id for f in s.fixes]
    assert "hygiene.compile_in_window" in ids, ids
    fix = next(f for f in s.fixes if f.id == "hygiene.compile_in_window")
    assert fix.gain_bound is None and "measurement" in fix.gain_reason
    assert fix.evidence[0].endswith("graph(s) compiled during the measured steps")


def test_script_path_finds_a_module_file_without_importing_it(tmp_path, monkeypatch):
    from stepscope.doctor.checkup import script_path

    package = tmp_path / "proj" / "train"
    package.mkdir(parents=True)
    (tmp_path / "proj" / "__init__.py").write_text("raise RuntimeError('imported')\\n")
    (package / "__init__.py").write_text("")
    (package / "main.py").write_text("print('hi')\\n")
    (package / "__main__.py").write_text("")
    monkeypatch.chdir(tmp_path)
    assert script_path(["-m", "proj.train.main", "--lr", "1"]) == tmp_path / "proj" / "train" / "main.py"
    assert script_path(["-m", "proj.train"]) == tmp_path / "proj" / "train" / "__main__.py"
    assert script_path(["-m", "not.there"]) is None
    (tmp_path / "train.py").write_text("")
    launcher = ["-m", "torch.distributed.run", "--nproc-per-node", "2", "train.py"]
    assert script_path(launcher) == Path("train.py")  # the launcher module is installed: the script is the file
    (tmp_path / "train.py").unlink()
    assert script_path(["--nproc-per-node", "2", "train.py"]) is None  # named but missing
    (tmp_path / "train.py").write_text("")
    assert script_path(["--nproc-per-node", "2", "train.py"]) == Path("train.py")
