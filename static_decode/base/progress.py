"""The one progress bar of the project (capture warm-up, bench): rich, on stderr, or nothing when disabled."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any


def console() -> Any:
    """A rich Console on stderr (progress, capture summaries), so stdout keeps only a command's output."""
    from rich.console import Console

    return Console(stderr=True)


@contextlib.contextmanager
def progress_bar(label: str, total: int, *, enabled: bool = True) -> Iterator[Callable[[str, int], None]]:
    """A bar named `label` over `total` units; yields `advance(text, n)` (n units done, `text` shown)."""
    if not enabled:
        yield lambda text, n=1: None
        return
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    columns = (TextColumn(label), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
               TextColumn("{task.description}"))
    with Progress(*columns, console=console(), transient=False) as bar:
        task = bar.add_task("", total=total)
        yield lambda text, n=1: bar.update(task, advance=n, description=text)
