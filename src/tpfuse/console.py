"""Terminal output shared by the command lines (``tpfuse`` and ``tpfuse bench``): a table and a
one-line progress indicator, rich when it is installed, plain text otherwise."""

from __future__ import annotations

import sys

__all__ = ["print_table", "Progress"]


def print_table(rows: list[list[str]], title: str) -> None:
    try:
        from rich.console import Console
        from rich.table import Table
    except ImportError:  # plain text without the optional dependency
        widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
        print(title)
        for row in rows:
            print("  ".join(c.rjust(w) for c, w in zip(row, widths)))
        return
    table = Table(title=title)
    for name in rows[0]:
        table.add_column(name, justify="right")
    for row in rows[1:]:
        table.add_row(*row)
    Console(width=160).print(table)


class Progress:
    """A one-line progress indicator on stderr (rich when available)."""

    def __init__(self, name: str = "demo") -> None:
        self._name = name
        self._bar = None
        if not sys.stderr.isatty():   # a log file: plain lines (rich would print nothing until the end)
            return
        try:
            from rich.progress import Progress

            self._bar = Progress(transient=False)
            self._task = None
        except ImportError:
            pass

    def __call__(self, done: int, total: int, label: str) -> None:
        if self._bar is None:
            print(f"[{done}/{total}] {label}", file=sys.stderr, flush=True)
            return
        if self._task is None:
            self._bar.start()
            self._task = self._bar.add_task(self._name, total=total)
        self._bar.update(self._task, completed=done, description=f"{self._name}: {label}")
        if done == total:
            self._bar.stop()
