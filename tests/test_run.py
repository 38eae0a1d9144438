"""End to end: ``stepscope run`` measures unmodified training scripts (tests/scripts/) in a child process."""

from __future__ import annotations

import contextlib
import importlib.util
import os
import queue
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil
import pytest
import torch
from run_helpers import (
    SCRIPTS,
    RunResult,
    check_consistent,
    hooked,
    line_starting,
    run_env,
    script,
    stepscope_cmd,
    stepscope_here,
    stepscope_run,
    terminal_signals,
    torchrun,
)

from stepscope.summary import RunSummary


def counter(summary: RunSummary, name: str) -> float:
    assert name in summary.counters, f"counter {name!r} missing: {summary.counters}"
    return summary.counters[name]


# -- a plain loop, stopped after --steps -----------------------------------------------------------------------
# Each run starts a Python that imports torch (seconds of CPU): tests that only read a run share it.


@pytest.fixture(scope="module")
def plain_run(tmp_path_factory) -> RunResult:
    """basic.py (clip_grad_norm_) stopped after 3 + 15 steps, with a --tag that has a space in it."""
    tmp_path = tmp_path_factory.mktemp("plain")
    return stepscope_run(tmp_path, script("basic.py"), "--tag", "hello world", warmup=3, steps=15)


@pytest.fixture(scope="module")
def dashed_run(tmp_path_factory) -> RunResult:
    """basic.py as any command after ``--``, stopped after 3 + 8 steps; it clips with clip_grad_value_ (the plain
    run has clip_grad_norm_), for the terminal report's test."""
    tmp_path = tmp_path_factory.mktemp("dashed")
    cmd = ("--", sys.executable, script("basic.py"), "--tag", "dashed", "--clip", "value")
    return stepscope_run(tmp_path, *cmd, warmup=3, steps=8)


def test_stops_after_warmup_plus_steps(plain_run):
    r = plain_run
    assert r.returncode == 0, r.describe()
    s = r.summary
    check_consistent(s, r)
    assert s.steps.warmup == 3, r.describe()
    assert s.steps.measured == 15, r.describe()
    assert s.steps.boundary == "optimizer.step", r.describe()
    assert s.exit is not None, r.describe()
    assert s.exit.reason == "stopped", r.describe()
    assert s.exit.code in (0, None), r.describe()
    # The script never reached its own end.
    assert "basic: done" not in r.stdout, r.describe()


def test_script_runs_as_main_with_its_argv_and_output_untouched(plain_run):
    r = plain_run
    assert r.returncode == 0, r.describe()
    assert "basic: __name__=__main__ argv0=" in r.stdout, r.describe()
    first = next(line for line in r.stdout.splitlines() if line.startswith("basic: __name__="))
    assert first.split("argv0=")[1].split(" tag=")[0].endswith("basic.py"), r.describe()
    assert first.endswith("tag=hello world"), r.describe()
    assert "basic: a line on stderr\n" in r.stderr, r.describe()
    assert "basic: a line on stderr" not in r.stdout, r.describe()


def test_every_phase_of_a_plain_loop_is_timed(plain_run):
    r = plain_run
    assert r.returncode == 0, r.describe()
    s = r.summary
    check_consistent(s, r)
    for phase in ("data_wait", "forward", "backward", "clip", "optimizer", "zero_grad", "total"):
        assert phase in s.phases, f"{phase} missing\n{r.describe()}"
        assert s.phases[phase].steps == 15, f"{phase}: {s.phases[phase]}\n{r.describe()}"
    # Only phases that ran: this loop never reads a value back, and on CPU there is no device sync anyway.
    assert "sync" not in s.phases, r.describe()
    assert counter(s, "forward_calls") == pytest.approx(1)
    assert counter(s, "backward_calls") == pytest.approx(1)
    assert counter(s, "optimizer_steps") == pytest.approx(1)
    assert counter(s, "batches") == pytest.approx(1)
    assert counter(s, "item_calls") == pytest.approx(0)
    assert counter(s, "host_syncs") == pytest.approx(0)
    # samples/s from the loader's batch (8).
    assert s.throughput.samples_per_s == pytest.approx(8 / (s.phases["total"].mean_ms / 1e3), rel=0.02)
    assert s.throughput.steps_per_s == pytest.approx(1 / (s.phases["total"].mean_ms / 1e3), rel=0.02)
    loader = s.loaders[0]
    assert (loader.batch_size, loader.num_workers, loader.pin_memory, loader.persistent_workers) == (8, 0, False, False)
    assert loader.drop_last is True
    assert loader.iterable is False
    assert loader.length == 32
    assert loader.batches >= 18  # warm-up + measured steps, one batch each
    assert loader.samples == 8 * loader.batches
    assert s.meta.rank in (None, 0)


def test_terminal_report(dashed_run):
    r = dashed_run
    assert r.returncode == 0, r.describe()
    assert "clip" in r.summary.phases, r.describe()  # clip_grad_value_
    assert line_starting(r.stdout, "data_wait") is not None, r.describe()
    assert line_starting(r.stdout, "forward") is not None, r.describe()
    assert line_starting(r.stdout, "total") is not None, r.describe()
    assert re.search(r"^\s*bound:", r.stdout, re.MULTILINE), r.describe()
    assert "Traceback" not in r.stderr, r.describe()


def test_no_stop_runs_the_script_to_its_end(tmp_path):
    r = stepscope_here(tmp_path, "--no-stop", script("basic.py"), "--iters", "12", warmup=3, steps=5)
    assert r.returncode == 0, r.describe()
    assert "basic: done after 12 steps" in r.stdout, r.describe()
    s = r.summary
    check_consistent(s, r)
    assert s.exit.reason == "finished", r.describe()
    assert s.steps.warmup == 3
    # 12 optimizer steps ran: 3 of warm-up, then at least the 5 asked for, at most all 9 that followed.
    assert 5 <= s.steps.measured <= 9, r.describe()


