"""Warp-specialized persistent GEMM (Gluon, sm_90) for the epilogue hook: ``c = a @ b``.

The plain kernel (gemm.py) runs the epilogue hook's count and release on the warps that issue
the MMAs: per tile a wait for the TMA writes, a CTA barrier and a ``MEMBAR.GPU`` (~0.9 us on
the H200), which the tensor cores wait for. Here each program has three partitions (four
with the wait hook):

* MMA (the default partition, ``num_warps`` = 8: two warpgroups, 64 rows of the 128-row tile
  each): waits for a stage's operands, issues the wgmma, frees the stage; at a tile's end it
  scales (fp8, below), converts the accumulator and writes it into the output staging buffer
  (shared memory);
* load (1 warp): the TMA loads of A and B into a ring of ``STAGES`` stages, running ahead over
  the program's tiles;
* store (1 warp): the TMA store of the staging buffer to the tile's destination and then, with
  the epilogue hook, the count of the tile in its chunks and the publication of a chunk whose
  count is complete -- so the fences and the atomic's round trip wait on this warp only, while
  the MMA warps go on with the next tile;
* poll (1 warp, the wait hook only): the flags' bounded waits, up to ``POLL_DEPTH`` handoffs
  ahead of the load warp.

Dtypes: bf16/fp16 in and out; or fp8 (e4m3, e4m3 x e5m2 mixes; a and b may differ) into
bf16/fp16/float32 (``c_desc``'s dtype), b K-major (sm_90's fp8 wgmma reads it so), K-steps of 128
(32 per wgmma). The fp8 MMAs accumulate as gemm.py's ``tl.dot`` does: Triton's sm_90 default
``max_num_imprecise_acc`` (2**30, fast accumulation across all of K, no fp32 promotion in
between), the same wgmma K-steps in the same order. The scales (``SCALE_A`` / ``SCALE_B``, as
gemm.py: none, tensor-wise, row-wise ``[M, 1]`` / column-wise ``[1, N]``) multiply the fp32
accumulator in the MMA partition in gemm.py's ``_scale_tile`` order before the rounding, so a
tile rounds as gemm_kernel rounds it: tensor-wise values are read once per program, row-wise ones
per tile (by global row and column) while the tile's last wgmma group runs.

The three walk the same tiles in the same order (gemm.py's ``_tile_coords``), and
talk through mbarriers: ``ready[s]``/``empty[s]`` per stage, ``c_ready``/``c_empty`` for the
staging buffer.

Epilogue hook protocol (simpler than gemm.py's, whose count may not wait): per tile and chunk
it touches, after the tile's TMA writes are done (``cp.async.bulk.wait_group 0``) and ordered
before the generic proxy (``fence.proxy.async.global``), ``atom.add.acq_rel.gpu`` on the chunk's
counter returns the count before it; the tile that completes the count has acquired every
other tile's release, resets the counter to 0 for the next launch and publishes the generation
with a system-scope release (``fence.acq_rel.sys`` + relaxed store). One GPU counts, so the
count is GPU-scope; the system-scope release is cumulative (see gemm.py, ``_count_and_publish``).
Nobody spins on another program, so programs need not be co-resident.
That is ``EPILOGUE == EPI_SIGNALLED``; with ``EPI_ROUTE`` (an EpilogueSpec without signals:
the fused GEMM+RS/AR) the store warp stores and goes on, nothing counted or published.

Destinations: one TMA descriptor per chunk (``EPI_TMA`` = number of chunks, at most 8, every
tile inside one chunk) or one over stacked destinations (``EPI_TMA_STACKED``: a tile may
straddle chunks then; it is stored once and counted in each).

Wait hook (``WAIT``, the AG consumer side, without the epilogue hook): gemm.py's bounded wait
runs in the poll warp. The poll and load warps hand off only the tiles that touch a chunk no
earlier tile of the program touched (both track the same mask, ``_new_chunks``; chunks >= 62
every time): a chunk, once seen ready, stays ready for the launch, so later tiles of it need
neither the flag nor the handoff. For such a tile the poll warp polls every chunk its rows
touch that the program has not yet seen ready (``ld.acquire.sys``; the clock is read only once
a flag was not ready), then arrives on the next slot of a ring of ``POLL_DEPTH`` mbarriers
(release at CTA scope); the load warp waits on that slot before the tile's loads (acquire at
CTA scope: the peers' writes the poll warp acquired happen before its loads), issues
``fence.proxy.async.global`` (the TMA loads are async-proxy reads of rows a peer wrote; the
fence after a chunk's first tile covers every later load of this warp) and frees the slot. So
the flags' round trips and the spin do not sit in the load warp's path between two tiles'
loads (there they cost up to 1.5 points of the hook's 2-5 % on 50-100 us fp8 calls:
BENCHMARKS.md, the fp8 GEMM core); the MMA warps wait only for operands. A timed out wait is
recorded in the error word and its tile's slot arrived all the same, so the loads go on, the
kernel ends and the host raises TimeoutError. No stream-K: the host (tpfuse/gemm/launch.py,
``ws_choice``) takes this kernel for one hook at a time on those paths.

Per-tile timeline (``RECORD_TILES``, tile_records.py): the load warp writes a tile's program,
SM, start (before its wait for the poll warp's slot, if it takes one) and wait done (after
that wait and the proxy fence; = start without the wait hook); the store warp writes its end,
after the staging buffer was read out by the TMA store and, with the epilogue hook, after the
count (which waits for the TMA writes) and the chunk's publication if this tile completed it.
The load warp runs up to STAGES K-steps ahead of the MMA warps, so a tile's start is when its
loads begin to be issued, not when its MMAs do, and tiles of one program overlap in the
records.
"""
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma,
                                                              warpgroup_mma, warpgroup_mma_wait)

