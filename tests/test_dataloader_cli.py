"""End to end: ``stepscope dataloader`` captures an unmodified script's DataLoader (tests/scripts/loader_*.py),
measures it alone in a child process, stops the script before it trains, and writes the loader figures as JSON."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from run_helpers import RunResult, cli_here, run_env, script
from test_loader import SWEEP_ROW

from stepscope.summary import PhaseStats, RunSummary, Throughput


class LoaderRun(RunResult):
    """A `stepscope dataloader` run: its JSON (not a RunSummary) and its report."""

    @property
    def data(self) -> dict:
        assert self.json_path.exists(), f"no JSON written at {self.json_path}\n{self.describe()}"
        return json.loads(self.json_path.read_text())

    @property
    def text(self) -> str:
        """stdout with the terminal report's line wrapping undone (runs of whitespace as one space)."""
        return " ".join(self.stdout.split())


def stepscope_dataloader(
    tmp_path: Path, *args: str, batches: int = 20, warmup: int = 2, options: tuple[str, ...] = (), timeout: float = 120
) -> LoaderRun:
    """``python -m stepscope.cli dataloader --batches B --warmup W --json tmp_path/loader.json OPTIONS ARGS...``; a
    script's training process runs in this one (``cli_here``), a launcher's in processes of their own."""
    tmp_path.mkdir(parents=True, exist_ok=True)
    json_path = tmp_path / "loader.json"
    cmd = [
        sys.executable,
        "-m",
        "stepscope.cli",
        "dataloader",
        *("--batches", str(batches), "--warmup", str(warmup), "--json", str(json_path)),
        *options,
        *args,
    ]
    if "--" not in args:
        return LoaderRun(cmd, *cli_here(tmp_path, cmd), json_path)
    proc = subprocess.run(cmd, cwd=tmp_path, env=run_env(), capture_output=True, text=True, timeout=timeout)
    return LoaderRun(cmd, proc.returncode, proc.stdout, proc.stderr, json_path)


def torchrun(*args: str) -> list[str]:
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        *("--nnodes", "1", "--nproc-per-node", "2", "--rdzv-backend", "c10d", "--rdzv-endpoint", "localhost:0"),
        *args,
    ]


TRAINED = "loader_train_val: trained"  # printed by the script after training only


# -- which loader, and the script stopped ----------------------------------------------------------------------------


def test_the_largest_loader_is_measured_and_the_script_stopped_before_training(tmp_path):
    # 0.5 ms of CPU per sample, batches of 16, no workers: the train loader's true ceiling is 2000 samples/s.
    r = stepscope_dataloader(tmp_path, script("loader_train_val.py"), batches=20, warmup=2)
    assert r.returncode == 0, r.describe()
    assert "loader_train_val: built val=256 train=4096" in r.stdout, r.describe()
    assert TRAINED not in r.stdout, f"the script was not stopped\n{r.describe()}"
    d = r.data
    assert len(d["ranks"]) == 1, r.describe()
    head = d["ranks"][0]
    assert (head["rank"], head["index"], head["built"]) == (0, 1, 2), head  # the train loader, built second
    assert (head["dataset"], head["dataset_length"]) == ("BusyDataset", 4096), head
    loader = d["loader"]
    assert loader["batches"] == 20 and loader["warmup"] == 2, loader
    assert loader["settings"] == {"num_workers": 0, "prefetch_factor": None, "pin_memory": False,
                                  "persistent_workers": False}  # fmt: skip
    assert loader["ended_early"] is False and loader["notes"] == [], loader
    # Busy-waits cannot run faster than the true rate. How close to it the ceiling comes depends on the machine's
    # load (test_loader.py calibrates that in one process); here the rate must be the measured fetches' own: 16
    # samples per mean fetch, the warm-up and the loader's start-up left out.
    assert loader["samples_per_s"] <= 1.05 * 2000, loader
    assert loader["samples_per_s"] == pytest.approx(16e3 / loader["fetch_ms"]["mean"], rel=0.15), loader
    assert loader["fetch_ms"]["median"] >= 8.0, loader
    assert "sweep" not in d and "against_training" not in d, d.keys()
    assert "loader 1 of 2 built (BusyDataset, 4,096 samples)" in r.text, r.describe()
    assert "ceiling:" in r.text and "over 20 batches after 2 warm-up" in r.text, r.describe()
    assert "Traceback" not in r.stderr, r.describe()


