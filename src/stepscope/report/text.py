"""What the terminal reports share without rich: text made safe for one line, the outlying ranks of a large job, and
a table printed as rich prints it to a log or a file.

rich costs ~20 ms to import and ~10 ms to lay out a report: most of what `stepscope trace` takes on a small trace
besides numpy. Its tables are simple when the output is plain (no colour, an ASCII rule), so `plain_table` writes
them itself, the same characters rich writes, and gives up (None) where rich would lay them out another way.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import IO, TypeVar

PLAIN_WIDTH = 110  # a log's or a file's width: tables fit in it, lines stay whole

# C0 and C1 controls (escape sequences, newlines, tabs, carriage returns, backspace), line and paragraph separators,
# and the bidirectional overrides that can make a line read differently from what it holds
_UNSAFE = re.compile("[\x00-\x1f\x7f-\x9f\u2028\u2029\u202a-\u202e\u2066-\u2069]")
# Characters one cell wide whatever the terminal: printable ASCII and Latin-1 (µ), and the ellipsis of a cut cell.
# Anything else (wide CJK, combining marks) is left to rich, which measures cells.
_NARROW = re.compile("[ -~\xa0-\u02ff\u2026]*")

T = TypeVar("T")
RANK_ROWS = 16  # a larger job's table shows its outliers: 1,024 rows would bury the rest of the report


def terminal_safe(text: object) -> str:
    """``text`` made safe for one terminal line: each control character (ESC, a newline, a carriage return...)
    is shown as its escape (``\\x1b``, ``\\n``), so a string from a run (a command, an error, a file or kernel
    name) can neither move the cursor, recolour the terminal nor forge a line of the report."""
    return _UNSAFE.sub(lambda match: repr(match.group())[1:-1], str(text))


def plain_output(file: IO[str]) -> bool:
    """Whether reports to ``file`` are plain text (no colour, ASCII rules): a log or a file, or ``CI`` set."""
    return bool(os.environ.get("CI")) or not (hasattr(file, "isatty") and file.isatty())


def outliers(ranks: list[T], distance: Callable[[T], float], rank: Callable[[T], int]) -> list[T]:
    """The rows of a rank table: all ``ranks`` up to ``RANK_ROWS``, else the ``RANK_ROWS`` with the largest
    ``distance`` from the job (ties in rank order), in ``rank`` order. The JSON keeps every rank."""
    if len(ranks) <= RANK_ROWS:
        return ranks
    return sorted(sorted(ranks, key=distance, reverse=True)[:RANK_ROWS], key=rank)


@dataclass
class Column:
    """A column of a report's table: its header, ``right`` justified or left, cells cut to ``max_width`` with an
    ellipsis (None: never cut). Cells never wrap."""

    header: str
    right: bool = True
    max_width: int | None = None


@dataclass
class Grid:
    """A table of a report, printed by rich (console.py) or `plain_table`; cells are the text shown, unescaped."""

    columns: Sequence[Column]
    rows: list[list[str]]


def plain_table(grid: Grid) -> str | None:
    """``grid`` as rich prints it to a plain console (``SIMPLE_HEAD`` with an ASCII rule, no edge, one blank
    between columns and their own padding), or None where rich would lay it out otherwise: wider than
    `PLAIN_WIDTH` (it shrinks columns) or holding characters whose width it measures."""
    columns = grid.columns
    rows = [[terminal_safe(cell) for cell in row] for row in grid.rows]
    for row in rows:
        for i, column in enumerate(columns):
            if column.max_width is not None and len(row[i]) > column.max_width:
                row[i] = row[i][: column.max_width - 1] + "…"
    cells = [[c.header for c in columns], *rows]
    if not all(_NARROW.fullmatch(cell) for row in cells for cell in row):
        return None
    if any(cell != cell.rstrip() for row in cells for cell, c in zip(row, columns, strict=True) if c.right):
        return None  # rich measures the cell whole but strips it to justify it right
    widths = [max(len(row[i]) for row in cells) for i in range(len(columns))]
    if sum(widths) + 2 * (len(widths) - 1) > PLAIN_WIDTH:
        return None
    lines = [
        "  ".join(
            cell.rjust(width) if column.right else cell.ljust(width)
            for cell, width, column in zip(row, widths, columns, strict=True)
        )
        for row in cells
    ]
    lines.insert(1, "-" * len(lines[0]))
    return "\n".join(lines) + "\n"
