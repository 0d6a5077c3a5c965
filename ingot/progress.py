"""Progress bars on stderr for work that takes more than a moment (quantize, eval, convert, view), as
llama.cpp's tools and mlx_lm show them. rich draws them, imported only when a bar starts; when
stderr is not a terminal (a log, a pipe, a test) nothing is drawn.

    with progress_bar("quantize", total=len(names)) as advance:
        for name in names:
            ...                      # the work
            advance(name)            # one step done; the text says what was done last
"""
from __future__ import annotations

import sys
from contextlib import contextmanager
from typing import Callable, Iterator


@contextmanager
def progress_bar(what: str, total: int) -> Iterator[Callable[..., None]]:
    """Yields advance(text="", steps=1): mark `steps` of `total` done, showing `text` beside the bar."""
    if not sys.stderr.isatty():
        yield lambda text="", steps=1: None
        return
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    with Progress(TextColumn(f"[bold]{what}[/]"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  TextColumn("{task.description}"), console=Console(stderr=True), transient=True) as bar:
        task = bar.add_task("", total=total)
        yield lambda text="", steps=1: bar.update(task, advance=steps, description=text)
