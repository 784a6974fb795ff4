"""GPU tests of the ping-pong Gluon kernel (tpfuse/kernels/gemm_pp.py, ``GemmConfig.pingpong``):
a plain fp8 call is bitwise the same call in gemm_kernel (the same wgmma K-steps, accumulation
and order of scaling) and close to ``torch._scaled_mm``; the hooked calls (mirroring
tests/gpu/test_gemm_core.py's hooked fp8 tests) bitwise the plain call, the wait hook bounded.
sm_90 only. Run on one H200 (BENCHMARKS.md), the last time on the tree of 0704ad4 (the poll warp
handing off only the tiles of a chunk new to the program), late-release test included.
"""
import dataclasses
import os
import time

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
pytest.importorskip("triton", reason="triton is not installed")

from tpfuse import gemm as gc  # noqa: E402
from tpfuse.kernels import abi  # noqa: E402
from _fp8_inputs import fp8_operands as _operands  # noqa: E402  (tests/gpu)
from _late_release import release_chunks  # noqa: E402  (tests/gpu)

SM90 = torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9
E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
PP = gc.GemmConfig(BLOCK_M=128, BLOCK_N=128, BLOCK_K=128, num_warps=8, num_stages=5, gluon=True, pingpong=True)
PLAIN = dataclasses.replace(PP, gluon=False, pingpong=False)   # gemm_kernel, the same tiles and K-steps


@pytest.fixture(autouse=True)
def _compiled_kernels():
    if os.environ.get("TRITON_INTERPRET") == "1":
        pytest.skip("TRITON_INTERPRET=1 is set; these tests need compiled kernels")
    if not SM90:
        pytest.skip("gemm_pp's wgmma is sm_90's")


def _call(a, b, sa, sb, out_dtype, config, **kw):
    out = torch.full((a.shape[0], b.shape[1]), float("nan"), device="cuda", dtype=out_dtype)
    gc.matmul(a, b, out=out, config=config, scale_a=sa, scale_b=sb, out_dtype=out_dtype, **kw)
    return out, gc.last_plan()


def _rel_err(got, ref):
    return ((got.double() - ref).norm() / ref.norm()).item()


# (M, N, K): edges in M and N (N a multiple of 16, as fp8 asks, not of 128; TMA clips the
# stores, zero-fills the loads), one K-step, the
# short-K prefill shapes of issue 29, and a tall one
SHAPES = [(1000, 784, 1024), (4096, 4096, 1792), (16384, 4096, 1792), (384, 256, 128), (771, 4096, 4096)]


@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("mode", ["tensor", "row"])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_pingpong_is_bitwise_gemm_kernel_and_close_to_scaled_mm(shape, mode, out_dtype):
    m, n, k = shape
    a, b, sa, sb = _operands(m, n, k, mode)
    ours, plan = _call(a, b, sa, sb, out_dtype, PP)
    assert plan.kernel == "gemm_pp_kernel", plan.explain()
    assert plan.ws_block == (128, 128, 128) and plan.ws_stages == (5 if out_dtype == torch.bfloat16 else 3)
    assert "gemm_pp" in plan.explain()
    again, _ = _call(a, b, sa, sb, out_dtype, PP)   # a second call (the direct launch path)
    ref, ref_plan = _call(a, b, sa, sb, out_dtype, PLAIN)
    assert ref_plan.kernel == "gemm_kernel", ref_plan.explain()
    torch.cuda.synchronize()
    assert not torch.isnan(ours).any() and not torch.isinf(ours).any()
    assert torch.equal(ours, ref) and torch.equal(again, ref)
    # against cuBLASLt with the same (fast) accumulation: no further off the float64 product
    # than twice its own error, or two output roundings
    theirs = torch._scaled_mm(a, b, scale_a=sa, scale_b=sb, out_dtype=out_dtype, use_fast_accum=True)
    exact = (a.double() * sa.double()) @ (b.double() * sb.double())
    eps = torch.finfo(out_dtype).eps if out_dtype != torch.float32 else 1e-5
    assert _rel_err(ours, exact) <= max(2 * _rel_err(theirs, exact), 2 * eps)


