"""``ring``: a decomposed pipeline on torch.distributed point-to-point ops (any backend).

W steps around the ring (each rank sends to group rank + 1 and receives from rank - 1).  In
every step the rank multiplies the chunk it holds while the next chunk travels:

* ``ag_gemm``: step s computes the rows of chunk ``(rank - s) mod W`` (its own rows first) while
  that chunk is forwarded and chunk ``(rank - s - 1) mod W`` arrives.
* ``gemm_rs``: the partial sum of destination chunk d travels the ring starting at rank d + 1;
  each rank adds its own product for d and forwards it, so after W - 1 hops rank d holds the
  full sum.  Step s computes the product for the chunk that arrives next while the previous
  partial is on the wire.  Partials travel and accumulate in float32 (float64 for float64).
* ``gemm_ar``: the ``gemm_rs`` ring over W near-equal row chunks (M need not divide by W),
  then a ring all-gather of the reduced chunks, so every rank ends with bitwise-equal output.

On CUDA the transfers are issued on a side stream: it waits for the compute stream before each
exchange (the send data and the receive buffer are ready), the buffers are ``record_stream``-ed
on it so the caching allocator cannot hand them out while in flight, and the compute stream
waits for it before touching a received chunk.

fp8 (``scale_a``, ``scale_b``, ``out_dtype`` given): every step's GEMM is a scaled one
(:func:`tpfuse.strategies._scaled.mm`); the fp8 rows travel as bytes and a row-wise ``scale_a``
travels with its rows in the same exchange; ``gemm_rs``/``gemm_ar`` partials come out of the
scaled GEMM in float32, travel and accumulate in float32 and are rounded once to ``out_dtype``.

Under :func:`tpfuse.timeline.recording` each step records its spans (lanes "gemm",
"copy" = exchange posted .. finished, "wait" = the compute side waiting for it, "reduce"); off by
default, one ``timeline.current()`` read per call when off.
"""

from __future__ import annotations

import functools

import torch
import torch.distributed as dist

from tpfuse._dist import GroupContext, all_gather_rows, breadcrumb, new_output, row_bounds
from tpfuse import dtypes, timeline
from tpfuse.model import steps
from tpfuse.model.simulate import Schedule
from tpfuse.strategies._scaled import mm, wire
from tpfuse.strategies.unfused import accumulation_dtype

__all__ = ["NAME", "DESCRIPTION", "ORDER", "DTYPES", "SYMMETRIC_MEMORY", "KNOBS", "SCHEDULE", "why_unavailable",
           "ag_gemm", "gemm_rs", "gemm_ar"]

NAME = "ring"
DESCRIPTION = "torch.distributed P2P ring steps overlapped with per-shard GEMMs"
ORDER = 10
DTYPES = dtypes.EVERY + (dtypes.FP8,)   # fp8: torch._scaled_mm per GEMM
SYMMETRIC_MEMORY = False
KNOBS = None
_STEPS = {"ag_gemm": steps.ring_all_gather, "gemm_rs": steps.ring_reduce_scatter, "gemm_ar": steps.ring_all_reduce}
# W steps, one shard each
SCHEDULE = Schedule(lambda g, c: _STEPS[c.op](g, c), kind="ring",
                    num_chunks=lambda op, *, world_size, **_: world_size)


def why_unavailable(ctx: GroupContext, device: torch.device, dtype: torch.dtype) -> str | None:
    """Runs on every backend (point-to-point ops), every device and dtype the ops take."""
    return None


@functools.lru_cache(maxsize=None)
def _comm_stream(device_index: int) -> torch.cuda.Stream:
    return torch.cuda.Stream(device=device_index)


