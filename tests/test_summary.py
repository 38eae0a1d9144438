"""RunSummary: versioned JSON round trip and the errors a bad file gets."""

import orjson
import pytest

from stepscope import Fix, PhaseStats, RunSummary, Scope, SummaryError, Verdict
from stepscope.summary import (
    SCHEMA_VERSION,
    Cluster,
    Epoch,
    Exit,
    LoaderInfo,
    LossSeries,
    Meta,
    Overhead,
    Steps,
    Straggler,
    Throughput,
)


def full_summary():
    return RunSummary(
        steps=Steps(warmup=20, measured=480, boundary="scope.step"),
        phases={
            "data_wait": PhaseStats(mean_ms=61.25, median_ms=60.0, p95_ms=80.5, share=0.6125, steps=480),
            "forward": PhaseStats(
                mean_ms=20.0,
                median_ms=19.5,
                p95_ms=25.0,
                share=0.2,
                steps=480,
                device_mean_ms=18.0,
                device_median_ms=17.75,
                device_p95_ms=22.0,
                device_share=0.18,
            ),
            "attention": PhaseStats(mean_ms=8.0, median_ms=8.0, p95_ms=9.0, share=0.08, steps=480, nested=True),
            "total": PhaseStats(mean_ms=100.0, median_ms=99.0, p95_ms=120.0, share=1.0, steps=480),
        },
        throughput=Throughput(steps_per_s=10.0, samples_per_s=320.0, step_time_ms=100.0),
        verdict=Verdict(bound="data", confidence="high", evidence=["data_wait is 61% of the step", "GPU idle 58%"]),
        fixes=[
            Fix(
                id="num_workers",
                title="Raise DataLoader num_workers",
                why="the loader cannot keep up",
                evidence=["data_wait 61%"],
                how="DataLoader(..., num_workers=8)",
                cost="config",
                gain_bound=0.55,
                gain_reason="at most the data_wait share",
            ),
            Fix(
                id="amp",
                title="Mixed precision",
                why="compute",
                evidence=[],
                how="torch.autocast",
                cost="code",
                gain_bound=None,
                changes_numerics=True,
            ),
        ],
        system={"cpu_count": 16, "gpus": [{"name": "H100", "memory_gb": 80}], "nested": {"a": [1, 2.5, None]}},
        ranks=[
            RunSummary(meta=Meta(rank=0), throughput=Throughput(samples_per_s=160.0)),
            RunSummary(meta=Meta(rank=1), throughput=Throughput(samples_per_s=158.5), notes=["rank 1 note"]),
        ],
        loaders=[
            LoaderInfo(
                index=0,
                dataset="ImageFolder",
                batch_size=32,
                num_workers=4,
                pin_memory=True,
                persistent_workers=False,
                prefetch_factor=2,
                drop_last=False,
                iterable=False,
                length=100,
                batches=500,
                samples=16000,
                fetch_s=30.6,
            )
        ],
        epochs=[Epoch(loader=0, index=0, time_s=9.8, batches=100, samples=3200, start_stall_ms=812.5, complete=True)],
        counters={"item_calls": 1.0, "host_syncs": 1.0},
        exit=Exit(reason="stopped", code=0),
        cluster=Cluster(
            world_size=2,
            ranks_reported=[0, 1],
            samples_per_s=318.5,
            phases={"data_wait": {"min_ms": 60.0, "mean_ms": 61.25, "max_ms": 62.5}},
            straggler=Straggler(rank=1, phase="data_wait", excess_ms=1.25),
        ),
        meta=Meta(
            stepscope_version="0.1.0",
            torch_version="2.13.0",
            device="cuda:0 (H100)",
            timing="cuda",
            started_at="2026-01-01T00:00:00+00:00",
            command="train.py --lr 0.1",
            hostname="node1",
            python_version="3.11.7",
            rank=0,
            local_rank=0,
            world_size=2,
        ),
        notes=["one note", "ünïcode note ✓"],
        trace={
            "folder": "/runs/traces",
            "files": 1,
            "verdict": {"bound": "compute", "confidence": "high", "evidence": ["computation kernels run 91%"]},
            "ranks": [
                {
                    "rank": 0,
                    "file": "rank0.step4-6.pt.trace.json.gz",
                    "idle_pct": 4.5,
                    "idle_breakdown": None,
                    "top_kernels": [
                        {"name": "gemm<128>", "type": "computation", "count": 3, "total_ms": 1.5, "pct": 60.0}
                    ],
                }
            ],
            "stragglers": [],
            "warnings": [],
            "skipped": [{"file": "broken.json", "reason": "the file is empty"}],
        },
        loss=LossSeries(steps=[0, 1, 2], values=[2.5, None, 2.25]),
        overhead=Overhead(us_per_step=45.5, share=0.0112, hooks_us_per_step=40.0, threads_us_per_step=5.5, how="x"),
    )


