"""Stream the events of a Kineto (torch.profiler) JSON trace in bounded memory.

A trace is one JSON object whose ``traceEvents`` array holds almost all of its bytes. Parsing the whole file at
once costs several times its size in Python objects, so the array is cut into runs of complete events and each run
is parsed on its own with orjson: memory stays at a few chunks whatever the trace size.

The cut points come from the JSON structure, not from the layout (Kineto pretty-prints; traces re-written by other
tools are one line): numpy finds every quote and bracket of a chunk, brackets inside strings are dropped by the
parity of the quotes before them, and the nesting depth is the running sum of the rest. An event ends where the
depth comes back to the array's level. Everything outside the array (``distributedInfo``, ``deviceProperties``,
``displayTimeUnit``, ...) is parsed once with an empty array in its place.
"""

from __future__ import annotations

import itertools
import re
import zlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO, NoReturn

import numpy as np
import orjson

try:  # ISA-L's inflate (the extra stepscope[fast]): zlib's interface, ~3x its speed, a quarter of a trace's read time
    from isal import isal_zlib as INFLATE

    INFLATE_ERRORS: tuple[type[Exception], ...] = (INFLATE.error, zlib.error)
except ImportError:
    INFLATE = zlib  # type: ignore[no-redef]
    INFLATE_ERRORS = (zlib.error,)

# Decompressed bytes per parse. 1 MB, not more: each run's events are made and freed together, and the allocator
# gives a freed run's memory back to the kernel, so the next run faults its pages in again: at 8 MB, ~14,000 page
# faults and ~30 ms of system time on a 54 MB trace, ~5,000 at 1 MB, with a peak RSS 20 MB lower.
CHUNK_BYTES = 1 << 20
HEAD_BYTES = 64 << 10  # searched for the start of traceEvents before the whole first chunk
HEADER_MAX_BYTES = 512 << 20  # how far into a file the start of traceEvents is looked for
GZIP_MAGIC = b"\x1f\x8b"
_QUOTE, _OPEN, _CLOSE = 0x22, 0x7B, 0x7D  # '"' and, once OR-ed with 0x20, '{' / '[' and '}' / ']'
_SEPARATORS = b", \t\r\n"  # what may come between two events of the array
_EVENTS_KEY = re.compile(rb'"traceEvents"\s*:\s*$')
_BLANKS = re.compile(rb"\s*")  # what bytes.lstrip() strips


class TraceReadError(ValueError):
    """A file that cannot be read as a Kineto trace, with the reason in one sentence."""


class SplitError(Exception):
    """A run cut the cheap way did not decode while the file was read in shares: it must be read alone."""


@dataclass
class TraceFile:
    """What lies outside ``traceEvents``: the trace's metadata (``distributedInfo``, ``deviceProperties``, ...)."""

    path: Path
    meta: dict[str, Any] = field(default_factory=dict)
    events: int = 0
    bytes_read: int = 0  # decompressed bytes


