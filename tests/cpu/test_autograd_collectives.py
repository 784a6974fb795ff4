"""Which torch collectives the layers' backward runs (gloo ranks).

A ColumnParallelLinear that keeps the gathered input (the default) computes its backward from
the fused ops alone: the gradient of the gathered input, an output nothing used, must reach the
backward as None, not as zeros that cost a reduce-scatter of [M, K] zeros per step (seen on the
H200 bed: that collective went through the gloo group and broke CUDA-graph capture of the
layer).  When the caller does use the gathered input, its gradient is still reduce-scattered.
"""
from __future__ import annotations

import torch

from tpfuse.spawn import RankPool


def _count_reduce_scatters(rank: int, world_size: int) -> dict:
    import tpfuse
    import tpfuse.autograd as A
    from tpfuse.nn import ColumnParallelLinear

    calls = []
    original = A.reduce_scatter_rows

    def counting(x, *args):
        calls.append(tuple(x.shape))
        return original(x, *args)

    A.reduce_scatter_rows = counting
    try:
        torch.manual_seed(0)
        layer = ColumnParallelLinear(6, 4 * world_size, bias=False, strategy="unfused")
        x = torch.randn(3, 6, requires_grad=True)
        layer(x).sum().backward()
        unused = len(calls)
        calls.clear()
        # return_gathered: the caller uses the gathered input too, so its gradient must flow back
        a = torch.randn(3, 6, requires_grad=True)
        b = torch.randn(6, 5, requires_grad=True)
        c, a_full = tpfuse.ag_gemm(a, b, return_gathered=True, strategy="unfused")
        (c.sum() + (a_full * 2).sum()).backward()
        return {"unused": unused, "used": len(calls)}
    finally:
        A.reduce_scatter_rows = original


def test_column_backward_runs_no_collective_for_the_unused_gathered_input():
    with RankPool(2) as pool:
        results = pool.run(_count_reduce_scatters, timeout=120)
    for r in results:
        assert r["unused"] == 0, r
        assert r["used"] == 1, r