def test_script_that_ends_before_the_step_budget_finishes(tmp_path):
    r = stepscope_here(tmp_path, script("basic.py"), "--iters", "12", warmup=3, steps=200)
    assert r.returncode == 0, r.describe()
    assert "basic: done after 12 steps" in r.stdout, r.describe()
    s = r.summary
    assert s.exit.reason == "finished", r.describe()
    assert s.steps.measured == 9, r.describe()


def test_script_exit_code_propagates(tmp_path):
    r = stepscope_here(tmp_path, script("basic.py"), "--iters", "6", "--exit-code", "3", warmup=2, steps=50)
    assert r.returncode == 3, r.describe()
    assert "basic: done after 6 steps" in r.stdout, r.describe()
    s = r.summary
    assert s.exit.code == 3, r.describe()
    assert s.steps.measured == 4, r.describe()
    assert "Traceback" not in r.stderr, r.describe()


def test_any_command_after_double_dash(dashed_run):
    r = dashed_run
    assert r.returncode == 0, r.describe()
    assert "tag=dashed" in r.stdout, r.describe()
    s = r.summary
    check_consistent(s, r)
    assert s.steps.measured == 8, r.describe()
    assert s.exit.reason == "stopped", r.describe()
    assert not s.ranks
    assert s.cluster is None
    assert s.loaders[0].batch_size == 8


# -- where the time goes -----------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def slow_loader_run(tmp_path_factory) -> RunResult:
    """slow_loader.py without workers, 3 ms per sample, stopped after 3 + 20 steps. 40 samples make 5 batches of 8
    per epoch: the 23 batches span 4 whole epochs and 3 batches of a fifth (without workers each batch waits for its
    8 sleeps, whatever the dataset's size)."""
    tmp_path = tmp_path_factory.mktemp("slow_loader")
    args = ("--sample-ms", "3", "--num-samples", "40")
    return stepscope_here(tmp_path, script("slow_loader.py"), *args, warmup=3, steps=20)


def test_slow_loader_is_data_bound(slow_loader_run):
    r = slow_loader_run
    assert r.returncode == 0, r.describe()
    s = r.summary
    check_consistent(s, r)
    assert s.verdict.bound == "data", f"{s.verdict}\n{r.describe()}"
    assert s.verdict.evidence, r.describe()
    assert any("data_wait" in e and re.search(r"\d+%", e) for e in s.verdict.evidence), s.verdict.evidence
    data = s.phases["data_wait"]
    # 8 samples x 3 ms of sleep per batch; sleeping never undershoots. Each of the 8 wake-ups waits for a CPU on a
    # busy machine (52 ms a batch beside a busy loop per core): the upper bound holds where the run saw no
    # contention for the CPU.
    from stepscope.collectors.signals import derive_signals

    contended = any(signal["id"] == "cpu_contention" for signal in derive_signals(s.system or {}))
    assert 24 * 0.98 <= data.mean_ms <= 24 * (3.0 if contended else 1.4), f"data_wait {data}\n{r.describe()}"
    assert data.share > 0.7, f"data_wait {data}\n{r.describe()}"
    total_ms = s.phases["total"].mean_ms
    assert s.throughput.samples_per_s == pytest.approx(8 / (total_ms / 1e3), rel=0.02), s.throughput
    assert s.loaders[0].num_workers == 0


def test_workers_cut_data_wait(tmp_path, slow_loader_run):
    serial = slow_loader_run
    workers = stepscope_here(
        tmp_path,
        script("slow_loader.py"),
        *("--sample-ms", "3", "--num-workers", "2", "--persistent-workers"),
        warmup=5,
        steps=20,
    )
    assert serial.returncode == 0, serial.describe()
    assert workers.returncode == 0, workers.describe()
    s0, s2 = serial.summary, workers.summary
    check_consistent(s2, workers)
    assert s2.loaders[0].num_workers == 2, workers.describe()
    assert s2.loaders[0].persistent_workers is True
    assert s2.loaders[0].prefetch_factor == 2
    assert s2.loaders[0].batch_size == 8
    # Two workers fill batches in parallel: steady-state data_wait is about half the serial one.
    assert s2.phases["data_wait"].mean_ms < 0.75 * s0.phases["data_wait"].mean_ms, (
        f"serial {s0.phases['data_wait']}\nworkers {s2.phases['data_wait']}\n{workers.describe()}"
    )
    assert s2.throughput.samples_per_s > 1.2 * s0.throughput.samples_per_s


def test_epochs_are_listed(slow_loader_run):
    # 40 samples / batch 8 = 5 batches per epoch; 3 + 20 = 23 steps = 4 whole epochs and 3 batches of a fifth.
    r = slow_loader_run
    assert r.returncode == 0, r.describe()
    s = r.summary
    check_consistent(s, r)
    epochs = s.epochs
    assert len(epochs) == 5, f"{epochs}\n{r.describe()}"
    assert [e.index for e in epochs] == [0, 1, 2, 3, 4]
    assert all(e.loader == 0 for e in epochs)
    for e in epochs[:4]:
        assert e.complete, e
        assert (e.batches, e.samples) == (5, 40), e
        assert e.time_s > 3 * 40 / 1e3, e  # 40 samples of 3 ms of sleep each
    assert not epochs[4].complete, epochs[4]
    assert epochs[4].batches == 3, epochs[4]
    assert all(e.start_stall_ms is None or e.start_stall_ms >= 0 for e in epochs)
    loader = s.loaders[0]
    assert loader.length == 5
    assert loader.batches == 23
    assert loader.samples == 184


