"""``copy_engine``: chunks move by ``copy_`` on a side stream (the copy engine across GPUs, no
SMs), compute runs per chunk on the compute stream as chunks land (DistGEMM / async-TP style).

Runs where every rank of the group can map the others' memory: CUDA, one host, through a
symmetric-memory workspace (:mod:`tpfuse.symm`: buffers, our own flags, a generation in device
memory, credits, a side stream).  The process group carries only the rendezvous, so it may be
gloo (the one-GPU bed).  Schedules, for rank r of W (``peers`` = r+1, r+2, ... mod W)::

  ag_gemm   compute: begin (credits: peers done reading r's slot of the last call)
                     copy a_shard -> r's slot;  signal READY[r] on every peer
                     c[r] = a_shard @ b;  then c[p] = a_full[p] @ b as each chunk p lands
            side:    for p in peers: wait READY[p];  a_full[p] <- p's slot;  event p
                     (before the last event) signal DONE[r] on every peer (credits back)
  gemm_rs   compute: begin (credits: every owner p reduced the last call's partials)
                     for p in peers: part_p = a[p rows] @ b  -> side copies it into p's inbox[r]
                     a[r rows] @ b -> r's own inbox[r];  wait READY from every peer
                     c_shard = sum over src = 0..W-1 of inbox[src] in float32 (rank order)
                     signal DONE[r] on every peer
            side:    for p in peers: wait part_p;  p's inbox[r] <- part_p;  signal READY[r] on p
  gemm_ar   one-shot (small outputs): r's slot <- a @ b; signal READY; wait READY from all;
                     c = sum over src of every rank's slot, read in place, in rank order
            two-shot: the gemm_rs schedule over near-equal row chunks (M need not divide by W),
                     then each owner's reduced chunk goes to its gather slot (READY2/DONE2)
                     and every rank pulls every chunk (compute stream)

The one-shot and two-shot paths keep separate workspaces, and the two-shot workspace holds its
inboxes and its gather slot in fixed halves: every region then has one credit that covers every
reader of it whatever the shapes of consecutive calls (mixing them in one buffer let a two-shot
call wait for a DONE2 credit that the one-shot call before it never raised; found by the bench).

Either way every rank's ``gemm_ar`` output is bitwise the same (one sum order, or one owner's
sum copied).  Partials are rounded to the input dtype once and summed in float32, as in
``unfused``.  Per-chunk GEMMs are ``torch.matmul`` (cuBLAS).

An eager call never waits for the GPU (except the first call of a workspace capacity: allocation
and rendezvous).  A timed-out wait breaks the workspace:
the outputs of that call and of every call queued after it are NaN (eager and graph replays
alike), and the next call on the group, :func:`tpfuse.synchronize` or the watchdog report it
(tpfuse/symm.py).  Build the workspace with one eager call before capturing.
"""
from __future__ import annotations

import os

import torch

from tpfuse import dtypes, symm, timeline
from tpfuse._dist import GroupContext, breadcrumb, new_output
from tpfuse.model import steps as model_steps
from tpfuse.model.simulate import Schedule
from tpfuse.strategies import _symm_steps as steps

__all__ = ["NAME", "DESCRIPTION", "ORDER", "DTYPES", "SYMMETRIC_MEMORY", "KNOBS", "SCHEDULE", "why_unavailable",
           "ag_gemm", "gemm_rs", "gemm_ar", "ar_mode", "ar_one_shot", "gather_reduced"]

NAME = "copy_engine"
DESCRIPTION = "copy-engine peer copies (no SMs taken) overlapped with per-chunk GEMMs"
ORDER = 20
DTYPES = dtypes.FAST
SYMMETRIC_MEMORY = True
KNOBS = None

# gemm_ar reads every peer's whole partial in place (one-shot) up to this many output bytes, and
# reduce-scatters + gathers above it (fused too).  A lead, not a measurement: one-shot moves W
# times the bytes but has one flag round trip instead of two; it is measured only once a
# multi-GPU run is.
ONE_SHOT_MAX_BYTES = 1 << 20


def ar_one_shot(m: int, n: int, element_size: int) -> bool:
    """Whether a symmetric-memory gemm_ar of output [m, n] takes the one-shot path."""
    return m * n * element_size <= ONE_SHOT_MAX_BYTES


