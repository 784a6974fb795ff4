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
                     signal DONE[r] on every peer (credits back)
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
                     and every rank pulls every chunk (side stream)

The one-shot and two-shot paths keep separate workspaces, and the two-shot workspace holds its
inboxes and its gather slot in fixed halves: every region then has one credit that covers every
reader of it whatever the shapes of consecutive calls (mixing them in one buffer let a two-shot
call wait for a DONE2 credit that the one-shot call before it never raised; found by the bench).

Either way every rank's ``gemm_ar`` output is bitwise the same (one sum order, or one owner's
sum copied).  Partials are rounded to the input dtype once and summed in float32, as in
``unfused``.  Per-chunk GEMMs are ``torch.matmul`` (cuBLAS).

An eager call waits for its own completion once (one host sync on the workspace's error word)
so that a timed-out wait raises ``TimeoutError`` here instead of returning stale data; inside a
CUDA graph capture it cannot, so a timed-out replay fills its outputs with NaN and
:func:`tpfuse.symm.check_workspaces` raises.  Build the workspace with one eager call before
capturing.
"""
from __future__ import annotations

import os

import torch

from tpfuse import symm, timeline
from tpfuse._dist import GroupContext, breadcrumb, new_output
from tpfuse.model import knobs
from tpfuse.strategies.ring import _row_bounds

__all__ = ["NAME", "why_unavailable", "ag_gemm", "gemm_rs", "gemm_ar", "ar_mode", "gather_reduced"]

NAME = "copy_engine"
_DTYPES = (torch.bfloat16, torch.float16, torch.float32)

# gemm_ar's one-shot limit (output bytes), shared with fused and the planner's model
ONE_SHOT_MAX_BYTES = knobs.ONE_SHOT_MAX_BYTES


def why_unavailable(ctx: GroupContext, device: torch.device, dtype: torch.dtype) -> str | None:
    """None if copy_engine can run for this group, device and dtype, else why not."""
    if device.type != "cuda":
        return f"copy_engine needs CUDA symmetric memory; the inputs are on {device} and this group is {ctx.backend}"
    if dtype not in _DTYPES:
        return f"copy_engine runs bfloat16/float16/float32 only, not {dtype}; float64 runs with 'unfused' or 'ring'"
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


def _finish(ws: symm.Workspace, op: str, *outputs: torch.Tensor) -> None:
    if torch.cuda.is_current_stream_capturing():
        ws.poison_on_error(*outputs)
    else:
        breadcrumb(f"copy_engine {op}: checking the waits")
        ws.check(op)


def _peers(ctx: GroupContext) -> list[int]:
    return [(ctx.rank + i) % ctx.world_size for i in range(1, ctx.world_size)]


def ag_gemm(a_shard: torch.Tensor, b: torch.Tensor, ctx: GroupContext) -> tuple[torch.Tensor, torch.Tensor]:
    world_size, rank = ctx.world_size, ctx.rank
    m_shard, k = a_shard.shape
    a_full = new_output((world_size * m_shard, k), dtype=a_shard.dtype, device=a_shard.device)
    c = new_output((world_size * m_shard, b.shape[1]), dtype=a_shard.dtype, device=a_shard.device)
    if world_size == 1 or a_full.numel() == 0:
        a_full.copy_(a_shard)
        torch.matmul(a_full, b, out=c)
        return c, a_full

    def rows(chunk: int) -> slice:
        return slice(chunk * m_shard, (chunk + 1) * m_shard)

    ws = symm.get_workspace(ctx, "ag_gemm", a_shard.dtype, a_shard.device, a_full[rows(0)].nbytes)
    peers = _peers(ctx)
    main, side = torch.cuda.current_stream(), ws.stream
    breadcrumb("copy_engine ag_gemm: publishing the local shard")
    ws.begin(ws.incoming("DONE", peers))
    ws.data(rank, (m_shard, k)).copy_(a_shard)
    ws.signal(ws.outgoing("READY", peers))
    side.wait_stream(main)
    arrived = {}
    dev = a_shard.device
    with torch.cuda.stream(side):
        for p in peers:
            with timeline.span("wait", f"READY {p}", device=dev, chunk=p):
                ws.wait(ws.incoming("READY", [p]), symm.WAIT_READY)
            with timeline.span("copy", f"pull {p}", device=dev, chunk=p):
                a_full[rows(p)].copy_(ws.data(p, (m_shard, k)))
            arrived[p] = torch.cuda.Event()
            arrived[p].record(side)
        ws.signal(ws.outgoing("DONE", peers))
    a_full[rows(rank)].copy_(a_shard)
    with timeline.span("gemm", f"GEMM {rank}", device=dev, chunk=rank):
        torch.matmul(a_shard, b, out=c[rows(rank)])
    for p in peers:
        main.wait_event(arrived[p])
        with timeline.span("gemm", f"GEMM {p}", device=dev, chunk=p):
            torch.matmul(a_full[rows(p)], b, out=c[rows(p)])
    main.wait_stream(side)
    a_full.record_stream(side)
    _finish(ws, "ag_gemm", c, a_full)
    return c, a_full


def _scatter_partials(a: torch.Tensor, b: torch.Tensor, ctx: GroupContext, ws: symm.Workspace,
                      bounds: list[tuple[int, int]], slot_rows: int) -> list[torch.Tensor]:
    """Phase 1 of gemm_rs/gemm_ar: the partial of every owner's rows into that owner's inbox
    slot for this rank (peers through the side stream, owner order from rank + 1); returns this
    rank's inbox slots in rank order (views of the rows it owns)."""
    rank, world_size, n = ctx.rank, ctx.world_size, b.shape[1]
    main, side = torch.cuda.current_stream(), ws.stream

    def inbox(owner: int, src: int) -> torch.Tensor:
        lo, hi = bounds[owner]
        return ws.data(owner, (slot_rows, n), offset=src * slot_rows * n)[: hi - lo]

    dev = a.device
    side.wait_stream(main)
    for p in _peers(ctx):
        lo, hi = bounds[p]
        with timeline.span("gemm", f"GEMM {p}", device=dev, chunk=p):
            part = torch.matmul(a[lo:hi], b)
        done = torch.cuda.Event()
        done.record(main)
        with torch.cuda.stream(side):
            side.wait_event(done)
            with timeline.span("copy", f"push {p}", device=dev, chunk=p):
                inbox(p, rank).copy_(part)
            ws.signal(ws.outgoing("READY", [p]))
        part.record_stream(side)
    lo, hi = bounds[rank]
    with timeline.span("gemm", f"GEMM {rank}", device=dev, chunk=rank):
        torch.matmul(a[lo:hi], b, out=inbox(rank, rank))
    return [inbox(rank, src) for src in range(world_size)]


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
    peers = _peers(ctx)
    breadcrumb("copy_engine gemm_rs: computing partials")
    ws.begin(ws.incoming("DONE", peers))
    bounds = [(r * shard, (r + 1) * shard) for r in range(world_size)]
    sources = _scatter_partials(a, b, ctx, ws, bounds, shard)
    reduce_inbox(ws, ("rs", shard, n), peers, sources, c_shard)
    ws.signal(ws.outgoing("DONE", peers))
    torch.cuda.current_stream().wait_stream(ws.stream)
    _finish(ws, "gemm_rs", c_shard)
    return c_shard


def ar_mode(m: int, n: int, element_size: int) -> str:
    """``"one_shot"`` or ``"two_shot"`` for a gemm_ar output of [m, n] (agreed on every rank)."""
    return "one_shot" if knobs.ar_one_shot(m, n, element_size) else "two_shot"


def gemm_ar(a: torch.Tensor, b: torch.Tensor, ctx: GroupContext) -> torch.Tensor:
    m, n = a.shape[0], b.shape[1]
    world_size, rank = ctx.world_size, ctx.rank
    if world_size == 1 or m * n == 0:
        return torch.matmul(a, b)
    c = new_output((m, n), dtype=a.dtype, device=a.device)
    peers = _peers(ctx)
    if ar_mode(m, n, a.element_size()) == "one_shot":
        # its own workspace: its slot is read in place by every peer (credit: DONE from all), a
        # layout the two-shot workspace's credits do not protect
        ws = symm.get_workspace(ctx, "gemm_ar_one_shot", a.dtype, a.device, m * n * a.element_size())
        breadcrumb("copy_engine gemm_ar (one-shot): computing the partial")
        ws.begin(ws.incoming("DONE", peers))
        with timeline.span("gemm", "GEMM", device=a.device):
            torch.matmul(a, b, out=ws.data(rank, (m, n)))
        ws.signal(ws.outgoing("READY", peers))
        reduce_inbox(ws, ("ar1", m, n), peers, [ws.data(src, (m, n)) for src in range(world_size)], c)
        ws.signal(ws.outgoing("DONE", peers))
        _finish(ws, "gemm_ar", c)
        return c

    bounds = _row_bounds(m, world_size)
    slot_rows = -(-m // world_size)
    ws = two_shot_workspace(ctx, a.dtype, a.device, slot_rows * n)
    gather_at = two_shot_gather_offset(ws)

    def gathered(owner: int) -> torch.Tensor:
        lo, hi = bounds[owner]
        return ws.data(owner, (slot_rows, n), offset=gather_at)[: hi - lo]

    breadcrumb("copy_engine gemm_ar (two-shot): computing partials")
    ws.begin(ws.incoming("DONE", peers))
    sources = _scatter_partials(a, b, ctx, ws, bounds, slot_rows)
    gather_reduced(ws, peers, sources, bounds, gathered, c)
    _finish(ws, "gemm_ar", c)
    return c


def two_shot_workspace(ctx: GroupContext, dtype: torch.dtype, device: torch.device, slot: int) -> symm.Workspace:
    """The two-shot gemm_ar workspace (shared with ``fused``) for inbox slots of ``slot``
    elements: the inboxes (W slots, written by the peers, credit DONE) in the first half of the
    data region, this rank's gathered chunk (read by the peers, credit DONE2) in the second.
    Fixed halves: a call of another shape never writes where a peer may still be reading the
    previous call's gathered chunk."""
    element = torch.empty((), dtype=dtype).element_size()
    return symm.get_workspace(ctx, "gemm_ar", dtype, device, 2 * (ctx.world_size * slot + 8) * element)


def two_shot_gather_offset(ws: symm.Workspace) -> int:
    """Element offset of the gather slot: the second half of the data region (16-byte aligned)."""
    element = torch.empty((), dtype=ws.spec.dtype).element_size()
    return (ws.spec.capacity // element // 2) // 8 * 8


def reduce_inbox(ws: symm.Workspace, key: tuple, peers: list[int], sources: list[torch.Tensor],
                 out: torch.Tensor) -> None:
    """Wait for every peer's READY, then ``out`` = the float32 sum of ``sources`` in rank order."""
    with timeline.span("wait", "READY all", device=out.device):
        ws.wait(ws.incoming("READY", peers), symm.WAIT_READY)
    with timeline.span("reduce", "reduce", device=out.device):
        ws.reduce(key, sources, out)


def gather_reduced(ws: symm.Workspace, peers: list[int], sources: list[torch.Tensor],
                   bounds: list[tuple[int, int]], gathered, c: torch.Tensor) -> None:
    """Phase 2 of the two-shot gemm_ar (shared with ``fused``): once this rank's inbox is full
    (READY) and every peer has pulled the last call's reduced chunk (DONE2, lag 1), reduce the
    inbox into this rank's gather slot ``gathered(rank)``, free the inbox (DONE), announce the
    chunk (READY2), and pull every peer's reduced chunk into ``c`` on the side stream."""
    rank = ws.rank
    ws.wait(ws.incoming("DONE2", peers), symm.WAIT_CREDIT2, lag=1)
    mine = gathered(rank)
    reduce_inbox(ws, ("ar2",) + tuple(c.shape), peers, sources, mine)
    ws.signal(ws.outgoing("DONE", peers))
    ws.signal(ws.outgoing("READY2", peers))
    lo, hi = bounds[rank]
    c[lo:hi].copy_(mine)
    side = ws.stream
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for p in peers:
            with timeline.span("wait", f"READY2 {p}", device=c.device, chunk=p):
                ws.wait(ws.incoming("READY2", [p]), symm.WAIT_READY2)
            plo, phi = bounds[p]
            with timeline.span("copy", f"pull {p}", device=c.device, chunk=p):
                c[plo:phi].copy_(gathered(p))
        ws.signal(ws.outgoing("DONE2", peers))
    torch.cuda.current_stream().wait_stream(side)
    c.record_stream(side)
