"""``stepscope run --apply FIX[=VALUE]``: fixes parsed up front, injected into an unmodified script, recorded.

The end-to-end tests run a small script twice, without and with ``--apply``, and read what the script itself saw
(which process produced each sample, its optimizer's defaults, whether anomaly mode was on inside the step): the
first run shows that the script left alone does the opposite, so each assertion can fail."""

from __future__ import annotations

import json
import re
import textwrap
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from run_helpers import stepscope_here, stepscope_run, torchrun

from stepscope import cli
from stepscope.analyses.loader import MAX_WORKERS
from stepscope.instrument.apply import APPLIABLE, ApplyError, Injector, parse_fixes, worker_limit
from stepscope.instrument.hooks import patcher

TRAIN = """
import json, os, sys, time
import torch
from torch.utils.data import DataLoader, Dataset

class Sleepy(Dataset):
    def __len__(self):
        return 64

    def __getitem__(self, i):
        time.sleep(0.001)
        return torch.full((4,), float(os.getpid())), torch.zeros(1)

torch.autograd.set_detect_anomaly(True)
model = torch.nn.Linear(4, 1)
opt = torch.optim.SGD(model.parameters(), lr=0.0, foreach=False)
loader = DataLoader(Sleepy(), batch_size=8, num_workers=0)
pids, anomaly = set(), set()
for epoch in range(2):
    for x, y in loader:
        pids.update(int(p) for p in x[:, 0].tolist())
        with torch.autograd.detect_anomaly():
            loss = torch.nn.functional.mse_loss(model(x), y)
            anomaly.add(torch.is_anomaly_enabled())
            loss.backward()
        opt.step()
        opt.zero_grad()
print(json.dumps({"foreach": opt.defaults["foreach"], "workers": loader.num_workers,
                  "worker_pids": len(pids - {os.getpid()}), "anomaly": sorted(anomaly)}))
"""


def _script(tmp_path: Path, name: str, source: str) -> Path:
    path = tmp_path / name
    path.write_text(textwrap.dedent(source))
    return path


def _seen(stdout: str) -> dict[str, Any]:
    """The script's own JSON line: what it saw from inside."""
    line = next(line for line in stdout.splitlines() if line.startswith("{"))
    return json.loads(line)


# -- parsing -------------------------------------------------------------------------------------------------------


def test_parse_fixes_defaults_aliases_and_values() -> None:
    fixes = parse_fixes(
        ["loader.num_workers=2", "optimizer.foreach", "debug.anomaly", "loader.prefetch_factor=3", "autocast.bf16",
         "matmul.precision=high", "loader.pin_memory=off"]
    )  # fmt: skip
    assert fixes == [
        {"id": "loader.num_workers", "value": 2},
        {"id": "optimizer.foreach", "value": True},
        {"id": "debug.anomaly", "value": False},  # a bare debug fix turns the debug mode off: the fix's direction
        {"id": "loader.prefetch", "value": 3},
        {"id": "precision.bf16", "value": True},
        {"id": "tf32", "value": "high"},
        {"id": "loader.pin_memory", "value": False},
    ]
    assert parse_fixes(["torch.tf32"]) == [{"id": "tf32", "value": "high"}]
    assert parse_fixes(["tf32=off"]) == [{"id": "tf32", "value": "highest"}]
    assert parse_fixes(["malloc.allocator"]) == [{"id": "malloc.allocator", "value": "jemalloc"}]
    assert parse_fixes(["malloc.allocator=TCMalloc"]) == [{"id": "malloc.allocator", "value": "tcmalloc"}]