from . import _types, abi
# gemm.py's tile orders, called from Gluon as they are (scalar integer arithmetic); the first
# timeout of a wait claims the error word as in gemm.py
from .gemm import _tile_coords
from .signals import record_timeout
from .tile_records import record_end, record_start, tile_clock

EPI_TMA_STACKED = gl.constexpr(abi.EPI_TMA_STACKED)
EPI_SIGNALLED = gl.constexpr(abi.EPI_SIGNALLED)
# SCALE_A / SCALE_B (kernels/_types.py, as gemm.py): no scale, one value, one per row of a / column of b
SCALE_NONE = gl.constexpr(_types.SCALE_NONE)
SCALE_TENSOR = gl.constexpr(_types.SCALE_TENSOR)
SCALE_VECTOR = gl.constexpr(_types.SCALE_VECTOR)

# The store warp's count of one stored tile in one chunk: lane 0 counts, every lane gets the
# count it made (shfl). Before it: this warp's TMA writes done and ordered before the release.
# $1 counter, $2 tiles counted, $3 the chunk's tile total, $4 the signal's address, $5 the
# generation. The count completing the chunk resets the counter and publishes.
_COUNT_ASM = gl.constexpr("{\n\t.reg .pred p, last;\n\t.reg .u32 lane, old;\n\t"
              "cp.async.bulk.wait_group 0;\n\tfence.proxy.async.global;\n\tbar.warp.sync -1;\n\t"
              "mov.u32 lane, %laneid;\n\tsetp.eq.u32 p, lane, 0;\n\tmov.u32 old, 0;\n\t"
              "@p atom.add.acq_rel.gpu.global.u32 old, [$1], $2;\n\tadd.u32 old, old, $2;\n\t"
              "setp.eq.and.u32 last, old, $3, p;\n\t"
              "@last fence.acq_rel.sys;\n\t@last st.relaxed.gpu.global.b32 [$1], 0;\n\t"
              "@last st.relaxed.sys.global.b32 [$4], $5;\n\t"
              "shfl.sync.idx.b32 $0, old, 0, 31, -1;\n\t}")
# The wait hook's bounded spin, one PTX loop: until the int32 at $2 (acquire, system scope) is
# >= $3, for at most $4 ns of %globaltimer, or until the error word at $5 is set by another
# waiter. $0: 0 ready, 1 timed out, 2 stopped by another's error; $1: the value last read.
# %globaltimer is read only once a first look found the flag not ready (t0 = 0 until then).
_WAIT_ASM = gl.constexpr(
    "{\n\t.reg .pred p, q;\n\t.reg .u64 t0, t1;\n\t.reg .u32 e;\n\tmov.u32 $0, 0;\n\tmov.u64 t0, 0;\n\t"
    "WAIT_POLL:\n\tld.global.acquire.sys.b32 $1, [$2];\n\t"
    "setp.ge.s32 p, $1, $3;\n\t@p bra WAIT_DONE;\n\tsetp.eq.u64 q, t0, 0;\n\t@q mov.u64 t0, %globaltimer;\n\t"
    "ld.volatile.global.b32 e, [$5];\n\t"
    "setp.ne.s32 p, e, 0;\n\t@p mov.u32 $0, 2;\n\t@p bra WAIT_DONE;\n\tmov.u64 t1, %globaltimer;\n\t"
    "sub.u64 t1, t1, t0;\n\tsetp.gt.s64 p, t1, $4;\n\t@p mov.u32 $0, 1;\n\t@p bra WAIT_DONE;\n\t"
    "bra WAIT_POLL;\n\tWAIT_DONE:\n\t}")
