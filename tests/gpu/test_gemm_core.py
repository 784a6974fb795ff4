"""GEMM core on a CUDA GPU: TMA and plain-pointer paths, tile orders, hooks, bounded waits.

Run in its own pytest process (tests/cpu/test_gemm_core_interp.py switches Triton to the
interpreter while it runs). Outputs are poisoned with NaN and compared with a float64 reference
within 3x cuBLAS's own error in the same dtype (tpfuse/testing.py).
"""
import dataclasses
import json
import os
import warnings

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
pytest.importorskip("triton", reason="triton is not installed")

from tpfuse import gemm as gc  # noqa: E402
from tpfuse import testing  # noqa: E402
from tpfuse.gemm import cache, launch  # noqa: E402
from tpfuse.gemm.config import GLUON_STAGES  # noqa: E402
from tpfuse.kernels import abi  # noqa: E402
from _fp8_inputs import fp8_operands  # noqa: E402  (tests/gpu)
from _late_release import release_chunks  # noqa: E402  (tests/gpu)


@pytest.fixture(autouse=True)
def _compiled_kernels():
    # Checked when each test runs, not at collection: tests/cpu/test_gemm_core_interp.py sets
    # TRITON_INTERPRET=1 while it is imported and its tests run, and restores it afterwards.
    if os.environ.get("TRITON_INTERPRET") == "1":
        pytest.skip("TRITON_INTERPRET=1 is set; these tests need compiled kernels")

HOPPER = torch.cuda.is_available() and torch.cuda.get_device_capability()[0] >= 9
BIG = gc.GemmConfig(BLOCK_M=128, BLOCK_N=256, BLOCK_K=64, num_warps=8, num_stages=3)
SMALL = gc.GemmConfig(BLOCK_M=64, BLOCK_N=64, BLOCK_K=64, num_warps=4, num_stages=3)
# TMA loads, pointer stores: the seventh stage takes the staging buffer's shared memory
DEEP_PTR = gc.GemmConfig(BLOCK_M=128, BLOCK_N=128, BLOCK_K=64, num_warps=8, num_stages=7, tma_store=False)
# one loop over (tile, K-step): the next tile's loads, and its wait hook, run ahead of this
# tile's epilogue
FLAT = dataclasses.replace(BIG, flatten=True)


