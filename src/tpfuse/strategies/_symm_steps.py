"""The symmetric-memory steps that ``copy_engine`` and ``fused`` share (private to the
strategies package; neither imports the other's private names): publish the local shard,
the two-shot gemm_ar workspace, reduce the inbox, gather the reduced rows, row bounds, and the
end of a call (the NaN fill of a broken workspace).

Nothing here synchronizes with the device: a timed-out wait breaks the workspace (its kernels
then fill the outputs with NaN) and the host learns of it from the workspace's host-visible
record at the next call (tpfuse/symm.py).  What a call needs per shape (flag tables, views) is
built once and kept on the workspace (``cached``).
"""
from __future__ import annotations

import contextlib
import functools

import torch

from tpfuse import _driver, dtypes, symm, timeline
from tpfuse._dist import row_bounds  # noqa: F401  (the strategies' shared row split)


_MAX_PLANS = 64   # per workspace: shapes beyond this start the cache over (plans are cheap to rebuild)


def cached(ws: symm.Workspace, key: tuple, build):
    """The per-shape plan ``key`` of workspace ``ws``, built by ``build()`` on its first call
    (the buffers a plan points into live as long as the workspace; dropping one is safe)."""
    plans = ws.state.get("plans")
    if plans is None:
        plans = ws.state["plans"] = {}
    hit = plans.get(key)
    if hit is None:
        if len(plans) >= _MAX_PLANS:
            plans.clear()
        hit = plans[key] = build()
    return hit


def lean_finish(ws: symm.Workspace, kept: dict, c: torch.Tensor, a_full: torch.Tensor, *, signal,
                zero: torch.Tensor | None = None) -> None:
    """The lean ag_gemm paths' last launch: the NaN fill of (c, a_full) that raises ``signal``
    (and resets ``zero``), through the :meth:`Workspace.poisoner` kept in the plan's ``kept`` per
    (c's shape, c's dtype); emptied at 16 entries (a new output shape per call would grow it)."""
    key = (c.shape, c.dtype)
    finish = kept.get(key)
    if finish is None:
        if len(kept) >= 16:
            kept.clear()
        finish = kept[key] = ws.poisoner(tuple(c.shape), c.dtype, tuple(a_full.shape), a_full.dtype, signal=signal,
                                         zero=zero)
    finish(c, a_full)


@functools.lru_cache(maxsize=1024)
def bounds_of(m: int, world_size: int) -> tuple[tuple[int, int], ...]:
    """:func:`row_bounds` as a tuple, cached (it sits on every two-shot gemm_ar call)."""
    return tuple(row_bounds(m, world_size))


def peers(rank: int, world_size: int) -> list[int]:
    """The other ranks in issue order: rank + 1, rank + 2, ... (mod W)."""
    return [(rank + i) % world_size for i in range(1, world_size)]


_AS_IS = contextlib.nullcontext()   # stateless: the streams as they are


def side_for_spans(ws: symm.Workspace):
    """``ws.on_stream()`` while a timeline records (its spans time the current stream's work),
    else the streams as they are: for a block whose every operation names the side stream."""
    return ws.on_stream() if timeline.current() is not None else _AS_IS


def event_calls(event) -> tuple:
    """``(record, wait)`` for a plan's events: ``record(event, stream)`` = ``event.record(stream)``
    and ``wait(event, stream)`` = ``stream.wait_event(event)``.  For a ``torch.cuda.Event`` they are
    the C methods under those calls: their Python wrappers only default the stream, and
    ``wait_event`` goes through ``Event.wait``, two frames per wait (each frame costs 0.5-1 us of
    host time on the bed's hosts, where an eager copy_engine call makes 4-8 such calls).  Any
    other event (the CPU tests' stand-ins) keeps its own methods."""
    base = torch._C._CudaEventBase
    record, wait = getattr(base, "record", None), getattr(base, "wait", None)
    if record is not None and wait is not None and isinstance(event, base):
        return record, wait
    return type(event).record, _wait_event


def _wait_event(event, stream) -> None:
    stream.wait_event(event)


