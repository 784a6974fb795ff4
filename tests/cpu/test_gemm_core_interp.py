"""GEMM core under TRITON_INTERPRET=1: index math, masks, tile orders, hooks, error word,
stream-K, the SM budget.

Every output is poisoned with NaN first; results are compared with a float64 reference of the
same (rounded) inputs, within 3x torch.matmul's own error in that dtype (tpfuse/testing.py). Small blocks
(16x16x16) and 4 persistent programs keep the interpreter quick and make every program loop
over several tiles.
"""
import os

_PREV_INTERPRET = os.environ.get("TRITON_INTERPRET")
os.environ["TRITON_INTERPRET"] = "1"   # before any triton import: kernels are decorated lazily

import dataclasses  # noqa: E402
import inspect  # noqa: E402
import json  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

pytest.importorskip("triton", reason="triton is not installed; the interpreter tests need it")

import tpfuse.kernels  # noqa: E402
from tpfuse import gemm as gc  # noqa: E402
from tpfuse import testing  # noqa: E402
from tpfuse.gemm import device, launch  # noqa: E402
from tpfuse.kernels import abi  # noqa: E402

CFG = gc.GemmConfig(BLOCK_M=16, BLOCK_N=16, BLOCK_K=16, GROUP_M=2, num_warps=4, num_stages=1)
# relative Frobenius error allowed: ~3x the output rounding of each dtype


def _purge_kernels():
    # and the package's attributes: ``from ..kernels import gemm`` (triton_modules) takes them
    # over sys.modules
    for name in ("tpfuse.kernels.gemm", "tpfuse.kernels.signals", "tpfuse.kernels.tile_records"):
        sys.modules.pop(name, None)
        vars(tpfuse.kernels).pop(name.rpartition(".")[2], None)
    device.triton_modules.cache_clear()


@pytest.fixture(scope="module", autouse=True)
def _interpreter():
    # Kernels decorated before this module (or by a later GPU module) must not leak across.
    os.environ["TRITON_INTERPRET"] = "1"
    _purge_kernels()
    yield
    if _PREV_INTERPRET is None:
        os.environ.pop("TRITON_INTERPRET", None)
    else:
        os.environ["TRITON_INTERPRET"] = _PREV_INTERPRET
    _purge_kernels()


def _operands(m, k, n, dtype, b_layout, seed=0):
    g = torch.Generator().manual_seed(seed)
    a = torch.randn(m, k, generator=g).to(dtype)
    if b_layout == "weight_t":
        b = torch.randn(n, k, generator=g).to(dtype).t()      # column-major view, no copy
    else:
        b = torch.randn(k, n, generator=g).to(dtype)
    return a, b, testing.Reference.of(a, b)


def _assert_close(out, ref, dtype):
    """Frobenius error against the float64 reference within 3x torch.matmul's own in ``dtype``
    (tpfuse/testing.py); NaN (poison never overwritten) and Inf fail."""
    testing.assert_close(out, ref, dtype=dtype, norm="fro")


