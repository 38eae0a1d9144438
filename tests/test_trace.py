"""The Kineto (torch.profiler) trace analyser: `stepscope.analyses.trace` and ``stepscope trace``.

Three sources of truth:

- synthetic traces built here event by event (`Kineto`, tests/kineto.py), whose answers are known exactly;
- the real traces of Holistic Trace Analysis' test data, listed in tests/data/traces/hta.sha256 and kept in
  tests/data/traces/hta (tests/data/traces/README.md);
- the numbers HTA 0.5.0 computed on those traces, in tests/data/hta_reference.json.
A missing trace or reference fails its test, naming the file; none is skipped.
"""

from __future__ import annotations

import dataclasses
import gc
import gzip
import hashlib
import itertools
import json
import os
import shutil
import time
import zlib
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from kineto import ORIGIN_US, Kineto

from stepscope.analyses.trace import breakdown as bd
from stepscope.analyses.trace import events as events_module
from stepscope.analyses.trace import highlights as highlights_module
from stepscope.analyses.trace import stream
from stepscope.analyses.trace.analyze import DATALOADER, DEFINITIONS, RankTrace, TraceAnalysis, analyze_trace
from stepscope.analyses.trace.events import TraceEvents, rank_of, read_trace, trace_files
from stepscope.analyses.trace.highlights import highlights, trace_highlights
from stepscope.analyses.trace.shares import read_in_shares
from stepscope.analyses.trace.stream import TraceFile, TraceReadError, iter_events
from stepscope.cli import main
from stepscope.summary import RunSummary

DATA = Path(__file__).resolve().parent / "data"
TRACES = DATA / "traces"
HTA = TRACES / "hta"  # HTA's test traces, in the repository (tests/data/traces/README.md)
MANIFEST = TRACES / "hta.sha256"
REFERENCE = DATA / "hta_reference.json"
NOT_KINETO = {
    "execution_trace/benchmark_simple_add_et.json.gz": (
        "this is a PyTorch execution trace (ExecutionTraceObserver), not a Kineto trace"
    ),
    "memory_analysis/memory_timeline.raw.gz": (
        "this looks like a memory timeline (export_memory_timeline), not a Kineto trace"
    ),
}
COMM = "ncclKernel_AllReduce_RING_LL_Sum_float(ncclDevComm*, unsigned long, ncclWork*)"
GEMM = "void cutlass::Kernel<cutlass_80_tensorop_s1688gemm_256x64_16x4_nn_align4>(Params)"
ADD = "void at::native::vectorized_elementwise_kernel<4, at::native::CUDAFunctor_add<float>>(int)"
LOADER = "enumerate(DataLoader)#_SingleProcessDataLoaderIter.__next__"


def hta_file(relative: str) -> Path:
    """HTA's test trace (or folder) at ``relative`` inside its tests/data, from the repository's copy. Fails the
    test, naming it, when it is missing."""
    if not (HTA / relative).exists():
        pytest.fail(f"HTA's test trace {relative} is missing from {HTA} (tests/data/traces/README.md)")
    return HTA / relative


def manifest() -> dict[str, str]:
    """Every file of HTA's test data the tests use (relative to its tests/data) with its SHA-256."""
    lines = MANIFEST.read_text().splitlines()
    return {line[66:].removeprefix("hta/"): line[:64] for line in lines if line.strip()}


# ---------------------------------------------------------------------------------------------------------------------
# Building synthetic traces
# ---------------------------------------------------------------------------------------------------------------------


def only_rank(analysis: TraceAnalysis) -> RankTrace:
    assert [f.reason for f in analysis.files if not f.ok] == [], "every file should be readable"
    assert len(analysis.ranks) == 1, f"expected one rank, got {[r.rank for r in analysis.ranks]}"
    return analysis.ranks[0]


def analyse(trace: Kineto, tmp_path: Path, name: str = "trace.json", top: int = 10) -> RankTrace:
    """Write ``trace`` and analyse that one file."""
    return only_rank(analyze_trace(trace.write(tmp_path / name), top=top, jobs=1))


def read_stream(path: Path) -> tuple[list[dict[str, Any]], TraceFile]:
    trace = TraceFile(path)
    events = [event for batch in iter_events(path, trace) for event in batch]
    return events, trace


def reason_of(path: Path) -> str:
    with pytest.raises(TraceReadError) as caught:
        read_stream(path)
    return str(caught.value)


def approx(value: float, tol: float = 1e-9) -> Any:
    return pytest.approx(value, abs=tol)


@pytest.fixture
def small_chunks(monkeypatch):
    """Parse in tiny chunks so that events, strings and escapes straddle chunk boundaries."""

    def use(size: int) -> int:
        monkeypatch.setattr(stream, "CHUNK_BYTES", size)
        return size

    return use


@pytest.fixture(params=["isal", "zlib"])
def inflate(request, monkeypatch):
    """A gzip test run with ISA-L's inflate (the extra stepscope[fast], in the dev set) and with zlib's, which the
    reader falls back to without it."""
    if request.param == "zlib":
        monkeypatch.setattr(stream, "INFLATE", zlib)
        monkeypatch.setattr(stream, "INFLATE_ERRORS", (zlib.error,))
    else:
        isal_zlib = pytest.importorskip("isal.isal_zlib")
        monkeypatch.setattr(stream, "INFLATE", isal_zlib)
        monkeypatch.setattr(stream, "INFLATE_ERRORS", (isal_zlib.error, zlib.error))
    return request.param


@pytest.fixture
def no_gc():
    """Large real traces make millions of dicts: the cyclic collector only slows their parse down."""
    enabled = gc.isenabled()
    gc.disable()
    yield
    if enabled:
        gc.enable()


# ---------------------------------------------------------------------------------------------------------------------
# stream.py: iter_events
# ---------------------------------------------------------------------------------------------------------------------

TRICKY_NAMES = [
    "curly { open",
    "curly } close",
    "square [ open",
    "square ] close",
    '}]}]"],[{',
    'a "quoted" word',
    "backslash \\ alone",
    'escaped backslash then quote \\"',
    "ends with a backslash \\",
    "\\\\\\",
    '"traceEvents": [',
    "utf-8 é ✓ 漢字 🙂",
    "",
]


def tricky_trace() -> Kineto:
    trace = Kineto(rank=3)
    trace.meta["deviceProperties"][0]["note"] = 'bracket ] and brace } and "quote" \\ in the metadata'
    for i, name in enumerate(TRICKY_NAMES):
        trace.host(name, 10 * i, 5)
        trace.kernel(name, 10 * i + 3, 4)
    trace.events.append({"ph": "X", "cat": "cpu_op", "name": "nested", "ts": ORIGIN_US, "dur": 1, "pid": 1,
                         "tid": 1, "args": {"list": [[1, [2, {"k": "]"}]], {}], "empty": {}, "s": "[{"}})  # fmt: skip
    trace.trailer["baseTimeStamp"] = 1_700_000_000
    return trace


@pytest.mark.parametrize("chunk", [16, 61, 4096])
@pytest.mark.parametrize("layout", ["kineto", "compact"])
@pytest.mark.parametrize("events_at", ["first", "middle", "last"])
@pytest.mark.parametrize("suffix", [".json", ".json.gz"])
def test_stream_equals_json_load_across_chunk_boundaries(tmp_path, small_chunks, chunk, layout, events_at, suffix):
    small_chunks(chunk)
    trace = tricky_trace()
    path = trace.write(tmp_path / f"t{suffix}", layout, events_at)
    raw = trace.text(layout, events_at)
    expected = json.loads(raw)
    events, info = read_stream(path)
    assert events == expected["traceEvents"], "streamed events differ from json.load"
    assert info.meta == {k: v for k, v in expected.items() if k != "traceEvents"}, "metadata differs"
    assert info.meta["displayTimeUnit"] == "ms" and info.meta["baseTimeStamp"] == 1_700_000_000
    assert info.events == len(expected["traceEvents"])
    assert info.bytes_read == len(raw), "bytes_read counts the decompressed bytes"


def test_stream_yields_in_chunks_bounded_by_chunk_size(tmp_path, small_chunks):
    small_chunks(4096)
    trace = Kineto()
    for i in range(2000):
        trace.kernel(ADD, 10 * i, 5)
    batches = list(iter_events(trace.write(tmp_path / "t.json")))
    assert len(batches) > 10, "a large trace is parsed a chunk at a time, not at once"
    assert sum(len(b) for b in batches) == len(trace.events)


def test_stream_empty_trace_events_array(tmp_path):
    path = tmp_path / "t.json"
    path.write_text('{"schemaVersion": 1, "traceEvents": [], "displayTimeUnit": "ns"}')
    events, info = read_stream(path)
    assert events == [] and info.events == 0
    assert info.meta == {"schemaVersion": 1, "displayTimeUnit": "ns"}