@pytest.mark.parametrize(
    ("words", "said"),
    [
        (["loader.workers=2"], "not a fix stepscope can apply; appliable: loader.num_workers"),
        (["loader.num_workers"], "needs a value"),
        (["loader.num_workers=-1"], "takes a whole number in digits 0-9, from 0 to"),
        (["loader.num_workers=²"], "'²' is not one"),  # str.isdigit() says yes, int() raises
        (["loader.num_workers=١"], "'١' is not one"),  # Arabic-Indic one: int() reads 1
        (["loader.num_workers=+2"], "'+2' is not one"),
        (["loader.num_workers=100000"], "100000 is out of range"),
        (["loader.num_workers=" + "9" * 5000], "out of range"),  # past int()'s digit limit: no traceback
        (["loader.prefetch=0"], "from 1 to 64; 0 is out of range"),
        (["loader.prefetch=65"], "from 1 to 64; 65 is out of range"),
        (["optimizer.foreach=maybe"], "takes on or off"),
        (["tf32=fast"], "takes highest, high, medium"),
        (["optimizer.foreach", "optimizer.foreach=off"], "more than once"),
        (["optimizer.fused", "optimizer.foreach"], "exclude each other"),
        (["malloc.allocator=mimalloc"], "malloc.allocator takes jemalloc or tcmalloc, not 'mimalloc'"),
        (["malloc.allocator", "malloc.mmap_threshold"], "exclude each other (glibc's thresholds do nothing"),
    ],
)
def test_parse_fixes_refuses_with_the_reason(words: list[str], said: str) -> None:
    with pytest.raises(ApplyError, match=None) as error:
        parse_fixes(words)
    assert said in str(error.value)


def test_worker_count_bound_is_four_per_usable_core_and_stated(monkeypatch: pytest.MonkeyPatch) -> None:
    import stepscope.collectors.host as host

    monkeypatch.setattr(host, "cgroup_cpu_quota", lambda: None)
    monkeypatch.setattr(host, "usable_cores", lambda: 10)
    assert parse_fixes(["loader.num_workers=40"]) == [{"id": "loader.num_workers", "value": 40}]
    with pytest.raises(ApplyError) as error:
        parse_fixes(["loader.num_workers=41"])
    assert str(error.value) == (
        "--apply loader.num_workers=41: loader.num_workers takes a whole number in digits 0-9, from 0 to 40 "
        "(4 per usable core, at least 32; 10 core(s) here); 41 is out of range."
    )
    monkeypatch.setattr(host, "cgroup_cpu_quota", lambda: 9.5)  # a cgroup quota of 9.5 cores: 10 cores' worth
    assert worker_limit()[0] == 40
    # A small machine still takes as many workers as the loader sweep may measure best for a loader that waits
    # (they use no core): its best must be one --verify can apply.
    monkeypatch.setattr(host, "cgroup_cpu_quota", lambda: None)
    monkeypatch.setattr(host, "usable_cores", lambda: 1)
    assert worker_limit() == (MAX_WORKERS, "4 per usable core, at least 32; 1 core(s) here")
    assert parse_fixes([f"loader.num_workers={MAX_WORKERS}"]) == [{"id": "loader.num_workers", "value": MAX_WORKERS}]


def test_worker_count_bound_follows_the_open_file_limit(monkeypatch: pytest.MonkeyPatch) -> None:
    import resource

    import stepscope.collectors.host as host

    monkeypatch.setattr(host, "cgroup_cpu_quota", lambda: None)
    monkeypatch.setattr(host, "usable_cores", lambda: 64)
    monkeypatch.setattr(resource, "getrlimit", lambda which: (256, 4096))
    limit, why = worker_limit()
    assert limit == (256 - 64) // 8 == 24
    assert why == "the open-file limit here, 256 (`ulimit -n`), allows about 8 files per worker"


def test_verify_skips_a_fix_whose_value_this_machine_refuses_with_the_reason() -> None:
    from stepscope.instrument.verify import plan
    from stepscope.summary import Fix

    limit, why = worker_limit()
    fixes = [
        Fix("loader.num_workers", "t", "w", [], "h", "config", 0.5, apply=f"loader.num_workers={limit + 1}"),
        Fix("optimizer.foreach", "t", "w", [], "h", "config", 0.1),
    ]
    chosen = plan(fixes, top=2, allow_numerics=False)
    assert [arg for _, arg in chosen.chosen] == ["optimizer.foreach"]
    (skipped,) = chosen.skipped
    assert skipped.startswith("loader.num_workers is not verified: --apply loader.num_workers=") and why in skipped


