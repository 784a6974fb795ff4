"""Discrete-event replay of one fused op on W ranks: which chunk runs where, and when.

Each rank has two in-order engines, ``gemm`` (the SMs running GEMM chunks and reductions) and
``comm`` (whoever moves the bytes: NCCL, the copy engine or communication SMs).  A strategy is a
list of tasks per engine, in the strategy's order, with dependencies -- also across ranks (a ring
step waits for the neighbour's previous step; a reduce-scatter owner waits for every peer's
partial).  A task starts when its engine is free, its rank has started (per-rank skew) and every
dependency has finished.  Engines never reorder work, so the replay is exact for that model and
monotone: no task duration getting shorter can make the op slower.

Staging slots follow the life cycle FREE -> PRODUCING -> READY -> IN_FLIGHT -> FREE: with
``num_slots`` slots, producing chunk ``j`` waits until the transfer of chunk ``j - num_slots``
has completed (its credit came back).

Per rank the result reports, around the bottleneck engine (the one with more work), ``fill``
(start until it starts), ``drain`` (the exposed tail: the other engine's work after it ended) and
``steady`` (the rest, bubbles included), ``backlog`` (most chunks
waiting between producer and consumer at once), GEMM/comm busy time, exposed communication and
the total; ``draw_timeline`` turns it into a PNG.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field

from tpfuse.model import cost
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
    "default_comm_sms",
    "draw_timeline",
]

OPS = ("ag_gemm", "gemm_rs", "gemm_ar")


@dataclass(frozen=True)
class Schedule:
    """The simulator's model of a strategy: which builder replays it and with what.

    ``kind``: "collective" (the collective, then one GEMM; or GEMM then collective), "ring"
    (W torch.distributed P2P steps, compute on the chunk in hand while the next travels), or
    "pipeline" (peer chunks over symmetric memory with per-chunk signals). For "pipeline":
    ``comm_path`` "ce" (copy engine: no SMs) or "sm" (the persistent kernel's communication
    SMs); ``separate_kernels`` True when each chunk is its own GEMM launch and reductions are a
    separate kernel (False: one persistent kernel, reductions in it). A strategy module names
    its schedule as ``MODEL`` (``tpfuse/strategies/__init__.py``)."""
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
PERSISTENT_KERNEL = Schedule("pipeline", comm_path="sm", separate_kernels=False)


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
    engine: str  # "gemm" | "comm"
    kind: str  # "gemm" | "comm" | "reduce"
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
                 host_call_ms: float = 0.0):
        self.tasks: list[Task] = []
        self.world_size = world_size
        self.skew = skew
        self.pairs: list[tuple[int, int, int]] = []  # (rank, producer tid, consumer tid)
        # symmetric: every rank runs rank 0's schedule rotated (no skew, equal shards), so only
        # rank 0 is built and a dependency on rank q's task is one on rank 0's same task.
        self.symmetric = symmetric
        self.ranks = range(1) if symmetric else range(world_size)
        self.host_call_ms = host_call_ms

    def peer(self, rank: int) -> int:
        """The rank whose task stands for ``rank``'s (0 in symmetric mode)."""
        return 0 if self.symmetric else rank

    def add(self, rank: int, engine: str, kind: str, duration: float, deps=(), label: str = "",
            chunk: int = -1, launch: bool = False) -> int:
        """A task; ``launch=True``: issued from the host as its own call, so it also waits for a
        host task of ``host_call_ms`` on the rank's serial host engine (eager mode)."""
        deps = tuple(d for d in deps if d is not None)
        if launch and self.host_call_ms > 0:
            deps += (self.add(rank, "host", "host", self.host_call_ms, label=f"issue {label}"),)
        tid = len(self.tasks)
        self.tasks.append(Task(tid, rank, engine, kind, max(0.0, duration), deps, label, chunk))
        return tid

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