def test_the_largest_built_loader_is_measured_even_when_a_smaller_one_is_iterated_first(tmp_path):
    r = stepscope_dataloader(tmp_path, script("loader_train_val.py"), "--validate-first", batches=10, warmup=1)
    assert r.returncode == 0, r.describe()
    assert "loader_train_val: validated" not in r.stdout, r.describe()  # stopped at the val loader's iter()
    assert TRAINED not in r.stdout, r.describe()
    head = r.data["ranks"][0]
    assert (head["index"], head["dataset_length"]) == (1, 4096), head


@pytest.fixture(scope="module")
def val_loader_run(tmp_path_factory) -> LoaderRun:
    """``--loader 0`` (the val loader, 256 samples: 16 batches of 16) asked for 60 batches, against a training run at
    4000 samples/s. One run serves the tests of --loader, of a loader that ends early and of an input-bound
    comparison: --against only compares the measured ceiling with the training rate afterwards."""
    tmp = tmp_path_factory.mktemp("val_loader")
    summary_path = tmp / "train.json"
    RunSummary(throughput=Throughput(samples_per_s=4000.0)).to_json(summary_path)
    return stepscope_dataloader(
        tmp,
        "--loader",
        "0",
        script("loader_train_val.py"),
        batches=60,
        warmup=2,
        options=("--against", str(summary_path)),
    )


def test_loader_option_picks_the_first_built(val_loader_run):
    r = val_loader_run
    assert r.returncode == 0, r.describe()
    assert TRAINED not in r.stdout, r.describe()
    head = r.data["ranks"][0]
    assert (head["index"], head["dataset_length"], head["built"]) == (0, 256, 2), head
    assert r.data["loader"]["batches"] == 14  # the val loader's 16 less the 2 of warm-up: all it has of the 60 asked


def test_a_loader_that_ends_early_is_measured_and_says_so(val_loader_run):
    # The val loader has 256 / 16 = 16 batches: 2 of warm-up, then 14 of the 60 asked for.
    r = val_loader_run
    assert r.returncode == 0, r.describe()
    loader = r.data["loader"]
    assert loader["batches"] == 14 and loader["ended_early"] is True, loader
    assert loader["notes"] == ["the loader ended after 16 batches: 14 measured instead of 60"], loader
    assert "note: the loader ended after 16 batches: 14 measured instead of 60" in r.text, r.describe()


def test_iterable_dataset_without_len(tmp_path):
    r = stepscope_dataloader(
        tmp_path,
        script("loader_iterable.py"),
        batches=20,
        warmup=2,
        options=("--sweep", "--budget-s", "10"),
    )
    assert r.returncode == 0, r.describe()
    assert "loader_iterable: trained" not in r.stdout, r.describe()
    d = r.data
    head = d["ranks"][0]
    assert (head["dataset"], head["dataset_length"]) == ("BusyStream", None), head
    assert d["loader"]["samples_per_s"] > 0
    assert any("IterableDataset" in note and "get_worker_info" in note for note in d["sweep_notes"]), d
    assert all(row["error"] is None for row in d["sweep"]), d["sweep"]


# -- the sweep -------------------------------------------------------------------------------------------------------