def test_unknown_error_lists_every_appliable_id() -> None:
    with pytest.raises(ApplyError) as error:
        parse_fixes(["nope"])
    assert all(fix_id in str(error.value) for fix_id in APPLIABLE)


# -- injection in-process (real torch; the patches come off again) -------------------------------------------------


@pytest.fixture
def injected() -> Iterator[Callable[[list[str]], Injector]]:
    """Install an Injector for the given --apply words with hooks.py's kind of removable patch; removed after."""
    undo: list[Callable[[], None]] = []
    patch = patcher(undo)

    def install(words: list[str]) -> Injector:
        injector = Injector(parse_fixes(words))
        injector.install(patch)
        return injector

    benchmark = torch.backends.cudnn.benchmark
    yield install
    while undo:
        undo.pop()()
    torch.backends.cudnn.benchmark = benchmark


def test_loader_settings_that_need_workers_are_refused_and_the_loader_stays_valid(injected: Any) -> None:
    injector = injected(["loader.prefetch=4", "loader.persistent_workers"])
    loader = torch.utils.data.DataLoader(list(range(8)), batch_size=4)  # torch would refuse prefetch without workers
    assert loader.num_workers == 0 and loader.prefetch_factor is None and not loader.persistent_workers
    results = {r["id"]: r for r in injector.results()}
    for fix_id in ("loader.prefetch", "loader.persistent_workers"):
        assert results[fix_id]["applied"] is False
        assert "DataLoader #0 (test_apply.py:" in results[fix_id]["why"]
        assert "num_workers=0" in results[fix_id]["why"]


def test_iterable_dataset_keeps_its_workers(injected: Any) -> None:
    class Stream(torch.utils.data.IterableDataset):
        def __iter__(self) -> Iterator[int]:
            return iter(range(8))

    injector = injected(["loader.num_workers=2"])
    loader = torch.utils.data.DataLoader(Stream(), batch_size=4)
    assert loader.num_workers == 0  # workers would each yield the whole stream: duplicated data
    (result,) = injector.results()
    assert result["applied"] is False and "IterableDataset" in result["why"]


def test_optimizer_fused_and_foreach_at_construction(injected: Any) -> None:
    params = [torch.nn.Parameter(torch.zeros(3)) for _ in range(3)]
    injector = injected(["optimizer.fused"])
    adamw = torch.optim.AdamW((p for p in params), foreach=True)  # a generator: read once, still all the params
    assert adamw.defaults["fused"] is True and not adamw.defaults["foreach"]
    assert len(adamw.param_groups[0]["params"]) == 3
    ints = torch.optim.SGD([torch.zeros(2, dtype=torch.int64)], lr=0.1)  # fused kernels take floating point only
    assert not ints.defaults["fused"]
    (result,) = injector.results()
    # AdamW's constructor runs Adam's: one optimizer, recorded once
    assert result["applied"] is True and result["where"].startswith("AdamW #0 (test_apply.py:"), result
    assert "SGD #1" in result["why"] and "int64" in result["why"], result


def test_bf16_autocast_wraps_the_outermost_module_call(injected: Any) -> None:
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU(), torch.nn.Linear(4, 2))
    assert model(torch.randn(2, 4)).dtype == torch.float32
    injector = injected(["autocast.bf16"])
    assert model(torch.randn(2, 4)).dtype == torch.bfloat16
    assert not torch.is_autocast_enabled("cpu")  # only inside the call
    (result,) = injector.results()
    assert result["where"].startswith("Sequential on cpu (test_apply.py:"), result


