"""Discrete-event replay of one op on W ranks: the engine that runs a strategy's schedule.

Each rank has three in-order engines: ``gemm`` (the compute stream: GEMMs, reductions, local
copies and flag kernels), ``comm`` (whoever moves the bytes: NCCL, the side stream's copy-engine
copies, or a GEMM epilogue's stores to peers) and ``host`` (the Python thread issuing launches,
eager mode only).  A strategy's :class:`Schedule` (declared in its own module as ``SCHEDULE``)
builds a list of tasks per engine, in the order the strategy's code issues them, with
dependencies -- also across ranks (a pull waits for the peer's READY flag; a reduce-scatter
owner waits for every peer's partial).  A task starts when its engine is free, its rank has
started (per-rank skew) and every dependency has finished.  Engines never reorder work, so the
replay is exact for that model and monotone: no task duration getting shorter can make the op
slower.  :mod:`tpfuse.model.steps` holds the steps our strategies' schedules are made of.

Host (eager calls): the host never waits for the GPU.  It runs ahead, issuing this op's
launches while the GPU still runs earlier work, so device tasks do not wait for their issue;
the host's own tasks (tpfuse's dispatch, then one per launch) run serially on the ``host``
engine and a rank ends when both its GPU work and its host work are done: only the part of the
host time that exceeds the GPU time shows.  Under CUDA graphs there is no host time at all.

Per rank the result reports, around the bottleneck engine (gemm or comm, whichever has more
work), ``fill`` (start until it starts), ``drain`` (the exposed tail: the other engine's work
after it ended) and ``steady`` (the rest, bubbles included), ``backlog`` (most chunks waiting
between producer and consumer at once), GEMM/comm busy time, exposed communication and the
total; ``draw_timeline`` turns it into a PNG.  This module imports no strategy.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional

from tpfuse import dtypes
from tpfuse.model import cost
from tpfuse.model.hardware import HardwareProfile

__all__ = ["OPS", "Schedule", "Graph", "Ctx", "Task", "RankStats", "SimResult", "simulate",
           "built_num_chunks", "split_rows", "row_bounds", "draw_timeline"]

OPS = ("ag_gemm", "gemm_rs", "gemm_ar")


@dataclass(frozen=True)
class Schedule:
    """A strategy's schedule for the simulator (its module's ``SCHEDULE``).

    ``build(g, c)``: adds the tasks of op ``c.op`` (a :class:`Ctx`) for every rank in
    ``g.ranks`` to the :class:`Graph` ``g``, in the order the strategy issues them; called for
    ``world_size > 1`` only (one rank runs one GEMM, whatever the strategy).
    ``kind``: one word for explanations: "collective", "ring" or "pipeline" (chunks over
    symmetric memory; the planner reports its pieces per rank).
    ``num_chunks(op, m=, n=, k=, world_size=, dtype=, hw=, cuda_graph=, num_sms=)``: the
    communication chunks along the full M the strategy runs with, as built (None: 1).
    ``chunk_knob_ops``: ops whose chunk count is a knob (``num_chunks = W x pieces per rank``):
    :func:`simulate` replays any multiple of W there.
    ``sm_budget(hw, world_size)``: the grid of the strategy's persistent GEMM (None: it runs
    none; the planner reports 0 SMs).
    ``tile_m``: rows of that GEMM's M-tile (symmetric replay of shards that are not a multiple
    of it follows a rank whose first tile straddles its neighbour's rows).
    """
    build: Callable[["Graph", "Ctx"], None]
    kind: str = "collective"
    num_chunks: Optional[Callable[..., int]] = None
    chunk_knob_ops: tuple[str, ...] = ()
    sm_budget: Optional[Callable[[HardwareProfile, int], int]] = None
    tile_m: int = 0

    def __post_init__(self):
        if not callable(self.build):
            raise TypeError(f"Schedule.build: expected a function (graph, ctx) -> None, got {self.build!r}")
        if self.kind not in ("collective", "ring", "pipeline"):
            raise ValueError(f"Schedule.kind={self.kind!r}: use 'collective', 'ring' or 'pipeline'")
        bad = [op for op in self.chunk_knob_ops if op not in OPS]
        if bad:
            raise ValueError(f"Schedule.chunk_knob_ops: unknown ops {bad}; use names from {OPS}")


@dataclass
class Task:
    """One unit of work on one engine of one rank. Times are ms from the earliest rank start."""

    tid: int
    rank: int
    engine: str  # "gemm" | "comm" | "host"
    kind: str  # "gemm" | "comm" | "reduce" | "copy" (within one GPU) | "flag" (flags, waits) | "host"
    duration: float
    deps: tuple[int, ...]
    label: str
    chunk: int = -1
    start: float = math.nan
    end: float = math.nan


@dataclass(frozen=True)
class RankStats:
    rank: int
    start: float
    end: float
    total: float
    fill: float
    steady: float
    drain: float
    backlog: int
    gemm_busy: float
    comm_busy: float
    exposed_comm: float
    host_tail: float = 0.0   # how long the rank's host work outlasts its device work (eager calls)


@dataclass
class SimResult:
    op: str
    strategy: str
    world_size: int
    num_chunks: int
    makespan_ms: float
    ranks: list[RankStats]
    tasks: list[Task] = field(repr=False)

    @property
    def fill_ms(self) -> float:
        return max(r.fill for r in self.ranks)

    @property
    def drain_ms(self) -> float:
        return max(r.drain for r in self.ranks)

    @property
    def exposed_comm_ms(self) -> float:
        return max(r.exposed_comm for r in self.ranks)


class Graph:
    """The tasks of one replay: strategies add them with :meth:`add` and :meth:`flag`."""

    def __init__(self, world_size: int, skew: tuple[float, ...], symmetric: bool = False,
                 host_call_us: float = 0.0, host_scale: float = 0.0):
        self.tasks: list[Task] = []
        self.world_size = world_size
        self.skew = skew
        self.pairs: list[tuple[int, int, int]] = []  # (rank, producer tid, consumer tid)
        # symmetric: every rank runs rank 0's schedule rotated (no skew, equal shards), so only
        # rank 0 is built and a dependency on rank q's task is one on rank 0's same task.
        self.symmetric = symmetric
        self.ranks = range(1) if symmetric else range(world_size)
        self.host_scale = host_scale  # ms per us of host time: 1e-3 eager, 0 under CUDA graphs
        self.host_call_ms = host_call_us * host_scale

    def peer(self, rank: int) -> int:
        """The rank whose task stands for ``rank``'s (0 in symmetric mode)."""
        return 0 if self.symmetric else rank

    def add(self, rank: int, engine: str, kind: str, duration: float, deps=(), label: str = "",
            chunk: int = -1, launch: bool = False, issue_us: float | None = None) -> int:
        """A task; ``launch=True``: issued from the host as its own call, which costs a host
        task of ``host_call_us`` (``issue_us`` if given) on the rank's serial host engine in
        eager mode (none under CUDA graphs).  The device task does not wait for it: the host
        runs ahead of the GPU (see the module docstring)."""
        deps = tuple(d for d in deps if d is not None)
        host_ms = (self.host_call_ms if issue_us is None else issue_us * self.host_scale) if launch else 0.0
        if host_ms > 0:
            self.host(rank, host_ms, f"issue {label}")
        tid = len(self.tasks)
        self.tasks.append(Task(tid, rank, engine, kind, max(0.0, duration), deps, label, chunk))
        return tid

    def host(self, rank: int, ms: float, label: str) -> int:
        """``ms`` of host time on ``rank`` (issuing work; no device task waits for it)."""
        tid = len(self.tasks)
        self.tasks.append(Task(tid, rank, "host", "host", max(0.0, ms), (), label))
        return tid

    def flag(self, rank: int, engine: str, label: str, deps=(), launch: bool = True) -> int:
        """A flag kernel or stream write (signal, wait, arrival word, memset of words): a host
        call (``launch=False``: a step inside the previous launch, no call of its own), no
        device time of its own."""
        return self.add(rank, engine, "flag", 0.0, deps=deps, label=label, launch=launch)

    def run(self) -> None:
        """Event-driven replay: each engine runs its queue in order; a task starts at
        max(engine free, rank start, end of every dependency)."""
        queues: dict[tuple[int, str], list[Task]] = {}
        for t in self.tasks:
            queues.setdefault((t.rank, t.engine), []).append(t)
        heads = {key: 0 for key in queues}
        free = {key: self.skew[key[0]] for key in queues}
        waiting = [len(set(t.deps)) for t in self.tasks]
        dependents: list[list[int]] = [[] for _ in self.tasks]
        for t in self.tasks:
            for d in set(t.deps):
                dependents[d].append(t.tid)
        ready = [key for key, q in queues.items() if waiting[q[0].tid] == 0]
        finished = 0
        while ready:
            key = ready.pop()
            queue = queues[key]
            while heads[key] < len(queue) and waiting[queue[heads[key]].tid] == 0:
                t = queue[heads[key]]
                t.start = max([free[key]] + [self.tasks[d].end for d in t.deps])
                t.end = t.start + t.duration
                free[key] = t.end
                heads[key] += 1
                finished += 1
                for d in dependents[t.tid]:
                    waiting[d] -= 1
                    dt = self.tasks[d]
                    other = (dt.rank, dt.engine)
                    if waiting[d] == 0 and other != key and queues[other][heads[other]] is dt:
                        ready.append(other)
        if finished != len(self.tasks):
            stuck = next(t for t in self.tasks if math.isnan(t.start))
            raise ValueError(f"schedule: the replay deadlocked at rank {stuck.rank}'s {stuck.engine} task "
                             f"{stuck.label!r}: a task waits for one that can never finish (a cycle, or a task "
                             "queued behind its own dependent on one engine); fix the schedule's build")

