"""A toy strategy defined outside tpfuse/: the collective with torch.distributed, then
torch.matmul.  This module is the whole declaration (docs/strategies.md walks through it);
``tpfuse.register_strategy(toy_strategy)`` adds it, and ``tpfuse bench --register-strategy
toy_strategy`` times it.  tests/cpu/test_register_strategy.py checks all of that."""

from __future__ import annotations

import torch
import torch.distributed as dist

from tpfuse import dtypes
from tpfuse.model import cost
from tpfuse.model.simulate import Schedule

NAME = "toy"
DESCRIPTION = "all-gather or all-reduce with torch.distributed, then torch.matmul (a toy)"
DTYPES = dtypes.EVERY     # bf16, fp16, fp32, fp64: out = input; reduce in fp32 (fp64 for fp64)


def why_unavailable(ctx, device, dtype):
    return None   # torch.distributed collectives run on every backend


def ag_gemm(a_shard, b, ctx):                 # [M/W, K], [K, N] -> c [M, N], a_full [M, K]
    parts = [torch.empty_like(a_shard) for _ in range(ctx.world_size)]
    dist.all_gather(parts, a_shard.contiguous(), group=ctx.group)
    a_full = torch.cat(parts)
    return a_full @ b, a_full


def _summed(a, b, ctx):
    partial = (a @ b).to(dtypes.reduce_dtype(a.dtype, DTYPES))   # reduce bf16/fp16 in fp32
    dist.all_reduce(partial, group=ctx.group)
    return partial


def gemm_rs(a, b, ctx):                       # [M, K], [K, N] -> c_shard [M/W, N]
    rows = a.shape[0] // ctx.world_size
    return _summed(a, b, ctx)[ctx.rank * rows:(ctx.rank + 1) * rows].to(a.dtype)


def gemm_ar(a, b, ctx):                       # [M, K], [K, N] -> c [M, N], equal on every rank
    return _summed(a, b, ctx).to(a.dtype)


def _schedule(g, c):
    """The simulator's model: the collective on the comm engine, the GEMM on the compute engine,
    one after the other (ag: gather first; rs/ar: GEMM first), each a host-issued launch."""
    gemm_ms = cost.gemm_time_ms(c.m, c.n, c.k, c.dtype, c.hw)
    comm_ms = cost.collective_ms("ag_gemm" if c.op == "ag_gemm" else "gemm_ar", c.m, c.n, c.k, c.w, c.dtype, c.hw)
    for r in g.ranks:
        if c.op == "ag_gemm":
            gathered = g.add(r, "comm", "comm", comm_ms, label="all_gather", launch=True)
            g.add(r, "gemm", "gemm", gemm_ms, deps=(gathered,), label="GEMM", launch=True)
        else:
            product = g.add(r, "gemm", "gemm", gemm_ms, label="GEMM", launch=True)
            g.add(r, "comm", "comm", comm_ms, deps=(product,), label="all_reduce", launch=True)


SCHEDULE = Schedule(_schedule, kind="collective")