def test_expensive_optimizer_is_optimizer_bound(tmp_path):
    r = stepscope_here(tmp_path, "--batch-size", "16", script("optimizer_heavy.py"), "--opt-ms", "20", steps=15)
    assert r.returncode == 0, r.describe()
    s = r.summary
    check_consistent(s, r)
    assert s.steps.boundary == "optimizer.step"
    assert s.steps.measured == 15
    assert s.verdict.bound == "optimizer", f"{s.verdict}\n{r.describe()}"
    opt = s.phases["optimizer"]
    assert opt.mean_ms >= 20, opt
    assert opt.share > 0.7, opt
    # No DataLoader: samples/s comes from --batch-size.
    assert not s.loaders
    assert "data_wait" not in s.phases
    assert s.throughput.samples_per_s == pytest.approx(16 / (s.phases["total"].mean_ms / 1e3), rel=0.02)


def test_without_a_loader_the_summary_says_which_batch_size_would_give_samples_per_s(tmp_path):
    # nanoGPT's loop: get_batch() of 16 rows, 3 micro-steps an optimizer step, no DataLoader, and the loss from a
    # module (two forward calls a micro-step: the micro-steps are the backwards). No samples/s is
    # guessed; the note names the model's input and the --batch-size it suggests, which then gives the rate.
    r = stepscope_here(tmp_path, script("loader_none.py"), "--steps", "60", "--accum", "3", warmup=3, steps=15)
    assert r.returncode == 0, r.describe()
    s = r.summary
    assert s.throughput.samples_per_s is None and s.throughput.steps_per_s
    note = "the model's first input was (16, 16): if its first dimension is the batch, `stepscope run --batch-size 48`"
    assert any(note in n and "(16 × 3 backward passes a step)" in n for n in s.notes), s.notes
    assert note in r.stdout, r.stdout[-2000:]
    r = stepscope_here(tmp_path / "b", "--batch-size", "48", script("loader_none.py"), "--steps", "60", "--accum", "3",
                       warmup=3, steps=15)  # fmt: skip
    assert r.returncode == 0, r.describe()
    s = r.summary
    assert s.throughput.samples_per_s == pytest.approx(48 * s.throughput.steps_per_s)
    assert not any("no samples/s" in n for n in s.notes), s.notes


def test_gradient_accumulation(tmp_path):
    r = stepscope_here(tmp_path, script("grad_accum.py"), "--accum", "4", "--batch-size", "8", warmup=3, steps=15)
    assert r.returncode == 0, r.describe()
    s = r.summary
    check_consistent(s, r)
    assert s.steps.boundary == "optimizer.step"
    assert s.steps.measured == 15
    assert counter(s, "forward_calls") == pytest.approx(4, abs=0.01), s.counters
    assert counter(s, "backward_calls") == pytest.approx(4, abs=0.01), s.counters
    assert counter(s, "optimizer_steps") == pytest.approx(1, abs=0.01), s.counters
    assert counter(s, "batches") == pytest.approx(4, abs=0.01), s.counters
    # Every step consumes 4 batches of 8.
    assert s.throughput.samples_per_s == pytest.approx(32 / (s.phases["total"].mean_ms / 1e3), rel=0.02)
    assert s.phases["data_wait"].steps == 15


def test_autocast_bf16(tmp_path):
    r = stepscope_here(tmp_path, script("amp_bf16.py"), warmup=3, steps=10)
    assert r.returncode == 0, r.describe()
    s = r.summary
    check_consistent(s, r)
    assert s.steps.measured == 10
    for phase in ("forward", "backward", "optimizer"):
        assert phase in s.phases, r.describe()
        assert s.phases[phase].mean_ms > 0
    # The loader yields dicts of tensors: the batch size is the first dim of the first tensor (16).
    assert s.throughput.samples_per_s == pytest.approx(16 / (s.phases["total"].mean_ms / 1e3), rel=0.02)
    assert s.loaders[0].samples == 16 * s.loaders[0].batches


@pytest.mark.skipif(
    not hasattr(torch, "compile") or importlib.util.find_spec("torch._dynamo") is None,
    reason="torch.compile is unavailable",
)
def test_torch_compile(tmp_path):
    r = stepscope_here(tmp_path, script("compiled.py"), warmup=2, steps=5)
    assert r.returncode == 0, r.describe()
    s = r.summary
    check_consistent(s, r)
    assert s.exit.reason == "stopped"
    assert s.steps.measured == 5
    assert "forward" in s.phases, r.describe()
    assert "backward" in s.phases, r.describe()


@pytest.mark.parametrize("form", ["loss.backward", "torch.autograd.backward"])
def test_manual_updates_step_on_backward(tmp_path, form):
    flags = ["--autograd-backward"] if form == "torch.autograd.backward" else []
    r = stepscope_here(tmp_path, "--batch-size", "16", script("manual_sgd.py"), *flags, warmup=3, steps=12)
    assert r.returncode == 0, r.describe()
    s = r.summary
    check_consistent(s, r)
    assert s.steps.boundary == "backward", r.describe()
    assert s.steps.measured == 12
    assert s.exit.reason == "stopped"
    assert counter(s, "backward_calls") == pytest.approx(1)
    assert counter(s, "forward_calls") == pytest.approx(1)
    assert "optimizer" not in s.phases
    assert s.throughput.samples_per_s == pytest.approx(16 / (s.phases["total"].mean_ms / 1e3), rel=0.02)


def test_an_optimizer_that_never_steps_does_not_hold_the_first_step_forever(tmp_path):
    # It made an SGD for its learning rate and updates by hand: without the fallback, the run waited for its
    # first step until killed.
    r = stepscope_run(tmp_path, script("manual_sgd.py"), "--unused-optimizer", warmup=2, steps=10, timeout=60)
    assert r.returncode == 0, r.describe()
    s = r.summary
    check_consistent(s, r)
    assert (s.steps.boundary, s.steps.measured, s.exit.reason) == ("backward", 10, "stopped"), r.describe()
    assert counter(s, "backward_calls") == pytest.approx(1)
    assert any("none stepped in its first 100 backward calls" in note for note in s.notes), s.notes