@pytest.mark.parametrize("cuts", [(1,), (97, 300), (5, 6, 7, 2000), "repetitive"])
def test_stream_reads_multi_member_gzip(tmp_path, small_chunks, cuts, inflate):
    small_chunks(64)
    raw = tricky_trace().text("compact")
    if cuts == "repetitive":  # members that compress 10x: each 16-byte read inflates past the 64-byte cap
        trace = Kineto()
        for i in range(300):
            trace.kernel(ADD, 10 * i, 5)
        raw = trace.text("compact")
        cuts = tuple(range(1000, len(raw), 1000))
    bounds = [0, *cuts, len(raw)]
    path = tmp_path / "t.json.gz"
    members = [gzip.compress(raw[a:b]) for a, b in itertools.pairwise(bounds)]
    path.write_bytes(b"".join(members))
    assert gzip.decompress(path.read_bytes()) == raw
    try:
        events, info = read_stream(path)
    except TraceReadError as error:
        pytest.fail(f"{len(members)} gzip members read 16 bytes at a time: {error}")
    assert events == json.loads(raw)["traceEvents"]
    assert info.bytes_read == len(raw)


@pytest.mark.parametrize("padding", [1, 100, 5000], ids=["1-byte", "within-a-read", "across-reads"])
def test_stream_tolerates_zero_padding_after_gzip(tmp_path, small_chunks, padding, inflate):
    """gzip (and Python's gzip module) accept any run of zero bytes after the last member (tape-block padding)."""
    chunk = small_chunks(4096)  # compressed reads of chunk // 4 = 1024 bytes: 5000 zeros span several reads
    raw = tricky_trace().text("compact")
    path = tmp_path / "t.json.gz"
    path.write_bytes(gzip.compress(raw) + b"\x00" * padding)
    assert gzip.decompress(path.read_bytes()) == raw, "the padded file is valid for gzip itself"
    try:
        events, _ = read_stream(path)
    except TraceReadError as error:
        pytest.fail(f"{padding} zero bytes after the gzip member (reads of {chunk // 4} bytes) refused: {error}")
    assert events == json.loads(raw)["traceEvents"]


