"""Per-tile timeline of the GEMM kernels (``matmul(tile_records=...)``): what a program writes
into its tiles' rows of an int64 ``[num_tiles, TILE_RECORD_COLUMNS]`` tensor.

Off by default: ``gemm_kernel`` (gemm.py), ``gemm_ws_kernel`` (gemm_ws.py) and ``gemm_pp_kernel``
(gemm_pp.py, through gemm_ws's per-tile helpers) call these only
under ``if RECORD_TILES:``, a constexpr, so a launch without records compiles to the kernel
without them. Row and column layout, and the clock without inline PTX: ``abi.py``.
Plain scalar stores and scalar inline PTX, so the Gluon kernel calls them as they are.
"""
import triton
import triton.language as tl

from . import abi
from .signals import now_ns

TILE_RECORD_COLUMNS = tl.constexpr(abi.TILE_RECORD_COLUMNS)
REC_TILE = tl.constexpr(abi.REC_TILE)
REC_PROGRAM = tl.constexpr(abi.REC_PROGRAM)
REC_SM = tl.constexpr(abi.REC_SM)
REC_START_NS = tl.constexpr(abi.REC_START_NS)
REC_WAIT_NS = tl.constexpr(abi.REC_WAIT_NS)
REC_END_NS = tl.constexpr(abi.REC_END_NS)
REC_CLOCK_STEPS = tl.constexpr(abi.REC_CLOCK_STEPS)


@triton.jit
def tile_clock(step, phase, USE_ASM: tl.constexpr):
    """%globaltimer (ns) with USE_ASM; else the program's logical clock ``3 * step + phase``
    (``step``: the program's work item, ``phase``: 0 start, 1 wait done, 2 end), monotonic
    within a program, not comparable across programs."""
    if USE_ASM:
        t = now_ns(USE_ASM)
    else:
        t = (step * REC_CLOCK_STEPS + phase).to(tl.int64)
    return t


@triton.jit
def sm_id(USE_ASM: tl.constexpr):
    """%smid of this program's SM with USE_ASM, else -1."""
    if USE_ASM:
        s = tl.inline_asm_elementwise("mov.u32 $0, %smid;", "=r", [], dtype=tl.int32, is_pure=False, pack=1)
    else:
        s = tl.full((), -1, tl.int32)
    return s


@triton.jit
def record_start(records, row, t_start, t_wait, USE_ASM: tl.constexpr):
    """Tile ``row``'s id, program, SM, start and wait-done times."""
    rec = records + row.to(tl.int64) * TILE_RECORD_COLUMNS
    tl.store(rec + REC_TILE, row.to(tl.int64))
    tl.store(rec + REC_PROGRAM, tl.program_id(0).to(tl.int64))
    tl.store(rec + REC_SM, sm_id(USE_ASM).to(tl.int64))
    tl.store(rec + REC_START_NS, t_start)
    tl.store(rec + REC_WAIT_NS, t_wait)


@triton.jit
def record_end(records, row, t_end):
    """Tile ``row``'s end time."""
    tl.store(records + row.to(tl.int64) * TILE_RECORD_COLUMNS + REC_END_NS, t_end)


@triton.jit
def record_tile(records, row, t_start, t_wait, t_end, USE_ASM: tl.constexpr):
    """Tile ``row``'s whole record (gemm_kernel writes it once, after the tile's stores)."""
    record_start(records, row, t_start, t_wait, USE_ASM)
    record_end(records, row, t_end)