def split_rows(total: int, parts: int) -> list[int]:
    """``total`` rows into ``parts`` near-equal integer pieces (the first ones one larger)."""
    q, r = divmod(total, parts)
    return [q + (1 if i < r else 0) for i in range(parts)]


def row_bounds(sizes: list[int]) -> list[tuple[int, int]]:
    """Consecutive row ranges of the given sizes."""
    out, lo = [], 0
    for s in sizes:
        out.append((lo, lo + s))
        lo += s
    return out


def _check(op, world_size, num_chunks):
    if op not in OPS:
        raise ValueError(f"op: unknown op {op!r}; use one of {OPS}")
    if world_size < 1:
        raise ValueError(f"world_size: {world_size} must be >= 1")
    if num_chunks is not None and num_chunks < 1:
        raise ValueError(f"num_chunks: {num_chunks} must be >= 1")


def built_num_chunks(op: str, schedule: Schedule, *, m: int, n: int, k: int, world_size: int, dtype: str,
                     hw: HardwareProfile, cuda_graph: bool = False, num_sms: int | None = None) -> int:
    """Communication chunks (along the full M) ``schedule`` runs ``op`` with, as built: its
    ``num_chunks`` (1 without one, and at world size 1)."""
    if world_size == 1 or schedule.num_chunks is None:
        return 1
    return schedule.num_chunks(op, m=m, n=n, k=k, world_size=world_size, dtype=dtype, hw=hw,
                               cuda_graph=cuda_graph, num_sms=num_sms)


