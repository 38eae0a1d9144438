"""`stepscope scale`: the scaling analysis on fixture summaries of 1/2/4/8 ranks with known figures, its labels,
its errors, the terminal/JSON/HTML output through the CLI, and one real 1- vs 2-rank run under torchrun."""

from __future__ import annotations

import io
import json
import subprocess
import sys

import pytest
from chromium import find_chromium, load_page
from run_helpers import REPO, run_env, script, stepscope_cmd, torchrun

from stepscope.analyses.scale import (
    ScaleError,
    ScaleRun,
    analyze_scale,
    growing_phase,
    label_for,
    run_problem,
)
from stepscope.cli import main
from stepscope.instrument.merge import merge
from stepscope.report.scale import print_scale, read_runs
from stepscope.summary import Epoch, LoaderInfo, Meta, PhaseStats, RunSummary, Steps, Throughput

BATCH = 16  # samples per step per rank
POWER_W = 300.0  # per rank, constant: energy per sample = power × step time / batch
DATASET = 1920  # samples per epoch, split over the ranks (DistributedSampler)
# Per-rank ms per step at each world size: compute is constant, sync grows.
BASE_PHASES = {"data_wait": 5.0, "forward": 20.0, "backward": 30.0, "optimizer": 5.0}
SYNC_MS = {1: 0.0, 2: 4.0, 4: 10.0, 8: 20.0}
STEP_MS = {w: 60.0 + s for w, s in SYNC_MS.items()}  # 60, 64, 70, 80
# Cluster samples/s = world × batch / step: 266.67, 500, 914.29, 1600.
RATE = {w: w * BATCH * 1000 / STEP_MS[w] for w in STEP_MS}
REPEAT_FACTORS = (1.02, 1.0, 0.97)  # step time × factor: the median repeat is the nominal one


@pytest.fixture(autouse=True)
def no_ci(monkeypatch):
    monkeypatch.delenv("CI", raising=False)