def join(waiter, stream, event: torch.cuda.Event, calls: tuple | None = None) -> None:
    """``waiter.wait_stream(stream)`` through ``event``, one the caller keeps (a plan's): torch's
    makes a new event for each wait (an event object and its creation per call).  ``calls``: the
    plan's :func:`event_calls` to issue it through (the lean paths)."""
    if calls is None:
        event.record(stream)
        waiter.wait_event(event)
    else:
        record, wait = calls
        record(event, stream)
        wait(event, waiter)


def publish_shard(ws: symm.Workspace, a_shard: torch.Tensor, credits, ready_out,
                  scale_rows: torch.Tensor | None = None, *, also: torch.Tensor | None = None,
                  scale_also: torch.Tensor | None = None, words: torch.Tensor | None = None,
                  wait_ready: tuple[torch.Tensor, torch.Tensor] | None = None) -> None:
    """Begin a call (refuse a broken workspace, advance the generation, wait for the credits of
    the previous call), copy ``a_shard`` (and an fp8 shard's row-wise ``scale_rows``, into the
    region :func:`ag_scale_slot` names) into this rank's slot -- and into ``also`` (the gathered
    output's own rows; ``scale_also`` its scale rows) --, set this rank's words at the int64
    addresses ``words`` to 1 (fused's own arrival words), raise READY on every peer and, given
    ``wait_ready`` (the peers' READY to this rank), wait for it: one launch
    (:meth:`tpfuse.symm.Workspace.publish`).  A shard whose columns are not contiguous is made
    so first (a copy)."""
    if a_shard.dim() != 2 or (a_shard.stride(1) != 1 and a_shard.shape[1] > 1):
        a_shard = a_shard.contiguous()
    if scale_rows is not None and (scale_rows.dim() != 2 or (scale_rows.shape[1] > 1 and scale_rows.stride(1) != 1)):
        scale_rows = scale_rows.contiguous()
    m_shard, k = a_shard.shape
    slot = ws.data(ws.rank, (m_shard, k))
    scale_slot = None if scale_rows is None else ag_scale_slot(ws, ws.rank, m_shard, k)
    ws.publish(credits, ready_out, a_shard, slot, also, scale_rows, scale_slot, scale_also, words, wait_in=wait_ready)


# --- fp8 ag_gemm: a row-wise scale_a travels in the shard's slot, after its rows -------------------
#
#   [ a_shard: m_shard * k elements of the fp8 workspace dtype (1 byte each) | pad to 16 B |
#     scale rows: m_shard float32 ]
#
# One READY flag covers both (written after both copies), one DONE credit frees both.

