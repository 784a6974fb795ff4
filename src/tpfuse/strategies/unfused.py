"""``unfused``: the collective, then ``torch.matmul``.  The baseline and the test oracle.

Works on any torch.distributed backend.  Reductions of bfloat16/float16 partials run in float32
(the partial is upcast before the reduce-scatter/all-reduce), so the sum is more accurate than
a bf16 NCCL sum, at twice the bytes on the wire.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from tpfuse import dtypes
from tpfuse._dist import GroupContext, all_gather_rows, breadcrumb, new_output, reduce_scatter_rows
from tpfuse.model import steps
from tpfuse.model.simulate import Schedule

__all__ = ["NAME", "DESCRIPTION", "ORDER", "DTYPES", "SYMMETRIC_MEMORY", "KNOBS", "SCHEDULE", "why_unavailable",
           "ag_gemm", "gemm_rs", "gemm_ar", "accumulation_dtype"]

NAME = "unfused"
DESCRIPTION = "the collective, then one GEMM (nothing overlapped)"
ORDER = 0
DTYPES = dtypes.EVERY
SYMMETRIC_MEMORY = False
KNOBS = None
SCHEDULE = Schedule(steps.collective_then_gemm, kind="collective")


def why_unavailable(ctx: GroupContext, device: torch.device, dtype: torch.dtype) -> str | None:
    """Runs on every backend and device, every dtype the ops take."""
    return None


def accumulation_dtype(dtype: torch.dtype) -> torch.dtype:
    """dtype in which partial sums of ``dtype`` products are reduced across ranks."""
    return dtypes.reduce_dtype(dtype, DTYPES)


def ag_gemm(a_shard: torch.Tensor, b: torch.Tensor, ctx: GroupContext) -> tuple[torch.Tensor, torch.Tensor]:
    m_shard, k = a_shard.shape
    a_full = new_output((ctx.world_size * m_shard, k), dtype=a_shard.dtype, device=a_shard.device)
    if ctx.world_size == 1:
        a_full.copy_(a_shard)
    elif a_full.numel() > 0:
        breadcrumb("unfused ag_gemm: all_gather")
        all_gather_rows(a_full, a_shard.contiguous(), ctx.group)
    c = new_output((a_full.shape[0], b.shape[1]), dtype=a_shard.dtype, device=a_shard.device)
    torch.matmul(a_full, b, out=c)
    return c, a_full


def gemm_rs(a: torch.Tensor, b: torch.Tensor, ctx: GroupContext) -> torch.Tensor:
    m, n = a.shape[0], b.shape[1]
    partial = torch.matmul(a, b)
    if ctx.world_size == 1:
        return partial
    acc = accumulation_dtype(a.dtype)
    shard = new_output((m // ctx.world_size, n), dtype=acc, device=a.device)
    if partial.numel() > 0:
        breadcrumb("unfused gemm_rs: reduce_scatter")
        reduce_scatter_rows(shard, partial.to(acc), ctx.group)
    return shard.to(a.dtype)


def gemm_ar(a: torch.Tensor, b: torch.Tensor, ctx: GroupContext) -> torch.Tensor:
    partial = torch.matmul(a, b)
    if ctx.world_size == 1 or partial.numel() == 0:
        return partial
    summed = partial.to(accumulation_dtype(a.dtype))
    breadcrumb("unfused gemm_ar: all_reduce")
    dist.all_reduce(summed, group=ctx.group)
    return summed.to(a.dtype)