def _chunks(handle: BinaryIO, compressed: bool) -> Iterator[bytes]:
    """Decompressed chunks of the file (gzip members one after the other, as `gzip` itself reads them)."""
    if not compressed:
        while chunk := handle.read(CHUNK_BYTES):
            yield chunk
        return
    inflate = INFLATE.decompressobj(wbits=31)
    fed = False  # whether the current member has begun: a stream may end only between members
    while raw := handle.read(CHUNK_BYTES // 4):
        while raw:
            if not fed:  # between members gzip skips zero padding, however long
                raw = raw.lstrip(b"\x00")
                if not raw:
                    break
            fed = True
            out = inflate.decompress(raw, CHUNK_BYTES)
            if inflate.eof:  # what follows the member is all in unused_data (unconsumed_tail may repeat it)
                raw = inflate.unused_data
                inflate, fed = INFLATE.decompressobj(wbits=31), False
            else:
                raw = inflate.unconsumed_tail
            if out:
                yield out
    if fed and not inflate.eof:
        raise TraceReadError("the gzip stream is cut short (the file is truncated)")


def _unescaped_quotes(buf: bytes, quotes: np.ndarray) -> np.ndarray:
    """Drop the quotes escaped by an odd run of backslashes (rare: only strings that contain quotes)."""
    escaped = []
    start = buf.find(b'\\"')
    while start != -1:
        quote = start + 1
        run = 0
        while start - run >= 0 and buf[start - run] == 0x5C:
            run += 1
        if run % 2:
            escaped.append(quote)
        start = buf.find(b'\\"', quote)
    if not escaped:
        return quotes
    return np.setdiff1d(quotes, np.asarray(escaped, dtype=quotes.dtype), assume_unique=True)


def _structure(buf: bytes) -> tuple[np.ndarray, np.ndarray]:
    """Positions of the brackets outside strings in ``buf`` (which starts outside a string), and the depth after each.

    Depth counts from 0 at the start of ``buf``: an opening bracket raises it by one, a closing one lowers it.
    """
    data = np.frombuffer(buf, dtype=np.uint8)
    folded = data | 0x20
    brackets = np.flatnonzero((folded == _OPEN) | (folded == _CLOSE))
    quotes = np.flatnonzero(data == _QUOTE)
    if b'\\"' in buf:
        quotes = _unescaped_quotes(buf, quotes)
    outside = (np.searchsorted(quotes, brackets) & 1) == 0
    brackets = brackets[outside]
    steps = np.where(folded[brackets] == _OPEN, 1, -1).astype(np.int32)
    return brackets, np.cumsum(steps, dtype=np.int32)


def _events_start(buf: bytes) -> int:
    """Offset just after the ``[`` of the top-level ``traceEvents`` array, or -1 when ``buf`` does not reach it."""
    # Kineto writes the array after a few kB of metadata: scanning a prefix first spares a scan of a whole chunk.
    # A bracket's depth depends only on the bytes before it, so a prefix finds what the whole buffer would.
    for size in (HEAD_BYTES, len(buf)):
        head = buf[:size]
        brackets, depth = _structure(head)
        # the array's bracket takes the depth from 1 (inside the top-level object) to 2
        for pos in brackets[depth == 2]:
            if head[pos] == 0x5B and _EVENTS_KEY.search(head, max(0, pos - 64), pos):
                return int(pos) + 1
        if size >= len(buf):
            break
    return -1


def _split_events(buf: bytes) -> tuple[int, int, int]:
    """Within the array (``buf`` starts between two events): (end of the last complete event + 1, events, array end).

    The array's end is the offset of its ``]``, or -1 when ``buf`` stops before it.
    """
    brackets, depth = _structure(buf)
    closes = depth == 0  # an event's '}' brings the depth back to the array's level
    array_end = np.flatnonzero(depth < 0)
    end_at = int(brackets[array_end[0]]) if len(array_end) else -1
    ends = brackets[closes]
    if end_at >= 0:
        ends = ends[ends < end_at]
    last = int(ends[-1]) + 1 if len(ends) else 0
    return last, len(ends), end_at


Decode = Callable[[bytes], list[Any]]


def iter_events(path: str | Path, trace: TraceFile | None = None) -> Iterator[list[dict[str, Any]]]:
    """Yield the events of a Kineto trace (``.json`` or ``.json.gz``) as lists of dicts, a chunk at a time.

    ``trace`` (if given) receives the metadata once the file has been read to its end. Raises `TraceReadError` for
    a file that is not JSON, not a Kineto trace, or truncated; OSError for a file that cannot be opened.
    """
    return iter_decoded(path, orjson.loads, trace)


def iter_decoded(
    path: str | Path, decode: Decode, trace: TraceFile | None = None, share: tuple[int, int] = (0, 1)
) -> Iterator[list[Any]]:
    """Like `iter_events`, with ``decode`` turning each JSON array of complete events into a list.

    ``decode`` must raise ValueError (orjson's and msgspec's errors are ValueErrors) on bytes that are not a valid
    array: a cut point found the cheap way is checked by decoding it, and found again the exact way when it fails.

    ``share`` (k, n): decode only the runs k, k + n, k + 2n, ... of the file (all n readers cut it at the same
    places), so that n processes can read one file together. The other runs' cheap cuts are not checked: a reader
    whose own cheap cut does not decode raises `SplitError`, and the file must then be read alone.
    """
    path = Path(path)
    trace = trace if trace is not None else TraceFile(path)
    with open(path, "rb") as handle:
        compressed = handle.read(2) == GZIP_MAGIC
        handle.seek(0)
        chunks = _chunks(handle, compressed)
        try:
            yield from _parse(chunks, trace, decode, share)
        except (*INFLATE_ERRORS, EOFError) as error:
            raise TraceReadError(f"the gzip data is corrupt ({error})") from None
        except (TraceReadError, SplitError):
            raise
        except ValueError as error:  # the decoder's
            # Corrupt gzip data inflates to garbage for a while before zlib notices: the rest of the file says
            # whether the JSON or the gzip stream is at fault.
            try:
                for _ in chunks:
                    pass
            except (*INFLATE_ERRORS, EOFError) as corrupt:
                raise TraceReadError(f"the gzip data is corrupt ({corrupt})") from None
            raise TraceReadError(f"the JSON is malformed ({error})") from None


def _counted(chunks: Iterator[bytes], trace: TraceFile) -> Iterator[bytes]:
    for chunk in chunks:
        trace.bytes_read += len(chunk)
        yield chunk


def _decode_run(pending: bytearray, end: int, decode: Decode) -> list[Any]:
    """Decode the events in ``pending[:end]`` as one JSON array, without copying them.

    ``pending`` starts with at least one separator (the array's ``[``, or the comma or blank left by the previous
    cut): the last separator before the first event becomes ``[`` and the byte at ``end`` becomes ``]`` while the
    decoder reads, and both are put back.
    """
    start = 1
    while start < end and pending[start] in _SEPARATORS:
        start += 1
    if end == len(pending):
        pending.append(0x20)
    before, after = pending[start - 1], pending[end]
    pending[start - 1], pending[end] = 0x5B, 0x5D
    try:
        with memoryview(pending) as view, view[start - 1 : end + 1] as run:
            return decode(run)
    finally:
        pending[start - 1], pending[end] = before, after


def _drop(pending: bytearray, cut: int) -> None:
    """Drop the decoded ``pending[:cut]``, leaving one separator in front of what follows (see `_decode_run`)."""
    if cut < len(pending) and pending[cut] in _SEPARATORS:
        del pending[:cut]  # from the front of a bytearray: no copy
    else:
        pending[:cut] = b" "


def _parse(
    raw_chunks: Iterator[bytes], trace: TraceFile, decode: Decode, share: tuple[int, int]
) -> Iterator[list[Any]]:
    chunks = _counted(raw_chunks, trace)
    mine, readers = share
    run = 0  # runs cut so far, decoded by this reader or not
    head, start = _find_events(chunks)
    # a bytearray, so that runs are decoded in place and cuts are cheap; a blank stands for the "[" (see _decode_run)
    pending, header = bytearray(memoryview(head)[start - 1 :]), bytes(head[: start - 1])
    del head
    pending[0] = 0x20
    trailer = None
    for chunk in itertools.chain([b""], chunks, [None]):  # None: the file has ended, cut exactly what is left
        if chunk is not None:
            pending += chunk
            # Cheap cut: Kineto ends each event with "}," and a newline (its args, the last key, close with "}" and
            # a newline), which no string holds (kernel names hold "},"); a cut there that decodes is a real
            # boundary, since a prefix of the array is valid JSON only between events. "}," alone serves traces
            # written on one line. The exact scan runs when that fails, and once the file has ended.
            cheap = (pending.rfind(b"},\n") + 1) or (pending.rfind(b"},") + 1)
            if cheap > 0:
                ours = run % readers == mine
                events = []  # another reader's run
                if ours:
                    try:
                        events = _decode_run(pending, cheap, decode)
                    except ValueError:
                        if readers > 1:
                            raise SplitError from None
                        events = None
                if events is not None:
                    if ours:
                        trace.events += len(events)
                        yield events
                    run += 1
                    _drop(pending, cheap)
                    continue
        last, count, end_at = _split_events(pending)
        if count:
            if run % readers == mine:
                events = _decode_run(pending, last, decode)
                trace.events += len(events)
                yield events
            run += 1
        if end_at >= 0:
            trailer = bytes(pending[end_at + 1 :])
            break
        _drop(pending, last)
    if trailer is None:
        raise TraceReadError(f"the file ends inside traceEvents after {trace.events:,} events (truncated)")
    trailer += b"".join(chunks)
    trace.meta = orjson.loads(header + b"[]" + trailer)
    trace.meta.pop("traceEvents", None)


def _find_events(chunks: Iterator[bytes]) -> tuple[bytearray, int]:
    """The file's first chunks, through the ``[`` of ``traceEvents`` at least, and the offset just after it. Refuses
    (`_refuse`) a file that is not a JSON object, or whose array does not start within `HEADER_MAX_BYTES`.

    The head is searched again each time it has doubled, so an array far into the file costs time in proportion to
    its offset, not to its square."""
    head = bytearray()
    searched = 0
    for chunk in chunks:
        head += chunk
        first = _BLANKS.match(head).end()  # not head.lstrip(): Kineto starts with a newline, and that copies the head
        if head[first : first + 1] != b"{":
            _refuse(head)
        if len(head) >= 2 * searched:
            searched = len(head)
            if (start := _events_start(head)) >= 0:
                return head, start
            if searched > HEADER_MAX_BYTES:
                _refuse(head)
    if len(head) > searched and (start := _events_start(head)) >= 0:
        return head, start
    _refuse(head)


def _refuse(head: bytes | bytearray) -> NoReturn:
    """Say what a file without ``traceEvents`` is, when it is recognisable."""
    text = head.lstrip()[:4096]
    if not text:
        raise TraceReadError("the file is empty")
    if b'"nodes"' in text and b'"schema"' in text:
        raise TraceReadError("this is a PyTorch execution trace (ExecutionTraceObserver), not a Kineto trace")
    if text.startswith(b"[["):
        raise TraceReadError("this looks like a memory timeline (export_memory_timeline), not a Kineto trace")
    if not text.startswith((b"{", b"[")):
        raise TraceReadError("the file is not JSON")
    if not head.rstrip().endswith((b"}", b"]")):
        raise TraceReadError("the file ends before its traceEvents array (truncated)")
    raise TraceReadError("the JSON has no traceEvents array: not a Kineto trace")
