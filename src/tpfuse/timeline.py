"""Timelines: what each rank's GEMM, copies, waits and reductions did, and when.

A timeline is a list of :class:`TimelineEvent` (one span each: rank, lane, name, start/end in
nanoseconds, and optionally the communication chunk and the CTA tile it belongs to).  Lanes
are free-form strings; the strategies use ``"gemm"``, ``"copy"``, ``"wait"``, ``"reduce"`` and
the bench adds ``"call"`` around each op call.

Recording is off by default and costs one module attribute read when off::

    from tpfuse import timeline
    with timeline.recording() as rec:          # this process records
        tpfuse.ag_gemm(a_shard, b, strategy="ring")
    events = rec.events()                      # synchronizes CUDA, resolves events to ns
    timeline.to_chrome_trace(events)           # Perfetto / chrome://tracing JSON (a dict)
    timeline.draw(events, "out.png")           # one row per (rank, lane)

Inside a strategy (the whole cost when off is one attribute read)::

    with timeline.span("gemm", f"chunk {c}", device=a.device, chunk=c):
        ...

Spans on a CPU device are timed with ``time.perf_counter_ns`` (CLOCK_MONOTONIC on Linux: one
clock for every process of the host, so ranks line up).  Spans on a CUDA device record a pair of
CUDA events on the current stream (the work between them is what the stream ran, not what the
host waited for); :meth:`Recorder.events` synchronizes and places them on the host clock through
a reference event recorded when recording started (alignment to within a launch, ~us).
Device-side records (``%globaltimer`` per tile, added to kernels later) come in as raw ns with
:meth:`Recorder.add_raw` or, a buffer at a time, :meth:`Recorder.add_records` (with an offset
onto the host clock); ``to_chrome_trace`` and ``draw`` only assume that the events of one rank
share a clock.  Spans cannot be recorded while a CUDA graph is being captured.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Iterable, Iterator

import torch

__all__ = ["TimelineEvent", "Recorder", "recording", "current", "span", "to_chrome_trace", "draw", "LANES"]

# Drawing order of the lanes the strategies use; other lanes follow, sorted by name.
LANES = ("call", "gemm", "copy", "wait", "reduce")


@dataclass(frozen=True)
class TimelineEvent:
    """One span: ``[start_ns, end_ns)`` on ``rank``'s ``lane``; ``chunk``/``tile`` where it has one."""

    rank: int
    lane: str
    name: str
    start_ns: int
    end_ns: int
    chunk: int | None = None
    tile: int | None = None

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> TimelineEvent:
        return cls(**{k: d.get(k) for k in ("rank", "lane", "name", "start_ns", "end_ns", "chunk", "tile")})


class _Switch:
    """The one flag the strategies read: the active recorder of this process, or None."""

    recorder: Recorder | None = None


_SWITCH = _Switch()


def current() -> Recorder | None:
    """The active recorder of this process, or None (the default: record nothing)."""
    return _SWITCH.recorder


_NO_SPAN = contextlib.nullcontext()   # stateless: one for every span that records nothing


def span(lane: str, name: str, *, device: torch.device, chunk: int | None = None):
    """The active recorder's :meth:`Recorder.span`, or a no-op context when nothing records or
    a CUDA graph is being captured (a captured call records nothing; its replays neither)."""
    rec = _SWITCH.recorder
    if rec is None or (device.type == "cuda" and torch.cuda.is_current_stream_capturing()):
        return _NO_SPAN
    return rec.span(lane, name, device=device, chunk=chunk)