# In the load warp, after the poll warp's word that a chunk is ready (generic proxy), before
# the TMA loads (async proxy) of the rows it released: peers' writes to them are then ordered
# before the loads.
_PROXY_FENCE_ASM = gl.constexpr("fence.proxy.async.global;\n\tmov.u32 $0, 0;")
# How many handoffs (tiles of a chunk new to the program) the poll warp may run ahead of the
# load warp
POLL_DEPTH = gl.constexpr(2)


@gluon.jit
def _chunk_bit(cc):
    """Chunk ``cc``'s bit in the int64 masks of chunks seen ready or fenced for (0 for chunks
    >= 62: those are waited on and fenced for every time)."""
    one = gl.to_tensor(1).to(gl.int64)
    return gl.where(cc < 62, one << gl.minimum(cc, 61).to(gl.int64), 0)


@gluon.jit
def _wait_chunks(c_lo, c_hi, tile_id, wait_signal, wait_gen, wait_timeout, err_ptr, status, verified):
    """The wait hook of one tile in the poll warp, as gemm.py's ``_wait_chunks`` (which Gluon
    cannot call: its scalars come from ``tl.full``): poll every chunk the tile's rows touch that
    this program has not yet seen ready (bit c of ``verified``; chunks >= 62 every time).
    Returns ``(status, verified)``."""
    if status == 0:
        for cc in range(c_lo, c_hi + 1):
            bit = _chunk_bit(cc)
            if ((verified & bit) == 0) & (status == 0):
                st, seen = gl.inline_asm_elementwise(_WAIT_ASM, "=r,=r,l,r,l,l",
                                                     [wait_signal + cc, wait_gen, wait_timeout, err_ptr],
                                                     dtype=(gl.int32, gl.int32), is_pure=False, pack=1)
                if st == 1:
                    record_timeout(err_ptr, tile_id, cc, wait_gen, seen)
                status = st
                if st == 0:
                    verified = verified | bit
    return status, verified


