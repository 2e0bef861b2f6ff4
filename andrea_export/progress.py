"""Progress and messages on stderr (stdout stays clean for results), through rich."""

from __future__ import annotations

import contextlib
import sys
import time

from rich.console import Console

# Piped or in CI, rich would assume 80 columns and squeeze tables; give it room instead.
console = Console(stderr=True, highlight=False, width=None if sys.stderr.isatty() else 140)


@contextlib.contextmanager
def step(message: str, quiet: bool = False):
    """A spinner while a long step runs, then one line with its duration."""
    if quiet:
        yield
        return
    t0 = time.perf_counter()
    with console.status(message + " ..."):
        yield
    console.print(f"[green]done[/] {message} ({time.perf_counter() - t0:.1f} s)")


def warn(message: str) -> None:
    console.print(f"[bold yellow]WARNING:[/] {message}")
