"""Persistent Triton GEMM shared by every fused strategy: ``c = a @ b`` (times the scales).

Three variants, in the style of Triton's persistent matmul tutorial, over shared helpers:

* :func:`gemm_kernel` -- plain persistent: program ``p`` of ``P`` runs tiles ``p, p + P, ...``
  of the tile order (the grid is at most one program per SM), so tiles early in the order run
  first.
* :func:`gemm_sk_kernel` -- the same for the first tiles, then stream-K: the last ``sk_tiles``
  tiles of the order are shared out to every program by K-steps (partials in a workspace).
* :func:`gemm_hooked_kernel` -- either of the above with the wait hook and/or the epilogue
  hook (below).

Shared helpers: the tile order (:func:`_tile_coords`), the K loop (:func:`_mainloop`), the
tile's stores in ``EPI_SUBTILE`` column slices with the scales applied (:func:`_store_tile`,
written once for registers and for stream-K's workspace sums), stream-K's runs
(:func:`_sk_run`, :func:`_sk_segment`, :func:`_sk_partial`, :func:`_sk_claim`), and the epilogue
hook's counts. The host (``tpfuse/gemm/launch.py``) picks the variant and passes exactly the
constexprs it takes (a frozen compile spec per variant).

Shapes: ``a [M, K]`` row-major (any row stride), ``b [K, N]`` row-major (``B_KMAJOR=False``)
or column-major, i.e. ``weight.t()`` of a contiguous ``[N, K]`` weight (``B_KMAJOR=True``).
fp32 accumulation; fp32 inputs go through tf32; fp8 inputs (e4m3, e5m2) through fp8 MMAs.
Scales (``SCALE_A``, ``SCALE_B``: 0 none, 1 one fp32 value, 2 one per row of ``a`` / column of
``b``; ``torch._scaled_mm``'s meaning) multiply the fp32 tile in the epilogue, before the
rounding to ``C_DTYPE``; a row-wise ``scale_a`` is indexed by the global row, like ``a``.

Tile orders (``TILE_ORDER`` constexpr); rows are cut in communication chunks of ``chunk_m``:

* ``0`` grouped: the usual GROUP_M swizzle over the whole ``M x N`` tile grid (L2 reuse).
* ``1`` round (AG): the grouped order over M-tile rows rotated to start at the M-tile holding
  the first row of chunk ``start_chunk`` (the local shard), then on round in row order. A group
  of GROUP_M rows may span two chunks, so L2 reuse stays that of ``grouped``.
* ``2`` owner (RS): chunk by chunk, ``start_chunk`` first (the next rank), then round; each
  chunk's tiles form one segment, GROUP_M-swizzled inside it, so chunks finish in that order
  and the first destination gets its rows as early as possible. A tile straddling two chunks
  runs with the one earlier in the order. With small chunks (few M-tiles) L2 reuse of B drops.

Hooks (constexpr, compiled away when off; :func:`gemm_hooked_kernel` only):

* ``WAIT``: before loading the A rows of a tile, wait until ``wait_signal[c] >= wait_gen`` for
  every chunk ``c`` the tile's rows touch (acquire, system scope, bounded; see signals.py).
  Signals only grow during a call, so each program polls a chunk once.
* ``EPILOGUE``: store the finished tile to the destination of each row's chunk instead of ``c``:
  row ``r`` of chunk ``q`` goes to ``c + dest_offs[q] + (r - q*chunk_m)*stride_dm`` (element
  offsets from a common origin ``c``, so peer buffers work), then count the tile in
  ``counters[q]`` (acq_rel, GPU scope); the program that counts the chunk's last tile publishes
  ``*signal_ptrs[q] = epi_gen`` (release, sys) and resets the counter to zero for the next call.
  A tile is counted after the next tile's main loop, when its stores have drained, so the
  release costs no stall; the publication comes one tile later. Where every tile lies in one
  chunk (EPI_COUNT=3) the count is a ``red.release.gpu`` that returns nothing (ptxas waits for
  a returning atomic's result at the loop's next iteration), and the program that stored the
  chunk's poll tile polls the chunk once per tile and publishes it; at its end it hands the
  chunk off, and every program's end publishes handed-off chunks whose count is complete
  (``_count_red``, ``_poll_chunk``, ``_take_poll``, ``_end_counts``). EPI_COUNT=4 (flattened
  tile loops) makes that count COUNT_STEP K-steps into the next tile's main loop instead, under
  its MMAs, so the chunk is published most of a tile earlier (``_count_in_loop``).
  Destinations stacked as one tensor's rows store through one descriptor (EPI_TMA_STACKED).
  That is ``EPILOGUE == EPI_SIGNALLED``; ``EPI_ROUTE`` (an EpilogueSpec without signals) makes
  the stores only: nothing counted, nothing published.

Per-tile timeline (``RECORD_TILES`` constexpr, compiled away when off; tile_records.py): tile
``pid_m * num_pid_n + pid_n``'s row of ``tile_records`` gets its program, SM and the clock
before its wait hook (start), after it (wait done) and after its stores were issued (end),
written once after the stores. The epilogue hook counts and publishes a tile a tile later
(above), so that falls in the next tile's span, or after the program's last one. A tile shared
out by K-steps (stream-K) is recorded by the segment that completes and stores it. In a
flattened loop (FLATTEN) the next tile's first loads are issued before this tile's end is read.

Three granularities stay separate: CTA tile (BLOCK_M/N/K), epilogue subtile (EPI_SUBTILE
column slices of the tile per store), communication chunk (chunk_m rows, num_chunks).

FLATTEN (configs with ``flatten=True``): Triton fuses the tile loop and the K loop into one
pipelined loop, so the next tile's loads (and its prologue: coordinates, wait hook) run ahead of
this tile's epilogue. It does so only when the tile loop holds exactly one loop and no
``tl.debug_barrier``: hence the owner order's closed form, the hooks' chunk loops inside an
``if``, ``cta_barrier`` and ``_carry`` (docs/gemm_core.md, "Kernels"; CPU test
``test_offline_hooked_kernels_flatten_into_one_pipelined_loop``).

No @triton.jit helpers of triton.language.standard here (tl.cdiv, tl.zeros): the interpreter
cannot call them when triton was imported before TRITON_INTERPRET=1 was set (tests/conftest.py
imports tpfuse, which imports torch._dynamo, which imports triton).
"""
import triton
import triton.language as tl

from . import abi

from .signals import (HANDOFF, bulk_writes_done, count_release_red, count_release_red_if, cta_barrier,
                      cta_barrier_if, handoff_red,
                      poll_publish, poll_read, publish_handed_off, record_timeout, reset_and_publish,
                      wait_geq)
from .tile_records import record_tile, tile_clock

# EPI_COUNT=3 is taken with at most this many chunks (the end of a program checks them all at
# once) and fewer tiles than this in all (a chunk's count must stay below its HANDOFF bit)
MAX_POLLED_CHUNKS = tl.constexpr(abi.MAX_POLLED_CHUNKS)
MAX_COUNTED_TILES = HANDOFF
# EPI_TMA value for destinations stacked as one tensor's rows (chunk c's destination starts at
# row c * chunk_m of the first one's): one descriptor, epi_d0, over all M rows, so a tile is
# stored at its own row as the plain output is (one code path instead of one per chunk)
EPI_TMA_STACKED = tl.constexpr(abi.EPI_TMA_STACKED)
EPI_SIGNALLED = tl.constexpr(abi.EPI_SIGNALLED)
# EPI_COUNT=4: the previous tile is counted at this K-step of the next tile's main loop (or its
# last, if it has fewer): late enough for the previous tile's TMA stores to have drained, and
# with this K-step's MMAs in flight, so the release's fence waits under them
COUNT_STEP = tl.constexpr(abi.COUNT_STEP)
# SCALE_A / SCALE_B (kernels/_types.py): no scale, one value, one per row of a / column of b
SCALE_NONE = tl.constexpr(0)
SCALE_TENSOR = tl.constexpr(1)
SCALE_VECTOR = tl.constexpr(2)


@triton.jit
def _grouped(local, rows, num_pid_n, GROUP_M: tl.constexpr):
    # GROUP_M swizzle on a rows x num_pid_n grid: column-major inside groups of GROUP_M rows.
    num_in_group = GROUP_M * num_pid_n
    group_id = local // num_in_group
    first_m = group_id * GROUP_M
    group_rows = tl.minimum(rows - first_m, GROUP_M)
    pid_m = first_m + (local % num_in_group) % group_rows
    pid_n = (local % num_in_group) // group_rows
    return pid_m, pid_n