class Recorder:
    """Collects spans of one process.  Made by :func:`recording`; not thread-safe."""

    def __init__(self, rank: int | None = None):
        if rank is None:
            import torch.distributed as dist

            rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
        self.rank = rank
        self._spans: list[tuple] = []  # (lane, name, start, end, chunk, tile), start/end: int ns or CUDA events
        self._raw: list[TimelineEvent] = []
        self._tiles: list[tuple] = []   # (records, tile_shape, tile_grid, chunk_m, anchor stamp)
        self._cuda_ref: dict[int, tuple[torch.cuda.Event, int]] = {}  # device index -> (event, host ns)

    # -- stamps -------------------------------------------------------------------------------
    def _cuda_reference(self, index: int) -> None:
        """Anchor device ``index``'s events to the host clock: an event recorded right after a
        synchronize, with the host time of that moment."""
        torch.cuda.synchronize(index)
        event = torch.cuda.Event(enable_timing=True)
        event.record(torch.cuda.current_stream(index))
        event.synchronize()
        self._cuda_ref[index] = (event, time.perf_counter_ns())

    def now(self, device: torch.device | None = None):
        """A time stamp: host ns for CPU (or None) devices, a CUDA event on the current stream otherwise."""
        if device is None or device.type != "cuda":
            return time.perf_counter_ns()
        if torch.cuda.is_current_stream_capturing():
            raise RuntimeError("timeline spans cannot be recorded while a CUDA graph is being captured; "
                               "record eager calls (outside torch.cuda.graph) or stop the recording")
        index = device.index if device.index is not None else torch.cuda.current_device()
        if index not in self._cuda_ref:
            self._cuda_reference(index)
        event = torch.cuda.Event(enable_timing=True)
        event.record(torch.cuda.current_stream(index))
        return (index, event)

    def add_span(self, lane: str, name: str, start, end, *, chunk: int | None = None, tile: int | None = None) -> None:
        """Record a span between two stamps from :meth:`now` (of the same device)."""
        self._spans.append((lane, name, start, end, chunk, tile))

    @contextlib.contextmanager
    def span(self, lane: str, name: str, *, device: torch.device | None = None, chunk: int | None = None,
             tile: int | None = None) -> Iterator[None]:
        """Time the block: host time on CPU, the current stream's work between two events on CUDA."""
        start = self.now(device)
        try:
            yield
        finally:
            self.add_span(lane, name, start, self.now(device), chunk=chunk, tile=tile)

    def add_raw(self, lane: str, name: str, start_ns: int, end_ns: int, *, rank: int | None = None,
                chunk: int | None = None, tile: int | None = None) -> None:
        """A span already in nanoseconds (e.g. ``%globaltimer`` records read back from a kernel)."""
        if end_ns < start_ns:
            raise ValueError(f"add_raw: end_ns {end_ns} is before start_ns {start_ns} ({lane}/{name})")
        self._raw.append(TimelineEvent(self.rank if rank is None else rank, lane, name, int(start_ns), int(end_ns),
                                       chunk, tile))

    def add_records(self, lane: str, name: str, records, *, offset_ns: int = 0, rank: int | None = None) -> None:
        """Many raw spans at once: ``records`` [N, 2..4] integers (start_ns, end_ns[, chunk[, tile]]),
        e.g. a kernel's ``%globaltimer`` buffer read back; a negative chunk/tile means none.
        ``offset_ns`` is added to both times (to move a device clock onto the host's)."""
        rows = records.tolist() if hasattr(records, "tolist") else [list(r) for r in records]
        for row in rows:
            if not 2 <= len(row) <= 4:
                raise ValueError(f"add_records: each record is (start_ns, end_ns[, chunk[, tile]]), got {row}")
            chunk = int(row[2]) if len(row) > 2 and row[2] >= 0 else None
            tile = int(row[3]) if len(row) > 3 and row[3] >= 0 else None
            self.add_raw(lane, name, int(row[0]) + offset_ns, int(row[1]) + offset_ns, rank=rank, chunk=chunk, tile=tile)

    def add_tile_records(self, records: torch.Tensor, plan, chunk_m: int, anchor) -> None:
        """A GEMM's per-tile records (``tpfuse.gemm.matmul(tile_records=...)``, columns in
        ``tpfuse/kernels/abi.py``) with its :class:`~tpfuse.gemm.LaunchPlan` (the tile grid) and
        the stamp (:meth:`now`) taken just before the launch.  Read back in :meth:`events`: lane
        ``"tiles chunk NN"`` per communication chunk (of the tile's first row), and ``"tile
        waits"`` for the part of a tile spent in the wait hook.  The device clock
        (``%globaltimer``) is placed on the host's by putting the earliest tile start at the
        anchor (the launch's stream position): exact in durations, within a launch latency in
        offset."""
        self._tiles.append((records, tuple(plan.tile_shape), tuple(plan.tile_grid), int(chunk_m), anchor))

    def _tile_events(self) -> list[TimelineEvent]:
        from tpfuse.kernels import abi

        out = []
        for records, (bm, _), (_, grid_n), chunk_m, anchor in self._tiles:
            rows = [r for r in records.cpu().tolist() if r[abi.REC_START_NS] >= 0 and r[abi.REC_TILE] >= 0]
            if not rows:
                continue
            base = self._ns(anchor) - min(r[abi.REC_START_NS] for r in rows)
            for r in rows:
                tile = int(r[abi.REC_TILE])
                chunk = (tile // grid_n) * bm // max(1, chunk_m)
                start, wait, end = (int(r[c]) + base for c in (abi.REC_START_NS, abi.REC_WAIT_NS, abi.REC_END_NS))
                out.append(TimelineEvent(self.rank, f"tiles chunk {chunk:02d}", f"tile {tile}", start, max(start, end),
                                         chunk, tile))
                if wait > start:
                    out.append(TimelineEvent(self.rank, "tile waits", f"tile {tile}", start, wait, chunk, tile))
        return out

    # -- results ------------------------------------------------------------------------------
    def _ns(self, stamp) -> int:
        if isinstance(stamp, int):
            return stamp
        index, event = stamp
        ref, ref_ns = self._cuda_ref[index]
        return ref_ns + round(ref.elapsed_time(event) * 1e6)

    def events(self) -> list[TimelineEvent]:
        """Every span so far, in ns, sorted by start (synchronizes the CUDA devices used)."""
        for index in self._cuda_ref:
            torch.cuda.synchronize(index)
        out = [TimelineEvent(self.rank, lane, name, self._ns(s), self._ns(e), chunk, tile)
               for lane, name, s, e, chunk, tile in self._spans]
        return sorted(out + self._raw + self._tile_events(), key=lambda ev: (ev.start_ns, ev.lane))


@contextlib.contextmanager
def recording(rank: int | None = None) -> Iterator[Recorder]:
    """Record this process's spans inside the block (one recorder at a time)."""
    if _SWITCH.recorder is not None:
        raise RuntimeError("timeline.recording(): a recording is already active in this process")
    rec = Recorder(rank)
    _SWITCH.recorder = rec
    try:
        yield rec
    finally:
        _SWITCH.recorder = None


# --------------------------------------------------------------------------------------------
# Output: Chrome trace JSON and a PNG
# --------------------------------------------------------------------------------------------


def _lane_order(events: Iterable[TimelineEvent]) -> list[str]:
    present = {ev.lane for ev in events}
    return [lane for lane in LANES if lane in present] + sorted(present - set(LANES))


def to_chrome_trace(events: list[TimelineEvent], *, meta: dict[str, Any] | None = None) -> dict:
    """Chrome trace-event JSON (loads in Perfetto / chrome://tracing): one process per rank, one
    thread per lane, complete ("X") events in microseconds from the earliest start."""
    t0 = min((ev.start_ns for ev in events), default=0)
    lanes = _lane_order(events)
    trace: list[dict] = []
    for rank in sorted({ev.rank for ev in events}):
        trace.append({"ph": "M", "name": "process_name", "pid": rank, "tid": 0, "args": {"name": f"rank {rank}"}})
        for tid, lane in enumerate(lanes):
            trace.append({"ph": "M", "name": "thread_name", "pid": rank, "tid": tid, "args": {"name": lane}})
            trace.append({"ph": "M", "name": "thread_sort_index", "pid": rank, "tid": tid, "args": {"sort_index": tid}})
    for ev in events:
        args = {k: v for k, v in (("chunk", ev.chunk), ("tile", ev.tile)) if v is not None}
        trace.append({"ph": "X", "name": ev.name, "cat": ev.lane, "pid": ev.rank, "tid": lanes.index(ev.lane),
                      "ts": (ev.start_ns - t0) / 1e3, "dur": (ev.end_ns - ev.start_ns) / 1e3, "args": args})
    return {"traceEvents": trace, "displayTimeUnit": "ns", "otherData": dict(meta or {})}


_COLORS = {"call": "#bbbbbb", "gemm": "#4c72b0", "copy": "#55a868", "wait": "#c44e52", "reduce": "#8172b2",
           "tiles": "#6b8fc7", "tile": "#e08a8c"}   # "tiles chunk NN", "tile waits": first word


def _pyplot():
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:
        raise RuntimeError("drawing a PNG needs matplotlib: pip install 'tpfuse[cli]' (or matplotlib)") from exc
    return plt


def _panels(events: list[TimelineEvent]) -> list[tuple[str, list[TimelineEvent]]]:
    """Split at the "call" spans: one panel per distinct call name (in order of first start),
    holding the events that lie inside a call of that name on the same rank."""
    calls = sorted((ev for ev in events if ev.lane == "call"), key=lambda ev: ev.start_ns)
    if not calls:
        return [("", events)]
    names = list(dict.fromkeys(ev.name for ev in calls))
    panels = []
    for name in names:
        mine = [c for c in calls if c.name == name]
        inside = [ev for ev in events if ev.lane == "call" and ev.name == name or ev.lane != "call" and any(
            c.rank == ev.rank and c.start_ns <= ev.start_ns <= c.end_ns for c in mine)]
        panels.append((name, inside))
    return panels


def draw(events: list[TimelineEvent], path: str | Path, *, title: str = "") -> Path:
    """A PNG with one row per (rank, lane): each span a bar, its chunk number inside where it fits.

    With "call" spans (the bench records one per strategy) each call name gets its own panel,
    on its own time axis.  Fill (waiting for the first chunk before the GEMM can start), steady
    state (GEMM bars back to back with copies under them) and tail (the last copy or reduction
    after the last GEMM) read left to right.
    """
    if not events:
        raise ValueError("draw: no events to draw (was anything recorded inside timeline.recording()?)")
    plt = _pyplot()
    panels = _panels(events)
    lanes = _lane_order(events)
    layout = []
    for name, mine in panels:
        rows = [(rank, lane) for rank in sorted({ev.rank for ev in mine}) for lane in lanes
                if any(ev.rank == rank and ev.lane == lane for ev in mine)]
        layout.append((name, mine, rows))
    heights = [max(1, len(rows)) for _, _, rows in layout]
    fig, axes = plt.subplots(len(layout), 1, figsize=(12, 0.42 * sum(heights) + 1.2 * len(layout)),
                             gridspec_kw={"height_ratios": heights}, squeeze=False)
    for ax, (name, mine, rows) in zip(axes[:, 0], layout):
        t0 = min(ev.start_ns for ev in mine)
        span_us = max(1e-3, (max(ev.end_ns for ev in mine) - t0) / 1e3)
        for y, (rank, lane) in enumerate(rows):
            spans = [ev for ev in mine if ev.rank == rank and ev.lane == lane]
            bars = [((ev.start_ns - t0) / 1e3, max((ev.end_ns - ev.start_ns) / 1e3, span_us * 2e-3)) for ev in spans]
            ax.broken_barh(bars, (y - 0.4, 0.8), facecolors=_COLORS.get(lane, _COLORS.get(lane.split()[0], "#937860")), edgecolor="black",
                           linewidth=0.3)
            for ev, (x, w) in zip(spans, bars):
                if ev.chunk is not None and w > span_us * 0.03:
                    ax.text(x + w / 2, y, str(ev.chunk), ha="center", va="center", fontsize=7, color="white")
        ax.set_yticks(range(len(rows)), [f"rank {r} {lane}" for r, lane in rows], fontsize=8)
        ax.set_ylim(len(rows) - 0.5, -0.5)
        ax.set_title(name or title or "tpfuse timeline", fontsize=9, loc="left")
        ax.grid(axis="x", alpha=0.3)
    axes[-1, 0].set_xlabel("us from the first event of the panel")
    if title:
        fig.suptitle(title, fontsize=10)
    return save_figure(fig, path)


def save_figure(fig, path: str | Path) -> Path:
    """Lay out, write ``fig`` as a PNG at ``path`` (its folder created), close it."""
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    _pyplot().close(fig)
    return path