def simulate(op: str, schedule: Schedule, *, m: int, n: int, k: int, world_size: int, dtype: str,
             hw: HardwareProfile, num_chunks: int | None = None, skew_ms: tuple[float, ...] | None = None,
             num_sms: int | None = None, cuda_graph: bool = False, fast: bool = False,
             name: str = "") -> SimResult:
    """Replay ``op`` with ``schedule`` (a strategy's ``SCHEDULE``; ``name`` labels the result)
    on ``world_size`` ranks.  ``tpfuse.strategies.simulate`` does the same by strategy name.

    ``m`` is the full M, ``n``/``k`` the local sizes (as the ops take them); ``dtype`` a
    canonical name (``bf16``...).  ``num_chunks`` counts communication chunks along the full M;
    None (or the same number) is what the strategy runs (:func:`built_num_chunks`); in the
    schedule's ``chunk_knob_ops`` any multiple of W (``W x pieces per rank``); any other count
    is a ``ValueError``.  ``skew_ms[r]`` delays rank r's start.  ``num_sms``: the persistent
    GEMM's grid (None: the schedule's ``sm_budget``, else every SM).

    Host: in eager mode (default) every strategy pays the same host model -- ``host_op_us`` of
    tpfuse dispatch per call, then ``host_call_us`` per host-issued launch, copy, flag kernel,
    stream write or collective (``host_core_call_us`` for a persistent GEMM's launch; ring:
    ``ring_step_host_us`` per step) on a serial host engine that runs ahead of the GPU: the op
    takes the longer of its GPU time and its host time.  ``cuda_graph=True``: replayed from a
    graph, no host time at all.

    ``fast=True`` (the planner): without skew every rank runs the same schedule rotated, so only
    one rank is replayed (exact when the shards are equal and a multiple of the schedule's
    ``tile_m``; otherwise a rank whose first M-tile straddles its neighbour's rows is replayed,
    and uneven shards are all modelled as the largest one: upper bounds) and every rank reports
    its numbers.
    """
    if not isinstance(schedule, Schedule):
        raise TypeError(f"schedule: expected a tpfuse.model.simulate.Schedule, got {type(schedule).__name__}; "
                        "to replay a strategy by name use tpfuse.strategies.simulate")
    w = world_size
    _check(op, w, num_chunks)
    if num_sms is not None:
        gemm_sms = num_sms
    else:
        gemm_sms = schedule.sm_budget(hw, w) if schedule.sm_budget is not None else hw.sm_count
    if gemm_sms < 1:
        raise ValueError(f"num_sms: {num_sms} must be >= 1 (the persistent GEMM's grid)")
    knob = w > 1 and op in schedule.chunk_knob_ops
    if num_chunks is None or w == 1 or not knob:
        built = built_num_chunks(op, schedule, m=m, n=n, k=k, world_size=w, dtype=dtype, hw=hw,
                                 cuda_graph=cuda_graph, num_sms=num_sms)
        if num_chunks is not None and w > 1 and num_chunks != built:
            raise ValueError(f"num_chunks: {name or 'this strategy'} runs {op} with {built} chunk(s) as built; "
                             f"its chunk count is no knob for {op}; pass None or {built}")
        num_chunks = built
    elif num_chunks % w:
        raise ValueError(f"num_chunks: {num_chunks} is not a multiple of world_size {w}; {name or 'the strategy'} "
                         f"cuts each rank's shard into num_chunks / W pieces, use a multiple such as {w}")
    skew = tuple(skew_ms) if skew_ms is not None else (0.0,) * w
    if len(skew) != w:
        raise ValueError(f"skew_ms: {len(skew)} values for world_size {w}; give one per rank")
    base = min(skew)
    skew = tuple(s - base for s in skew)
    symmetric = fast and w > 1 and max(skew) == 0.0
    host_scale = 0.0 if cuda_graph else 1e-3
    g = Graph(w, skew, symmetric=symmetric, host_call_us=hw.host_call_us, host_scale=host_scale)
    ctx = Ctx(op, m, n, k, w, dtype, hw, num_chunks, gemm_sms,
              ring_step_ms=hw.ring_step_host_us * host_scale, even=symmetric, tile_m=schedule.tile_m)
    for r in g.ranks:  # tpfuse's own dispatch comes first on every rank's host
        g.host(r, hw.host_op_us * host_scale, "dispatch")
    if w == 1:
        g.add(0, "gemm", "gemm", cost.gemm_time_ms(m, n, k, dtype, hw), label="GEMM", launch=True)
    else:
        schedule.build(g, ctx)
    g.run()
    by_rank: list[list[Task]] = [[] for _ in range(w)]
    for t in g.tasks:
        by_rank[t.rank].append(t)
    pairs: list[list[tuple[int, int]]] = [[] for _ in range(w)]
    for rank, prod, cons in g.pairs:
        pairs[rank].append((prod, cons))
    if symmetric:
        zero = _rank_stats(g, 0, by_rank[0], pairs[0])
        ranks = [zero] + [dataclasses.replace(zero, rank=r) for r in range(1, w)]
    else:
        ranks = [_rank_stats(g, r, by_rank[r], pairs[r]) for r in range(w)]
    makespan = max(r.end for r in ranks) - min(r.start for r in ranks)
    return SimResult(op, name, w, num_chunks, makespan, ranks, g.tasks)


