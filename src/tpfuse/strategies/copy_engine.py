"""``copy_engine``: chunks move by ``copy_`` on a side stream (the copy engine across GPUs, no
SMs), compute runs per chunk on the compute stream as chunks land (DistGEMM / async-TP style).

Runs where every rank of the group can map the others' memory: CUDA, one host, through a
symmetric-memory workspace (:mod:`tpfuse.symm`: buffers, our own flags, a generation in device
memory, credits, a side stream).  The process group carries only the rendezvous, so it may be
gloo (the one-GPU bed).  Schedules, for rank r of W (``peers`` = r+1, r+2, ... mod W)::

  ag_gemm   compute: begin (credits: peers done reading r's slot of the last call)
                     copy a_shard -> r's slot and a_full[r];  signal READY[r] on every peer;
                     wait READY[p] from every peer (one launch: _symm_steps.publish_shard)
                     c[r] = a_shard @ b;  then c[p] = a_full[p] @ b as each chunk p lands
                     NaN fill (broken only) + DONE[r] on every peer (credits back), one launch
            side:    for p in peers: a_full[p] <- p's slot;  event p
  gemm_rs   compute: begin (credits: every owner p reduced the last call's partials)
                     for p in peers: part_p = a[p rows] @ b  -> side copies it into p's inbox[r]
                     a[r rows] @ b -> r's own inbox[r];  join the side stream;
                     signal READY[r] on every peer and wait READY from every peer (one launch)
                     c_shard = sum over src = 0..W-1 of inbox[src] in float32 (rank order)
                     signal DONE[r] on every peer (in the reduce's launch)
            side:    for p in peers: wait part_p;  p's inbox[r] <- part_p
  gemm_ar   one-shot (small outputs): r's slot <- a @ b; signal READY; wait READY from all;
                     c = sum over src of every rank's slot, read in place, in rank order
            two-shot: the gemm_rs schedule over near-equal row chunks (M need not divide by W),
                     then each owner's reduced chunk goes to its gather slot (READY2/DONE2)
                     and every rank pulls every chunk (compute stream: one wait for every
                     peer's READY2, a copy_ per peer, then DONE2 in the NaN fill's launch)

The one-shot and two-shot paths keep separate workspaces, and the two-shot workspace holds its
inboxes and its gather slot in fixed halves: every region then has one credit that covers every
reader of it whatever the shapes of consecutive calls (mixing them in one buffer let a two-shot
call wait for a DONE2 credit that the one-shot call before it never raised; found by the bench).

Either way every rank's ``gemm_ar`` output is bitwise the same (one sum order, or one owner's
sum copied).  Partials are rounded to the input dtype once and summed in float32, as in
``unfused``.  Per-chunk GEMMs are ``torch.matmul`` (cuBLAS).

fp8 (``scale_a``, ``scale_b``, ``out_dtype`` given; e4m3, or e5m2 with e4m3): the same schedules
with scaled per-chunk GEMMs (:func:`tpfuse.strategies._scaled.mm`, ``torch._scaled_mm``).
``ag_gemm`` moves the fp8 bytes through an fp8 workspace, and a row-wise ``scale_a`` in the same
slot after the shard's rows (``_symm_steps.ag_scale_slot``; one READY and one credit for both),
so ``return_gathered`` also returns the gathered scales.  ``gemm_rs``/``gemm_ar`` partials come
out of the scaled GEMM in float32 (the policy's reduce dtype, :func:`partial_dtype`), travel
through a float32 workspace (the one float32 calls use), are summed in float32 and rounded once
to ``out_dtype``.

An eager call never waits for the GPU (except the first call of a workspace capacity: allocation
and rendezvous).  A timed-out wait breaks the workspace:
the outputs of that call and of every call queued after it are NaN (eager and graph replays
alike), and the next call on the group, :func:`tpfuse.synchronize` or the watchdog report it
(tpfuse/symm.py).  Build the workspace with one eager call before capturing.
"""
from __future__ import annotations

import functools
import os

import torch

from tpfuse import _driver, dtypes, symm, timeline
from tpfuse._dist import GroupContext, breadcrumb, new_output
from tpfuse.model import steps as model_steps
from tpfuse.model.simulate import Schedule
from tpfuse.strategies import _symm_steps as steps
from tpfuse.strategies._scaled import mm