def test_guarded_flag_ignores_the_script_setting_it_back(injected: Any) -> None:
    torch.backends.cudnn.benchmark = False
    injector = injected(["cudnn.benchmark"])
    assert torch.backends.cudnn.benchmark is True
    torch.backends.cudnn.benchmark = False  # what a script's own setting does later
    assert torch.backends.cudnn.benchmark is True
    (result,) = injector.results()
    assert result["applied"] is True
    assert result["ignored"] and result["ignored"][0].startswith("cudnn.benchmark=False at test_apply.py:")


def test_host_threads_sets_the_intra_op_threads_and_guards_them(injected: Any) -> None:
    threads = torch.get_num_threads()
    try:
        injector = injected(["host.threads=1"])
        assert torch.get_num_threads() == 1
        torch.set_num_threads(3)  # the script's own count, later: ignored, recorded
        assert torch.get_num_threads() == 1
        (result,) = injector.results()
        assert result["applied"] is True and result["where"] == "1 intra-op thread(s) from torch's import on"
        assert result["ignored"][0].startswith("set_num_threads(3) at test_apply.py:"), result
    finally:
        torch.set_num_threads(threads)


# -- end to end: `stepscope run --apply` on an unmodified script ---------------------------------------------------


def test_apply_workers_foreach_and_anomaly_off(tmp_path: Path) -> None:
    train = _script(tmp_path, "train.py", TRAIN)
    plain = stepscope_here(tmp_path / "plain", "--no-stop", str(train), warmup=1, steps=4)
    assert plain.returncode == 0, plain.describe()
    as_written = _seen(plain.stdout)
    assert as_written == {"foreach": False, "workers": 0, "worker_pids": 0, "anomaly": [True]}, plain.describe()
    assert plain.summary.applied == []

    fixed = stepscope_here(
        tmp_path / "fixed", "--no-stop", "--apply", "loader.num_workers=2", "--apply", "optimizer.foreach",
        "--apply", "debug.anomaly=off", str(train), warmup=1, steps=4,
    )  # fmt: skip
    assert fixed.returncode == 0, fixed.describe()
    seen = _seen(fixed.stdout)
    assert seen["workers"] == 2 and seen["worker_pids"] >= 1, seen  # samples came from worker processes
    assert seen["foreach"] is True and seen["anomaly"] == [False], seen
    summary = fixed.summary
    assert [loader.num_workers for loader in summary.loaders] == [2]
    applied = {entry["id"]: entry for entry in summary.applied}
    assert applied["loader.num_workers"] == {
        "id": "loader.num_workers", "value": 2, "applied": True, "where": "DataLoader #0 (train.py:17)", "why": None
    }  # fmt: skip
    assert applied["optimizer.foreach"]["where"] == "SGD #0 (train.py:16)"
    anomaly = applied["debug.anomaly"]
    assert anomaly["applied"] is True
    # the script's set_detect_anomaly(True) at line 14, and its detect_anomaly() at each step, were ignored
    assert anomaly["ignored"][0] == "anomaly detection turned on at train.py:14", anomaly
    assert any(i.startswith("anomaly detection turned on at train.py:22") for i in anomaly["ignored"]), anomaly
    assert "applied: loader.num_workers=2 (DataLoader #0 (train.py:17))" in fixed.stdout, fixed.describe()


def test_unknown_fix_is_a_usage_error_before_the_script_runs(tmp_path: Path) -> None:
    marker = tmp_path / "ran"
    train = _script(tmp_path, "train.py", f"open({str(marker)!r}, 'w').close()\n")
    result = stepscope_here(tmp_path, "--apply", "loader.workers=2", str(train))
    assert result.returncode == 2, result.describe()
    assert "'loader.workers' is not a fix stepscope can apply; appliable: loader.num_workers" in result.stderr
    assert not marker.exists()


