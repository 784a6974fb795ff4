"""The tuning cache: measured op times per (shape, strategy) that override the model's predictions.

``$TPFUSE_CACHE_DIR/tuning.json``, else ``~/.cache/tpfuse/tuning.json``; written atomically by
:meth:`TuningCache.record` (``tpfuse.plan.record_measurement`` validates and calls it), read by
the planner's ``choose`` (``strategy="auto"``).  A file that cannot be read, or an entry that is
not what ``record`` writes, is ignored with one ``RuntimeWarning`` that names the file and says
it can be deleted: a stale or hand-edited cache never fails a call.

Keys are plain strings built from validated arguments (:func:`cache_key`); this module imports
nothing of the planner (``tpfuse.plan`` sits above it).
"""

from __future__ import annotations

import functools
import importlib.metadata
import json
import math
import os
import statistics
import tempfile
import threading
import warnings
from pathlib import Path

__all__ = ["tuning_cache_path", "cache_key", "TuningCache", "CACHE"]

# Measurements kept per (shape, strategy): the median of the last few is what counts.
_KEEP = 16


def tuning_cache_path() -> Path:
    """``$TPFUSE_CACHE_DIR/tuning.json``, else ``~/.cache/tpfuse/tuning.json``."""
    root = os.environ.get("TPFUSE_CACHE_DIR")
    return Path(root if root else Path.home() / ".cache" / "tpfuse") / "tuning.json"


@functools.lru_cache(maxsize=None)
def _versions() -> str:
    import torch

    try:
        triton = importlib.metadata.version("triton")
    except importlib.metadata.PackageNotFoundError:
        triton = "none"
    try:
        ours = importlib.metadata.version("tpfuse")
    except importlib.metadata.PackageNotFoundError:
        ours = "dev"
    return f"torch={torch.__version__}|triton={triton}|tpfuse={ours}"


def cache_key(op: str, m: int, n: int, k: int, w: int, dtype: str, hw_name: str) -> str:
    """The entry of one validated call shape (versions included: an upgrade re-tunes)."""
    return f"{op}|m={m}|n={n}|k={k}|W={w}|{dtype}|{hw_name}|{_versions()}"


def _times(entry: object) -> dict[str, list[float]] | None:
    """An entry's ``measured`` map if it is what :meth:`TuningCache.record` writes, else None."""
    if not isinstance(entry, dict) or not isinstance(entry.get("measured"), dict):
        return None
    times = entry["measured"]
    for strategy, values in times.items():
        if not isinstance(strategy, str) or not isinstance(values, list) or not all(
                isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and v > 0
                for v in values):
            return None
    return times


class TuningCache:
    """The JSON tuning cache, loaded once per path; a missing or corrupt file is an empty cache,
    a corrupt entry is no entry (each with one warning naming the file)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._path: Path | None = None
        self._entries: dict[str, object] = {}
        self.generation = 0
        self._warned: set[str] = set()

    def _warn(self, what: str, detail: str) -> None:
        if what in self._warned:
            return
        self._warned.add(what)
        warnings.warn(f"tpfuse: tuning cache {str(self._path)!r}: {detail}; ignoring it (the file only "
                      "holds measured times: it can be deleted, and record_measurement rewrites it)",
                      RuntimeWarning, stacklevel=4)

    def _load(self, path: Path) -> None:
        self._path, self._entries = path, {}
        self.generation += 1
        if not path.exists():
            return
        try:
            data = json.loads(path.read_text())
            if not isinstance(data, dict) or not isinstance(data.get("entries"), dict):
                raise ValueError("no 'entries' object")
            self._entries = data["entries"]
        except (OSError, ValueError) as exc:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
            self._warn(str(path), f"the file is unreadable ({exc})")

    def current(self) -> tuple[int, Path]:
        """(generation, path): reload when ``TPFUSE_CACHE_DIR`` (or HOME) now points elsewhere."""
        path = tuning_cache_path()
        with self._lock:
            if path != self._path:
                self._load(path)
            return self.generation, path

    def measured(self, key: str) -> dict[str, float]:
        """strategy -> median measured ms for ``key`` (empty if none, or if the entry is corrupt)."""
        with self._lock:
            entry = self._entries.get(key)
            if entry is None:
                return {}
            times = _times(entry)
            if times is None:
                self._warn(f"{self._path}|{key}", f"the entry {key!r} is not a map of strategy -> "
                           f"positive times ({json.dumps(entry)[:120]})")
                return {}
            return {s: statistics.median(v) for s, v in times.items() if v}

    def record(self, key: str, fields: dict, strategy: str, ms: float) -> None:
        """Add one measured time for ``key`` and ``strategy`` and rewrite the file atomically
        (a corrupt entry for ``key`` is replaced)."""
        self.current()
        with self._lock:
            entry = self._entries.get(key)
            if _times(entry) is None:
                entry = self._entries[key] = dict(fields, measured={})
            entry["measured"].setdefault(strategy, []).append(ms)
            entry["measured"][strategy] = entry["measured"][strategy][-_KEEP:]
            path = self._path
            path.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(prefix=".tuning.", suffix=".json", dir=path.parent)
            try:
                with os.fdopen(fd, "w") as f:
                    json.dump({"version": 1, "entries": self._entries}, f, indent=1, sort_keys=True)
                os.replace(tmp, path)  # atomic: readers see the old or the new file, never half
            except BaseException:
                Path(tmp).unlink(missing_ok=True)
                raise
            self.generation += 1


CACHE = TuningCache()
