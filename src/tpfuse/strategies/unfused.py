"""``unfused``: the collective, then ``torch.matmul``.  The baseline and the test oracle.

Works on any torch.distributed backend.  Reductions of bfloat16/float16 partials run in float32
(the partial is upcast before the reduce-scatter/all-reduce), so the sum is more accurate than
a bf16 NCCL sum, at twice the bytes on the wire.

fp8 (``scale_a``, ``scale_b``, ``out_dtype`` given): the all-gather moves the fp8 bytes (as
uint8) and, for a row-wise ``scale_a``, the gathered scales; the GEMM is ``torch._scaled_mm``
(:func:`tpfuse.strategies._scaled.mm`).  ``gemm_rs``/``gemm_ar`` take float32 partials straight
out of the scaled GEMM, reduce them in float32 and round once to ``out_dtype``.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from tpfuse import dtypes
from tpfuse._dist import GroupContext, all_gather_rows, breadcrumb, new_output, reduce_scatter_rows
from tpfuse.model import steps
from tpfuse.model.simulate import Schedule
from tpfuse.strategies._scaled import mm, wire

__all__ = ["NAME", "DESCRIPTION", "ORDER", "DTYPES", "SYMMETRIC_MEMORY", "KNOBS", "SCHEDULE", "why_unavailable",
           "ag_gemm", "gemm_rs", "gemm_ar", "accumulation_dtype"]

NAME = "unfused"
DESCRIPTION = "the collective, then one GEMM (nothing overlapped)"
ORDER = 0
DTYPES = dtypes.EVERY + (dtypes.FP8,)   # fp8: torch._scaled_mm per GEMM
SYMMETRIC_MEMORY = False
KNOBS = None
SCHEDULE = Schedule(steps.collective_then_gemm, kind="collective")


def why_unavailable(ctx: GroupContext, device: torch.device, dtype: torch.dtype) -> str | None:
    """Runs on every backend and device, every dtype the ops take."""
    return None


def accumulation_dtype(dtype: torch.dtype) -> torch.dtype:
    """dtype in which partial sums of ``dtype`` products are reduced across ranks."""
    return dtypes.reduce_dtype(dtype, DTYPES)


def ag_gemm(a_shard: torch.Tensor, b: torch.Tensor, ctx: GroupContext, scale_a: torch.Tensor | None = None,
            scale_b: torch.Tensor | None = None, out_dtype: torch.dtype | None = None):
    """(c, a_full), or (c, a_full, scale_a_full) when scaled (fp8)."""
    m_shard, k = a_shard.shape
    a_full = new_output((ctx.world_size * m_shard, k), dtype=a_shard.dtype, device=a_shard.device)
    scale_full = scale_a
    if scale_a is not None and scale_a.dim() == 2:  # row-wise: gathered with the rows
        scale_full = new_output((ctx.world_size * m_shard, 1), dtype=scale_a.dtype, device=scale_a.device)
    if ctx.world_size == 1:
        a_full.copy_(a_shard)
        scale_full = None if scale_a is None else scale_a.clone()
    else:
        if a_full.numel() > 0:
            breadcrumb("unfused ag_gemm: all_gather")
            all_gather_rows(wire(a_full), wire(a_shard.contiguous()), ctx.group)
        if scale_full is not scale_a and scale_full.numel() > 0:
            all_gather_rows(scale_full, scale_a.contiguous(), ctx.group)
    c = new_output((a_full.shape[0], b.shape[1]), dtype=out_dtype or a_shard.dtype, device=a_shard.device)
    mm(a_full, b, scale_full, scale_b, out_dtype, out=c)
    if scale_a is None:
        return c, a_full
    return c, a_full, (scale_a.clone() if scale_full is scale_a else scale_full)


def _partial(a: torch.Tensor, b: torch.Tensor, scale_a, scale_b, out_dtype) -> torch.Tensor:
    """This rank's product: in the input dtype (plain), in float32 (fp8: reduced before rounding)."""
    return mm(a, b) if scale_a is None else mm(a, b, scale_a, scale_b, torch.float32)


def gemm_rs(a: torch.Tensor, b: torch.Tensor, ctx: GroupContext, scale_a: torch.Tensor | None = None,
            scale_b: torch.Tensor | None = None, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    m, n = a.shape[0], b.shape[1]
    result_dtype = out_dtype or a.dtype
    partial = _partial(a, b, scale_a, scale_b, out_dtype)
    if ctx.world_size == 1:
        return partial.to(result_dtype)
    acc = accumulation_dtype(a.dtype)
    shard = new_output((m // ctx.world_size, n), dtype=acc, device=a.device)
    if partial.numel() > 0:
        breadcrumb("unfused gemm_rs: reduce_scatter")
        reduce_scatter_rows(shard, partial.to(acc), ctx.group)
    return shard.to(result_dtype)


def gemm_ar(a: torch.Tensor, b: torch.Tensor, ctx: GroupContext, scale_a: torch.Tensor | None = None,
            scale_b: torch.Tensor | None = None, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    result_dtype = out_dtype or a.dtype
    partial = _partial(a, b, scale_a, scale_b, out_dtype)
    if ctx.world_size == 1 or partial.numel() == 0:
        return partial.to(result_dtype)
    summed = partial.to(accumulation_dtype(a.dtype))
    breadcrumb("unfused gemm_ar: all_reduce")
    dist.all_reduce(summed, group=ctx.group)
    return summed.to(result_dtype)
