"""Ping-pong warp-specialized persistent GEMM (Gluon, sm_90) for fp8 calls: ``c = a @ b``.

gemm_ws.py's MMA partition (two warpgroups on one tile) scales, converts and writes a tile's
accumulator while the tensor cores wait; on short-K fp8 shapes (M=4096 N=4096 K=1792, ~12 us per
tile on the H200) that epilogue costs 5-10 % (issue 29). Here, as in CUTLASS's
``KernelTmaWarpSpecializedPingpong``, two consumer warpgroups each own a whole 128x128 tile
(its fp32 accumulator: 128 registers per thread) and take alternate tiles of the program's
persistent tile sequence, so one consumer's epilogue runs under the other's MMAs. Partitions:

====================== ======= ========= =====================================================
partition              warps   registers what
====================== ======= ========= =====================================================
consumer 0 (default)   4       232       the program's tiles 0, 2, 4, ...: wgmma, scale,
                                         convert, write its own staging buffer
consumer 1             4       232       tiles 1, 3, 5, ...
load                   1       40        TMA loads of A and B into one ring of ``STAGES``
                                         stages, in tile order (tile 0's K-steps, tile 1's, ...);
                                         the poll warp's word before the loads of a tile
                                         that touches a chunk new to the program
store                  1       40        TMA stores of the two staging buffers, alternately;
                                         the epilogue hook's count and publication after each
poll (wait hook only)  1       40        gemm_ws's poll warp: the flags' bounded waits, up to
                                         ``POLL_DEPTH`` handoffs ahead of the load warp
====================== ======= ========= =====================================================

(Triton pads the workers to whole warpgroups: 12 warps, the load/store(/poll) warpgroup at 40
registers; the default partition gets the rest of the 64K, 232.)

mbarriers: ``ready[s]`` / ``empty[s]`` per stage of the shared ring; ``c_ready[c]`` /
``c_empty[c]`` per consumer's staging buffer; ``turn[c]``, the ordering barrier: consumer ``c``
starts a tile's mainloop only after the other consumer has issued its previous tile's last
wgmma. That keeps the two mainloops from interleaving (CUTLASS's ordered barrier) and is also
what keeps the shared ring's phase parity unambiguous: a consumer waits on ring index
``r = (local tile) * k_tiles + ki`` with parity ``(r // STAGES) & 1``, which reads right only if
that stage's previous fill (``r - STAGES``, perhaps the other consumer's) has landed -- true
once every ring index below this tile's has been waited on. Without it consumer 1 could take
stage ``s``'s fill for consumer 0 two fills earlier as its own.

Numerics: gemm_ws's. The same wgmma K-steps (32 per instruction, 128 per stage) in the same
order with the same accumulation (Triton's sm_90 default ``max_num_imprecise_acc``), the scales
through gemm_ws's ``_load_scales`` / ``_scale_acc`` (gemm.py's ``_scale_tile`` order), the same
rounding to the output; so a tile is meant to be bitwise gemm_ws's and gemm_kernel's. Dtypes:
fp8 (e4m3, e4m3 x e5m2 mixes) into bf16/fp16/float32, b K-major, 128x128x128 tiles only. Tile
order: gemm.py's ``_tile_coords``. Edges: TMA zero-fills loads past M, N, K and clips stores.

Stages: as many 32 KiB fp8 stages as fit beside the two 128x128 staging buffers in sm_90's
227 KiB: 5 for a 16-bit output (2 x 32 KiB), 3 for float32 (2 x 64 KiB) (the host passes
them: ``tpfuse.gemm.config.PINGPONG_STAGES``).

Arguments: gemm_ws_kernel's, in its order, so the host's argument list, direct launch and
PreparedMatmul serve both.

Hooks, one at a time (not ``EPILOGUE`` and ``WAIT`` together), and ``RECORD_TILES``: gemm_ws's
protocol, run by gemm_ws's own per-tile code in the same roles (gemm_ws.py's docstring states
it). The load warp is gemm_ws's own ``_load_partition`` (it takes gemm_ws's argument tuple,
with the two staging buffers and their barriers in the places of gemm_ws's one, which it does
not touch): before the loads of a tile that touches a chunk no earlier tile of the program
touched, ``_before_tile_loads`` waits for the poll warp's slot (gemm_ws's ``_poll_partition``,
which hands off the same tiles and runs the wait hook's bounded ``_wait_chunks``; a timeout is
recorded in the error word and the loads go on) and issues ``fence.proxy.async.global``; before
every tile's loads it writes the tile record's start; the consumers wait only for operands.
The store warp calls ``_store_tile_and_count`` on each consumer's staging buffer in turn (the
TMA store through the output's descriptor, the stacked destinations' one or the tile's
chunk's, then per chunk the tile touches the count, the chunk's last tile publishing the
generation) and writes the tile record's end. All four kinds of partition walk the same tiles
in the same order (``_tile_coords`` with the call's ``chunk_m``, ``num_chunks``,
``start_chunk``), so the round and owner orders of hooked calls hold here as in gemm_ws. GPU:
tests/gpu/test_gemm_pp_gpu.py (H200, 4cd5880, 711a2e0, 087127f and 0704ad4's tree).
"""
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (mbarrier, tma,
                                                              warpgroup_mma, warpgroup_mma_wait)