@pytest.mark.parametrize("num_sms", [1, 7, 66], ids=lambda s: f"{s}sms")
def test_pingpong_with_few_programs_alternates_consumers_over_many_tiles(num_sms):
    # few programs: each runs many tiles, odd and even counts, so both consumers, the shared
    # ring's phases and the ordering barrier go round many times
    m, n, k = 2048, 1536, 1792
    a, b, sa, sb = _operands(m, n, k, "row", seed=3)
    ours, plan = _call(a, b, sa, sb, torch.bfloat16, PP, num_sms=num_sms)
    assert plan.kernel == "gemm_pp_kernel" and plan.grid[0] == num_sms, plan.explain()
    ref, _ = _call(a, b, sa, sb, torch.bfloat16, PLAIN, num_sms=num_sms)
    assert torch.equal(ours, ref)


@pytest.mark.parametrize("a_dtype,b_dtype,out_dtype", [(E5M2, E4M3, torch.float16), (E4M3, E5M2, torch.bfloat16)])
def test_pingpong_fp8_mixes(a_dtype, b_dtype, out_dtype):
    m, n, k = 1000, 784, 1024
    a, b, sa, sb = _operands(m, n, k, "row", a_dtype, b_dtype, seed=5)
    ours, plan = _call(a, b, sa, sb, out_dtype, PP)
    assert plan.kernel == "gemm_pp_kernel", plan.explain()
    ref, _ = _call(a, b, sa, sb, out_dtype, PLAIN)
    assert torch.equal(ours, ref)


def test_pingpong_is_bitwise_gemm_ws():
    # the hook-free Gluon kernel on the same tiles: the same wgmma sequence and scaling
    m, n, k = 4096, 4096, 1792
    a, b, sa, sb = _operands(m, n, k, "row", seed=7)
    ours, _ = _call(a, b, sa, sb, torch.bfloat16, PP)
    ws, plan = _call(a, b, sa, sb, torch.bfloat16, dataclasses.replace(PP, pingpong=False))
    assert plan.kernel == "gemm_ws_kernel", plan.explain()
    assert torch.equal(ours, ws)


