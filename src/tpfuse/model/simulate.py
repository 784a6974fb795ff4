"""Discrete-event replay of one fused op on W ranks: which chunk runs where, and when.

Each rank has three in-order engines: ``gemm`` (the compute stream: GEMMs, reductions, local
copies and flag kernels), ``comm`` (whoever moves the bytes: NCCL, the side stream's copy-engine
copies, or the fused GEMM's epilogue stores to peers) and ``host`` (the Python thread issuing
launches, eager mode only).  A strategy is a list of tasks per engine, in the order the strategy's
code issues them, with dependencies -- also across ranks (a pull waits for the peer's READY flag; a
reduce-scatter owner waits for every peer's partial).  A task starts when its engine is free, its
rank has started (per-rank skew) and every dependency has finished.  Engines never reorder work,
so the replay is exact for that model and monotone: no task duration getting shorter can make
the op slower.

The copy_engine and fused builders follow ``tpfuse/strategies/copy_engine.py`` and
``fused.py`` call by call (each host-issued launch, copy, flag kernel or stream write is one
host task in eager mode); flags take no device time (their latency is in the copies' alpha).
The fused GEMM is one launch whose M-tiles run as row bands in the kernel's tile order ("round"
from the local chunk for ag_gemm, "owner" from rank + 1 for gemm_rs); a band waits for every
piece its rows touch (ag) or sends its rows to their owners when done (rs).

Per rank the result reports, around the bottleneck engine (gemm or comm, whichever has more
work), ``fill`` (start until it starts), ``drain`` (the exposed tail: the other engine's work
after it ended) and ``steady`` (the rest, bubbles included), ``backlog`` (most chunks waiting
between producer and consumer at once), GEMM/comm busy time, exposed communication and the
total; ``draw_timeline`` turns it into a PNG.
"""

from __future__ import annotations

import bisect
import dataclasses
import math
from dataclasses import dataclass, field

from tpfuse.model import cost, knobs
from tpfuse.model.hardware import HardwareProfile

__all__ = [
    "OPS",
    "STRATEGIES",
    "Schedule",
    "COLLECTIVE_THEN_GEMM",
    "P2P_RING",
    "COPY_ENGINE_PIPELINE",
    "PERSISTENT_KERNEL",
    "Task",
    "RankStats",
    "SimResult",
    "simulate",
    "built_num_chunks",
    "draw_timeline",
]

OPS = ("ag_gemm", "gemm_rs", "gemm_ar")


@dataclass(frozen=True)
class Schedule:
    """The simulator's model of a strategy: which builder replays it and with what.

    ``kind``: "collective" (the collective, then one GEMM; or GEMM then collective), "ring"
    (W torch.distributed P2P steps, compute on the chunk in hand while the next travels), or
    "pipeline" (peer chunks over symmetric memory with per-chunk flags).  For "pipeline":
    ``separate_kernels`` True is copy_engine's schedule (one cuBLAS GEMM per chunk, each its own
    launch), False fused's (one persistent GEMM launch hooked to the chunks); ``comm_path`` is
    who moves ag_gemm's pulls and the side stream's copies: "ce" (copy engine, no SMs; what
    both build) or "sm" (SM copies, e.g. same-device copies on the one-GPU bed).  fused's
    gemm_rs epilogue always stores by SMs.  A strategy module names its schedule as ``MODEL``
    (``tpfuse/strategies/__init__.py``)."""
    kind: str
    comm_path: str = "p2p"
    separate_kernels: bool = True

    def __post_init__(self):
        if self.kind not in ("collective", "ring", "pipeline"):
            raise ValueError(f"Schedule.kind={self.kind!r}: use 'collective', 'ring' or 'pipeline'")
        if self.kind == "pipeline" and self.comm_path not in ("ce", "sm"):
            raise ValueError(f"Schedule.comm_path={self.comm_path!r}: a pipeline moves chunks by 'ce' or 'sm'")


COLLECTIVE_THEN_GEMM = Schedule("collective")
P2P_RING = Schedule("ring")
COPY_ENGINE_PIPELINE = Schedule("pipeline", comm_path="ce", separate_kernels=True)
PERSISTENT_KERNEL = Schedule("pipeline", comm_path="ce", separate_kernels=False)


def __getattr__(name):
    # STRATEGIES: the registry's names (tpfuse/strategies/__init__.py), in its order. Looked up
    # when asked for, not at import: the strategy modules import this one for their schedules.
    if name == "STRATEGIES":
        from tpfuse import strategies
        return strategies.STRATEGY_NAMES
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def schedule_of(strategy: str) -> Schedule:
    """The schedule the strategy named ``strategy`` declares (its module's ``MODEL``)."""
    from tpfuse import strategies
    if strategy not in strategies.STRATEGY_NAMES:
        raise ValueError(f"strategy: unknown strategy {strategy!r}; use one of {strategies.STRATEGY_NAMES}")
    return strategies.model(strategy)


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