from .gemm import _tile_coords
# gemm_ws's hooks as its load and store warps run them, per tile (one protocol, one code)
from .gemm_ws import (EPI_TMA_STACKED, SCALE_TENSOR, _alloc_polls, _load_partition, _poll_partition, _stage_tile,
                      _store_tile_and_count)
from .tile_records import record_end, tile_clock

# Launch geometry (the host passes these; tpfuse/gemm/launch.py, offline.py): the default
# partition is consumer 0, one warpgroup; the workers add consumer 1 and the load and store warps.
NUM_WARPS = 4
# 64K registers over 12 warps (the workers padded to two warpgroups): 168 per thread at launch,
# then setmaxnreg 232 / 232 / 40 (CUTLASS's ping-pong split: 2 x 232 + 40 <= 512 per thread triple)
MAXNREG = 168
CONSUMER_REGS = 232
DATA_MOVER_REGS = 40
BLOCK = (128, 128, 128)
_CONSUMER_REGS = gl.constexpr(CONSUMER_REGS)
_DATA_MOVER_REGS = gl.constexpr(DATA_MOVER_REGS)

@gluon.jit
def _pp_store_partition(p, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr,
                        GROUP_M: gl.constexpr, STAGES: gl.constexpr, TILE_ORDER: gl.constexpr,
                        EPILOGUE: gl.constexpr, EPI_TMA: gl.constexpr, RECORD_TILES: gl.constexpr):
    """The program's tiles in order: tile j from consumer j % 2's staging buffer, stored and
    (epilogue hook) counted by gemm_ws's ``_store_tile_and_count``; the tile record's end."""
    (a_desc, b_desc, a_bufs, b_bufs, ready, empty, c_bufs, c_ready, c_empty,
     M, N, K, chunk_m, num_chunks, start_chunk, counters, signal_ptrs, epi_gen, epi_descs,
     wait_signal, wait_gen, wait_timeout, err_ptr, tile_records, scale_a, scale_b) = p
    num_pid_m = gl.cdiv(M, BLOCK_M)
    num_pid_n = gl.cdiv(N, BLOCK_N)
    j = 0
    for tile_id in range(gl.program_id(0), num_pid_m * num_pid_n, gl.num_programs(0)):
        pid_m, pid_n = _tile_coords(tile_id, M, num_pid_m, num_pid_n, chunk_m, num_chunks, start_chunk,
                                    BLOCK_M, GROUP_M, TILE_ORDER)
        c = j % 2
        mbarrier.wait(c_ready.index(c), (j // 2) & 1)
        _store_tile_and_count(c_bufs.index(c), c_empty.index(c), epi_descs, pid_m * BLOCK_M, pid_n * BLOCK_N, M,
                              chunk_m, num_pid_n, counters, signal_ptrs, epi_gen, BLOCK_M, EPILOGUE, EPI_TMA)
        if RECORD_TILES:
            record_end(tile_records, pid_m * num_pid_n + pid_n, tile_clock(0, 2, True))
        j += 1
    tma.store_wait(0)


@gluon.jit
def _pp_consumer_partition(p, turn, CONSUMER: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                           BLOCK_K: gl.constexpr, GROUP_M: gl.constexpr, STAGES: gl.constexpr,
                           TILE_ORDER: gl.constexpr, SCALE_A: gl.constexpr, SCALE_B: gl.constexpr,
                           num_warps: gl.constexpr):
    """Consumer ``CONSUMER`` (0 or 1): the program's tiles ``CONSUMER``, ``CONSUMER + 2``, ...,
    each a whole 128x128 tile in this warpgroup's accumulator, as gemm_ws's MMA partition
    computes, scales and stages it."""
    (a_desc, b_desc, a_bufs, b_bufs, ready, empty, c_bufs, c_ready, c_empty,
     M, N, K, chunk_m, num_chunks, start_chunk, counters, signal_ptrs, epi_gen, epi_descs,
     wait_signal, wait_gen, wait_timeout, err_ptr, tile_records, scale_a, scale_b) = p
    num_pid_m = gl.cdiv(M, BLOCK_M)
    num_pid_n = gl.cdiv(N, BLOCK_N)
    k_tiles = gl.cdiv(K, BLOCK_K)
    INSTR_K: gl.constexpr = 256 // a_desc.dtype.primitive_bitwidth
    mma_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                         instr_shape=[16, BLOCK_N, INSTR_K])
    acc = gl.zeros((BLOCK_M, BLOCK_N), dtype=gl.float32, layout=mma_layout)
    c_smem = c_bufs.index(CONSUMER)
    sa = 1.0
    sb = 1.0
    if SCALE_A == SCALE_TENSOR:
        sa = gl.load(scale_a)
    if SCALE_B == SCALE_TENSOR:
        sb = gl.load(scale_b)
    i = 0   # this consumer's tiles so far; its i-th is the program's tile 2 * i + CONSUMER
    for tile_id in range(gl.program_id(0) + CONSUMER * gl.num_programs(0), num_pid_m * num_pid_n,
                         2 * gl.num_programs(0)):
        # our turn at the tensor cores: the other consumer has issued its previous tile (consumer
        # 0's first wait passes at once, on the fresh barrier's phase before 0)
        mbarrier.wait(turn.index(CONSUMER), (i & 1) ^ (1 - CONSUMER))
        it = (2 * i + CONSUMER) * k_tiles   # this tile's first ring index
        for ki in range(k_tiles):
            s = it % STAGES
            mbarrier.wait(ready.index(s), (it // STAGES) & 1)
            # fp8: Triton's sm_90 default max_num_imprecise_acc, as gemm_ws and gemm.py's tl.dot
            acc = warpgroup_mma(a_bufs.index(s), b_bufs.index(s).permute((1, 0)), acc, use_acc=ki > 0,
                                is_async=True)
            acc = warpgroup_mma_wait(1, deps=(acc, ))
            mbarrier.arrive(empty.index((it + STAGES - 1) % STAGES), count=1, pred=ki > 0)
            it += 1
        # the other consumer's turn: its next tile's wgmma queue behind this one's last group
        mbarrier.arrive(turn.index(1 - CONSUMER), count=1)
        acc = _stage_tile(acc, tile_id, it, sa, sb, scale_a, scale_b, M, N, num_pid_m, num_pid_n, chunk_m,
                          num_chunks, start_chunk, empty, c_smem, c_empty.index(CONSUMER), c_ready.index(CONSUMER),
                          (i & 1) ^ 1, mma_layout, BLOCK_M, BLOCK_N, GROUP_M, STAGES, TILE_ORDER, SCALE_A, SCALE_B,
                          num_warps)
        i += 1


@gluon.jit(do_not_specialize=["chunk_m", "num_chunks", "start_chunk", "epi_gen", "wait_gen", "wait_timeout"],
           do_not_specialize_on_alignment=["counters", "signal_ptrs", "wait_signal", "err_ptr", "tile_records",
                                           "scale_a", "scale_b"])
def gemm_pp_kernel(a_desc, b_desc, c_desc, M, N, K, chunk_m, num_chunks, start_chunk,
                   wait_signal, wait_gen, wait_timeout, err_ptr,
                   counters, signal_ptrs, epi_gen,
                   epi_d0, epi_d1, epi_d2, epi_d3, epi_d4, epi_d5, epi_d6, epi_d7, tile_records, scale_a, scale_b,
                   BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr, GROUP_M: gl.constexpr,
                   STAGES: gl.constexpr, TILE_ORDER: gl.constexpr, B_KMAJOR: gl.constexpr,
                   EPILOGUE: gl.constexpr, EPI_TMA: gl.constexpr, WAIT: gl.constexpr, RECORD_TILES: gl.constexpr,
                   SCALE_A: gl.constexpr, SCALE_B: gl.constexpr, num_warps: gl.constexpr):
    gl.static_assert(not (EPILOGUE and WAIT), "gemm_pp_kernel: one hook at a time (as gemm_ws)")
    gl.static_assert(B_KMAJOR, "gemm_pp_kernel: b K-major (sm_90's fp8 wgmma)")
    gl.static_assert((BLOCK_M == 128) & (BLOCK_N == 128) & (BLOCK_K == 128), "gemm_pp_kernel: 128x128x128 tiles")
    gl.static_assert(num_warps == 4, "gemm_pp_kernel: one warpgroup per consumer")
    gl.static_assert(a_desc.dtype.primitive_bitwidth == 8, "gemm_pp_kernel: fp8 inputs")
    a_bufs = gl.allocate_shared_memory(a_desc.dtype, [STAGES] + a_desc.block_type.shape, a_desc.layout)
    b_bufs = gl.allocate_shared_memory(b_desc.dtype, [STAGES] + b_desc.block_type.shape, b_desc.layout)
    c_bufs = gl.allocate_shared_memory(c_desc.dtype, [2] + c_desc.block_type.shape, c_desc.layout)
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    c_ready = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    c_empty = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    turn = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(ready.index(i), count=1)
        mbarrier.init(empty.index(i), count=1)
    for c in gl.static_range(2):
        mbarrier.init(c_ready.index(c), count=1)
        mbarrier.init(c_empty.index(c), count=1)
        mbarrier.init(turn.index(c), count=1)
    polls = _alloc_polls(ready, empty, WAIT)
    # the store warp's descriptors as gemm_ws builds them; gemm_ws's argument tuple (the two
    # staging buffers and their barriers in the places of its one), so that its load warp serves
    # here as it is; the consumers take the ordering barriers besides
    if EPILOGUE and EPI_TMA == EPI_TMA_STACKED:
        epi_descs = (epi_d0, epi_d0, epi_d0, epi_d0, epi_d0, epi_d0, epi_d0, epi_d0)
    elif EPILOGUE:
        epi_descs = (epi_d0, epi_d1, epi_d2, epi_d3, epi_d4, epi_d5, epi_d6, epi_d7)
    else:
        epi_descs = (c_desc, c_desc, c_desc, c_desc, c_desc, c_desc, c_desc, c_desc)
    p = (a_desc, b_desc, a_bufs, b_bufs, ready, empty, c_bufs, c_ready, c_empty,
         M, N, K, chunk_m, num_chunks, start_chunk, counters, signal_ptrs, epi_gen, epi_descs,
         wait_signal, wait_gen, wait_timeout, err_ptr, tile_records, scale_a, scale_b)
    # The list twice, as literals: Triton's frontend takes no list (nor argument tuples holding
    # the constexprs) from a variable, and the plain kernels stay without the poll warp.
    if WAIT:   # gemm_ws's poll warp, in the load and store warps' warpgroup
        gl.warp_specialize([
            (_pp_consumer_partition, (p, turn, 0, BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, STAGES, TILE_ORDER, SCALE_A,
                                      SCALE_B, num_warps)),
            (_pp_consumer_partition, (p, turn, 1, BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, STAGES, TILE_ORDER, SCALE_A,
                                      SCALE_B, num_warps)),
            (_load_partition, (p, polls, BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, STAGES, TILE_ORDER, True, EPILOGUE,
                               EPI_TMA, WAIT, RECORD_TILES)),
            (_pp_store_partition, (p, BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, STAGES, TILE_ORDER, EPILOGUE, EPI_TMA,
                                   RECORD_TILES)),
            (_poll_partition, (p, polls, BLOCK_M, BLOCK_N, GROUP_M, TILE_ORDER)),
        ], [4, 1, 1, 1], [_CONSUMER_REGS, _DATA_MOVER_REGS, _DATA_MOVER_REGS, _DATA_MOVER_REGS])
    else:
        gl.warp_specialize([
            (_pp_consumer_partition, (p, turn, 0, BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, STAGES, TILE_ORDER, SCALE_A,
                                      SCALE_B, num_warps)),
            (_pp_consumer_partition, (p, turn, 1, BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, STAGES, TILE_ORDER, SCALE_A,
                                      SCALE_B, num_warps)),
            (_load_partition, (p, polls, BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, STAGES, TILE_ORDER, True, EPILOGUE,
                               EPI_TMA, WAIT, RECORD_TILES)),
            (_pp_store_partition, (p, BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, STAGES, TILE_ORDER, EPILOGUE, EPI_TMA,
                                   RECORD_TILES)),
        ], [4, 1, 1], [_CONSUMER_REGS, _DATA_MOVER_REGS, _DATA_MOVER_REGS])
