"""report/text.py: the tables `stepscope trace` writes to a log without rich are the characters rich writes."""

from __future__ import annotations

import io
import random

import pytest

from stepscope.report.console import _console, grid_table
from stepscope.report.text import PLAIN_WIDTH, Column, Grid, plain_table
from stepscope.report.trace import KERNEL_COLUMNS, OPS_COLUMNS, RANK_COLUMNS


def _rich(grid: Grid) -> str:
    out = io.StringIO()  # not a TTY: the plain console a log gets
    _console(out).print(grid_table(grid, ascii_only=True))
    return out.getvalue()


def _cell(rng: random.Random, pieces: int) -> str:
    # No backslashes: rich's escape() mangles some (one before "[1]" is dropped, a trailing one doubled), and the
    # plain table writes the text as it is.
    parts = ["at::native::", "void ", "<float>", "[1]", "[bold]", "[/]", " ", ":fire:", "x", "{lambda()#1}", "µ", "7"]
    text = "".join(rng.choice(parts) for _ in range(rng.randint(0, pieces)))
    return text.strip() if rng.random() < 0.9 else text


@pytest.mark.parametrize("columns", [RANK_COLUMNS, KERNEL_COLUMNS, OPS_COLUMNS], ids=["ranks", "kernels", "ops"])
def test_plain_table_is_what_rich_prints(columns: list[Column]) -> None:
    """Random cells (markup, emoji codes, blanks, cells over the cut) in the report's own columns:
    the plain table equals rich's, or is None and left to rich (too wide for the log's 110 columns)."""
    rng = random.Random(7)
    written = 0
    for _ in range(300):
        rows = [[_cell(rng, 12 if i == 0 else 2) for i in range(len(columns))] for _ in range(rng.randint(0, 5))]
        grid = Grid(columns, rows)
        plain = plain_table(grid)
        if plain is None:  # wider than the log, or a blank at the end of a right-justified cell (rich strips it)
            widths = [max([len(c.header)] + [len(r[i]) for r in rows]) for i, c in enumerate(columns)]
            too_wide = sum(min(w, c.max_width or w) for w, c in zip(widths, columns, strict=True)) > PLAIN_WIDTH - 30
            blank = any(r[i] != r[i].rstrip() for r in rows for i, c in enumerate(columns) if c.right)
            assert too_wide or blank
            continue
        assert plain == _rich(grid)
        written += 1
    assert written >= 50


def test_plain_table_leaves_wide_and_unmeasured_text_to_rich() -> None:
    """A table wider than the log is shrunk by rich, and wide characters are measured by it: no plain table."""
    wide = Grid([Column("a" * 60), Column("b" * 60)], [["1", "2"]])
    assert plain_table(wide) is None
    cjk = Grid([Column("kernel", right=False, max_width=50)], [["核函数"]])
    assert plain_table(cjk) is None
    cut = Grid([Column("kernel", right=False, max_width=50), Column("n")], [["k" * 51, "1"]])
    assert plain_table(cut) == _rich(cut) and "k" * 49 + "…" in plain_table(cut)