def test_round_trip_through_a_file(tmp_path):
    original = full_summary()
    path = tmp_path / "nested" / "dir" / "run.json"  # parents are created
    text = original.to_json(path)
    assert path.read_text() == text + "\n"
    loaded = RunSummary.from_json(path)
    assert loaded == original
    assert isinstance(loaded.fixes[0], Fix)
    assert isinstance(loaded.verdict, Verdict)
    assert isinstance(loaded.phases["forward"], PhaseStats)
    assert loaded.phases["attention"].nested is True
    assert loaded.fixes[1].gain_bound is None
    assert loaded.fixes[1].changes_numerics is True


def test_round_trip_of_a_real_scope_summary(tmp_path, clock):
    scope = Scope(clock=clock, warmup=1, timing="host")
    for f in (50, 10, 12, 14):
        with scope.phase("forward"):
            clock.advance(f)
        scope.step(batch_size=8)
    original = scope.summary()
    path = tmp_path / "scope.json"
    original.to_json(path)
    assert RunSummary.from_json(path) == original
    assert RunSummary.from_json(str(path)) == original


def test_json_form_puts_schema_version_first():
    data = orjson.loads(full_summary().to_json())
    assert next(iter(data)) == "schema_version"
    assert data["schema_version"] == SCHEMA_VERSION == 8
    assert data["phases"]["forward"]["device_p95_ms"] == 22.0
    assert data["fixes"][1]["gain_bound"] is None


def test_default_summary_round_trips(tmp_path):
    path = tmp_path / "empty.json"
    RunSummary().to_json(path)
    assert RunSummary.from_json(path) == RunSummary()


def test_missing_file(tmp_path):
    path = tmp_path / "nope.json"
    with pytest.raises(SummaryError, match="no summary file at") as info:
        RunSummary.from_json(path)
    assert str(path) in str(info.value)


def test_summary_error_is_a_value_error():
    assert issubclass(SummaryError, ValueError)


def test_invalid_json(tmp_path):
    path = tmp_path / "bad.json"
    path.write_text('{"schema_version": 1, "steps": ')
    with pytest.raises(SummaryError, match="is not valid JSON"):
        RunSummary.from_json(path)


def test_directory_instead_of_file(tmp_path):
    with pytest.raises(SummaryError, match="cannot read summary"):
        RunSummary.from_json(tmp_path)


@pytest.mark.parametrize("payload", [{}, {"steps": {"warmup": 1, "measured": 2}}, [1, 2], "text", 3])
def test_not_a_stepscope_summary(tmp_path, payload):
    path = tmp_path / "other.json"
    path.write_bytes(orjson.dumps(payload))
    with pytest.raises(SummaryError, match="not a stepscope summary"):
        RunSummary.from_json(path)


def test_newer_schema_version_asks_for_an_upgrade(tmp_path):
    data = full_summary().to_dict()
    data["schema_version"] = SCHEMA_VERSION + 1
    path = tmp_path / "future.json"
    path.write_bytes(orjson.dumps(data))
    with pytest.raises(SummaryError, match="upgrade stepscope") as info:
        RunSummary.from_json(path)
    assert f"schema {SCHEMA_VERSION + 1}" in str(info.value)


@pytest.mark.parametrize("version", [0, -1, "1", 1.0, None])
def test_invalid_schema_version(version):
    with pytest.raises(SummaryError, match="invalid schema_version"):
        RunSummary.from_dict({"schema_version": version})


@pytest.mark.parametrize(
    ("section", "where"),
    [
        ("steps", lambda d: d["steps"]),
        ("phases", lambda d: d["phases"]["forward"]),
        ("throughput", lambda d: d["throughput"]),
        ("verdict", lambda d: d["verdict"]),
        ("fixes", lambda d: d["fixes"][0]),
        ("meta", lambda d: d["meta"]),
    ],
)
def test_unknown_field_in_a_section_names_the_field(section, where):
    data = full_summary().to_dict()
    where(data)["bogus_field"] = 1
    with pytest.raises(SummaryError, match="bogus_field"):
        RunSummary.from_dict(data)


def test_unknown_top_level_field_names_the_field(tmp_path):
    # Sections reject unknown fields; the top level must too, or a misspelt key loads silently as a summary
    # with no phases.
    data = full_summary().to_dict()
    data["phases_typo"] = data.pop("phases")
    path = tmp_path / "typo.json"
    path.write_bytes(orjson.dumps(data))
    with pytest.raises(SummaryError, match="phases_typo"):
        RunSummary.from_json(path)


def test_missing_required_field():
    data = full_summary().to_dict()
    del data["phases"]["forward"]["mean_ms"]
    with pytest.raises(SummaryError, match="mean_ms"):
        RunSummary.from_dict(data, source="x.json")