def rank_summary(
    phases_ms: dict[str, float],
    *,
    rank: int | None = None,
    world: int | None = None,
    batch: float = BATCH,
    command: str = "train.py --bs 16",
    device: str = "cpu",
    energy: bool = True,
    batch_known: bool = True,
) -> RunSummary:
    """One process's summary: exclusive phases (their sum is the step), 100 measured steps, two complete epochs."""
    step = sum(phases_ms.values())
    phases = {
        name: PhaseStats(mean_ms=ms, median_ms=ms, p95_ms=ms, share=ms / step, steps=100)
        for name, ms in phases_ms.items()
        if ms > 0
    }
    phases["total"] = PhaseStats(mean_ms=step, median_ms=step, p95_ms=step, share=1.0, steps=100)
    steps_per_s = 1000 / step
    per_rank_samples = DATASET // (world or 1)
    epoch_s = per_rank_samples / batch * step / 1000
    system = {}
    if energy:
        per_sample = POWER_W * step / 1000 / batch
        system = {"energy": {"total_j": POWER_W * 10, "per_step_j": per_sample * batch, "per_sample_j": per_sample}}
    return RunSummary(
        steps=Steps(warmup=5, measured=100),
        phases=phases,
        throughput=Throughput(
            steps_per_s=steps_per_s,
            samples_per_s=batch * steps_per_s if batch_known else None,
            step_time_ms=step,
        ),
        meta=Meta(command=command, device=device, rank=rank, world_size=world),
        system=system,
        loaders=[
            LoaderInfo(
                0,
                "Data",
                int(batch),
                0,
                False,
                False,
                None,
                True,
                False,
                int(per_rank_samples // batch),
                batches=250,
                samples=int(250 * batch),
            ),
            LoaderInfo(1, "Val", 64, 0, False, False, None, False, False, 2, batches=4, samples=256),
        ],
        epochs=[Epoch(0, i, epoch_s, int(per_rank_samples // batch), per_rank_samples, 1.0, True) for i in range(2)]
        + [Epoch(1, 0, 0.05, 4, 256, 1.0, True), Epoch(0, 2, 0.5, 3, 48, 1.0, False)],
    )


def run_at(world: int, factor: float = 1.0, sync: dict[int, float] = SYNC_MS, **kwargs) -> RunSummary:
    """A run of ``world`` ranks as `stepscope run` writes it (merged for several ranks, plain for one)."""
    phases = {n: ms * factor for n, ms in {**BASE_PHASES, "sync": sync[world]}.items()}
    if world == 1:
        return rank_summary(phases, **kwargs)
    ranks = [rank_summary(phases, rank=r, world=world, **kwargs) for r in range(world)]
    return merge(ranks, expected_world=world)


def write_runs(folder, worlds=(1, 2, 4, 8), repeats=REPEAT_FACTORS, **kwargs) -> list[str]:
    folder.mkdir(parents=True, exist_ok=True)
    paths = []
    for world in worlds:
        for i, factor in enumerate(repeats):
            path = folder / f"ws{world}-{i}.json"
            run_at(world, factor, **kwargs).to_json(path)
            paths.append(str(path))
    return paths


def analyze(paths, by=None):
    runs, skipped = read_runs([str(p) for p in paths], by)
    return analyze_scale(runs, by=by, skipped=skipped)


# -- figures -----------------------------------------------------------------------------------------------------


def test_speedup_efficiency_and_repeats(tmp_path):
    write_runs(tmp_path / "runs")
    report = analyze([tmp_path / "runs"])  # a folder stands for its *.json files
    assert report.skipped == [] and report.notes == []
    (group,) = report.groups
    assert group.label is None and group.scaling == "weak"
    assert [c.world_size for c in group.configs] == [1, 2, 4, 8]
    for c in group.configs:
        w = c.world_size
        assert len(c.sources) == 3
        assert c.samples_per_s.median == pytest.approx(RATE[w])
        assert c.samples_per_s.low == pytest.approx(RATE[w] / 1.02)
        assert c.samples_per_s.high == pytest.approx(RATE[w] / 0.97)
        assert c.speedup == pytest.approx(RATE[w] / RATE[1])
        assert c.efficiency == pytest.approx(RATE[w] / RATE[1] / w)
        assert c.batch_per_rank == pytest.approx(BATCH)
        assert c.step_ms == pytest.approx(STEP_MS[w])
        assert c.phases_ms["sync"] == pytest.approx(SYNC_MS[w])
        assert c.phases_ms["forward"] == pytest.approx(20.0)
    eight = group.configs[-1]
    assert eight.speedup == pytest.approx(6.0)  # 1600 / 266.67
    assert eight.efficiency == pytest.approx(0.75)
    assert any("8 ranks give 6.00× the samples/s of 1 rank" in line and "75% parallel efficiency" in line
               for line in group.findings)  # fmt: skip


def test_growing_phase_is_named_with_its_figures(tmp_path):
    (group,) = analyze(write_runs(tmp_path)).groups
    growth = group.growth
    assert growth is not None
    assert (growth.phase, growth.from_world, growth.to_world) == ("sync", 1, 8)
    assert growth.from_ms == pytest.approx(0.0) and growth.to_ms == pytest.approx(20.0)
    assert growth.share == pytest.approx(0.25)
    assert group.findings[1] == (
        "sync grows from 0.0 ms at 1 rank to 20.0 ms at 8 ranks: 25% of the step (60.0 ms → 80.0 ms per rank); time "
        "in collectives outside backward (all-reduce, barriers), waiting for the slowest rank included."
    )


def test_a_custom_phase_can_grow():
    """A phase stepscope has no explanation for is named with its figures alone."""
    runs = []
    for world, halo in ((1, 1.0), (4, 9.0)):
        phases = {**BASE_PHASES, "halo_exchange": halo}
        summary = rank_summary(phases) if world == 1 else merge(
            [rank_summary(phases, rank=r, world=world) for r in range(world)], expected_world=world
        )  # fmt: skip
        runs.append(ScaleRun(f"ws{world}", summary))
    (group,) = analyze_scale(runs).groups
    assert list(group.configs[0].phases_ms) == ["data_wait", "forward", "backward", "optimizer", "halo_exchange"]
    assert group.findings[1] == (
        "halo_exchange grows from 1.0 ms at 1 rank to 9.0 ms at 4 ranks: 13% of the step (61.0 ms → 69.0 ms per rank)."
    )


def test_data_wait_growing_is_named(tmp_path):
    """The loader falls behind at higher world sizes (shared storage): data_wait is the phase that grows."""
    folder = tmp_path / "runs"
    folder.mkdir()
    for world, wait in ((1, 2.1), (2, 6.0), (4, 18.4)):
        phases = {**BASE_PHASES, "data_wait": wait, "sync": 1.0}
        summary = rank_summary(phases) if world == 1 else merge(
            [rank_summary(phases, rank=r, world=world) for r in range(world)], expected_world=world
        )  # fmt: skip
        summary.to_json(folder / f"ws{world}.json")
    (group,) = analyze([folder]).groups
    assert group.growth.phase == "data_wait"
    step = 55.0 + 18.4 + 1.0
    assert group.growth.share == pytest.approx(18.4 / step)
    assert (
        f"data_wait grows from 2.1 ms at 1 rank to 18.4 ms at 4 ranks: {100 * 18.4 / step:.0f}% of the step"
        in (group.findings[1])
    )


def test_no_phase_grows(tmp_path):
    flat = dict.fromkeys(SYNC_MS, 1.0)
    (group,) = analyze(write_runs(tmp_path, worlds=(1, 4), repeats=(1.0,), sync=flat)).groups
    assert group.growth is None
    assert group.configs[1].efficiency == pytest.approx(1.0)
    assert group.findings[1].startswith("no phase grows by more than 5% of the step from 1 rank to 4 ranks")


def test_growth_below_the_threshold_is_not_named():
    """A phase that grows by less than 5% of the step is noise, not a finding."""
    configs = analyze_scale(
        [ScaleRun(f"ws{w}", run_at(w, sync={1: 0.0, 2: 2.0})) for w in (1, 2)]
    ).groups[0].configs  # fmt: skip
    assert growing_phase(configs) is None  # 2 ms of a 62 ms step: 3%


def test_energy_per_sample_and_epoch_time(tmp_path):
    (group,) = analyze(write_runs(tmp_path, repeats=(1.0,))).groups
    for c in group.configs:
        w = c.world_size
        # every rank draws POWER_W for a step of STEP_MS[w] per BATCH samples
        assert c.energy_per_sample_j == pytest.approx(POWER_W * STEP_MS[w] / 1000 / BATCH)
        # the training loader's complete epochs; the validation loader's and the cut-short epoch are left out
        assert c.epoch_s == pytest.approx(DATASET / w / BATCH * STEP_MS[w] / 1000)
    assert "energy per sample goes from 1.125 J at 1 rank to 1.5 J at 8 ranks (+33%)." in group.findings


def test_energy_missing_on_one_rank_gives_none():
    two = run_at(2)
    two.ranks[1].system = {}
    (group,) = analyze_scale([ScaleRun("one", run_at(1)), ScaleRun("two", two)]).groups
    assert group.configs[0].energy_per_sample_j is not None
    assert group.configs[1].energy_per_sample_j is None
    assert not any("energy" in line for line in group.findings)


def test_noisy_repeats_are_called_out(tmp_path):
    (group,) = analyze(write_runs(tmp_path, worlds=(1, 2), repeats=(1.0, 0.8, 1.1))).groups
    noisy = [line for line in group.findings if line.startswith("repeats at")]
    assert len(noisy) == 2 and noisy[0].startswith("repeats at 1 rank vary:")


def test_strong_scaling_same_global_batch():
    runs = [ScaleRun(f"ws{w}", run_at(w, batch=64 / w)) for w in (1, 2, 4)]
    (group,) = analyze_scale(runs).groups
    assert group.scaling == "strong"
    assert [c.batch_per_rank for c in group.configs] == pytest.approx([64, 32, 16])
    out = io.StringIO()
    print_scale(analyze_scale(runs), file=out)
    assert out.getvalue().splitlines()[0].endswith("strong scaling (same global batch: 64)")


def test_baseline_is_the_smallest_world_size(tmp_path):
    (group,) = analyze(write_runs(tmp_path, worlds=(2, 4, 8), repeats=(1.0,))).groups
    assert group.configs[0].world_size == 2 and group.configs[0].speedup == 1.0
    assert group.configs[-1].speedup == pytest.approx(RATE[8] / RATE[2])
    assert group.configs[-1].efficiency == pytest.approx(RATE[8] / RATE[2] / 4)


# -- labels ------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("by", "command", "path", "label"),
    [
        ("strategy", "train.py --strategy fsdp --bs 16", "/r/a.json", "fsdp"),
        ("strategy", "train.py --strategy=zero3", "/r/a.json", "zero3"),
        ("strategy", "train.py strategy=ddp lr=0.1", "/r/a.json", "ddp"),
        ("zero_stage", "train.py --zero-stage 2", "/r/a.json", "2"),
        ("--zero-stage", "train.py zero_stage=3", "/r/a.json", "3"),
        ("strategy", "train.py --bs 16", "/runs/strategy=fsdp/ws8.json", "fsdp"),
        ("strategy", "train.py --bs 16", "/runs/ws8/strategy=ddp.json", "ddp"),
        ("strategy", "train.py --strategy fsdp", "/runs/strategy=ddp/ws8.json", "fsdp"),  # the command wins
        ("strategy", "train.py --strategy --bs 16", "/r/a.json", None),  # a flag without a value
        ("strategy", "train.py --strategies x", "/r/a.json", None),
        ("strategy", "", "/runs/ddp/a.json", None),
        ("folder", "train.py --strategy fsdp", "/runs/ddp/a.json", "ddp"),
    ],
)
def test_label_for(by, command, path, label):
    assert label_for(by, command, path) == label


def test_by_groups_each_label_against_its_own_baseline(tmp_path):
    ddp = write_runs(tmp_path / "strategy=ddp", repeats=(1.0,))
    slow_sync = {1: 0.0, 2: 10.0, 4: 30.0, 8: 60.0}
    fsdp = write_runs(tmp_path / "strategy=fsdp", worlds=(2, 4, 8), repeats=(1.0, 1.0), sync=slow_sync, batch=8)
    report = analyze([tmp_path / "strategy=ddp", tmp_path / "strategy=fsdp"], by="strategy")
    assert len(ddp) == 4 and len(fsdp) == 6
    assert [g.label for g in report.groups] == ["ddp", "fsdp"]
    ddp_group, fsdp_group = report.groups
    assert [c.world_size for c in fsdp_group.configs] == [2, 4, 8]
    assert fsdp_group.configs[0].speedup == 1.0  # fsdp's own smallest world size, not ddp's 1 rank
    assert [len(c.sources) for c in fsdp_group.configs] == [2, 2, 2]
    assert fsdp_group.configs[0].batch_per_rank == pytest.approx(8)  # labels may differ in batch
    assert fsdp_group.growth.phase == "sync" and fsdp_group.growth.to_ms == pytest.approx(60.0)
    assert ddp_group.configs[-1].efficiency == pytest.approx(0.75)


def test_by_reads_the_command_and_folder(tmp_path):
    for name, command in (("a", "train.py --opt adamw"), ("b", "train.py --opt sgd")):
        write_runs(tmp_path / name, worlds=(1, 2), repeats=(1.0,), command=command)
    by_command = analyze([tmp_path / "a", tmp_path / "b"], by="opt")
    assert [g.label for g in by_command.groups] == ["adamw", "sgd"]
    by_folder = analyze([tmp_path / "a", tmp_path / "b"], by="folder")
    assert [g.label for g in by_folder.groups] == ["a", "b"]


def test_a_run_without_the_label_is_skipped(tmp_path):
    write_runs(tmp_path / "runs", worlds=(1, 2), repeats=(1.0,), command="train.py --opt adamw")
    run_at(4, command="train.py").to_json(tmp_path / "runs" / "ws4-other.json")
    report = analyze([tmp_path / "runs"], by="opt")
    assert [c.world_size for c in report.groups[0].configs] == [1, 2]
    (skip,) = report.skipped
    assert skip.reason.startswith(f"{tmp_path / 'runs' / 'ws4-other.json'} has no opt label: its command (train.py)")


def test_a_label_with_one_world_size_is_left_out_with_a_note(tmp_path):
    write_runs(tmp_path / "strategy=ddp", worlds=(1, 2), repeats=(1.0,))
    write_runs(tmp_path / "strategy=fsdp", worlds=(4,), repeats=(1.0, 1.0))
    report = analyze([tmp_path / "strategy=ddp", tmp_path / "strategy=fsdp"], by="strategy")
    assert [g.label for g in report.groups] == ["ddp"]
    assert report.notes == ["label 'fsdp' is left out: its 2 run(s) all have world size 4, nothing to compare."]


# -- errors --------------------------------------------------------------------------------------------------------


def scale_error(paths, by=None) -> ScaleError:
    with pytest.raises(ScaleError) as caught:
        analyze(paths, by)
    return caught.value


def test_no_files(tmp_path):
    (tmp_path / "empty").mkdir()
    error = scale_error([tmp_path / "empty", tmp_path / "missing.json"])
    assert str(error).startswith("no summary files found in")
    assert [s.reason for s in error.skipped] == [
        f"{tmp_path / 'empty'} is a folder with no *.json file in it.",
        f"{tmp_path / 'missing.json'}: no such file or folder.",
    ]
    with pytest.raises(ScaleError, match="no summaries were given"):
        analyze_scale([])


def test_bad_files_are_skipped_and_the_rest_goes_on(tmp_path):
    paths = write_runs(tmp_path, worlds=(1, 2), repeats=(1.0,))
    (tmp_path / "broken.json").write_text("{not json")
    (tmp_path / "other.json").write_text('{"traceEvents": []}')
    report = analyze([*paths, tmp_path / "broken.json", tmp_path / "other.json"])
    assert len(report.groups) == 1
    reasons = [s.reason for s in report.skipped]
    assert len(reasons) == 2
    assert reasons[0].startswith(f"{tmp_path / 'broken.json'} is not valid JSON")
    assert reasons[1] == f"{tmp_path / 'other.json'} is not a stepscope summary: it has no schema_version field."


def test_only_bad_files_is_an_error(tmp_path):
    (tmp_path / "broken.json").write_text("{not json")
    no_rate = tmp_path / "norate.json"
    run_at(1, batch_known=False).to_json(no_rate)
    error = scale_error([tmp_path])
    assert str(error) == "none of the 2 summaries can be used"
    assert any("has no samples/s (no batch size was known" in s.reason for s in error.skipped)


def test_a_single_configuration_is_an_error(tmp_path):
    error = scale_error(write_runs(tmp_path, worlds=(4,)))
    assert str(error) == (
        "a scaling report needs runs of at least two world sizes to compare, and every usable run (3) has world size 4"
    )
    labelled = tmp_path / "l"
    write_runs(labelled / "strategy=ddp", worlds=(2,), repeats=(1.0,))
    write_runs(labelled / "strategy=fsdp", worlds=(8,), repeats=(1.0,))
    error = scale_error([labelled / "strategy=ddp", labelled / "strategy=fsdp"], by="strategy")
    assert str(error).endswith("no label has two ('ddp': 2 only; 'fsdp': 8 only)")


def test_no_throughput_leaves_too_little(tmp_path):
    paths = write_runs(tmp_path, worlds=(1,), repeats=(1.0,))
    run_at(2, batch_known=False).to_json(tmp_path / "ws2-norate.json")
    error = scale_error([*paths, tmp_path / "ws2-norate.json"])
    assert "every usable run (1) has world size 1" in str(error)
    (skip,) = error.skipped
    assert skip.reason == (
        f"{tmp_path / 'ws2-norate.json'} has no samples/s (no batch size was known: `stepscope run --batch-size N` "
        "gives it when the script has no DataLoader)."
    )


def test_different_batches_within_a_label_are_an_error():
    runs = [ScaleRun("a", run_at(1)), ScaleRun("b", run_at(2, batch=32)), ScaleRun("c", run_at(4))]
    with pytest.raises(ScaleError) as caught:
        analyze_scale(runs)
    assert str(caught.value) == (
        "the runs are not comparable: their samples per step per rank are 16 at 1 rank, 32 at 2 ranks, 16 at 4 ranks, "
        "so neither the per-rank batch (weak scaling) nor the global batch (strong scaling) is the same; compare "
        "runs of one batch setting, or tell the settings apart with --by"
    )


def test_different_devices_within_a_label_are_an_error():
    gpu = "cuda:0 (NVIDIA H100 80GB HBM3)"
    same = [ScaleRun("a", run_at(1, device=gpu)), ScaleRun("b", run_at(2, device=gpu.replace(":0", ":3")))]
    assert analyze_scale(same).groups[0].configs[1].world_size == 2  # the index does not matter, the model does
    mixed = [ScaleRun("a", run_at(1, device=gpu)), ScaleRun("b", run_at(2))]
    with pytest.raises(ScaleError, match=r"ran on different devices \(cpu, cuda \(NVIDIA H100 80GB HBM3\)\)"):
        analyze_scale(mixed)


def test_run_problems():
    one_rank = rank_summary({"forward": 10.0}, rank=2, world=4)
    assert run_problem(one_rank).startswith("is one rank's summary (rank 2 of 4)")
    partial = run_at(4)
    partial.ranks = partial.ranks[:3]
    partial.cluster.ranks_reported = [0, 1, 2]
    assert run_problem(partial).startswith("has figures from 3 of its 4 ranks")
    assert run_problem(RunSummary()) == "has no measured steps"
    assert run_problem(run_at(2)) is None
    assert run_problem(rank_summary({"forward": 10.0}, rank=0, world=1)) is None  # torchrun with one process


# -- output --------------------------------------------------------------------------------------------------------


def test_terminal_table(tmp_path):
    report = analyze(write_runs(tmp_path))
    out = io.StringIO()
    print_scale(report, file=out)
    text = out.getvalue()
    rows = {line.split()[0]: line.split() for line in text.splitlines() if line.split()[:1] in (["1"], ["8"])}
    assert rows["1"] == ["1", "3", "16", "266.7", "261.4–274.9", "1.00×", "100%", "60.0", "7.2", "1.125"]
    assert rows["8"] == ["8", "3", "16", "1,600.0", "1,568.6–1,649.5", "6.00×", "75%", "80.0", "1.2", "1.5"]
    sync = next(line for line in text.splitlines() if line.startswith("sync"))
    assert sync.split() == ["sync", "0.000", "4.000", "10.0", "20.0", "←", "grows"]
    assert "weak scaling (same batch per rank: 16)" in text.splitlines()[0]
    assert "- sync grows from 0.0 ms at 1 rank to 20.0 ms at 8 ranks" in text


def test_cli_terminal_json_and_html(tmp_path, capsys):
    runs = tmp_path / "strategy=<img src=x onerror=alert(1)>"
    write_runs(runs, worlds=(1, 2, 4), repeats=(1.0, 1.02))
    (runs / "broken.json").write_text("[]")
    json_path, html_path = tmp_path / "out" / "scale.json", tmp_path / "out" / "scale.html"
    code = main(["scale", str(runs), "--by", "strategy", "--json", str(json_path), "--html", str(html_path)])
    out = capsys.readouterr().out
    assert code == 0, out
    assert "strategy=<img src=x onerror=alert(1)>" in out.splitlines()[0]  # verbatim, not read as markup
    assert "skipped: " in out and "broken.json is not a stepscope summary" in out
    data = json.loads(json_path.read_text())
    assert data["by"] == "strategy"
    (group,) = data["groups"]
    assert group["label"] == "<img src=x onerror=alert(1)>" and group["scaling"] == "weak"
    assert [c["world_size"] for c in group["configs"]] == [1, 2, 4]
    assert group["configs"][2]["speedup"] == pytest.approx(RATE[4] / RATE[1], rel=0.02)
    assert set(group["configs"][0]["samples_per_s"]) == {"median", "low", "high"}
    assert group["growth"]["phase"] == "sync"
    assert data["skipped"][0]["source"].endswith("broken.json")
    page = html_path.read_text()
    assert page.startswith("<!DOCTYPE html>") and page.count("<svg") == 3
    assert "<img" not in page and "strategy=&lt;img src=x onerror=alert(1)&gt;" in page
    assert "ideal linear scaling" in page and "parallel efficiency" in page
    assert "<script" not in page and "http://" not in page.replace("http://www.w3.org/2000/svg", "")


def test_cli_errors_are_one_sentence_and_exit_2(tmp_path, capsys):
    (tmp_path / "broken.json").write_text("{")
    assert main(["scale", str(tmp_path / "broken.json")]) == 2
    err = capsys.readouterr().err.splitlines()
    assert err[0].startswith("stepscope: skipped: ") and "is not valid JSON" in err[0]
    assert err[1] == "stepscope: none of the 1 summaries can be used."
    paths = write_runs(tmp_path / "runs", worlds=(2,), repeats=(1.0,))
    assert main(["scale", *paths, "--json", str(tmp_path / "x.json")]) == 2
    err = capsys.readouterr().err.splitlines()
    assert err == [
        "stepscope: a scaling report needs runs of at least two world sizes to compare, and every usable run (1) "
        "has world size 2."
    ]
    assert not (tmp_path / "x.json").exists()
    paths = write_runs(tmp_path / "ok", worlds=(1, 2), repeats=(1.0,))
    (tmp_path / "file").write_text("")
    assert main(["scale", *paths, "--html", str(tmp_path / "file" / "scale.html")]) == 2
    err = capsys.readouterr().err.splitlines()
    assert err == [
        f"stepscope: --html {tmp_path / 'file' / 'scale.html'}: cannot write the scaling report: {tmp_path / 'file'} "
        "is a file, not a folder."
    ], "checked before any summary is read"


def test_an_output_that_fails_to_write_leaves_the_other_written(tmp_path, capsys):
    paths = write_runs(tmp_path / "ok", worlds=(1, 2), repeats=(1.0,))
    page = tmp_path / "scale.html"
    assert main(["scale", *paths, "--json", "/dev/full", "--html", str(page)]) == 1
    err = capsys.readouterr().err.splitlines()
    assert err == ["stepscope: --json /dev/full: could not write the scaling table (No space left on device)."]
    assert "<html" in page.read_text()


def test_real_runs_one_and_two_ranks(tmp_path):
    """`stepscope run` under torchrun with 1 and 2 processes (gloo, CPU), then `stepscope scale` on the two."""
    summaries = []
    for world in (1, 2):
        json_path = tmp_path / f"ws{world}.json"
        args = [*torchrun(world), script("ddp.py"), "--extra-ms", "0", "--epochs", "1", "--samples", "512"]
        cmd = stepscope_cmd(json_path, "--", *args, warmup=3, steps=15)
        proc = subprocess.run(cmd, cwd=tmp_path, env=run_env(), capture_output=True, text=True, timeout=60)
        assert proc.returncode == 0 and json_path.exists(), proc.stdout + proc.stderr
        summaries.append(str(json_path))
    proc = subprocess.run(
        [sys.executable, "-m", "stepscope.cli", "scale", *summaries, "--json", str(tmp_path / "scale.json")],
        cwd=REPO, env=run_env(), capture_output=True, text=True, timeout=30,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    (group,) = json.loads((tmp_path / "scale.json").read_text())["groups"]
    one, two = group["configs"]
    assert (one["world_size"], two["world_size"]) == (1, 2)
    assert one["batch_per_rank"] == pytest.approx(8, rel=0.05) and two["batch_per_rank"] == pytest.approx(8, rel=0.05)
    assert two["speedup"] > 0 and two["efficiency"] == pytest.approx(two["speedup"] / 2)
    assert "sync" in two["phases_ms"] or "backward" in two["phases_ms"]


@pytest.mark.skipif(find_chromium() is None, reason="chromium is not on PATH (`make test` installs it where it can)")
def test_the_scaling_page_renders_in_chromium_without_errors(tmp_path):
    runs = tmp_path / "runs"
    write_runs(runs, worlds=(1, 2, 4, 8), repeats=(1.0, 1.02))
    page = tmp_path / "scale.html"
    assert main(["scale", str(runs), "--html", str(page)]) == 0
    load = load_page(
        page,
        {
            "charts": "[...document.querySelectorAll('svg')].map(s => s.getBoundingClientRect().width)",
            "scripts": "document.querySelectorAll('script').length",
            "text": "document.body.innerText",
        },
    )
    assert load.errors == [] and load.console == []
    assert load.requests == [page.resolve().as_uri()]  # nothing fetched: self-contained
    assert len(load.values["charts"]) == 3 and all(width > 300 for width in load.values["charts"])
    assert load.values["scripts"] == 0
    assert "sync grows from 0.0 ms at 1 rank to 20.2 ms at 8 ranks" in load.values["text"]