class _Ring:
    """Neighbour exchange for one op call: ``start`` posts a send to next + a receive from prev."""

    def __init__(self, ctx: GroupContext, device: torch.device):
        self.ctx = ctx
        self.device = device
        self.rec = timeline.current()
        self._posted = None  # (stamp, what, chunk) of the exchange in flight, when recording
        self.stream = _comm_stream(device.index if device.index is not None else torch.cuda.current_device()) \
            if device.type == "cuda" else None

    def start(self, send: torch.Tensor | None, recv: torch.Tensor | None, what: str, *,
              after_compute: bool = True, chunk: int | None = None,
              extra: tuple[torch.Tensor, torch.Tensor] | None = None) -> list:
        """Post the exchange.  ``after_compute=False`` lets it start before the compute stream's
        pending work finishes: only correct when the send data was produced on the comm stream
        (a chunk received by an earlier exchange) and the receive buffer is untouched.
        ``extra``: a second (send, recv) pair in the same exchange (row-wise fp8 scales)."""
        ops = []
        for snd, rcv in ((send, recv),) + ((extra,) if extra is not None else ()):
            if snd is not None and snd.numel() > 0:
                ops.append(dist.P2POp(dist.isend, wire(snd), self.ctx.next_rank, self.ctx.group))
            if rcv is not None and rcv.numel() > 0:
                ops.append(dist.P2POp(dist.irecv, wire(rcv), self.ctx.prev_rank, self.ctx.group))
        if not ops:
            return []
        breadcrumb(f"ring {what}: exchange posted")
        if self.stream is None:
            if self.rec is not None:
                self._posted = (self.rec.now(self.device), what, chunk)
            return dist.batch_isend_irecv(ops)
        if after_compute:
            self.stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(self.stream):
            if self.rec is not None:
                self._posted = (self.rec.now(self.device), what, chunk)
            works = dist.batch_isend_irecv(ops)
        for op in ops:
            op.tensor.record_stream(self.stream)
        return works

    def finish(self, works: list, what: str) -> None:
        breadcrumb(f"ring {what}: waiting for exchange")
        rec, posted = self.rec, self._posted
        waited = rec.now(self.device) if rec is not None else None
        if self.stream is None:
            for work in works:
                work.wait()
            copied = rec.now(self.device) if rec is not None else None
        else:
            with torch.cuda.stream(self.stream):
                for work in works:
                    work.wait()
                copied = rec.now(self.device) if rec is not None else None
            torch.cuda.current_stream().wait_stream(self.stream)
        if rec is not None:
            rec.add_span("wait", what, waited, rec.now(self.device), chunk=posted[2] if posted else None)
            if posted is not None:
                rec.add_span("copy", posted[1], posted[0], copied, chunk=posted[2])
            self._posted = None


def ag_gemm(a_shard: torch.Tensor, b: torch.Tensor, ctx: GroupContext, scale_a: torch.Tensor | None = None,
            scale_b: torch.Tensor | None = None, out_dtype: torch.dtype | None = None):
    """(c, a_full), or (c, a_full, scale_a_full) when scaled (fp8)."""
    world_size, rank = ctx.world_size, ctx.rank
    m_shard, k = a_shard.shape
    a_full = new_output((world_size * m_shard, k), dtype=a_shard.dtype, device=a_shard.device)
    c = new_output((world_size * m_shard, b.shape[1]), dtype=out_dtype or a_shard.dtype, device=a_shard.device)
    rowwise = scale_a is not None and scale_a.dim() == 2
    scale_full = scale_a.clone() if scale_a is not None and not rowwise else scale_a
    if rowwise:
        scale_full = new_output((world_size * m_shard, 1), dtype=scale_a.dtype, device=scale_a.device)

    def rows(chunk: int) -> slice:
        return slice(chunk * m_shard, (chunk + 1) * m_shard)

    def scales(chunk: int) -> torch.Tensor | None:
        return scale_full[rows(chunk)] if rowwise else scale_full

    def done() -> tuple:
        return (c, a_full) if scale_a is None else (c, a_full, scale_full)

    a_full[rows(rank)].copy_(a_shard)
    if rowwise:
        scale_full[rows(rank)].copy_(scale_a)
    if world_size == 1 or a_full.numel() == 0:
        if rowwise and world_size > 1 and scale_full.numel() > 0:  # K = 0: the scales still travel
            all_gather_rows(scale_full, scale_a.contiguous(), ctx.group)
        mm(a_full, b, scale_full, scale_b, out_dtype, out=c)
        return done()
    ring = _Ring(ctx, a_shard.device)
    chunk = rank
    for step in range(world_size):
        prev_chunk = (chunk - 1) % world_size
        last = step == world_size - 1
        # From step 1 on, the chunk to forward arrived on the comm stream itself: its transfer need
        # not wait for the GEMM of the previous step, so transfers run back to back.
        works = [] if last else ring.start(a_full[rows(chunk)], a_full[rows(prev_chunk)], f"ag_gemm step {step}",
                                           after_compute=step == 0, chunk=prev_chunk,
                                           extra=(scales(chunk), scales(prev_chunk)) if rowwise else None)
        if ring.rec is None:
            mm(a_full[rows(chunk)], b, scales(chunk), scale_b, out_dtype, out=c[rows(chunk)])
        else:
            with ring.rec.span("gemm", f"ag_gemm chunk {chunk}", device=ring.device, chunk=chunk):
                mm(a_full[rows(chunk)], b, scales(chunk), scale_b, out_dtype, out=c[rows(chunk)])
        if works:
            ring.finish(works, f"ag_gemm step {step}")
        chunk = prev_chunk
    return done()