def _operands(m, k, n, dtype, b_layout, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    a = torch.randn(m, k, generator=g, device="cuda").to(dtype)
    if b_layout == "weight_t":
        b = torch.randn(n, k, generator=g, device="cuda").to(dtype).t()
    else:
        b = torch.randn(k, n, generator=g, device="cuda").to(dtype)
    return a, b, testing.Reference.of(a, b)


def _assert_close(out, ref, dtype):
    """Frobenius error against the float64 reference within 3x cuBLAS's own in ``dtype`` (tf32
    for float32, as the core computes it; tpfuse/testing.py); NaN (poison never overwritten)
    and Inf fail."""
    torch.cuda.synchronize()
    testing.assert_close(out, ref, dtype=dtype, norm="fro")


@pytest.mark.parametrize("shape", [(37, 53, 29), (130, 70, 65), (4091, 1000, 771), (2048, 4096, 3584)],
                         ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("b_layout", ["row_major", "weight_t"])
@pytest.mark.parametrize("config", [BIG, SMALL, DEEP_PTR], ids=["128x256", "64x64", "128x128s7_ptr"])
def test_matmul_bf16(shape, b_layout, config):
    m, k, n = shape
    a, b, ref = _operands(m, k, n, torch.bfloat16, b_layout)
    out = torch.full((m, n), float("nan"), device="cuda", dtype=torch.bfloat16)
    gc.matmul(a, b, out=out, config=config)
    _assert_close(out, ref, torch.bfloat16)


@pytest.mark.parametrize("use_tma", [False] + ([True] if HOPPER else []))
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_paths_and_dtypes(use_tma, dtype):
    a, b, ref = _operands(1024, 512, 768, dtype, "weight_t", seed=1)
    out = torch.full((1024, 768), float("nan"), device="cuda", dtype=dtype)
    gc.matmul(a, b, out=out, config=gc.GemmConfig(BLOCK_M=128, BLOCK_N=128, BLOCK_K=32,
                                                  num_stages=3), use_tma=use_tma)
    _assert_close(out, ref, dtype)


@pytest.mark.skipif(not HOPPER, reason="TMA needs compute capability 9.0")
def test_tma_rejects_misaligned_rows_with_a_clear_error():
    a, b, _ = _operands(64, 53, 64, torch.bfloat16, "row_major")   # 53 * 2 bytes: not 16-aligned
    with pytest.raises(ValueError, match="16-byte aligned"):
        gc.matmul(a, b, use_tma=True)


@pytest.mark.parametrize("order,start", [("grouped", 0), ("round", 3), ("owner", 5)])
@pytest.mark.parametrize("flatten,sub", [(False, 1), (True, 2)])
def test_tile_orders(order, start, flatten, sub):
    a, b, ref = _operands(4091 * 2, 1000, 771, torch.bfloat16, "weight_t", seed=2)
    out = torch.full((8182, 771), float("nan"), device="cuda", dtype=torch.bfloat16)
    cfg = gc.GemmConfig(BLOCK_M=128, BLOCK_N=128, BLOCK_K=64, num_stages=3, flatten=flatten, EPI_SUBTILE=sub)
    gc.matmul(a, b, out=out, config=cfg, tile_order=order,
              chunk_m=None if order == "grouped" else 1023, start_chunk=start)
    _assert_close(out, ref, torch.bfloat16)


WS_GPU = torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9
# the wait hook in gemm_kernel and, on sm_90 with inline PTX, in the Gluon kernel's load warp
# (tpfuse/kernels/gemm_ws.py; flatten means nothing to it)
KERNELS = [("gemm_kernel", BIG, False), ("gemm_kernel", FLAT, False)] + ([("gemm_ws_kernel", BIG, True)] if WS_GPU else [])
KERNEL_IDS = [f"{k}-{'flat' if c.flatten else 'nested'}" for k, c, _ in KERNELS]


@pytest.mark.skipif(not WS_GPU, reason="the Gluon kernel runs on sm_90")
@pytest.mark.parametrize("hook", ["wait", "epilogue"])
def test_gluon_launches_with_expanded_descriptors_match_the_jit_launch_bitwise(hook):
    # The first call of a specialization launches through Triton's JIT (descriptor objects); the
    # later ones call the C launcher with the descriptors expanded by tpfuse (tpfuse/_direct.py,
    # launch_tma) where this Triton's expansion is the one read there: same bits, fresh outputs.
    from tpfuse import _direct

    a, b, ref = _operands(4 * 512, 1024, 1536, torch.bfloat16, "weight_t", seed=7)
    signal = torch.full((4,), 5, dtype=torch.int32, device="cuda")
    outs = []
    before = gc.launch_counts()
    for _ in range(3):
        if hook == "wait":
            out = torch.full((4 * 512, 1536), float("nan"), device="cuda", dtype=torch.bfloat16)
            gc.matmul(a, b, out=out, config=BIG, tile_order="round", start_chunk=1,
                      wait=gc.WaitSpec(signal, 5, 512, timeout_ns=2_000_000_000))
        else:
            out = torch.full((4 * 512 + 8, 1536), float("nan"), device="cuda", dtype=torch.bfloat16)
            dests = [out[c * 512:(c + 1) * 512] for c in range(4)]
            gc.matmul(a, b, config=BIG, tile_order="owner", start_chunk=2, chunk_m=512,
                      epilogue=gc.EpilogueSpec.from_tensors(dests, signal, 6, 512))
        assert _took("gemm_ws_kernel"), gc.last_plan().explain()
        outs.append(out)
    torch.cuda.synchronize()
    _assert_close(outs[0][:4 * 512], ref, torch.bfloat16)
    assert all(torch.equal(o[:4 * 512], outs[0][:4 * 512]) for o in outs[1:])
    delta = {k: gc.launch_counts().get(k, 0) - before.get(k, 0) for k in ("direct", "direct_tma")}
    assert delta["direct"] >= 2, delta
    if _direct.tma_expansion_known():
        assert delta["direct_tma"] >= 2, delta
    else:
        assert delta["direct_tma"] == 0, delta


@pytest.mark.skipif(not WS_GPU, reason="the Gluon kernel runs on sm_90")
@pytest.mark.parametrize("hook", ["wait", "epilogue"])
def test_a_prepared_call_is_matmuls_call_bitwise_on_new_tensors(hook):
    # PreparedMatmul (the fused strategies' GEMM): after its first call it launches from the
    # kept argument list with the new tensors' addresses; every call equals matmul's bitwise
    # (tests/cpu/test_prepared_matmul.py: the arguments, and the calls that go through matmul).
    from tpfuse import _direct

    signal = torch.full((4,), 5, dtype=torch.int32, device="cuda")
    err = gc.new_error_word(torch.device("cuda"))
    dest = torch.empty(4 * 512, 1536, device="cuda", dtype=torch.bfloat16)
    dests = [dest[c * 512:(c + 1) * 512] for c in range(4)]
    if hook == "wait":
        fixed = dict(config=BIG, tile_order="round", start_chunk=1, check=False,
                     wait=gc.WaitSpec(signal, 5, 512, timeout_ns=2_000_000_000, error=err))
    else:
        fixed = dict(config=BIG, tile_order="owner", start_chunk=2, chunk_m=512,
                     epilogue=gc.EpilogueSpec.from_tensors(dests, signal, 6, 512))
    call = gc.PreparedMatmul(**fixed)
    before = gc.launch_counts()
    for seed in range(3):
        a, b, ref = _operands(4 * 512, 1024, 1536, torch.bfloat16, "weight_t", seed=seed)
        if hook == "wait":
            ours = torch.full((4 * 512, 1536), float("nan"), device="cuda", dtype=torch.bfloat16)
            call(a, b, out=ours)
            theirs = gc.matmul(a, b, **fixed)
        else:
            call(a, b)
            ours = dest.clone()
            dest.fill_(float("nan"))
            gc.matmul(a, b, **fixed)
            theirs = dest
        assert _took("gemm_ws_kernel"), gc.last_plan().explain()
        torch.cuda.synchronize()
        _assert_close(ours, ref, torch.bfloat16)
        assert torch.equal(ours, theirs)
    assert (call._kept is not None) == _direct.tma_expansion_known()
    delta = gc.launch_counts().get("direct_tma", 0) - before.get("direct_tma", 0)
    assert delta >= (4 if _direct.tma_expansion_known() else 0), delta
    assert not err.any()


def _took(kernel):
    """The latest matmul ran ``kernel`` (its public LaunchPlan says so)."""
    return gc.last_plan().kernel == kernel


@pytest.mark.parametrize("use_asm", [True, False], ids=["asm", "atomics"])
@pytest.mark.parametrize("kernel,config,gluon", KERNELS, ids=KERNEL_IDS)
def test_wait_hook_signals_preset(use_asm, kernel, config, gluon):
    if kernel == "gemm_ws_kernel" and not use_asm:
        pytest.skip("the Gluon kernel's wait is inline PTX")
    options = gc.GemmOptions(signal_asm=use_asm, gluon=gluon)
    a, b, ref = _operands(8 * 517, 1024, 1536, torch.bfloat16, "weight_t", seed=3)
    signal = torch.tensor([4, 9, 4, 4, 5, 4, 4, 4], dtype=torch.int32, device="cuda")
    out = torch.full((8 * 517, 1536), float("nan"), device="cuda", dtype=torch.bfloat16)
    gc.matmul(a, b, out=out, config=config, tile_order="round", start_chunk=2,
              wait=gc.WaitSpec(signal, 4, 517, timeout_ns=2_000_000_000), options=options)
    assert _took(kernel), gc.last_plan().explain()
    _assert_close(out, ref, torch.bfloat16)


@pytest.mark.parametrize("kernel,config,gluon", KERNELS, ids=KERNEL_IDS)
def test_wait_hook_released_late_reads_only_released_rows(kernel, config, gluon):
    options = gc.GemmOptions(gluon=gluon)
    # The producer writes A chunk by chunk, last chunk first, after a delay, and raises each
    # chunk's signal after its rows: a tile that loaded its rows before its wait returned
    # (e.g. a load hoisted by the pipeliner of the flattened loop) would read the NaN poison.
    # 64 programs leave SMs free for the producer's kernels.
    m, k, n, chunk_m = 8 * 512, 1024, 1536, 512
    src, b, ref = _operands(m, k, n, torch.bfloat16, "weight_t", seed=21)
    a = torch.full_like(src, float("nan"))
    signal = torch.zeros(8, dtype=torch.int32, device="cuda")
    out = torch.full((m, n), float("nan"), device="cuda", dtype=torch.bfloat16)
    consumer, producer = torch.cuda.Stream(), torch.cuda.Stream()
    cfg = dataclasses.replace(config, num_programs=64)
    err = gc.new_error_word("cuda")
    # Everything above was made on the default stream, which the two streams below do not wait
    # for: without this, the producer's writes to ``a`` and ``signal`` could land before the
    # default stream's NaN/zero fills and be overwritten (seen on the H200, 2026-11-30: the
    # warm-up below timed out with every signal set to 1 before the GEMM started, reading 0).
    torch.cuda.synchronize()

    def call(gen):   # returns at once: the producer is what releases the GEMM
        with torch.cuda.stream(consumer):
            gc.matmul(a, b, out=out, config=cfg, tile_order="round", start_chunk=2, check=False,
                      wait=gc.WaitSpec(signal, gen, chunk_m, timeout_ns=5_000_000_000, error=err),
                      options=options)

    def release(gen, delay_cycles):   # on the producer stream: A chunk by chunk, each then signalled
        release_chunks(a, src, signal, chunk_m, gen, delay_cycles, producer)

    # The whole sequence once with every chunk released before the GEMM starts (the wait hook
    # with signals already set). It was added because the first such run of a process timed
    # out on the H200 while the second passed; the race fixed above fits that (the default
    # stream's first fills are the slow ones of a process), and the warm-up stays as a check.
    release(1, 1)
    torch.cuda.synchronize()
    call(1)
    torch.cuda.synchronize()
    gc.check_error_word(err)
    assert _took(kernel)
    # The checked run: A poisoned again, the next generation, released late.
    a.fill_(float("nan"))
    out.fill_(float("nan"))
    torch.cuda.synchronize()
    call(2)
    release(2, 20_000_000)   # ~10 ms: the GEMM is spinning by now
    torch.cuda.synchronize()
    gc.check_error_word(err)
    _assert_close(out, ref, torch.bfloat16)


@pytest.mark.parametrize("use_asm", [True, False], ids=["asm", "atomics"])
@pytest.mark.parametrize("kernel,config,gluon", KERNELS, ids=KERNEL_IDS)
def test_wait_timeout_is_bounded(use_asm, kernel, config, gluon):
    import time
    if kernel == "gemm_ws_kernel" and not use_asm:
        pytest.skip("the Gluon kernel's wait is inline PTX")
    options = gc.GemmOptions(signal_asm=use_asm, gluon=gluon)
    a, b, _ = _operands(1024, 512, 512, torch.bfloat16, "row_major", seed=4)
    signal = torch.tensor([7, 7, 6, 7], dtype=torch.int32, device="cuda")
    t0 = time.time()
    with pytest.raises(TimeoutError, match=r"rank 3.*chunk=2\] >= generation 7, last value seen 6"):
        gc.matmul(a, b, config=config, wait=gc.WaitSpec(signal, 7, 256, timeout_ns=20_000_000,
                                                        max_spins=100_000, rank=3), options=options)
    assert time.time() - t0 < 30 and _took(kernel)


def _epilogue_over_generations(m, k, n, chunk_m, config, start_chunk, seed, after=lambda: True,
                               expect_tma=None, stacked=False, expect_ws=False, order="owner",
                               b_layout="weight_t", dtype=torch.bfloat16, options=None):
    """Route every chunk of ``a @ b`` to its own destination over three generations: signals
    published, counters back at zero, each destination exact and untouched past its rows.
    ``expect_tma``: the plan must (True) or must not (False) store through TMA descriptors.
    ``stacked``: the destinations are consecutive row blocks of one tensor (one descriptor).
    ``expect_ws``: the plan must (True) or must not (False) take the warp-specialized Gluon
    kernel (None: either)."""
    num_chunks = m // chunk_m
    if stacked:
        whole = torch.full((m + 5, n), float("nan"), device="cuda", dtype=dtype)
        dests = [whole[c * chunk_m:(c + 1) * chunk_m] for c in range(num_chunks)]
    else:
        dests = [torch.full((chunk_m + 5, n), float("nan"), device="cuda", dtype=dtype)
                 for _ in range(num_chunks)]
    n_descs = abi.EPI_TMA_STACKED if stacked else num_chunks
    before = gc.launch_counts()
    signals = torch.zeros(num_chunks, dtype=torch.int32, device="cuda")
    counters = torch.zeros(num_chunks, dtype=torch.int32, device="cuda")
    for generation in (1, 2, 3):
        a, b, ref = _operands(m, k, n, dtype, b_layout, seed=seed + generation)
        for d in dests:
            d.fill_(float("nan"))
        spec = gc.EpilogueSpec.from_tensors(dests, signals, generation, chunk_m, counters=counters)
        gc.clear_plans()
        gc.matmul(a, b, config=config, tile_order=order, start_chunk=start_chunk, epilogue=spec,
                  chunk_m=chunk_m, options=options)
        torch.cuda.synchronize()
        plan = gc.last_plan()
        if expect_tma is not None:
            assert plan.epi_tma == (n_descs if expect_tma else 0), plan.explain()
        if expect_ws is not None:
            assert (plan.kernel == "gemm_ws_kernel") == expect_ws, plan.explain()
        assert signals.tolist() == [generation] * num_chunks
        assert counters.tolist() == [0] * num_chunks and after()
        for c, d in enumerate(dests):
            _assert_close(d[:chunk_m], ref[c * chunk_m:(c + 1) * chunk_m], dtype)
            assert torch.isnan(whole[m:] if stacked else d[chunk_m:]).all()
    if options is None or options.direct_launch:
        # generations 2 and 3 launched the compiled kernel directly, whichever it was
        assert gc.launch_counts().get("direct", 0) - before.get("direct", 0) >= 2


@pytest.mark.parametrize("chunk_m,tma", [(517, True), (512, True), (512, False)])
@pytest.mark.parametrize("sub", [1, 2])
@pytest.mark.parametrize("flatten", [False, True], ids=["nested", "flat"])
def test_epilogue_routes_and_publishes_several_generations(chunk_m, tma, sub, flatten):
    # gemm_kernel's hook (test_ws_* below: the Gluon kernel's). 512-row chunks: every tile in
    # one chunk, stored by TMA through its destination's descriptor unless epi_tma=False. 517:
    # tiles straddle two destinations, pointer stores (TMA would need a negative row coordinate).
    cfg = dataclasses.replace(BIG, EPI_SUBTILE=sub, flatten=flatten)
    _epilogue_over_generations(8 * chunk_m, 1024, 1536, chunk_m, cfg,
                               start_chunk=3, seed=0, expect_tma=chunk_m % 128 == 0 and tma,
                               options=gc.GemmOptions(gluon=False, epi_tma=tma))


ROUTE_CASES = ([("gemm_kernel", BIG, 512), ("gemm_kernel", FLAT, 517), ("gemm_kernel", FLAT, 512)]
               + ([("gemm_ws_kernel", BIG, 512)] if WS_GPU else []))


@pytest.mark.parametrize("kernel,config,chunk_m", ROUTE_CASES,
                         ids=[f"{k}-{'flat' if c.flatten else 'nested'}-{cm}" for k, c, cm in ROUTE_CASES])
def test_epilogue_without_signals_stores_what_the_signalled_hook_stores(kernel, config, chunk_m):
    # fused gemm_rs / gemm_ar's hook: no signals, so no count and no publication; the rows it
    # stores are the signalled hook's, bitwise (per-chunk TMA descriptors at 512 rows; pointer
    # stores at 517, tiles straddling two destinations, and without signals in gemm_kernel's
    # flattened loop: launch.route_tma_fallback), and nothing past a chunk is written
    m, k, n = 8 * chunk_m, 1024, 1536
    a, b, ref = _operands(m, k, n, torch.bfloat16, "weight_t", seed=4)
    got = {}
    for signalled in (True, False):
        dests = [torch.full((chunk_m + 8, n), float("nan"), device="cuda", dtype=torch.bfloat16) for _ in range(8)]
        signals = torch.zeros(8, dtype=torch.int32, device="cuda")
        spec = gc.EpilogueSpec.from_tensors(dests, signals if signalled else None, 3, chunk_m)
        options = gc.GemmOptions(gluon=kernel == "gemm_ws_kernel")
        for _ in range(2):   # the JIT launch, then the direct one
            gc.matmul(a, b, config=config, tile_order="owner", start_chunk=3, epilogue=spec, options=options)
        torch.cuda.synchronize()
        plan = gc.last_plan()
        fallback = not signalled and kernel == "gemm_kernel" and config.flatten
        assert plan.kernel == kernel and plan.epi_tma == (8 if chunk_m % 128 == 0 and not fallback else 0), \
            plan.explain()
        assert signals.tolist() == [3 if signalled else 0] * 8
        assert all(torch.isnan(d[chunk_m:]).all() for d in dests)
        got[signalled] = torch.cat([d[:chunk_m] for d in dests])
    _assert_close(got[False], ref, torch.bfloat16)
    assert torch.equal(got[False], got[True])


@pytest.mark.parametrize("chunk_m,chunks", [(512, 8), (517, 8), (96, 16)])
@pytest.mark.parametrize("sub", [1, 2])
@pytest.mark.parametrize("flatten", [False, True], ids=["nested", "flat"])
def test_epilogue_stacked_destinations_take_one_descriptor(chunk_m, chunks, sub, flatten):
    # Chunks of one tensor: one TMA descriptor over all rows, for any chunk height (517: tiles
    # straddle two chunks) and any number of chunks (16), each tile stored at its own row.
    cfg = dataclasses.replace(BIG, EPI_SUBTILE=sub, flatten=flatten)
    _epilogue_over_generations(chunks * chunk_m, 1024, 1536, chunk_m, cfg, start_chunk=3, seed=20,
                               expect_tma=True, stacked=True, options=gc.GemmOptions(gluon=False))


@pytest.mark.parametrize("count", ["auto", "after_loop", "returning"])
@pytest.mark.parametrize("config", [BIG, dataclasses.replace(BIG, num_programs=7), DEEP_PTR,
                                    dataclasses.replace(FLAT, num_programs=7),
                                    dataclasses.replace(BIG, num_programs=7, stream_k=2)],
                         ids=["big", "7_programs", "pointer_stores", "flat_7_programs", "stream_k_7_programs"])
def test_epilogue_count_modes_publish_every_chunk(count, config):
    # the count modes are gemm_kernel's (gluon=False)
    # auto: counts that return nothing, made inside the next tile's main loop in flattened
    # tile loops (EPI_COUNT=4), after it otherwise and with "after_loop" (3), a poller per chunk;
    # 7 programs run ~14 tiles each, so most chunks are published by their poller inside the
    # tile loop, the rest at the programs' ends after the handoff. With stream_k=2 the last 12 of the 96 tiles are
    # shared out by K-steps and counted by the segment that stores them.
    modes = []

    def mode():
        modes.append(gc.last_plan().epi_count)
        return True

    # tma_store=False configs keep pointer stores in the hook too: a TMA store's staging
    # buffer would not fit beside their deeper pipeline
    _epilogue_over_generations(8 * 256, 512, 1536, 256, config, start_chunk=2, seed=11, after=mode,
                               expect_tma=config.tma_store,
                               options=gc.GemmOptions(gluon=False, epi_count=count))
    assert set(modes) == {{"auto": 4 if config.flatten else 3, "after_loop": 3, "returning": 1}[count]}


def test_epilogue_with_more_chunks_than_descriptors_stores_through_pointers():
    _epilogue_over_generations(12 * 96, 512, 1024, 96, BIG, start_chunk=5, seed=3, expect_tma=False)


# The warp-specialized Gluon kernel (tpfuse/kernels/gemm_ws.py): taken for the epilogue hook on
# sm_90 where it stores by TMA (per-chunk descriptors: chunk_m a multiple of 128, at most 8
# chunks; or stacked destinations, any chunk height), whatever the order, the layout of b, the
# dtype and the tile width (its wait hook: the wait tests above).


@pytest.mark.skipif(not WS_GPU, reason="the Gluon kernel is sm_90 only")
@pytest.mark.parametrize("m,chunk_m,stacked", [(8 * 512, 512, False), (3 * 384, 384, False), (8 * 517, 517, True),
                                               (16 * 96, 96, True), (2 * 128, 128, False)])
@pytest.mark.parametrize("order,start", [("owner", 3), ("round", 1), ("grouped", 0)])
def test_ws_epilogue_routes_and_publishes_several_generations(m, chunk_m, stacked, order, start):
    # 517 / 96: tiles straddle two chunks, stored once through the stacked descriptor and
    # counted in both; 2 x 128 rows with 7 programs: most programs run one tile
    start = min(start, m // chunk_m - 1)
    _epilogue_over_generations(m, 1000, 1536, chunk_m, BIG, start_chunk=start, seed=40, stacked=stacked,
                               expect_tma=True, expect_ws=True, order=order)


@pytest.mark.skipif(not WS_GPU, reason="the Gluon kernel is sm_90 only")
@pytest.mark.parametrize("config", [BIG, dataclasses.replace(BIG, BLOCK_N=128), dataclasses.replace(BIG, num_programs=5),
                                    dataclasses.replace(BIG, stream_k=1)],
                         ids=["128x256", "128x128", "5_programs", "stream_k_config"])
@pytest.mark.parametrize("b_layout,dtype", [("weight_t", torch.bfloat16), ("row_major", torch.float16)])
def test_ws_epilogue_layouts_dtypes_and_tiles(config, b_layout, dtype):
    # K = 328: a last K-step of 8 (TMA zero-fills the rest); N = 776: a ragged last column of tiles
    _epilogue_over_generations(4 * 256, 328, 776, 256, config, start_chunk=2, seed=50, expect_tma=True,
                               expect_ws=True, b_layout=b_layout, dtype=dtype)


@pytest.mark.skipif(not WS_GPU, reason="the Gluon kernel is sm_90 only")
def test_ws_is_not_taken_with_both_hooks_or_when_switched_off():
    m, chunk_m = 4 * 256, 256
    a, b, ref = _operands(m, 256, 512, torch.bfloat16, "weight_t")
    signals = torch.zeros(4, dtype=torch.int32, device="cuda")
    # 5 spare rows each, so that the caching allocator cannot lay them out as stacked rows
    dests = [torch.empty(chunk_m + 5, 512, device="cuda", dtype=torch.bfloat16) for _ in range(4)]
    spec = gc.EpilogueSpec.from_tensors(dests, signals, 1, chunk_m)
    wait = gc.WaitSpec(torch.ones(4, dtype=torch.int32, device="cuda"), 1, chunk_m)
    gc.matmul(a, b, config=BIG, tile_order="owner", epilogue=spec, wait=wait)
    plan = gc.last_plan()
    assert plan.kernel == "gemm_kernel" and "both hooks" in plan.explain() and signals.tolist() == [1] * 4
    gc.matmul(a, b, config=BIG, tile_order="owner", epilogue=spec.with_generation(2),
              options=gc.GemmOptions(gluon=False))
    plan = gc.last_plan()
    assert plan.kernel == "gemm_kernel" and "gluon=False" in plan.explain()
    assert plan.epi_tma == 4 and signals.tolist() == [2] * 4
    _assert_close(torch.cat([d[:chunk_m] for d in dests]), ref, torch.bfloat16)


@pytest.mark.parametrize("direct", [True, False], ids=["direct", "jit"])
def test_repeated_calls_reuse_the_compiled_kernel(direct):
    # One compile per shape; with direct launches on, every later call of the shape calls the
    # compiled kernel directly. Fails if the direct path stops being taken -- also when the
    # library's own fallback (a failed direct launch turns them off) kicked in.
    options = gc.GemmOptions(direct_launch=direct)
    out = torch.full((1000, 640), float("nan"), device="cuda", dtype=torch.bfloat16)
    before = gc.launch_counts()
    for seed in range(3):
        a, b, ref = _operands(1000, 512, 640, torch.bfloat16, "weight_t", seed=seed)
        out.fill_(float("nan"))
        gc.matmul(a, b, out=out, config=BIG, options=options)
        _assert_close(out, ref, torch.bfloat16)
        a2, b2, ref2 = a[:999], b, ref[:999]      # another shape in between
        _assert_close(gc.matmul(a2, b2, config=SMALL, options=options), ref2, torch.bfloat16)
    after = gc.launch_counts()
    delta = {key: after.get(key, 0) - before.get(key, 0) for key in ("jit", "direct", "compiled")}
    assert delta["compiled"] <= 2, delta             # at most one compile per shape (0: compiled earlier)
    assert delta["jit"] + delta["direct"] == 6, delta
    if direct:   # the first call of each shape may already find it compiled by an earlier test
        assert delta["direct"] >= 4, delta
    else:
        assert delta["direct"] == 0, delta


def test_tune_writes_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("TPFUSE_CACHE_DIR", str(tmp_path))
    a, b, ref = _operands(512, 512, 512, torch.bfloat16, "weight_t")
    configs = [SMALL, gc.GemmConfig(BLOCK_M=128, BLOCK_N=128, BLOCK_K=64)]
    best, timings = gc.tune(a, b, configs=configs, rep_ms=5, chunks=4)
    assert len(timings) == 2 and (tmp_path / "gemm_core.json").exists()
    assert cache.lookup(512, 512, 512, torch.bfloat16, True, a.device) == best
    # and per hook, the leader fastest with it, which hooked calls of the shape then take
    entries = json.loads((tmp_path / "gemm_core.json").read_text())
    hooked = {key.rsplit("|hook=", 1)[1]: e for key, e in entries.items() if "|hook=" in key}
    assert sorted(hooked) == ["epilogue", "wait"] and all(e["chunks"] == 4 for e in hooked.values())
    for hook, entry in hooked.items():
        assert gc.GemmConfig.from_dict(entry["config"]) in configs
        assert cache.lookup(512, 512, 512, torch.bfloat16, True, a.device, hook) == gc.GemmConfig.from_dict(entry["config"])
    sig = torch.ones(4, dtype=torch.int32, device="cuda")
    out = gc.matmul(a, b, tile_order="round", wait=gc.WaitSpec(sig, 1, 128))
    assert gc.last_plan().config_source == "tuning cache (wait hook)"
    _assert_close(out, ref, torch.bfloat16)
    # a tuning without hooks leaves no entry of an earlier one's behind
    gc.tune(a, b, configs=configs, rep_ms=5, hooks=())
    assert not any("|hook=" in key for key in json.loads((tmp_path / "gemm_core.json").read_text()))
    gc.matmul(a, b, tile_order="round", wait=gc.WaitSpec(sig, 1, 128))
    assert gc.last_plan().config_source == "tuning cache"


@pytest.mark.skipif(not HOPPER, reason="TMA needs sm_90+")
def test_misaligned_view_after_an_aligned_call_takes_the_pointer_path():
    # Same shape and strides as a cached TMA plan, but the base is 2 bytes off 16-byte alignment:
    # the call must not reuse the TMA plan (TMA needs aligned bases).
    m, k, n = 256, 512, 384
    a, b, ref = _operands(m, k, n, torch.bfloat16, "weight_t", seed=20)
    gc.matmul(a, b)
    store = torch.empty(m * k + 1, device="cuda", dtype=torch.bfloat16)
    a_odd = store[1:].view(m, k)
    a_odd.copy_(a)
    assert a_odd.stride() == a.stride() and a_odd.data_ptr() % 16 != 0
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")   # "plain-pointer path instead of TMA" (once per process)
        out = gc.matmul(a_odd, b)
    _assert_close(out, ref, torch.bfloat16)


# ---- stream-K ------------------------------------------------------------------------------
SK_128 = gc.GemmConfig(BLOCK_M=128, BLOCK_N=128, BLOCK_K=128, num_warps=8, num_stages=3)
SK_256 = gc.GemmConfig(BLOCK_M=128, BLOCK_N=256, BLOCK_K=64, num_warps=8, num_stages=3, EPI_SUBTILE=2)


def _tile_counters_are_zero():
    torch.cuda.synchronize()
    return all(int(c.abs().sum()) == 0 for _, c in launch._STREAM_K_BUFFERS.values())


# (509, 3000, 1000): 16-byte aligned rows -> TMA on Hopper; K = 3000 is 23.4 steps of 128.
# (128, 4091, 771): misaligned rows -> plain-pointer path.
def _calls_in_a_row(m, k, n, dtype, b_layout, cfg, seeds):
    """One call per seed, each checked against the reference with the tile counters back at
    zero after it; returns the last call's (a, b, out)."""
    for seed in seeds:
        a, b, ref = _operands(m, k, n, dtype, b_layout, seed=seed)
        out = torch.full((m, n), float("nan"), device="cuda", dtype=dtype)
        gc.matmul(a, b, out=out, config=cfg)
        _assert_close(out, ref, dtype)
        assert _tile_counters_are_zero()
    return a, b, out


def _k_shared_epilogue(config, tma, seed):
    """Epilogue hook over generations with tiles whose K is shared out (stream-K):
    128-row chunks take TMA stores (unless epi_tma=False), 131-row ones pointer stores.
    gluon=False: stream-K's shared tiles are gemm_kernel's."""
    chunk_m = 128 if tma else 131
    _epilogue_over_generations(4 * chunk_m, 2048, 1536, chunk_m, config, start_chunk=1, seed=seed,
                               after=_tile_counters_are_zero, expect_tma=tma,
                               options=gc.GemmOptions(epi_tma=tma, gluon=False))


def _k_shared_wait(config, seed):
    """Wait hook with signals pre-set (all >= generation 4) on tiles whose K is shared out."""
    a, b, ref = _operands(4 * 131, 2048, 1536, torch.bfloat16, "weight_t", seed=seed)
    signal = torch.tensor([4, 9, 4, 5], dtype=torch.int32, device="cuda")
    out = torch.full((4 * 131, 1536), float("nan"), device="cuda", dtype=torch.bfloat16)
    gc.matmul(a, b, out=out, config=config, tile_order="round", start_chunk=2,
              wait=gc.WaitSpec(signal, 4, 131, timeout_ns=2_000_000_000))
    _assert_close(out, ref, torch.bfloat16)


# (shape, config): all tiles shared out (under one wave), the last partial wave only (mode 1),
# it and one full wave (mode 2), the plain-pointer path, a decode-sized tile.
@pytest.mark.parametrize("mode,base,shape,b_layout,dtype", [
    (1, SK_128, (509, 3000, 1000), "weight_t", torch.bfloat16),      # 32 tiles < SMs: all shared
    (1, SK_256, (2048, 4096, 7168), "weight_t", torch.bfloat16),     # 448 tiles: 52 shared out
    (2, SK_256, (2048, 4096, 7168), "row_major", torch.float16),     # 184 shared out
    (1, SK_128, (128, 4091, 771), "row_major", torch.bfloat16),      # plain pointers
    (1, gc.GemmConfig(BLOCK_M=64, BLOCK_N=64, BLOCK_K=256, num_warps=4, num_stages=3),
     (128, 4096, 3584), "weight_t", torch.bfloat16),                 # decode-like: 112 tiles
], ids=["all-128-tma", "mode1-256", "mode2-256-row-fp16", "ptr-128", "decode-64"])
def test_stream_k_matches_reference(mode, base, shape, b_layout, dtype):
    m, k, n = shape
    cfg = dataclasses.replace(base, stream_k=mode)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    assert gc.stream_k_tiles(-(-m // cfg.BLOCK_M) * -(-n // cfg.BLOCK_N), sms, mode) > 0
    a, b, out = _calls_in_a_row(m, k, n, dtype, b_layout, cfg, seeds=(16, 17))
    for _ in range(20):   # segments finish in another order on every run; the sum's order is fixed
        again = torch.full((m, n), float("nan"), device="cuda", dtype=dtype)
        gc.matmul(a, b, out=again, config=cfg)
        torch.cuda.synchronize()
        assert torch.equal(again, out), "stream-K result changed between identical calls"


@pytest.mark.parametrize("tma", [True, False], ids=["tma", "pointers"])
@pytest.mark.parametrize("flatten", [False, True], ids=["nested", "flat"])
def test_stream_k_with_epilogue_hook_several_generations(tma, flatten):
    _k_shared_epilogue(dataclasses.replace(SK_256, stream_k=1, flatten=flatten), tma, 18)


def test_stream_k_with_wait_hook_signals_preset():
    _k_shared_wait(dataclasses.replace(SK_128, stream_k=1), seed=19)


def test_tune_skips_a_config_that_does_not_compile(tmp_path, monkeypatch):
    monkeypatch.setenv("TPFUSE_CACHE_DIR", str(tmp_path))
    a, b, _ = _operands(256, 1024, 512, torch.bfloat16, "weight_t", seed=15)
    too_big = gc.GemmConfig(BLOCK_M=128, BLOCK_N=256, BLOCK_K=128, num_stages=8)   # 768 KiB of smem
    with pytest.warns(UserWarning, match="skipping config"):
        best, timings = gc.tune(a, b, configs=[too_big, SMALL], rep_ms=5)
    assert best == SMALL and [c for c, _ in timings] == [SMALL]


# ---- per-tile timeline (matmul(tile_records=...)) --------------------------------------------
# (kernel, config, hook): gemm_kernel nested, flattened and with stream-K, with and without each
# hook; on sm_90 the Gluon kernel with each hook (its load warp reads start and wait done, its
# store warp end)
RECORDS = ([("gemm_kernel", c, h) for c in (BIG, FLAT) for h in ("none", "wait", "epilogue")]
           + [("gemm_kernel", dataclasses.replace(BIG, stream_k=1), "none")]
           + ([("gemm_ws_kernel", BIG, h) for h in ("wait", "epilogue")] if WS_GPU else []))
RECORD_IDS = [f"{k}-{'sk' if c.stream_k else 'flat' if c.flatten else 'nested'}-{h}" for k, c, h in RECORDS]


def _check_tile_records(rec, plan, waited):
    """Each of the plan's tiles has its row, written by a program of the grid on an SM of this
    GPU, with %globaltimer times start <= wait done (= start without a wait hook) <= end; rows
    past the grid left at -1."""
    torch.cuda.synchronize()
    rows = rec[:plan.num_tiles].cpu()
    assert rows[:, abi.REC_TILE].tolist() == list(range(plan.num_tiles)), "a tile without its row"
    assert (rec[plan.num_tiles:] == -1).all()
    program, sm = rows[:, abi.REC_PROGRAM], rows[:, abi.REC_SM]
    assert ((program >= 0) & (program < plan.programs)).all()
    assert ((sm >= 0) & (sm < torch.cuda.get_device_properties(0).multi_processor_count)).all()
    start, wait, end = rows[:, abi.REC_START_NS], rows[:, abi.REC_WAIT_NS], rows[:, abi.REC_END_NS]
    assert (start > 0).all() and ((start <= wait) & (wait <= end)).all()
    assert waited or (wait == start).all()
    assert end.max() - start.min() < 1_000_000_000, "one launch's tiles spread over more than a second"
    if plan.kernel == "gemm_kernel" and not plan.config.flatten and not plan.sk_tiles:
        for p in program.unique().tolist():   # a program runs its tiles one after the other
            s, e = start[program == p].sort()[0], end[program == p].sort()[0]
            assert (e[:-1] <= s[1:]).all(), f"program {p}: a tile started before the previous one ended"


@pytest.mark.parametrize("kernel,config,hook", RECORDS, ids=RECORD_IDS)
def test_tile_records_on_gpu(kernel, config, hook):
    m, k, n, chunk_m = 8 * 512, 1024, 1536, 512
    a, b, ref = _operands(m, k, n, torch.bfloat16, "weight_t", seed=70)
    options = gc.GemmOptions(gluon=kernel == "gemm_ws_kernel")
    signal = torch.full((8,), 4, dtype=torch.int32, device="cuda")
    whole = torch.full((m, n), float("nan"), device="cuda", dtype=torch.bfloat16)
    signals = torch.zeros(8, dtype=torch.int32, device="cuda")

    def call(generation, records):
        kw = dict(config=config, options=options, tile_records=records)
        if hook == "wait":
            out = torch.full((m, n), float("nan"), device="cuda", dtype=torch.bfloat16)
            gc.matmul(a, b, out=out, tile_order="round", start_chunk=2,
                      wait=gc.WaitSpec(signal, 4, chunk_m, timeout_ns=2_000_000_000), **kw)
            return out
        if hook == "epilogue":
            whole.fill_(float("nan"))
            dests = [whole[c * chunk_m:(c + 1) * chunk_m] for c in range(8)]
            gc.matmul(a, b, tile_order="owner", start_chunk=3, **kw,
                      epilogue=gc.EpilogueSpec.from_tensors(dests, signals, generation, chunk_m))
            torch.cuda.synchronize()
            assert signals.tolist() == [generation] * 8
            return whole.clone()
        out = torch.full((m, n), float("nan"), device="cuda", dtype=torch.bfloat16)
        return gc.matmul(a, b, out=out, **kw)

    plain = call(1, None)
    assert gc.last_plan().kernel == kernel and not gc.last_plan().record_tiles, gc.last_plan().explain()
    _assert_close(plain, ref, torch.bfloat16)
    rec = gc.tile_records_for(m, n, config, device="cuda")
    before = gc.launch_counts()
    for generation in (2, 3):   # the JIT launch, then the direct one
        rec.fill_(-1)
        out = call(generation, rec)
        plan = gc.last_plan()
        assert plan.kernel == kernel and plan.record_tiles and bool(plan.sk_tiles) == bool(config.stream_k)
        torch.cuda.synchronize()
        assert torch.equal(out, plain), "the records changed the result"
        _check_tile_records(rec, plan, waited=hook == "wait")
    assert gc.launch_counts().get("direct", 0) > before.get("direct", 0)


# ---- fp8 against torch._scaled_mm (cuBLASLt) ----------------------------------------------------
E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
FP8 = torch.cuda.is_available() and torch.cuda.get_device_capability() >= (8, 9)
FP8_BIG = gc.GemmConfig(BLOCK_M=128, BLOCK_N=256, BLOCK_K=128, num_warps=8, num_stages=3)
FP8_NARROW = gc.GemmConfig(BLOCK_M=128, BLOCK_N=128, BLOCK_K=128, num_warps=8, num_stages=5, EPI_SUBTILE=2)


def _fp8_operands(m, k, n, a_dtype, b_dtype, mode, seed=0):
    return fp8_operands(m, n, k, mode, a_dtype, b_dtype, seed)   # tests/gpu/_fp8_inputs.py


def _scaled_mm(a, b, sa, sb, out_dtype):
    return torch._scaled_mm(a, b, scale_a=sa, scale_b=sb, out_dtype=out_dtype)


def _fp8_close(ours, theirs, a, b, sa, sb):
    """Both within 2 output roundings of the float64 product of the dequantized inputs."""
    torch.cuda.synchronize()
    ref = (a.double() * sa.double()) @ (b.double() * sb.double())
    eps = torch.finfo(ours.dtype).eps if ours.dtype != torch.float32 else 1e-5
    for name, got in (("ours", ours), ("torch._scaled_mm", theirs)):
        assert not torch.isnan(got).any(), name
        err = ((got.double() - ref).norm() / ref.norm()).item()
        assert err <= 2 * eps, f"{name}: relative error {err:.3g}"


@pytest.mark.skipif(not FP8, reason="fp8 MMAs need compute capability 8.9+")
@pytest.mark.parametrize("mode", ["tensor", "row"])
@pytest.mark.parametrize("shape", [(37 * 4, 1008, 784), (2048, 4096, 3584), (128, 3584, 4096)],
                         ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("config", [None, FP8_BIG, FP8_NARROW], ids=["default", "128x256x128", "128x128x128_sub2"])
def test_fp8_against_scaled_mm(mode, shape, config):
    m, k, n = shape
    a, b, sa, sb = _fp8_operands(m, k, n, E4M3, E4M3, mode)
    out = torch.full((m, n), float("nan"), device="cuda", dtype=torch.bfloat16)
    gc.matmul(a, b, out=out, config=config, scale_a=sa, scale_b=sb)
    plan = gc.last_plan()
    assert plan.kernel == "gemm_kernel" and plan.use_tma == HOPPER, plan.explain()
    _fp8_close(out, _scaled_mm(a, b, sa, sb, torch.bfloat16), a, b, sa, sb)


@pytest.mark.skipif(not (FP8 and HOPPER), reason="fp8 with TMA: sm_90")
def test_fp8_float32_out_fits_a_cached_config_tuned_for_bf16(tmp_path, monkeypatch):
    # 6 stages of fp8 128x128x128 fit beside a bf16 staging tile (224 KiB), not beside a float32
    # one (256 KiB): the cached config stores in two column halves (config.fit_shared_memory),
    # bitwise as that config passed in does
    monkeypatch.setenv("TPFUSE_CACHE_DIR", str(tmp_path))
    m, k, n = 512, 4096, 1024
    a, b, sa, sb = _fp8_operands(m, k, n, E4M3, E4M3, "row")
    six = gc.GemmConfig(BLOCK_M=128, BLOCK_N=128, BLOCK_K=128, num_warps=8, num_stages=6)
    cache.store(m, n, k, E4M3, True, a.device, six, 1.0)
    launch.clear_plans()
    try:
        out = gc.matmul(a, b, scale_a=sa, scale_b=sb, out_dtype=torch.float32)
        plan = gc.last_plan()
        halves = dataclasses.replace(six, EPI_SUBTILE=2)
        assert plan.config_source == "tuning cache" and plan.config == halves, plan.explain()
        assert any("EPI_SUBTILE 1 -> 2, num_stages 6 -> 6" in r for r in plan.reasons), plan.reasons
        given = gc.matmul(a, b, config=halves, scale_a=sa, scale_b=sb, out_dtype=torch.float32)
        torch.cuda.synchronize()
        assert torch.equal(out, given)
        # the heuristic's 128x256x128 with 3 stages (272 KiB with a float32 tile) too
        m2, k2, n2 = 2048, 1024, 4096
        a2, b2, sa2, sb2 = _fp8_operands(m2, k2, n2, E4M3, E4M3, "tensor")
        got = gc.matmul(a2, b2, scale_a=sa2, scale_b=sb2, out_dtype=torch.float32)
        plan2 = gc.last_plan()
        assert plan2.config_source.startswith("heuristic") and plan2.config.EPI_SUBTILE == 2, plan2.explain()
        want = gc.matmul(a2, b2, config=plan2.config, scale_a=sa2, scale_b=sb2, out_dtype=torch.float32)
        torch.cuda.synchronize()
        assert torch.equal(got, want)
        gc.matmul(a, b, scale_a=sa, scale_b=sb)   # bf16 out: the cached config as it is
        assert gc.last_plan().config == six, gc.last_plan().explain()
    finally:
        launch.clear_plans()


@pytest.mark.skipif(not FP8, reason="fp8 MMAs need compute capability 8.9+")
@pytest.mark.parametrize("a_dtype,b_dtype,out_dtype", [
    # float32 out: 2.7e-4 relative error on the H200 (2026-12-02) against a bound of 2e-5: the
    # core's fp8 dot accumulates in the tensor core across K (Triton's sm_90 default
    # max_num_imprecise_acc, cuBLASLt's use_fast_accum=True), cuBLASLt's default promotes to fp32
    pytest.param(E4M3, E5M2, torch.float32, marks=pytest.mark.xfail(
        strict=True, reason="fp8 products accumulate in fast (tensor-core) precision; docs/gemm_core.md")),
    (E5M2, E4M3, torch.float16)])
def test_fp8_mixes_and_out_dtypes(a_dtype, b_dtype, out_dtype):
    a, b, sa, sb = _fp8_operands(1024, 512, 768, a_dtype, b_dtype, "tensor", seed=1)
    out = gc.matmul(a, b, config=FP8_NARROW, scale_a=sa, scale_b=sb, out_dtype=out_dtype)
    assert out.dtype == out_dtype
    _fp8_close(out, _scaled_mm(a, b, sa, sb, out_dtype), a, b, sa, sb)


@pytest.mark.skipif(not FP8, reason="fp8 MMAs need compute capability 8.9+")
def test_fp8_stream_k_and_hooks_match_the_plain_call_bitwise():
    # stream-K sums and scales per subtile from the workspace; the wait hook's gathered rows
    # take their scales by global row; the epilogue hook stores scaled rows to each chunk's
    # destination. Hooks change neither sums nor scaling: bitwise the plain call, in
    # gemm_hooked_kernel (gluon=False) and, on sm_90, in the Gluon kernel (gemm_ws_kernel:
    # the same wgmma K-steps in the same order, the scales applied in gemm.py's order).
    m, k, n, chunk_m = 1024, 2048, 1024, 256
    a, b, sa, sb = _fp8_operands(m, k, n, E4M3, E4M3, "row", seed=2)
    sk = dataclasses.replace(FP8_NARROW, num_programs=7, stream_k=2)
    out = gc.matmul(a, b, config=sk, scale_a=sa, scale_b=sb)
    assert gc.last_plan().sk_tiles > 0
    _fp8_close(out, _scaled_mm(a, b, sa, sb, torch.bfloat16), a, b, sa, sb)
    plain = gc.matmul(a, b, config=FP8_BIG, scale_a=sa, scale_b=sb)
    for gluon in (False, True):
        options = gc.GemmOptions(gluon=gluon)
        kernel = "gemm_ws_kernel" if gluon and WS_GPU else "gemm_hooked_kernel"
        signal = torch.full((m // chunk_m,), 5, dtype=torch.int32, device="cuda")
        # the wait hook: a gemm_kernel config passed in keeps it in gemm_kernel (ws_choice:
        # the kernel the config was timed in); a Gluon config's runs the Gluon kernel
        wait_cfg = dataclasses.replace(FP8_BIG, gluon=gluon and WS_GPU)
        waited = gc.matmul(a, b, config=wait_cfg, tile_order="round", start_chunk=2, scale_a=sa, scale_b=sb,
                           wait=gc.WaitSpec(signal, generation=5, chunk_m=chunk_m, timeout_ns=10**9), options=options)
        assert gc.last_plan().variant == kernel, gc.last_plan().explain()
        if gluon and WS_GPU:
            gc.matmul(a, b, config=FP8_BIG, tile_order="round", start_chunk=2, scale_a=sa, scale_b=sb,
                      wait=gc.WaitSpec(signal, generation=5, chunk_m=chunk_m, timeout_ns=10**9), options=options)
            assert gc.last_plan().variant == "gemm_hooked_kernel" and "timed in" in gc.last_plan().explain()
        dests = torch.full((m, n), float("nan"), dtype=torch.bfloat16, device="cuda")
        signals = torch.zeros(m // chunk_m, dtype=torch.int32, device="cuda")
        spec = gc.EpilogueSpec.from_tensors(list(dests.split(chunk_m)), signals, 1, chunk_m)
        gc.matmul(a, b, config=FP8_BIG, tile_order="owner", start_chunk=1, epilogue=spec, scale_a=sa, scale_b=sb,
                  options=options)
        assert gc.last_plan().variant == kernel, gc.last_plan().explain()
        torch.cuda.synchronize()
        assert torch.equal(waited, plain) and torch.equal(dests, plain) and signals.tolist() == [1] * 4, kernel


@pytest.mark.skipif(not WS_GPU, reason="the Gluon kernel is sm_90's")
@pytest.mark.parametrize("mode", ["tensor", "row"])
@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_fp8_gluon_epilogue_hook_per_chunk_matches_the_plain_call_bitwise(mode, out_dtype):
    # gemm_rs's case: fp8 into float32 partials, one destination per chunk (per-chunk TMA
    # descriptors), the Gluon kernel's store warp counting and publishing; float32 takes
    # 128-wide tiles (ws_choice). Bitwise the plain call's 128x256 tiles (K-steps of 128 both).
    m, k, n, chunk_m = 1024, 2048, 1024, 256
    a, b, sa, sb = _fp8_operands(m, k, n, E4M3, E4M3, mode, seed=5)
    # the plain call: 128x256 tiles; a float32 one's staging buffer leaves shared memory for 2 stages
    plain_cfg = FP8_BIG if out_dtype != torch.float32 else dataclasses.replace(FP8_BIG, num_stages=2)
    plain = gc.matmul(a, b, config=plain_cfg, scale_a=sa, scale_b=sb, out_dtype=out_dtype)
    assert not torch.isnan(plain).any()   # its accuracy: test_fp8_against_scaled_mm, test_fp8_mixes_and_out_dtypes
    # separate destinations 8 rows apart: not one stacked block (which would take one descriptor)
    gapped = torch.empty((m // chunk_m * (chunk_m + 8), n), dtype=out_dtype, device="cuda")
    dests = [gapped[q * (chunk_m + 8):q * (chunk_m + 8) + chunk_m] for q in range(m // chunk_m)]
    signals = torch.zeros(m // chunk_m, dtype=torch.int32, device="cuda")
    for generation in (1, 2):   # the JIT launch, then the direct one
        for d in dests:
            d.fill_(float("nan"))
        spec = gc.EpilogueSpec.from_tensors(dests, signals, generation, chunk_m)
        gc.matmul(a, b, config=FP8_BIG, tile_order="owner", start_chunk=1, epilogue=spec, scale_a=sa, scale_b=sb,
                  out_dtype=out_dtype)
        plan = gc.last_plan()
        assert plan.kernel == "gemm_ws_kernel" and plan.epi_tma == m // chunk_m, plan.explain()
        # float32 needs 128-wide tiles (shared memory); bf16 takes them where they fill the waves better
        assert plan.tile_shape == (128, 128) or out_dtype != torch.float32 and plan.tile_shape == (128, 256), \
            plan.explain()
        torch.cuda.synchronize()
        assert signals.tolist() == [generation] * (m // chunk_m)
        assert torch.equal(torch.cat(dests), plain)


@pytest.mark.skipif(not WS_GPU, reason="the Gluon kernel is sm_90's")
@pytest.mark.parametrize("mode", ["tensor", "row"])
@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("shape", [(1000, 1024, 784), (4096, 1792, 4096)], ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("bn", [128, 256])
def test_fp8_plain_gluon_config_matches_gemm_kernel_bitwise(mode, out_dtype, shape, bn):
    # GemmConfig(gluon=True): a plain fp8 call in the Gluon kernel (no hook), the tuner's choice
    # where it times faster. The same wgmma K-steps and scale order as gemm_kernel on the same
    # tiles: bitwise its result (float32 out: 128-wide tiles in both). Twice: the JIT launch,
    # then the direct one. (N = 784: fp8 wants N a multiple of 16. The accuracy against float64
    # is gemm_kernel's, tested above; a float32 output's is the known fast-accumulation bound,
    # the strict xfail of test_fp8_mixes_and_out_dtypes.)
    m, k, n = shape
    a, b, sa, sb = _fp8_operands(m, k, n, E4M3, E4M3, mode, seed=7)
    width = 128 if out_dtype == torch.float32 else bn
    base = gc.GemmConfig(BLOCK_M=128, BLOCK_N=width, BLOCK_K=128, num_warps=8, num_stages=3 if width == 256 else 5)
    if out_dtype == torch.float32:
        base = dataclasses.replace(base, num_stages=3)
    plain = gc.matmul(a, b, config=base, scale_a=sa, scale_b=sb, out_dtype=out_dtype)
    assert gc.last_plan().kernel == "gemm_kernel", gc.last_plan().explain()
    gluon = gc.GemmConfig(BLOCK_M=128, BLOCK_N=bn, BLOCK_K=128, num_warps=8,
                          num_stages=GLUON_STAGES[bn], gluon=True)
    for _ in range(2):
        out = torch.full((m, n), float("nan"), device="cuda", dtype=out_dtype)
        gc.matmul(a, b, out=out, config=gluon, scale_a=sa, scale_b=sb, out_dtype=out_dtype)
        plan = gc.last_plan()
        assert plan.kernel == "gemm_ws_kernel" and plan.tile_shape == (128, width), plan.explain()
        torch.cuda.synchronize()
        assert torch.equal(out, plain)
    if out_dtype != torch.float32:
        _fp8_close(out, _scaled_mm(a, b, sa, sb, out_dtype), a, b, sa, sb)


@pytest.mark.skipif(not FP8, reason="fp8 MMAs need compute capability 8.9+")
def test_fp8_sizes_off_the_tensor_core_multiple_raise_with_the_fix():
    a, b, sa, sb = _fp8_operands(64, 1000, 776, E4M3, E4M3, "tensor")   # K = 1000: not a multiple of 16
    with pytest.raises(ValueError, match="multiples of 16.*pad"):
        gc.matmul(a, b, scale_a=sa, scale_b=sb)
