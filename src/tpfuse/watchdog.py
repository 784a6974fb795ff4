"""How a timed-out wait reaches the host without a device sync: host-visible error records and
the watchdog thread (DESIGN.md §3; docs/ops.md, "How errors surface").

Every symmetric-memory workspace (tpfuse/symm.py) has an error word in device memory (layout:
tpfuse/kernels/abi.py) and a *mirror* of it in host-visible memory: pinned host memory, which a
kernel addresses directly under UVA.  The word carries the mirror's address, and the kernel
that wins the word after a timeout copies its record there (tpfuse/kernels/signals.py:
``record_error``).  So the host learns of a timeout by reading host memory:

* :meth:`HostRecord.failed` -- one load, no CUDA call: the workspace's next call raises
  ``TimeoutError`` with the record;
* :class:`Watchdog` -- one daemon thread per process, started with the first workspace, polls
  every watched record every ``interval`` seconds and logs ONE line per error (through the
  ``logging`` logger ``"tpfuse"`` when logging is configured, else on stderr), naming the
  ranks, as NCCL's watchdog does.

Importing this module touches no CUDA; a record may be a plain CPU tensor (tests, and the
Triton interpreter, whose kernels store to it through its address).
"""
from __future__ import annotations

import logging
import sys
import threading
import time
import weakref
from typing import Callable, Iterable

import torch

from tpfuse.kernels import abi

__all__ = ["HostRecord", "Watchdog", "describe", "watch", "WAIT_KINDS", "register_wait"]

log = logging.getLogger("tpfuse")

# What a timeout of each wait (word abi.ERR_WHAT) means, in the user's words.  A strategy with
# waits of its own (codes it owns in abi.py) adds them through :func:`register_wait`.
WAIT_KINDS = {
    abi.WAIT_CREDIT: ("credit", "to finish reading this rank's buffer from the previous call"),
    abi.WAIT_READY: ("ready", "to publish its data for this call"),
    abi.WAIT_CREDIT2: ("credit", "to finish reading this rank's gather buffer from the previous call"),
    abi.WAIT_READY2: ("ready", "to publish its reduced rows for this call"),
}
# code -> explain(words, op=, waiter=, timeout_s=) -> the sentence (register_wait)
_EXPLAIN: dict[int, Callable[..., str]] = {}


def register_wait(code: int, kind: str, meaning: str, explain: Callable[..., str]) -> None:
    """A strategy's own wait (its code in abi.py): ``kind``/``meaning`` for :data:`WAIT_KINDS`,
    and ``explain(words, *, op, waiter, timeout_s)``, the sentence :func:`describe` gives for a
    record of that code (``waiter``: the rank that waited).  The strategy's module calls it at
    import; the kernels that record the code are its own, so it is registered before any record."""
    known = WAIT_KINDS.get(code)
    if code in (abi.WAIT_GEMM_CHUNK, abi.WAIT_CREDIT, abi.WAIT_READY, abi.WAIT_CREDIT2, abi.WAIT_READY2) or (
            known is not None and known != (kind, meaning)):
        raise ValueError(f"wait code {code} is taken ({known or 'the GEMM wait hook'}); give the wait its own code in abi.py")
    WAIT_KINDS[code] = (kind, meaning)
    _EXPLAIN[code] = explain


def describe(words: list[int], *, op: str, rank: int, timeout_s: float,
             chunk_owner: Callable[[int], int] | None = None) -> str:
    """The facts of an error record (abi.py's layout) in one sentence: who waited for whom, for
    what, which generation, and what was last seen.  ``chunk_owner``: the rank whose rows a GEMM
    chunk holds (the kernel does not know it; the strategy that launched the GEMM does)."""
    what, peer = words[abi.ERR_WHAT], words[abi.ERR_PEER]
    waiter = words[abi.ERR_RANK] if words[abi.ERR_RANK] >= 0 else rank
    gen, seen = words[abi.ERR_GENERATION], words[abi.ERR_SEEN]
    if what == abi.WAIT_GEMM_CHUNK:
        chunk = words[abi.ERR_CHUNK]
        owner = chunk_owner(chunk) if chunk_owner is not None else None
        who = f"rank {owner}, whose rows they are," if owner is not None else "the peer that owns those rows"
        return (f"tpfuse {op}: rank {waiter}'s GEMM (tile {words[abi.ERR_TILE]}, program {words[abi.ERR_PROGRAM]}) "
                f"waited more than {timeout_s:g} s (TPFUSE_TIMEOUT_S) for chunk {chunk} of its input "
                f"to land (its arrival word: wanted >= {gen}, last saw {seen}); {who} is "
                f"dead, late, or called a different op sequence.")
    explain = _EXPLAIN.get(what)
    if explain is not None:
        return explain(words, op=op, waiter=waiter, timeout_s=timeout_s)
    chunk = words[abi.ERR_CHUNK]
    kind, meaning = WAIT_KINDS.get(what, ("?", "to signal"))
    where = f" (the wait was for chunk {chunk})" if chunk >= 0 else ""
    return (f"tpfuse {op}: rank {waiter} waited more than {timeout_s:g} s (TPFUSE_TIMEOUT_S) for rank {peer} "
            f"{meaning} ({kind} flag: wanted generation >= {gen}, last saw {seen}){where}. Rank {peer} is dead, "
            f"late, or called a different op sequence.")


