"""Output paths of the command line, checked before any work starts (issue 31.3): a benchmark
that runs for minutes must not fail at the end on a path it could have refused at the start."""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["output_path_error"]


def output_path_error(flag: str, path: str, suffixes: tuple[str, ...] = (), *,
                      directory_if_no_suffix: bool = False) -> str | None:
    """Why ``path`` (the value of ``flag``) cannot be written, in one line, or None.

    ``suffixes``: the file endings the output supports (any, if empty).  With
    ``directory_if_no_suffix`` a path without one of them names a directory the output goes into
    (``bench --json DIR``).  The folder the file goes into may not exist yet (it is created), but
    the nearest part of it that exists must be a writable directory.
    """
    p = Path(path)
    as_directory = directory_if_no_suffix and p.suffix.lower() not in suffixes
    if not as_directory:
        if suffixes and p.suffix.lower() not in suffixes:
            return f"{flag} {path}: the output is {' or '.join(s.lstrip('.').upper() for s in suffixes)}; " \
                   f"give a path ending in {' or '.join(suffixes)}"
        if p.is_dir():
            return f"{flag} {path}: is a directory; give a file name ending in {' or '.join(suffixes) or 'a name'}"
    folder = p if as_directory else p.parent
    existing = folder
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if not existing.is_dir():
        return f"{flag} {path}: {existing} is a file, not a directory"
    if not os.access(existing, os.W_OK | os.X_OK):
        return f"{flag} {path}: the directory {existing} is not writable"
    return None
