"""A progress bar on a terminal for work a user waits on (offline generation, batch files)."""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager


@contextmanager
def progress(total: int, what: str, show: bool = True) -> Iterator[Callable[[], None]]:
    """A function that advances the bar by one; a no-op when ``show`` is false or stderr
    is not a terminal."""
    if not show or not sys.stderr.isatty():
        yield lambda: None
        return
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TimeElapsedColumn

    columns = (what, BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    with Progress(*columns, console=Console(stderr=True), transient=False) as bar:
        task = bar.add_task(what, total=total)
        yield lambda: bar.advance(task)