def why_unavailable(ctx: GroupContext, device: torch.device, dtype: torch.dtype) -> str | None:
    """None if copy_engine can run for this group, device and dtype, else why not."""
    if device.type != "cuda":
        return f"copy_engine needs CUDA symmetric memory; the inputs are on {device} and this group is {ctx.backend}"
    if not dtypes.accepts(DTYPES, dtype):
        return f"copy_engine runs {dtypes.describe(DTYPES)} only, not {dtype}; use 'unfused' or 'ring'"
    try:
        import torch.distributed._symmetric_memory  # noqa: F401
    except ImportError:
        return "copy_engine needs torch.distributed._symmetric_memory, which this torch build lacks"
    if ctx.world_size > symm.MAX_WORLD_SIZE:
        return f"copy_engine holds flags for at most {symm.MAX_WORLD_SIZE} ranks; this group has {ctx.world_size}"
    local = os.environ.get("LOCAL_WORLD_SIZE")   # set by torchrun: ranks r // local share a host
    if local and local.isdigit() and int(local) > 0:
        hosts = {ctx.global_rank(r) // int(local) for r in range(ctx.world_size)}
        if len(hosts) > 1:
            return (f"copy_engine needs every rank of the group on one host (peer memory over NVLink); this "
                    f"group spans {len(hosts)} hosts, so it runs 'unfused' or 'ring' on NCCL")
    return None


class _AgPlan:
    """What an ag_gemm call of one shard shape needs, built once per workspace and shape: the
    flag tables, this rank's and every peer's slot, one event per peer (re-recorded every call:
    a stream waits for an event's latest record at the time of the wait)."""

    def __init__(self, ws: symm.Workspace, m_shard: int, k: int):
        self.peers = steps.peers(ws.rank, ws.world_size)
        self.credits = ws.incoming("DONE", self.peers)
        self.ready_out = ws.outgoing("READY", self.peers)
        self.done_out = ws.outgoing("DONE", self.peers)
        self.ready_in = [ws.incoming("READY", [p]) for p in self.peers]
        self.slots = [ws.data(p, (m_shard, k)) for p in self.peers]
        self.rows = [slice(p * m_shard, (p + 1) * m_shard) for p in self.peers]
        self.events = [torch.cuda.Event() for _ in self.peers]


def ag_gemm(a_shard: torch.Tensor, b: torch.Tensor, ctx: GroupContext) -> tuple[torch.Tensor, torch.Tensor]:
    world_size, rank = ctx.world_size, ctx.rank
    m_shard, k = a_shard.shape
    a_full = new_output((world_size * m_shard, k), dtype=a_shard.dtype, device=a_shard.device)
    c = new_output((world_size * m_shard, b.shape[1]), dtype=a_shard.dtype, device=a_shard.device)
    if world_size == 1 or a_full.numel() == 0:
        a_full.copy_(a_shard)
        torch.matmul(a_full, b, out=c)
        return c, a_full

    ws = symm.get_workspace(ctx, "ag_gemm", a_shard.dtype, a_shard.device, m_shard * k * a_shard.element_size())
    plan = steps.cached(ws, ("copy_engine ag", m_shard, k), lambda: _AgPlan(ws, m_shard, k))
    main, side = torch.cuda.current_stream(), ws.stream
    breadcrumb("copy_engine ag_gemm: publishing the local shard")
    steps.publish_shard(ws, a_shard, plan.credits, plan.ready_out)
    side.wait_stream(main)
    dev = a_shard.device
    last = plan.peers[-1]
    pulled = [a_full[rows] for rows in plan.rows]   # each peer's rows, sliced once per call
    with torch.cuda.stream(side):
        for p, ready, slot, dest, event in zip(plan.peers, plan.ready_in, plan.slots, pulled, plan.events):
            with timeline.span("wait", f"READY {p}", device=dev, chunk=p):
                ws.wait(ready, symm.WAIT_READY)
            with timeline.span("copy", f"pull {p}", device=dev, chunk=p):
                dest.copy_(slot)
            if p == last:
                # DONE before the last event: the compute stream's wait for that event then
                # joins the whole side stream (no wait_stream at the end: two stream operations)
                ws.signal(plan.done_out)
            event.record(side)
    mine = slice(rank * m_shard, (rank + 1) * m_shard)
    a_full[mine].copy_(a_shard)
    with timeline.span("gemm", f"GEMM {rank}", device=dev, chunk=rank):
        torch.matmul(a_shard, b, out=c[mine])
    for p, rows, chunk, event in zip(plan.peers, plan.rows, pulled, plan.events):
        main.wait_event(event)
        with timeline.span("gemm", f"GEMM {p}", device=dev, chunk=p):
            torch.matmul(chunk, b, out=c[rows])
    a_full.record_stream(side)
    steps.finish(ws, c, a_full)
    return c, a_full


class _ScatterPlan:
    """gemm_rs / two-shot gemm_ar phase 1 of one shape: every owner's inbox slot for this rank,
    this rank's inbox in rank order, the READY table of each owner, one event per peer."""

    def __init__(self, ws: symm.Workspace, bounds: list[tuple[int, int]], slot_rows: int, n: int):
        rank = ws.rank

        def inbox(owner: int, src: int) -> torch.Tensor:
            lo, hi = bounds[owner]
            return ws.data(owner, (slot_rows, n), offset=src * slot_rows * n)[: hi - lo]

        self.peers = steps.peers(rank, ws.world_size)
        self.credits = ws.incoming("DONE", self.peers)
        self.done_out = ws.outgoing("DONE", self.peers)
        self.rows = [slice(*bounds[p]) for p in self.peers]
        self.dests = [inbox(p, rank) for p in self.peers]
        self.ready_out = [ws.outgoing("READY", [p]) for p in self.peers]
        self.events = [torch.cuda.Event() for _ in self.peers]
        self.own_rows = slice(*bounds[rank])
        self.own = inbox(rank, rank)
        self.sources = [inbox(rank, src) for src in range(ws.world_size)]


def _scatter_partials(a: torch.Tensor, b: torch.Tensor, ws: symm.Workspace, plan: _ScatterPlan,
                      main: torch.cuda.Stream) -> list[torch.Tensor]:
    """Phase 1 of gemm_rs/gemm_ar: the partial of every owner's rows into that owner's inbox
    slot for this rank (peers through the side stream, owner order from rank + 1; ``main``: the
    current stream); returns this rank's inbox slots in rank order (views of the rows it owns)."""
    side = ws.stream
    dev = a.device
    # no side.wait_stream(main): the side stream's first work waits for an event recorded on the
    # compute stream after begin and the first GEMM, which orders it after both
    for p, rows, dest, ready, done in zip(plan.peers, plan.rows, plan.dests, plan.ready_out, plan.events):
        with timeline.span("gemm", f"GEMM {p}", device=dev, chunk=p):
            part = torch.matmul(a[rows], b)
        done.record(main)
        with torch.cuda.stream(side):
            side.wait_event(done)
            with timeline.span("copy", f"push {p}", device=dev, chunk=p):
                dest.copy_(part)
            ws.signal(ready)
        part.record_stream(side)
    with timeline.span("gemm", f"GEMM {ws.rank}", device=dev, chunk=ws.rank):
        torch.matmul(a[plan.own_rows], b, out=plan.own)
    return plan.sources


def gemm_rs(a: torch.Tensor, b: torch.Tensor, ctx: GroupContext) -> torch.Tensor:
    m, n = a.shape[0], b.shape[1]
    world_size, rank = ctx.world_size, ctx.rank
    if world_size == 1:
        return torch.matmul(a, b)
    shard = m // world_size
    c_shard = new_output((shard, n), dtype=a.dtype, device=a.device)
    if m * n == 0:
        return c_shard.zero_()
    ws = symm.get_workspace(ctx, "gemm_rs", a.dtype, a.device, world_size * shard * n * a.element_size())
    plan = steps.cached(ws, ("copy_engine rs", shard, n), lambda: _ScatterPlan(
        ws, [(r * shard, (r + 1) * shard) for r in range(world_size)], shard, n))
    breadcrumb("copy_engine gemm_rs: computing partials")
    ws.begin(plan.credits)
    main = torch.cuda.current_stream()
    sources = _scatter_partials(a, b, ws, plan, main)
    steps.reduce_inbox(ws, ("rs", shard, n), plan.peers, sources, c_shard)   # NaN when broken
    ws.signal(plan.done_out)
    main.wait_stream(ws.stream)
    return c_shard


def ar_mode(m: int, n: int, element_size: int) -> str:
    """``"one_shot"`` or ``"two_shot"`` for a gemm_ar output of [m, n] (agreed on every rank)."""
    return "one_shot" if ar_one_shot(m, n, element_size) else "two_shot"


def gemm_ar(a: torch.Tensor, b: torch.Tensor, ctx: GroupContext) -> torch.Tensor:
    m, n = a.shape[0], b.shape[1]
    world_size, rank = ctx.world_size, ctx.rank
    if world_size == 1 or m * n == 0:
        return torch.matmul(a, b)
    c = new_output((m, n), dtype=a.dtype, device=a.device)
    if ar_mode(m, n, a.element_size()) == "one_shot":
        # its own workspace: its slot is read in place by every peer (credit: DONE from all), a
        # layout the two-shot workspace's credits do not protect
        ws = symm.get_workspace(ctx, "gemm_ar_one_shot", a.dtype, a.device, m * n * a.element_size())
        sources = steps.cached(ws, ("copy_engine ar1", m, n), lambda: [ws.data(src, (m, n)) for src in range(world_size)])
        peers = steps.cached(ws, "peers", lambda: steps.peers(rank, world_size))
        breadcrumb("copy_engine gemm_ar (one-shot): computing the partial")
        ws.begin(ws.incoming("DONE", peers))
        with timeline.span("gemm", "GEMM", device=a.device):
            torch.matmul(a, b, out=sources[rank])
        steps.reduce_inbox(ws, ("ar1", m, n), peers, sources, c, signal_first=ws.outgoing("READY", peers))
        ws.signal(ws.outgoing("DONE", peers))
        return c

    bounds = steps.row_bounds(m, world_size)
    slot_rows = -(-m // world_size)
    ws = steps.two_shot_workspace(ctx, a.dtype, a.device, slot_rows * n)
    gather_at = steps.two_shot_gather_offset(ws)
    plan = steps.cached(ws, ("copy_engine ar2", m, n), lambda: _ScatterPlan(ws, bounds, slot_rows, n))
    views = steps.cached(ws, ("copy_engine ar2 gathered", m, n), lambda: [
        ws.data(owner, (slot_rows, n), offset=gather_at)[: hi - lo] for owner, (lo, hi) in enumerate(bounds)])

    breadcrumb("copy_engine gemm_ar (two-shot): computing partials")
    ws.begin(plan.credits)
    main = torch.cuda.current_stream()
    sources = _scatter_partials(a, b, ws, plan, main)
    steps.gather_reduced(ws, plan.peers, sources, bounds, views.__getitem__, c)   # NaN when broken
    main.wait_stream(ws.stream)   # the side stream's pushes joined back
    return c


# shared with other strategies through tpfuse/strategies/_symm_steps.py; kept here by name for
# callers of copy_engine's earlier API
two_shot_workspace = steps.two_shot_workspace
two_shot_gather_offset = steps.two_shot_gather_offset
reduce_inbox = steps.reduce_inbox
gather_reduced = steps.gather_reduced


# --- the simulator's model of this file (tpfuse.model.simulate runs it) -------------------------
def _schedule(g, c) -> None:
    if c.op == "ag_gemm":
        model_steps.pull_then_gemm_per_chunk(g, c)
    elif c.op == "gemm_rs":
        model_steps.reduce_scatter(g, c, model_steps.scatter_partials)
    elif ar_mode(c.m, c.n, c.elt) == "one_shot":
        model_steps.one_shot_all_reduce(g, c)
    else:
        model_steps.two_shot_all_reduce(g, c, model_steps.scatter_partials)


def _schedule_chunks(op: str, *, m: int, n: int, world_size: int, dtype: str, **_) -> int:
    """One chunk per rank; gemm_ar one-shot: the whole partial."""
    return 1 if op == "gemm_ar" and ar_one_shot(m, n, dtypes.itemsize(dtype)) else world_size


SCHEDULE = Schedule(_schedule, kind="pipeline", num_chunks=_schedule_chunks)