def test_lbfgs_closure_time_is_forward_and_backward(tmp_path):
    r = stepscope_here(tmp_path, script("lbfgs.py"), "--fwd-ms", "3", warmup=2, steps=8)
    assert r.returncode == 0, r.describe()
    s = r.summary
    check_consistent(s, r)
    assert s.steps.boundary == "optimizer.step"
    assert s.steps.measured == 8
    fwd_calls = counter(s, "forward_calls")
    assert fwd_calls >= 1, s.counters
    assert counter(s, "backward_calls") == pytest.approx(fwd_calls), s.counters
    assert counter(s, "optimizer_steps") == pytest.approx(1), s.counters
    forward, optimizer = s.phases["forward"], s.phases["optimizer"]
    assert "backward" in s.phases
    # Each closure call sleeps 3 ms in forward: that time is forward's, not the enclosing optimizer.step's.
    assert forward.mean_ms >= 3 * fwd_calls * 0.98, (forward, s.counters)
    assert optimizer.mean_ms < forward.mean_ms, (optimizer, forward)
    assert forward.share + s.phases["backward"].share > 0.5, s.phases
    assert s.verdict.bound == "compute", f"{s.verdict}\n{r.describe()}"


def test_gan_two_optimizers_make_one_step(tmp_path):
    r = stepscope_here(tmp_path, script("gan.py"), "--batch-size", "16", warmup=3, steps=12)
    assert r.returncode == 0, r.describe()
    s = r.summary
    check_consistent(s, r)
    assert s.steps.boundary == "optimizer.step"
    assert s.steps.measured == 12
    assert s.exit.reason == "stopped"
    assert counter(s, "optimizer_steps") == pytest.approx(2, abs=0.01), s.counters
    assert counter(s, "backward_calls") == pytest.approx(2, abs=0.01), s.counters
    assert counter(s, "batches") == pytest.approx(1, abs=0.01), s.counters
    assert s.throughput.samples_per_s == pytest.approx(16 / (s.phases["total"].mean_ms / 1e3), rel=0.02)


@pytest.fixture(scope="module")
def item_run(tmp_path_factory) -> RunResult:
    """item_every_step.py: the step reads its loss back with .item() once, and the loader calls .item() too, which is
    data loading: 8 times per batch in the Dataset's __getitem__ (--item-in-dataset), and at each epoch start, where
    a shuffled loader draws its seed (32 samples: 4 batches per epoch, 5 epoch starts in 3 + 15 steps). Only the
    step's own read-back may be counted."""
    tmp_path = tmp_path_factory.mktemp("item")
    args = ("--item-in-dataset", "--samples", "32")
    return stepscope_here(tmp_path, script("item_every_step.py"), *args, warmup=3, steps=15)


def test_item_calls_are_counted(item_run):
    r = item_run
    assert r.returncode == 0, r.describe()
    s = r.summary
    check_consistent(s, r)
    assert counter(s, "item_calls") == pytest.approx(1, abs=0.01), s.counters
    assert counter(s, "host_syncs") == pytest.approx(0), s.counters


def test_tolist_counts_as_a_read_back(tmp_path):
    r = stepscope_here(tmp_path, script("item_every_step.py"), "--tolist", warmup=3, steps=15)
    assert r.returncode == 0, r.describe()
    s = r.summary
    check_consistent(s, r)
    assert counter(s, "item_calls") == pytest.approx(2, abs=0.01), s.counters


def test_item_inside_the_dataset_is_not_counted(item_run):
    # __getitem__ calls .item() 8 times per batch: that is data loading, not a read-back in the step.
    r = item_run
    assert r.returncode == 0, r.describe()
    s = r.summary
    check_consistent(s, r)
    assert counter(s, "item_calls") == pytest.approx(1, abs=0.01), s.counters


def test_loader_epoch_starts_are_data_loading_not_the_scripts_reads(item_run):
    # 4 batches per shuffled epoch: iter(loader) draws its seed with .item() at each of ~5 epoch starts. That is
    # the loader's work (data_wait), not a read-back of the training step.
    r = item_run
    assert r.returncode == 0, r.describe()
    s = r.summary
    check_consistent(s, r)
    assert counter(s, "item_calls") == pytest.approx(1, abs=0.01), s.counters
    assert len(s.epochs) >= 5
    assert all(e.start_stall_ms is not None and e.start_stall_ms > 0 for e in s.epochs if e.batches)


def test_module_mode(tmp_path):
    r = stepscope_run(tmp_path, "-m", "pkg.train", "--tag", "viamodule", cwd=SCRIPTS, warmup=3, steps=10)
    assert r.returncode == 0, r.describe()
    assert "pkg.train: __name__=__main__ __package__=pkg tag=viamodule argv=['--tag', 'viamodule']" in r.stdout, (
        r.describe()
    )
    s = r.summary
    check_consistent(s, r)
    assert s.steps.measured == 10
    assert s.exit.reason == "stopped"
    assert s.loaders[0].batch_size == 8


def test_module_mode_from_pythonpath(tmp_path):
    # pkg comes from tests/scripts on PYTHONPATH; the working directory is tmp_path.
    r = stepscope_run(tmp_path, "-m", "pkg.train", warmup=2, steps=4, pythonpath=(str(SCRIPTS),))
    assert r.returncode == 0, r.describe()
    assert r.summary.steps.measured == 4


# -- failures ----------------------------------------------------------------------------------------------------