def _scale_offset(m_shard: int, k: int, element_size: int) -> int:
    """Byte (= element, for 1-byte fp8) offset of the scale rows: after the shard, 16-byte aligned."""
    return -(-m_shard * k * element_size // 16) * 16


def ag_slot_bytes(m_shard: int, k: int, element_size: int, rowwise: bool) -> int:
    """Bytes of one rank's ag_gemm slot: the shard, and for row-wise fp8 its float32 scale rows."""
    if not rowwise:
        return m_shard * k * element_size
    return _scale_offset(m_shard, k, element_size) + 4 * m_shard


def ag_scale_slot(ws: symm.Workspace, owner: int, m_shard: int, k: int) -> torch.Tensor:
    """Rank ``owner``'s float32 ``[m_shard, 1]`` scale rows in its ag_gemm slot (fp8 workspaces:
    the data region is addressed in 1-byte elements, so the element offset is the byte offset)."""
    element = torch.empty((), dtype=ws.spec.dtype).element_size()
    if element != 1:
        raise AssertionError(f"scale rows live in 1-byte (fp8) ag_gemm workspaces, not {ws.spec.dtype}")
    offset = _scale_offset(m_shard, k, element)
    return ws.data(owner, (4 * m_shard,), offset=offset).view(torch.float32).view(m_shard, 1)


def two_shot_workspace(ctx, dtype: torch.dtype, device: torch.device, slot: int) -> symm.Workspace:
    """The two-shot gemm_ar workspace for inbox slots of ``slot`` elements: the inboxes (W
    slots, written by the peers, credit DONE) in the first half of the data region, this rank's
    gathered chunk (read by the peers, credit DONE2) in the second.  Fixed halves: a call of
    another shape never writes where a peer may still be reading the previous call's gathered
    chunk."""
    element = dtypes.itemsize(dtype)   # not a tensor's element_size(): no allocation per call
    return symm.get_workspace(ctx, "gemm_ar", dtype, device, 2 * (ctx.world_size * slot + 8) * element)


def two_shot_gather_offset(ws: symm.Workspace) -> int:
    """Element offset of the gather slot: the second half of the data region (16-byte aligned)."""
    element = dtypes.itemsize(ws.spec.dtype)
    return (ws.spec.capacity // element // 2) // 8 * 8


def reduce_inbox(ws: symm.Workspace, key: tuple, peer_ranks: list[int], sources: list[torch.Tensor],
                 out: torch.Tensor, *, signal_first=None, signal_after=None, ready=None) -> None:
    """Wait for every peer's READY (after raising ``signal_first``, a flag table, in the same
    launch), then ``out`` = the float32 sum of ``sources`` in rank order (NaN when broken), and
    raise ``signal_after`` (a flag table: the DONE credits) in the reduce's launch.  ``ready``:
    the peers' READY table if the caller's plan keeps it (else looked up)."""
    if ready is None:
        ready = ws.incoming("READY", peer_ranks)
    with timeline.span("wait", "READY all", device=out.device):
        if signal_first is not None:
            ws.signal_wait(signal_first, ready, symm.WAIT_READY)
        else:
            ws.wait(ready, symm.WAIT_READY)
    with timeline.span("reduce", "reduce", device=out.device):
        ws.reduce(key, sources, out, signal=signal_after)


def gather_reduced(ws: symm.Workspace, peer_ranks: list[int], sources: list[torch.Tensor],
                   bounds: list[tuple[int, int]], gathered, c: torch.Tensor, *, signal_first=None,
                   one_launch: bool = False, lean: bool = False) -> None:
    """Phase 2 of the two-shot gemm_ar: once every peer has pulled the last call's reduced
    chunk (DONE2, lag 1) and this rank's inbox is full (READY) -- one launch, after raising
    ``signal_first`` in it --, reduce the inbox into this rank's gather slot ``gathered(rank)``
    and its rows of ``c``, free the inbox (DONE) and announce the chunk (READY2), all in the
    reduce's launch; then pull every peer's reduced chunk into ``c`` (compute stream) and
    raise DONE2, NaN into ``c`` when broken.

    The pulls: without ``one_launch`` (copy_engine: copy-engine copies), one wait for every
    peer's READY2, a ``copy_`` per peer, then the NaN fill (the pulls copy whatever a broken peer
    left), which raises DONE2 in its launch: W + 1 operations.  One wait rather than one before
    each pull: every pull then waits for the last peer's READY2, which costs only when a peer
    lags the others.  With ``one_launch`` (fused): ONE launch does the READY2 waits, SM copies
    of every chunk, and the NaN fill or DONE2 (:meth:`tpfuse.symm.Workspace.gather`)."""
    plan = cached(ws, ("ar2 phase 2", c.shape, one_launch),
                  lambda: _GatherPlan(ws, peer_ranks, bounds, gathered, tuple(c.shape), one_launch))
    if lean and not one_launch and c.is_contiguous() and c.is_floating_point():
        _gather_reduced_lean(ws, plan, sources, c, signal_first)
        return
    with timeline.span("wait", "DONE2 + READY all", device=c.device):
        ws.signal_wait(signal_first, plan.credit2, symm.WAIT_CREDIT2, lag=1, then=(plan.ready, symm.WAIT_READY, 0))
    with timeline.span("reduce", "reduce", device=c.device):
        ws.reduce(plan.reduce_key, sources, plan.own, out2=c[plan.own_rows], signal=plan.done_ready2)
    if one_launch:
        with timeline.span("copy", "READY2 waits + pulls + DONE2", device=c.device):
            ws.gather(plan.gather_key, plan.ready2, plan.chunks, plan.offsets, c, plan.done2)
        return
    # The pulls run on the compute stream: it would wait for a side stream right after them and
    # nothing else runs meanwhile, so forking and joining one cost two stream operations (and a
    # record_stream) per call for no overlap.
    with timeline.span("wait", "READY2 all", device=c.device):
        ws.wait(plan.ready2, symm.WAIT_READY2)
    main, base = ws.current_stream(), plan.pulls.bind(c)
    for i, p in enumerate(peer_ranks):
        with timeline.span("copy", "pull", device=c.device, chunk=p):
            plan.pulls.copy(i, c, base, main)
    ws.poison_on_error(c, signal=plan.done2)


def _gather_reduced_lean(ws: symm.Workspace, plan: "_GatherPlan", sources: list[torch.Tensor], c: torch.Tensor,
                         signal_first) -> None:
    """:func:`gather_reduced`'s copy-engine path where nothing records a timeline (``lean``; c
    contiguous): the same operations in the same order, the reduce and the NaN fill through the
    plan's prepared launches, with no span (issue 34: an eager call's host cost)."""
    ws.signal_wait(signal_first, plan.credit2, symm.WAIT_CREDIT2, lag=1, then=(plan.ready, symm.WAIT_READY, 0))
    prepared = plan.prepared.get(c.dtype)
    if prepared is None:
        prepared = plan.prepared[c.dtype] = (
            ws.reducer(plan.reduce_key, sources, tuple(plan.own.shape), signal=plan.done_ready2, into=plan.own,
                       rows=(plan.own_rows.start, plan.own_rows.stop)),
            ws.poisoner(tuple(c.shape), c.dtype, None, None, signal=plan.done2))
    reduce, finish = prepared
    reduce(c)   # into the own gather slot and c's own rows
    ws.wait(plan.ready2, symm.WAIT_READY2)
    main, base = ws.current_stream(), plan.pulls.bind(c)
    for i in range(len(plan.chunks)):
        plan.pulls.copy(i, c, base, main)
    finish(c)


class _GatherPlan:
    """What phase 2 of a two-shot gemm_ar of one output shape needs, built once per workspace:
    the flag tables, this rank's gather slot and rows, and the peers' reduced chunks (one launch's
    table, or the copy-engine pulls, checked once)."""

    def __init__(self, ws: symm.Workspace, peer_ranks, bounds, gathered, shape: tuple, one_launch: bool):
        rank = ws.rank
        self.credit2 = ws.incoming("DONE2", peer_ranks)
        self.ready = ws.incoming("READY", peer_ranks)
        self.done_ready2 = ws.outgoing(("DONE", "READY2"), peer_ranks)
        self.ready2 = ws.incoming("READY2", peer_ranks)
        self.done2 = ws.outgoing("DONE2", peer_ranks)
        self.reduce_key = ("ar2",) + shape
        self.own = gathered(rank)
        self.own_rows = slice(*bounds[rank])
        self.gather_key = ("ar2 gather",) + shape
        self.chunks = [gathered(p) for p in peer_ranks]
        self.offsets = [bounds[p][0] * shape[1] for p in peer_ranks]
        self.prepared: dict = {}   # the lean path's (reducer, poisoner) by c's dtype
        self.pulls = None if one_launch else _driver.RowCopies(
            [(bounds[p][0], bounds[p][1], chunk) for p, chunk in zip(peer_ranks, self.chunks)],
            into=True, row_shape=shape[1:], dtype=ws.spec.dtype)


def finish(ws: symm.Workspace, out: torch.Tensor, out2: torch.Tensor | None = None, *,
           zero: torch.Tensor | None = None, signal=None) -> None:
    """End of a call whose outputs no reduce wrote: NaN into them if the workspace is broken
    (one small launch; no host sync -- the host learns of the timeout at its next call); in the
    same launch, the int32 words ``zero`` = 0 whatever the workspace's state, and unless broken
    the flag table ``signal`` raised (ag_gemm's DONE credits: its pulls precede the launch)."""
    ws.poison_on_error(out, out2, zero=zero, signal=signal)