def test_sweep_finds_that_workers_help(tmp_path):
    # 2 ms of sleep per sample, batches of 8: workers overlap the waits whatever the load on the machine's cores
    # (the CPU-bound case, which needs a free core, is tests/test_loader.py's).
    r = stepscope_dataloader(
        tmp_path,
        script("loader_train_val.py"),
        "--sleep",
        "--sample-ms",
        "2",
        "--batch-size",
        "8",
        batches=30,
        warmup=3,
        options=("--sweep", "--budget-s", "20"),
        timeout=180,
    )
    assert r.returncode == 0, r.describe()
    assert TRAINED not in r.stdout, r.describe()
    d = r.data
    rows = d["sweep"]
    assert len(rows) >= 2, rows
    assert set(rows[0]) == SWEEP_ROW
    measured = [row["samples_per_s"] for row in rows if row["error"] is None]
    assert measured == sorted(measured, reverse=True), rows  # fastest first
    assert any(row["settings"]["num_workers"] == 0 for row in rows), rows  # the current setting was tried
    best = d["best"]
    assert best["settings"]["num_workers"] >= 1, d
    assert best["samples_per_s"] == rows[0]["samples_per_s"], d
    assert best["gain"] > 0.3, d
    assert isinstance(d["sweep_skipped"], list)
    if not torch.cuda.is_available():
        assert any("pin_memory was not tried" in note for note in d["sweep_notes"]), d
    assert "sweep (fastest first):" in r.text, r.describe()
    assert "best: DataLoader(dataset, ..., num_workers=" in r.text, r.describe()


# -- against a training run ------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def sweep_against_run(tmp_path_factory) -> LoaderRun:
    """A sweep against a run that trained 100 samples/s waiting half its step for data: 5 ms per sample of its own
    (40 ms per batch of 8). Loading in process (8 x 2 ms of sleep) adds 16 ms to that; a worker overlaps it."""
    tmp = tmp_path_factory.mktemp("sweep_against")
    summary_path = tmp / "train.json"
    RunSummary(
        throughput=Throughput(samples_per_s=100.0),
        phases={"data_wait": PhaseStats(40.0, 40.0, 40.0, 0.5, 20), "total": PhaseStats(80.0, 80.0, 80.0, 1.0, 20)},
    ).to_json(summary_path)
    return stepscope_dataloader(
        tmp, script("loader_train_val.py"), "--sleep", "--sample-ms", "2", "--batch-size", "8",
        batches=15, warmup=2, options=("--sweep", "--budget-s", "20", "--against", str(summary_path)), timeout=180,
    )  # fmt: skip


# The comparison with the training rate needs no run of its own: it reads the measured ceiling of the val loader's
# run (0.5 ms of CPU per sample: at most ~2000 samples/s, so training at 4000 samples/s is input-bound) and of the
# sweep's (8 x 2 ms of sleep per batch of 8: ~500 samples/s whatever the load, so training at 100 samples/s is not).
@pytest.mark.parametrize(
    ("run", "train_rate", "input_bound"), [("val_loader_run", 4000.0, True), ("sweep_against_run", 100.0, False)]
)
def test_against_a_training_summary(request, run, train_rate, input_bound):
    r = request.getfixturevalue(run)
    assert r.returncode == 0, r.describe()
    d = r.data
    against = d["against_training"]
    assert against["train_rate"] == pytest.approx(train_rate), against
    assert against["loader_ceiling"] == pytest.approx(d["cluster_samples_per_s"]), against
    assert against["headroom"] == pytest.approx(d["cluster_samples_per_s"] / train_rate), against
    assert against["input_bound"] is input_bound, against
    verdict = "the input pipeline is the bottleneck" if input_bound else "the input pipeline keeps up"
    assert "against training: training consumed" in r.text and verdict in r.text, r.describe()


def test_against_a_training_summary_the_sweep_ranks_by_that_step(sweep_against_run):
    # ~1.4x for a worker, whatever the load (see sweep_against_run).
    r = sweep_against_run
    assert r.returncode == 0, r.describe()
    d = r.data
    assert d["trainer_ms_per_sample"] == pytest.approx(5.0), d
    current = next(row for row in d["sweep"] if row["settings"]["num_workers"] == 0)
    assert current["train_samples_per_s"] <= 8e3 / (40 + 16), current  # the step and the load add up
    best = d["best"]
    assert best["settings"]["num_workers"] >= 1 and best["train_samples_per_s"] > 8e3 / 48, d
    assert best["gain"] > 0.2, d
    assert "sweep (fastest training first: the run against spends 5.000 ms per sample" in r.text, r.describe()
    assert "training samples/s over the current setting" in r.text, r.describe()


