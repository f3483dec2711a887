"""Rich consoles for the commands: tables never truncated when the output is a file or a pipe."""

from __future__ import annotations

import os
import sys

from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)

PIPE_WIDTH = 160  # rich's default for a non-terminal is 80 columns, which cuts the tables' numbers


def table_console() -> Console:
    """Standard output: the terminal's width, or ``PIPE_WIDTH`` columns when it is not a terminal."""
    if sys.stdout.isatty() or "COLUMNS" in os.environ:
        return Console()
    return Console(width=PIPE_WIDTH)


def progress_bar(console: Console, remaining: bool = False) -> Progress:
    """A transient bar: description, bar, done/total, elapsed (and the time left when ``remaining``)."""
    columns = [TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn()]
    if remaining:
        columns.append(TimeRemainingColumn())
    return Progress(*columns, console=console, transient=True)
