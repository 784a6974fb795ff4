"""The ops on CUDA: W = 1 with NCCL (one GPU), W = 2 gloo ranks sharing one GPU, and with
several GPUs W = their number (up to 4) on NCCL, one rank per GPU.

NCCL refuses two ranks on one GPU, so on one GPU the multi-rank CUDA path of ``ring`` (side
stream, record_stream, stream waits) is checked with a gloo group carrying CUDA tensors where
gloo supports that; the test skips with the reason otherwise.  These are correctness checks only.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import tpfuse
from tpfuse import testing
from tpfuse.spawn import RankError, run_ranks

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

ENV = {"TPFUSE_POISON": "1", "TPFUSE_DEBUG": "1", "NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1"}
# The unfused baseline's own error must stay under these (it is the yardstick of the others:
# tpfuse/testing.py); every strategy's within 3x the baseline's in the same dtype.
BASELINE_LIMIT = {torch.bfloat16: 2e-2, torch.float16: 4e-3, torch.float32: 5e-3}


def ops_on_one_gpu(rank, world_size, shapes, strategies=("unfused", "ring", "copy_engine", "fused", "auto")):
    """Every op x strategy x dtype on CUDA; returns failures as strings (empty = all good)."""
    dev = torch.device("cuda", torch.cuda.current_device())
    torch.backends.cuda.matmul.allow_tf32 = False
    failures = []
    for rows, k, n in shapes:
        g = torch.Generator().manual_seed(rows * 7 + k)
        a_full = torch.randn(world_size * rows, k, generator=g, dtype=torch.float64)
        bs = [torch.randn(n, k, generator=g, dtype=torch.float64) for _ in range(world_size)]  # [N, K] weights
        for dtype in (torch.bfloat16, torch.float16, torch.float32):
            w = bs[rank].to(dev, dtype)
            baseline = {}   # op -> the unfused strategy's error (the strategies run unfused first)
            for strategy in strategies:
                if strategy == "fused" and dtype == torch.float32:
                    continue   # refused: checked below
                a_shard = a_full[rank * rows:(rank + 1) * rows].to(dev, dtype)
                c, gathered = tpfuse.ag_gemm(a_shard, w.t(), strategy=strategy, return_gathered=True)
                ref = a_full.to(dtype).double() @ bs[rank].to(dtype).double().t()
                if not torch.equal(gathered.cpu(), a_full.to(dtype)):
                    failures.append(f"ag_gemm gathered {strategy} {dtype} {rows}x{k}x{n}")
                a_mine = a_full.to(dev, dtype)  # [M, K] as this rank's K slice
                full = sum(a_full.to(dtype).double() @ x.to(dtype).double().t() for x in bs)
                rs = tpfuse.gemm_rs(a_mine, w.t(), strategy=strategy)
                m_shard = full.shape[0] // world_size
                ar = tpfuse.gemm_ar(a_mine[: max(1, a_mine.shape[0] - 1)], w.t(), strategy=strategy)
                for op, got, want in (("ag_gemm", c, ref), ("gemm_rs", rs, full[rank * m_shard:(rank + 1) * m_shard]),
                                      ("gemm_ar", ar, full[: max(1, full.shape[0] - 1)])):
                    what = f"{op} {strategy} {dtype} {rows}x{k}x{n}"
                    if strategy == "unfused":
                        baseline[op] = testing.rel_err(got.cpu(), want)
                        if not baseline[op] < BASELINE_LIMIT[dtype]:
                            failures.append(f"{what}: the unfused baseline itself is off: {baseline[op]:.2e}")
                    problem = testing.check_close(got.cpu(), want, baseline=baseline[op], dtype=dtype, what=what)
                    if problem:
                        failures.append(problem)
    if "fused" in strategies:   # fp32 is refused with the reason (its Triton GEMM would use TF32)
        try:
            tpfuse.ag_gemm(torch.randn(4, 8, device=dev), torch.randn(8, 4, device=dev), strategy="fused")
            failures.append("fused ran float32 although it refuses it")
        except ValueError as exc:
            if "TF32" not in str(exc):
                failures.append(f"fused float32: unexpected message {exc}")
    torch.cuda.synchronize()
    return failures


def test_w1_nccl():
    results = run_ranks(ops_on_one_gpu, 1, [(37, 53, 29), (4091, 1000, 771)], backend="nccl", env=ENV, timeout=300)
    assert results == [[]]


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 or more GPUs")
def test_nccl_one_rank_per_gpu():
    """W = number of GPUs (up to 4), NCCL, one rank per GPU: the real multi-GPU path of every strategy."""
    w = min(4, torch.cuda.device_count())
    results = run_ranks(ops_on_one_gpu, w, [(37, 53, 29), (1031, 512, 389)], backend="nccl", env=ENV, timeout=300)
    assert results == [[]] * w


def gloo_cuda_p2p_works(rank, world_size):
    x = torch.full((4,), float(rank), device="cuda")
    ops = [dist.P2POp(dist.isend, x, (rank + 1) % world_size), dist.P2POp(dist.irecv, y := torch.empty_like(x), (rank - 1) % world_size)]
    for work in dist.batch_isend_irecv(ops):
        work.wait()
    torch.cuda.synchronize()
    return y.cpu().tolist()


def test_ring_cuda_streams_two_ranks_one_gpu():
    env = {**ENV, "TORCH_SYMM_MEM_ALLOW_OVERLAPPING_DEVICES": "1", "CUDA_VISIBLE_DEVICES": "0"}
    try:
        run_ranks(gloo_cuda_p2p_works, 2, env=env, timeout=120)
    except RankError as exc:
        pytest.skip(f"gloo cannot send CUDA tensors here: {str(exc).splitlines()[-1]}")
    results = run_ranks(ops_on_one_gpu, 2, [(37, 53, 29), (1031, 512, 389)], ("unfused", "ring"), env=env, timeout=300)
    assert results == [[], []]
