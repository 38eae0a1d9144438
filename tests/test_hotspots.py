"""The stack sampler and the hotspots it feeds: frame walking on real frames, phase attribution, the memory
bound, the summary table, the reports, and `stepscope doctor` naming the line a checkpoint or a log costs."""

from __future__ import annotations

import sys
import threading
import time
from pathlib import Path

import pytest
import torch
from run_helpers import script, stepscope_here, stepscope_run

from stepscope import Scope
from stepscope.collectors import stacks
from stepscope.collectors.stacks import CodeKinds, StackSampler, frame_site, hotspots, slowdown
from stepscope.instrument.merge import merge
from stepscope.report import html_sections
from stepscope.report.terminal import hotspot_lines
from stepscope.summary import Meta, PhaseStats, RunSummary, Steps

HERE = str(Path(__file__).resolve())


def _park(ready: threading.Event, release: threading.Event) -> None:
    ready.set()
    release.wait()  # the line the frame walk must name: threading.Event.wait called here


def test_frame_site_names_the_user_line_and_the_library_function_it_called():
    ready, release = threading.Event(), threading.Event()
    thread = threading.Thread(target=_park, args=(ready, release), daemon=True)
    thread.start()
    ready.wait()
    time.sleep(0.05)
    try:
        site = frame_site(sys._current_frames()[thread.ident], CodeKinds())
    finally:
        release.set()
        thread.join()
    file, line, function, calls, in_loader = site
    assert (file, function, calls, in_loader) == (HERE, "_park", "threading.Event.wait", False)
    assert "release.wait()" in Path(HERE).read_text().splitlines()[line - 1]


class _Recorded(torch.utils.data.Dataset):
    def __init__(self) -> None:
        self.sites: list[tuple] = []

    def __len__(self) -> int:
        return 4

    def __getitem__(self, index: int) -> torch.Tensor:
        self.sites.append(frame_site(sys._getframe(), CodeKinds()))
        return torch.zeros(2)


def test_frame_site_knows_code_the_dataloader_ran():
    dataset = _Recorded()
    for _ in torch.utils.data.DataLoader(dataset, batch_size=2):
        pass
    assert dataset.sites and all(s[2] == "_Recorded.__getitem__" and s[4] for s in dataset.sites)
    # Library code all the way up (this file counted as a library): no user line to name.
    assert frame_site(sys._getframe(), CodeKinds(roots=("/",))) is None


def test_sampler_keeps_at_most_max_sites_and_counts_the_rest():
    sampler = StackSampler(threading.get_ident(), lambda frame: "other", rate_hz=100, max_sites=3)
    for _ in range(2):
        sampler.sample()  # each call is its own line of this file: five distinct sites, sampled twice
        sampler.sample()
        sampler.sample()
        sampler.sample()
        sampler.sample()
    assert len(sampler.sites) == 3
    assert sum(sampler.sites.values()) == 6 and sampler.unnamed == {"other": 4}
    assert sampler.samples == 10 and sampler.phase_samples == {"other": 10}
    forward = StackSampler(threading.get_ident(), lambda frame: "forward")
    forward.sample()
    assert forward.phase_samples == {"forward": 1} and forward.sites == {}  # forward's lines are not attributed


def test_a_slowed_sampler_counts_each_sample_as_the_samples_it_skips():
    sampler = StackSampler(threading.get_ident(), lambda frame: "other", rate_hz=100)
    assert (slowdown(100), slowdown(250), slowdown(20), slowdown(5)) == (5, 12, 1, 1)
    sampler.sample()
    sampler.weight = slowdown(100)
    sampler.sample()  # the same line as the one above, a line later: two sites
    sampler.sample()
    assert sorted(sampler.sites.values()) == [1, 5, 5] and sorted(sampler.observed.values()) == [1, 1, 1]
    assert sampler.samples == 3 and sampler.phase_samples == {"other": 11}
    out = hotspots(sampler.table(), {"other": _stats(1.0), "total": _stats(1.0)})
    rows = out["phases"]["other"]
    # shares of the weighted counts (time), samples as taken (what a rule's trust rests on)
    assert sorted((r["share"], r["samples"]) for r in rows) == [(round(1 / 11, 4), 1), (round(5 / 11, 4), 1),
                                                                  (round(5 / 11, 4), 1)]  # fmt: skip


def _alternate(stop: threading.Event) -> None:
    while not stop.is_set():
        time.sleep(0.007)  # 70% of the time here
        time.sleep(0.003)  # 30% here