def test_missing_script(tmp_path):
    missing = tmp_path / "no_such_script.py"
    r = stepscope_run(tmp_path, str(missing))
    assert r.returncode == 2, r.describe()
    assert "stepscope:" in r.stderr, r.describe()
    assert str(missing) in r.stderr or "no_such_script.py" in r.stderr, r.describe()
    assert "Traceback" not in r.stderr, r.describe()


def test_missing_module(tmp_path):
    r = stepscope_run(tmp_path, "-m", "no_such_pkg_xyz.train")
    assert r.returncode != 0, r.describe()
    assert "no_such_pkg_xyz" in r.stderr, r.describe()


def test_script_that_raises(tmp_path):
    r = stepscope_run(tmp_path, script("raises.py"), "--fail-at", "7", warmup=2, steps=20)
    assert r.returncode == 1, r.describe()
    assert "Traceback" in r.stderr, r.describe()
    assert "RuntimeError: boom at step 7" in r.stderr, r.describe()
    assert "raises.py" in r.stderr, r.describe()
    s = r.summary
    assert s.exit.reason == "error", r.describe()
    assert "RuntimeError" in (s.exit.error or ""), s.exit
    assert s.exit.code == 1, s.exit
    # Steps 3..7 closed before the error; the warm-up took 1 and 2.
    assert s.steps.warmup == 2
    assert s.steps.measured == 5, r.describe()
    check_consistent(s, r)


def test_script_that_never_steps(tmp_path):
    r = stepscope_here(tmp_path, script("no_step.py"), "--batches", "10", "--epochs", "2", warmup=3, steps=20)
    assert r.returncode == 0, r.describe()
    assert "no_step: 20 batches" in r.stdout, r.describe()
    s = r.summary
    assert s.steps.measured == 0, r.describe()
    assert s.exit.reason == "finished", r.describe()
    notes = " ".join(s.notes).lower()
    assert "no training step" in notes or "never" in notes, s.notes
    # The note names what was seen: the batches fetched and/or the forward passes.
    assert any(("batch" in n.lower() or "forward" in n.lower()) and re.search(r"\b20\b", n) for n in s.notes), s.notes
    # The warm-up was not the problem: no advice to lower it or to run more steps.
    assert not any("lower the warm-up" in n or "run more steps" in n for n in s.notes), s.notes
    assert s.loaders and s.loaders[0].batches == 20, s.loaders
    assert s.epochs and len(s.epochs) == 2 and all(e.complete for e in s.epochs), s.epochs


def _group_stacks(group: int) -> str:
    """``py-spy dump`` of every process in a process group (or why there is none): where a hang waits."""
    from stepscope.instrument.pyspy import PySpyError, find_pyspy

    pids = []
    for entry in Path("/proc").iterdir():
        with contextlib.suppress(OSError, ValueError):
            if entry.name.isdigit() and os.getpgid(int(entry.name)) == group:
                pids.append(entry.name)
    listing = ["ps", "-o", "pid=,stat=,args=", "-p", ",".join(pids) or "0"]
    listed = subprocess.run(listing, capture_output=True, text=True)
    try:
        pyspy = find_pyspy()
    except PySpyError as error:
        return f"{listed.stdout}(no stacks: {error})"
    dumps = [listed.stdout]
    for pid in pids:
        dump = subprocess.run([str(pyspy), "dump", "--pid", pid], capture_output=True, text=True, timeout=30)
        dumps.append(f"-- pid {pid}:\n{dump.stdout}{dump.stderr}")
    return "\n".join(dumps)


def _wait_for_ready(proc: subprocess.Popen, timeout: float) -> tuple[str | None, list[str]]:
    """Read proc.stdout in a thread until a READY line; return it and all lines read so far."""
    lines: list[str] = []
    ready: list[str] = []
    found = threading.Event()

    def reader() -> None:
        for line in proc.stdout:
            lines.append(line)
            if line.startswith("READY") and not found.is_set():
                ready.append(line.strip())
                found.set()
        found.set()

    thread = threading.Thread(target=reader, daemon=True)
    thread.start()
    found.wait(timeout)
    return (ready[0] if ready else None), lines