@pytest.mark.parametrize("shape", [(37, 53, 29), (130, 70, 65)], ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("b_layout", ["row_major", "weight_t"])
def test_matmul_odd_shapes_bf16(shape, b_layout):
    m, k, n = shape
    a, b, ref = _operands(m, k, n, torch.bfloat16, b_layout)
    out = torch.full((m, n), float("nan"), dtype=torch.bfloat16)
    assert gc.matmul(a, b, out=out, config=CFG) is out
    _assert_close(out, ref, torch.bfloat16)


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_matmul_other_dtypes(dtype):
    a, b, ref = _operands(37, 53, 29, dtype, "weight_t", seed=1)
    out = torch.full((37, 29), float("nan"), dtype=dtype)
    gc.matmul(a, b, out=out, config=CFG)
    _assert_close(out, ref, dtype)


@pytest.mark.parametrize("order,start", [("grouped", 0), ("round", 2), ("owner", 3)])
def test_tile_orders_compute_every_tile(order, start):
    # chunk_m = 33 is no multiple of BLOCK_M: tiles straddle chunks.
    a, b, ref = _operands(130, 70, 65, torch.bfloat16, "weight_t", seed=2)
    out = torch.full((130, 65), float("nan"), dtype=torch.bfloat16)
    gc.matmul(a, b, out=out, config=CFG, tile_order=order,
              chunk_m=None if order == "grouped" else 33, start_chunk=start)
    _assert_close(out, ref, torch.bfloat16)


def _tile_counters():
    """Tile counters of every stream-K buffer pair in use (all must be zero between calls)."""
    return [c for _, c in launch._STREAM_K_BUFFERS.values()]


def _calls_in_a_row(cfg, m, k, n, dtype, b_layout, seeds):
    """One call per seed with fresh operands, each checked against float64 and leaving every
    tile counter at zero (stream-K resets them itself); returns the last
    call's (a, b, out)."""
    for seed in seeds:
        a, b, ref = _operands(m, k, n, dtype, b_layout, seed=seed)
        out = torch.full((m, n), float("nan"), dtype=dtype)
        assert gc.matmul(a, b, out=out, config=cfg) is out
        _assert_close(out, ref, dtype)
        assert all((c == 0).all() for c in _tile_counters()), "a tile counter was left non-zero"
    return a, b, out


# ---- stream-K ---------------------------------------------------------------------------------
@pytest.mark.parametrize("shape,programs,mode,sub,b_layout,dtype", [
    ((37, 70, 29), 5, 1, 1, "row_major", torch.bfloat16),    # 6 tiles, 5 programs: 1 tile shared out
    ((50, 100, 33), 7, 2, 1, "weight_t", torch.float16),     # 12 tiles < 7 * 2: all shared out
    ((45, 130, 27), 4, 1, 2, "weight_t", torch.bfloat16),    # 3 tiles on 4 programs, 2 subtiles
    ((64, 40, 64), 5, 1, 1, "row_major", torch.bfloat16),    # 3 steps on 5 programs: empty runs
    ((100, 160, 40), 4, 2, 1, "weight_t", torch.float16),    # 21 tiles: 16 whole, 5 shared out
    ((16, 300, 16), 6, 1, 1, "row_major", torch.bfloat16),   # one tile, 19 steps over 6 programs
], ids=["one-sk-tile", "all-sk-fp16", "sub2", "empty-runs", "hybrid-mode2", "one-tile-deep-k"])
def test_stream_k_matches_reference(shape, programs, mode, sub, b_layout, dtype):
    m, k, n = shape
    cfg = gc.GemmConfig(BLOCK_M=16, BLOCK_N=16 * sub, BLOCK_K=16, GROUP_M=2, num_warps=4,
                        num_stages=1, EPI_SUBTILE=sub, num_programs=programs, stream_k=mode)
    tiles = -(-m // 16) * -(-n // (16 * sub))
    assert gc.stream_k_tiles(tiles, programs, mode) > 0, "the case must exercise stream-K"
    a, b, out = _calls_in_a_row(cfg, m, k, n, dtype, b_layout, seeds=(30, 31))
    again = torch.full((m, n), float("nan"), dtype=dtype)
    gc.matmul(a, b, out=again, config=cfg)
    assert torch.equal(again, out), "stream-K result changed between identical calls"


def test_stream_k_tiles_rule():
    assert gc.stream_k_tiles(112, 132, 1) == 112          # under one wave: every tile
    assert gc.stream_k_tiles(264, 132, 1) == 0            # whole waves: nothing to share
    assert gc.stream_k_tiles(448, 132, 1) == 448 % 132    # the last partial wave
    assert gc.stream_k_tiles(448, 132, 2) == 448 % 132 + 132
    assert gc.stream_k_tiles(448, 132, 0) == 0
    with pytest.raises(ValueError, match="stream_k=3"):
        gc.GemmConfig(stream_k=3)


def test_stream_k_with_hooks():
    # wait hook, round order: every tile waits for its rows' chunks (signals pre-set)
    a, b, ref = _operands(100, 75, 40, torch.bfloat16, "weight_t", seed=32)
    signal = torch.tensor([5, 6, 5, 5], dtype=torch.int32)
    out = torch.full((100, 40), float("nan"), dtype=torch.bfloat16)
    cfg = dataclasses.replace(CFG, num_programs=5, stream_k=1)   # 21 tiles on 5: 1 shared out
    gc.matmul(a, b, out=out, config=cfg, tile_order="round", start_chunk=2,
              wait=gc.WaitSpec(signal, generation=5, chunk_m=27, max_spins=10))
    _assert_close(out, ref, torch.bfloat16)
    # epilogue hook, owner order, all tiles shared out: chunks routed and published, twice
    _epilogue_over_generations(100, 40, 45, 27, dataclasses.replace(CFG, num_programs=29, stream_k=2),
                               start_chunk=1, seed=33)
    # a failed wait publishes nothing
    wait = gc.WaitSpec(torch.zeros(4, dtype=torch.int32), generation=1, chunk_m=16, max_spins=5)
    signals = torch.zeros(4, dtype=torch.int32)
    epi = gc.EpilogueSpec.from_tensors([torch.empty(16, 32, dtype=torch.bfloat16) for _ in range(4)],
                                       signals, 1, 16)
    a, b, _ = _operands(64, 32, 32, torch.bfloat16, "row_major", seed=36)
    with pytest.raises(TimeoutError):
        gc.matmul(a, b, config=dataclasses.replace(CFG, num_programs=5, stream_k=1), wait=wait, epilogue=epi)
    assert signals.tolist() == [0, 0, 0, 0], "garbage chunks must never be signalled ready"


@pytest.mark.parametrize("count,flatten,mode", [("auto", True, 4), ("auto", False, 3), ("after_loop", True, 3)])
@pytest.mark.parametrize("programs,stream_k", [(5, 1), (7, 2), (29, 2)])
def test_stream_k_epilogue_counts_that_return_nothing(programs, stream_k, count, flatten, mode):
    # 24 tiles in 32-row chunks (every tile in one chunk): counts that return nothing with
    # stream-K, made inside the next tile's main loop in flattened tile loops (EPI_COUNT=4),
    # after it otherwise (3). The whole tiles before the shared ones are counted as usual; the
    # tiles shared out by K-steps (4, 10, all 24) are stored and counted by whichever segment
    # sums them; with 29 programs every chunk's poll tile is one of those.
    cfg = dataclasses.replace(CFG, num_programs=programs, stream_k=stream_k, flatten=flatten)
    assert gc.stream_k_tiles(24, programs, stream_k) > 0, "the case must exercise stream-K"
    modes = _epilogue_over_generations(128, 40, 45, 32, cfg, start_chunk=1, seed=37,
                                       options=gc.GemmOptions(epi_count=count))
    assert modes == {mode}


def _probe_tile_order(out_ptr, M, num_pid_m, num_pid_n, chunk_m, num_chunks, start_chunk,
                      BLOCK_M: "tl.constexpr", GROUP_M: "tl.constexpr", TILE_ORDER: "tl.constexpr"):
    for t in range(0, num_pid_m * num_pid_n):
        pm, pn = _tile_coords(t, M, num_pid_m, num_pid_n, chunk_m, num_chunks,
                              start_chunk, BLOCK_M, GROUP_M, TILE_ORDER)
        tl.store(out_ptr + 2 * t, pm)
        tl.store(out_ptr + 2 * t + 1, pn)


def _tile_sequence(m, n, chunk_m, start, order, block_m=16, block_n=16, group_m=2):
    """(pid_m, pid_n) of each tile id, straight from the kernel's _tile_coords."""
    import triton
    import triton.language
    from tpfuse.kernels import gemm

    globals().update(tl=triton.language, _tile_coords=gemm._tile_coords)
    probe = triton.jit(_probe_tile_order)
    npm, npn = -(-m // block_m), -(-n // block_n)
    out = torch.full((npm * npn, 2), -1, dtype=torch.int32)
    probe[(1,)](out, m, npm, npn, chunk_m, -(-m // chunk_m), start,
                BLOCK_M=block_m, GROUP_M=group_m, TILE_ORDER=gc.TILE_ORDERS.index(order))
    return [tuple(r) for r in out.tolist()]


def test_grouped_order_is_the_group_m_swizzle():
    seq = _tile_sequence(100, 80, 1, 0, "grouped")
    npm, npn, g = 7, 5, 2
    expect = []
    for t in range(npm * npn):
        first = (t // (g * npn)) * g
        rows = min(npm - first, g)
        expect.append((first + (t % (g * npn)) % rows, (t % (g * npn)) // rows))
    assert seq == expect


@pytest.mark.parametrize("m,chunk_m,start", [(130, 33, 2), (128, 16, 5), (160, 20, 0), (130, 33, 3)])
def test_chunk_rotated_order_finishes_chunks_in_order(m, chunk_m, start):
    seq = _tile_sequence(m, 48, chunk_m, start, "owner")
    npm, npn = -(-m // 16), 3
    assert sorted(seq) == [(i, j) for i in range(npm) for j in range(npn)], "not a permutation"
    num_chunks = -(-m // chunk_m)

    def chunks_of(pid_m):
        lo, hi = pid_m * 16, min(pid_m * 16 + 16, m) - 1
        return range(lo // chunk_m, hi // chunk_m + 1)

    assert start in chunks_of(seq[0][0]), "the first tile must hold rows of start_chunk"
    finish = {}
    for pos, (pm, _) in enumerate(seq):
        for c in chunks_of(pm):
            finish[c] = pos
    order = [(start + j) % num_chunks for j in range(num_chunks)]
    finishes = [finish[c] for c in order]
    assert finishes == sorted(finishes), f"chunks finish out of order: {dict(zip(order, finishes))}"
    # a chunk's tiles form one contiguous run, except tiles shared with an earlier chunk
    for j, c in enumerate(order):
        positions = [p for p, (pm, _) in enumerate(seq) if c in chunks_of(pm)
                     and not any(order[i] in chunks_of(pm) for i in range(j))]
        assert positions == list(range(positions[0], positions[-1] + 1)) if positions else True


def _owner_order_by_search(m, n, chunk_m, start, block_m=16, block_n=16, group_m=2):
    """The owner order as specified: segment j (chunk (start + j) % num_chunks) covers the
    rotated M-tile positions from R(j) to R(j+1), found by searching every chunk boundary."""
    npm, npn = -(-m // block_m), -(-n // block_n)
    num_chunks = -(-m // chunk_m)
    t0 = start * chunk_m // block_m
    bounds = []
    for j in range(1, num_chunks):
        c = (start + j) % num_chunks
        r = -(-(c * chunk_m) // block_m) - t0 + (npm if c < start else 0)
        bounds.append(min(max(r, 0), npm))
    seq = []
    for t in range(npm * npn):
        lo = max([0] + [r for r in bounds if r * npn <= t])
        hi = min([npm] + [r for r in bounds if r * npn > t])
        local, rows = t - lo * npn, hi - lo
        first = (local // (group_m * npn)) * group_m
        g = min(rows - first, group_m)
        seq.append(((lo + first + (local % (group_m * npn)) % g + t0) % npm, (local % (group_m * npn)) // g))
    return seq


@pytest.mark.parametrize("m,chunk_m,block_m", [(130, 33, 16), (128, 16, 16), (160, 20, 16), (100, 7, 16),
                                               (96, 48, 32), (200, 25, 64), (64, 64, 16)])
def test_owner_order_closed_form_matches_the_segment_search(m, chunk_m, block_m):
    # the kernel finds a tile's segment in closed form (no loop, so FLATTEN can fuse the loops)
    num_chunks = -(-m // chunk_m)
    for start in sorted({0, min(1, num_chunks - 1), num_chunks // 2, num_chunks - 1}):
        assert _tile_sequence(m, 48, chunk_m, start, "owner", block_m=block_m) == \
            _owner_order_by_search(m, 48, chunk_m, start, block_m=block_m), (m, chunk_m, block_m, start)


@pytest.mark.parametrize("m,chunk_m,start", [(130, 33, 2), (128, 16, 5)])
def test_round_order_is_grouped_order_rotated_to_the_start_chunk(m, chunk_m, start):
    grouped = _tile_sequence(m, 48, chunk_m, 0, "grouped")
    seq = _tile_sequence(m, 48, chunk_m, start, "round")
    npm = -(-m // 16)
    t0 = start * chunk_m // 16
    assert seq == [((pm + t0) % npm, pn) for pm, pn in grouped]
    assert seq[0][0] * 16 <= start * chunk_m < seq[0][0] * 16 + 16


def test_wait_hook_with_signals_preset():
    a, b, ref = _operands(130, 70, 65, torch.bfloat16, "weight_t", seed=3)
    signal = torch.tensor([5, 7, 5, 9, 5], dtype=torch.int32)   # >= generation 5 everywhere
    wait = gc.WaitSpec(signal, generation=5, chunk_m=27, max_spins=10)
    out = torch.full((130, 65), float("nan"), dtype=torch.bfloat16)
    gc.matmul(a, b, out=out, config=CFG, tile_order="round", start_chunk=1, wait=wait)
    _assert_close(out, ref, torch.bfloat16)
    assert signal.tolist() == [5, 7, 5, 9, 5], "a wait must not write the signal"


@pytest.mark.parametrize("per_chunk_signals,count", [(False, "returning"), (True, "auto")])
def test_epilogue_routes_chunks_and_publishes(per_chunk_signals, count):
    options = gc.GemmOptions(epi_count=count)
    m, k, n, chunk_m = 100, 40, 45, 27          # 4 chunks: 27, 27, 27, 19 rows
    num_chunks = 4
    dests = [torch.full((chunk_m + 3, n), float("nan"), dtype=torch.bfloat16) for _ in range(num_chunks)]
    if per_chunk_signals:
        signals = [torch.zeros(2, dtype=torch.int32) for _ in range(num_chunks)]
        sig_value = lambda: [s[0].item() for s in signals]  # noqa: E731
    else:
        signals = torch.zeros(num_chunks, dtype=torch.int32)
        sig_value = lambda: signals.tolist()  # noqa: E731
    spec = None
    for generation in (1, 2):   # counters reset themselves: a second call publishes again
        a, b, ref = _operands(m, k, n, torch.bfloat16, "row_major", seed=10 + generation)
        for d in dests:
            d.fill_(float("nan"))
        spec = gc.EpilogueSpec.from_tensors(dests, signals, generation, chunk_m,
                                            counters=spec.counters if spec else None)
        assert gc.matmul(a, b, config=CFG, tile_order="owner", start_chunk=2, epilogue=spec, options=options) is None
        # 27-row chunks straddle 16-row tiles: the returning count whatever was asked
        assert gc.last_plan().epi_count == abi.EPI_COUNT_RETURNING
        assert sig_value() == [generation] * num_chunks
        assert spec.counters.tolist() == [0] * num_chunks
        for c, d in enumerate(dests):
            rows = min(chunk_m, m - c * chunk_m)
            _assert_close(d[:rows], ref[c * chunk_m:c * chunk_m + rows], torch.bfloat16)
            assert torch.isnan(d[rows:]).all(), f"dest {c} written past its chunk"


@pytest.mark.parametrize("stream_k", [0, 1])
def test_epilogue_without_signals_routes_only(stream_k):
    """An EpilogueSpec without signals (the fused GEMM+RS/AR's): every chunk's rows land in its
    destination exactly, nothing past them is written, and the plan says it counts nothing."""
    m, k, n, chunk_m = 100, 40, 45, 27          # 4 chunks: 27, 27, 27, 19 rows; tiles straddle them
    cfg = dataclasses.replace(CFG, stream_k=stream_k)
    dests = [torch.full((chunk_m + 3, n), float("nan"), dtype=torch.bfloat16) for _ in range(4)]
    spec = gc.EpilogueSpec.from_tensors(dests, None, 1, chunk_m)
    assert not spec.signalled and spec.signal_ptrs is None and spec.counters is None
    a, b, ref = _operands(m, k, n, torch.bfloat16, "row_major", seed=21)
    assert gc.matmul(a, b, config=cfg, tile_order="owner", start_chunk=2, epilogue=spec) is None
    plan = gc.last_plan()
    assert plan.epi_count == 0 and any("without signals" in r for r in plan.reasons), plan.reasons
    for c, d in enumerate(dests):
        rows = min(chunk_m, m - c * chunk_m)
        _assert_close(d[:rows], ref[c * chunk_m:c * chunk_m + rows], torch.bfloat16)
        assert torch.isnan(d[rows:]).all(), f"dest {c} written past its chunk"


def test_epilogue_signals_and_counters_come_together():
    dests = [torch.zeros(8, 4, dtype=torch.bfloat16) for _ in range(2)]
    with pytest.raises(ValueError, match="counters without signals"):
        gc.EpilogueSpec.from_tensors(dests, None, 1, 8, counters=torch.zeros(2, dtype=torch.int32))
    half = dataclasses.replace(gc.EpilogueSpec.from_tensors(dests, torch.zeros(2, dtype=torch.int32), 1, 8),
                               counters=None)
    a, b = torch.zeros(16, 8, dtype=torch.bfloat16), torch.zeros(8, 4, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="signal_ptrs without counters"):
        gc.matmul(a, b, config=CFG, tile_order="owner", epilogue=half)


def _epilogue_over_generations(m, k, n, chunk_m, config, start_chunk, seed, options=None, num_sms=None):
    """Route each chunk of ``a @ b`` (owner order) to a destination of its own over two
    generations: every chunk published, counters back at zero, each destination exact and
    untouched past its rows. Returns the epilogue count modes the calls' plans took."""
    modes = set()
    num_chunks = -(-m // chunk_m)
    dests = [torch.full((chunk_m, n), float("nan"), dtype=torch.bfloat16) for _ in range(num_chunks)]
    signals = torch.zeros(num_chunks, dtype=torch.int32)
    spec = None
    for generation in (1, 2):
        a, b, ref = _operands(m, k, n, torch.bfloat16, "row_major", seed=seed + generation)
        for d in dests:
            d.fill_(float("nan"))
        spec = gc.EpilogueSpec.from_tensors(dests, signals, generation, chunk_m,
                                            counters=spec.counters if spec else None)
        gc.matmul(a, b, config=config, tile_order="owner", start_chunk=start_chunk, epilogue=spec, options=options,
                  num_sms=num_sms)
        modes.add(gc.last_plan().epi_count)
        assert signals.tolist() == [generation] * num_chunks
        assert spec.counters.tolist() == [0] * num_chunks
        for c, d in enumerate(dests):
            rows = min(chunk_m, m - c * chunk_m)
            _assert_close(d[:rows], ref[c * chunk_m:c * chunk_m + rows], torch.bfloat16)
            assert torch.isnan(d[rows:]).all(), f"dest {c} written past its chunk"
    return modes


@pytest.mark.parametrize("count", ["auto", "after_loop", "returning"])
@pytest.mark.parametrize("programs,chunk_m", [(3, 32), (5, 24), (2, 128)])
def test_epilogue_publishes_with_many_tiles_per_program(programs, chunk_m, count):
    # Few programs, each running several tiles of a chunk in a row (24-row chunks: some tiles
    # straddle two chunks; one 128-row chunk: every program's tiles in it).
    # auto takes EPI_COUNT=4 where every tile lies in one chunk (flattened tile loop): counts
    # that return nothing, made inside the next tile's main loop (after_loop: 3, after it), a
    # poller per chunk, handoff at the poller's end. The interpreter runs the programs one after
    # the other, which takes both ways a chunk gets published: with 3 programs and 32-row
    # chunks, chunk 1's poller (program 1) finds it complete inside its tile loop; chunks 0, 2
    # and 3 are handed off incomplete and published at a later program's end.
    modes = _epilogue_over_generations(128, 32, 64, chunk_m,
                                       dataclasses.replace(CFG, num_programs=programs, flatten=True),
                                       start_chunk=-(-128 // chunk_m) - 1, seed=40,
                                       options=gc.GemmOptions(epi_count=count))
    aligned = chunk_m % 16 == 0
    assert modes == {{"auto": 4 if aligned else 1, "after_loop": 3 if aligned else 1, "returning": 1}[count]}


@pytest.mark.parametrize("m,chunk_m,start_chunk,programs", [(100, 32, 2, 2), (128, 32, 2, 3), (128, 128, 0, 2),
                                                           (100, 48, 0, 3)])
def test_count_in_loop_merges_runs_of_one_chunk(m, chunk_m, start_chunk, programs):
    # EPI_COUNT=4 (flattened tile loop): a program's consecutive tiles of one chunk are counted
    # as one run, the merge decided a tile ahead from the owner order's chunk segments; m = 100
    # leaves a short last chunk (4 rows), in the middle of the rotation with start_chunk = 2.
    modes = _epilogue_over_generations(m, 32, 64, chunk_m, dataclasses.replace(CFG, num_programs=programs, flatten=True),
                               start_chunk=start_chunk, seed=41)
    assert modes == {4}


def test_wait_timeout_raises_with_chunk_and_generation():
    a, b, _ = _operands(64, 32, 32, torch.bfloat16, "row_major", seed=4)
    signal = torch.tensor([3, 3, 2, 3], dtype=torch.int32)      # chunk 2 never reaches 3
    err = gc.new_error_word("cpu")
    wait = gc.WaitSpec(signal, generation=3, chunk_m=16, max_spins=20, error=err, rank=5)
    gc.matmul(a, b, config=CFG, tile_order="round", start_chunk=0, wait=wait, check=False)
    words = err.tolist()
    from tpfuse.kernels import abi   # the one error-word layout
    assert words[abi.ERR_STATUS] == 1 and words[abi.ERR_CHUNK] == 2 and words[abi.ERR_GENERATION] == 3
    assert words[abi.ERR_SEEN] == 2 and words[abi.ERR_WHAT] == abi.WAIT_GEMM_CHUNK
    with pytest.raises(TimeoutError, match=r"rank 5.*chunk=2.*generation 3"):
        gc.check_error_word(err, rank=5)
    with pytest.raises(TimeoutError, match=r"chunk=2\] >= generation 3"):
        gc.matmul(a, b, config=CFG, wait=gc.WaitSpec(signal, 3, 16, max_spins=20))


def test_failed_wait_does_not_publish():
    a, b, _ = _operands(64, 32, 32, torch.bfloat16, "row_major", seed=5)
    wait = gc.WaitSpec(torch.zeros(4, dtype=torch.int32), generation=1, chunk_m=16, max_spins=5)
    dests = [torch.empty(16, 32, dtype=torch.bfloat16) for _ in range(4)]
    signals = torch.zeros(4, dtype=torch.int32)
    epi = gc.EpilogueSpec.from_tensors(dests, signals, 1, 16)
    with pytest.raises(TimeoutError):
        gc.matmul(a, b, config=CFG, wait=wait, epilogue=epi)
    assert signals.tolist() == [0, 0, 0, 0], "garbage chunks must never be signalled ready"


@pytest.mark.parametrize("call,exc,match", [
    (lambda a, b: gc.matmul(a.double(), b.double()), TypeError, "a.dtype=torch.float64"),
    (lambda a, b: gc.matmul(a, b.half()), TypeError, "b.dtype"),
    (lambda a, b: gc.matmul(a, b[:-1]), ValueError, r"need a \[M, K\] and b \[K, N\]"),
    (lambda a, b: gc.matmul(a[None], b), ValueError, "must be 2-D"),
    (lambda a, b: gc.matmul(a.t().contiguous().t(), b), ValueError, "unit column stride"),
    (lambda a, b: gc.matmul(a, torch.randn(32, 16, dtype=a.dtype)[::2, ::2]), ValueError, "call b.contiguous"),
    (lambda a, b: gc.matmul(a, b, tile_order="zigzag"), ValueError, "tile_order='zigzag'"),
    (lambda a, b: gc.matmul(a, b, tile_order="round"), ValueError, "needs chunk_m"),
    (lambda a, b: gc.matmul(a, b, tile_order="round", chunk_m=8, start_chunk=4), ValueError, "start_chunk=4"),
    (lambda a, b: gc.matmul(a, b, chunk_m=8, wait=gc.WaitSpec(torch.zeros(2, dtype=torch.int32), 1, 16)),
     ValueError, "chunk sizes disagree"),
    (lambda a, b: gc.matmul(a, b, wait=gc.WaitSpec(torch.zeros(2, dtype=torch.int32), 0, 8)),
     ValueError, "wait.generation=0"),
    (lambda a, b: gc.matmul(a, b, wait=gc.WaitSpec(torch.zeros(1, dtype=torch.int32), 1, 8)),
     ValueError, "num_chunks=2"),
    (lambda a, b: gc.matmul(a, b, out=torch.empty(16, 9, dtype=a.dtype)), ValueError, r"need \(16, 8\)"),
    (lambda a, b: gc.matmul(a, b, config="fast"), TypeError, "GemmConfig"),
    (lambda a, b: gc.matmul(a, b, options="fast"), TypeError, "GemmOptions"),
])
def test_bad_input_names_argument_and_fix(call, exc, match):
    a = torch.randn(16, 16, dtype=torch.bfloat16)
    b = torch.randn(16, 8, dtype=torch.bfloat16)
    with pytest.raises(exc, match=match):
        call(a, b)


def test_config_validation_and_smem_pruning():
    with pytest.raises(ValueError, match="BLOCK_N=96"):
        gc.GemmConfig(BLOCK_N=96)
    with pytest.raises(ValueError, match="EPI_SUBTILE=4"):
        gc.GemmConfig(EPI_SUBTILE=4)
    with pytest.raises(TypeError, match="split_k"):   # removed: see docs/gemm_core.md
        gc.GemmConfig(split_k=2)
    cands = gc.candidate_configs(4096, 4096, 4096, torch.bfloat16, smem_limit=150_000)
    assert cands and all(c.smem_bytes(2) <= 150_000 for c in cands)
    assert len(gc.candidate_configs(4096, 4096, 4096)) > len(cands)
    assert len(gc.candidate_configs(128, 4096, 4096)) > len(gc.candidate_configs(4096, 4096, 4096))


# Per-rank Llama-3 shapes at TP 8 measured in benchmarks/results/gemm_core_h200*.json (M, N, K).
MEASURED = [(m, n, k) for m in (16384, 4096, 2048, 512, 128)
            for n, k in ((3584, 4096), (4096, 1792), (7168, 8192), (8192, 3584), (13312, 16384), (16384, 6656))]


def test_default_config_keeps_the_measured_winners():
    # tuned winners of the measured shapes (docs/gemm_core.md): 128x256 at M >= 2048,
    # 128x128 x 6 stages where 128x256 leaves most SMs idle, deep narrow pipelines for decode
    assert gc.default_config(16384, 3584, 4096) == gc.GemmConfig(BLOCK_M=128, BLOCK_N=256, BLOCK_K=64,
                                                                 num_warps=8, num_stages=3)
    assert gc.default_config(512, 3584, 4096) == gc.GemmConfig(BLOCK_M=128, BLOCK_N=128, BLOCK_K=64,
                                                               num_warps=8, num_stages=6)
    assert gc.default_config(128, 3584, 4096) == gc.GemmConfig(BLOCK_M=64, BLOCK_N=64, BLOCK_K=128,
                                                               num_warps=4, num_stages=6)
    assert all(not c.stream_k for c in (gc.default_config(m, n, k) for m, n, k in MEASURED))


def test_stream_k_candidates_only_for_ragged_waves():
    def sk(m, n, k, num_sms=132):
        return [c for c in gc.candidate_configs(m, n, k, num_sms=num_sms) if c.stream_k]
    # whole waves, or many waves (the tail is a small part): none
    assert not sk(16384, 3584, 4096) and not sk(4096, 8192, 3584)
    assert not sk(128 * 33, 256 * 4, 4096)   # 132 tiles of 128x256 and of 128x128 -> 264: whole waves
    # under one wave (8B fc1, M = 512) and a ragged fourth wave (70B fc1, M = 2048): some, each
    # leaving every program >= 8 steps
    for m, n, k in [(512, 3584, 4096), (2048, 7168, 8192)]:
        cands = sk(m, n, k)
        assert cands, (m, n, k)
        for c in cands:
            tiles = -(-m // c.BLOCK_M) * -(-n // c.BLOCK_N)
            assert tiles % 132 and tiles < 4 * 132
            assert gc.stream_k_tiles(tiles, 132, c.stream_k) * -(-k // c.BLOCK_K) >= 8 * 132
    assert {c.stream_k for c in sk(2048, 7168, 8192)} == {1, 2}   # 448 tiles: 52 left over (< 66)


def test_config_dict_round_trip_and_old_cache_entries():
    cfg = gc.GemmConfig(BLOCK_M=64, BLOCK_N=128, BLOCK_K=128, num_warps=4, tma_store=False)
    assert gc.GemmConfig.from_dict(json.loads(json.dumps(cfg.to_dict()))) == cfg
    sk = gc.GemmConfig(BLOCK_N=128, stream_k=2)
    assert gc.GemmConfig.from_dict(json.loads(json.dumps(sk.to_dict()))) == sk
    old = {k: v for k, v in gc.GemmConfig().to_dict().items()
           if k not in ("stream_k", "tma_store")}  # written before stream-K and tma_store existed
    assert gc.GemmConfig.from_dict(old) == gc.GemmConfig()
    with pytest.raises(ValueError, match="unknown fields.*cluster"):
        gc.GemmConfig.from_dict(dict(old, cluster=2))
    # removed fields: an old entry with the feature off loads, one with it on is refused
    assert gc.GemmConfig.from_dict(dict(old, warp_specialize=False, split_k=1)) == gc.GemmConfig()
    with pytest.raises(ValueError, match="warp_specialize=True is no longer supported"):
        gc.GemmConfig.from_dict(dict(old, warp_specialize=True))
    with pytest.raises(ValueError, match="split_k=4 is no longer supported"):
        gc.GemmConfig.from_dict(dict(old, split_k=4))


def test_empty_m_and_zero_k():
    a = torch.randn(0, 16, dtype=torch.bfloat16)
    assert gc.matmul(a, torch.randn(16, 8, dtype=torch.bfloat16)).shape == (0, 8)
    out = gc.matmul(torch.randn(4, 0, dtype=torch.bfloat16), torch.randn(0, 8, dtype=torch.bfloat16))
    assert out.shape == (4, 8) and (out == 0).all()


def test_import_needs_no_triton_and_no_gpu():
    # tpfuse.gemm adds no triton import to what the package itself imports, and no device probe
    code = ("import sys; import tpfuse; had = 'triton' in sys.modules; "
            "import tpfuse.gemm as g; import tpfuse.gemm.offline; "
            "assert 'tpfuse.kernels.gemm' not in sys.modules, 'kernel module imported eagerly'; "
            "assert 'tpfuse.kernels.gemm_ws' not in sys.modules, 'Gluon kernel imported eagerly'; "
            "assert had or 'triton' not in sys.modules, 'triton imported eagerly'; "
            "assert not g.device.device_info.cache_info().currsize")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["CUDA_VISIBLE_DEVICES"] = ""
    subprocess.run([sys.executable, "-c", code], check=True, env=env,
                   cwd=os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))


def test_candidates_include_deep_pipelines_once_each():
    for m, n, k in MEASURED:
        cands = gc.candidate_configs(m, n, k)
        assert len(set(cands)) == len(cands), (m, n, k)
        assert all(c.smem_bytes(2) <= 232448 for c in cands)
    # one tile per SM with cold inputs (M = 512) and decode: 5-6 stage 128x128x64, 6-12 stage narrow tiles
    prefill = gc.candidate_configs(512, 3584, 4096)
    assert gc.GemmConfig(BLOCK_M=128, BLOCK_N=128, BLOCK_K=64, num_warps=8, num_stages=6) in prefill
    decode = gc.candidate_configs(128, 3584, 4096)
    assert gc.GemmConfig(BLOCK_M=64, BLOCK_N=64, BLOCK_K=128, num_warps=4, num_stages=6) in decode
    assert gc.GemmConfig(BLOCK_M=64, BLOCK_N=64, BLOCK_K=64, num_warps=4, num_stages=12) in decode
    assert gc.default_config(512, 3584, 4096) in prefill and gc.default_config(128, 3584, 4096) in decode


def test_epilogue_takes_tma_descriptors_only_where_they_fit():
    # Host rule only (the interpreter has no TMA): one descriptor per chunk when the spec
    # knows its destinations, they are 16-byte aligned, there are at most 8 chunks and every
    # tile lies in one chunk.
    dests = [torch.empty(40, 64, dtype=torch.bfloat16) for _ in range(4)]
    spec = gc.EpilogueSpec.from_tensors(dests, torch.zeros(4, dtype=torch.int32), 1, 40)
    assert spec.align_elems == 8 and len(spec.dests) == 4
    assert launch.epilogue_tma_dests(spec, True, 4, 8) == 4
    assert launch.epilogue_tma_dests(spec, True, 4, 16) == 0        # 40-row chunks, 16-row tiles straddle
    assert launch.epilogue_tma_dests(spec, False, 4, 8) == 0        # plain-pointer launch or tma_store=False
    assert launch.epilogue_tma_dests(dataclasses.replace(spec, dests=()), True, 4, 8) == 0
    assert launch.epilogue_tma_dests(dataclasses.replace(spec, align_elems=0), True, 4, 8) == 0
    assert launch.epilogue_tma_dests(None, True, 4, 8) == 0
    one = gc.EpilogueSpec.from_tensors(dests[:1], torch.zeros(1, dtype=torch.int32), 1, 40)
    assert launch.epilogue_tma_dests(one, True, 1, 16) == 1         # one chunk: nothing to straddle
    many = [torch.empty(8, 64, dtype=torch.bfloat16) for _ in range(9)]
    spec9 = gc.EpilogueSpec.from_tensors(many, torch.zeros(9, dtype=torch.int32), 1, 8)
    assert launch.epilogue_tma_dests(spec9, True, 9, 8) == 0        # > 8: pointer stores
    assert launch.epilogue_tma_dests(spec, True, 4, 8, gc.GemmOptions(epi_tma=False)) == 0


def test_epilogue_descriptors_cover_each_chunk_and_check_rows():
    pytest.importorskip("triton.tools.tensor_descriptor")
    dests = [torch.empty(40, 64, dtype=torch.bfloat16) for _ in range(3)]
    spec = gc.EpilogueSpec.from_tensors(dests, torch.zeros(3, dtype=torch.int32), 1, 40)
    cfg = gc.GemmConfig(BLOCK_M=16, BLOCK_N=32, BLOCK_K=16, EPI_SUBTILE=2)
    plan = launch.LaunchPlan(100, 64, 32, cfg, use_tma=True, chunk_m=40, num_chunks=3, epi_tma=3)
    descs = launch._epilogue_descriptors(spec, plan)
    assert [list(d.shape) for d in descs] == [[40, 64], [40, 64], [20, 64]]   # last chunk: 20 rows
    assert all(list(d.block_shape) == [16, 16] for d in descs)
    assert [d.base.data_ptr() for d in descs] == [d.data_ptr() for d in dests]
    assert launch._epilogue_descriptors(spec, plan) is descs                        # cached on the spec
    short = gc.EpilogueSpec.from_tensors([torch.empty(40, 64, dtype=torch.bfloat16),
                                          torch.empty(10, 64, dtype=torch.bfloat16)],
                                         torch.zeros(2, dtype=torch.int32), 1, 40)
    plan2 = dataclasses.replace(plan, m=80, num_chunks=2, epi_tma=2)
    with pytest.raises(ValueError, match=r"dests\[1\] is \(10, 64\); chunk 1 needs at least \(40, 64\)"):
        launch._epilogue_descriptors(short, plan2)


def test_stacked_destinations_take_one_descriptor_for_every_chunk():
    # Chunks of one output tensor (out[c * chunk_m:] slices): one descriptor over all M rows,
    # whatever the number of chunks and their height, since a tile is stored at its own row.
    pytest.importorskip("triton.tools.tensor_descriptor")
    stacked = abi.EPI_TMA_STACKED
    out = torch.empty(100, 64, dtype=torch.bfloat16)
    dests = [out[c * 40:(c + 1) * 40] for c in range(3)]          # the last chunk has 20 rows
    spec = gc.EpilogueSpec.from_tensors(dests, torch.zeros(3, dtype=torch.int32), 1, 40)
    assert gc.hooks.stacked_dests(spec)
    assert launch.epilogue_tma_dests(spec, True, 3, 16) == stacked   # 40-row chunks, 16-row tiles
    assert launch.epilogue_tma_dests(spec, False, 3, 16) == 0
    wide = torch.empty(9 * 8, 64, dtype=torch.bfloat16)
    spec9 = gc.EpilogueSpec.from_tensors([wide[c * 8:(c + 1) * 8] for c in range(9)],
                                         torch.zeros(9, dtype=torch.int32), 1, 8)
    assert launch.epilogue_tma_dests(spec9, True, 9, 8) == stacked   # more than 8 chunks
    cfg = gc.GemmConfig(BLOCK_M=16, BLOCK_N=32, BLOCK_K=16, EPI_SUBTILE=2)
    plan = launch.LaunchPlan(100, 64, 32, cfg, use_tma=True, chunk_m=40, num_chunks=3, epi_tma=stacked)
    (desc,) = launch._epilogue_descriptors(spec, plan)
    assert list(desc.shape) == [100, 64] and list(desc.block_shape) == [16, 16]
    assert desc.base.data_ptr() == out.data_ptr() and list(desc.strides) == [64, 1]
    # not stacked: another order, a gap, other storage, another width
    sig = torch.zeros(3, dtype=torch.int32)
    for other in ([dests[1], dests[0], dests[2]],
                  [out[0:40], out[41:81], out[81:100]],
                  [dests[0], dests[1].clone(), dests[2]],
                  [d[:, :32] if c == 1 else d for c, d in enumerate(dests)]):
        spec_o = gc.EpilogueSpec.from_tensors(other, sig, 1, 40)
        assert not gc.hooks.stacked_dests(spec_o)
        assert launch.epilogue_tma_dests(spec_o, True, 3, 8) == 3    # per-chunk descriptors
    # the last chunk's rows must lie in the tensor
    short = torch.empty(90, 64, dtype=torch.bfloat16)
    spec_s = gc.EpilogueSpec.from_tensors([short[0:40], short[40:80], short[80:90]], sig, 1, 40)
    assert gc.hooks.stacked_dests(spec_s)
    with pytest.raises(ValueError, match=r"dests\[2\] is \(10, 64\); chunk 2 needs at least \(20, 64\)"):
        launch._epilogue_descriptors(spec_s, plan)


def test_with_generation_keeps_what_was_derived_from_the_buffers():
    # The next call's spec: a new generation, the same buffers, and the descriptors and the
    # stacked flag built once for them (dataclasses.replace would build them again).
    pytest.importorskip("triton.tools.tensor_descriptor")
    out = torch.empty(100, 64, dtype=torch.bfloat16)
    spec = gc.EpilogueSpec.from_tensors([out[c * 40:(c + 1) * 40] for c in range(3)],
                                        torch.zeros(3, dtype=torch.int32), 1, 40)
    stacked = abi.EPI_TMA_STACKED
    cfg = gc.GemmConfig(BLOCK_M=16, BLOCK_N=32, BLOCK_K=16)
    plan = launch.LaunchPlan(100, 64, 32, cfg, use_tma=True, chunk_m=40, num_chunks=3, epi_tma=stacked)
    (desc,) = launch._epilogue_descriptors(spec, plan)
    assert gc.hooks.stacked_dests(spec)
    nxt = spec.with_generation(2)
    assert nxt.generation == 2 and spec.generation == 1 and nxt.dests == spec.dests
    assert nxt.counters is spec.counters and nxt.signal_ptrs is spec.signal_ptrs
    assert nxt.__dict__["_stacked"] is True and launch._epilogue_descriptors(nxt, plan)[0] is desc
    assert dataclasses.replace(spec, generation=2).__dict__.get("_tma_descs") is None   # what it saves
    fresh = gc.EpilogueSpec.from_tensors([out[:40]], torch.zeros(1, dtype=torch.int32), 1, 40).with_generation(5)
    assert fresh.generation == 5 and "_tma_descs" not in fresh.__dict__   # nothing derived yet: nothing kept


@pytest.mark.parametrize("num_sms", [1, 2])
@pytest.mark.parametrize("config", [CFG, dataclasses.replace(CFG, num_programs=4, stream_k=1)],
                         ids=["persistent", "stream_k"])
def test_num_sms_caps_the_grid_and_every_tile_is_computed(num_sms, config):
    # 5 x 3 = 15 tiles of 16x16 on 1 or 2 programs: each program loops over many tiles (and,
    # with stream-K on 2 programs, the last tile is shared out by K-steps)
    a, b, ref = _operands(67, 40, 40, torch.bfloat16, "weight_t", seed=60)
    out = torch.full((67, 40), float("nan"), dtype=torch.bfloat16)
    gc.matmul(a, b, out=out, config=config, num_sms=num_sms)
    plan = gc.last_plan()
    assert plan.programs == num_sms and plan.num_tiles == 15 and f"num_sms={num_sms}" in plan.explain()
    assert plan.sk_tiles == (1 if config.stream_k and num_sms == 2 else 0)
    _assert_close(out, ref, torch.bfloat16)
    # a budget above what the config launches changes nothing
    gc.matmul(a[:16], b, config=config, num_sms=1000)
    # (3 tiles: as many programs; stream-K shares them out to all its 4)
    assert gc.last_plan().programs == (4 if config.stream_k else 3)
    if config.stream_k:
        return
    # the epilogue hook with a capped grid: chunks still routed and published
    modes = _epilogue_over_generations(64, 32, 32, 16, dataclasses.replace(CFG, flatten=True), start_chunk=1,
                                       seed=61, num_sms=num_sms)
    assert modes == {abi.EPI_COUNT_IN_LOOP} and gc.last_plan().programs == num_sms


@pytest.mark.parametrize("num_sms,exc,match", [(0, ValueError, "num_sms=0"), (-3, ValueError, "num_sms=-3"),
                                               (2.0, TypeError, "num_sms=2.0"), (True, TypeError, "num_sms=True"),
                                               ("4", TypeError, "num_sms='4'")])
def test_num_sms_is_validated(num_sms, exc, match):
    a = torch.randn(16, 16, dtype=torch.bfloat16)
    with pytest.raises(exc, match=match):
        gc.matmul(a, a, num_sms=num_sms)


def test_launch_plan_says_which_kernel_ran_and_why():
    a, b, _ = _operands(37, 53, 29, torch.bfloat16, "weight_t", seed=62)
    gc.matmul(a, b)
    plan = gc.last_plan()
    assert plan.kernel == "gemm_kernel" and plan.config_source.startswith("heuristic")
    assert plan.config == gc.default_config(37, 29, 53, num_sms=device.INTERPRETER_PROGRAMS)
    assert "plain-pointer loads" in plan.explain() and "37x29x53: gemm_kernel" in plan.explain()
    gc.matmul(a, b, config=CFG, options=gc.GemmOptions(gluon=False))
    assert gc.last_plan().config_source == "argument" and gc.last_plan().options.gluon is False
    counts = gc.launch_counts()
    gc.matmul(a, b, config=CFG)
    assert gc.launch_counts()["interpreter"] == counts["interpreter"] + 1
    gc.matmul(a[:0], b)
    assert gc.last_plan().kernel == "none" and gc.launch_counts()["interpreter"] == counts["interpreter"] + 1


# ---- scales and fp8 (torch._scaled_mm's meaning) ------------------------------------------------
E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2


def _scaled_operands(m, k, n, a_dtype, b_dtype, mode, seed=0):
    """fp8 (or any) ``a [m, k]``, ``b = weight.t()`` and fp32 scales: ``mode`` "tensor" (0-d)
    or "row" (``[m, 1]`` and ``[1, n]``); returns (a, b, scale_a, scale_b, float64 reference of
    the dequantized product)."""
    g = torch.Generator().manual_seed(seed)
    a = (torch.randn(m, k, generator=g) * 2).to(a_dtype)
    b = (torch.randn(n, k, generator=g) * 2).to(b_dtype).t()
    if mode == "tensor":
        sa, sb = torch.tensor(0.75), torch.tensor(1.5)
    else:
        sa, sb = torch.rand(m, 1, generator=g) + 0.25, torch.rand(1, n, generator=g) + 0.25
    ref = (a.double() * sa.double()) @ (b.double() * sb.double())
    return a, b, sa, sb, ref


def _assert_rounded(out, ref, out_dtype):
    """``out`` is ``ref`` rounded to ``out_dtype`` give or take an fp32 accumulation: relative
    Frobenius error within 2 units of the output's rounding."""
    assert out.dtype == out_dtype and not torch.isnan(out).any()
    eps = torch.finfo(out_dtype).eps if out_dtype != torch.float32 else 1e-5
    err = (out.double() - ref).norm() / ref.norm()
    assert err <= 2 * eps, f"relative error {err:.3g} > {2 * eps:.3g}"


@pytest.mark.parametrize("mode", ["tensor", "row"])
@pytest.mark.parametrize("a_dtype,b_dtype,out_dtype", [(E4M3, E4M3, torch.bfloat16), (E4M3, E5M2, torch.float32),
                                                       (E5M2, E4M3, torch.float16)],
                         ids=["e4m3-bf16", "e4m3xe5m2-fp32", "e5m2xe4m3-fp16"])
def test_fp8_matches_scaled_mm(mode, a_dtype, b_dtype, out_dtype):
    m, k, n = 37, 48, 32
    a, b, sa, sb, ref = _scaled_operands(m, k, n, a_dtype, b_dtype, mode)
    out = torch.full((m, n), float("nan"), dtype=out_dtype)
    assert gc.matmul(a, b, out=out, config=CFG, scale_a=sa, scale_b=sb, out_dtype=out_dtype) is out
    _assert_rounded(out, ref, out_dtype)
    plan = gc.last_plan()
    assert plan.variant == "gemm_kernel" and plan.out_dtype == out_dtype
    assert (plan.scale_a, plan.scale_b) == ((1, 1) if mode == "tensor" else (2, 2))
    # against torch._scaled_mm itself (CPU): the same products, rounded once
    theirs = torch._scaled_mm(a, b, scale_a=sa if mode == "row" else sa.reshape(()),
                              scale_b=sb if mode == "row" else sb.reshape(()), out_dtype=out_dtype)
    _assert_rounded(theirs, ref, out_dtype)
    if out_dtype == torch.bfloat16:   # default out dtype of fp8 inputs
        assert gc.matmul(a, b, config=CFG, scale_a=sa, scale_b=sb).dtype == torch.bfloat16


def test_fp8_gluon_config_off_sm90_runs_gemm_kernel_and_says_why():
    # GemmConfig(gluon=True) where the Gluon kernel cannot run (here: the interpreter, no TMA):
    # the call never fails; gemm_kernel runs the rest of the config, bitwise as without the
    # flag, with a warning and the plan's reason naming why
    m, k, n = 45, 144, 32
    a, b, sa, sb, ref = _scaled_operands(m, k, n, E4M3, E4M3, "row", seed=7)
    cfg = gc.GemmConfig(BLOCK_M=128, BLOCK_N=128, BLOCK_K=128, num_warps=8, num_stages=5, gluon=True)
    out = torch.full((m, n), float("nan"), dtype=torch.bfloat16)
    with pytest.warns(UserWarning, match="gluon=True.*not stored by TMA.*gemm_kernel.*45x32x144"):
        gc.matmul(a, b, out=out, config=cfg, scale_a=sa, scale_b=sb)
    plan = gc.last_plan()
    assert plan.kernel == "gemm_kernel" and plan.config is cfg and not plan.ws_block
    assert "gluon=True" in plan.explain() and "gemm_kernel with the rest of the config" in plan.explain()
    _assert_rounded(out, ref, torch.bfloat16)
    plain = gc.matmul(a, b, config=dataclasses.replace(cfg, gluon=False), scale_a=sa, scale_b=sb)
    assert torch.equal(plain, out)
    assert not any("gluon" in r for r in gc.last_plan().reasons)   # no flag: nothing said, as before


def test_tune_times_fp8_candidates_with_the_scales_it_is_given(monkeypatch):
    # tune(scale_a=, scale_b=, out_dtype=): the candidates are timed on the calls they are tuned
    # for (row-wise scales load in every tile's epilogue); without scales, unscaled into bf16
    import triton

    m, k, n = 45, 144, 32
    a, b, sa, sb, _ = _scaled_operands(m, k, n, E4M3, E4M3, "row", seed=8)
    seen = []

    def one_call(fn, **kw):   # no CUDA events here: each candidate's call runs once
        fn()
        plan = gc.last_plan()
        seen.append((plan.scale_a, plan.scale_b, plan.out_dtype))
        return 1.0

    monkeypatch.setattr(triton.testing, "do_bench", one_call)
    best, timings = gc.tune(a, b, configs=[CFG], save=False, graphs=False, scale_a=sa, scale_b=sb,
                            out_dtype=torch.float32)
    assert best == CFG and [c for c, _ in timings] == [CFG]
    assert seen == [(2, 2, torch.float32)]
    seen.clear()
    gc.tune(a, b, configs=[CFG], save=False, graphs=False)
    assert seen == [(0, 0, torch.bfloat16)]


def test_tune_times_the_leaders_hooked_calls_as_the_strategies_make_them(monkeypatch):
    # tune(hooks=, chunks=): after the plain ranking, each re-timed leader is timed with the
    # wait hook (signals set, round order) and with the epilogue hook (no signals, one
    # destination per chunk, owner order), chunks of ceil(M / chunks) rows; those calls compute
    # a @ b like the plain one
    import triton
    import importlib

    tune_mod = importlib.import_module("tpfuse.gemm.tune")   # the module (gc.tune is the function)

    m, k, n = 45, 32, 32
    a, b, ref = _operands(m, k, n, torch.bfloat16, "weight_t", seed=3)
    for hook, order in (("wait", "round"), ("epilogue", "owner")):
        out = torch.full((m, n), float("nan"), dtype=torch.bfloat16)
        kwargs, check = tune_mod._hooked_call(hook, a, out, 3)
        gc.matmul(a, b, config=CFG, **kwargs)
        check()
        _assert_close(out if hook == "wait" else torch.cat(kwargs["epilogue"].dests), ref, torch.bfloat16)
        plan = gc.last_plan()
        assert (plan.tile_order, plan.num_chunks, plan.chunk_m, plan.start_chunk) == (order, 3, 15, 1)
    wide = dataclasses.replace(CFG, BLOCK_N=32)
    seen = []

    def one_call(fn, **kw):   # each timing runs its call once; the wider config is the faster
        fn()
        plan = gc.last_plan()
        seen.append(plan.tile_order)
        return 1.0 if plan.config == wide else 2.0

    monkeypatch.setattr(triton.testing, "do_bench", one_call)
    best, timings = gc.tune(a, b, configs=[CFG, wide], save=False, graphs=False, chunks=3)
    assert best == wide and [c for c, _ in timings] == [wide, CFG]
    # 2 candidates timed once and re-timed 4 times, plainly, then with each hook
    assert [seen.count(o) for o in ("grouped", "round", "owner")] == [10, 10, 10]
    seen.clear()
    gc.tune(a, b, configs=[CFG, wide], save=False, graphs=False, hooks=())
    assert seen == ["grouped"] * 10
    seen.clear()
    gc.tune(a, b, configs=[CFG], save=False, graphs=False)   # one candidate: nothing to choose between
    assert seen == ["grouped"]


def test_scales_on_bf16_operands_and_stream_k_sums():
    # the epilogue's scaling of 16-bit operands (the interpreter's stand-in for fp8 dots where a
    # Triton cannot run them), through whole tiles and stream-K's workspace sums (2 subtiles)
    m, k, n = 45, 130, 32
    a, b, sa, sb, ref = _scaled_operands(m, k, n, torch.bfloat16, torch.bfloat16, "row", seed=4)
    for cfg in (CFG, dataclasses.replace(CFG, num_programs=4, stream_k=1, EPI_SUBTILE=2)):
        out = gc.matmul(a, b, config=cfg, scale_a=sa, scale_b=sb, out_dtype=torch.float32)
        _assert_rounded(out, ref, torch.float32)
        assert gc.last_plan().variant == ("gemm_sk_kernel" if cfg.stream_k else "gemm_kernel")
    a8, b8, sa8, sb8, ref8 = _scaled_operands(m, 144, n, E4M3, E4M3, "row", seed=5)   # K: a multiple of 16
    sk = dataclasses.replace(CFG, num_programs=4, stream_k=2, EPI_SUBTILE=2)
    out = gc.matmul(a8, b8, config=sk, scale_a=sa8, scale_b=sb8)
    assert gc.last_plan().sk_tiles > 0
    _assert_rounded(out, ref8, torch.bfloat16)


def test_fp8_hooks_take_row_scales_by_global_row():
    # wait hook: the gathered rows' scales are indexed by global row like a (round order from
    # chunk 1); epilogue hook: each chunk's rows, scaled, go to that chunk's bf16 destination.
    # Both bitwise equal to the call without hooks (same sums, same scaling).
    m, k, n, chunk_m = 64, 48, 32, 16
    a, b, sa, sb, ref = _scaled_operands(m, k, n, E4M3, E4M3, "row", seed=6)
    plain = gc.matmul(a, b, config=CFG, scale_a=sa, scale_b=sb)
    _assert_rounded(plain, ref, torch.bfloat16)
    signal = torch.full((4,), 3, dtype=torch.int32)
    out = torch.full((m, n), float("nan"), dtype=torch.bfloat16)
    gc.matmul(a, b, out=out, config=CFG, tile_order="round", start_chunk=1, scale_a=sa, scale_b=sb,
              wait=gc.WaitSpec(signal, generation=3, chunk_m=chunk_m, max_spins=10))
    assert gc.last_plan().variant == "gemm_hooked_kernel"
    assert torch.equal(out, plain)
    dests = [torch.full((chunk_m, n), float("nan"), dtype=torch.bfloat16) for _ in range(4)]
    signals = torch.zeros(4, dtype=torch.int32)
    spec = gc.EpilogueSpec.from_tensors(dests, signals, 1, chunk_m)
    gc.matmul(a, b, config=CFG, tile_order="owner", start_chunk=2, epilogue=spec, scale_a=sa, scale_b=sb)
    assert signals.tolist() == [1] * 4 and torch.equal(torch.cat(dests), plain)


@pytest.mark.parametrize("call,exc,match", [
    (lambda a, w, s: gc.matmul(a[:, :40], w.t()[:40]), ValueError, "K=40 and N=32 must be multiples of 16"),
    (lambda a, w, s: gc.matmul(a, w[:24].t()), ValueError, "N=24 must be multiples of 16|pad"),
    (lambda a, w, s: gc.matmul(a, w.t().contiguous()), ValueError, "fp8 b has strides .*weight.t"),
    (lambda a, w, s: gc.matmul(a, w.t().to(torch.bfloat16)), TypeError, "fp8 operands pair as"),
    (lambda a, w, s: gc.matmul(a.to(E5M2), w.t().to(E5M2)), TypeError, "float8_e5m2 with b.dtype"),
    (lambda a, w, s: gc.matmul(a, w.t(), out_dtype=E4M3), TypeError, "out_dtype=torch.float8_e4m3fn"),
    (lambda a, w, s: gc.matmul(a, w.t(), scale_a=s.double()), TypeError, "scale_a.dtype=torch.float64"),
    (lambda a, w, s: gc.matmul(a, w.t(), scale_a=torch.ones(1, 16)), ValueError, r"scale_a has shape \(1, 16\)"),
    (lambda a, w, s: gc.matmul(a, w.t(), scale_b=torch.ones(32, 1)), ValueError, r"need .*\[1, 32\]"),
    (lambda a, w, s: gc.matmul(a, w.t(), scale_b=2.0), TypeError, "scale_b must be a torch.Tensor"),
    (lambda a, w, s: gc.matmul(a, w.t(), out=torch.empty(16, 32)), ValueError, "need \\(16, 32\\) torch.bfloat16"),
])
def test_fp8_bad_input_names_argument_and_fix(call, exc, match):
    a = torch.randn(16, 48).to(E4M3)
    w = torch.randn(32, 48).to(E4M3)
    with pytest.raises(exc, match=match):
        call(a, w, torch.ones(()))


def test_compile_spec_projects_to_each_variant():
    from tpfuse.gemm.spec import CompileSpec, HookedSpec, PersistentSpec, StreamKSpec
    import tpfuse.kernels.gemm as km
    fields = {f.name: 0 for f in dataclasses.fields(CompileSpec)}
    fields.update(C_DTYPE="bfloat16")
    full = CompileSpec(**fields)
    assert type(full.project()) is PersistentSpec
    assert type(dataclasses.replace(full, STREAM_K=True).project()) is StreamKSpec
    for hook in ("WAIT", "EPILOGUE"):
        spec = dataclasses.replace(full, STREAM_K=True, **{hook: True}).project()
        assert type(spec) is HookedSpec and spec.STREAM_K
    # each variant's spec is exactly that kernel's constexprs (and a hashable cache key)
    for cls in (PersistentSpec, StreamKSpec, HookedSpec):
        kernel = getattr(km, cls.KERNEL)
        params = inspect.signature(kernel.fn).parameters.values()   # JIT or interpreted function
        constexprs = [p.name for p in params if "constexpr" in str(p.annotation)]
        assert [f.name for f in dataclasses.fields(cls)] == constexprs, cls.KERNEL
        hash(dataclasses.replace(full, STREAM_K=True, WAIT=True).project())


def test_fp8_default_configs_take_deep_k_steps_and_fit():
    from tpfuse.gemm.config import _SM90_SMEM_BYTES
    for m, n, k in ((16384, 3584, 4096), (512, 3584, 4096), (128, 8192, 3584), (128, 3584, 4096)):
        cfg = gc.default_config(m, n, k, E4M3)
        assert cfg.BLOCK_K >= 128 and cfg.smem_bytes(1, 2) <= _SM90_SMEM_BYTES, cfg
        cands = gc.candidate_configs(m, n, k, E4M3)
        assert cands and all(c.smem_bytes(1, 2) <= _SM90_SMEM_BYTES for c in cands)
        assert sum(c.BLOCK_K == 128 for c in cands) >= len(cands) // 2


def test_fit_shared_memory_halves_the_staging_then_drops_stages():
    from tpfuse.gemm.config import _SM90_SMEM_BYTES as LIMIT, fit_shared_memory as fit
    six = gc.GemmConfig(BLOCK_M=128, BLOCK_N=128, BLOCK_K=128, num_warps=8, num_stages=6, stream_k=1)
    assert fit(six, 1, 2, LIMIT) == six                                        # bf16 out: 224 KiB fits
    assert fit(six, 1, 4, LIMIT) == dataclasses.replace(six, EPI_SUBTILE=2)    # float32: half the staging
    big = gc.default_config(2048, 4096, 3584, E4M3)                             # 128x256x128, 3 stages
    assert big.smem_bytes(1, 4) > LIMIT and fit(big, 1, 4, LIMIT) == dataclasses.replace(big, EPI_SUBTILE=2)
    sub2 = dataclasses.replace(six, EPI_SUBTILE=2, num_stages=7)               # halved already: fewer stages
    assert fit(sub2, 1, 4, LIMIT) == dataclasses.replace(sub2, num_stages=6)
    assert fit(dataclasses.replace(six, tma_store=False), 1, 4, LIMIT).num_stages == 6   # no staging buffer
    assert fit(six, 1, 4, 1).num_stages == 1                                    # never below one stage
    for c in gc.candidate_configs(512, 13312, 16384, E4M3) + gc.candidate_configs(16384, 3584, 4096, E4M3):
        if not c.gluon:
            assert fit(c, 1, 4, LIMIT).smem_bytes(1, 4) <= LIMIT, c


def test_fp8_stream_k_candidates_go_two_stages_deeper():
    # 405B fc1 M=512: 208 tiles of 128x256 on 132 SMs; 128x128x128 stream-K with 6 stages led
    # on the H200 (config.candidate_configs). Only stream-K tiles take the second extra stage.
    from tpfuse.gemm.config import _SM90_SMEM_BYTES
    cands = gc.candidate_configs(512, 13312, 16384, E4M3)
    deep = gc.GemmConfig(BLOCK_M=128, BLOCK_N=128, BLOCK_K=128, num_warps=8, num_stages=6, stream_k=1)
    assert deep in cands and dataclasses.replace(deep, num_stages=5) in cands
    assert dataclasses.replace(deep, stream_k=2) in cands
    assert all(c.smem_bytes(1, 2) <= _SM90_SMEM_BYTES for c in cands)
    assert len(set(cands)) == len(cands)
    plain16 = {dataclasses.replace(c, BLOCK_K=min(2 * c.BLOCK_K, 256))
               for c in gc.candidate_configs(512, 13312, 16384) if not c.stream_k}
    for c in cands:
        if not c.stream_k and not c.gluon:   # plain tiles: at most one stage over the 16-bit space's
            assert any(dataclasses.replace(p, num_stages=c.num_stages) == c and c.num_stages - p.num_stages in (0, 1)
                       for p in plain16), c