def test_the_sampler_slows_down_after_its_full_rate_window_and_still_measures_time(monkeypatch):
    # A thread sleeps 7 ms on one line and 3 ms on the next, over and over. Sampled at 100 Hz for 0.3 s, then at
    # 20 Hz with each sample counting 5: fewer samples taken, the same shares of the time.
    monkeypatch.setattr(stacks, "FULL_RATE_S", 0.3)
    stop = threading.Event()
    thread = threading.Thread(target=_alternate, args=(stop,), daemon=True)
    thread.start()
    sampler = StackSampler(thread.ident, lambda frame: "other", rate_hz=100, kinds=CodeKinds(roots=()))
    sampler.start()
    time.sleep(2.3)
    sampler.stop()
    stop.set()
    thread.join()
    table = sampler.table()
    assert sampler.weight == 5
    # 0.3 s at 100 Hz, 2 s at 20 Hz: ~70 samples (a loaded machine's late wakes give fewer), not the ~230 of 100 Hz
    assert 20 <= table["samples"] <= 110, table["samples"]
    assert sum(table["sites"].values()) > 2 * sum(table["observed"].values())
    first = min(line for (_, _, line, *_) in table["sites"])
    seven = sum(n for (_, _, line, *_), n in table["sites"].items() if line == first)
    assert 0.5 <= seven / sum(table["sites"].values()) <= 0.9, table["sites"]


def _stats(share: float, step_ms: float = 100.0) -> PhaseStats:
    return PhaseStats(share * step_ms, share * step_ms, share * step_ms, share, 10)


def test_hotspots_groups_lines_keeps_the_top_ones_and_prices_them():
    sites = {
        ("other", HERE, 10, "main", "torch.serialization.save", False): 70,
        ("other", HERE, 10, "main", "torch.nn.modules.module.Module.state_dict", False): 10,  # same line
        ("other", HERE, 20, "main", None, False): 19,
        ("other", HERE, 30, "main", None, False): 1,  # 1%: noise
        ("sync", HERE, 40, "main", "torch._tensor.Tensor.item", False): 5,
    }
    table = {"rate_hz": 100.0, "samples": 130, "phase_samples": {"other": 100, "sync": 5, "forward": 25}}
    out = hotspots({**table, "unnamed": {}, "sites": sites}, {"other": _stats(0.6), "total": _stats(1.0)})
    other = out["phases"]["other"]
    assert [(r["line"], r["calls"], r["samples"]) for r in other] == [
        (10, "torch.serialization.save", 80),
        (20, None, 19),
    ]
    assert other[0]["share"] == 0.8 and other[0]["ms_per_step"] == pytest.approx(0.8 * 60.0)
    assert other[0]["file"] == "tests/test_hotspots.py" or other[0]["file"] == HERE
    assert out["phases"]["sync"][0]["ms_per_step"] == 0.0  # no sync statistics: no time to give it
    assert (out["rate_hz"], out["samples"], out["phase_samples"]["forward"]) == (100.0, 130, 25)
    assert hotspots({}, {}) == {}


def _sleep_in_fetch(n: int, seconds: float):
    for _ in range(n):
        time.sleep(seconds)  # data_wait's line
        yield torch.zeros(1)


def save_checkpoint(seconds: float) -> None:
    time.sleep(seconds)  # other's line


def test_scope_phase_at_reads_open_phases_and_fetches():
    scope = Scope(warmup=0, system_interval_s=None)
    assert scope._phase_at(sys._getframe()) == "other"
    with scope.phase("forward"):
        assert scope._phase_at(sys._getframe()) == "forward"
        with scope.phase("sync"):
            assert scope._phase_at(sys._getframe()) == "sync"
        assert scope._phase_at(sys._getframe()) == "forward"
    seen = []

    def fetches():
        for _ in range(2):
            seen.append(scope._phase_at(sys._getframe()))
            yield 1

    for _ in scope.data(fetches()):
        seen.append(scope._phase_at(sys._getframe()))
    assert seen == ["data_wait", "other", "data_wait", "other"]


def test_scope_samples_stacks_when_asked_and_names_each_phase_line():
    with pytest.raises(ValueError):
        Scope(stack_sample_hz=0)
    assert Scope(warmup=0).summary().hotspots == {}  # off by default
    scope = Scope(warmup=1, stack_sample_hz=250, system_interval_s=1.0)
    for _ in scope.data(_sleep_in_fetch(50, 0.006)):
        with scope.phase("forward"):
            time.sleep(0.002)
        save_checkpoint(0.01)
        scope.step(batch_size=1)
    scope.close()
    hot = scope.summary().hotspots
    assert hot["rate_hz"] == 250 and hot["samples"] >= 30, hot
    top = {phase: rows[0] for phase, rows in hot["phases"].items()}
    assert set(top) == {"other", "data_wait"}, hot
    assert top["other"]["function"] == "save_checkpoint" and top["other"]["code"].startswith("time.sleep(seconds)")
    assert top["data_wait"]["function"] == "_sleep_in_fetch" and top["data_wait"]["share"] > 0.8
    assert top["other"]["share"] > 0.8
    # other sleeps 10 ms, forward 2 ms a step: the sample counts must rank them so (a wrong attribution would not)
    assert hot["phase_samples"]["other"] > 1.5 * hot["phase_samples"].get("forward", 0), hot