@dataclass(frozen=True)
class Ctx:
    op: str
    m: int
    n: int
    k: int
    w: int
    dtype: str
    hw: HardwareProfile
    num_chunks: int
    gemm_sms: int  # the persistent GEMM's grid (its epilogue stores to peers use these SMs)
    ring_step_ms: float = 0.0  # host issue time of one ring step (0 under CUDA graphs)
    even: bool = False  # every shard as the largest one (symmetric replay)
    tile_m: int = 0  # the schedule's persistent GEMM tile height (Schedule.tile_m)

    def shard_rows(self) -> list[int]:
        rows = split_rows(self.m, self.w)
        return [rows[0]] * self.w if self.even else rows

    @property
    def elt(self) -> int:
        return dtypes.itemsize(self.dtype)

    def gemm(self, rows: int, *, num_sms: int | None = None, hbm_share: float = 1.0) -> float:
        """A separately launched cuBLAS GEMM on ``rows`` rows: the cuBLAS model at that M (its
        launch, ``gemm_launch_us``, is the gap each launch pays), but never less than its share
        of the whole GEMM plus that launch (back-to-back chunks heat the chip like the whole
        GEMM does, and the tile-choice model could otherwise reward chunking for
        wave-quantization luck)."""
        t = cost.gemm_time_ms(rows, self.n, self.k, self.dtype, self.hw, num_sms=num_sms,
                              hbm_share=hbm_share)
        whole = cost.gemm_time_ms(self.m, self.n, self.k, self.dtype, self.hw, num_sms=num_sms,
                                  hbm_share=hbm_share, launch=False)
        return max(t, whole * rows / max(self.m, 1) + self.hw.gemm_launch_us * 1e-3)

    def host_steps(self, g: "Graph", rank: int, steps: int) -> None:
        """``steps`` host-issue tasks of a ring on ``rank`` (``ring_step_host_us`` each): host
        time that shows only where it exceeds the ring's GPU time."""
        for s in range(steps):
            g.host(rank, self.ring_step_ms, f"issue {s}")

    def xfer(self, num_bytes: float, path: str) -> float:
        return cost.transfer_time_ms(num_bytes, path, self.hw,
                                     num_sms=self.gemm_sms if path == "sm" else None, world_size=self.w)

    def layout_rank(self, g: "Graph", r: int) -> int:
        """The rank whose row geometry rank ``r``'s tasks follow: itself, except in symmetric
        replay when shards are not a multiple of the persistent GEMM's tile height -- then rank 1,
        whose first M-tile straddles rank 0's rows (ranks are not rotations of each other then;
        rank 0, aligned, would be the optimistic one)."""
        if g.symmetric and self.w > 1 and self.tile_m and self.shard_rows()[0] % self.tile_m:
            return 1
        return r