@pytest.mark.parametrize("target", ["stepscope", "child"])
def test_sigterm_still_writes_the_summary(tmp_path, target):
    json_path = tmp_path / "s.json"
    cmd = stepscope_cmd(json_path, script("sleepy_forever.py"), "--sleep-ms", "5", warmup=2, steps=100_000)
    proc = subprocess.Popen(cmd, cwd=tmp_path, env=run_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        ready, lines = _wait_for_ready(proc, timeout=60)
        assert ready is not None, f"no READY line; exit code {proc.poll()}, stdout {lines}"
        time.sleep(0.3)  # a few more steps
        pid = proc.pid if target == "stepscope" else int(ready.split()[1])
        os.kill(pid, signal.SIGTERM)
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    stderr = proc.stderr.read()
    assert json_path.exists(), f"no summary after SIGTERM to {target}; exit code {proc.returncode}\n{stderr}"
    s = RunSummary.from_json(json_path)
    assert s.exit.reason in ("terminated", "interrupted"), (s.exit, stderr)
    assert s.steps.measured >= 3, s.steps
    check_consistent(s)


def test_a_killed_script_keeps_its_steps_from_the_stream_over_its_last_checkpoint(tmp_path):
    # SIGKILL (the OOM killer) runs no exit handler: the step stream carries every step out, and the last checkpoint
    # (every 1 s here) what the stream does not hold.
    stdout, json_path = _sigkill_the_script(tmp_path, ["--checkpoint-s", "1"], after_s=2.5)  # a checkpoint or two
    s = RunSummary.from_json(json_path)
    assert s.exit.reason == "killed", s.exit
    assert s.exit.code == 137
    assert s.exit.error == f"killed by SIGKILL after step {s.steps.warmup + s.steps.measured}", s.exit
    assert s.steps.measured >= 10, s.steps  # ~5 ms steps for 2.5 s
    (note,) = [n for n in s.notes if n.startswith("from the step stream")]
    checkpointed = int(note.split("its last checkpoint had ")[1].split(")")[0])
    assert 0 < checkpointed < s.steps.measured, note  # the steps since the last checkpoint are kept too
    assert s.system is not None, "the checkpoint's host figures are kept"
    check_consistent(s)
    assert "the script was killed by SIGKILL after step" in stdout


def _sigkill_the_script(tmp_path, options: list[str], after_s: float) -> tuple[str, Path]:
    """Run sleepy_forever.py under `stepscope run OPTIONS`, SIGKILL the script ``after_s`` after its READY line;
    stepscope run's stdout and the summary's path (stepscope run must exit 137)."""
    json_path = tmp_path / "s.json"
    cmd = stepscope_cmd(json_path, script("sleepy_forever.py"), "--sleep-ms", "5", warmup=2, steps=100_000)
    cmd[cmd.index("run") + 1 : cmd.index("run") + 1] = options
    proc = subprocess.Popen(cmd, cwd=tmp_path, env=run_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        ready, lines = _wait_for_ready(proc, timeout=60)
        assert ready is not None, f"no READY line; exit code {proc.poll()}, stdout {lines}"
        time.sleep(after_s)
        os.kill(int(ready.split()[1]), signal.SIGKILL)
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    stderr = proc.stderr.read()
    time.sleep(0.2)  # the reader thread drains the rest of stdout
    assert proc.returncode == 128 + signal.SIGKILL, stderr
    return "".join(lines), json_path


def test_a_script_killed_before_its_first_checkpoint_is_killed_not_failed_and_keeps_its_steps(tmp_path):
    # SIGKILL a few steps in, long before the first checkpoint (30 s): the stream has every step closed by then.
    stdout, json_path = _sigkill_the_script(tmp_path, [], after_s=0.0)
    s = RunSummary.from_json(json_path)
    assert (s.exit.reason, s.exit.code) == ("killed", 137), s.exit
    assert s.exit.error == f"killed by SIGKILL after step {s.steps.warmup + s.steps.measured}", s.exit
    assert s.steps.warmup == 2 and s.steps.measured >= 1, s.steps  # READY comes after the 5th step
    assert any(n.endswith("host time only.") for n in s.notes), s.notes  # no checkpoint to add to it
    assert "the script was killed by SIGKILL after step" in stdout, stdout


def test_a_command_killed_before_any_step_says_no_figures_survived(tmp_path):
    # Killed while it imports: no step closed, so no stream and no checkpoint.
    json_path = tmp_path / "s.json"
    cmd = stepscope_cmd(json_path, script("sleepy_forever.py"), "--sleep-ms", "5", warmup=2, steps=100_000)
    proc = subprocess.Popen(cmd, cwd=tmp_path, env=run_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            children = psutil.Process(proc.pid).children()
            if children:
                children[0].send_signal(signal.SIGKILL)  # the script, as soon as it exists: long before its steps
                break
            time.sleep(0.01)
        stdout, _ = proc.communicate(timeout=60)
    finally:
        proc.kill()
    s = RunSummary.from_json(json_path)
    assert (s.exit.reason, s.exit.code) == ("killed", 137), s.exit
    assert s.exit.error.startswith("killed by signal 9 after ") and "no figures survived" in s.exit.error, s.exit
    assert s.steps.measured == 0 and not s.ranks, s.steps
    (note,) = [n for n in s.notes if "no figures survived" in n]
    assert "before any of its processes closed a training step" in note, note
    assert "the script was killed by signal 9 after" in stdout, stdout
    assert "before importing torch" not in stdout + "".join(s.notes), stdout


def test_a_checkpoint_write_is_not_charged_to_the_step(tmp_path):
    # In process, as `stepscope run` sets a tracker up, with a checkpoint after every step that takes a known 30 ms
    # (steps do ~5 ms of work). Same-run calibration: a hand timer between successive optimizer steps, less the
    # write inside each interval, is what stepscope's step time must read.
    from stepscope.instrument.hooks import install
    from stepscope.instrument.tracker import RunConfig, StopRun, Tracker
    from stepscope.scope import enabled_scope

    torch.set_num_threads(1)
    warmup, steps = 2, 10
    scope = enabled_scope(warmup=warmup, system_interval_s=None)
    tracker = Tracker(scope, RunConfig(out_dir=str(tmp_path), warmup=warmup, steps=steps, checkpoint_s=0.0))
    write_ns: list[int] = []

    def write() -> None:
        t0 = time.perf_counter_ns()
        time.sleep(0.03)
        write_ns.append(time.perf_counter_ns() - t0)

    tracker.on_checkpoint = write
    undo = install(tracker)
    model = torch.nn.Linear(8, 4)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    x = torch.randn(4, 8)
    ends: list[int] = []  # when each optimizer.step() returned (the checkpoint is written inside it)
    try:
        for _ in range(warmup + steps + 1):
            model(x).sum().backward()
            time.sleep(0.005)
            optimizer.step()
            ends.append(time.perf_counter_ns())
            optimizer.zero_grad()
    except StopRun:
        pass  # the step after the last measured one stops the run, before it begins
    finally:
        undo()
    summary = tracker.summary()
    assert summary.steps.measured == steps
    assert len(write_ns) == len(ends) == warmup + steps, (len(write_ns), len(ends))
    measured = range(warmup, warmup + steps)  # step i runs from ends[i - 1] to ends[i]
    hand_ms = sum(ends[i] - ends[i - 1] - write_ns[i] for i in measured) / steps / 1e6
    total_ms = summary.phases["total"].mean_ms
    assert hand_ms >= 5.0
    assert abs(total_ms - hand_ms) <= 0.1 * hand_ms + 1.0, (total_ms, hand_ms)  # charged, it would be ~30 ms more
    assert summary.phases["other"].mean_ms < 15.0, summary.phases["other"]  # the 5 ms sleep; charged, 35 ms


@pytest.mark.parametrize("value", ["0", "-5", "0.5", "nan", "inf", "soon"])
def test_checkpoint_period_must_be_a_finite_second_or_more(tmp_path, value):
    r = stepscope_run(tmp_path, "--checkpoint-s", value, script("sleepy_forever.py"), warmup=None, steps=None)
    assert r.returncode == 2, r.describe()
    line = r.stderr.strip().splitlines()[-1]
    assert "argument --checkpoint-s: must be a" in line and "number of seconds" in line, r.describe()
    assert not r.json_path.exists()


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_a_process_group_signal_keeps_the_summary(tmp_path, signum):
    # `timeout`, schedulers and CI cancellation signal the whole process group, and often again: stepscope run and
    # the script both get each signal, the script a second copy from stepscope. The script's exit handlers and
    # stepscope's report must outlive the repeats. The group is signalled three times, 50 ms apart (a scheduler's
    # repeated cancellation), then stepscope has a minute to report, however loaded the machine.
    json_path = tmp_path / "s.json"
    cmd = stepscope_cmd(json_path, script("sleepy_forever.py"), "--sleep-ms", "5", warmup=2, steps=100_000)
    proc = subprocess.Popen(
        cmd,
        cwd=tmp_path,
        env=run_env(),
        stdin=subprocess.DEVNULL,  # no terminal: stepscope passes SIGINT on, as under a job manager
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,  # its own process group, led by stepscope run (what `set -m` gives a shell job)
        preexec_fn=terminal_signals,
    )
    signals = 0
    try:
        ready, lines = _wait_for_ready(proc, timeout=60)
        assert ready is not None, f"no READY line; exit code {proc.poll()}, stdout {lines}"
        time.sleep(0.3)  # a few more steps
        for _ in range(3):
            if proc.poll() is not None:
                break
            with contextlib.suppress(ProcessLookupError):  # the group is gone once stepscope has exited
                os.killpg(proc.pid, signum)
                signals += 1
            time.sleep(0.05)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            where = _group_stacks(proc.pid)  # what each process of the group waits on, for the next look
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            pytest.fail(
                f"stepscope run did not exit 60 s after {signals} group signals; its processes' stacks:\n{where}\n"
                f"stderr:\n{proc.stderr.read()[-4000:]}"
            )
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    stderr = proc.stderr.read()
    time.sleep(0.2)  # the reader thread drains the rest of stdout
    stdout = "".join(lines)
    assert signals >= 2, signals
    assert proc.returncode == 128 + signum, (proc.returncode, stderr)
    assert json_path.exists(), f"no summary after {signals} group signals\n{stdout}\n{stderr}"
    s = RunSummary.from_json(json_path)
    reason = "terminated" if signum == signal.SIGTERM else "interrupted"
    assert (s.exit.reason, s.exit.code) == (reason, 128 + signum), f"{s.exit}\n{stderr}"
    assert s.steps.measured >= 3, s.steps
    check_consistent(s)
    assert "no process of the command reported a summary" not in stdout, stdout
    if signum == signal.SIGTERM:  # repeats of SIGTERM are ignored once the script is exiting: no traceback at all
        assert "Exception ignored" not in stderr and "Traceback" not in stderr, stderr


def test_a_script_that_catches_ctrl_c_gets_the_next_one_as_python_gives_it(tmp_path):
    # The child ignores a SIGINT that repeats the last one (no step between, within 2 s): a copy of the same request.
    # A script that catches the interrupt and trains on must still get the next Ctrl-C.
    json_path = tmp_path / "s.json"
    cmd = stepscope_cmd(json_path, script("catches_interrupt.py"), warmup=2, steps=100_000)
    proc = subprocess.Popen(
        cmd, cwd=tmp_path, env=run_env(), stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        text=True, start_new_session=True, preexec_fn=terminal_signals,
    )  # fmt: skip
    lines: queue.Queue[str] = queue.Queue()
    threading.Thread(target=lambda: [lines.put(line.strip()) for line in proc.stdout], daemon=True).start()

    def wait_for(prefix: str) -> str:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            with contextlib.suppress(queue.Empty):
                line = lines.get(timeout=1)
                if line.startswith(prefix):
                    return line
        pytest.fail(f"no {prefix} line; exit code {proc.poll()}")

    try:
        pid = int(wait_for("READY").split()[1])
        os.kill(pid, signal.SIGINT)
        wait_for("CAUGHT")
        wait_for("AGAIN")  # steps went on after the catch
        os.kill(pid, signal.SIGINT)
        proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    stderr = proc.stderr.read()
    assert proc.returncode == 130, (proc.returncode, stderr)
    s = RunSummary.from_json(json_path)
    assert (s.exit.reason, s.exit.code) == ("interrupted", 130), f"{s.exit}\n{stderr}"


def test_started_with_sigint_ignored_neither_stepscope_nor_the_script_reacts_to_it(tmp_path):
    # A background job of a script (nohup, `cmd &` without job control) starts with SIGINT ignored, and so does the
    # script it runs: a group SIGINT must not stop the run (the script alone would not stop); SIGTERM still does.
    json_path = tmp_path / "s.json"
    cmd = stepscope_cmd(json_path, script("sleepy_forever.py"), "--sleep-ms", "5", warmup=2, steps=100_000)
    proc = subprocess.Popen(
        cmd, cwd=tmp_path, env=run_env(), stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        text=True, start_new_session=True, preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN),
    )  # fmt: skip
    try:
        ready, lines = _wait_for_ready(proc, timeout=60)
        assert ready is not None, f"no READY line; exit code {proc.poll()}, stdout {lines}"
        for _ in range(3):
            os.killpg(proc.pid, signal.SIGINT)
            time.sleep(0.05)
        time.sleep(1.0)
        assert proc.poll() is None, (proc.returncode, proc.stderr.read())
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert proc.returncode == 128 + signal.SIGTERM, (proc.returncode, proc.stderr.read())
    assert RunSummary.from_json(json_path).exit.reason == "terminated"


# -- several ranks -----------------------------------------------------------------------------------------------


def test_torchrun_two_ranks_with_a_straggler(tmp_path):
    launcher = [
        *torchrun(),
        script("ddp.py"),
        "--sample-ms",
        "0.5",
        "--extra-ms",
        "1.25",
    ]
    r = stepscope_run(tmp_path, "--", *launcher, warmup=3, steps=20, timeout=180)
    assert r.returncode == 0, r.describe()
    s = r.summary
    assert len(s.ranks) == 2, r.describe()
    by_rank = {rank.meta.rank: rank for rank in s.ranks}
    assert set(by_rank) == {0, 1}, r.describe()
    for rank in s.ranks:
        check_consistent(rank, r)
        assert rank.meta.world_size == 2
        assert rank.steps.measured == 20, rank.steps
        assert rank.steps.boundary == "optimizer.step"
        assert rank.exit is not None and rank.exit.reason == "stopped", rank.exit
        assert rank.loaders and rank.loaders[0].batch_size == 8
        assert rank.throughput.samples_per_s is not None

    cluster = s.cluster
    assert cluster is not None, r.describe()
    assert cluster.world_size == 2
    assert sorted(cluster.ranks_reported) == [0, 1]
    assert cluster.samples_per_s == pytest.approx(sum(rank.throughput.samples_per_s for rank in s.ranks), rel=0.05)
    data = cluster.phases["data_wait"]
    assert data["min_ms"] <= data["mean_ms"] <= data["max_ms"], data
    assert data["max_ms"] == pytest.approx(by_rank[1].phases["data_wait"].mean_ms, rel=0.01), data
    assert data["min_ms"] == pytest.approx(by_rank[0].phases["data_wait"].mean_ms, rel=0.01), data
    for name, stats in cluster.phases.items():
        assert stats["min_ms"] <= stats["mean_ms"] <= stats["max_ms"], (name, stats)
    # Rank 1 sleeps 8 x 1.25 = 10 ms more per batch than rank 0.
    assert by_rank[1].phases["data_wait"].mean_ms > by_rank[0].phases["data_wait"].mean_ms + 5
    straggler = cluster.straggler
    assert straggler is not None, r.describe()
    assert straggler.rank == 1, straggler
    assert straggler.phase == "data_wait", straggler
    assert straggler.excess_ms > 3, straggler
    assert re.search(r"^\s*bound:", r.stdout, re.MULTILINE), r.describe()


def test_a_scripts_own_scope_is_named_in_a_note_with_its_phases(tmp_path):
    # Under `stepscope run` a script's own Scope keeps timing in its own summary(); the run's figures come from
    # torch's hooks. Before, its phase("myphase") and step(batch_size=8) vanished from the output with no word.
    path = tmp_path / "own_scope.py"
    path.write_text(
        "import torch\n"
        "from stepscope import Scope\n"
        "scope = Scope(warmup=2)\n"
        "model = torch.nn.Linear(8, 1)\n"
        "opt = torch.optim.SGD(model.parameters(), lr=0.1)\n"
        "for _ in range(12):\n"
        "    with scope.phase('myphase'):\n"
        "        loss = model(torch.randn(8, 8)).pow(2).mean()\n"
        "    loss.backward()\n"
        "    opt.step()\n"
        "    opt.zero_grad()\n"
        "    scope.step(batch_size=8)\n"
    )
    r = stepscope_here(tmp_path, str(path), warmup=2, steps=5)
    assert r.returncode == 0, r.describe()
    (note,) = [n for n in r.summary.notes if "the script's own Scope" in n]
    assert "'myphase'" in note and "stay in that Scope's summary()" in note, note
    assert "myphase" not in r.summary.phases, "the run's figures are its own"
    assert "the script's own Scope timed phase(s) 'myphase'" in r.stdout


def test_a_batch_of_a_dataclass_of_its_own_gives_samples_per_s(tmp_path):
    # `@dataclass class Batch` from a collate_fn (a batch class of the script's own, as many codebases have): its
    # tensors are the batch's, so the first one's first dimension is the samples, as for a tuple or a dict.
    import dataclasses

    from torch.utils.data import DataLoader, TensorDataset

    @dataclasses.dataclass
    class Batch:
        name: str
        images: torch.Tensor
        labels: torch.Tensor

    def collate(rows):
        return Batch("train", torch.stack([r[0] for r in rows]), torch.stack([r[1] for r in rows]))

    steps = 8
    with hooked(tmp_path, warmup=2, steps=steps) as tracker:
        loader = DataLoader(TensorDataset(torch.randn(96, 8), torch.randn(96, 4)), batch_size=6, collate_fn=collate)
        model = torch.nn.Linear(8, 4)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
        for batch in loader:
            torch.nn.functional.mse_loss(model(batch.images), batch.labels).backward()
            optimizer.step()
            optimizer.zero_grad()
    s = tracker.summary()
    assert s.steps.measured == steps
    assert s.throughput.samples_per_s == pytest.approx(6 * s.throughput.steps_per_s, rel=1e-6), s.throughput