def default_comm_sms(hw: HardwareProfile) -> int:
    """Fewest SMs whose peer stores reach the copy-engine rate (the fused kernel's comm workers)."""
    return max(1, min(hw.sm_count // 4, math.ceil(hw.link_ce_gbps / hw.link_sm_gbps_per_sm)))


def _split(total: int, parts: int) -> list[int]:
    """``total`` rows into ``parts`` near-equal integer pieces (the first ones one larger)."""
    q, r = divmod(total, parts)
    return [q + (1 if i < r else 0) for i in range(parts)]


def _check(op, sched, world_size, num_chunks):
    if op not in OPS:
        raise ValueError(f"op: unknown op {op!r}; use one of {OPS}")
    if world_size < 1:
        raise ValueError(f"world_size: {world_size} must be >= 1")
    if num_chunks < 1:
        raise ValueError(f"num_chunks: {num_chunks} must be >= 1")
    if op != "gemm_ar" and sched.kind == "pipeline" and num_chunks % world_size:
        raise ValueError(f"num_chunks: {num_chunks} is not a multiple of world_size {world_size}; "
                         f"{op} chunks each rank's shard, use a multiple such as {world_size}")


def simulate(op: str, strategy: str, *, m: int, n: int, k: int, world_size: int, dtype: str,
             hw: HardwareProfile, num_chunks: int | None = None, skew_ms: tuple[float, ...] | None = None,
             comm_sms: int | None = None, num_slots: int | None = None, cuda_graph: bool = False,
             fast: bool = False) -> SimResult:
    """Replay ``op`` with ``strategy`` on ``world_size`` ranks.

    ``m`` is the full M, ``n``/``k`` the local sizes (as the ops take them); ``dtype`` a
    canonical name (``bf16``...).  ``num_chunks`` counts communication chunks along the full M
    (for ag_gemm/gemm_rs a multiple of W: each shard is cut into ``num_chunks / W`` pieces;
    ``ring`` always uses W).  ``skew_ms[r]`` delays rank r's start.  ``comm_sms`` is the SMs the
    fused kernel gives to communication; ``num_slots`` bounds staged chunks in flight
    (None: one slot per chunk).

    Host: in eager mode (default) every strategy pays the same host model -- ``host_op_us`` of
    tpfuse dispatch per call, then ``host_call_us`` per host-issued launch or collective on a
    serial host engine that the launched work waits for (ring: ``ring_step_host_us`` per step,
    its measured issue cost).  ``cuda_graph=True``: replayed from a graph, no host time at all.

    ``fast=True`` (the planner): without skew every rank runs the same schedule rotated, so only
    rank 0 is replayed (exact when the shards are equal; uneven shards are all modelled as the
    largest one, an upper bound) and every rank reports rank 0's numbers.
    """
    w = world_size
    sched = schedule_of(strategy)
    if num_chunks is None:
        num_chunks = 1 if (w == 1 or sched.kind == "collective") else w
    if sched.kind == "ring" and w > 1:
        num_chunks = w
    _check(op, sched, w, num_chunks)
    skew = tuple(skew_ms) if skew_ms is not None else (0.0,) * w
    if len(skew) != w:
        raise ValueError(f"skew_ms: {len(skew)} values for world_size {w}; give one per rank")
    base = min(skew)
    skew = tuple(s - base for s in skew)
    if comm_sms is None:
        comm_sms = default_comm_sms(hw)
    symmetric = fast and w > 1 and max(skew) == 0.0
    host_ms = 0.0 if cuda_graph else 1e-3
    g = _Graph(w, skew, symmetric=symmetric, host_call_ms=hw.host_call_us * host_ms)
    ctx = _Ctx(op, m, n, k, w, dtype, hw, num_chunks, comm_sms, num_slots,
               ring_step_ms=hw.ring_step_host_us * host_ms, even=symmetric)
    for r in g.ranks:  # tpfuse's own dispatch comes first on every rank's host
        g.add(r, "host", "host", hw.host_op_us * host_ms, label="dispatch")
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
    comm_sms: int
    num_slots: int | None
    ring_step_ms: float = 0.0  # host issue time of one ring step (0 under CUDA graphs)
    even: bool = False  # every shard as the largest one (symmetric replay)

    def shard_rows(self) -> list[int]:
        rows = _split(self.m, self.w)
        return [rows[0]] * self.w if self.even else rows

    @property
    def elt(self) -> int:
        return cost.DTYPE_BYTES[self.dtype]

    def gemm(self, rows: int, *, num_sms: int | None = None, hbm_share: float = 1.0) -> float:
        """A separately launched GEMM on ``rows`` rows: its launch plus never less than its share
        of the whole GEMM (back-to-back chunks heat the chip like the whole GEMM does, and the
        tile-choice model could otherwise reward chunking for wave-quantization luck)."""
        t = cost.gemm_time_ms(rows, self.n, self.k, self.dtype, self.hw, num_sms=num_sms,
                              hbm_share=hbm_share)
        whole = cost.gemm_time_ms(self.m, self.n, self.k, self.dtype, self.hw, num_sms=num_sms,
                                  hbm_share=hbm_share, launch=False)
        return max(t, whole * rows / max(self.m, 1) + self.hw.gemm_launch_us * 1e-3)

    def persistent(self, rows: int, first: bool) -> float:
        """A chunk of rows inside one persistent kernel on the SMs left by the comm workers.

        Its share of the whole GEMM (tiles of consecutive chunks share waves: no per-chunk launch
        or wave tail), but never less than the chunk's own HBM floor: a chunk's tiles still read
        all of B, so a memory-bound (decode-sized) GEMM cut into W chunks reads the weights W
        times (L2 reuse across chunks is ignored: conservative)."""
        sms = self.hw.sm_count - self.comm_sms
        whole = cost.gemm_time_ms(self.m, self.n, self.k, self.dtype, self.hw, num_sms=sms, launch=False)
        floor = cost.gemm_memory_time_ms(rows, self.n, self.k, self.dtype, self.hw)
        share = max(whole * rows / max(self.m, 1), floor)
        return share + (self.hw.gemm_launch_us * 1e-3 if first else 0.0)

    def host_steps(self, g: "_Graph", rank: int, steps: int) -> list[int]:
        """``steps`` host-issue tasks of a ring on ``rank``, one after the other (engine "host"):
        step s's GEMM depends on the s-th, so a ring whose steps are shorter than the host's
        issue time runs at the host's pace."""
        return [g.add(rank, "host", "host", self.ring_step_ms, label=f"issue {s}") for s in range(steps)]

    def xfer(self, num_bytes: float, path: str) -> float:
        return cost.transfer_time_ms(num_bytes, path, self.hw,
                                     num_sms=self.comm_sms if path == "sm" else None, world_size=self.w)


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
    # pipeline (copy engine or persistent kernel): pull every peer's shard in pieces, nearest peer first; compute the
    # local shard first, then each piece as it lands.
    pieces = c.num_chunks // w
    path = sched.comm_path
    ce = sched.separate_kernels
    for r in g.ranks:
        # copy_engine: each copy and each GEMM is its own host call; fused: one kernel launch
        kernel = None if ce else g.add(r, "host", "host", g.host_call_ms, label="issue kernel")
        order = [(r + d) % w for d in range(w)]
        arrivals = []
        for src in order[1:]:
            for p, rows in enumerate(_split(shard_rows[src], pieces)):
                tid = g.add(r, "comm", "comm", c.xfer(rows * c.k * c.elt, path), deps=(kernel,),
                            label=f"pull {src}.{p}", chunk=src * pieces + p, launch=ce)
                arrivals.append((tid, rows, src * pieces + p))
        first = True
        if ce:
            g.add(r, "gemm", "gemm", c.gemm(shard_rows[r]), label=f"GEMM {r}", chunk=r * pieces, launch=True)
            for tid, rows, ch in arrivals:
                t = g.add(r, "gemm", "gemm", c.gemm(rows), deps=(tid,), label=f"GEMM {ch}", chunk=ch,
                          launch=True)
                g.pairs.append((r, tid, t))
        else:
            for p, rows in enumerate(_split(shard_rows[r], pieces)):
                g.add(r, "gemm", "gemm", c.persistent(rows, first), deps=(kernel,), label=f"tiles {r}.{p}",
                      chunk=r * pieces + p)
                first = False
            for tid, rows, ch in arrivals:
                t = g.add(r, "gemm", "gemm", c.persistent(rows, False), deps=(tid,),
                          label=f"tiles {ch}", chunk=ch)
                g.pairs.append((r, tid, t))


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


def _build_rs(g: _Graph, c: _Ctx, sched: Schedule) -> None:
    w = c.w
    shard_rows = c.shard_rows()
    if sched.kind == "ring":
        _ring_reduce_scatter(g, c)
        return
    # pipeline: produce partials in owner order (r+1, r+2, ..., own last), push each
    # piece to its owner as soon as it is READY; the owner reduces once every peer's piece is in.
    pieces = c.num_chunks // w
    path = sched.comm_path
    slots = c.num_slots
    ce = sched.separate_kernels
    pushes: dict[int, list[int]] = {r: [] for r in range(w)}  # owner -> transfer tids
    all_pushes: list[int] = []
    own_gemm = {}
    for r in g.ranks:
        kernel = None if ce else g.add(r, "host", "host", g.host_call_ms, label="issue kernel")
        order = [(r + d) % w for d in range(1, w)] + [r]
        sends: list[int] = []
        first = True
        for dst in order:
            for p, rows in enumerate(_split(shard_rows[dst], pieces)):
                ch = dst * pieces + p
                credit = sends[len(sends) - slots] if (slots and dst != r and len(sends) >= slots) else None
                dur = c.gemm(rows) if ce else c.persistent(rows, first)
                first = False
                gt = g.add(r, "gemm", "gemm", dur, deps=(credit, kernel), label=f"GEMM {dst}.{p}", chunk=ch,
                           launch=ce)
                if dst == r:
                    own_gemm.setdefault(r, []).append(gt)
                    continue
                st = g.add(r, "comm", "comm", c.xfer(rows * c.n * c.elt, path), deps=(gt,),
                           label=f"push {dst}.{p}", chunk=ch, launch=ce)
                sends.append(st)
                pushes[dst].append(st)
                all_pushes.append(st)
                g.pairs.append((r, gt, st))
    for r in g.ranks:
        red = cost.reduce_time_ms((w + 1) * shard_rows[r] * c.n * c.elt, c.hw, launch=ce)
        # symmetric: the pushes every peer makes to rank 0 are rank 0's own pushes, rotated
        incoming = all_pushes if g.symmetric else pushes[r]
        g.add(r, "gemm", "reduce", red, deps=tuple(incoming) + tuple(own_gemm[r]), label="reduce", chunk=r,
              launch=ce)


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
    # pipeline: cut M into chunks; all-reduce chunk i (best of one-shot pull-and-reduce
    # and two-shot RS+AG, reduction on the comm side) while chunk i+1 is computed.
    path = sched.comm_path
    ce = sched.separate_kernels
    rows_list = _split(c.m, c.num_chunks)
    gemms: dict[tuple[int, int], int] = {}
    for r in g.ranks:
        kernel = None if ce else g.add(r, "host", "host", g.host_call_ms, label="issue kernel")
        first = True
        for i, rows in enumerate(rows_list):
            dur = c.gemm(rows) if ce else c.persistent(rows, first)
            first = False
            gemms[(r, i)] = g.add(r, "gemm", "gemm", dur, deps=(kernel,), label=f"GEMM {i}", chunk=i, launch=ce)
    for r in g.ranks:
        for i, rows in enumerate(rows_list):
            nbytes = rows * c.n * c.elt
            launch = sched.separate_kernels  # a separate reduction kernel, or reduced in the persistent kernel
            one_shot = (c.xfer((w - 1) * nbytes, path)
                        + cost.reduce_time_ms((w + 1) * nbytes, c.hw, launch=launch))
            two_shot = (2 * c.xfer((w - 1) * nbytes / w, path)
                        + cost.reduce_time_ms((w + 1) * nbytes / w, c.hw, launch=launch))
            t = g.add(r, "comm", "comm", min(one_shot, two_shot),
                      deps=tuple({gemms[(g.peer(q), i)] for q in range(w)}), label=f"AR {i}", chunk=i, launch=ce)
            g.pairs.append((r, gemms[(r, i)], t))


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
    colors = {"gemm": "#4C72B0", "comm": "#DD8452", "reduce": "#55A868"}
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
