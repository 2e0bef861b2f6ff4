"""Progress and messages on stderr (stdout stays clean for results), through rich."""

from __future__ import annotations

import contextlib
import re
import sys
import time

from rich.console import Console
from rich.text import Text

# Piped or in CI, rich would assume 80 columns and squeeze tables; give it room instead. Strings are
# printed as they are, never parsed as markup or emoji codes: messages carry file names, config values
# and install hints like 'andrea-export[gpu]'. Styles are given as Text (see `styled`).
console = Console(stderr=True, highlight=False, markup=False, emoji=False,
                  width=None if sys.stderr.isatty() else 140)


def styled(text: str, style: str) -> Text:
    """`text` in a rich style, as a Text object (literal: no markup parsing)."""
    return Text(text, style=style)


@contextlib.contextmanager
def step(message: str, quiet: bool = False):
    """A spinner while a long step runs, then one line with its duration."""
    if quiet:
        yield
        return
    t0 = time.perf_counter()
    with console.status(Text(message + " ...")):  # a str status would be parsed as markup
        yield
    console.print(styled("done", "green"), f"{message} ({time.perf_counter() - t0:.1f} s)")


def warn(message: str) -> None:
    console.print(styled("WARNING:", "bold yellow"), message)


def error(message: str) -> None:
    console.print(styled("error:", "bold red"), message, soft_wrap=True)


_CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f-\x9f]")  # C0 but tab and newline, DEL, C1


def for_terminal(text: str) -> str:
    """`text` with its control characters written as escapes (ESC as \\x1b): text a model or a user made,
    printed on a terminal, must not move the cursor, retitle the window or hide what came before."""
    return _CONTROL.sub(lambda m: f"\\x{ord(m.group()):02x}", text)