@pytest.mark.parametrize("chunks_before", [0, 3, 40])
def test_stream_finds_trace_events_after_long_metadata(tmp_path, small_chunks, chunks_before):
    """The array is found however many chunks of metadata come first (the head is searched again as it grows)."""
    chunk = small_chunks(4096)
    trace = Kineto()
    for i in range(30):
        trace.kernel(ADD, 10 * i, 5)
    data = json.loads(trace.text("compact"))
    data = {"hosts": [{"name": "x" * 100, "id": i} for i in range(chunks_before * chunk // 110)], **data}
    path = tmp_path / "far.json"
    path.write_text(json.dumps(data))
    events, info = read_stream(path)
    assert events == data["traceEvents"]
    assert info.meta["hosts"] == data["hosts"] and len(path.read_bytes()) > chunks_before * chunk


def test_every_real_trace_is_found_unchanged():
    """Each file of the manifest is in the repository with its SHA-256: a missing or altered trace fails here, by
    name."""
    found = manifest()
    assert len(found) == 32, f"{MANIFEST} lists {len(found)} files, not HTA's 32"
    for relative, digest in sorted(found.items()):
        assert hashlib.sha256(hta_file(relative).read_bytes()).hexdigest() == digest, f"{relative} differs from HTA's"
    copied = sorted(p.relative_to(HTA).as_posix() for p in HTA.rglob("*") if p.is_file())
    assert set(copied) <= set(found), f"files in {HTA} that the manifest does not list: {set(copied) - set(found)}"


@pytest.mark.parametrize("relative", sorted(set(manifest()) - set(NOT_KINETO)))
def test_stream_equals_json_load_on_real_traces(relative, small_chunks, no_gc):
    path = hta_file(relative)
    small_chunks(4096)
    raw = path.read_bytes()
    if raw[:2] == b"\x1f\x8b":
        raw = gzip.decompress(raw)
    expected = json.loads(raw)
    info = TraceFile(path)
    streamed = (event for batch in iter_events(path, info) for event in batch)
    pairs = enumerate(zip(streamed, expected["traceEvents"], strict=True))
    differs = next((i for i, (got, want) in pairs if got != want), None)  # one assert: rewriting costs per call
    assert differs is None, f"event {differs} differs from json.load's"
    assert info.events == len(expected["traceEvents"])
    assert info.meta == {k: v for k, v in expected.items() if k != "traceEvents"}
    assert info.bytes_read == len(raw)


def test_stream_reads_a_real_trace_split_into_gzip_members(tmp_path, no_gc, inflate):
    """`cat a.gz b.gz`: at the default chunk size, the first member ends in a decompress call fed the previous call's
    unconsumed input (its output was capped at CHUNK_BYTES); the next member must be read once, from its first byte."""
    raw = gzip.decompress(hta_file("nccl_parser_config/nccl_data.json.gz").read_bytes())
    cut = len(raw) * 9 // 10  # a first member of 8.8 MB decompressed: more than one capped decompress call
    path = tmp_path / "two-members.json.gz"
    path.write_bytes(gzip.compress(raw[:cut], 1) + gzip.compress(raw[cut:], 1))
    assert gzip.decompress(path.read_bytes()) == raw
    try:
        events, info = read_stream(path)
    except TraceReadError as error:
        pytest.fail(f"a valid two-member gzip (CHUNK_BYTES {stream.CHUNK_BYTES:,}) refused: {error}")
    expected = json.loads(raw)
    assert len(events) == len(expected["traceEvents"]) and events == expected["traceEvents"]
    assert info.bytes_read == len(raw)


def columns_of(trace: TraceEvents) -> dict[str, Any]:
    """Everything `read_trace` found, with arrays as lists (to compare two reads with one assert)."""
    kinds = ("device", "runtime", "cpu", "gpu_annotations")
    found = {kind: {k: v.tolist() for k, v in getattr(trace, kind).items()} for kind in kinds}
    fields = ("names", "events", "bytes_read", "origin_us", "rounded", "device_type", "rank", "meta")
    return found | {name: getattr(trace, name) for name in fields}


@pytest.mark.parametrize(
    "relative",
    [
        "nccl_parser_config/nccl_data.json.gz",
        "mtia_trace_single_rank/mtia_rank_0.json.gz",
        "call_stack/backward_thread.json",
    ],
)
def test_two_processes_read_what_one_reads(relative, monkeypatch, small_chunks, no_gc):
    """The parent and a forked child each decode every other run: merged in order, the columns, names (in the order
    of their first kept event), counts and metadata are one reader's."""
    path = hta_file(relative)
    monkeypatch.setattr(events_module, "SHARED_MIN_BYTES", 0)
    small_chunks(1 << 20)  # many runs for each process
    shared = []
    monkeypatch.setattr(events_module, "read_in_shares", lambda *a: shared.append(1) or read_in_shares(*a))
    assert columns_of(read_trace(path, processes=2)) == columns_of(read_trace(path))
    assert shared, "the shared read was not tried"


def test_two_processes_give_up_and_read_alone_when_a_cheap_cut_fails(tmp_path, monkeypatch, small_chunks):
    """One line and kernel names holding "},": a cheap cut lands inside a string. One reader then cuts exactly; two
    readers cannot agree on the cut, so the file is read again by one, with the same result."""
    trace = Kineto()
    for i in range(400):
        trace.kernel(f"void f<{{lambda(float)#{i}}}, at::Array<char*, 2>>(int)", 10.0 * i, 5.0, stream=7)
    path = trace.write(tmp_path / "trace.json", layout="compact")
    monkeypatch.setattr(events_module, "SHARED_MIN_BYTES", 0)
    small_chunks(1024)
    outcomes = []

    def spy(*args: Any) -> bool:
        outcomes.append(read_in_shares(*args))
        return outcomes[-1]

    monkeypatch.setattr(events_module, "read_in_shares", spy)
    assert columns_of(read_trace(path, processes=2)) == columns_of(read_trace(path))
    assert outcomes == [False]


def _gz(data: bytes) -> bytes:
    return gzip.compress(data)


def _flip(data: bytes, at: int, n: int = 8) -> bytes:
    out = bytearray(data)
    for i in range(at, at + n):
        out[i] ^= 0xFF
    return bytes(out)


def _good_trace() -> bytes:
    trace = Kineto()
    for i in range(20):
        trace.kernel(GEMM, 100 * i, 50)
    return trace.text("compact")


GOOD = _good_trace()
BAD_INPUTS = {
    "empty": (b"", "the file is empty"),
    "blank": (b"  \n\t\n", "the file is empty"),
    "empty-gzip": (_gz(b""), "the file is empty"),
    "text": (b"hello, this is not a trace\n", "the file is not JSON"),
    "binary": (b"\x89PNG\r\n\x1a\n\x00\x00", "the file is not JSON"),
    "no-trace-events": (b'{"schemaVersion": 1, "deviceProperties": []}', "the JSON has no traceEvents array"),
    "events-not-array": (b'{"traceEvents": {"a": 1}}', "the JSON has no traceEvents array"),
    "chrome-array-format": (b'[{"ph": "X", "ts": 1, "dur": 1}]', "the JSON has no traceEvents array"),
    "memory-timeline": (b"[[1, 2, 3], [4, 5, 6]]", "this looks like a memory timeline (export_memory_timeline)"),
    "execution-trace": (
        b'{"schema": "1.0.3-chakra.0.0.4", "pid": 1, "time": "x", "start_ts": 1, "nodes": [{"id": 1}]}',
        "this is a PyTorch execution trace (ExecutionTraceObserver)",
    ),
    "truncated-json": (GOOD[: len(GOOD) * 2 // 3], "the file ends inside traceEvents after"),
    "truncated-json-gz": (_gz(GOOD[: len(GOOD) * 2 // 3]), "(truncated)"),
    "malformed-event": (b'{"traceEvents": [{"ph": "X",, "ts": 1}]}', "the JSON is malformed"),
    "malformed-metadata": (b'{"traceEvents": [{"ph": "X"}], "displayTimeUnit": }', "the JSON is malformed"),
    "cut-gzip": (_gz(GOOD)[: len(_gz(GOOD)) // 2], "the gzip stream is cut short (the file is truncated)"),
    "corrupt-gzip": (_flip(_gz(GOOD), 40), "the gzip data is corrupt"),
    "bad-gzip-crc": (_flip(_gz(GOOD), len(_gz(GOOD)) - 8, 4), "the gzip data is corrupt"),
}


@pytest.mark.parametrize("content, reason", list(BAD_INPUTS.values()), ids=list(BAD_INPUTS))
def test_stream_refuses_bad_input_with_one_sentence(tmp_path, content, reason, inflate):
    path = tmp_path / "bad.json"
    path.write_bytes(content)
    got = reason_of(path)
    assert got.startswith(reason) or reason in got, f"reason {got!r} should say {reason!r}"
    assert "\n" not in got, "the reason is one line"


def test_truncation_reason_counts_the_events_read(tmp_path, small_chunks, inflate):
    small_chunks(256)
    trace = Kineto()
    for i in range(50):
        trace.kernel(ADD, 10 * i, 5)
    raw = trace.text()
    path = tmp_path / "t.json.gz"
    path.write_bytes(gzip.compress(raw[: len(raw) // 2]))
    got = reason_of(path)
    assert got.startswith("the file ends inside traceEvents after ") and got.endswith(" events (truncated)")
    count = int(got.split(" after ")[1].split(" events")[0].replace(",", ""))
    assert 0 < count < len(trace.events), "the events before the cut are counted"


def test_missing_file_is_an_oserror(tmp_path):
    with pytest.raises(OSError):
        read_stream(tmp_path / "absent.json")


# ---------------------------------------------------------------------------------------------------------------------
# events.py: read_trace, rank_of, trace_files
# ---------------------------------------------------------------------------------------------------------------------


def test_read_trace_columns(tmp_path):
    trace = Kineto(rank=5)
    trace.step(1, 0, 100)
    trace.host("aten::mm", 10, 20)
    trace.kernel(GEMM, 30, 15, launch=12, stream=7)
    trace.memcpy(50, 10, launch=20, stream=20)
    trace.events.append({"ph": "X", "cat": "gpu_user_annotation", "name": "fwd", "pid": 0, "tid": 7,
                         "ts": ORIGIN_US + 30, "dur": 15, "args": {}})  # fmt: skip
    trace.events.append({"ph": "X", "cat": "python_function", "name": "train.py(1): <module>", "pid": 100, "tid": 1,
                         "ts": ORIGIN_US + 1, "dur": 90, "args": {"Python id": 1}})  # fmt: skip
    trace.events.append({"ph": "i", "cat": "cpu_instant_event", "name": "[memory]", "pid": 100, "tid": 1, "s": "t",
                         "ts": ORIGIN_US + 3, "args": {"Bytes": 4}})  # fmt: skip
    t = read_trace(trace.write(tmp_path / "t.json.gz"))
    assert isinstance(t, TraceEvents)
    assert (t.rank, t.rank_source, t.device_type, t.rounded) == (5, "distributedInfo", "cuda", False)
    assert t.origin_us == ORIGIN_US, "times are relative to the first kept event (the ProfilerStep)"
    assert t.events == len(trace.events), "events counts every event of the file"
    names = [t.names[i] for i in t.device["name"]]
    assert names == [GEMM, "Memcpy HtoD (Pageable -> Device)"]
    assert t.device["ts"].tolist() == [30, 50] and t.device["end"].tolist() == [45, 60]
    assert t.device["stream"].tolist() == [7, 20]
    assert t.device["kind"].tolist() == [0, 1], "kernel, then memcpy"
    assert t.device["correlation"].tolist() == [1, 2]
    assert [t.names[i] for i in t.runtime["name"]] == ["cudaLaunchKernel", "cudaMemcpyAsync"]
    assert t.runtime["ts"].tolist() == [12, 20] and t.runtime["correlation"].tolist() == [1, 2]
    assert [t.names[i] for i in t.cpu["name"]] == ["ProfilerStep#1", "aten::mm"], "python stacks are dropped"
    assert t.cpu["kind"].tolist() == [1, 0], "user annotation, cpu op"
    assert t.cpu["end"].tolist() == [100, 30]
    assert [t.names[i] for i in t.gpu_annotations["name"]] == ["fwd"]
    assert t.gpu_annotations["stream"].tolist() == [7]


@pytest.mark.parametrize(
    "device, kernel_cat, expected",
    [
        ("NVIDIA H100 80GB HBM3", "kernel", "cuda"),
        ("AMD Instinct MI250X", "kernel", "rocm"),
        ("ARTEMIS", "mtia_ccp_events", "mtia"),
        (None, "mtia_ccp_events", "mtia"),
        (None, None, "cpu"),
    ],
)
def test_device_type(tmp_path, device, kernel_cat, expected):
    trace = Kineto(device=device)
    trace.step(1, 0, 100)
    trace.host("aten::add", 10, 10)
    if kernel_cat:
        trace.kernel("k", 20, 10, cat=kernel_cat)
    assert read_trace(trace.write(tmp_path / "t.json")).device_type == expected


def test_fractional_timestamps_are_rounded_as_hta(tmp_path):
    """ns-resolution traces: start rounded up, end down (HTA), so back-to-back kernels do not overlap."""
    trace = Kineto(origin=1_000_000)
    trace.kernel(GEMM, 100.4, 10.2, launch=95.25)  # [100.4, 110.6) -> [101, 110)
    trace.kernel(GEMM, 110.5, 9.9, launch=96.5)  # [110.5, 120.4) -> [111, 120): overlapping by 0.1 µs unrounded
    path = trace.write(tmp_path / "ns.json")
    t = read_trace(path)
    assert t.rounded
    assert t.origin_us == 1_000_096, "the first kept event, a launch at 95.25 µs, rounded up"
    assert t.device["ts"].tolist() == [5, 15] and t.device["end"].tolist() == [14, 24]
    assert t.runtime["ts"].tolist() == [0, 1] and t.runtime["end"].tolist() == [1, 2]  # 95.25+2 -> floor 97
    rank = only_rank(analyze_trace(path, jobs=1))
    assert rank.kernel_span_ms == approx(0.019)
    assert rank.idle_pct == approx(100 / 19), "the 1 µs between the rounded kernels is idle"
    assert rank.idle_breakdown == {"host_wait_pct": 0.0, "kernel_wait_pct": 100.0, "other_pct": 0.0}


def test_whole_microsecond_timestamps_are_not_rounded(tmp_path):
    """HTA rounds only when the ts column is not integral: a fractional dur alone leaves times as they are."""
    trace = Kineto()
    trace.kernel(GEMM, 100, 10.5)
    t = read_trace(trace.write(tmp_path / "us.json"))
    assert not t.rounded
    assert (t.device["end"] - t.device["ts"]).tolist() == [10.5]


def test_one_fractional_timestamp_anywhere_rounds_all(tmp_path):
    trace = Kineto()
    trace.kernel(GEMM, 100, 10.5)
    trace.events.append({"ph": "i", "name": "mark", "pid": 1, "tid": 1, "ts": ORIGIN_US + 0.5, "s": "t"})
    t = read_trace(trace.write(tmp_path / "mixed.json"))
    assert t.rounded and (t.device["end"] - t.device["ts"]).tolist() == [10.0]


@pytest.mark.parametrize("odd", [{"ph": "Z"}, {}, {"ph": 5}], ids=["unknown-phase", "no-phase", "phase-not-text"])
def test_events_of_odd_phases_count_by_their_timestamp_alone(tmp_path, odd):
    """The decoder tells complete events from the others by their phase: an event of a phase it does not know (or
    none) sends its run to the generic decoder, which reads the same: its fractional ts rounds the trace, the rest
    of it is not kept."""
    trace = Kineto()
    trace.kernel(GEMM, 100, 10.5)
    trace.events.append({**odd, "cat": "kernel", "name": "odd", "ts": ORIGIN_US + 0.5, "dur": 3, "args": {"stream": 7}})
    t = read_trace(trace.write(tmp_path / "odd.json"))
    assert t.rounded and (t.device["end"] - t.device["ts"]).tolist() == [10.0]
    assert [t.names[i] for i in t.device["name"].tolist()] == [GEMM]


@pytest.mark.parametrize(
    "name, meta, expected",
    [
        ("trace.json", {"distributedInfo": {"rank": 3}}, (3, "distributedInfo")),
        ("rank7.json", {"distributedInfo": {"rank": 3}}, (3, "distributedInfo")),
        ("x.json", {"distributedInfo": {"rank": "2"}}, (2, "distributedInfo")),
        ("rank-5.Apr_03.pt.trace.json.gz", {}, (5, "file name")),
        ("inference_rank_12.json.gz", {"distributedInfo": {"backend": "nccl"}}, (12, "file name")),
        ("RANK9.json", {"distributedInfo": None}, (9, "file name")),
        ("worker0.json", {}, (0, "default")),
        ("rank_not_found.json.gz", {"distributedInfo": {"rank": -1}}, (0, "default")),
    ],
)
def test_rank_of(name, meta, expected):
    assert rank_of(Path("/some/job") / name, meta) == expected


def test_trace_files_expands_folders(tmp_path):
    for name in ["b/rank1.json.gz", "a/rank0.json", "a/notes.txt", "a/rank2.json.bak", "c.json", "d/e/f.json"]:
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text("{}")
    found = trace_files([tmp_path / "a", tmp_path / "b", tmp_path / "d", tmp_path / "c.json", tmp_path / "x.txt"])
    assert [p.relative_to(tmp_path).as_posix() for p in found] == [
        "a/rank0.json", "b/rank1.json.gz", "d/e/f.json", "c.json", "x.txt"
    ]  # fmt: skip


# ---------------------------------------------------------------------------------------------------------------------
# breakdown.py: HTA's definitions
# ---------------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "name, expected",
    [
        (COMM, bd.COMMUNICATION),
        ("ncclDevKernel_AllGather_RING_LL(ncclDevComm*, unsigned long, ncclWork*)", bd.COMMUNICATION),
        ("Memcpy HtoD (Pageable -> Device)", bd.MEMORY),
        ("Memset (Device)", bd.MEMORY),
        ("dma_request", bd.MEMORY),
        (GEMM, bd.COMPUTATION),
        ("event_wait", bd.COMPUTATION),
        ("nccl_not_a_kernel_launch", bd.COMPUTATION),
        ("Event Sync", bd.OTHER),
        ("Context Sync", bd.OTHER),
        ("void copy_Memcpy_like_kernel", bd.OTHER),
    ],
)
def test_kernel_type(name, expected):
    assert bd.kernel_type(name) == expected, f"{name!r} should be {bd.KERNEL_TYPES[expected]}"


def _iv(*pairs: tuple[float, float]) -> tuple[np.ndarray, np.ndarray]:
    return np.array([a for a, _ in pairs], float), np.array([b for _, b in pairs], float)


def test_interval_arithmetic():
    merged = bd.merge(*_iv((30, 40), (0, 10), (10, 20), (5, 8), (35, 50), (60, 61)))
    assert merged[0].tolist() == [0, 30, 60] and merged[1].tolist() == [20, 50, 61], "touching intervals merge"
    assert bd.length(merged) == 41
    assert bd.intersection(_iv((0, 50)), _iv((25, 100))) == 25
    assert bd.intersection(_iv((0, 10), (20, 30)), _iv((5, 25))) == 10
    assert bd.intersection(_iv((0, 10)), _iv((10, 20))) == 0
    clipped = bd.clip(merged, 5, 35)
    assert clipped[0].tolist() == [5, 30] and clipped[1].tolist() == [20, 35]
    empty = bd.merge(np.zeros(0), np.zeros(0))
    assert bd.length(empty) == 0 and bd.intersection(empty, merged) == 0


def three_steps(step_us: float = 100) -> Kineto:
    trace = Kineto()
    for n in range(3):
        trace.step(n + 1, n * step_us, step_us)
    return trace


def test_idle_is_the_uncovered_share_of_the_kernel_span(tmp_path):
    """Kernels cover 60 of the 100 µs from the first kernel's start to the last one's end; the last step is dropped."""
    trace = three_steps()
    trace.kernel(GEMM, 10, 30, launch=5)  # [10, 40)
    trace.kernel(GEMM, 80, 30, launch=60)  # [80, 110): launched after the first ended
    trace.kernel(GEMM, 210, 80, launch=205)  # launched in the last step: outside the window
    trace.memcpy(290, 5, launch=206)
    rank = analyse(trace, tmp_path)
    assert rank.steps == 2 and rank.step_ms == approx(0.1)
    assert rank.kernel_span_ms == approx(0.1)
    assert (rank.idle_pct, rank.compute_pct, rank.non_compute_pct) == (approx(40), approx(60), approx(0))
    assert rank.idle_breakdown == {"host_wait_pct": 100.0, "kernel_wait_pct": 0.0, "other_pct": 0.0}
    assert rank.wall == {"basis_ms": approx(0.2), "idle_pct": approx(70), "compute_pct": approx(30),
                         "non_compute_pct": approx(0)}  # fmt: skip
    assert rank.overlap_pct is None and rank.exposed_comm_pct is None, "no communication kernels"
    assert [(k.name, k.count, k.total_us) for k in rank.top_kernels] == [(GEMM, 2, 60.0)]
    assert rank.notes == []


def test_window_keeps_kernels_by_their_launch(tmp_path):
    trace = three_steps()
    trace.kernel(GEMM, 10, 40, launch=5)  # [10, 50)
    trace.kernel(GEMM, 250, 40, launch=150)  # launched in step 2, runs during step 3: kept
    trace.kernel(GEMM, 220, 20, launch=210)  # launched in step 3: dropped
    rank = analyse(trace, tmp_path)
    assert rank.kernel_span_ms == approx(0.28)
    assert rank.idle_pct == approx(100 * 200 / 280)


def test_single_profiler_step_keeps_everything(tmp_path):
    trace = Kineto()
    trace.step(1, 0, 100)
    trace.kernel(GEMM, 10, 30, launch=5)
    trace.kernel(GEMM, 150, 10, launch=140)  # after the only step
    rank = analyse(trace, tmp_path)
    assert rank.steps == 1
    assert rank.idle_pct == approx(100 * 110 / 150)
    assert any("fewer than two ProfilerSteps" in note for note in rank.notes), rank.notes


def test_no_profiler_step(tmp_path):
    trace = Kineto()
    trace.kernel(GEMM, 0, 50)
    trace.kernel(GEMM, 100, 50, launch=0)
    rank = analyse(trace, tmp_path)
    assert (rank.steps, rank.step_ms, rank.wall) == (0, None, None)
    assert rank.idle_pct == approx(100 / 3)
    assert rank.idle_breakdown == {"host_wait_pct": 0.0, "kernel_wait_pct": 0.0, "other_pct": 100.0}


def test_overlap_is_the_share_of_communication_under_computation(tmp_path):
    trace = Kineto()
    trace.kernel(COMM, 0, 50, stream=20)  # communication [0, 50)
    trace.kernel(GEMM, 25, 75, stream=7)  # computation [25, 100)
    rank = analyse(trace, tmp_path)
    assert rank.overlap_pct == approx(50)
    assert rank.exposed_comm_pct == approx(25)
    assert (rank.idle_pct, rank.compute_pct, rank.non_compute_pct) == (approx(0), approx(75), approx(25))
    assert rank.kernel_types == {
        "communication": {"time_ms": approx(0.05), "pct": approx(40)},
        "computation": {"time_ms": approx(0.075), "pct": approx(60)},
    }
    assert [k.type for k in rank.top_kernels] == ["computation", "communication"]


def test_memory_copies_are_non_compute(tmp_path):
    trace = Kineto()
    trace.kernel(GEMM, 0, 50)
    trace.memcpy(50, 30, launch=10)
    rank = analyse(trace, tmp_path)
    assert (rank.idle_pct, rank.compute_pct, rank.non_compute_pct) == (approx(0), approx(62.5), approx(37.5))
    assert rank.kernel_types["memory"]["pct"] == approx(37.5)
    assert rank.overlap_pct is None


@pytest.mark.parametrize(
    "launch, start, expected",
    [
        (15, 40, "host_wait"),  # launched after the previous kernel ended (at 10): the GPU waited for the host
        (10, 30, "kernel_wait"),  # launched exactly as it ended: not after it, and a 20 µs gap
        (2, 20, "kernel_wait"),  # launched early, 10 µs gap: launch latency
        (2, 39, "kernel_wait"),  # 29 µs
        (2, 40, "other"),  # 30 µs: not under HTA's 30 µs
        (2, 110, "other"),  # launched early, 100 µs gap: waiting on something else
    ],
)
def test_idle_breakdown_categories(tmp_path, launch, start, expected):
    trace = Kineto()
    trace.kernel(GEMM, 0, 10, launch=-5)
    trace.kernel(GEMM, start, 10, launch=launch)
    rank = analyse(trace, tmp_path)
    shares = {k.removesuffix("_pct"): v for k, v in rank.idle_breakdown.items()}
    assert shares == {k: (100.0 if k == expected else 0.0) for k in shares}, f"the gap should be {expected}"


def test_idle_breakdown_sums_gaps_over_streams(tmp_path):
    trace = Kineto()
    trace.kernel(GEMM, 0, 10, launch=-5)
    trace.kernel(GEMM, 30, 10, launch=20)  # host wait 20
    trace.kernel(GEMM, 50, 10, launch=25)  # kernel wait 10
    trace.kernel(GEMM, 160, 10, launch=30)  # other 100
    trace.kernel(ADD, 0, 20, stream=8, launch=-4)
    trace.kernel(ADD, 70, 20, stream=8, launch=60)  # host wait 50
    trace.kernel(ADD, 90, 5, stream=8, launch=61)  # back to back: a 0 µs kernel wait
    rank = analyse(trace, tmp_path)
    assert rank.idle_breakdown == {
        "host_wait_pct": approx(100 * 70 / 180), "kernel_wait_pct": approx(100 * 10 / 180),
        "other_pct": approx(100 * 100 / 180),
    }  # fmt: skip
    assert rank.idle_pct == approx(100 * 95 / 170), "busy: [0, 20) [30, 40) [50, 60) [70, 95) [160, 170)"


def test_top_kernels(tmp_path):
    trace = Kineto()
    for i in range(3):
        trace.kernel(ADD, 100 * i, 10)
    trace.kernel(GEMM, 400, 50)
    trace.kernel(COMM, 500, 5, stream=20)
    trace.kernel(COMM, 600, 5, stream=20)
    rank = analyse(trace, tmp_path, top=2)
    assert [(k.name, k.type, k.count, k.total_us, k.mean_us) for k in rank.top_kernels] == [
        (GEMM, "computation", 1, 50.0, 50.0),
        (ADD, "computation", 3, 30.0, 10.0),
    ]
    assert [k.pct for k in rank.top_kernels] == [approx(500 / 9), approx(300 / 9)], "shares of all device time"


# ---------------------------------------------------------------------------------------------------------------------
# analyze.py: verdicts, data loading, phases, CPU-only, jobs and stragglers
# ---------------------------------------------------------------------------------------------------------------------


def data_bound_trace(rank: int = 0) -> Kineto:
    """Steps of 1 ms: the DataLoader takes the first 600 µs with the GPU idle, then one 300 µs kernel."""
    trace = Kineto(rank=rank)
    for n in range(3):
        t0 = 1000 * n
        trace.step(n + 1, t0, 1000)
        trace.host(LOADER, t0, 600, cat="user_annotation")
        trace.kernel(GEMM, t0 + 650, 300, launch=t0 + 620)
    return trace


def test_data_bound_verdict(tmp_path):
    rank = analyse(data_bound_trace(), tmp_path)
    loading = rank.data_loading
    assert (loading.spans, loading.per_step_ms) == (2, approx(0.6)), "the dropped step's span is not counted"
    assert (loading.step_share_pct, loading.gpu_idle_pct) == (approx(60), approx(100))
    assert rank.idle_pct == approx(100 * 700 / 1300)
    assert (rank.verdict.bound, rank.verdict.confidence) == ("data", "high"), rank.verdict
    assert (
        rank.verdict.evidence[0]
        == "DataLoader spans take 0.6 ms per step (60% of the step), the GPU idle for 100% of them"
    )


def test_comms_bound_verdict(tmp_path):
    trace = Kineto()
    for n in range(3):
        t0 = 1000 * n
        trace.step(n + 1, t0, 1000)
        trace.kernel(GEMM, t0 + 10, 300, launch=t0 + 5)
        trace.kernel(COMM, t0 + 310, 680, launch=t0 + 6, stream=20)
    rank = analyse(trace, tmp_path)
    assert rank.overlap_pct == approx(0)
    assert rank.exposed_comm_pct == approx(100 * 1360 / 1980)
    assert (rank.verdict.bound, rank.verdict.confidence) == ("comms", "high"), rank.verdict
    assert rank.verdict.evidence[0].startswith("communication not overlapped by computation is 68.7% of the kernel")


def test_compute_bound_verdict(tmp_path):
    trace = Kineto()
    for n in range(3):
        t0 = 1000 * n
        trace.step(n + 1, t0, 1000)
        for i in range(10):
            trace.kernel(GEMM, t0 + 100 * i, 95, launch=t0 + i)
    rank = analyse(trace, tmp_path)
    assert rank.compute_pct == approx(100 * 1900 / 1995)
    assert (rank.verdict.bound, rank.verdict.confidence) == ("compute", "high"), rank.verdict


def test_host_bound_verdict(tmp_path):
    trace = Kineto()
    for n in range(3):
        t0 = 1000 * n
        trace.step(n + 1, t0, 1000)
        for i in range(10):
            trace.kernel(ADD, t0 + 100 * i + 50, 10, launch=t0 + 100 * i + 45)  # each launched after the last ended
    rank = analyse(trace, tmp_path)
    assert rank.idle_breakdown["host_wait_pct"] == approx(100)
    assert rank.verdict.bound == "host", rank.verdict
    assert "waiting for the host" in rank.verdict.evidence[0]


def test_stepscope_phases(tmp_path):
    trace = Kineto()
    for n in range(3):
        t0 = 1000 * n
        trace.step(n + 1, t0, 1000)
        trace.host("stepscope/forward", t0 + 100, 300, cat="user_annotation")
        trace.host("stepscope/backward", t0 + 400, 500, cat="user_annotation")
        trace.kernel(GEMM, t0 + 120, 700)
    rank = analyse(trace, tmp_path)
    assert rank.phases_ms == {"forward": approx(0.3), "backward": approx(0.5)}


def test_cpu_only_trace(tmp_path):
    trace = Kineto(device=None)
    for n in range(3):
        trace.step(n + 1, 1000 * n, 1000)
    trace.host("aten::linear", 100, 500)
    trace.host("aten::addmm", 150, 400)  # nested: counted once
    trace.host("aten::add", 1100, 300)
    trace.host("Optimizer.step#SGD.step", 1500, 400)  # not an ATen op
    trace.host("aten::mm", 2100, 800)  # in the dropped step
    trace.host("aten::mm", 0, 2000, tid=2)  # another thread
    rank = analyse(trace, tmp_path)
    assert rank.device_type == "cpu"
    gpu = (rank.kernel_span_ms, rank.idle_pct, rank.compute_pct, rank.non_compute_pct, rank.overlap_pct)
    assert gpu == (None,) * 5 and rank.idle_breakdown is None and rank.top_kernels == []
    assert rank.cpu is not None
    assert (rank.cpu.thread, rank.cpu.basis_ms) == (1, approx(2.0))
    assert (rank.cpu.computation_pct, rank.cpu.other_pct) == (approx(40), approx(60))
    assert rank.verdict.bound == "unknown" and "CPU-only trace" in rank.verdict.evidence[0]


def test_dataloader_pattern():
    assert DATALOADER.search(LOADER)
    assert DATALOADER.search("enumerate(DataLoader)#_MultiProcessingDataLoaderIter.__next__")
    assert not DATALOADER.search("aten::to")


def uniform_rank(rank: int, step_us: float) -> Kineto:
    """Three steps of ``step_us``; each runs one 800 µs kernel 100 µs after the step starts."""
    trace = Kineto(rank=rank)
    for n in range(3):
        t0 = step_us * n
        trace.step(n + 1, t0, step_us)
        trace.kernel(GEMM, t0 + 100, 800, launch=t0 + 50)
    return trace


def test_straggler_among_three_ranks(tmp_path):
    job = tmp_path / "job"
    for rank, step_us in [(0, 1000), (1, 1000), (2, 1300)]:
        uniform_rank(rank, step_us).write(job / f"rank{rank}.json")
    analysis = analyze_trace(job, jobs=1)
    assert [r.rank for r in analysis.ranks] == [0, 1, 2]
    assert [r.step_ms for r in analysis.ranks] == [approx(1.0), approx(1.0), approx(1.3)]
    assert len(analysis.stragglers) == 1, analysis.stragglers
    slow = analysis.stragglers[0]
    assert (slow["job"], slow["rank"], slow["step_ms"], slow["median_step_ms"]) == (str(job), 2, approx(1.3), 1.0)
    assert slow["slower_pct"] == approx(30)
    assert slow["why"] == "GPU idle: +0.15 ms per step over the other ranks' median"
    assert analysis.spread[str(job)]["step_ms"] == {"min": 1.0, "max": approx(1.3), "mean": approx(1.1),
                                                    "range": approx(0.3)}  # fmt: skip
    assert analysis.warnings == []


def test_straggler_in_a_two_rank_folder(tmp_path):
    job = tmp_path / "job"
    uniform_rank(0, 1000).write(job / "a.json")
    uniform_rank(1, 1300).write(job / "b.json.gz")
    analysis = analyze_trace(job, jobs=1)
    assert [s["rank"] for s in analysis.stragglers] == [1]
    slow = analysis.stragglers[0]
    assert slow["median_step_ms"] == approx(1.0), "the median of the other ranks"
    assert slow["why"].startswith("GPU idle: +"), slow["why"]


def test_no_straggler_when_ranks_agree(tmp_path):
    job = tmp_path / "job"
    for rank, step_us in [(0, 1000), (1, 1020)]:
        uniform_rank(rank, step_us).write(job / f"rank{rank}.json")
    assert analyze_trace(job, jobs=1).stragglers == [], "2% slower is under the 5% threshold"


def test_duplicate_ranks_in_a_folder(tmp_path):
    job = tmp_path / "job"
    uniform_rank(0, 1000).write(job / "first.json")
    uniform_rank(0, 1300).write(job / "second.json")
    analysis = analyze_trace(job, jobs=1)
    assert [r.rank for r in analysis.ranks] == [0, 0], "both files are still analysed"
    assert analysis.stragglers == [] and str(job) not in analysis.spread
    assert any("rank(s) 0 appear in more than one file" in w for w in analysis.warnings), analysis.warnings


def test_folders_are_separate_jobs(tmp_path):
    uniform_rank(0, 1000).write(tmp_path / "a" / "rank0.json")
    uniform_rank(1, 1000).write(tmp_path / "a" / "rank1.json")
    data_bound_trace(0).write(tmp_path / "b" / "rank0.json")
    analysis = analyze_trace([tmp_path / "a", tmp_path / "b"], jobs=1)
    assert sorted((r.job, r.rank) for r in analysis.ranks) == [
        (str(tmp_path / "a"), 0), (str(tmp_path / "a"), 1), (str(tmp_path / "b"), 0)
    ]  # fmt: skip
    assert analysis.warnings == [], "the same rank in two folders is two jobs, not a duplicate"
    assert analysis.verdict.bound == "unknown" and "several jobs" in analysis.verdict.evidence[0]


def test_job_verdict_counts_ranks(tmp_path):
    for rank in range(3):
        data_bound_trace(rank).write(tmp_path / f"rank{rank}.json")
    analysis = analyze_trace(tmp_path, jobs=1)
    assert analysis.verdict.bound == "data"
    assert analysis.verdict.evidence[0] == "3 of 3 ranks are data-bound"


def test_ranks_filter(tmp_path):
    for rank in range(3):
        uniform_rank(rank, 1000).write(tmp_path / f"rank{rank}.json")
    analysis = analyze_trace(tmp_path, ranks=[1, 2], jobs=1)
    assert [r.rank for r in analysis.ranks] == [1, 2]
    assert [f.ok for f in analysis.files] == [True] * 3, "every file is still read and listed"


def test_parallel_reading_gives_the_same_analysis(tmp_path, monkeypatch):
    import stepscope.analyses.trace.analyze as analyze

    monkeypatch.setattr(analyze, "PARALLEL_MIN_BYTES", 0)  # small files: force the worker processes
    for rank in range(3):
        uniform_rank(rank, 1000 + 100 * rank).write(tmp_path / f"rank{rank}.json.gz")
    serial, parallel = analyze_trace(tmp_path, jobs=1).to_dict(), analyze_trace(tmp_path, jobs=2).to_dict()
    for result in (serial, parallel):
        for status in result["files"]:
            status.pop("read_s")
    assert (serial.pop("read")["processes"], parallel.pop("read")["processes"]) == (1, 2)
    assert parallel == serial


def test_good_and_bad_files_in_one_folder(tmp_path):
    uniform_rank(0, 1000).write(tmp_path / "rank0.json")
    for name, (content, _) in BAD_INPUTS.items():
        (tmp_path / f"{name}.json").write_bytes(content)
    analysis = analyze_trace(tmp_path, jobs=1)
    assert [r.rank for r in analysis.ranks] == [0]
    statuses = {Path(f.path).name: f for f in analysis.files}
    assert statuses["rank0.json"].ok and statuses["rank0.json"].rank == 0
    for name, (_, reason) in BAD_INPUTS.items():
        status = statuses[f"{name}.json"]
        assert not status.ok and reason in status.reason, f"{name}: {status.reason!r}"


def test_odd_events_do_not_stop_the_analysis(tmp_path):
    """A traceEvents array holding something else than objects (a null, a number) must not crash the analysis."""
    uniform_rank(0, 1000).write(tmp_path / "rank0.json")
    (tmp_path / "rank1.json").write_text(
        '{"distributedInfo": {"rank": 1}, "traceEvents": [null, 3, {"ph": "X", "cat": "kernel", "name": "k", '
        '"ts": 1, "dur": 2, "args": {"stream": 7, "correlation": 1}}]}'
    )
    try:
        analysis = analyze_trace(tmp_path, jobs=1)
    except Exception as error:  # the file should be analysed without the odd items, or listed with a reason
        pytest.fail(f"analyze_trace raised {error!r} on a traceEvents array holding a null")
    assert 0 in [r.rank for r in analysis.ranks]
    status = next(f for f in analysis.files if f.path.endswith("rank1.json"))
    assert status.ok or status.reason


def test_absent_file_is_listed(tmp_path):
    analysis = analyze_trace(tmp_path / "absent.json", jobs=1)
    assert analysis.ranks == []
    assert [(f.ok, f.reason) for f in analysis.files] == [(False, "No such file or directory")]


def test_nothing_found(tmp_path):
    analysis = analyze_trace(tmp_path, jobs=1)
    assert analysis.ranks == [] and analysis.files == []
    assert analysis.warnings and "no .json or .json.gz files found" in analysis.warnings[0]
    assert analysis.verdict.bound == "unknown"


def test_to_dict_is_json(tmp_path):
    uniform_rank(0, 1000).write(tmp_path / "rank0.json")
    result = json.loads(json.dumps(analyze_trace(tmp_path, jobs=1).to_dict()))
    assert result["definitions"] == DEFINITIONS


# ---------------------------------------------------------------------------------------------------------------------
# Real traces and HTA's own numbers
# ---------------------------------------------------------------------------------------------------------------------


def _reference_cases() -> list[Any]:
    """One case per file or folder HTA was run on (its path relative to HTA's tests/data); a missing reference is
    one failing case."""
    if not REFERENCE.exists():
        return [pytest.param(None, None, id="reference-missing")]
    traces = json.loads(REFERENCE.read_text()).get("traces", {})
    return [pytest.param(r.removeprefix("hta/"), e, id=r.removeprefix("hta/")) for r, e in sorted(traces.items())]


TOLERANCE_PP = 0.5  # HTA rounds its percentages to 2 decimals


def _close(mine: float | None, hta: float | None, what: str, rank: int) -> None:
    if hta is None:
        assert mine is None, f"rank {rank} {what}: HTA has none, stepscope {mine}"
    else:
        assert mine is not None and abs(mine - hta) <= TOLERANCE_PP, f"rank {rank} {what}: stepscope {mine}, HTA {hta}"


@pytest.mark.parametrize("relative, entry", _reference_cases())
def test_agrees_with_hta(relative, entry):
    """analyze_trace on each file (or folder) HTA was run on gives HTA's figures within 0.5 percentage points."""
    if relative is None:
        pytest.fail(f"HTA's reference figures are missing: {REFERENCE} (bench/hta_reference.py writes it)")
    path = hta_file(relative)
    analysis = analyze_trace(path, jobs=1, top=50)
    hta_ranks = entry.get("ranks") or {}
    if not hta_ranks:
        assert analysis.ranks == [], f"HTA could not load it ({entry.get('errors')}); stepscope analysed it"
        assert [f.ok for f in analysis.files] == [False] * len(analysis.files)
        return
    ours = {r.rank: r for r in analysis.ranks}
    assert sorted(ours) == sorted(map(int, hta_ranks)), "the same ranks as HTA"
    for key, hta in hta_ranks.items():
        rank = ours[int(key)]
        temporal = hta.get("temporal") or {}
        for figure in ("idle_pct", "compute_pct", "non_compute_pct"):
            _close(getattr(rank, figure), temporal.get(figure), figure, rank.rank)
        _close(rank.overlap_pct, hta.get("comm_comp_overlap_pct"), "overlap_pct", rank.rank)
        idle = (hta.get("idle_breakdown") or {}).get("rank_sum_over_streams") or {}
        hta_idle = {k: (idle.get(k) or {}).get("pct") for k in ("host_wait", "kernel_wait", "other")}
        if all(v is None for v in hta_idle.values()):
            assert rank.idle_breakdown is None, f"rank {rank.rank}: HTA found no idle gaps"
        else:
            assert rank.idle_breakdown is not None, f"rank {rank.rank}: HTA has an idle breakdown, stepscope none"
            for k, v in hta_idle.items():
                _close(rank.idle_breakdown[f"{k}_pct"], v or 0.0, f"idle {k}", rank.rank)
        for kernel in (hta.get("kernel_breakdown") or {}).get("top_kernels") or []:
            if kernel["sum_us"] <= 0:
                continue
            # the reference cuts names at 200 characters
            total = sum(k.total_us for k in rank.top_kernels if k.name.startswith(kernel["name"]))
            assert total == pytest.approx(kernel["sum_us"], abs=1), f"rank {rank.rank}: {kernel['name'][:60]}"


@pytest.mark.parametrize("relative, reason", list(NOT_KINETO.items()), ids=list(NOT_KINETO))
def test_not_kineto_files_get_their_reason(relative, reason):
    analysis = analyze_trace(hta_file(relative), jobs=1)
    assert analysis.ranks == []
    assert [(f.ok, f.reason) for f in analysis.files] == [(False, reason)]


@pytest.mark.parametrize(
    "relative, rank, source, device",
    [
        ("rank_unavailable/rank_not_found.json.gz", 0, "default", "cpu"),
        ("distributed_info_unavailable/distributed_info_not_found.json.gz", 0, "default", "cpu"),
        ("mtia_inference_trace/mtia_inference_rank_0.json.gz", 0, "file name", "mtia"),
        ("amd_trace/mi250_minitoy_train_ROCm6_2_kineto.json.gz", 0, "default", "rocm"),
        ("cpu_only/rank-34.Jul_15_10_52_41.1074.pt.trace.json.gz", 34, "distributedInfo", "cpu"),
        ("trace_compare/base/base.json.gz", 1, "distributedInfo", "cuda"),
    ],
)
def test_real_trace_rank_and_device(relative, rank, source, device, no_gc):
    t = read_trace(hta_file(relative))
    assert (t.rank, t.rank_source, t.device_type) == (rank, source, device)


def test_rank_from_the_file_name_of_a_real_trace(tmp_path):
    shutil.copy(hta_file("rank_unavailable/rank_not_found.json.gz"), tmp_path / "rank-3.json.gz")
    rank = only_rank(analyze_trace(tmp_path, jobs=1))
    assert (rank.rank, rank.rank_source) == (3, "file name")


@pytest.mark.parametrize("relative", ["amd_trace/mi250_minitoy_train_ROCm6_2_kineto.json.gz",
                                      "mtia_inference_trace/mtia_inference_rank_0.json.gz"])  # fmt: skip
def test_amd_and_mtia_traces_are_analysed(relative):
    rank = only_rank(analyze_trace(hta_file(relative), jobs=1))
    assert rank.idle_pct is not None and rank.top_kernels, "device figures for a non-CUDA accelerator"
    assert rank.idle_pct + rank.compute_pct + rank.non_compute_pct == approx(100, 1e-6)


@pytest.mark.parametrize("relative", ["cpu_only/rank-34.Jul_15_10_52_41.1074.pt.trace.json.gz",
                                      "rank_non_gpu/rank_non_gpu.json.gz"])  # fmt: skip
def test_real_cpu_only_traces(relative):
    rank = only_rank(analyze_trace(hta_file(relative), jobs=1))
    assert rank.cpu is not None and 0 <= rank.cpu.computation_pct <= 100 and rank.cpu.basis_ms > 0
    gpu = (rank.kernel_span_ms, rank.idle_pct, rank.compute_pct, rank.non_compute_pct, rank.overlap_pct)
    assert gpu == (None,) * 5 and rank.idle_breakdown is None and rank.wall is None


def test_real_truncated_and_corrupt_traces(tmp_path, inflate):
    """A real trace cut in the middle and re-gzipped, one with flipped bytes, and a good one: the good one counts."""
    source = hta_file("trace_filter/sampled_rank-1.json.gz")
    raw = gzip.decompress(source.read_bytes())
    (tmp_path / "cut.json.gz").write_bytes(gzip.compress(raw[: len(raw) // 2]))
    data = source.read_bytes()
    (tmp_path / "flipped.json.gz").write_bytes(_flip(data, len(data) // 2))
    (tmp_path / "short.json.gz").write_bytes(data[: len(data) // 2])
    shutil.copy(hta_file("trace_filter/sampled_rank-0.json.gz"), tmp_path / "good.json.gz")
    analysis = analyze_trace(tmp_path, jobs=1)
    assert [r.rank for r in analysis.ranks] == [0]
    reasons = {Path(f.path).name: f.reason for f in analysis.files}
    assert reasons["good.json.gz"] == ""
    assert reasons["cut.json.gz"].startswith("the file ends inside traceEvents after ")
    assert reasons["cut.json.gz"].endswith(" events (truncated)")
    assert reasons["flipped.json.gz"].startswith("the gzip data is corrupt")
    assert reasons["short.json.gz"] == "the gzip stream is cut short (the file is truncated)"


# ---------------------------------------------------------------------------------------------------------------------
# highlights.py: what a RunSummary carries (summary.trace)
# ---------------------------------------------------------------------------------------------------------------------

HOSTILE = '<script>alert(1)</script>_kernel<float, "q">'
RANK_HIGHLIGHTS = {
    "rank", "job", "file", "device_type", "steps", "step_ms", "kernel_span_ms", "idle_pct", "compute_pct",
    "non_compute_pct", "overlap_pct", "exposed_comm_pct", "idle_breakdown", "data_loading", "cpu", "phases_ms",
    "top_kernels", "notes", "verdict", "step_source", "trace_ms", "top_ops",
}  # fmt: skip


def test_highlights_of_a_real_two_rank_trace(tmp_path):
    folder = hta_file("trace_filter")
    analysis = analyze_trace(folder, jobs=1)
    result = highlights(analysis, folder)
    assert set(result) == {"folder", "files", "verdict", "ranks", "stragglers", "late_ranks", "warnings", "skipped"}
    assert result["late_ranks"] == [] and "no late-rank analysis" in result["warnings"][0], "sampled ranks disagree"
    assert (result["folder"], result["files"], result["skipped"]) == (str(folder), 2, [])
    assert result["verdict"] == dataclasses.asdict(analysis.verdict)
    assert [(r["rank"], r["job"], r["file"]) for r in result["ranks"]] == [
        (0, ".", "sampled_rank-0.json.gz"), (1, ".", "sampled_rank-1.json.gz")
    ]  # fmt: skip
    for mine, full in zip(result["ranks"], analysis.ranks, strict=True):
        assert set(mine) == RANK_HIGHLIGHTS
        for figure in ("step_ms", "kernel_span_ms", "idle_pct", "compute_pct", "non_compute_pct", "overlap_pct",
                       "exposed_comm_pct"):  # fmt: skip
            assert mine[figure] == approx(getattr(full, figure), 5e-4), figure
        assert mine["idle_breakdown"]["host_wait_pct"] == approx(full.idle_breakdown["host_wait_pct"], 5e-4)
        assert mine["verdict"] == dataclasses.asdict(full.verdict) and mine["verdict"]["bound"] == "host"
        assert len(mine["top_kernels"]) == 5 and mine["top_kernels"][0]["type"] == "communication"
        top = full.top_kernels[0]
        assert mine["top_kernels"][0] == {
            "name": top.name,
            "type": top.type,
            "count": top.count,
            "total_ms": approx(top.total_us / 1000, 5e-4),
            "pct": approx(top.pct, 5e-4),
        }
        assert all(len(k["name"]) <= 200 for k in mine["top_kernels"])
        assert any(k["name"].endswith("…") for k in mine["top_kernels"]), "long C++ names are cut"
    # it travels in a summary: JSON and back unchanged
    RunSummary(trace=result).to_json(tmp_path / "s.json")
    assert RunSummary.from_json(tmp_path / "s.json").trace == result
    assert len(json.dumps(result)) < 10_000, "compact"


def test_highlights_of_a_synthetic_trace_with_a_hostile_kernel_name_and_a_broken_file(tmp_path):
    job = tmp_path / "traces"
    trace = data_bound_trace()
    trace.kernel(HOSTILE, 960, 5, launch=955)
    trace.write(job / "rank0.step4-6.pt.trace.json.gz")
    (job / "sub").mkdir()
    (job / "sub" / "broken.json").write_text('{"traceEvents": [')
    result = highlights(analyze_trace(job, jobs=1), job)
    (rank,) = result["ranks"]
    assert (rank["rank"], rank["job"], rank["file"]) == (0, ".", "rank0.step4-6.pt.trace.json.gz")
    assert [k["name"] for k in rank["top_kernels"]] == [GEMM, HOSTILE], "kept as is: escaping is the page's job"
    assert rank["data_loading"] == {"spans": 2, "per_step_ms": 0.6, "step_share_pct": 60.0, "gpu_idle_pct": 100.0,
                                    "total_ms": 1.2, "trace_share_pct": None}  # fmt: skip
    assert rank["cpu"] is None and rank["verdict"]["bound"] == result["verdict"]["bound"] == "data"
    assert result["skipped"] == [{"file": "sub/broken.json", "reason": "the file ends inside traceEvents after 0 "
                                  "events (truncated)"}]  # fmt: skip


def test_trace_highlights_of_a_folder_with_nothing_to_show(tmp_path):
    assert trace_highlights(tmp_path / "absent", since=0.0) == ({}, (
        f"The run wrote no trace to {tmp_path / 'absent'} (it ended before the profiler's window, --trace-window, "
        "recorded a step), so the summary has no trace highlights."
    ))  # fmt: skip
    assert trace_highlights(tmp_path) == ({}, f"No trace file (.json, .json.gz) in {tmp_path}, so the summary has "
                                              "no trace highlights.")  # fmt: skip
    (tmp_path / "empty.json").write_bytes(b"")
    assert trace_highlights(tmp_path) == ({}, f"The traces in {tmp_path} could not be analysed (empty.json: the file "
                                              "is empty).")  # fmt: skip


def test_trace_highlights_leave_out_traces_older_than_the_run(tmp_path):
    uniform_rank(0, 1000).write(tmp_path / "rank0.step4-6.pt.trace.json.gz")
    old = uniform_rank(0, 1300).write(tmp_path / "rank0.step9-11.pt.trace.json.gz")
    started = time.time()
    os.utime(old, (started - 3600, started - 3600))
    result, note = trace_highlights(tmp_path, since=started)
    assert note is None
    assert [r["file"] for r in result["ranks"]] == ["rank0.step4-6.pt.trace.json.gz"]
    assert result["warnings"] == ["1 trace file(s) older than this run were left out: rank0.step9-11.pt.trace.json.gz"]
    os.utime(tmp_path / "rank0.step4-6.pt.trace.json.gz", (started - 3600, started - 3600))
    result, note = trace_highlights(tmp_path, since=started)
    assert result == {} and "2 older file(s) there were left out" in note
    assert len(trace_highlights(tmp_path)[0]["ranks"]) == 2, "without a run's start every file counts"


def test_trace_highlights_never_raise(tmp_path, monkeypatch):
    uniform_rank(0, 1000).write(tmp_path / "rank0.json")

    def broken(*args, **kwargs):
        raise MemoryError("out of memory")

    monkeypatch.setattr(highlights_module, "analyze_trace", broken)
    assert trace_highlights(tmp_path) == ({}, f"The traces in {tmp_path} could not be analysed (MemoryError: out of "
                                              "memory).")  # fmt: skip


# ---------------------------------------------------------------------------------------------------------------------
# The CLI: stepscope trace
# ---------------------------------------------------------------------------------------------------------------------

RANK_KEYS = {"rank", "idle_pct", "compute_pct", "non_compute_pct", "overlap_pct", "idle_breakdown", "top_kernels"}


def test_cli_trace_writes_json(tmp_path, capsys):
    job = tmp_path / "job"
    for rank in range(2):
        data_bound_trace(rank).write(job / f"rank{rank}.json.gz")
    (job / "broken.json").write_text("{")
    out = tmp_path / "out" / "trace.json"
    assert main(["trace", str(job), "--json", str(out), "--jobs", "1"]) == 0
    printed, err = capsys.readouterr()
    assert err == ""
    assert "bound: data" in printed, printed
    assert "skipped" in printed and "broken.json" in printed
    result = json.loads(out.read_text())
    assert {"ranks", "verdict", "files", "definitions", "stragglers", "spread", "warnings"} <= set(result)
    assert result["verdict"]["bound"] == "data"
    assert [r["rank"] for r in result["ranks"]] == [0, 1]
    for rank in result["ranks"]:
        assert set(rank) >= RANK_KEYS, RANK_KEYS - set(rank)
        assert set(rank["idle_breakdown"]) == {"host_wait_pct", "kernel_wait_pct", "other_pct"}
        assert rank["idle_pct"] == approx(100 * 700 / 1300)
        assert rank["top_kernels"][0]["name"] == GEMM
    assert [(Path(f["path"]).name, f["ok"]) for f in result["files"]] == [
        ("broken.json", False), ("rank0.json.gz", True), ("rank1.json.gz", True)
    ]  # fmt: skip
    assert set(result["definitions"]) >= {"window", "idle_pct", "compute_pct", "overlap_pct", "idle_breakdown"}


def test_cli_ranks_and_top(tmp_path, capsys):
    for rank in range(3):
        uniform_rank(rank, 1000).write(tmp_path / f"rank{rank}.json")
    out = tmp_path / "out.json"
    assert main(["trace", str(tmp_path), "--ranks", "1", "--top", "1", "--json", str(out), "--jobs", "1"]) == 0
    result = json.loads(out.read_text())
    assert [r["rank"] for r in result["ranks"]] == [1]
    assert len(result["ranks"][0]["top_kernels"]) == 1
    assert "bound: " in capsys.readouterr().out


def test_cli_nothing_readable_exits_1(tmp_path, capsys):
    (tmp_path / "empty.json").write_bytes(b"")
    (tmp_path / "text.json").write_text("not json")
    assert main(["trace", str(tmp_path), "--jobs", "1"]) == 1
    printed = capsys.readouterr().out
    assert "the file is empty" in printed and "the file is not JSON" in printed
    assert "nothing could be analysed" in printed


def test_cli_missing_paths(tmp_path, capsys):
    missing = tmp_path / "nowhere.json"
    assert main(["trace", str(missing)]) == 1
    assert f"stepscope: {missing}: no such file or folder" in capsys.readouterr().err
    uniform_rank(0, 1000).write(tmp_path / "rank0.json")
    assert main(["trace", str(missing), str(tmp_path / "rank0.json"), "--jobs", "1"]) == 0
    assert f"{missing}: no such file or folder" in capsys.readouterr().err


def _deeply_nested(depth: int, where: str) -> bytes:
    """A trace whose one kernel event (or whose metadata) holds JSON nested ``depth`` levels deep."""
    deep = "[" * depth + "]" * depth
    kernel = '{"ph": "X", "cat": "kernel", "name": "k", "ts": 10, "dur": 5, "tid": 1, "args": {"stream": 7, '
    nested = kernel + f'"correlation": 1, "x": {deep}}}}}' if where == "args" else kernel + '"correlation": 1}}'
    meta = f', "extra": {deep}' if where == "meta" else ""
    return f'{{"traceEvents": [{kernel}"correlation": 2}}}}, {nested}]{meta}}}'.encode()


@pytest.mark.parametrize("where", ["args", "meta"])
@pytest.mark.parametrize("depth", [1_100, 100_000])
def test_cli_skips_a_trace_nested_too_deep_and_analyses_the_others(tmp_path, capsys, depth, where):
    for rank in range(2):
        data_bound_trace(rank).write(tmp_path / f"rank{rank}.json")
    deep = tmp_path / "rank2.json"
    deep.write_bytes(_deeply_nested(depth, where))
    assert read_trace(tmp_path / "rank0.json").events > 0
    with pytest.raises(TraceReadError):  # a reason, not a RecursionError
        read_trace(deep)
    out = tmp_path / "out.json"
    assert main(["trace", str(tmp_path), "--json", str(out), "--jobs", "1"]) == 0
    printed = capsys.readouterr().out
    skipped = [line for line in printed.splitlines() if "skipped" in line]
    assert len(skipped) == 1 and "rank2.json" in skipped[0], printed
    assert any(why in skipped[0] for why in ("nests JSON deeper", "depth limit exceeded")), skipped
    result = json.loads(out.read_text())
    assert [r["rank"] for r in result["ranks"]] == [0, 1], "the good files are analysed"
    assert result["verdict"]["bound"] == "data"


def test_nesting_below_the_limit_is_read(tmp_path):
    path = tmp_path / "t.json"
    path.write_bytes(_deeply_nested(500, "args"))
    assert read_trace(path).events == 2


def test_cli_on_a_real_two_rank_job(tmp_path, capsys):
    out = tmp_path / "trace.json"
    assert main(["trace", str(hta_file("trace_filter")), "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "2 rank(s)" in printed and "bound: " in printed
    result = json.loads(out.read_text())
    assert [r["rank"] for r in result["ranks"]] == [0, 1]
    assert result["ranks"][1]["idle_pct"] == approx(54.72, TOLERANCE_PP)
    assert set(result["spread"][str(hta_file("trace_filter"))]) >= {"idle_pct", "compute_pct", "overlap_pct"}
    assert main(["trace", str(hta_file("trace_filter")), "--ranks", "1", "--json", str(out), "--jobs", "1"]) == 0
    assert [r["rank"] for r in json.loads(out.read_text())["ranks"]] == [1]