@triton.jit
def _segment_start(c, start_chunk, t0, chunk_m, num_pid_m, BLOCK_M: tl.constexpr):
    """Owner order: rotated position of the first M-tile that starts in chunk ``c`` (c != start_chunk)."""
    r = (c * chunk_m + BLOCK_M - 1) // BLOCK_M - t0
    r = tl.where(c < start_chunk, r + num_pid_m, r)
    return tl.minimum(tl.maximum(r, 0), num_pid_m)


@triton.jit
def _tile_coords(tile_id, M, num_pid_m, num_pid_n, chunk_m, num_chunks, start_chunk,
                 BLOCK_M: tl.constexpr, GROUP_M: tl.constexpr, TILE_ORDER: tl.constexpr):
    """Tile id in tile-order space -> (pid_m, pid_n)."""
    if TILE_ORDER == 0:
        pid_m, pid_n = _grouped(tile_id, num_pid_m, num_pid_n, GROUP_M)
    elif TILE_ORDER == 1:
        # round: the grouped order over M-tile rows rotated to start at start_chunk's first row
        t0 = (start_chunk * chunk_m) // BLOCK_M
        pos_m, pid_n = _grouped(tile_id, num_pid_m, num_pid_n, GROUP_M)
        pid_m = (pos_m + t0) % num_pid_m
    else:
        # Rotated M-tile positions p = (pid_m - t0) mod num_pid_m. Chunk c's segment covers
        # positions [R(c), R(next chunk)): from the first M-tile that starts in chunk c up to the
        # one holding its last row, so a tile straddling two chunks runs with the earlier one in
        # the order; the tile at position 0 runs with start_chunk. Closed form, no loop over
        # chunks: a loop here would keep Triton from flattening the tile and K loops (FLATTEN).
        t0 = (start_chunk * chunk_m) // BLOCK_M
        pos = tile_id // num_pid_n
        first_row = ((pos + t0) % num_pid_m) * BLOCK_M
        c = tl.where(pos == 0, start_chunk, tl.minimum(first_row // chunk_m, num_chunks - 1))
        nxt = (c + 1) % num_chunks
        seg_lo = tl.where(c == start_chunk, 0, _segment_start(c, start_chunk, t0, chunk_m, num_pid_m, BLOCK_M))
        seg_hi = tl.where(nxt == start_chunk, num_pid_m,
                          _segment_start(nxt, start_chunk, t0, chunk_m, num_pid_m, BLOCK_M))
        local = tile_id - seg_lo * num_pid_n
        pos_m, pid_n = _grouped(local, seg_hi - seg_lo, num_pid_n, GROUP_M)
        pid_m = (seg_lo + pos_m + t0) % num_pid_m
    return pid_m, pid_n

@triton.jit
def _store_rows(base, rows, offs_n, vals, row_lo, row_hi, N, stride_m, stride_n):
    """Masked store of a [BM, BN'] block; rows outside [row_lo, row_hi) or cols >= N skipped."""
    mask = ((rows >= row_lo) & (rows < row_hi))[:, None] & (offs_n < N)[None, :]
    ptrs = base + (rows - row_lo)[:, None] * stride_m + offs_n[None, :] * stride_n
    tl.store(ptrs, vals, mask=mask)

@triton.jit
def _scale_tile(acc, offs_m, offs_n, M, N, scale_a, scale_b, SCALE_A: tl.constexpr, SCALE_B: tl.constexpr):
    """``acc * scale_a * scale_b`` in fp32 (torch._scaled_mm's meaning): a tensor-wise pair
    multiplies by their product, a row-wise scale of A by ``scale_a[global row]``, a
    column-wise scale of B by ``scale_b[column]``. Nothing without scales."""
    if SCALE_A == SCALE_TENSOR and SCALE_B == SCALE_TENSOR:
        acc = acc * (tl.load(scale_a) * tl.load(scale_b))
    else:
        if SCALE_A == SCALE_TENSOR:
            acc = acc * tl.load(scale_a)
        elif SCALE_A == SCALE_VECTOR:
            acc = acc * tl.load(scale_a + offs_m, mask=offs_m < M, other=0.0)[:, None]
        if SCALE_B == SCALE_TENSOR:
            acc = acc * tl.load(scale_b)
        elif SCALE_B == SCALE_VECTOR:
            acc = acc * tl.load(scale_b + offs_n, mask=offs_n < N, other=0.0)[None, :]
    return acc


@triton.jit
def _epilogue_store(acc, c, off_m, off_n, M, N, stride_cm, dest_offs, stride_dm, chunk_m, num_chunks,
                    epi_descs, scale_a, scale_b,
                    C_DTYPE: tl.constexpr, SUB_N: tl.constexpr, SUB_IDX: tl.constexpr,
                    USE_TMA: tl.constexpr, EPILOGUE: tl.constexpr, DEST_ALIGNED: tl.constexpr,
                    EPI_TMA: tl.constexpr, SCALE_A: tl.constexpr, SCALE_B: tl.constexpr):
    """Scale and store one column subtile (SUB_IDX-th slice of SUB_N columns)."""
    offs_m = off_m + tl.arange(0, acc.shape[0])
    offs_n = off_n + SUB_IDX * SUB_N + tl.arange(0, SUB_N)
    vals = _scale_tile(acc, offs_m, offs_n, M, N, scale_a, scale_b, SCALE_A, SCALE_B).to(C_DTYPE)
    if EPILOGUE and EPI_TMA == EPI_TMA_STACKED:
        epi_descs[0].store([off_m, off_n + SUB_IDX * SUB_N], vals)
    elif EPILOGUE and EPI_TMA > 0:
        # One TMA descriptor per chunk, over that chunk's rows of its destination. The host
        # takes this path only when chunk_m is a multiple of BLOCK_M, so every tile lies in one
        # chunk (a straddling tile would need a negative row coordinate for its later chunk,
        # which TMA stores do not take: illegal instruction on the H200). At the top level of
        # the tile loop, so Triton gives the store a staging buffer of its own and the next
        # tile's loads need not wait for it.
        q_tile = off_m // chunk_m
        for q in tl.static_range(EPI_TMA):
            if q == q_tile:
                epi_descs[q].store([off_m - q * chunk_m, off_n + SUB_IDX * SUB_N], vals)
    elif EPILOGUE:
        # One store for the whole subtile even when it straddles chunks: row r goes to
        # c (the destinations' common origin) + dest_offs[chunk(r)] + its row in the chunk.
        row_chunk = tl.minimum(offs_m // chunk_m, num_chunks - 1)
        row_off = tl.load(dest_offs + row_chunk) + (offs_m - row_chunk * chunk_m).to(tl.int64) * stride_dm
        if DEST_ALIGNED > 0:   # host checked: every offset and the row stride are 16-byte multiples
            row_off = tl.multiple_of(row_off, DEST_ALIGNED)
        ptrs = c + row_off[:, None] + offs_n[None, :]
        tl.store(ptrs, vals, mask=(offs_m < M)[:, None] & (offs_n < N)[None, :])
    elif USE_TMA:
        c.store([off_m, off_n + SUB_IDX * SUB_N], vals)
    else:
        # unit column stride (checked on the host), so the compiler can vectorize
        _store_rows(c, offs_m, offs_n, vals, 0, M, N, stride_cm, 1)


@triton.jit
def _store_tile(acc, c, off_m, off_n, M, N, stride_cm, dest_offs, stride_dm, chunk_m, num_chunks, epi_descs,
                scale_a, scale_b, ws, q_first, q_last, first_slot, total_steps, num_progs,
                C_DTYPE: tl.constexpr, EPI_SUBTILE: tl.constexpr, USE_TMA: tl.constexpr,
                EPILOGUE: tl.constexpr, DEST_ALIGNED: tl.constexpr, EPI_TMA: tl.constexpr,
                SCALE_A: tl.constexpr, SCALE_B: tl.constexpr, FROM_WS: tl.constexpr):
    """Store one tile in EPI_SUBTILE column slices: the fp32 tile ``acc`` held in registers or,
    FROM_WS (stream-K), each slice summed from the workspace partials of programs
    ``q_first..q_last`` (:func:`_sum_segments`; ``acc`` then only gives the tile's shape). A tile
    in registers is scaled whole before it is sliced: each row-/column-wise scale is loaded once
    per tile, before the first slice's store (per slice, the second slice's column scales were
    loaded after the first slice's store, in the accumulator's replicated layout: 136 global
    loads and 231 registers per thread on the tuned 8B fc2 config against 14 and 191)."""
    BLOCK_M: tl.constexpr = acc.shape[0]
    BLOCK_N: tl.constexpr = acc.shape[1]
    SUB_N: tl.constexpr = BLOCK_N // EPI_SUBTILE
    SA: tl.constexpr = SCALE_A if FROM_WS else SCALE_NONE
    SB: tl.constexpr = SCALE_B if FROM_WS else SCALE_NONE
    if not FROM_WS:
        # the whole tile scaled at once: every scale load issued before the first subtile's store
        acc = _scale_tile(acc, off_m + tl.arange(0, BLOCK_M), off_n + tl.arange(0, BLOCK_N), M, N, scale_a, scale_b,
                          SCALE_A, SCALE_B)
        if EPI_SUBTILE == 2:
            acc_lo, acc_hi = tl.split(tl.permute(tl.reshape(acc, (BLOCK_M, 2, SUB_N)), (0, 2, 1)))
    for s in tl.static_range(EPI_SUBTILE):
        if FROM_WS:
            vals = _sum_segments(ws, q_first, q_last, first_slot, total_steps, num_progs, s, BLOCK_M, BLOCK_N, SUB_N)
        elif EPI_SUBTILE == 1:
            vals = acc
        elif s == 0:
            vals = acc_lo
        else:
            vals = acc_hi
        _epilogue_store(vals, c, off_m, off_n, M, N, stride_cm, dest_offs, stride_dm, chunk_m, num_chunks,
                        epi_descs, scale_a, scale_b, C_DTYPE, SUB_N, s, USE_TMA, EPILOGUE, DEST_ALIGNED, EPI_TMA,
                        SA, SB)


@triton.jit
def _count_and_publish(c_lo, c_hi, M, chunk_m, num_pid_n, counters, signal_ptrs, epi_gen, status,
                       BLOCK_M: tl.constexpr, EPI_TMA: tl.constexpr, EPI_COUNT: tl.constexpr,
                       USE_ASM: tl.constexpr):
    """Count one stored tile in every chunk it touches; the chunk's last tile publishes it.

    The count is acq_rel at GPU scope: every program counting lives on this GPU, and the
    publishing program's system-scope release is cumulative (PTX memory model: causality order
    runs through the GPU-scope release/acquire pairs of the count into the system-scope pair
    of the signal), so a peer that acquires the signal sees every tile of the chunk, wherever
    its stores went. EPI_COUNT: 1 = that GPU-scope count, read at once (abi.EPI_COUNT_RETURNING);
    3 and 4 (the default where the host allows them) take _count_and_poll or _count_in_loop in
    the tile loops and _end_counts after them instead."""
    # (the loop sits inside an ``if``, so that the tile loop can still be flattened)
    if c_hi >= c_lo:
        _tile_stores_done(EPI_TMA, USE_ASM)
        for cc in range(c_lo, c_hi + 1):
            tiles_in_chunk = _tiles_in_chunk(cc, M, chunk_m, num_pid_n, BLOCK_M)
            done = tl.atomic_add(counters + cc, 1, sem="acq_rel", scope="gpu")
            if done == tiles_in_chunk - 1:
                # Last tile of chunk cc: this program has acquired every other tile's release,
                # so its release publishes the whole chunk.
                reset_and_publish(counters + cc, signal_ptrs + cc, epi_gen, status == 0)


@triton.jit
def _tile_stores_done(EPI_TMA: tl.constexpr, USE_ASM: tl.constexpr):
    """Before a tile's count: every thread's stores of the tile happen before the release that
    follows. A tile that went out by TMA (async proxy) is first waited for until its writes are
    done, not only read out of shared memory, and ordered before the generic release."""
    if EPI_TMA > 0:
        bulk_writes_done()
    cta_barrier(USE_ASM)


@triton.jit
def _tiles_in_chunk(cc, M, chunk_m, num_pid_n, BLOCK_M: tl.constexpr):
    row_end = tl.minimum((cc + 1) * chunk_m, M)
    return ((row_end - 1) // BLOCK_M - (cc * chunk_m) // BLOCK_M + 1) * num_pid_n


@triton.jit
def _count_red(pend_lo, pend_hi, pend_n, counters, EPI_TMA: tl.constexpr, USE_ASM: tl.constexpr):
    """EPI_COUNT=3 and 4: count the ``pend_n`` stored tiles of chunk ``pend_lo`` (tiles never
    straddle chunks here; ``pend_hi < pend_lo``: nothing to count) with a release that returns
    nothing, so no warp waits for it."""
    if pend_hi >= pend_lo:
        _tile_stores_done(EPI_TMA, USE_ASM)
        count_release_red(counters + pend_lo, pend_n, USE_ASM)


@triton.jit
def _poll_chunk(q, seen, sig, M, chunk_m, num_pid_n, counters, epi_gen, status, BLOCK_M: tl.constexpr,
                USE_ASM: tl.constexpr):
    """EPI_COUNT=3 and 4: publish chunk ``q`` (-1: none) to its signal at ``sig`` if ``seen`` (its
    counter; both as :func:`poll_read` found them) says its count is complete; returns -1 once
    published, else ``q`` (see :func:`poll_publish`)."""
    return poll_publish(q, seen, sig, counters + q, _tiles_in_chunk(q, M, chunk_m, num_pid_n, BLOCK_M),
                        epi_gen, (status == 0).to(tl.int32), USE_ASM)


@triton.jit
def _take_poll(pend_poll, pend_lo, poll_q, counters, USE_ASM: tl.constexpr):
    """EPI_COUNT=3 and 4, after counting the previous tile: if it was its chunk's poll tile, poll that
    chunk from now on (a chunk still polled is handed off first: rare, a program with few
    tiles per chunk gets there only with very few programs). Returns the chunk to poll.
    Selects, not branches: with USE_ASM only the last thread's ``poll_q`` is meaningful."""
    handoff_red(tl.where(pend_poll != 0, poll_q, -1), counters + poll_q, USE_ASM)
    return tl.where(pend_poll != 0, pend_lo, poll_q)


@triton.jit
def _count_and_poll(pend_lo, pend_hi, pend_n, pend_poll, poll_q, M, chunk_m, num_pid_n, counters, signal_ptrs,
                    epi_gen, status, BLOCK_M: tl.constexpr, EPI_TMA: tl.constexpr, USE_ASM: tl.constexpr):
    """EPI_COUNT=3, once per tile after the tile loop's main loop: count the pending stored
    tiles (``pend_*``), then poll the chunk this program polls and publish it if complete.
    The program that stored a chunk's poll tile polls the chunk once per tile from its next
    tile on (_end_counts after the loop hands it off). Returns the chunk polled from now on."""
    seen, sig = poll_read(poll_q, counters + poll_q, signal_ptrs + poll_q, USE_ASM)   # read across the count
    _count_red(pend_lo, pend_hi, pend_n, counters, EPI_TMA, USE_ASM)
    poll_q = _poll_chunk(poll_q, seen, sig, M, chunk_m, num_pid_n, counters, epi_gen, status, BLOCK_M,
                         USE_ASM)
    return _take_poll(pend_poll, pend_lo, poll_q, counters, USE_ASM)


@triton.jit
def _end_counts(poll_q, M, chunk_m, num_chunks, num_pid_n, counters, signal_ptrs, epi_gen, status,
                BLOCK_M: tl.constexpr, USE_ASM: tl.constexpr):
    """EPI_COUNT=3 and 4, at the program's end, after its last count: hand off the chunk it still
    polls, and publish every chunk whose count is complete with its poller gone. Whichever of
    a chunk's last count and its handoff comes later in the counter's coherence order, its
    program reads "complete + HANDOFF" here after the CTA barrier below (the other one's
    program may too: a chunk can be published twice, with the same generation). Nobody
    spins, so programs need not be co-resident (MPS, other kernels on the GPU); and a
    program's end costs one round trip (the reads), plus a system-scope fence where it
    publishes."""
    handoff_red(poll_q, counters + poll_q, USE_ASM)
    # the last thread's counts and handoff happen before every thread's reads below
    cta_barrier(USE_ASM)
    cs = tl.arange(0, MAX_POLLED_CHUNKS)
    publish_handed_off(counters + cs, signal_ptrs + cs,
                       _tiles_in_chunk(cs, M, chunk_m, num_pid_n, BLOCK_M), (cs < num_chunks).to(tl.int32),
                       epi_gen, (status == 0).to(tl.int32), USE_ASM)


@triton.jit
def _is_poll_tile(off_m, off_n, c_lo, M, chunk_m, num_pid_n, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """1 for the tile whose program polls chunk ``c_lo`` (EPI_COUNT 3, 4): the chunk's last M-tile
    row, last column -- the chunk's last tile in the owner and grouped orders, so by the time
    its program polls, the chunk's other tiles have mostly been counted."""
    last_row = tl.minimum((c_lo + 1) * chunk_m, M) - 1
    return ((off_n // BLOCK_N == num_pid_n - 1) & (off_m // BLOCK_M == last_row // BLOCK_M)).to(tl.int32)


@triton.jit
def _wait_chunks(c_lo, c_hi, tile_id, wait_signal, wait_gen, wait_timeout, err_ptr, status, verified,
                 USE_ASM: tl.constexpr):
    """WAIT hook of one tile: poll every chunk its rows touch that this program has not yet seen
    ready. Signals only grow within a call, so a chunk seen ready stays ready: bit c of
    `verified` marks it (chunks >= 62 are polled every time). The loop sits inside an ``if``:
    a second loop directly in the tile loop would keep Triton from flattening it (FLATTEN)."""
    if status == 0:
        for cc in range(c_lo, c_hi + 1):
            bit = tl.where(cc < 62, tl.full((), 1, tl.int64) << tl.minimum(cc, 61).to(tl.int64), 0)
            if ((verified & bit) == 0) & (status == 0):
                st, seen = wait_geq(wait_signal + cc, wait_gen, wait_timeout, err_ptr, USE_ASM)
                if st == 1:
                    record_timeout(err_ptr, tile_id, cc, wait_gen, seen)
                status = st
                if st == 0:
                    verified = verified | bit
    return status, verified


@triton.jit
def _tile_start(tile_id, M, num_pid_m, num_pid_n, chunk_m, num_chunks, start_chunk, wait_signal,
                wait_gen, wait_timeout, err_ptr, status, verified, BLOCK_M: tl.constexpr,
                BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr, TILE_ORDER: tl.constexpr,
                WAIT: tl.constexpr, EPILOGUE: tl.constexpr, USE_ASM: tl.constexpr):
    """A tile's corner, the chunks its rows touch (hooks only) and, with WAIT, its wait hook:
    (off_m, off_n, c_lo, c_hi, status, verified)."""
    pid_m, pid_n = _tile_coords(tile_id, M, num_pid_m, num_pid_n, chunk_m, num_chunks,
                                start_chunk, BLOCK_M, GROUP_M, TILE_ORDER)
    off_m = pid_m * BLOCK_M
    off_n = pid_n * BLOCK_N
    if WAIT or EPILOGUE:
        c_lo = off_m // chunk_m
        c_hi = (tl.minimum(off_m + BLOCK_M, M) - 1) // chunk_m
    else:
        c_lo = 0
        c_hi = 0
    if WAIT:
        status, verified = _wait_chunks(c_lo, c_hi, tile_id, wait_signal, wait_gen, wait_timeout,
                                        err_ptr, status, verified, USE_ASM)
    return off_m, off_n, c_lo, c_hi, status, verified


@triton.jit
def _next_in_segment(work_id, num_progs, num_work, c, M, chunk_m, num_chunks, start_chunk, num_pid_n,
                     BLOCK_M: tl.constexpr, TILE_ORDER: tl.constexpr):
    """EPI_COUNT=4: whether this program's next tile (``work_id + num_progs``) exists and lies in
    chunk ``c`` too. In the owner order chunk ``c``'s tiles are one segment of the order, found
    in closed form (every chunk but the last, by index, has ``chunk_m / BLOCK_M`` M-tile rows:
    ``chunk_m % BLOCK_M == 0`` here); other orders never merge."""
    if TILE_ORDER == 2:
        full = (chunk_m // BLOCK_M) * num_pid_n
        last = _tiles_in_chunk(num_chunks - 1, M, chunk_m, num_pid_n, BLOCK_M)
        rank = (c - start_chunk + num_chunks) % num_chunks
        rank_last = (num_chunks - 1 - start_chunk + num_chunks) % num_chunks
        seg_start = rank * full - tl.where(rank_last < rank, full - last, 0)
        seg_end = seg_start + tl.where(c == num_chunks - 1, last, full)
        return work_id + num_progs < tl.minimum(seg_end, num_work)
    else:
        return work_id < 0


@triton.jit
def _carry(x, USE_ASM: tl.constexpr):
    """``x`` through an opaque move, for a value that the tile loop carries to its next tile and
    that the epilogue sets from one the prologue computed (``pend_lo = c_lo``). Triton 3.6's
    loop flattening (FLATTEN) mishandles a loop-carried value that is yielded straight from the
    prologue: the fused loop updates it on the tile's first K-step instead of its last, so the
    epilogue would count the current tile instead of the previous one. (It also fails to
    compile a body that ends in an ``if`` using a value made after the K loop, as the per-chunk
    TMA stores do; the move after them avoids that too.) No flattening without USE_ASM."""
    if USE_ASM:
        x = tl.inline_asm_elementwise("mov.u32 $0, $1;", "=r,r", [x], dtype=tl.int32,
                                      is_pure=False, pack=1)
    return x


@triton.jit
def _count_in_loop(now, cnt_lo, cnt_n, poll_q, counters, signal_ptrs, seen, sig,
                   EPI_TMA: tl.constexpr, USE_ASM: tl.constexpr):
    """EPI_COUNT=4, in the main loop: if ``now``, count the ``cnt_n`` (0: none) stored tiles of
    chunk ``cnt_lo`` (as :func:`_count_red`) and read the polled chunk's counter and signal
    address (as :func:`poll_read`); returns the ``(seen, sig)`` read, else the ones passed in.
    One ``if`` on ``now``, the rest predicated inside the PTX on ``cnt_n``: Triton 3.6 does not
    software-pipeline a flattened loop (FLATTEN) whose K-step body holds a nested ``if``, or a
    comparison of the tile loop's carried values (offline sm_90 compile)."""
    if now:
        if EPI_TMA > 0:
            bulk_writes_done()   # waits for nothing when nothing is left to wait for
        cta_barrier_if(cnt_n, USE_ASM)
        count_release_red_if(cnt_n, counters + cnt_lo, cnt_n, USE_ASM)
        seen, sig = poll_read(poll_q, counters + poll_q, signal_ptrs + poll_q, USE_ASM)
    return seen, sig


@triton.jit
def _mainloop(a, b, off_m, off_n, k_lo, k_hi, M, N, K, stride_am, stride_ak, stride_bk, stride_bn,
              cnt_lo, cnt_n, poll_q, counters, signal_ptrs,
              BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
              USE_TMA: tl.constexpr, B_KMAJOR: tl.constexpr, DOT_FP32: tl.constexpr,
              COUNT: tl.constexpr, EPI_TMA: tl.constexpr, USE_ASM: tl.constexpr):
    """fp32 sum over BLOCK_K steps [k_lo, k_hi) of one tile's A-rows x B-columns.

    COUNT (EPI_COUNT=4): at K-step ``k_lo + COUNT_STEP`` (or the last) also count the
    ``cnt_n`` (0: none) stored tiles of chunk ``cnt_lo``, right after that step's MMAs were
    issued, and read chunk ``poll_q``'s counter and signal address for the epilogue's
    :func:`_poll_chunk`. Returns ``(acc, seen, sig)`` (``-1, 0`` without COUNT)."""
    acc = tl.full((BLOCK_M, BLOCK_N), 0.0, tl.float32)
    seen = tl.full((), -1, tl.int32)
    sig = tl.full((), 0, tl.int64)
    k_count = tl.minimum(k_lo + COUNT_STEP, k_hi - 1)
    if USE_TMA:
        for ki in range(k_lo, k_hi):
            off_k = ki * BLOCK_K
            a_blk = a.load([off_m, off_k])
            if B_KMAJOR:
                b_blk = b.load([off_n, off_k]).T
            else:
                b_blk = b.load([off_k, off_n])
            acc = tl.dot(a_blk, b_blk, acc)
            if COUNT:
                seen, sig = _count_in_loop(ki == k_count, cnt_lo, cnt_n, poll_q, counters, signal_ptrs, seen, sig,
                                           EPI_TMA, USE_ASM)
    else:
        offs_k0 = tl.arange(0, BLOCK_K)
        offs_am = off_m + tl.arange(0, BLOCK_M)
        offs_bn = off_n + tl.arange(0, BLOCK_N)
        offs_am = tl.where(offs_am < M, offs_am, 0)   # clamp instead of masking rows
        offs_bn = tl.where(offs_bn < N, offs_bn, 0)
        for ki in range(k_lo, k_hi):
            offs_k = ki * BLOCK_K + offs_k0
            a_blk = tl.load(a + offs_am[:, None] * stride_am + offs_k[None, :] * stride_ak,
                            mask=(offs_k < K)[None, :], other=0.0)
            b_blk = tl.load(b + offs_k[:, None] * stride_bk + offs_bn[None, :] * stride_bn,
                            mask=(offs_k < K)[:, None], other=0.0)
            if DOT_FP32:
                # TRITON_INTERPRET=1 (triton 3.6) multiplies bf16 bit patterns as integers
                # in tl.dot; exact fp32 products of the same bf16/fp16 values avoid it.
                a_blk = a_blk.to(tl.float32)
                b_blk = b_blk.to(tl.float32)
            acc = tl.dot(a_blk, b_blk, acc)
            if COUNT:
                seen, sig = _count_in_loop(ki == k_count, cnt_lo, cnt_n, poll_q, counters, signal_ptrs, seen, sig,
                                           EPI_TMA, USE_ASM)
    return acc, seen, sig


@triton.jit
def _sum_segments(ws, q_first, q_last, first_slot, total_steps, num_progs, SUB_IDX: tl.constexpr,
                  BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, SUB_N: tl.constexpr):
    """Stream-K: sum of the partials of one tile's column subtile SUB_IDX, held by programs
    q_first..q_last (slot `first_slot` of q_first, slot 0 of the others; programs whose run
    is empty -- more programs than steps -- hold none), in program order."""
    offs = (tl.arange(0, BLOCK_M)[:, None] * BLOCK_N
            + (tl.arange(0, SUB_N) + SUB_IDX * SUB_N)[None, :])
    q64 = q_first.to(tl.int64)
    total = tl.load(ws + (q64 * 2 + first_slot) * (BLOCK_M * BLOCK_N) + offs, cache_modifier=".cg")
    for j in tl.range(1, q_last - q_first + 1, num_stages=1):
        q = q64 + j
        if (q * total_steps) // num_progs < ((q + 1) * total_steps) // num_progs:
            # .cg reads at L2, where the other programs' stores went: never a stale L1 line
            total += tl.load(ws + q * (2 * BLOCK_M * BLOCK_N) + offs, cache_modifier=".cg")
    return total


@triton.jit
def _count_previous(pend_lo, pend_hi, pend_n, pend_poll, poll_q, c_lo, seen, sig, M, chunk_m, num_pid_n,
                    counters, signal_ptrs, epi_gen, status, BLOCK_M: tl.constexpr, EPI_TMA: tl.constexpr,
                    EPI_COUNT: tl.constexpr, USE_ASM: tl.constexpr):
    """Epilogue hook, after a whole tile's main loop (its chunks start at ``c_lo``): count the
    previous stored tiles now -- their stores have drained during this main loop, so the
    release costs no wait (publication is a tile later). Returns ``(poll_q, merge)``: the chunk
    polled from now on, and (EPI_COUNT=3) whether the pending tiles wait for this one."""
    merge = pend_lo < 0
    if EPI_COUNT == 4:
        # ... or rather, they were counted a few K-steps into this main loop, under its MMAs;
        # poll with what was read there
        poll_q = _poll_chunk(poll_q, seen, sig, M, chunk_m, num_pid_n, counters, epi_gen, status,
                             BLOCK_M, USE_ASM)
        poll_q = _take_poll(pend_poll, pend_lo, poll_q, counters, USE_ASM)
    elif EPI_COUNT == 3:
        # ... with a release that returns nothing, so no warp waits for it. Pending tiles of
        # this tile's chunk wait for it and are counted with it, a tile later (the chunk cannot
        # be complete before this tile is counted anyway): one release, and one fence, per run
        # of a program's tiles in one chunk.
        merge = (pend_hi >= pend_lo) & (pend_lo == c_lo) & (pend_poll == 0)
        poll_q = _count_and_poll(pend_lo, tl.where(merge, pend_lo - 1, pend_hi), pend_n, pend_poll,
                                 poll_q, M, chunk_m, num_pid_n, counters, signal_ptrs, epi_gen,
                                 status, BLOCK_M, EPI_TMA, USE_ASM)
    else:
        _count_and_publish(pend_lo, pend_hi, M, chunk_m, num_pid_n, counters, signal_ptrs,
                           epi_gen, status, BLOCK_M, EPI_TMA, EPI_COUNT, USE_ASM)
    return poll_q, merge


@triton.jit
def _pend_stored(off_m, off_n, c_lo, c_hi, pend_poll, pend_n, cnt_n, merge, work_id, num_progs, num_work, M,
                 chunk_m, num_chunks, start_chunk, num_pid_n, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                 TILE_ORDER: tl.constexpr, EPI_COUNT: tl.constexpr, USE_ASM: tl.constexpr):
    """Epilogue hook, after a whole tile's stores: the tile becomes the pending one the next
    tile counts. Returns ``(pend_lo, pend_hi, pend_poll, pend_n, cnt_n)``, each through
    :func:`_carry`."""
    pend_lo = _carry(c_lo, USE_ASM)
    pend_hi = _carry(c_hi, USE_ASM)
    if EPI_COUNT >= 3:
        pend_poll = _carry(_is_poll_tile(off_m, off_n, c_lo, M, chunk_m, num_pid_n, BLOCK_M, BLOCK_N), USE_ASM)
    if EPI_COUNT == 4:
        # The run of pending tiles grows by this tile if this main loop did not count it
        # (cnt_n == 0: merged). It is counted in the next tile's main loop unless that tile
        # lies in this chunk too and this is no poll tile -- decided here, a tile ahead: a
        # count inside the K-steps can only take values the tile loop carries (see
        # _count_in_loop).
        run_n = tl.where((pend_n > 0) & (cnt_n == 0), pend_n + 1, 1)
        merge_next = (_next_in_segment(work_id, num_progs, num_work, c_lo, M, chunk_m, num_chunks,
                                       start_chunk, num_pid_n, BLOCK_M, TILE_ORDER)
                      & (_is_poll_tile(off_m, off_n, c_lo, M, chunk_m, num_pid_n, BLOCK_M, BLOCK_N) == 0))
        pend_n = _carry(run_n, USE_ASM)
        cnt_n = _carry(tl.where(merge_next, 0, run_n), USE_ASM)
    elif EPI_COUNT == 3:
        pend_n = _carry(tl.where(merge, pend_n + 1, 1), USE_ASM)
    return pend_lo, pend_hi, pend_poll, pend_n, cnt_n


@triton.jit
def _kloop(a, b, off_m, off_n, k_lo, k_hi, M, N, K, stride_am, stride_ak, stride_bk, stride_bn,
           BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
           USE_TMA: tl.constexpr, B_KMAJOR: tl.constexpr, DOT_FP32: tl.constexpr):
    """:func:`_mainloop` without the epilogue hook's in-loop count: the fp32 tile."""
    acc, _, _ = _mainloop(a, b, off_m, off_n, k_lo, k_hi, M, N, K, stride_am, stride_ak, stride_bk, stride_bn,
                          0, 0, 0, a, a, BLOCK_M, BLOCK_N, BLOCK_K, USE_TMA, B_KMAJOR, DOT_FP32,
                          False, 0, False)
    return acc


@triton.jit
def _tile_corner(tile_id, M, num_pid_m, num_pid_n, chunk_m, num_chunks, start_chunk, BLOCK_M: tl.constexpr,
                 BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr, TILE_ORDER: tl.constexpr):
    """(off_m, off_n) of tile ``tile_id`` of the tile order."""
    pid_m, pid_n = _tile_coords(tile_id, M, num_pid_m, num_pid_n, chunk_m, num_chunks, start_chunk,
                                BLOCK_M, GROUP_M, TILE_ORDER)
    return pid_m * BLOCK_M, pid_n * BLOCK_N


@triton.jit
def _sk_run(start_pid, num_progs, sk_tiles, k_tiles):
    """Stream-K: the ``sk_tiles * k_tiles`` K-steps of the shared tiles are cut into
    ``num_progs`` equal runs, one per program, so every SM gets the same work. This program's
    run ``[lo, hi)`` covers pieces of consecutive tiles ("segments"): returns ``(lo, hi,
    first_idx, num_segs, total_steps)``, segment ``s`` being the part of shared tile
    ``first_idx + s`` in the run."""
    total_steps = sk_tiles * k_tiles
    lo = (start_pid * total_steps) // num_progs
    hi = ((start_pid + 1) * total_steps) // num_progs
    first_idx = lo // k_tiles
    num_segs = tl.where(hi > lo, (hi - 1) // k_tiles - first_idx + 1, 0)
    return lo, hi, first_idx, num_segs, total_steps


@triton.jit
def _sk_segment(seg, first_idx, lo, hi, k_tiles):
    """Segment ``seg`` of this program's run: ``(sk_idx, it, k_lo, k_hi)``: shared tile
    ``sk_idx``, the run's first step in it (``it``) and its K-steps ``[k_lo, k_hi)``."""
    sk_idx = first_idx + seg
    it = tl.maximum(lo, sk_idx * k_tiles)
    k_lo = it - sk_idx * k_tiles
    k_hi = tl.minimum(hi - sk_idx * k_tiles, k_tiles)
    return sk_idx, it, k_lo, k_hi


@triton.jit
def _sk_partial(acc, ws, start_pid, it, lo, tile_counters, tile_id, steps, k_tiles,
                BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """Stream-K: a partial tile goes to this program's workspace slot (0: the segment that
    starts the run, 1: the one that ends it) and is counted in the tile's counter by its
    ``steps`` K-steps (acq_rel). Returns whether this segment brought the count to
    ``k_tiles``: then every other segment's release is acquired, their partials are visible,
    and this one sums and stores the tile (:func:`_sk_claim`, :func:`_store_tile`)."""
    offs_ws = tl.arange(0, BLOCK_M)[:, None] * BLOCK_N + tl.arange(0, BLOCK_N)[None, :]
    slot = tl.where(it == lo, 0, 1)
    ws_slot = ws + (start_pid.to(tl.int64) * 2 + slot) * (BLOCK_M * BLOCK_N)
    tl.store(ws_slot + offs_ws, acc)
    tl.debug_barrier()
    arrived = tl.atomic_add(tile_counters + tile_id, steps, sem="acq_rel", scope="gpu")
    return arrived + steps == k_tiles


@triton.jit
def _sk_claim(tile_counters, tile_id, sk_idx, k_tiles, total_steps, num_progs):
    """Stream-K, in the segment that completes shared tile ``sk_idx``: reset its counter for
    the next launch and find the programs holding its partials, the owners of its first and
    last steps (owner(i) = the largest p with lo_p <= i); the first one's partial is in its slot
    0 only if its run starts exactly at the tile's first step. Returns ``(q_first, q_last,
    first_slot)`` for :func:`_sum_segments`, which sums them in program order -- the same sum
    whichever segment comes last."""
    tl.atomic_xchg(tile_counters + tile_id, 0, sem="relaxed", scope="gpu")
    t_start = sk_idx * k_tiles
    q_first = ((t_start + 1) * num_progs - 1) // total_steps
    q_last = ((t_start + k_tiles) * num_progs - 1) // total_steps
    first_slot = tl.where((q_first * total_steps) // num_progs == t_start, 0, 1)
    return q_first, q_last, first_slot


@triton.jit
def _record(tile_records, off_m, off_n, num_pid_n, t_start, t_wait, step, BLOCK_M: tl.constexpr,
            BLOCK_N: tl.constexpr, USE_ASM: tl.constexpr):
    """The tile at ``(off_m, off_n)``'s record, its end read now (tile_records.py)."""
    record_tile(tile_records, (off_m // BLOCK_M) * num_pid_n + off_n // BLOCK_N, t_start, t_wait,
                tile_clock(step, 2, USE_ASM), USE_ASM)


# --------------------------------------------------------------------------------------------
# the kernels
# --------------------------------------------------------------------------------------------
# Per-call values (chunk geometry; with hooks: generations, timeouts) and the scale, hook and
# record buffers are not specialized on, so a new generation or a new signal pad never compiles
# a new kernel. ``c`` is a TMA descriptor (USE_TMA and TMA_STORE: TMA loads and stores) or a
# pointer (TMA loads and pointer stores: no staging buffer, its shared memory goes to the
# pipeline; or the plain-pointer path); ``a`` and ``b`` are descriptors with USE_TMA.
@triton.jit(do_not_specialize=["chunk_m", "num_chunks", "start_chunk"],
            do_not_specialize_on_alignment=["scale_a", "scale_b", "tile_records"])
def gemm_kernel(
    a, b, c, M, N, K, stride_am, stride_ak, stride_bk, stride_bn, stride_cm, stride_cn,
    chunk_m, num_chunks, start_chunk,          # the tile order's chunks
    scale_a, scale_b,                          # fp32 scales (SCALE_A / SCALE_B) or None
    tile_records,                              # int64 [num_tiles, abi.TILE_RECORD_COLUMNS] or None
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    EPI_SUBTILE: tl.constexpr, TILE_ORDER: tl.constexpr, USE_TMA: tl.constexpr, TMA_STORE: tl.constexpr,
    B_KMAJOR: tl.constexpr, C_DTYPE: tl.constexpr, SCALE_A: tl.constexpr, SCALE_B: tl.constexpr,
    FLATTEN: tl.constexpr, DOT_FP32: tl.constexpr, USE_ASM: tl.constexpr, RECORD_TILES: tl.constexpr,
):
    """Plain persistent GEMM: program ``p`` computes and stores tiles ``p, p + P, ...``."""
    start_pid = tl.program_id(0)
    num_progs = tl.num_programs(0)
    num_pid_m = (M + BLOCK_M - 1) // BLOCK_M
    num_pid_n = (N + BLOCK_N - 1) // BLOCK_N
    k_tiles = (K + BLOCK_K - 1) // BLOCK_K
    for tile_id in tl.range(start_pid, num_pid_m * num_pid_n, num_progs, flatten=FLATTEN):
        if RECORD_TILES:
            step = (tile_id - start_pid) // num_progs   # the logical clock's work item
            rec_t0 = tile_clock(step, 0, USE_ASM)
        off_m, off_n = _tile_corner(tile_id, M, num_pid_m, num_pid_n, chunk_m, num_chunks, start_chunk,
                                    BLOCK_M, BLOCK_N, GROUP_M, TILE_ORDER)
        acc = _kloop(a, b, off_m, off_n, 0, k_tiles, M, N, K, stride_am, stride_ak, stride_bk, stride_bn,
                     BLOCK_M, BLOCK_N, BLOCK_K, USE_TMA, B_KMAJOR, DOT_FP32)
        _store_tile(acc, c, off_m, off_n, M, N, stride_cm, c, 0, chunk_m, num_chunks, c, scale_a, scale_b,
                    c, 0, 0, 0, 0, 0, C_DTYPE, EPI_SUBTILE, USE_TMA and TMA_STORE, False, 0, 0,
                    SCALE_A, SCALE_B, False)
        if RECORD_TILES:
            _record(tile_records, off_m, off_n, num_pid_n, rec_t0, rec_t0, step, BLOCK_M, BLOCK_N, USE_ASM)


@triton.jit(do_not_specialize=["chunk_m", "num_chunks", "start_chunk"],
            do_not_specialize_on_alignment=["scale_a", "scale_b", "tile_counters", "tile_records"])
def gemm_sk_kernel(
    a, b, c, M, N, K, stride_am, stride_ak, stride_bk, stride_bn, stride_cm, stride_cn,
    chunk_m, num_chunks, start_chunk, scale_a, scale_b,
    # fp32 partials [programs, 2, BLOCK_M, BLOCK_N], int32 [num_tiles] zeros (tile counters),
    # and how many tiles (the last ones of the order) are shared out by K-steps
    ws, tile_counters, sk_tiles,
    tile_records,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    EPI_SUBTILE: tl.constexpr, TILE_ORDER: tl.constexpr, USE_TMA: tl.constexpr, TMA_STORE: tl.constexpr,
    B_KMAJOR: tl.constexpr, C_DTYPE: tl.constexpr, SCALE_A: tl.constexpr, SCALE_B: tl.constexpr,
    FLATTEN: tl.constexpr, DOT_FP32: tl.constexpr, USE_ASM: tl.constexpr, RECORD_TILES: tl.constexpr,
):
    """Persistent GEMM with a stream-K tail: whole tiles as :func:`gemm_kernel`, then the last
    ``sk_tiles`` of the order shared out to every program by K-steps (:func:`_sk_run`)."""
    start_pid = tl.program_id(0)
    num_progs = tl.num_programs(0)
    num_pid_m = (M + BLOCK_M - 1) // BLOCK_M
    num_pid_n = (N + BLOCK_N - 1) // BLOCK_N
    k_tiles = (K + BLOCK_K - 1) // BLOCK_K
    num_work = num_pid_m * num_pid_n - sk_tiles
    C_TMA: tl.constexpr = USE_TMA and TMA_STORE
    for tile_id in tl.range(start_pid, num_work, num_progs, flatten=FLATTEN):
        if RECORD_TILES:
            step = (tile_id - start_pid) // num_progs
            rec_t0 = tile_clock(step, 0, USE_ASM)
        off_m, off_n = _tile_corner(tile_id, M, num_pid_m, num_pid_n, chunk_m, num_chunks, start_chunk,
                                    BLOCK_M, BLOCK_N, GROUP_M, TILE_ORDER)
        acc = _kloop(a, b, off_m, off_n, 0, k_tiles, M, N, K, stride_am, stride_ak, stride_bk, stride_bn,
                     BLOCK_M, BLOCK_N, BLOCK_K, USE_TMA, B_KMAJOR, DOT_FP32)
        _store_tile(acc, c, off_m, off_n, M, N, stride_cm, c, 0, chunk_m, num_chunks, c, scale_a, scale_b,
                    c, 0, 0, 0, 0, 0, C_DTYPE, EPI_SUBTILE, C_TMA, False, 0, 0, SCALE_A, SCALE_B, False)
        if RECORD_TILES:
            _record(tile_records, off_m, off_n, num_pid_n, rec_t0, rec_t0, step, BLOCK_M, BLOCK_N, USE_ASM)
    lo, hi, first_idx, num_segs, total_steps = _sk_run(start_pid, num_progs, sk_tiles, k_tiles)
    if RECORD_TILES:   # work items of the whole-tile loop (the logical clock)
        whole_steps = (num_work - start_pid + num_progs - 1) // num_progs
    for seg in tl.range(0, num_segs, flatten=FLATTEN):
        sk_idx, it, k_lo, k_hi = _sk_segment(seg, first_idx, lo, hi, k_tiles)
        tile_id = num_work + sk_idx
        if RECORD_TILES:
            step = whole_steps + seg
            rec_t0 = tile_clock(step, 0, USE_ASM)
        off_m, off_n = _tile_corner(tile_id, M, num_pid_m, num_pid_n, chunk_m, num_chunks, start_chunk,
                                    BLOCK_M, BLOCK_N, GROUP_M, TILE_ORDER)
        acc = _kloop(a, b, off_m, off_n, k_lo, k_hi, M, N, K, stride_am, stride_ak, stride_bk, stride_bn,
                     BLOCK_M, BLOCK_N, BLOCK_K, USE_TMA, B_KMAJOR, DOT_FP32)
        if (k_lo == 0) & (k_hi == k_tiles):
            _store_tile(acc, c, off_m, off_n, M, N, stride_cm, c, 0, chunk_m, num_chunks, c, scale_a, scale_b,
                        c, 0, 0, 0, 0, 0, C_DTYPE, EPI_SUBTILE, C_TMA, False, 0, 0, SCALE_A, SCALE_B, False)
            if RECORD_TILES:
                _record(tile_records, off_m, off_n, num_pid_n, rec_t0, rec_t0, step, BLOCK_M, BLOCK_N, USE_ASM)
        elif _sk_partial(acc, ws, start_pid, it, lo, tile_counters, tile_id, k_hi - k_lo, k_tiles, BLOCK_M, BLOCK_N):
            q_first, q_last, first_slot = _sk_claim(tile_counters, tile_id, sk_idx, k_tiles, total_steps, num_progs)
            _store_tile(acc, c, off_m, off_n, M, N, stride_cm, c, 0, chunk_m, num_chunks, c, scale_a, scale_b,
                        ws, q_first, q_last, first_slot, total_steps, num_progs, C_DTYPE, EPI_SUBTILE, C_TMA,
                        False, 0, 0, SCALE_A, SCALE_B, True)
            if RECORD_TILES:   # the segment that completed the tile stands for it
                _record(tile_records, off_m, off_n, num_pid_n, rec_t0, rec_t0, step, BLOCK_M, BLOCK_N, USE_ASM)


@triton.jit(do_not_specialize=["chunk_m", "num_chunks", "start_chunk", "wait_gen", "wait_timeout",
                               "stride_dm", "epi_gen"],
            do_not_specialize_on_alignment=["scale_a", "scale_b", "wait_signal", "err_ptr", "dest_offs",
                                            "signal_ptrs", "counters", "tile_counters", "tile_records"])
def gemm_hooked_kernel(
    a, b, c, M, N, K, stride_am, stride_ak, stride_bk, stride_bn, stride_cm, stride_cn,
    chunk_m, num_chunks, start_chunk, scale_a, scale_b,
    wait_signal, wait_gen, wait_timeout, err_ptr,            # wait hook
    dest_offs, stride_dm, signal_ptrs, counters, epi_gen,    # epilogue hook (c: the destinations' origin)
    # epilogue hook through TMA: descriptor q (q < EPI_TMA) covers chunk q's rows of its
    # destination, or (EPI_TMA_STACKED) epi_d0 covers all M rows; the unused ones are None
    # (separate arguments: Triton 3.6's launcher does not take a tuple of descriptors)
    epi_d0, epi_d1, epi_d2, epi_d3, epi_d4, epi_d5, epi_d6, epi_d7,
    ws, tile_counters, sk_tiles,                             # stream-K (STREAM_K), as gemm_sk_kernel
    tile_records,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    EPI_SUBTILE: tl.constexpr, TILE_ORDER: tl.constexpr, USE_TMA: tl.constexpr, TMA_STORE: tl.constexpr,
    B_KMAJOR: tl.constexpr, C_DTYPE: tl.constexpr, SCALE_A: tl.constexpr, SCALE_B: tl.constexpr,
    FLATTEN: tl.constexpr, DOT_FP32: tl.constexpr, USE_ASM: tl.constexpr, RECORD_TILES: tl.constexpr,
    STREAM_K: tl.constexpr, WAIT: tl.constexpr, EPILOGUE: tl.constexpr, DEST_ALIGNED: tl.constexpr,
    EPI_TMA: tl.constexpr, EPI_COUNT: tl.constexpr,
):
    """:func:`gemm_kernel` (with STREAM_K: :func:`gemm_sk_kernel`) with the wait hook (WAIT)
    and/or the epilogue hook (EPILOGUE): the tile loop carries which chunks the previous
    stored tile touched (``pend_*``) and counts them after this tile's main loop (EPI_COUNT 1
    and 3) or inside it (4); the end of the program counts the last ones."""
    start_pid = tl.program_id(0)
    num_progs = tl.num_programs(0)
    C_TMA: tl.constexpr = USE_TMA and TMA_STORE
    # EPILOGUE: EPI_SIGNALLED counts the stored tiles and publishes chunks; EPI_ROUTE only routes
    COUNT: tl.constexpr = EPILOGUE == EPI_SIGNALLED
    epi_descs = (epi_d0, epi_d1, epi_d2, epi_d3, epi_d4, epi_d5, epi_d6, epi_d7)
    num_pid_m = (M + BLOCK_M - 1) // BLOCK_M
    num_pid_n = (N + BLOCK_N - 1) // BLOCK_N
    num_tiles = num_pid_m * num_pid_n
    k_tiles = (K + BLOCK_K - 1) // BLOCK_K
    status = tl.full((), 0, tl.int32)  # 0 until a wait of this program fails
    verified = tl.full((), 0, tl.int64)  # WAIT: bit c set once signal[c] >= wait_gen was seen
    pend_lo = tl.full((), 0, tl.int32)   # EPILOGUE: chunks of the previous tile, counted late
    pend_hi = tl.full((), -1, tl.int32)
    pend_poll = tl.full((), 0, tl.int32)  # EPI_COUNT>=3: the previous tile is its chunk's poll tile
    pend_n = tl.full((), 1, tl.int32)     # EPI_COUNT>=3: how many tiles pend_lo's count holds
    cnt_n = tl.full((), 0, tl.int32)      # EPI_COUNT=4: how many of them the next main loop counts
    if EPI_COUNT == 4:
        pend_n = tl.full((), 0, tl.int32)  # (0: nothing pending)
    poll_q = tl.full((), -1, tl.int32)    # EPI_COUNT>=3: chunk this program polls (-1: none)

    if STREAM_K:
        num_work = num_tiles - sk_tiles   # whole tiles first; the last sk_tiles after the loop
    else:
        num_work = num_tiles
    for work_id in tl.range(start_pid, num_work, num_progs, flatten=FLATTEN):
        if RECORD_TILES:
            step = (work_id - start_pid) // num_progs   # the logical clock's work item
            rec_t0 = tile_clock(step, 0, USE_ASM)
        off_m, off_n, c_lo, c_hi, status, verified = _tile_start(
            work_id, M, num_pid_m, num_pid_n, chunk_m, num_chunks, start_chunk, wait_signal, wait_gen,
            wait_timeout, err_ptr, status, verified, BLOCK_M, BLOCK_N, GROUP_M, TILE_ORDER, WAIT,
            EPILOGUE, USE_ASM)
        if RECORD_TILES:
            rec_tw = rec_t0
            if WAIT:
                rec_tw = tile_clock(step, 1, USE_ASM)
        # EPI_COUNT=4 counts the pending tiles (cnt_n of them, 0: none) inside this main loop
        acc, seen, sig = _mainloop(a, b, off_m, off_n, 0, k_tiles, M, N, K, stride_am, stride_ak, stride_bk,
                                   stride_bn, pend_lo, cnt_n, poll_q, counters, signal_ptrs, BLOCK_M, BLOCK_N,
                                   BLOCK_K, USE_TMA, B_KMAJOR, DOT_FP32,
                                   COUNT and EPI_COUNT == 4, EPI_TMA, USE_ASM)
        if COUNT:
            poll_q, merge = _count_previous(pend_lo, pend_hi, pend_n, pend_poll, poll_q, c_lo, seen, sig, M,
                                            chunk_m, num_pid_n, counters, signal_ptrs, epi_gen, status,
                                            BLOCK_M, EPI_TMA, EPI_COUNT, USE_ASM)
        _store_tile(acc, c, off_m, off_n, M, N, stride_cm, dest_offs, stride_dm, chunk_m, num_chunks, epi_descs,
                    scale_a, scale_b, c, 0, 0, 0, 0, 0, C_DTYPE, EPI_SUBTILE, C_TMA, EPILOGUE, DEST_ALIGNED,
                    EPI_TMA, SCALE_A, SCALE_B, False)
        if RECORD_TILES:
            _record(tile_records, off_m, off_n, num_pid_n, rec_t0, rec_tw, step, BLOCK_M, BLOCK_N, USE_ASM)
        if COUNT:   # after the stores (see _carry)
            pend_lo, pend_hi, pend_poll, pend_n, cnt_n = _pend_stored(
                off_m, off_n, c_lo, c_hi, pend_poll, pend_n, cnt_n, merge, work_id, num_progs, num_work, M,
                chunk_m, num_chunks, start_chunk, num_pid_n, BLOCK_M, BLOCK_N, TILE_ORDER, EPI_COUNT, USE_ASM)
    if STREAM_K:
        lo, hi, first_idx, num_segs, total_steps = _sk_run(start_pid, num_progs, sk_tiles, k_tiles)
        if RECORD_TILES:   # work items of this program's whole-tile loop (the logical clock)
            whole_steps = (num_work - start_pid + num_progs - 1) // num_progs
        for seg in tl.range(0, num_segs, flatten=FLATTEN):
            sk_idx, it, k_lo, k_hi = _sk_segment(seg, first_idx, lo, hi, k_tiles)
            tile_id = num_work + sk_idx
            if RECORD_TILES:
                step = whole_steps + seg
                rec_t0 = tile_clock(step, 0, USE_ASM)
            off_m, off_n, c_lo, c_hi, status, verified = _tile_start(
                tile_id, M, num_pid_m, num_pid_n, chunk_m, num_chunks, start_chunk, wait_signal,
                wait_gen, wait_timeout, err_ptr, status, verified, BLOCK_M, BLOCK_N, GROUP_M,
                TILE_ORDER, WAIT, EPILOGUE, USE_ASM)
            if RECORD_TILES:
                rec_tw = rec_t0
                if WAIT:
                    rec_tw = tile_clock(step, 1, USE_ASM)
            acc = _kloop(a, b, off_m, off_n, k_lo, k_hi, M, N, K, stride_am, stride_ak, stride_bk, stride_bn,
                         BLOCK_M, BLOCK_N, BLOCK_K, USE_TMA, B_KMAJOR, DOT_FP32)
            if COUNT:   # the previous stored tile, counted late as in the loop above
                if EPI_COUNT >= 3:
                    poll_q = _count_and_poll(pend_lo, pend_hi, pend_n, pend_poll, poll_q, M, chunk_m, num_pid_n,
                                             counters, signal_ptrs, epi_gen, status, BLOCK_M, EPI_TMA,
                                             USE_ASM)
                else:
                    _count_and_publish(pend_lo, pend_hi, M, chunk_m, num_pid_n, counters, signal_ptrs,
                                       epi_gen, status, BLOCK_M, EPI_TMA, EPI_COUNT, USE_ASM)
            if (k_lo == 0) & (k_hi == k_tiles):
                _store_tile(acc, c, off_m, off_n, M, N, stride_cm, dest_offs, stride_dm, chunk_m, num_chunks,
                            epi_descs, scale_a, scale_b, c, 0, 0, 0, 0, 0, C_DTYPE, EPI_SUBTILE, C_TMA, EPILOGUE,
                            DEST_ALIGNED, EPI_TMA, SCALE_A, SCALE_B, False)
                if RECORD_TILES:
                    _record(tile_records, off_m, off_n, num_pid_n, rec_t0, rec_tw, step, BLOCK_M, BLOCK_N, USE_ASM)
                if COUNT:
                    pend_lo = c_lo
                    pend_hi = c_hi
                    if EPI_COUNT >= 3:
                        pend_poll = _is_poll_tile(off_m, off_n, c_lo, M, chunk_m, num_pid_n, BLOCK_M, BLOCK_N)
                        pend_n = tl.full((), 1, tl.int32)
            else:
                is_last = _sk_partial(acc, ws, start_pid, it, lo, tile_counters, tile_id, k_hi - k_lo, k_tiles,
                                      BLOCK_M, BLOCK_N)
                if COUNT:   # the tile's chunks are pending only where this segment stores it
                    pend_lo = c_lo
                    pend_hi = tl.where(is_last, c_hi, c_lo - 1)
                    if EPI_COUNT >= 3:
                        pend_poll = tl.where(is_last, _is_poll_tile(off_m, off_n, c_lo, M, chunk_m, num_pid_n,
                                                                    BLOCK_M, BLOCK_N), 0)
                        pend_n = tl.full((), 1, tl.int32)
                if is_last:
                    q_first, q_last, first_slot = _sk_claim(tile_counters, tile_id, sk_idx, k_tiles, total_steps,
                                                            num_progs)
                    if WAIT:
                        # A segment whose wait failed (maybe on another program) fed garbage
                        # into this tile: never publish its chunks.
                        if tl.load(err_ptr, volatile=True) != 0:
                            status = tl.full((), 2, tl.int32)
                    _store_tile(acc, c, off_m, off_n, M, N, stride_cm, dest_offs, stride_dm, chunk_m, num_chunks,
                                epi_descs, scale_a, scale_b, ws, q_first, q_last, first_slot, total_steps,
                                num_progs, C_DTYPE, EPI_SUBTILE, C_TMA, EPILOGUE, DEST_ALIGNED, EPI_TMA,
                                SCALE_A, SCALE_B, True)
                    if RECORD_TILES:   # the segment that completed the tile stands for it
                        _record(tile_records, off_m, off_n, num_pid_n, rec_t0, rec_tw, step, BLOCK_M, BLOCK_N,
                                USE_ASM)
    if COUNT:
        if EPI_COUNT >= 3:
            _count_red(pend_lo, pend_hi, pend_n, counters, EPI_TMA, USE_ASM)
            poll_q = _take_poll(pend_poll, pend_lo, poll_q, counters, USE_ASM)
            _end_counts(poll_q, M, chunk_m, num_chunks, num_pid_n, counters, signal_ptrs, epi_gen, status,
                        BLOCK_M, USE_ASM)
        else:
            _count_and_publish(pend_lo, pend_hi, M, chunk_m, num_pid_n, counters, signal_ptrs,
                               epi_gen, status, BLOCK_M, EPI_TMA, EPI_COUNT, USE_ASM)