def test_section_of_the_wrong_type(tmp_path):
    data = full_summary().to_dict()
    data["verdict"] = ["data"]
    path = tmp_path / "wrong.json"
    path.write_bytes(orjson.dumps(data))
    with pytest.raises(SummaryError, match="does not match summary schema") as info:
        RunSummary.from_json(path)
    assert str(path) in str(info.value)


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (lambda d: d["verdict"].update(bound="slow"), "unknown verdict bound 'slow'"),
        (lambda d: d["fixes"][0].update(cost="cheap"), "unknown cost 'cheap'"),
    ],
)
def test_values_outside_the_vocabulary_are_refused(tmp_path, edit, message):
    data = full_summary().to_dict()
    edit(data)
    with pytest.raises(SummaryError, match=message):
        RunSummary.from_dict(data)


def test_schema_1_file_is_upgraded_with_empty_facts():
    data = RunSummary().to_dict()
    data["schema_version"] = 1
    del data["facts"], data["dataloader"], data["series"], data["pipeline"], data["trace"], data["eval"]
    del data["hotspots"]
    summary = RunSummary.from_dict(data)
    assert summary.schema_version == SCHEMA_VERSION
    assert summary.facts == {} and summary.dataloader == {}
    assert summary.series is None and summary.pipeline == {} and summary.trace == {}


def test_schema_2_file_and_its_ranks_are_upgraded_without_series_pipeline_or_trace():
    rank = RunSummary().to_dict()
    data = RunSummary().to_dict()
    for d in (rank, data):
        d["schema_version"] = 2
        del d["series"], d["pipeline"], d["trace"], d["eval"], d["hotspots"]
    data["ranks"] = [rank]
    summary = RunSummary.from_dict(data)
    assert summary.schema_version == SCHEMA_VERSION and summary.ranks[0].schema_version == SCHEMA_VERSION
    assert summary.series is None and summary.ranks[0].pipeline == {}
    assert summary.trace == {} and summary.ranks[0].trace == {}


def test_schema_3_file_without_trace_highlights_loads_with_an_empty_trace():
    """Version 3 gained ``trace`` before its release: a version-3 file written without it still loads."""
    data = full_summary().to_dict()
    data["schema_version"] = 3
    del data["trace"], data["eval"], data["hotspots"]
    assert RunSummary.from_dict(data).trace == {}


def test_schema_3_file_is_upgraded_with_empty_eval_and_hotspots():
    data = full_summary().to_dict()
    data["schema_version"] = 3
    del data["eval"], data["hotspots"]
    summary = RunSummary.from_dict(data)
    assert (summary.schema_version, summary.eval, summary.hotspots) == (SCHEMA_VERSION, {}, {})


def test_schema_4_file_is_upgraded_with_no_applied_fixes_and_unknown_nodes():
    data = full_summary().to_dict()
    data["schema_version"] = 4
    del data["applied"]
    for name in ("node_rank", "job_id", "pid", "launch_id"):
        del data["meta"][name]
    summary = RunSummary.from_dict(data)
    assert (summary.schema_version, summary.applied) == (SCHEMA_VERSION, [])
    assert (summary.meta.node_rank, summary.meta.job_id, summary.meta.pid) == (None, None, None)


def test_schema_5_file_is_upgraded_without_a_wall_window_or_wall_rates():
    data = full_summary().to_dict()
    data["schema_version"] = 5
    del data["wall"], data["invariants"], data["throughput"]["wall_steps_per_s"]
    del data["throughput"]["wall_samples_per_s"]
    summary = RunSummary.from_dict(data)
    assert (summary.schema_version, summary.wall, summary.invariants) == (SCHEMA_VERSION, None, [])
    assert summary.throughput.wall_samples_per_s is None


def test_trace_highlights_are_a_top_level_field_after_pipeline():
    data = orjson.loads(full_summary().to_json())
    assert list(data)[-9:] == [
        "pipeline", "trace", "eval", "hotspots", "applied", "wall", "invariants", "loss", "overhead"
    ]  # fmt: skip
    assert data["trace"]["ranks"][0]["top_kernels"][0]["name"] == "gemm<128>"
    assert RunSummary().to_dict()["trace"] == {}


def test_world_size_and_batch_per_rank_read_the_merged_summary_or_the_single_process():
    single = RunSummary(throughput=Throughput(steps_per_s=10.0, samples_per_s=160.0))
    assert (single.world_size, single.batch_per_rank) == (1, 16.0)
    ranks = [
        RunSummary(throughput=Throughput(steps_per_s=10.0, samples_per_s=80.0)),
        RunSummary(throughput=Throughput(steps_per_s=5.0, samples_per_s=40.0)),
        RunSummary(throughput=Throughput(steps_per_s=5.0)),  # no batch size known: left out of the mean
    ]
    merged = RunSummary(ranks=ranks, cluster=Cluster(world_size=4, ranks_reported=[0, 1, 2], samples_per_s=120.0))
    assert (merged.world_size, merged.batch_per_rank) == (4, 8.0)
    assert RunSummary(meta=Meta(world_size=2)).world_size == 2
    assert RunSummary().batch_per_rank is None