# The command's own entry point, in this process, as the test above runs it: the values here take the same path as
# its refused --apply.
@pytest.mark.parametrize("value", ["100000", "²", "١", "LIMIT+1"])
def test_a_worker_count_out_of_bounds_is_a_usage_error_before_the_script_runs(
    tmp_path: Path, value: str, capsys: pytest.CaptureFixture[str]
) -> None:
    limit, why = worker_limit()
    value = str(limit + 1) if value == "LIMIT+1" else value
    marker = tmp_path / "ran"
    train = _script(tmp_path, "train.py", f"open({str(marker)!r}, 'w').close()\n")
    code = cli.main(["run", "--json", str(tmp_path / "s.json"), "--apply", f"loader.num_workers={value}", str(train)])
    err = capsys.readouterr().err
    assert code == 2, err
    (line,) = err.splitlines()  # one sentence, no traceback
    assert line.startswith(f"stepscope: --apply loader.num_workers={value}: ") and f"from 0 to {limit} ({why})" in line
    assert not marker.exists()


def test_fix_without_a_chance_is_recorded_and_the_script_is_unchanged(tmp_path: Path) -> None:
    train = _script(
        tmp_path,
        "train.py",
        """
        import sys
        import torch
        model = torch.nn.Linear(3, 1)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        for step in range(6):
            loss = model(torch.ones(2, 3)).sum()
            loss.backward()
            opt.step()
            opt.zero_grad()
            print(f"step {step}")
        print("bye", file=sys.stderr)
        sys.exit(3)
        """,
    )
    # What the script prints on its own (its source above fixes it: no run without stepscope is needed to learn it).
    plain_stdout, plain_stderr = "".join(f"step {step}\n" for step in range(6)), "bye\n"
    result = stepscope_here(tmp_path, "--no-stop", "--apply", "loader.num_workers=2", str(train), warmup=1, steps=2)
    assert result.returncode == 3, result.describe()
    assert result.stdout.startswith(plain_stdout), result.describe()  # the script's lines first, then the report
    assert result.stderr.startswith(plain_stderr), result.describe()
    (entry,) = result.summary.applied
    assert entry == {
        "id": "loader.num_workers",
        "value": 2,
        "applied": False,
        "where": None,
        "why": "the script built no DataLoader after importing torch",
    }
    assert "applied: loader.num_workers=2 NOT applied (the script built no DataLoader" in result.stdout


def test_ddp_arguments_applied_on_every_rank_and_recorded_once(tmp_path: Path) -> None:
    train = _script(
        tmp_path,
        "ddp.py",
        """
        import json
        import torch, torch.distributed as dist
        from torch.nn.parallel import DistributedDataParallel
        dist.init_process_group("gloo")
        model = DistributedDataParallel(torch.nn.Linear(4, 1), find_unused_parameters=True)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        for _ in range(6):
            model(torch.randn(2, 4)).sum().backward()
            opt.step()
            opt.zero_grad()
        print(json.dumps({"rank": dist.get_rank(), "bucket_view": model.gradient_as_bucket_view,
                          "find_unused": model.find_unused_parameters}))
        dist.destroy_process_group()
        """,
    )
    result = stepscope_run(
        tmp_path, "--no-stop", "--apply", "ddp.gradient_as_bucket_view", "--apply", "ddp.find_unused_parameters=off",
        "--", *torchrun(2), str(train), warmup=1, steps=2,
    )  # fmt: skip
    assert result.returncode == 0, result.describe()
    # The two ranks print to one stdout at once: a line may hold both objects (print writes text, then newline).
    seen = [json.loads(found) for found in re.findall(r'\{"rank": [^{}]*\}', result.stdout)]
    assert sorted(s["rank"] for s in seen) == [0, 1], result.describe()
    assert all(s["bucket_view"] is True and s["find_unused"] is False for s in seen), seen
    summary = result.summary
    assert len(summary.ranks) == 2
    where = "DistributedDataParallel(Linear) (ddp.py:6)"
    assert [(e["id"], e["applied"], e["where"]) for e in summary.applied] == [
        ("ddp.gradient_as_bucket_view", True, where),
        ("ddp.find_unused_parameters", True, where),
    ]
    assert "applied without proof" in summary.applied[1]["note"]
