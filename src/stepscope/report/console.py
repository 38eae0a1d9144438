"""The console that reports print to, and what every report's tables share: plain ASCII for logs, text made safe
for one terminal line, the outlying ranks of a large job.

Apart from report/terminal.py (which needs stepscope.summary and stepscope.record) so that `stepscope trace` loads
only what its report prints with.
"""

from __future__ import annotations

import os
import re
import sys
from collections.abc import Callable
from typing import IO, TypeVar

from rich import box
from rich.console import Console

# SIMPLE_HEAD with an ASCII rule under the header.
_ASCII_HEAD = box.Box("    \n    \n -- \n    \n    \n    \n    \n    \n", ascii=True)


def _console(file: IO[str] | None) -> Console:
    file = file or sys.stdout
    plain = bool(os.environ.get("CI")) or not (hasattr(file, "isatty") and file.isatty())
    if plain:
        # A log or a file: long lines stay whole (wrapping mid-sentence breaks grep and copy); tables keep 110.
        return Console(file=file, force_terminal=False, color_system=None, highlight=False, width=110, soft_wrap=True)
    return Console(file=file, highlight=False)


def _plain(console: Console) -> bool:
    return console.color_system is None


# C0 and C1 controls (escape sequences, newlines, tabs, carriage returns, backspace), line and paragraph separators,
# and the bidirectional overrides that can make a line read differently from what it holds
_UNSAFE = re.compile("[\x00-\x1f\x7f-\x9f\u2028\u2029\u202a-\u202e\u2066-\u2069]")


def terminal_safe(text: object) -> str:
    """``text`` made safe for one terminal line: each control character (ESC, a newline, a carriage return...)
    is shown as its escape (``\\x1b``, ``\\n``), so a string from a run (a command, an error, a file or kernel
    name) can neither move the cursor, recolour the terminal nor forge a line of the report."""
    return _UNSAFE.sub(lambda match: repr(match.group())[1:-1], str(text))


T = TypeVar("T")
RANK_ROWS = 16  # a larger job's table shows its outliers: 1,024 rows would bury the rest of the report


def outliers(ranks: list[T], distance: Callable[[T], float], rank: Callable[[T], int]) -> list[T]:
    """The rows of a rank table: all ``ranks`` up to ``RANK_ROWS``, else the ``RANK_ROWS`` with the largest
    ``distance`` from the job (ties in rank order), in ``rank`` order. The JSON keeps every rank."""
    if len(ranks) <= RANK_ROWS:
        return ranks
    return sorted(sorted(ranks, key=distance, reverse=True)[:RANK_ROWS], key=rank)