def _reduce_scatter_gemm(a: torch.Tensor, b: torch.Tensor, ctx: GroupContext, bounds: list[tuple[int, int]],
                         op: str = "gemm_rs", scale_a: torch.Tensor | None = None,
                         scale_b: torch.Tensor | None = None) -> torch.Tensor:
    """This rank's chunk ``bounds[rank]`` of ``sum over ranks of a @ b``, in the accumulation dtype
    (scaled: ``(a * scale_a) @ (b * scale_b)``, float32 straight out of the scaled GEMM)."""

    def product(lo: int, hi: int) -> torch.Tensor:
        if scale_a is None:
            return torch.matmul(a[lo:hi], b).to(acc_dtype)
        return mm(a[lo:hi], b, scale_a[lo:hi] if scale_a.dim() == 2 else scale_a, scale_b, acc_dtype)

    world_size, rank = ctx.world_size, ctx.rank
    acc_dtype = accumulation_dtype(a.dtype)
    n = b.shape[1]
    ring = _Ring(ctx, a.device)
    works: list = []
    in_flight = incoming = None
    for step in range(world_size):
        dest = (rank - 1 - step) % world_size
        lo, hi = bounds[dest]
        if ring.rec is None:
            partial = product(lo, hi)
        else:
            with ring.rec.span("gemm", f"gemm_rs chunk {dest}", device=ring.device, chunk=dest):
                partial = product(lo, hi)
        if works:
            ring.finish(works, f"{op} step {step}")
        if incoming is not None:
            if ring.rec is None:
                partial += incoming
            else:
                with ring.rec.span("reduce", f"gemm_rs chunk {dest}", device=ring.device, chunk=dest):
                    partial += incoming
        if step == world_size - 1:
            return partial
        next_dest = (rank - 2 - step) % world_size
        incoming = new_output((bounds[next_dest][1] - bounds[next_dest][0], n), dtype=acc_dtype, device=a.device)
        in_flight = partial  # keep the send buffer alive until its exchange has finished
        works = ring.start(in_flight, incoming, f"{op} step {step}", chunk=dest)
    raise AssertionError("unreachable")


def gemm_rs(a: torch.Tensor, b: torch.Tensor, ctx: GroupContext, scale_a: torch.Tensor | None = None,
            scale_b: torch.Tensor | None = None, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    m, n = a.shape[0], b.shape[1]
    result_dtype = out_dtype or a.dtype
    if ctx.world_size == 1:
        return mm(a, b, scale_a, scale_b, out_dtype)
    if m * n == 0:
        return new_output((m // ctx.world_size, n), dtype=result_dtype, device=a.device).zero_()
    shard = m // ctx.world_size
    bounds = [(r * shard, (r + 1) * shard) for r in range(ctx.world_size)]
    return _reduce_scatter_gemm(a, b, ctx, bounds, "gemm_rs", scale_a, scale_b).to(result_dtype)


def gemm_ar(a: torch.Tensor, b: torch.Tensor, ctx: GroupContext, scale_a: torch.Tensor | None = None,
            scale_b: torch.Tensor | None = None, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    m, n = a.shape[0], b.shape[1]
    if ctx.world_size == 1 or m * n == 0:
        return mm(a, b, scale_a, scale_b, out_dtype)
    world_size, rank = ctx.world_size, ctx.rank
    bounds = row_bounds(m, world_size)
    mine = _reduce_scatter_gemm(a, b, ctx, bounds, "gemm_ar", scale_a, scale_b)
    c = new_output((m, n), dtype=out_dtype or a.dtype, device=a.device)
    lo, hi = bounds[rank]
    c[lo:hi].copy_(mine)
    ring = _Ring(ctx, a.device)
    chunk = rank
    for step in range(world_size - 1):
        prev_chunk = (chunk - 1) % world_size
        (slo, shi), (rlo, rhi) = bounds[chunk], bounds[prev_chunk]
        works = ring.start(c[slo:shi], c[rlo:rhi], f"gemm_ar gather step {step}", chunk=prev_chunk)
        if works:
            ring.finish(works, f"gemm_ar gather step {step}")
        chunk = prev_chunk
    return c