def _rank_stats(g: Graph, r: int, tasks: list[Task], pairs: list[tuple[int, int]]) -> RankStats:
    mine = [t for t in tasks if t.duration > 0]
    start = g.skew[r]
    end = max((t.end for t in mine), default=start)
    gemm_tasks = [t for t in mine if t.engine == "gemm"]
    comm_tasks = [t for t in mine if t.engine == "comm"]
    gemm_busy = sum(t.duration for t in gemm_tasks)
    comm_busy = sum(t.duration for t in comm_tasks)
    total = end - start
    if gemm_tasks and comm_tasks:
        # The seed decomposition T = fill + steady + drain around the bottleneck engine (the one
        # with more work): fill = before it starts, drain = the other engine's tail after it ends.
        bottleneck = gemm_tasks if gemm_busy >= comm_busy else comm_tasks
        fill = max(0.0, min(t.start for t in bottleneck) - start)
        drain = max(0.0, end - max(t.end for t in bottleneck))
    else:
        fill = drain = 0.0
    events = []
    for prod, cons in pairs:
        events.append((g.tasks[prod].end, 1))
        events.append((g.tasks[cons].start, -1))
    backlog = peak = 0
    for _, delta in sorted(events, key=lambda e: (e[0], e[1])):
        backlog += delta
        peak = max(peak, backlog)
    device_end = max((t.end for t in gemm_tasks + comm_tasks), default=start)
    return RankStats(rank=r, start=start, end=end, total=total, fill=fill,
                     steady=max(0.0, total - fill - drain), drain=drain, backlog=peak,
                     gemm_busy=gemm_busy, comm_busy=comm_busy,
                     exposed_comm=max(0.0, total - gemm_busy), host_tail=max(0.0, end - device_end))