def test_against_a_summary_without_samples_per_s_is_refused(tmp_path):
    summary_path = tmp_path / "train.json"
    RunSummary().to_json(summary_path)
    r = stepscope_dataloader(
        tmp_path, script("loader_train_val.py"), options=("--against", str(summary_path)), timeout=60
    )
    assert r.returncode == 2, r.describe()
    assert "has no samples/s" in r.stderr, r.describe()
    assert "loader_train_val: built" not in r.stdout, r.describe()  # refused before running anything


# -- bad input -------------------------------------------------------------------------------------------------------


def test_a_script_without_a_dataloader_points_at_the_library_api(tmp_path):
    r = stepscope_dataloader(tmp_path, script("loader_none.py"))
    assert r.returncode != 0, r.describe()
    assert "loader_none: done after 20 steps" in r.stdout, r.describe()  # nothing to capture: it ran to its end
    assert "stepscope.measure_loader" in r.stderr, r.describe()
    assert "never iterated a torch DataLoader" in r.stderr, r.describe()
    assert "Traceback" not in r.stderr, r.describe()
    assert r.data == {"ranks": []}


def test_a_loader_index_that_is_never_built_is_named(tmp_path):
    r = stepscope_dataloader(
        tmp_path, "--loader", "5", script("loader_train_val.py"), "--validate-first", "--epochs", "0"
    )
    assert r.returncode != 0, r.describe()
    assert "never iterated a torch DataLoader" not in r.stderr, r.describe()
    assert "--loader" in r.stderr or "loader 5" in r.stderr, r.describe()


@pytest.mark.parametrize(
    ("device", "message"),
    [
        pytest.param(
            "cuda",
            "--device cuda: torch sees no CUDA device on this machine.",
            marks=pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal without CUDA"),
        ),
        ("mps", "--device mps: copies are timed on CUDA devices only"),
    ],
)
def test_a_device_that_cannot_be_timed_is_refused_before_the_script_starts(tmp_path, device, message):
    r = stepscope_dataloader(tmp_path, "--device", device, script("loader_train_val.py"), batches=5, warmup=1)
    assert r.returncode == 2, r.describe()
    assert message in r.stderr, r.describe()
    assert "loader_train_val: built" not in r.stdout, r.describe()
    assert "Traceback" not in r.stderr, r.describe()


# -- several ranks ---------------------------------------------------------------------------------------------------


def test_torchrun_two_ranks_each_with_its_distributed_sampler(tmp_path):
    # Rank 1 sleeps 1 ms more per sample than rank 0: their ceilings differ, and the cluster's is their sum.
    launcher = torchrun(script("ddp.py"), "--extra-ms", "1.0", "--epochs", "2", "--samples", "2048")
    r = stepscope_dataloader(tmp_path, "--", *launcher, batches=20, warmup=2, timeout=240)
    assert r.returncode == 0, r.describe()
    assert "ddp: rank" not in r.stdout, r.describe()
    d = r.data
    ranks = d["ranks"]
    assert [rank["rank"] for rank in ranks] == [0, 1], r.describe()
    rates = {rank["rank"]: rank["loader"]["samples_per_s"] for rank in ranks}
    for rank in ranks:
        assert rank["dataset"] == "SleepyDataset" and rank["dataset_length"] == 2048, rank
        assert rank["loader"]["batches"] == 20, rank
        assert "error" not in rank, rank
    assert d["cluster_samples_per_s"] == pytest.approx(rates[0] + rates[1], rel=1e-9), d
    spread = d["rank_samples_per_s"]
    assert spread["min"] == pytest.approx(min(rates.values()))
    assert spread["max"] == pytest.approx(max(rates.values()))
    assert spread["mean"] == pytest.approx((rates[0] + rates[1]) / 2)
    assert rates[0] > rates[1], rates  # 8 x 0.5 ms against 8 x 1.5 ms of sleep per batch
    assert d["loader"]["samples_per_s"] == pytest.approx(rates[0])  # rank 0's loader at the top
    assert "ranks: 2 · samples/s per rank min" in r.text, r.describe()
    assert "cluster ceiling" in r.text, r.describe()