class _Graph:
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
        """A task; ``launch=True``: issued from the host as its own call, so it also waits for a
        host task of ``host_call_us`` (``issue_us`` if given) on the rank's serial host engine
        (eager mode; none under CUDA graphs)."""
        deps = tuple(d for d in deps if d is not None)
        host_ms = (self.host_call_ms if issue_us is None else issue_us * self.host_scale) if launch else 0.0
        if host_ms > 0:
            deps += (self.add(rank, "host", "host", host_ms, label=f"issue {label}"),)
        tid = len(self.tasks)
        self.tasks.append(Task(tid, rank, engine, kind, max(0.0, duration), deps, label, chunk))
        return tid

    def flag(self, rank: int, engine: str, label: str, deps=()) -> int:
        """A flag kernel or stream write (signal, wait, arrival word, memset of words): a host
        call, no device time of its own."""
        return self.add(rank, engine, "flag", 0.0, deps=deps, label=label, launch=True)

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
        assert finished == len(self.tasks), "simulator deadlock: a strategy built a cyclic schedule"


def _split(total: int, parts: int) -> list[int]:
    """``total`` rows into ``parts`` near-equal integer pieces (the first ones one larger)."""
    q, r = divmod(total, parts)
    return [q + (1 if i < r else 0) for i in range(parts)]


def _bounds(sizes: list[int]) -> list[tuple[int, int]]:
    """Consecutive row ranges of the given sizes."""
    out, lo = [], 0
    for s in sizes:
        out.append((lo, lo + s))
        lo += s
    return out