def draw_timeline(result: SimResult, path, *, title: str | None = None) -> None:
    """Draw per rank a GEMM lane and a comm lane of ``result`` into a PNG at ``path``."""
    import matplotlib

    matplotlib.use("Agg", force=False)
    import matplotlib.pyplot as plt

    w = result.world_size
    fig, ax = plt.subplots(figsize=(11, 0.9 + 0.7 * w))
    colors = {"gemm": "#4C72B0", "comm": "#DD8452", "reduce": "#55A868", "copy": "#8172B3", "flag": "#937860"}
    by_tid = {t.tid: t for t in result.tasks}
    idle = {"host": ("idle: waiting for the host to issue the next launch", "#BBBBBB"),
            "data": ("idle: waiting for the next chunk to arrive", "#E5C07B")}
    shown = set()   # legend: only the span kinds (and idle reasons) that appear
    yticks, ylabels = [], []
    for r in range(w):
        for lane, engine in enumerate(("gemm", "comm")):
            y = (w - 1 - r) * 2.4 + (1 - lane) * 1.1
            yticks.append(y + 0.5)
            ylabels.append(f"rank {r} {engine}")
            mine = sorted((t for t in result.tasks if t.rank == r and t.engine == engine and t.duration > 0),
                          key=lambda t: t.start)
            free = 0.0
            for t in mine:
                if engine == "gemm" and t.start - free > result.makespan_ms / 200:   # label the idle gap
                    deps = [by_tid[d] for d in t.deps if d in by_tid]
                    last = max(deps, key=lambda d: d.end) if deps else None
                    why = "host" if last is None or last.engine == "host" else "data"
                    ax.broken_barh([(free, t.start - free)], (y + 0.3, 0.4), facecolors=idle[why][1],
                                   edgecolors="none", hatch="///")
                    shown.add(why)
                free = max(free, t.end)
                shown.add(t.kind)
                ax.broken_barh([(t.start, t.duration)], (y, 1.0), facecolors=colors[t.kind],
                               edgecolors="white", linewidth=0.5)
                if t.duration > result.makespan_ms / 40:
                    ax.text(t.start + t.duration / 2, y + 0.5, t.label.split()[-1], ha="center",
                            va="center", fontsize=6, color="white")
    ax.set_yticks(yticks, ylabels, fontsize=7)
    ax.set_xlabel("ms (predicted)")
    ax.set_title(title or f"{result.op} / {result.strategy}: W={w}, {result.num_chunks} chunks, "
                 f"{result.makespan_ms:.3f} ms predicted", fontsize=9)
    kinds = [k for k in colors if k in shown]
    handles = [plt.Rectangle((0, 0), 1, 1, color=colors[k]) for k in kinds]
    handles += [plt.Rectangle((0, 0), 1, 1, facecolor=idle[k][1], hatch="///") for k in idle if k in shown]
    ax.legend(handles, kinds + [idle[k][0] for k in idle if k in shown], loc="upper left",
              bbox_to_anchor=(1.0, 1.0), fontsize=7)
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