def test_pingpong_hooks_match_the_plain_call_bitwise():
    # the wait hook (round order, signals already set) and the epilogue hook (owner order,
    # stacked destinations: one descriptor) change neither the sums nor the scaling: bitwise
    # the plain gemm_pp call; every chunk published, the counters back at zero
    m, n, k, chunk_m = 1024, 1024, 2048, 256
    a, b, sa, sb = _operands(m, n, k, "row", seed=2)
    plain, plan = _call(a, b, sa, sb, torch.bfloat16, PP)
    assert plan.kernel == "gemm_pp_kernel", plan.explain()
    signal = torch.full((m // chunk_m,), 5, dtype=torch.int32, device="cuda")
    waited, plan = _call(a, b, sa, sb, torch.bfloat16, PP, tile_order="round", start_chunk=2,
                         wait=gc.WaitSpec(signal, generation=5, chunk_m=chunk_m, timeout_ns=10**9))
    assert plan.kernel == "gemm_pp_kernel" and "wait hook: gemm_pp" in plan.explain(), plan.explain()
    dests = torch.full((m, n), float("nan"), dtype=torch.bfloat16, device="cuda")
    signals = torch.zeros(m // chunk_m, dtype=torch.int32, device="cuda")
    counters = torch.zeros(m // chunk_m, dtype=torch.int32, device="cuda")
    spec = gc.EpilogueSpec.from_tensors(list(dests.split(chunk_m)), signals, 1, chunk_m, counters=counters)
    gc.matmul(a, b, config=PP, tile_order="owner", start_chunk=1, epilogue=spec, scale_a=sa, scale_b=sb)
    plan = gc.last_plan()
    assert plan.kernel == "gemm_pp_kernel" and plan.epi_tma == abi.EPI_TMA_STACKED, plan.explain()
    assert "epilogue hook: gemm_pp" in plan.explain()
    torch.cuda.synchronize()
    assert torch.equal(waited, plain) and torch.equal(dests, plain)
    assert signals.tolist() == [1] * 4 and not counters.any()


@pytest.mark.parametrize("signalled", [True, False], ids=["signalled", "route_only"])
@pytest.mark.parametrize("mode", ["tensor", "row"])
@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_pingpong_epilogue_hook_per_chunk_matches_the_plain_call_bitwise(mode, out_dtype, signalled):
    # gemm_rs's case: one destination per chunk (per-chunk TMA descriptors, 8 rows apart so not
    # stacked), gemm_pp's store warp counting and publishing (or, without signals, as fused
    # gemm_rs / gemm_ar run it, storing only); bitwise the plain gemm_pp call and gemm_kernel's;
    # two generations: the JIT launch, then the direct one
    m, n, k, chunk_m = 1024, 1024, 2048, 256
    a, b, sa, sb = _operands(m, n, k, mode, seed=5)
    plain, plan = _call(a, b, sa, sb, out_dtype, PP)
    assert plan.kernel == "gemm_pp_kernel", plan.explain()
    ref, _ = _call(a, b, sa, sb, out_dtype, PLAIN)
    gapped = torch.empty((m // chunk_m * (chunk_m + 8), n), dtype=out_dtype, device="cuda")
    dests = [gapped[q * (chunk_m + 8):q * (chunk_m + 8) + chunk_m] for q in range(m // chunk_m)]
    signals = torch.zeros(m // chunk_m, dtype=torch.int32, device="cuda")
    for generation in (1, 2):
        for d in dests:
            d.fill_(float("nan"))
        spec = gc.EpilogueSpec.from_tensors(dests, signals if signalled else None, generation, chunk_m)
        gc.matmul(a, b, config=PP, tile_order="owner", start_chunk=1, epilogue=spec, scale_a=sa, scale_b=sb,
                  out_dtype=out_dtype)
        plan = gc.last_plan()
        assert plan.kernel == "gemm_pp_kernel" and plan.epi_tma == m // chunk_m, plan.explain()
        assert plan.ws_stages == (5 if out_dtype == torch.bfloat16 else 3)
        torch.cuda.synchronize()
        assert signals.tolist() == [generation if signalled else 0] * (m // chunk_m)
        assert torch.equal(torch.cat(dests), plain) and torch.equal(plain, ref)


def test_pingpong_wait_timeout_is_bounded():
    # a wait that never sees its flag (chunk 2 stays at 6 < 7): gemm_pp's poll warp records the
    # timeout and the loads go on, so the kernel ends and the host raises within the bound
    m, n, k = 1024, 512, 512
    a, b, sa, sb = _operands(m, n, k, "tensor", seed=4)
    signal = torch.tensor([7, 7, 6, 7], dtype=torch.int32, device="cuda")
    t0 = time.time()
    with pytest.raises(TimeoutError, match=r"rank 3.*chunk=2\] >= generation 7, last value seen 6"):
        gc.matmul(a, b, config=PP, scale_a=sa, scale_b=sb,
                  wait=gc.WaitSpec(signal, 7, 256, timeout_ns=20_000_000, max_spins=100_000, rank=3))
    assert time.time() - t0 < 30 and gc.last_plan().kernel == "gemm_pp_kernel", gc.last_plan().explain()


def test_pingpong_wait_hook_released_late_reads_only_released_rows():
    # test_gemm_core.py's late release for gemm_pp (its poll warp two tiles ahead of the load
    # warp, the handoff through mbarriers): a producer stream writes A chunk by chunk, last chunk
    # first, after a delay, and raises each chunk's signal after its rows; a tile that loaded its
    # rows before its chunk's signal would read the NaN poison. 64 programs leave SMs free for
    # the producer's copies. The result is bitwise the plain gemm_pp call on the released rows.
    m, n, k, chunk_m = 8 * 512, 1536, 1024, 512
    src, b, sa, sb = _operands(m, n, k, "row", seed=11)
    plain, plan = _call(src, b, sa, sb, torch.bfloat16, PP)
    assert plan.kernel == "gemm_pp_kernel", plan.explain()
    poison = torch.full((m, k), float("nan"), device="cuda").to(E4M3)
    a = poison.clone()
    signal = torch.zeros(8, dtype=torch.int32, device="cuda")
    out = torch.full((m, n), float("nan"), device="cuda", dtype=torch.bfloat16)
    consumer, producer = torch.cuda.Stream(), torch.cuda.Stream()
    cfg = dataclasses.replace(PP, num_programs=64)
    err = gc.new_error_word("cuda")
    torch.cuda.synchronize()   # the streams below do not wait for the default stream's fills

    def call(gen):   # returns at once: the producer is what releases the GEMM
        with torch.cuda.stream(consumer):
            gc.matmul(a, b, out=out, config=cfg, tile_order="round", start_chunk=2, check=False,
                      scale_a=sa, scale_b=sb,
                      wait=gc.WaitSpec(signal, gen, chunk_m, timeout_ns=5_000_000_000, error=err))

    def release(gen, delay_cycles):   # on the producer stream: A chunk by chunk, each then signalled
        release_chunks(a, src, signal, chunk_m, gen, delay_cycles, producer)

    release(1, 1)   # first with every chunk released before the GEMM starts
    torch.cuda.synchronize()
    call(1)
    torch.cuda.synchronize()
    gc.check_error_word(err)
    assert gc.last_plan().kernel == "gemm_pp_kernel", gc.last_plan().explain()
    assert torch.equal(out, plain)
    a.copy_(poison)   # then poisoned again, the next generation, released late
    out.fill_(float("nan"))
    torch.cuda.synchronize()
    call(2)
    release(2, 20_000_000)   # ~10 ms: the GEMM is spinning by now
    torch.cuda.synchronize()
    gc.check_error_word(err)
    assert torch.equal(out, plain)


@pytest.mark.parametrize("hook", ["none", "wait", "epilogue"])
def test_pingpong_with_tile_records(hook):
    # tile_records: gemm_pp writes every tile's row (start and wait done in the load warp, end
    # in the store warp) and the result does not change
    m, n, k, chunk_m = 1000, 784, 1024, 250
    a, b, sa, sb = _operands(m, n, k, "tensor")
    plain, _ = _call(a, b, sa, sb, torch.bfloat16, PP)
    rec = gc.tile_records_for(m, n, PP, device="cuda")
    kw = {}
    if hook == "wait":
        kw = dict(tile_order="round", start_chunk=1,
                  wait=gc.WaitSpec(torch.full((4,), 2, dtype=torch.int32, device="cuda"), 2, chunk_m,
                                   timeout_ns=10**9))
    if hook == "epilogue":
        dests = torch.full((m, n), float("nan"), dtype=torch.bfloat16, device="cuda")
        signals = torch.zeros(4, dtype=torch.int32, device="cuda")
        spec = gc.EpilogueSpec.from_tensors(list(dests.split(chunk_m)), signals, 1, chunk_m)
        gc.matmul(a, b, config=PP, tile_order="owner", start_chunk=1, epilogue=spec, scale_a=sa, scale_b=sb,
                  tile_records=rec)
        plan, ours = gc.last_plan(), dests
    else:
        ours, plan = _call(a, b, sa, sb, torch.bfloat16, PP, tile_records=rec, **kw)
    assert plan.kernel == "gemm_pp_kernel", plan.explain()
    torch.cuda.synchronize()
    assert torch.equal(ours, plain)
    rows = rec[:plan.num_tiles].cpu()
    assert plan.num_tiles == 8 * 7 and (rows != -1).all()
    assert rows[:, abi.REC_TILE].tolist() == list(range(plan.num_tiles))
    assert ((rows[:, abi.REC_PROGRAM] >= 0) & (rows[:, abi.REC_PROGRAM] < plan.programs)).all()
    start, wait, end = (rows[:, c] for c in (abi.REC_START_NS, abi.REC_WAIT_NS, abi.REC_END_NS))
    assert (start <= wait).all() and (wait <= end).all()
    if hook != "wait":
        assert torch.equal(start, wait)