class HostRecord:
    """The host-visible copy of one error word: ``words`` (int32[abi.ERROR_WORDS], on the CPU;
    pinned for a CUDA workspace) that the recording kernel fills, status last.  Reading it is a
    host memory load (a numpy view), never a device sync."""

    def __init__(self, words: torch.Tensor, *, op: str, group: str, rank: int, timeout_s: float):
        if words.device.type != "cpu" or words.dtype != torch.int32 or words.numel() < abi.ERROR_WORDS:
            raise AssertionError(f"host record: need a CPU int32[{abi.ERROR_WORDS}] tensor, got {words.dtype} "
                                 f"[{words.numel()}] on {words.device}")
        self.words = words
        self._view = words.numpy()          # shares the memory: a read is a plain load
        self.op, self.group, self.rank, self.timeout_s = op, group, rank, timeout_s
        self.reported = False               # the watchdog logged it
        self.chunk_owner: Callable[[int], int] | None = None   # set by a strategy whose GEMM waits per chunk

    @classmethod
    def allocate(cls, device: torch.device, **labels) -> "HostRecord":
        """A zeroed record for a workspace on ``device``: pinned (device-addressable) for CUDA."""
        pin = device.type == "cuda"
        return cls(torch.zeros(abi.ERROR_WORDS, dtype=torch.int32, pin_memory=pin), **labels)

    @property
    def address(self) -> int:
        """Where kernels store the record (the host pointer; the same address on the device under UVA)."""
        return self.words.data_ptr()

    def failed(self) -> bool:
        """True once a kernel recorded a timeout (one host load)."""
        return int(self._view[abi.ERR_STATUS]) != abi.ERR_OK

    def record(self) -> list[int]:
        return [int(v) for v in self._view[:abi.ERR_RECORD_WORDS]]

    def message(self) -> str:
        return describe(self.record(), op=self.op, rank=self.rank, timeout_s=self.timeout_s,
                        chunk_owner=self.chunk_owner)


class Watchdog:
    """Polls host records every ``interval`` seconds and reports each error once through
    ``emit`` (default: the ``tpfuse`` logger when logging is configured, else stderr).  Records
    are held weakly: a released workspace drops out.  :meth:`poll` is one round (tests drive it
    directly); :meth:`start` runs rounds on a daemon thread."""

    def __init__(self, interval: float = 0.2, emit: Callable[[str], None] | None = None):
        self.interval = interval
        self._emit = emit or _emit
        self._records: list[weakref.ref] = []
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None

    def watch(self, record: HostRecord) -> None:
        with self._lock:
            self._records.append(weakref.ref(record))

    def _live(self) -> Iterable[HostRecord]:
        with self._lock:
            self._records = [r for r in self._records if r() is not None]
            return [r() for r in self._records]

    def poll(self) -> list[str]:
        """One round: the lines reported now (each error once)."""
        lines = []
        for record in self._live():
            if record is not None and not record.reported and record.failed():
                record.reported = True
                line = (f"tpfuse watchdog: {record.message()} The outputs of that call and of every call queued "
                        f"after it on this workspace are NaN; the next tpfuse call (or tpfuse.synchronize()) raises "
                        f"TimeoutError. Call tpfuse.release_workspaces() on every rank to recover.")
                self._emit(line)
                lines.append(line)
        return lines

    def start(self) -> None:
        with self._lock:
            if self._thread is not None and self._thread.is_alive():
                return
            self._thread = threading.Thread(target=self._run, name="tpfuse-watchdog", daemon=True)
            self._thread.start()

    def _run(self) -> None:
        while True:
            time.sleep(self.interval)
            try:
                self.poll()
            except Exception as exc:   # a watchdog must never take the process down
                _emit(f"tpfuse watchdog: polling failed: {exc!r}")


def _emit(line: str) -> None:
    """Through the ``tpfuse`` logger when logging is configured, else straight to stderr (one
    line either way: not both, which would print it twice where logging writes to stderr)."""
    if log.hasHandlers():
        log.error(line)
    else:
        print(line, file=sys.stderr, flush=True)


_WATCHDOG = Watchdog()


def watch(record: HostRecord) -> None:
    """Watch ``record`` with the process's watchdog, starting its thread on the first call."""
    _WATCHDOG.watch(record)
    _WATCHDOG.start()
