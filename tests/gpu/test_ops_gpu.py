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


def fp8_ops_on_gpus(rank, world_size, strategies=("copy_engine", "fused")):
    """fp8 (e4m3, bf16 out) ops x strategies x {tensor-wise, row-wise} at M/W = 37, K = 1008,
    N = 784: within 4x the error of cuBLASLt's ``torch._scaled_mm`` on the same inputs (float64
    reference of the dequantized inputs), gathered A and scales bit-exact.  Returns failures."""
    from tpfuse import _fp8

    dev = torch.device("cuda", torch.cuda.current_device())
    rows, k, n = 37, 1008, 784
    m = world_size * rows
    failures = []

    def rel(x, ref):
        return ((x.double() - ref).abs().max() / ref.abs().max()).item()

    for gran in ("tensor", "rows"):
        g = torch.Generator().manual_seed(29 if gran == "tensor" else 30)
        a8, sa = _fp8.quantize(torch.randn(m, k, generator=g).to(dev), _fp8.E4M3, gran)
        ws = [_fp8.quantize(torch.randn(n, k, generator=g).to(dev), _fp8.E4M3, gran) for _ in range(world_size)]
        bs = [(w8.t(), sw.reshape(()) if gran == "tensor" else sw.reshape(1, n)) for w8, sw in ws]
        a_rs = [_fp8.quantize(torch.randn(m, k, generator=g).to(dev), _fp8.E4M3, gran) for _ in range(world_size)]
        b8, sb = bs[rank]
        ref_ag = (a8.double() * sa.double()) @ (b8.double() * sb.double())
        base_ag = rel(torch._scaled_mm(a8, b8, scale_a=sa, scale_b=sb, out_dtype=torch.bfloat16), ref_ag)
        ref_ar = sum((x.double() * s.double()) @ (b.double() * t.double()) for (x, s), (b, t) in zip(a_rs, bs))
        base_ar = rel(sum(torch._scaled_mm(x, b, scale_a=s, scale_b=t, out_dtype=torch.float32)
                          for (x, s), (b, t) in zip(a_rs, bs)).bfloat16(), ref_ar)
        mine = slice(rank * rows, (rank + 1) * rows)
        for strategy in strategies:
            what = f"{strategy} {gran}-wise"
            c, a_full, s_full = tpfuse.ag_gemm(a8[mine].contiguous(), b8, scale_a=sa[mine] if gran == "rows" else sa,
                                               scale_b=sb, strategy=strategy, return_gathered=True)
            if rel(c, ref_ag) > 4 * base_ag + 1e-6 or not torch.equal(a_full.view(torch.uint8), a8.view(torch.uint8)) \
                    or not torch.equal(s_full.reshape(sa.shape), sa):
                failures.append(f"{what} ag_gemm: err {rel(c, ref_ag):.2e} (cuBLASLt {base_ag:.2e}) or gathered differ")
            x, s = a_rs[rank]
            rs = tpfuse.gemm_rs(x, b8, scale_a=s, scale_b=sb, strategy=strategy)
            if rel(rs, ref_ar[mine]) > 4 * base_ar + 1e-6:
                failures.append(f"{what} gemm_rs: err {rel(rs, ref_ar[mine]):.2e} (cuBLASLt {base_ar:.2e})")
            ar = tpfuse.gemm_ar(x, b8, scale_a=s, scale_b=sb, strategy=strategy)
            if rel(ar, ref_ar) > 4 * base_ar + 1e-6:
                failures.append(f"{what} gemm_ar: err {rel(ar, ref_ar):.2e} (cuBLASLt {base_ar:.2e})")
    torch.cuda.synchronize()
    return failures


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 or more GPUs (one GPU: tests/gpu/bed.py --cases fp8)")
def test_fp8_copy_engine_and_fused_one_rank_per_gpu():
    w = min(4, torch.cuda.device_count())
    assert run_ranks(fp8_ops_on_gpus, w, backend="nccl", env=ENV, timeout=300) == [[]] * w