def _bands(bounds: list[tuple[int, int]], start_row: int, tile_m: int) -> list[tuple[int, int, int, int]]:
    """The persistent GEMM's M-tiles (``tile_m`` rows each) in its tile order -- the M-tile
    holding ``start_row`` first, then on round in row order (``tpfuse/kernels/gemm.py``: "round"
    and "owner") -- as bands ``(lo, hi, first, last)``: consecutive M-tiles whose rows touch the
    same chunks ``bounds[first..last]`` are one band (a tile touching two chunks waits for both,
    or, in owner order, runs with the earlier one)."""
    total = bounds[-1][1]
    if total <= 0:
        return [(0, 0, 0, len(bounds) - 1)]
    starts = [lo for lo, _ in bounds]
    num = -(-total // tile_m)
    t0 = (start_row // tile_m) % num
    out: list[tuple[int, int, int, int]] = []
    # Tiles t0..num-1, then 0..t0-1; a run of tiles inside one chunk is taken in one step, so the
    # work is O(chunks), not O(M / tile_m) (a plan must stay fast at any M).
    for b, end in ((t0, num), (0, t0)):
        while b < end:
            lo, hi = b * tile_m, min((b + 1) * tile_m, total)
            first, last = bisect.bisect_right(starts, lo) - 1, bisect.bisect_right(starts, hi - 1) - 1
            step = 1
            if first == last:  # every later tile that ends inside this chunk joins the run
                chunk_end = bounds[first][1]
                step = max(1, min(end, num if chunk_end >= total else chunk_end // tile_m) - b)
                hi = min((b + step) * tile_m, total)
            if out and out[-1][1] == lo and out[-1][2:] == (first, last):
                out[-1] = (out[-1][0], hi, first, last)
            else:
                out.append((lo, hi, first, last))
            b += step
    return out


# A band's epilogue stores are modelled in up to this many parts, each sent when its tiles are
# done, so that the stores of a band trail its compute (they overlap the later tiles' compute).
_STORE_PARTS = 4


def _check(op, world_size, num_chunks):
    if op not in OPS:
        raise ValueError(f"op: unknown op {op!r}; use one of {OPS}")
    if world_size < 1:
        raise ValueError(f"world_size: {world_size} must be >= 1")
    if num_chunks is not None and num_chunks < 1:
        raise ValueError(f"num_chunks: {num_chunks} must be >= 1")


def _ar_path(sched: Schedule, m: int, n: int, w: int, dtype: str) -> str:
    """The gemm_ar path a symmetric-memory strategy takes: "one_shot" for small outputs
    (:func:`tpfuse.model.knobs.ar_one_shot`; fused too takes copy_engine's), else "fused"
    (fused's RS + gather, M % W == 0) or copy_engine's "two_shot"."""
    if knobs.ar_one_shot(m, n, cost.DTYPE_BYTES[dtype]):
        return "one_shot"
    if not sched.separate_kernels and m % w == 0:
        return "fused"
    return "two_shot"


def built_num_chunks(op: str, strategy: str, *, m: int, n: int, k: int, world_size: int, dtype: str,
                     hw: HardwareProfile, cuda_graph: bool = False, num_sms: int | None = None) -> int:
    """Communication chunks (along the full M) the strategy runs this op with, as built:
    unfused 1; ring W; copy_engine W (one per rank; gemm_ar: 1 one-shot, W two-shot); fused W,
    except ag_gemm: W x :func:`tpfuse.model.knobs.fused_ag_chunks_per_rank` (the value fused
    dispatches with)."""
    sched = schedule_of(strategy)
    w = world_size
    if w == 1 or sched.kind == "collective":
        return 1
    if sched.kind == "ring":
        return w
    if op == "gemm_ar":
        return 1 if _ar_path(sched, m, n, w, dtype) == "one_shot" else w
    if op == "ag_gemm" and not sched.separate_kernels:
        return w * knobs.fused_ag_chunks_per_rank(-(-m // w), n, k, w, dtype, hw, cuda_graph=cuda_graph,
                                                  num_sms=num_sms)
    return w


def simulate(op: str, strategy: str, *, m: int, n: int, k: int, world_size: int, dtype: str,
             hw: HardwareProfile, num_chunks: int | None = None, skew_ms: tuple[float, ...] | None = None,
             num_sms: int | None = None, cuda_graph: bool = False, fast: bool = False) -> SimResult:
    """Replay ``op`` with ``strategy`` on ``world_size`` ranks.

    ``m`` is the full M, ``n``/``k`` the local sizes (as the ops take them); ``dtype`` a
    canonical name (``bf16``...).  ``num_chunks`` counts communication chunks along the full M;
    None (or the same number) is what the strategy runs (:func:`built_num_chunks`).  Only
    fused ag_gemm has a knob: ``num_chunks = W * c`` cuts every shard into ``c`` pieces, each
    with its own copy and arrival word; any other count is a ``ValueError``.  ``skew_ms[r]``
    delays rank r's start.  ``num_sms``: the fused GEMM's grid (None:
    :func:`tpfuse.model.knobs.fused_sm_budget`, every SM).

    Host: in eager mode (default) every strategy pays the same host model -- ``host_op_us`` of
    tpfuse dispatch per call, then ``host_call_us`` per host-issued launch, copy, flag kernel,
    stream write or collective (``host_core_call_us`` for the fused GEMM's launch) on a serial
    host engine that the issued work waits for (ring: ``ring_step_host_us`` per step, its
    measured issue cost).  ``cuda_graph=True``: replayed from a graph, no host time at all.

    ``fast=True`` (the planner): without skew every rank runs the same schedule rotated, so only
    one rank is replayed (exact when the shards are equal and a multiple of the fused GEMM's
    tile height; otherwise the fused schedules replay a rank whose first M-tile straddles its
    neighbour's rows, and uneven shards are all modelled as the largest one: upper bounds) and
    every rank reports its numbers.
    """
    w = world_size
    sched = schedule_of(strategy)
    _check(op, w, num_chunks)
    gemm_sms = knobs.fused_sm_budget(hw, w) if num_sms is None else num_sms
    if gemm_sms < 1:
        raise ValueError(f"num_sms: {num_sms} must be >= 1 (the fused GEMM's grid)")
    knob = w > 1 and sched.kind == "pipeline" and not sched.separate_kernels and op == "ag_gemm"
    if num_chunks is None or w == 1 or not knob:
        built = built_num_chunks(op, strategy, m=m, n=n, k=k, world_size=w, dtype=dtype, hw=hw,
                                 cuda_graph=cuda_graph, num_sms=num_sms)
        if num_chunks is not None and w > 1 and num_chunks != built:
            raise ValueError(f"num_chunks: {strategy} runs {op} with {built} chunk(s) as built "
                             f"(tpfuse/strategies/); only fused ag_gemm has a chunk knob; pass None or {built}")
        num_chunks = built
    elif num_chunks % w:
        raise ValueError(f"num_chunks: {num_chunks} is not a multiple of world_size {w}; fused ag_gemm "
                         f"cuts each rank's shard into num_chunks / W pieces, use a multiple such as {w}")
    skew = tuple(skew_ms) if skew_ms is not None else (0.0,) * w
    if len(skew) != w:
        raise ValueError(f"skew_ms: {len(skew)} values for world_size {w}; give one per rank")
    base = min(skew)
    skew = tuple(s - base for s in skew)
    symmetric = fast and w > 1 and max(skew) == 0.0
    host_scale = 0.0 if cuda_graph else 1e-3
    g = _Graph(w, skew, symmetric=symmetric, host_call_us=hw.host_call_us, host_scale=host_scale)
    ctx = _Ctx(op, m, n, k, w, dtype, hw, num_chunks, gemm_sms,
               ring_step_ms=hw.ring_step_host_us * host_scale, even=symmetric)
    for r in g.ranks:  # tpfuse's own dispatch comes first on every rank's host
        g.add(r, "host", "host", hw.host_op_us * host_scale, label="dispatch")
    if w == 1 or sched.kind == "collective":
        _build_unfused(g, ctx)
    else:
        {"ag_gemm": _build_ag, "gemm_rs": _build_rs, "gemm_ar": _build_ar}[op](g, ctx, sched)
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
    return SimResult(op, strategy, w, num_chunks, makespan, ranks, g.tasks)


@dataclass(frozen=True)
class _Ctx:
    op: str
    m: int
    n: int
    k: int
    w: int
    dtype: str
    hw: HardwareProfile
    num_chunks: int
    gemm_sms: int  # the fused GEMM's grid (its epilogue stores to peers use these SMs)
    ring_step_ms: float = 0.0  # host issue time of one ring step (0 under CUDA graphs)
    even: bool = False  # every shard as the largest one (symmetric replay)

    def shard_rows(self) -> list[int]:
        rows = _split(self.m, self.w)
        return [rows[0]] * self.w if self.even else rows

    @property
    def elt(self) -> int:
        return cost.DTYPE_BYTES[self.dtype]

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

    def host_steps(self, g: "_Graph", rank: int, steps: int) -> list[int]:
        """``steps`` host-issue tasks of a ring on ``rank``, one after the other (engine "host"):
        step s's GEMM depends on the s-th, so a ring whose steps are shorter than the host's
        issue time runs at the host's pace."""
        return [g.add(rank, "host", "host", self.ring_step_ms, label=f"issue {s}") for s in range(steps)]

    def xfer(self, num_bytes: float, path: str) -> float:
        return cost.transfer_time_ms(num_bytes, path, self.hw,
                                     num_sms=self.gemm_sms if path == "sm" else None, world_size=self.w)

    def layout_rank(self, g: "_Graph", r: int) -> int:
        """The rank whose row geometry rank ``r``'s tasks follow: itself, except in symmetric
        replay when shards are not a multiple of the fused GEMM's tile height -- then rank 1,
        whose first M-tile straddles rank 0's rows (ranks are not rotations of each other then;
        rank 0, aligned, would be the optimistic one)."""
        if g.symmetric and self.w > 1 and self.shard_rows()[0] % knobs.FUSED_TILE_M:
            return 1
        return r


def _build_unfused(g: _Graph, c: _Ctx) -> None:
    """tpfuse's unfused strategy: collective then GEMM (ag), or GEMM then upcast of the partial to
    the accumulation dtype, collective on it, downcast (rs, ar); NCCL waits for every rank."""
    full = cost.gemm_time_ms(c.m, c.n, c.k, c.dtype, c.hw)
    if c.w == 1:
        for r in g.ranks:
            g.add(r, "gemm", "gemm", full, label="GEMM", launch=True)
        return
    up, comm, down = cost.unfused_collective_parts(c.op, c.m, c.n, c.k, c.w, c.dtype, c.hw)
    if c.op == "ag_gemm":
        # NCCL waits for every rank: each all-gather depends on every rank having issued its own
        issued = {r: g.add(r, "comm", "comm", 0.0, label="join", launch=True) for r in g.ranks}
        for r in g.ranks:
            t = g.add(r, "comm", "comm", comm, deps=tuple(issued.values()), label="all_gather")
            gt = g.add(r, "gemm", "gemm", full, deps=(t,), label="GEMM", launch=True)
            g.pairs.append((r, t, gt))
    else:
        gemms = {r: g.add(r, "gemm", "gemm", full, label="GEMM", launch=True) for r in g.ranks}
        ups = {r: g.add(r, "gemm", "reduce", up, deps=(gemms[r],), label="upcast", launch=True) for r in g.ranks}
        name = "reduce_scatter" if c.op == "gemm_rs" else "all_reduce"
        for r in g.ranks:
            t = g.add(r, "comm", "comm", comm, deps=tuple(ups.values()), label=name, launch=True)
            g.add(r, "gemm", "reduce", down, deps=(t,), label="downcast", launch=True)
            g.pairs.append((r, gemms[r], t))


def _publish(g: _Graph, c: _Ctx, shard_rows: list[int]) -> dict[int, int]:
    """AG, both symmetric-memory strategies: begin (credits), this rank's shard into its own
    slot, READY to every peer, all on the compute stream.  Returns rank -> its READY task."""
    ready = {}
    for r in g.ranks:
        g.flag(r, "gemm", "begin")
        g.add(r, "gemm", "copy", cost.copy_time_ms(shard_rows[r] * c.k * c.elt, c.hw), label="publish",
              chunk=r, launch=True)
        ready[r] = g.flag(r, "gemm", "READY")
    return ready


def _build_ag(g: _Graph, c: _Ctx, sched: Schedule) -> None:
    w = c.w
    shard_rows = c.shard_rows()
    if sched.kind == "ring":
        # step s: compute on shard (r - s) while shard (r - s - 1) travels from rank r - 1
        # (posted by the host when it issued step s - 1).
        contended = c.hw.sm_count - c.hw.nccl_sms
        host = {r: c.host_steps(g, r, w) for r in g.ranks}
        recv = {}  # (rank, step) -> tid
        for s in range(1, w):
            for r in g.ranks:
                src = (r - s) % w
                prev = recv.get((g.peer((r - 1) % w), s - 1))
                recv[(r, s)] = g.add(r, "comm", "comm", c.xfer(shard_rows[src] * c.k * c.elt, "p2p"),
                                     deps=(prev, host[r][s - 1]), label=f"recv {src}", chunk=src)
        for r in g.ranks:
            for s in range(w):
                src = (r - s) % w
                dep = recv.get((r, s))
                sms = contended if s < w - 1 else None
                t = g.add(r, "gemm", "gemm", c.gemm(shard_rows[src], num_sms=sms), deps=(dep, host[r][s]),
                          label=f"GEMM {src}", chunk=src)
                if dep is not None:
                    g.pairs.append((r, dep, t))
        return
    if sched.separate_kernels:
        _build_ag_copy_engine(g, c, sched.comm_path, shard_rows)
    else:
        _build_ag_fused(g, c, sched.comm_path, shard_rows)


def _build_ag_copy_engine(g: _Graph, c: _Ctx, path: str, shard_rows: list[int]) -> None:
    """copy_engine ag_gemm: the side stream waits for each peer's READY and pulls its shard,
    nearest peer first (r+1, r+2, ...); the compute stream copies the local shard into the
    gathered buffer, runs its GEMM, then one cuBLAS GEMM per shard as it lands."""
    w = c.w
    ready = _publish(g, c, shard_rows)
    for r in g.ranks:
        peers = [(r + d) % w for d in range(1, w)]
        arrived = {}
        after = ready[r]  # side.wait_stream(main)
        for p in peers:
            g.flag(r, "comm", f"wait READY {p}", deps=(after, ready[g.peer(p)]))
            after = None
            arrived[p] = g.add(r, "comm", "comm", c.xfer(shard_rows[p] * c.k * c.elt, path), label=f"pull {p}",
                               chunk=p, launch=True)
        g.flag(r, "comm", "DONE")
        g.add(r, "gemm", "copy", cost.copy_time_ms(shard_rows[r] * c.k * c.elt, c.hw), label="local shard",
              chunk=r, launch=True)
        g.add(r, "gemm", "gemm", c.gemm(shard_rows[r]), label=f"GEMM {r}", chunk=r, launch=True)
        for p in peers:
            t = g.add(r, "gemm", "gemm", c.gemm(shard_rows[p]), deps=(arrived[p],), label=f"GEMM {p}", chunk=p,
                      launch=True)
            g.pairs.append((r, arrived[p], t))


def _build_ag_fused(g: _Graph, c: _Ctx, path: str, shard_rows: list[int]) -> None:
    """fused ag_gemm: the side stream pulls every peer's shard as copy_engine does, in
    ``num_chunks / W`` pieces, each followed by its arrival word; ONE persistent GEMM launch
    visits its M-tiles in round order from the local chunk, each band waiting for the pieces
    its rows touch."""
    w = c.w
    pieces = c.num_chunks // w
    sizes = [p for q in range(w) for p in _split(shard_rows[q], pieces)]
    bounds = _bounds(sizes)
    total = bounds[-1][1]
    core = cost.core_gemm_time_ms(total, c.n, c.k, c.dtype, c.hw, hook="wait", num_sms=c.gemm_sms)
    ready = _publish(g, c, shard_rows)
    for r in g.ranks:
        me = c.layout_rank(g, r)
        g.add(r, "gemm", "copy", cost.copy_time_ms(shard_rows[me] * c.k * c.elt, c.hw), label="local shard",
              chunk=me, launch=True)
        after = g.flag(r, "gemm", f"arrived {me}")  # side.wait_stream(main) follows it
        arrived: dict[int, int] = {}
        for d in range(1, w):
            q = (me + d) % w
            g.flag(r, "comm", f"wait READY {q}", deps=(after, ready[g.peer(q)]))
            after = None
            for p in range(pieces):
                i = q * pieces + p
                lo, hi = bounds[i]
                g.add(r, "comm", "comm", c.xfer((hi - lo) * c.k * c.elt, path), label=f"pull {q}.{p}", chunk=i,
                      launch=True)
                arrived[i] = g.flag(r, "comm", f"arrived {q}.{p}")
        g.flag(r, "comm", "DONE")
        first, consumed = True, set()
        for lo, hi, a, b in _bands(bounds, bounds[me * pieces][0], knobs.FUSED_TILE_M):
            deps = tuple(arrived[i] for i in range(a, b + 1) if i in arrived)
            t = g.add(r, "gemm", "gemm", core * (hi - lo) / max(total, 1), deps=deps, label=f"tiles {lo}:{hi}",
                      chunk=a, launch=first, issue_us=c.hw.host_core_call_us)
            first = False
            for i in range(a, b + 1):
                if i in arrived and i not in consumed:  # the piece's first consumer (for the backlog)
                    consumed.add(i)
                    g.pairs.append((r, arrived[i], t))
        g.flag(r, "gemm", "reset words")


def _ring_reduce_scatter(g: _Graph, c: _Ctx) -> dict[int, int]:
    """tpfuse's ring reduce-scatter (strategies/ring.py): step s GEMMs the partial of shard
    r - s - 1, upcasts it to the accumulation dtype, adds what rank r - 1 sent at step s - 1 and
    sends the sum on (4-byte partials on the wire for bf16); the last step's shard is r's own,
    downcast at the end.  The next step's GEMM is issued after the add (one compute stream).
    Returns rank -> the tid of its downcast."""
    w = c.w
    shard_rows = c.shard_rows()
    acc = cost.accumulation_dtype(c.dtype)
    acc_elt = cost.DTYPE_BYTES[acc]
    contended = c.hw.sm_count - c.hw.nccl_sms
    send: dict[tuple[int, int], int] = {}
    finals: dict[int, int] = {}
    host = {r: c.host_steps(g, r, w) for r in g.ranks}
    for s in range(w):
        for r in g.ranks:
            dst = (r - s - 1) % w
            rows = shard_rows[dst]
            sms = contended if s < w - 1 else None
            gt = g.add(r, "gemm", "gemm", c.gemm(rows, num_sms=sms), deps=(host[r][s],),
                       label=f"GEMM {dst}", chunk=dst)
            ready = g.add(r, "gemm", "reduce", cost.cast_time_ms(rows * c.n, c.dtype, acc, c.hw),
                          deps=(gt,), label=f"upcast {dst}", chunk=dst)
            if s > 0:
                ready = g.add(r, "gemm", "reduce",
                              cost.reduce_time_ms(3 * rows * c.n * acc_elt, c.hw),
                              deps=(ready, send[(g.peer((r - 1) % w), s - 1)]), label=f"add {dst}", chunk=dst)
            if s < w - 1:
                send[(r, s)] = g.add(r, "comm", "comm", c.xfer(rows * c.n * acc_elt, "p2p"),
                                     deps=(ready,), label=f"send {dst}", chunk=dst)
                g.pairs.append((r, gt, send[(r, s)]))
            else:
                finals[r] = g.add(r, "gemm", "reduce", cost.cast_time_ms(rows * c.n, acc, c.dtype, c.hw),
                                  deps=(ready,), label="downcast", chunk=dst)
    return finals


def _scatter_partials(g: _Graph, c: _Ctx, path: str, bounds: list[tuple[int, int]]) -> dict[int, list[int]]:
    """copy_engine's phase 1 of gemm_rs/gemm_ar: per owner from rank + 1, a cuBLAS GEMM of its
    rows, then (side stream) the copy into the owner's inbox and READY to it; the own rows last.
    Returns rank -> the tasks the rank's reduce waits for (READY from every peer; its own GEMM)."""
    w = c.w
    incoming: dict[int, list[int]] = {r: [] for r in range(w)}
    sent: list[int] = []
    own = {}
    for r in g.ranks:
        g.flag(r, "gemm", "begin")
        for d in range(1, w):
            p = (r + d) % w
            rows = bounds[p][1] - bounds[p][0]
            gt = g.add(r, "gemm", "gemm", c.gemm(rows), label=f"GEMM {p}", chunk=p, launch=True)
            st = g.add(r, "comm", "comm", c.xfer(rows * c.n * c.elt, path), deps=(gt,), label=f"push {p}",
                       chunk=p, launch=True)
            sig = g.flag(r, "comm", f"READY {p}")
            incoming[p].append(sig)
            sent.append(sig)
            g.pairs.append((r, gt, st))
        own[r] = g.add(r, "gemm", "gemm", c.gemm(bounds[r][1] - bounds[r][0]), label=f"GEMM {r}", chunk=r,
                       launch=True)
    # symmetric: the partials every peer sends rank 0 are rank 0's own sends, rotated
    return {r: (sent if g.symmetric else incoming[r]) + [own[r]] for r in g.ranks}


def _fused_partials(g: _Graph, c: _Ctx, bounds: list[tuple[int, int]]) -> dict[int, list[int]]:
    """fused's phase 1 of gemm_rs/gemm_ar: ONE persistent GEMM launch in owner order (rank + 1
    first, own rows last) whose epilogue stores every finished band's rows into their owners'
    inboxes (SM stores over the link, egress in order, overlapping the later bands' compute);
    the launch ends when its stores have; then READY to every owner.  Returns rank -> the
    tasks the rank's reduce waits for (READY from every peer)."""
    w = c.w
    total = bounds[-1][1]
    core = cost.core_gemm_time_ms(total, c.n, c.k, c.dtype, c.hw, hook="epilogue", num_sms=c.gemm_sms)
    ready = {}
    for r in g.ranks:
        me = c.layout_rank(g, r)
        g.flag(r, "gemm", "begin")
        first = True
        stores = []
        for lo, hi, a, b in _bands(bounds, bounds[(me + 1) % w][0], knobs.FUSED_TILE_M):
            tiles = -(-(hi - lo) // knobs.FUSED_TILE_M)
            for part in _split(tiles, max(1, min(_STORE_PARTS, tiles))):
                phi = min(hi, lo + part * knobs.FUSED_TILE_M)
                t = g.add(r, "gemm", "gemm", core * (phi - lo) / max(total, 1), label=f"tiles {lo}:{phi}",
                          chunk=a, launch=first, issue_us=c.hw.host_core_call_us)
                first = False
                for q in range(a, b + 1):
                    rows = min(phi, bounds[q][1]) - max(lo, bounds[q][0])
                    if q != me and rows > 0:
                        stores.append(g.add(r, "comm", "comm", c.xfer(rows * c.n * c.elt, "sm"), deps=(t,),
                                            label=f"store {q} {lo}:{phi}", chunk=q))
                        g.pairs.append((r, t, stores[-1]))
                lo = phi
        g.add(r, "gemm", "flag", 0.0, deps=tuple(stores), label="GEMM end (stores drained)")
        g.flag(r, "gemm", "reset words")
        ready[r] = g.flag(r, "gemm", "READY")
    return {r: list(ready.values()) if g.symmetric else [ready[q] for q in range(w) if q != r]
            for r in g.ranks}


def _reduce_owned(g: _Graph, c: _Ctx, waits: dict[int, list[int]], rows: dict[int, int], label: str) -> dict[int, int]:
    """The owner's side: wait READY from every peer, then the fp32 reduce kernel over its W
    inbox slots (reads W x rows x N of the op's dtype, writes rows x N), then DONE."""
    out = {}
    for r in g.ranks:
        g.flag(r, "gemm", "wait READY", deps=tuple(waits[r]))
        out[r] = g.add(r, "gemm", "reduce", cost.reduce_time_ms((c.w + 1) * rows[r] * c.n * c.elt, c.hw),
                       label=label, chunk=r, launch=True)
        g.flag(r, "gemm", "DONE")
    return out


def _build_rs(g: _Graph, c: _Ctx, sched: Schedule) -> None:
    if sched.kind == "ring":
        _ring_reduce_scatter(g, c)
        return
    shard_rows = c.shard_rows()
    bounds = _bounds(shard_rows)
    if sched.separate_kernels:
        waits = _scatter_partials(g, c, sched.comm_path, bounds)
    else:
        waits = _fused_partials(g, c, bounds)
    _reduce_owned(g, c, waits, {r: shard_rows[c.layout_rank(g, r)] for r in g.ranks}, "reduce")


def _build_ar(g: _Graph, c: _Ctx, sched: Schedule) -> None:
    w = c.w
    if sched.kind == "ring":
        # ring reduce-scatter (as gemm_rs, downcast into the output) then a ring all-gather of
        # the reduced shards in the op's dtype, step by step (exposed).
        finals = _ring_reduce_scatter(g, c)
        shard_rows = c.shard_rows()
        host = {r: c.host_steps(g, r, w - 1) for r in g.ranks}  # the all-gather's steps
        recv = {}
        for s in range(1, w):
            for r in g.ranks:
                src = (r - s) % w
                left = g.peer((r - 1) % w)
                prev = recv.get((left, s - 1), finals[left] if s == 1 else None)
                recv[(r, s)] = g.add(r, "comm", "comm", c.xfer(shard_rows[src] * c.n * c.elt, "p2p"),
                                     deps=(prev, finals[r], host[r][s - 1]), label=f"ag {src}", chunk=src)
        return
    mode = _ar_path(sched, c.m, c.n, w, c.dtype)
    if mode == "one_shot":
        # copy_engine one-shot: the whole partial into the own slot, READY, then every rank
        # reduces all W partials read in place from the peers' slots (rank order)
        ready = {}
        for r in g.ranks:
            g.flag(r, "gemm", "begin")
            g.add(r, "gemm", "gemm", c.gemm(c.m), label="GEMM", launch=True)
            ready[r] = g.flag(r, "gemm", "READY")
        nbytes = c.m * c.n * c.elt
        for r in g.ranks:
            g.flag(r, "gemm", "wait READY", deps=tuple(ready[g.peer(q)] for q in range(w) if q != r))
            g.add(r, "gemm", "reduce", cost.peer_reduce_time_ms((w + 1) * nbytes, (w - 1) * nbytes, c.hw),
                  label="reduce (peers in place)", launch=True)
            g.flag(r, "gemm", "DONE")
        return
    # two-shot: reduce-scatter over near-equal row chunks (copy_engine's or fused's phase 1),
    # the owner's sum into its gather slot, READY2; every rank pulls every chunk (side stream)
    sizes = [c.shard_rows()[0]] * w if c.even else _split(c.m, w)
    bounds = _bounds(sizes)
    if mode == "fused":
        waits = _fused_partials(g, c, bounds)
    else:
        waits = _scatter_partials(g, c, sched.comm_path, bounds)
    ready2 = {}
    local = {}
    for r in g.ranks:
        me = c.layout_rank(g, r)
        g.flag(r, "gemm", "wait READY", deps=tuple(waits[r]))
        g.flag(r, "gemm", "wait DONE2 (last call)")
        g.add(r, "gemm", "reduce", cost.reduce_time_ms((w + 1) * sizes[me] * c.n * c.elt, c.hw),
              label="reduce", chunk=me, launch=True)
        g.flag(r, "gemm", "DONE")
        ready2[r] = g.flag(r, "gemm", "READY2")
        local[r] = g.add(r, "gemm", "copy", cost.copy_time_ms(sizes[me] * c.n * c.elt, c.hw), label="own chunk",
                         chunk=me, launch=True)
    for r in g.ranks:
        me = c.layout_rank(g, r)
        after = local[r]  # side.wait_stream(main)
        for d in range(1, w):
            p = (me + d) % w
            g.flag(r, "comm", f"wait READY2 {p}", deps=(after, ready2[g.peer(p)]))
            after = None
            g.add(r, "comm", "comm", c.xfer(sizes[p] * c.n * c.elt, sched.comm_path), label=f"gather {p}",
                  chunk=p, launch=True)
        g.flag(r, "comm", "DONE2")


def _rank_stats(g: _Graph, r: int, tasks: list[Task], pairs: list[tuple[int, int]]) -> RankStats:
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
    return RankStats(rank=r, start=start, end=end, total=total, fill=fill,
                     steady=max(0.0, total - fill - drain), drain=drain, backlog=peak,
                     gemm_busy=gemm_busy, comm_busy=comm_busy,
                     exposed_comm=max(0.0, total - gemm_busy))


def draw_timeline(result: SimResult, path, *, title: str | None = None) -> None:
    """Draw per rank a GEMM lane and a comm lane of ``result`` into a PNG at ``path``."""
    import matplotlib

    matplotlib.use("Agg", force=False)
    import matplotlib.pyplot as plt

    w = result.world_size
    fig, ax = plt.subplots(figsize=(11, 0.9 + 0.7 * w))
    colors = {"gemm": "#4C72B0", "comm": "#DD8452", "reduce": "#55A868", "copy": "#8172B3", "flag": "#937860"}
    yticks, ylabels = [], []
    for r in range(w):
        for lane, engine in enumerate(("gemm", "comm")):
            y = (w - 1 - r) * 2.4 + (1 - lane) * 1.1
            yticks.append(y + 0.5)
            ylabels.append(f"rank {r} {engine}")
            for t in result.tasks:
                if t.rank != r or t.engine != engine or t.duration <= 0:
                    continue
                ax.broken_barh([(t.start, t.duration)], (y, 1.0), facecolors=colors[t.kind],
                               edgecolors="white", linewidth=0.5)
                if t.duration > result.makespan_ms / 40:
                    ax.text(t.start + t.duration / 2, y + 0.5, t.label.split()[-1], ha="center",
                            va="center", fontsize=6, color="white")
    ax.set_yticks(yticks, ylabels, fontsize=7)
    ax.set_xlabel("ms (predicted)")
    ax.set_title(title or f"{result.op} / {result.strategy}: W={w}, {result.num_chunks} chunks, "
                 f"{result.makespan_ms:.3f} ms predicted", fontsize=9)
    handles = [plt.Rectangle((0, 0), 1, 1, color=col) for col in colors.values()]
    ax.legend(handles, list(colors), loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