def doctor(tmp_path: Path, *args: str, steps: int = 40):
    return stepscope_here(tmp_path, *args, warmup=3, steps=steps, verb="doctor")


def test_doctor_names_a_sleepy_save_checkpoint_and_fixes_it_first(tmp_path):
    r = doctor(tmp_path, script("hotspot_checkpoint.py"), "--sleep-ms", "15")
    assert r.returncode == 0, r.describe()
    s = r.summary
    assert s.verdict.bound == "host", r.describe()
    top = s.hotspots["phases"]["other"][0]
    assert top["file"].endswith("hotspot_checkpoint.py") and top["function"] == "save_checkpoint", s.hotspots
    assert top["code"] == "time.sleep(sleep_ms / 1000)  # stands in for a slow filesystem, with a known cost"
    assert top["share"] > 0.8 and top["samples"] >= 20
    fix = s.fixes[0]
    assert fix.id == "host.checkpoint_every_step", r.describe()
    assert fix.gain_bound == pytest.approx(top["share"] * s.phases["other"].share, abs=2e-3)
    assert f"hotspot_checkpoint.py:{top['line']}" in fix.evidence[0]
    assert any("top line in other" in e and "time.sleep" in e for e in s.verdict.evidence), s.verdict
    assert "other " in r.stdout and "hotspot_checkpoint.py:" in r.stdout


def test_doctor_names_torch_save_at_its_line(tmp_path):
    r = doctor(tmp_path, script("hotspot_checkpoint.py"), "--mb", "8", steps=60)
    assert r.returncode == 0, r.describe()
    s = r.summary
    assert s.verdict.bound == "host", r.describe()
    top = s.hotspots["phases"]["other"][0]
    assert (top["calls"], top["code"]) == ("torch.serialization.save", "torch.save(state, path)"), s.hotspots
    first = next(iter(s.fixes), None)
    assert first is not None and first.id == "host.checkpoint_every_step", r.describe()
    assert "[torch.serialization.save]" in first.evidence[0]


def test_stack_hz_0_samples_the_host_but_no_stacks(tmp_path):
    # 100 steps of ~2 ms: the default rate takes ~20 stack samples here
    r = stepscope_run(tmp_path, "--stack-hz", "0", script("hotspot_checkpoint.py"), "--mb", "1", warmup=2, steps=100)
    assert r.returncode == 0, r.describe()
    s = r.summary
    assert s.hotspots == {} and s.system.get("interval_s") == 1.0, r.describe()  # the host sampler was on


def test_doctor_names_per_step_logging(tmp_path):
    # A process of its own: in this one, pytest's handlers on the root logger make the script's basicConfig a no-op.
    log = str(tmp_path / "train.log")
    r = stepscope_run(tmp_path, script("hotspot_logging.py"), log, warmup=3, steps=60, verb="doctor", timeout=120)
    assert r.returncode == 0, r.describe()
    s = r.summary
    assert s.verdict.bound == "host", r.describe()
    top = s.hotspots["phases"]["other"][0]
    assert top["calls"].startswith("logging.") and top["code"].startswith("log.info("), s.hotspots
    assert s.fixes[0].id == "host.log_every_step", r.describe()
    assert any("log.info(" in line for line in hotspot_lines(s))
    assert "Host time by source line" in html_sections.hotspots(s) and "log.info(" in html_sections.hotspots(s)


def test_merged_summary_keeps_each_ranks_hotspots_and_shows_the_stragglers():
    def rank(r: int, line: int) -> RunSummary:
        row = {"file": "t.py", "line": line, "function": "main", "code": "x", "calls": None, "share": 0.9}
        hot = {"rate_hz": 100.0, "samples": 50, "phases": {"other": [{**row, "samples": 45, "ms_per_step": 9.0}]}}
        phases = {"other": _stats(0.9, 10), "total": _stats(1.0, 10)}
        return RunSummary(steps=Steps(measured=10), phases=phases, meta=Meta(rank=r, world_size=2), hotspots=hot)

    merged = merge([rank(0, 1), rank(1, 2)])
    assert [r.hotspots["phases"]["other"][0]["line"] for r in merged.ranks] == [1, 2]
    assert merged.hotspots["rank"] in (0, 1) and merged.hotspots["phases"]
    assert hotspot_lines(merged)[0].startswith("source lines of rank")
