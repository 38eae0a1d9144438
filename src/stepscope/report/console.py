"""The rich console that reports print to: colour and Unicode rules on a terminal, plain ASCII in a log or a file.

Apart from report/terminal.py (which needs stepscope.summary and stepscope.record) so that `stepscope trace` loads
only what its report prints with. What needs no rich is in report/text.py.
"""

from __future__ import annotations

import sys
from typing import IO

from rich import box
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from stepscope.report.text import PLAIN_WIDTH, Grid, plain_output, terminal_safe

# SIMPLE_HEAD with an ASCII rule under the header.
_ASCII_HEAD = box.Box("    \n    \n -- \n    \n    \n    \n    \n    \n", ascii=True)


def _console(file: IO[str] | None) -> Console:
    file = file or sys.stdout
    # Emoji codes stay as written: ":fire:" in a kernel or file name is text, not a picture.
    if plain_output(file):
        # A log or a file: long lines stay whole (wrapping mid-sentence breaks grep and copy); tables keep 110.
        return Console(
            file=file,
            force_terminal=False,
            color_system=None,
            highlight=False,
            emoji=False,
            width=PLAIN_WIDTH,
            soft_wrap=True,
        )
    return Console(file=file, highlight=False, emoji=False)


def _plain(console: Console) -> bool:
    return console.color_system is None


def grid_table(grid: Grid, ascii_only: bool = False) -> Table:
    """``grid`` as a rich table: no edge, one blank before each column but the first, cells never wrapped (text
    from the trace escaped, so rich never reads it as markup)."""
    table = Table(
        box=_ASCII_HEAD if ascii_only else box.SIMPLE_HEAD, show_edge=False, pad_edge=False, padding=(0, 0, 0, 1)
    )
    for column in grid.columns:
        justify = "right" if column.right else "left"
        if column.max_width is None:
            table.add_column(column.header, justify=justify, no_wrap=True)
        else:
            table.add_column(
                column.header, justify=justify, no_wrap=True, max_width=column.max_width, overflow="ellipsis"
            )
    for row in grid.rows:
        table.add_row(*(escape(terminal_safe(cell)) for cell in row))
    return table