__all__ = ["NAME", "DESCRIPTION", "ORDER", "DTYPES", "SYMMETRIC_MEMORY", "KNOBS", "SCHEDULE", "why_unavailable",
           "ag_gemm", "gemm_rs", "gemm_ar", "ar_mode", "ar_one_shot", "gather_reduced", "partial_dtype"]

NAME = "copy_engine"
DESCRIPTION = "copy-engine peer copies (no SMs taken) overlapped with per-chunk GEMMs"
ORDER = 20
DTYPES = dtypes.FAST + (dtypes.FP8,)   # fp8: torch._scaled_mm per chunk
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


@functools.lru_cache(maxsize=None)   # it sits on every gemm_rs / gemm_ar call
def partial_dtype(dtype: torch.dtype) -> torch.dtype:
    """dtype of the partial products RS/AR move between ranks: the input's own (rounded once, then
    summed in float32), or for fp8 inputs the policy's reduce dtype (float32: the scaled GEMM's
    output is reduced before it is rounded to ``out_dtype``)."""
    return dtypes.reduce_dtype(dtype, DTYPES) if dtypes.rule(DTYPES, dtype) is dtypes.FP8 else dtype


def _chunk_mm(a: torch.Tensor, b: torch.Tensor, scaled: tuple | None, out: torch.Tensor,
              scale_rows: torch.Tensor | None = None) -> torch.Tensor:
    """``out = a @ b``, or scaled (``scaled`` = (scale_a of ``a``'s rows or tensor-wise, scale_b),
    ``scale_rows`` in place of the first) rounded to ``out``'s dtype."""
    if scaled is None:
        return torch.matmul(a, b, out=out)
    if a.shape[1] == 0:   # K = 0 (fp8 allows it: 0 is a multiple of 16): nothing to multiply
        return out.zero_()
    return mm(a, b, scaled[0] if scale_rows is None else scale_rows, scaled[1], out.dtype, out=out)


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
    flag tables, this rank's and every peer's slot (fp8 row-wise: and scale rows), one event per
    peer (re-recorded every call: a stream waits for an event's latest record at the time of the
    wait)."""

    def __init__(self, ws: symm.Workspace, m_shard: int, k: int, rowwise: bool = False):
        self.peers = steps.peers(ws.rank, ws.world_size)
        self.credits = ws.incoming("DONE", self.peers)
        self.ready_out = ws.outgoing("READY", self.peers)
        self.done_out = ws.outgoing("DONE", self.peers)
        self.ready_in = ws.incoming("READY", self.peers)
        self.slots = [ws.data(p, (m_shard, k)) for p in self.peers]
        self.scale_slots = [steps.ag_scale_slot(ws, p, m_shard, k) if rowwise else None for p in self.peers]
        self.rows = [slice(p * m_shard, (p + 1) * m_shard) for p in self.peers]
        # each peer's slot into its rows of a_full, checked once (one driver call per pull)
        self.pulls = _driver.RowCopies(
            [(p * m_shard, (p + 1) * m_shard, slot) for p, slot in zip(self.peers, self.slots)],
            into=True, row_shape=(k,), dtype=ws.spec.dtype)
        self.events = [torch.cuda.Event() for _ in self.peers]
        self.fork = torch.cuda.Event()   # the side stream's wait for the compute stream
        # timeline span names, built once (span() is a no-op when nothing records)
        self.labels = [(f"pull {p}", f"GEMM {p}") for p in self.peers]
        self.own_label = f"GEMM {ws.rank}"
        # the lean path's launches (ag_gemm: no row-wise scales, no timeline): the publish into
        # a_full's own rows, and the NaN fill of c and a_full that raises DONE, prepared once
        self.mine = slice(ws.rank * m_shard, (ws.rank + 1) * m_shard)
        self.publish = ws.publisher(self.credits, self.ready_out, ws.data(ws.rank, (m_shard, k)),
                                    (self.mine.start, self.mine.stop), wait_in=self.ready_in)
        self.finish: dict = {}   # (c's shape, c's dtype) -> Workspace.poisoner of (c, a_full)
        # every rank's rows of c and a_full, taken by one split_with_sizes each (not a slice each)
        self.chunk_sizes = [m_shard] * ws.world_size
        self.event_calls = steps.event_calls(self.fork)   # the lean path's (record, wait)


def ag_gemm(a_shard: torch.Tensor, b: torch.Tensor, ctx: GroupContext, scale_a: torch.Tensor | None = None,
            scale_b: torch.Tensor | None = None, out_dtype: torch.dtype | None = None):
    """(c, a_full), or (c, a_full, scale_a_full) when scaled (fp8)."""
    world_size, rank = ctx.world_size, ctx.rank
    m_shard, k = a_shard.shape
    dev = a_shard.device
    scaled = None if scale_a is None else (scale_a, scale_b)
    rowwise = scaled is not None and scale_a.dim() == 2
    a_full = new_output((world_size * m_shard, k), dtype=a_shard.dtype, device=dev)
    c = new_output((world_size * m_shard, b.shape[1]), dtype=out_dtype or a_shard.dtype, device=dev)
    scale_full = None
    if scaled is not None:
        scale_full = new_output((world_size * m_shard, 1), dtype=scale_a.dtype, device=dev) if rowwise \
            else scale_a.clone()

    def done() -> tuple:
        return (c, a_full) if scaled is None else (c, a_full, scale_full)

    # K = 0 with row-wise scales still gathers them (the workspace path), as ring does
    if world_size == 1 or m_shard == 0 or (k == 0 and not rowwise):
        a_full.copy_(a_shard)
        if rowwise:
            scale_full.copy_(scale_a)
        _chunk_mm(a_full, b, scaled, c, scale_full)
        return done()

    need = steps.ag_slot_bytes(m_shard, k, a_shard.element_size(), rowwise)
    ws = symm.get_workspace(ctx, "ag_gemm", a_shard.dtype, dev, need)
    plan = steps.cached(ws, ("copy_engine ag", m_shard, k, rowwise), lambda: _AgPlan(ws, m_shard, k, rowwise))
    main, side = ws.current_stream(), ws.stream
    if not rowwise and c.numel() and timeline.current() is None:
        _ag_lean(a_shard, b, scaled, ws, plan, a_full, c, main, side)
        return done()
    mine = slice(rank * m_shard, (rank + 1) * m_shard)
    breadcrumb("copy_engine ag_gemm: publishing the local shard")
    # into this rank's slot and a_full's own rows (and the scale rows), READY out and the peers'
    # READY in, in the same launch.  One wait for every peer rather than one before each pull
    # (a launch less per peer): a pull can start only once the last peer has published, which
    # costs overlap only when a peer lags behind the others (docs/ops.md).
    with timeline.span("wait", "publish + READY all", device=dev, chunk=rank):
        steps.publish_shard(ws, a_shard, plan.credits, plan.ready_out, scale_a if rowwise else None,
                            also=a_full[mine], scale_also=scale_full[mine] if rowwise else None,
                            wait_ready=plan.ready_in)
    steps.join(side, main, plan.fork)
    pulled = [a_full[rows] for rows in plan.rows]   # each peer's rows, sliced once per call
    scales = [scale_full[rows] if rowwise else None for rows in plan.rows]
    base = plan.pulls.bind(a_full)
    with steps.side_for_spans(ws):   # every operation below names the side stream
        for i, (p, scale_slot, scale_dest, event, labels) in enumerate(zip(
                plan.peers, plan.scale_slots, scales, plan.events, plan.labels)):
            with timeline.span("copy", labels[0], device=dev, chunk=p):
                plan.pulls.copy(i, a_full, base, side)
                if scale_slot is not None:
                    _driver.copy_(scale_dest, scale_slot, stream=side)
            event.record(side)
    with timeline.span("gemm", plan.own_label, device=dev, chunk=rank):
        _chunk_mm(a_shard, b, scaled, c[mine])
    for p, rows, chunk, scale_rows, event, labels in zip(plan.peers, plan.rows, pulled, scales, plan.events,
                                                         plan.labels):
        main.wait_event(event)
        with timeline.span("gemm", labels[1], device=dev, chunk=p):
            _chunk_mm(chunk, b, scaled, c[rows], scale_rows)
    # No record_stream of a_full / scale_full (the side stream wrote them): the compute stream
    # has waited for the last event, which follows all of the side stream's work of this call,
    # so the caching allocator may hand their blocks out again on this stream as soon as they
    # are freed.  A record_stream kept each block until the GPU passed that event: with the host
    # running ahead, every call then took a fresh block from the driver (issue 34.4).
    # NaN when broken; DONE (the peers' slots are read: every pull precedes the last event) in the
    # same launch
    if rowwise:
        ws.poison_on_error(c, a_full, scale_full, signal=plan.done_out)
    else:
        steps.finish(ws, c, a_full, signal=plan.done_out)
    return done()


def _ag_lean(a_shard: torch.Tensor, b: torch.Tensor, scaled: tuple | None, ws: symm.Workspace, plan: _AgPlan,
             a_full: torch.Tensor, c: torch.Tensor, main: torch.cuda.Stream, side: torch.cuda.Stream) -> None:
    """:func:`ag_gemm`'s schedule where nothing records a timeline and no row-wise scales travel
    (every eager call but those): the same operations in the same order, through the plan's
    prepared launches and with no span or per-call list (issue 34: an eager call's host cost)."""
    breadcrumb("copy_engine ag_gemm: publishing the local shard")
    plan.publish(a_shard, a_full)
    steps.join(side, main, plan.fork, plan.event_calls)
    record, wait = plan.event_calls
    pulls, base = plan.pulls, plan.pulls.bind(a_full)
    for i, event in enumerate(plan.events):
        pulls.copy(i, a_full, base, side)
        record(event, side)
    outs, gathered = c.split_with_sizes(plan.chunk_sizes), a_full.split_with_sizes(plan.chunk_sizes)
    if scaled is None:
        torch.matmul(a_shard, b, out=outs[ws.rank])
        for p, event in zip(plan.peers, plan.events):
            wait(event, main)
            torch.matmul(gathered[p], b, out=outs[p])
    else:
        _chunk_mm(a_shard, b, scaled, outs[ws.rank])
        for p, event in zip(plan.peers, plan.events):
            wait(event, main)
            _chunk_mm(gathered[p], b, scaled, outs[p])
    steps.lean_finish(ws, plan.finish, c, a_full, signal=plan.done_out)


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
        self.ready_out = ws.outgoing("READY", self.peers)
        self.ready_in = ws.incoming("READY", self.peers)
        self.events = [torch.cuda.Event() for _ in self.peers]
        self.joined = torch.cuda.Event()   # the compute stream's wait for the side stream's pushes
        self.labels = [(f"GEMM {p}", f"push {p}") for p in self.peers]   # timeline span names
        self.own_label = f"GEMM {rank}"
        self.own_rows = slice(*bounds[rank])
        self.own = inbox(rank, rank)
        # every peer's partial, one allocation: peer i's in rows part_rows[i]; pushed from there into
        # its owner's inbox slot for this rank, checked once (one driver call per push)
        self.parts_shape = (len(self.peers) * slot_rows, n)
        self.parts_dtype = ws.spec.dtype
        # every chunk (and so every part) slot_rows rows: the lean path splits instead of slicing
        self.uniform = slot_rows if all(bounds[p] == (p * slot_rows, (p + 1) * slot_rows)
                                        for p in range(ws.world_size)) and slot_rows > 0 else 0
        # ... taken by split_with_sizes (Tensor.split's Python wrapper costs as much again)
        self.chunk_sizes = [slot_rows] * ws.world_size
        self.lean_steps = list(zip(range(len(self.peers)), self.peers, self.events))
        self.event_calls = steps.event_calls(self.joined)   # the lean path's (record, wait)
        # the lean path's flag launches, prepared: the begin (credits), READY out with the peers' READY in
        self.begin = ws.beginner(self.credits)
        self.ready_wait = ws.signal_waiter(self.ready_out, self.ready_in, symm.WAIT_READY)
        self.part_rows = [slice(i * slot_rows, i * slot_rows + rows.stop - rows.start)
                          for i, rows in enumerate(self.rows)]
        self.pushes = _driver.RowCopies([(r.start, r.stop, dest) for r, dest in zip(self.part_rows, self.dests)],
                                        into=False, row_shape=(n,), dtype=ws.spec.dtype)
        self.sources = [inbox(rank, src) for src in range(ws.world_size)]
        self.reducers: dict = {}   # gemm_rs's lean path: key -> Workspace.reducer of the inbox into c_shard


def _scatter_partials(a: torch.Tensor, b: torch.Tensor, ws: symm.Workspace, plan: _ScatterPlan,
                      main: torch.cuda.Stream, scaled: tuple | None = None) -> tuple[list[torch.Tensor], torch.Tensor]:
    """Phase 1 of gemm_rs/gemm_ar: the partial of every owner's rows into that owner's inbox
    slot for this rank (peers through the side stream, owner order from rank + 1; ``main``: the
    current stream); returns this rank's inbox slots in rank order (views of the rows it owns)
    and the peers' partials.
    ``scaled`` (fp8): (scale_a, scale_b); the partials are then float32 (the workspace's dtype).

    The peers' partials are computed into one allocation (one ``torch.empty`` per call, not one
    per peer), made on ``main`` and read by the side stream's copies: the caller holds it until
    the compute stream has joined the side stream, so the caching allocator cannot hand it to
    later work on ``main`` before the copies ran.  (``record_stream``
    did the same by keeping each block until the GPU passed the side stream's use of it: with the
    host running ahead, every call then took fresh blocks from the driver.)  The side stream's
    work is issued on it by name (its event wait and the copy), without making it the current
    stream and back for every peer.

    READY is not raised here: the caller joins the side stream and raises READY to every owner
    in the launch that waits for the peers' READY (one launch, not one per peer).  No owner's
    reduce starts any later for it: a reduce follows its owner's own GEMM on its stream and needs
    every rank's partial, the last of which is pushed at the end of that rank's pushes, so with
    ranks in step READY from the join comes when the owner can use it."""
    side = ws.stream
    dev = a.device
    rowwise = scaled is not None and scaled[0].dim() == 2
    parts = torch.empty(plan.parts_shape, dtype=ws.spec.dtype, device=dev)

    def product(rows: slice, out: torch.Tensor) -> torch.Tensor:
        if scaled is None:
            return torch.matmul(a[rows], b, out=out)
        return _chunk_mm(a[rows], b, scaled, out, scaled[0][rows] if rowwise else None)

    base = plan.pushes.bind(parts)
    # no side.wait_stream(main): the side stream's first work waits for an event recorded on the
    # compute stream after begin and the first GEMM, which orders it after both
    for i, (p, rows, part_rows, done, labels) in enumerate(zip(plan.peers, plan.rows, plan.part_rows, plan.events,
                                                             plan.labels)):
        with timeline.span("gemm", labels[0], device=dev, chunk=p):
            product(rows, parts[part_rows])
        done.record(main)
        side.wait_event(done)
        with timeline.span("copy", labels[1], device=dev, chunk=p):
            plan.pushes.copy(i, parts, base, side)
    with timeline.span("gemm", plan.own_label, device=dev, chunk=ws.rank):
        product(plan.own_rows, plan.own)
    return plan.sources, parts


def _scatter_lean(a: torch.Tensor, b: torch.Tensor, scaled: tuple | None, ws: symm.Workspace, plan: _ScatterPlan,
                  main: torch.cuda.Stream, out: torch.Tensor) -> None:
    """:func:`_scatter_partials` and the join after it where nothing records a timeline and no
    row-wise scales are given (every eager gemm_rs / two-shot gemm_ar call but those): the same
    operations in the same order, with no span or per-call list (issue 34: an eager call's host
    cost).

    ``out``: the call's new output (contiguous), written only after the join.  Where it has the
    partials' dtype and at least their rows (gemm_rs at W = 2; two-shot gemm_ar when W divides
    M), the peers' partials are staged in its first rows instead of a ``torch.empty``: the side
    stream's pushes read them before the join, the reduce and the pulls overwrite them after it."""
    side = ws.stream
    if out.dtype == plan.parts_dtype and out.shape[0] >= plan.parts_shape[0] and out.shape[1] == plan.parts_shape[1]:
        parts = out
    else:
        parts = torch.empty(plan.parts_shape, dtype=plan.parts_dtype, device=a.device)
    pushes, base = plan.pushes, plan.pushes.bind(parts)
    step = plan.uniform
    if step:   # equal chunks: every chunk's rows in one split call each, not a slice per chunk
        chunks = a.split_with_sizes(plan.chunk_sizes)
        rows = parts.shape[0]
        # rows: shard (gemm_rs's output at W = 2), M or (W - 1) shards, a whole number of chunks
        dests = (parts,) if rows == step else parts.split_with_sizes(plan.chunk_sizes[:rows // step])
        own = chunks[ws.rank]
    else:
        chunks = {p: a[r] for p, r in zip(plan.peers, plan.rows)}
        dests = [parts[r] for r in plan.part_rows]
        own = a[plan.own_rows]
    record, wait = plan.event_calls
    for i, p, done in plan.lean_steps:
        if scaled is None:
            torch.matmul(chunks[p], b, out=dests[i])
        else:
            _chunk_mm(chunks[p], b, scaled, dests[i])
        record(done, main)
        wait(done, side)
        pushes.copy(i, parts, base, side)
    if scaled is None:
        torch.matmul(own, b, out=plan.own)
    else:
        _chunk_mm(own, b, scaled, plan.own)
    steps.join(main, side, plan.joined, plan.event_calls)   # the pushes done: READY may go out
    del parts, dests   # freed after the join (see _scatter_partials)


def _rs_lean(a: torch.Tensor, b: torch.Tensor, scaled: tuple | None, ws: symm.Workspace, plan: _ScatterPlan,
             main: torch.cuda.Stream, c_shard: torch.Tensor) -> None:
    """:func:`gemm_rs` after its begin, lean (:func:`_scatter_lean`): the partials, READY with the
    wait for the peers' READY, and the reduce through the plan's prepared launch."""
    _scatter_lean(a, b, scaled, ws, plan, main, c_shard)
    plan.ready_wait()
    reduce = plan.reducers.get(c_shard.dtype)
    if reduce is None:
        reduce = plan.reducers[c_shard.dtype] = ws.reducer(("rs",) + tuple(c_shard.shape), plan.sources,
                                                             tuple(c_shard.shape), signal=plan.done_out)
    reduce(c_shard)


def _whole_product(a: torch.Tensor, b: torch.Tensor, scaled: tuple | None, out_dtype: torch.dtype) -> torch.Tensor:
    """``a @ b`` with nothing to exchange (one rank, or an empty gemm_ar): scaled for fp8."""
    if scaled is None:
        return torch.matmul(a, b)
    return _chunk_mm(a, b, scaled, new_output((a.shape[0], b.shape[1]), dtype=out_dtype, device=a.device))


def _rounded(acc: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    """The float32 sum ``acc`` of fp8 partials rounded once to ``out_dtype`` (itself if float32)."""
    return acc if acc.dtype == out_dtype else acc.to(out_dtype)


def gemm_rs(a: torch.Tensor, b: torch.Tensor, ctx: GroupContext, scale_a: torch.Tensor | None = None,
            scale_b: torch.Tensor | None = None, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    m, n = a.shape[0], b.shape[1]
    world_size, rank = ctx.world_size, ctx.rank
    scaled = None if scale_a is None else (scale_a, scale_b)
    result_dtype = out_dtype or a.dtype
    acc_dtype = partial_dtype(a.dtype)   # fp8: float32 partials, reduced, then rounded once
    if world_size == 1:
        return _whole_product(a, b, scaled, result_dtype)
    shard = m // world_size
    c_shard = new_output((shard, n), dtype=acc_dtype if scaled is not None else result_dtype, device=a.device)
    if m * n == 0:
        return _rounded(c_shard.zero_(), result_dtype)
    ws = symm.get_workspace(ctx, "gemm_rs", acc_dtype, a.device, world_size * shard * n * dtypes.itemsize(acc_dtype))
    plan = steps.cached(ws, ("copy_engine rs", shard, n), lambda: _ScatterPlan(
        ws, [(r * shard, (r + 1) * shard) for r in range(world_size)], shard, n))
    breadcrumb("copy_engine gemm_rs: computing partials")
    if (scaled is None or scaled[0].dim() != 2) and timeline.current() is None:
        plan.begin()
        _rs_lean(a, b, scaled, ws, plan, ws.current_stream(), c_shard)
        return _rounded(c_shard, result_dtype)
    ws.begin(plan.credits)
    main = ws.current_stream()
    sources, parts = _scatter_partials(a, b, ws, plan, main, scaled)
    steps.join(main, ws.stream, plan.joined)   # the pushes done: READY may go out
    del parts   # freed after the join: the side stream's copies of them come first on the GPU
    # READY to every owner and the wait for every peer's READY: one launch; the reduce is the NaN
    # fill and raises DONE in its launch
    steps.reduce_inbox(ws, ("rs", shard, n), plan.peers, sources, c_shard, signal_first=plan.ready_out,
                       signal_after=plan.done_out, ready=plan.ready_in)
    return _rounded(c_shard, result_dtype)


def ar_mode(m: int, n: int, element_size: int) -> str:
    """``"one_shot"`` or ``"two_shot"`` for a gemm_ar output of [m, n] (agreed on every rank);
    ``element_size``: bytes of a partial (:func:`partial_dtype`)."""
    return "one_shot" if ar_one_shot(m, n, element_size) else "two_shot"


def gemm_ar(a: torch.Tensor, b: torch.Tensor, ctx: GroupContext, scale_a: torch.Tensor | None = None,
            scale_b: torch.Tensor | None = None, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    m, n = a.shape[0], b.shape[1]
    world_size, rank = ctx.world_size, ctx.rank
    scaled = None if scale_a is None else (scale_a, scale_b)
    result_dtype = out_dtype or a.dtype
    acc_dtype = partial_dtype(a.dtype)   # fp8: float32 partials, reduced, then rounded once
    elt = dtypes.itemsize(acc_dtype)
    if world_size == 1 or m * n == 0:
        return _whole_product(a, b, scaled, result_dtype)
    c = new_output((m, n), dtype=acc_dtype if scaled is not None else result_dtype, device=a.device)
    if ar_mode(m, n, elt) == "one_shot":
        # its own workspace: its slot is read in place by every peer (credit: DONE from all), a
        # layout the two-shot workspace's credits do not protect
        ws = symm.get_workspace(ctx, "gemm_ar_one_shot", acc_dtype, a.device, m * n * elt)
        sources = steps.cached(ws, ("copy_engine ar1", m, n), lambda: [ws.data(src, (m, n)) for src in range(world_size)])
        peers = steps.cached(ws, "peers", lambda: steps.peers(rank, world_size))
        breadcrumb("copy_engine gemm_ar (one-shot): computing the partial")
        ws.begin(ws.incoming("DONE", peers))
        with timeline.span("gemm", "GEMM", device=a.device):
            _chunk_mm(a, b, scaled, sources[rank])
        steps.reduce_inbox(ws, ("ar1", m, n), peers, sources, c, signal_first=ws.outgoing("READY", peers),
                           signal_after=ws.outgoing("DONE", peers))
        return _rounded(c, result_dtype)

    bounds = steps.bounds_of(m, world_size)
    slot_rows = -(-m // world_size)
    ws = steps.two_shot_workspace(ctx, acc_dtype, a.device, slot_rows * n)
    plan = steps.cached(ws, ("copy_engine ar2", m, n), lambda: _ScatterPlan(ws, bounds, slot_rows, n))
    views = steps.cached(ws, ("copy_engine ar2 gathered", m, n), lambda: [
        ws.data(owner, (slot_rows, n), offset=steps.two_shot_gather_offset(ws))[: hi - lo]
        for owner, (lo, hi) in enumerate(bounds)])

    breadcrumb("copy_engine gemm_ar (two-shot): computing partials")
    if (scaled is None or scaled[0].dim() != 2) and timeline.current() is None:
        plan.begin()
        _scatter_lean(a, b, scaled, ws, plan, ws.current_stream(), c)
        steps.gather_reduced(ws, plan.peers, plan.sources, bounds, views.__getitem__, c, signal_first=plan.ready_out,
                             lean=True)
        return _rounded(c, result_dtype)
    ws.begin(plan.credits)
    main = ws.current_stream()
    sources, parts = _scatter_partials(a, b, ws, plan, main, scaled)
    steps.join(main, ws.stream, plan.joined)   # the pushes done: READY may go out
    del parts   # freed after the join (see _scatter_partials)
    # READY to every owner in the launch of the DONE2 and READY waits; NaN when broken
    steps.gather_reduced(ws, plan.peers, sources, bounds, views.__getitem__, c, signal_first=plan.ready_out)
    return _rounded(c, result_dtype)


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
        model_steps.reduce_scatter(g, c, model_steps.scatter_partials, ready_first=True)
    elif ar_mode(c.m, c.n, c.elt) == "one_shot":
        model_steps.one_shot_all_reduce(g, c)
    else:
        model_steps.two_shot_all_reduce(g, c, model_steps.scatter_partials, ready_first=True)


def _schedule_chunks(op: str, *, m: int, n: int, world_size: int, dtype: str, **_) -> int:
    """One chunk per rank; gemm_ar one-shot: the whole partial."""
    return 1 if op == "gemm_ar" and ar_one_shot(m, n, dtypes.itemsize(dtype)) else world_size


SCHEDULE = Schedule(_schedule, kind="pipeline", num_chunks=_schedule_chunks)