@gluon.jit
def _alloc_polls(ready, empty, WAIT: gl.constexpr):
    """WAIT: the poll warp's ring of ``POLL_DEPTH`` slots, ``(polled, poll_free)`` mbarriers of
    count 1; otherwise the stage barriers stand in, untouched (no shared memory spent)."""
    if WAIT:
        polled = gl.allocate_shared_memory(gl.int64, [POLL_DEPTH, 1], mbarrier.MBarrierLayout())
        poll_free = gl.allocate_shared_memory(gl.int64, [POLL_DEPTH, 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(POLL_DEPTH):
            mbarrier.init(polled.index(i), count=1)
            mbarrier.init(poll_free.index(i), count=1)
        polls = (polled, poll_free)
    else:
        polls = (ready, empty)
    return polls


@gluon.jit
def _new_chunks(pid_m, M, chunk_m, seen, BLOCK_M: gl.constexpr):
    """The chunks ``c_lo..c_hi`` the rows of a tile at row block ``pid_m`` touch, against ``seen``
    (bit c: chunk c handed off before, :func:`_chunk_bit`): ``(new, seen | their bits, c_lo,
    c_hi)``, ``new`` nonzero when one of them was not (chunks >= 62: always). The poll and load
    warps both call it on the same tiles in the same order, so both know which tiles are handed
    off."""
    off_m = pid_m * BLOCK_M
    c_lo = off_m // chunk_m
    c_hi = (gl.minimum(off_m + BLOCK_M, M) - 1) // chunk_m
    new = 0
    for cc in range(c_lo, c_hi + 1):
        bit = _chunk_bit(cc)
        if (seen & bit) == 0:
            new = 1
        seen = seen | bit
    return new, seen, c_lo, c_hi


@gluon.jit
def _poll_partition(p, polls, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, GROUP_M: gl.constexpr,
                    TILE_ORDER: gl.constexpr):
    """WAIT: the poll warp. Walks the program's tiles in the load warp's order and hands off
    those that touch a chunk no earlier tile of the program touched (:func:`_new_chunks`), up
    to ``POLL_DEPTH`` handoffs ahead of the load warp: the bounded wait of :func:`_wait_chunks`
    on every chunk the tile's rows touch that this program has not yet seen ready, then
    ``polled[slot]`` arrived (release at CTA scope), also after a timeout (recorded in the
    error word: the loads go on and the host raises). A chunk stays ready once seen (its
    generation only grows within a launch), so later tiles of it need no handoff. So the
    flags' system-scope round trips and the spin run beside the loads, not in the load warp's
    path between two tiles' loads, and a tile of chunks already handed off costs neither warp
    an mbarrier."""
    (a_desc, b_desc, a_bufs, b_bufs, ready, empty, c_smem, c_ready, c_empty,
     M, N, K, chunk_m, num_chunks, start_chunk, counters, signal_ptrs, epi_gen, epi_descs,
     wait_signal, wait_gen, wait_timeout, err_ptr, tile_records, scale_a, scale_b) = p
    polled, poll_free = polls
    num_pid_m = gl.cdiv(M, BLOCK_M)
    num_pid_n = gl.cdiv(N, BLOCK_N)
    status = gl.to_tensor(0)   # 0 until a wait of this program fails
    verified = gl.to_tensor(0).to(gl.int64)   # bit c set once signal[c] >= wait_gen was seen
    handed = gl.to_tensor(0).to(gl.int64)   # bit c set once a tile touching chunk c was handed off
    h = 0   # handoffs so far
    for tile_id in range(gl.program_id(0), num_pid_m * num_pid_n, gl.num_programs(0)):
        pid_m, pid_n = _tile_coords(tile_id, M, num_pid_m, num_pid_n, chunk_m, num_chunks, start_chunk,
                                    BLOCK_M, GROUP_M, TILE_ORDER)
        new, handed, c_lo, c_hi = _new_chunks(pid_m, M, chunk_m, handed, BLOCK_M)
        if new != 0:
            slot = h % POLL_DEPTH
            # the slot is free once the load warp has taken its previous handoff (a fresh
            # mbarrier counts as having completed the phase before phase 0)
            mbarrier.wait(poll_free.index(slot), ((h // POLL_DEPTH) & 1) ^ 1)
            status, verified = _wait_chunks(c_lo, c_hi, tile_id, wait_signal, wait_gen, wait_timeout, err_ptr,
                                            status, verified)
            mbarrier.arrive(polled.index(slot), count=1)
            h += 1


@gluon.jit
def _before_tile_loads(h, pid_m, pid_n, num_pid_n, M, chunk_m, polls, tile_records, fenced, BLOCK_M: gl.constexpr,
                       WAIT: gl.constexpr, RECORD_TILES: gl.constexpr):
    """The load warp's steps before the loads of a tile ``(pid_m, pid_n)`` (gemm_ws's and
    gemm_pp's): with the wait hook, if the tile touches a chunk this warp has not yet fenced for
    (bit c of ``fenced``, :func:`_new_chunks`: the poll warp hands off the same tiles), the poll
    warp's ``h``-th handoff (``polled``, acquire at CTA scope), ``fence.proxy.async.global``
    (the TMA loads are async-proxy reads of rows a peer wrote; the fence after a chunk's first
    tile orders every later load of this thread after it) and the poll slot freed; then the
    start of the tile's record. Returns ``(h, fenced)``, carried over the program's tiles."""
    if RECORD_TILES:
        t_start = tile_clock(0, 0, True)
    if WAIT:
        polled, poll_free = polls
        new, fenced, _, _ = _new_chunks(pid_m, M, chunk_m, fenced, BLOCK_M)
        if new != 0:
            slot = h % POLL_DEPTH
            mbarrier.wait(polled.index(slot), (h // POLL_DEPTH) & 1)
            gl.inline_asm_elementwise(_PROXY_FENCE_ASM, "=r", [], dtype=gl.int32, is_pure=False, pack=1)
            mbarrier.arrive(poll_free.index(slot), count=1)
            h += 1
    if RECORD_TILES:
        t_wait = t_start
        if WAIT:
            t_wait = tile_clock(0, 1, True)
        record_start(tile_records, pid_m * num_pid_n + pid_n, t_start, t_wait, True)
    return h, fenced


@gluon.jit
def _store_tile_and_count(c_smem, c_empty, epi_descs, off_m, off_n, M, chunk_m, num_pid_n, counters, signal_ptrs,
                          epi_gen, BLOCK_M: gl.constexpr, EPILOGUE: gl.constexpr, EPI_TMA: gl.constexpr):
    """The store warp's work on one staged tile (gemm_ws's and gemm_pp's): the TMA store of
    ``c_smem`` to the tile at ``(off_m, off_n)`` -- through ``epi_descs[0]`` (the output, or
    the stacked destinations' one descriptor) or, per-chunk descriptors, the tile's chunk's --,
    ``c_empty`` arrived once the buffer has been read out, then with the signalled epilogue
    hook (``EPILOGUE == EPI_SIGNALLED``; ``EPI_ROUTE`` stores only) the count of the tile in
    every chunk its rows touch (``_COUNT_ASM``: the count completing a chunk publishes it)."""
    if EPILOGUE and EPI_TMA != EPI_TMA_STACKED:
        # one descriptor per chunk, over that chunk's rows (the tile lies in one chunk)
        q_tile = off_m // chunk_m
        for q in gl.static_range(EPI_TMA):
            if q == q_tile:
                tma.async_copy_shared_to_global(epi_descs[q], [off_m - q * chunk_m, off_n], c_smem)
    else:
        tma.async_copy_shared_to_global(epi_descs[0], [off_m, off_n], c_smem)
    tma.store_wait(0)   # the staging buffer has been read out
    mbarrier.arrive(c_empty, count=1)
    if EPILOGUE == EPI_SIGNALLED:
        c_lo = off_m // chunk_m
        c_hi = (gl.minimum(off_m + BLOCK_M, M) - 1) // chunk_m
        for cc in range(c_lo, c_hi + 1):
            row_end = gl.minimum((cc + 1) * chunk_m, M)
            total = ((row_end - 1) // BLOCK_M - (cc * chunk_m) // BLOCK_M + 1) * num_pid_n
            sig = gl.load(signal_ptrs + cc)
            gl.inline_asm_elementwise(_COUNT_ASM, "=r,l,r,r,l,r", [counters + cc, 1, total, sig, epi_gen],
                                      dtype=gl.int32, is_pure=False, pack=1)


@gluon.jit
def _load_partition(p, polls, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr,
                    GROUP_M: gl.constexpr, STAGES: gl.constexpr, TILE_ORDER: gl.constexpr, B_KMAJOR: gl.constexpr,
                    EPILOGUE: gl.constexpr, EPI_TMA: gl.constexpr, WAIT: gl.constexpr, RECORD_TILES: gl.constexpr):
    (a_desc, b_desc, a_bufs, b_bufs, ready, empty, c_smem, c_ready, c_empty,
     M, N, K, chunk_m, num_chunks, start_chunk, counters, signal_ptrs, epi_gen, epi_descs,
     wait_signal, wait_gen, wait_timeout, err_ptr, tile_records, scale_a, scale_b) = p
    num_pid_m = gl.cdiv(M, BLOCK_M)
    num_pid_n = gl.cdiv(N, BLOCK_N)
    k_tiles = gl.cdiv(K, BLOCK_K)
    nbytes: gl.constexpr = a_desc.block_type.nbytes + b_desc.block_type.nbytes
    fenced = gl.to_tensor(0).to(gl.int64)   # WAIT: bit c set once this warp fenced after chunk c's wait
    h = 0   # WAIT: the poll warp's handoffs taken
    it = 0
    for tile_id in range(gl.program_id(0), num_pid_m * num_pid_n, gl.num_programs(0)):
        pid_m, pid_n = _tile_coords(tile_id, M, num_pid_m, num_pid_n, chunk_m, num_chunks, start_chunk,
                                    BLOCK_M, GROUP_M, TILE_ORDER)
        off_m = pid_m * BLOCK_M
        off_n = pid_n * BLOCK_N
        h, fenced = _before_tile_loads(h, pid_m, pid_n, num_pid_n, M, chunk_m, polls, tile_records, fenced, BLOCK_M,
                                       WAIT, RECORD_TILES)
        for ki in range(k_tiles):
            s = it % STAGES
            # stage s is free once the MMA warps have consumed its previous fill (a fresh
            # mbarrier counts as having completed the phase before phase 0)
            mbarrier.wait(empty.index(s), ((it // STAGES) & 1) ^ 1)
            mbarrier.expect(ready.index(s), nbytes)
            tma.async_copy_global_to_shared(a_desc, [off_m, ki * BLOCK_K], ready.index(s), a_bufs.index(s))
            if B_KMAJOR:
                tma.async_copy_global_to_shared(b_desc, [off_n, ki * BLOCK_K], ready.index(s), b_bufs.index(s))
            else:
                tma.async_copy_global_to_shared(b_desc, [ki * BLOCK_K, off_n], ready.index(s), b_bufs.index(s))
            it += 1


@gluon.jit
def _store_partition(p, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr, GROUP_M: gl.constexpr,
                    STAGES: gl.constexpr, TILE_ORDER: gl.constexpr, B_KMAJOR: gl.constexpr, EPILOGUE: gl.constexpr,
                    EPI_TMA: gl.constexpr, WAIT: gl.constexpr, RECORD_TILES: gl.constexpr):
    (a_desc, b_desc, a_bufs, b_bufs, ready, empty, c_smem, c_ready, c_empty,
     M, N, K, chunk_m, num_chunks, start_chunk, counters, signal_ptrs, epi_gen, epi_descs,
     wait_signal, wait_gen, wait_timeout, err_ptr, tile_records, scale_a, scale_b) = p
    num_pid_m = gl.cdiv(M, BLOCK_M)
    num_pid_n = gl.cdiv(N, BLOCK_N)
    tc = 0
    for tile_id in range(gl.program_id(0), num_pid_m * num_pid_n, gl.num_programs(0)):
        pid_m, pid_n = _tile_coords(tile_id, M, num_pid_m, num_pid_n, chunk_m, num_chunks, start_chunk,
                                    BLOCK_M, GROUP_M, TILE_ORDER)
        off_m = pid_m * BLOCK_M
        off_n = pid_n * BLOCK_N
        mbarrier.wait(c_ready, tc & 1)
        _store_tile_and_count(c_smem, c_empty, epi_descs, off_m, off_n, M, chunk_m, num_pid_n, counters, signal_ptrs,
                              epi_gen, BLOCK_M, EPILOGUE, EPI_TMA)
        if RECORD_TILES:
            record_end(tile_records, pid_m * num_pid_n + pid_n, tile_clock(0, 2, True))
        tc += 1
    tma.store_wait(0)


@gluon.jit
def _load_scales(layout: gl.constexpr, off_m, off_n, M, N, sa, sb, scale_a, scale_b, BLOCK_M: gl.constexpr,
                 BLOCK_N: gl.constexpr, SCALE_A: gl.constexpr, SCALE_B: gl.constexpr, num_warps: gl.constexpr):
    """A tile's scales in the accumulator's ``layout``: ``(row factor, column factor)``, the
    tensor-wise values ``sa`` / ``sb`` (loaded once per program) or ``scale_a[global row]`` /
    ``scale_b[column]`` (masked: 0 past M or N, as gemm.py; TMA clips those rows anyway).

    A vector is loaded once, spread over the partition's threads (one or two words each), and
    then moved into the accumulator's slice layout through shared memory: loaded in that layout
    directly, every thread issued one global load per column it holds (64 of a 256-column tile,
    replicated across the rows' threads) while the tensor cores waited for the epilogue."""
    fa = sa
    fb = sb
    flat: gl.constexpr = gl.BlockedLayout([1], [32], [num_warps], [0])
    if SCALE_A == SCALE_VECTOR:
        offs_m = off_m + gl.arange(0, BLOCK_M, layout=flat)
        fa = gl.convert_layout(gl.load(scale_a + offs_m, mask=offs_m < M, other=0.0), gl.SliceLayout(1, layout))
    if SCALE_B == SCALE_VECTOR:
        offs_n = off_n + gl.arange(0, BLOCK_N, layout=flat)
        fb = gl.convert_layout(gl.load(scale_b + offs_n, mask=offs_n < N, other=0.0), gl.SliceLayout(0, layout))
    return fa, fb


@gluon.jit
def _scale_acc(acc, fa, fb, SCALE_A: gl.constexpr, SCALE_B: gl.constexpr):
    """gemm.py's ``_scale_tile`` on the accumulator in its wgmma layout, in the same order of
    fp32 operations (so a tile rounds as the plain kernel rounds it): a tensor-wise pair
    multiplies by their product, otherwise by scale_a's factor first, then scale_b's."""
    if SCALE_A == SCALE_TENSOR and SCALE_B == SCALE_TENSOR:
        acc = acc * (fa * fb)
    else:
        if SCALE_A == SCALE_TENSOR:
            acc = acc * fa
        elif SCALE_A == SCALE_VECTOR:
            acc = acc * gl.expand_dims(fa, 1)
        if SCALE_B == SCALE_TENSOR:
            acc = acc * fb
        elif SCALE_B == SCALE_VECTOR:
            acc = acc * gl.expand_dims(fb, 0)
    return acc


@gluon.jit
def _stage_tile(acc, tile_id, it, sa, sb, scale_a, scale_b, M, N, num_pid_m, num_pid_n, chunk_m, num_chunks,
                start_chunk, empty, c_smem, c_empty, c_ready, c_phase, layout: gl.constexpr, BLOCK_M: gl.constexpr,
                BLOCK_N: gl.constexpr, GROUP_M: gl.constexpr, STAGES: gl.constexpr, TILE_ORDER: gl.constexpr,
                SCALE_A: gl.constexpr, SCALE_B: gl.constexpr, num_warps: gl.constexpr):
    """The MMA warps' end of tile ``tile_id`` (gemm_ws's and each gemm_pp consumer's), whose last
    wgmma group (ring index ``it - 1``) is in flight: the row-/column-wise scales loaded while
    it runs, its wait and the last stage freed, the scales applied, then the fp32 accumulator
    converted into the staging buffer ``c_smem`` once ``c_empty`` (phase ``c_phase``) says the
    store warp has read it out, and ``c_ready`` arrived. Returns the accumulator (its registers
    carry on into the next tile's wgmma)."""
    fa = sa
    fb = sb
    if SCALE_A == SCALE_VECTOR or SCALE_B == SCALE_VECTOR:
        # row-/column-wise scales: loaded while the tile's last wgmma group runs
        pid_m, pid_n = _tile_coords(tile_id, M, num_pid_m, num_pid_n, chunk_m, num_chunks, start_chunk,
                                    BLOCK_M, GROUP_M, TILE_ORDER)
        fa, fb = _load_scales(layout, pid_m * BLOCK_M, pid_n * BLOCK_N, M, N, sa, sb, scale_a, scale_b,
                              BLOCK_M, BLOCK_N, SCALE_A, SCALE_B, num_warps)
    acc = warpgroup_mma_wait(0, deps=(acc, ))
    mbarrier.arrive(empty.index((it + STAGES - 1) % STAGES), count=1)
    if SCALE_A != SCALE_NONE or SCALE_B != SCALE_NONE:
        acc = _scale_acc(acc, fa, fb, SCALE_A, SCALE_B)
    # the staging buffer is free once the store warp's previous TMA store has read it
    mbarrier.wait(c_empty, c_phase)
    c_smem.store(acc.to(c_smem.dtype))
    fence_async_shared()
    mbarrier.arrive(c_ready, count=1)
    return acc


@gluon.jit
def _mma_partition(p, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr, GROUP_M: gl.constexpr,
                    STAGES: gl.constexpr, TILE_ORDER: gl.constexpr, B_KMAJOR: gl.constexpr, EPILOGUE: gl.constexpr,
                    EPI_TMA: gl.constexpr, WAIT: gl.constexpr, RECORD_TILES: gl.constexpr, SCALE_A: gl.constexpr,
                    SCALE_B: gl.constexpr, num_warps: gl.constexpr):
    (a_desc, b_desc, a_bufs, b_bufs, ready, empty, c_smem, c_ready, c_empty,
     M, N, K, chunk_m, num_chunks, start_chunk, counters, signal_ptrs, epi_gen, epi_descs,
     wait_signal, wait_gen, wait_timeout, err_ptr, tile_records, scale_a, scale_b) = p
    num_pid_m = gl.cdiv(M, BLOCK_M)
    num_pid_n = gl.cdiv(N, BLOCK_N)
    k_tiles = gl.cdiv(K, BLOCK_K)
    # wgmma's K per instruction: 32 bytes of operand (16 for bf16/fp16, 32 for fp8)
    INSTR_K: gl.constexpr = 256 // a_desc.dtype.primitive_bitwidth
    mma_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                         instr_shape=[16, BLOCK_N, INSTR_K])
    acc = gl.zeros((BLOCK_M, BLOCK_N), dtype=gl.float32, layout=mma_layout)
    # tensor-wise scales: one value each for the whole call, read once
    sa = 1.0
    sb = 1.0
    if SCALE_A == SCALE_TENSOR:
        sa = gl.load(scale_a)
    if SCALE_B == SCALE_TENSOR:
        sb = gl.load(scale_b)
    it = 0
    tc = 0
    for tile_id in range(gl.program_id(0), num_pid_m * num_pid_n, gl.num_programs(0)):
        for ki in range(k_tiles):
            s = it % STAGES
            mbarrier.wait(ready.index(s), (it // STAGES) & 1)
            if B_KMAJOR:
                b_op = b_bufs.index(s).permute((1, 0))
            else:
                b_op = b_bufs.index(s)
            # fp8: Triton's sm_90 default max_num_imprecise_acc (2**30, as tl.dot in gemm.py):
            # the tensor core accumulates across all of K, no fp32 promotion in between
            acc = warpgroup_mma(a_bufs.index(s), b_op, acc, use_acc=ki > 0, is_async=True)
            # one wgmma group in flight: the previous stage's is done, so it is free
            acc = warpgroup_mma_wait(1, deps=(acc, ))
            mbarrier.arrive(empty.index((it + STAGES - 1) % STAGES), count=1, pred=ki > 0)
            it += 1
        acc = _stage_tile(acc, tile_id, it, sa, sb, scale_a, scale_b, M, N, num_pid_m, num_pid_n, chunk_m,
                          num_chunks, start_chunk, empty, c_smem, c_empty, c_ready, (tc & 1) ^ 1, mma_layout,
                          BLOCK_M, BLOCK_N, GROUP_M, STAGES, TILE_ORDER, SCALE_A, SCALE_B, num_warps)
        tc += 1


# Per-call values (generations, chunk geometry) and the hook buffers are not specialized on, so
# a new generation never compiles a new kernel.
@gluon.jit(do_not_specialize=["chunk_m", "num_chunks", "start_chunk", "epi_gen", "wait_gen", "wait_timeout"],
           do_not_specialize_on_alignment=["counters", "signal_ptrs", "wait_signal", "err_ptr", "tile_records",
                                           "scale_a", "scale_b"])
def gemm_ws_kernel(a_desc, b_desc, c_desc, M, N, K, chunk_m, num_chunks, start_chunk,
                   wait_signal, wait_gen, wait_timeout, err_ptr,
                   counters, signal_ptrs, epi_gen,
                   epi_d0, epi_d1, epi_d2, epi_d3, epi_d4, epi_d5, epi_d6, epi_d7, tile_records, scale_a, scale_b,
                   BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr, GROUP_M: gl.constexpr,
                   STAGES: gl.constexpr, TILE_ORDER: gl.constexpr, B_KMAJOR: gl.constexpr,
                   EPILOGUE: gl.constexpr, EPI_TMA: gl.constexpr, WAIT: gl.constexpr, RECORD_TILES: gl.constexpr,
                   SCALE_A: gl.constexpr, SCALE_B: gl.constexpr, num_warps: gl.constexpr):
    # a and b may differ in fp8 (e4m3 x e5m2 mixes); the output (c_desc) is bf16, fp16 or fp32
    a_bufs = gl.allocate_shared_memory(a_desc.dtype, [STAGES] + a_desc.block_type.shape, a_desc.layout)
    b_bufs = gl.allocate_shared_memory(b_desc.dtype, [STAGES] + b_desc.block_type.shape, b_desc.layout)
    c_smem = gl.allocate_shared_memory(c_desc.dtype, c_desc.block_type.shape, c_desc.layout)
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    c_ready = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    c_empty = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(ready.index(i), count=1)
        mbarrier.init(empty.index(i), count=1)
    mbarrier.init(c_ready, count=1)
    mbarrier.init(c_empty, count=1)
    polls = _alloc_polls(ready, empty, WAIT)
    # the store warp's eight descriptors, inline: a @gluon.jit helper returning this tuple failed to
    # compile where the per-chunk ones include None (fewer than eight chunks; found on the H200)
    if EPILOGUE and EPI_TMA == EPI_TMA_STACKED:
        epi_descs = (epi_d0, epi_d0, epi_d0, epi_d0, epi_d0, epi_d0, epi_d0, epi_d0)
    elif EPILOGUE:
        epi_descs = (epi_d0, epi_d1, epi_d2, epi_d3, epi_d4, epi_d5, epi_d6, epi_d7)
    else:
        epi_descs = (c_desc, c_desc, c_desc, c_desc, c_desc, c_desc, c_desc, c_desc)
    p = (a_desc, b_desc, a_bufs, b_bufs, ready, empty, c_smem, c_ready, c_empty,
         M, N, K, chunk_m, num_chunks, start_chunk, counters, signal_ptrs, epi_gen, epi_descs,
         wait_signal, wait_gen, wait_timeout, err_ptr, tile_records, scale_a, scale_b)
    # The list twice, as literals: Triton's frontend takes no list (nor argument tuples holding
    # the constexprs) from a variable, and the plain kernels stay without the poll warp.
    if WAIT:   # the poll warp, in the load and store warps' warpgroup (Triton pads workers to one)
        gl.warp_specialize([
            (_mma_partition, (p, BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, STAGES, TILE_ORDER, B_KMAJOR, EPILOGUE, EPI_TMA,
                              WAIT, RECORD_TILES, SCALE_A, SCALE_B, num_warps)),
            (_load_partition, (p, polls, BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, STAGES, TILE_ORDER, B_KMAJOR, EPILOGUE,
                               EPI_TMA, WAIT, RECORD_TILES)),
            (_store_partition, (p, BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, STAGES, TILE_ORDER, B_KMAJOR, EPILOGUE, EPI_TMA,
                                WAIT, RECORD_TILES)),
            (_poll_partition, (p, polls, BLOCK_M, BLOCK_N, GROUP_M, TILE_ORDER)),
        ], [1, 1, 1], [40, 40, 40])
    else:
        gl.warp_specialize([
            (_mma_partition, (p, BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, STAGES, TILE_ORDER, B_KMAJOR, EPILOGUE, EPI_TMA,
                              WAIT, RECORD_TILES, SCALE_A, SCALE_B, num_warps)),
            (_load_partition, (p, polls, BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, STAGES, TILE_ORDER, B_KMAJOR, EPILOGUE,
                               EPI_TMA, WAIT, RECORD_TILES)),
            (_store_partition, (p, BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, STAGES, TILE_ORDER, B_KMAJOR, EPILOGUE, EPI_TMA,
                                WAIT, RECORD_TILES)),
        ], [1, 1], [40, 40])
