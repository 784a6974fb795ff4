"""The GEMM core's per-tile timeline (``matmul(tile_records=...)``, the kernels' RECORD_TILES):
under TRITON_INTERPRET=1 every tile gets its row once, with the logical clock, and the result is
the one without records; compiled offline for sm_90, both kernels without records read no
%globaltimer beyond their wait hook's, and with records they read it where the docs say.

The interpreter is switched on per test (``interpreter`` fixture), not for the module: the
compile tests below need Triton's compiler.
"""
import dataclasses
import os
import sys

import pytest
import torch

pytest.importorskip("triton", reason="triton is not installed")

import tpfuse.kernels  # noqa: E402
from tpfuse import gemm as gc  # noqa: E402
from tpfuse import testing  # noqa: E402
from tpfuse.gemm import device  # noqa: E402
from tpfuse.kernels import abi  # noqa: E402

# 16x16 tiles on 4 programs: every program runs several tiles
CFG = gc.GemmConfig(BLOCK_M=16, BLOCK_N=16, BLOCK_K=16, GROUP_M=2, num_warps=4, num_stages=1, num_programs=4)
KERNEL_MODULES = ("tpfuse.kernels.gemm", "tpfuse.kernels.signals", "tpfuse.kernels.tile_records")


def _drop_kernels():
    # and the package's attributes: ``from ..kernels import gemm`` (triton_modules) takes them
    # over sys.modules
    for name in KERNEL_MODULES:
        sys.modules.pop(name, None)
        vars(tpfuse.kernels).pop(name.rpartition(".")[2], None)
    device.triton_modules.cache_clear()


@pytest.fixture
def interpreter():
    """TRITON_INTERPRET=1 with the kernel modules decorated afresh; as it was after."""
    previous = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1"
    _drop_kernels()
    yield
    if previous is None:
        os.environ.pop("TRITON_INTERPRET", None)
    else:
        os.environ["TRITON_INTERPRET"] = previous
    _drop_kernels()


def _operands(m, k, n, seed):
    g = torch.Generator().manual_seed(seed)
    a = torch.randn(m, k, generator=g).to(torch.bfloat16)
    b = torch.randn(n, k, generator=g).to(torch.bfloat16).t()
    return a, b, testing.Reference.of(a, b)


def _grouped_position(m, n, group_m=2, block=16):
    """Tile id (pid_m * N-tiles + pid_n) -> its position in the grouped order (GROUP_M swizzle)."""
    npm, npn = -(-m // block), -(-n // block)
    pos = {}
    for t in range(npm * npn):
        first = (t // (group_m * npn)) * group_m
        rows = min(npm - first, group_m)
        pid_m, pid_n = first + (t % (group_m * npn)) % rows, (t % (group_m * npn)) // rows
        pos[pid_m * npn + pid_n] = t
    return pos


def _check_rows(rec, plan, waited):
    """Every tile's row written once, by a program of the grid, start <= wait done <= end."""
    rows = rec[:plan.num_tiles]
    assert rows[:, abi.REC_TILE].tolist() == list(range(plan.num_tiles))
    programs = rows[:, abi.REC_PROGRAM]
    assert ((programs >= 0) & (programs < plan.programs)).all()
    assert (rows[:, abi.REC_SM] == -1).all()   # no %smid without inline PTX
    start, wait, end = rows[:, abi.REC_START_NS], rows[:, abi.REC_WAIT_NS], rows[:, abi.REC_END_NS]
    assert ((start <= wait) & (wait <= end)).all()
    # the logical clock: 3 * (the program's work item) + 0, 1 (with a wait hook; else = start), 2
    assert (start % abi.REC_CLOCK_STEPS == 0).all() and (end == start + 2).all()
    assert (wait == start + (1 if waited else 0)).all()
    # per program, its work items 0, 1, 2, ... (each once)
    for p in programs.unique().tolist():
        steps = sorted((start[programs == p] // abi.REC_CLOCK_STEPS).tolist())
        assert steps == list(range(len(steps))), (p, steps)


@pytest.mark.parametrize("order,chunk_m,start", [("grouped", None, 0), ("round", 33, 2), ("owner", 33, 3)])
def test_one_row_per_tile_and_the_same_result(interpreter, order, chunk_m, start):
    # 9 x 5 tiles of 16x16 (ragged last row and column of tiles); chunks of 33 rows straddle tiles
    m, k, n = 130, 70, 65
    a, b, ref = _operands(m, k, n, seed=1)
    plain = gc.matmul(a, b, config=CFG, tile_order=order, chunk_m=chunk_m, start_chunk=start)
    assert not gc.last_plan().record_tiles
    rec = gc.tile_records_for(m, n, CFG)
    out = torch.full((m, n), float("nan"), dtype=torch.bfloat16)
    gc.matmul(a, b, out=out, config=CFG, tile_order=order, chunk_m=chunk_m, start_chunk=start, tile_records=rec)
    plan = gc.last_plan()
    assert plan.record_tiles and plan.kernel == "gemm_kernel" and plan.num_tiles == 45 == rec.shape[0]
    assert plan.tile_shape == (16, 16) and plan.tile_grid == (9, 5) and "per-tile records: 45 rows" in plan.explain()
    assert torch.equal(out, plain)   # the records change nothing computed
    testing.assert_close(out, ref, dtype=torch.bfloat16, norm="fro")
    _check_rows(rec, plan, waited=False)
    if order == "grouped":
        # row t is tile t of the grid, not the t-th of the order: program p runs order
        # positions p, p + P, ... as its work items 0, 1, ...
        pos = _grouped_position(m, n)
        for t, row in enumerate(rec.tolist()):
            assert row[abi.REC_PROGRAM] == pos[t] % plan.programs
            assert row[abi.REC_START_NS] == abi.REC_CLOCK_STEPS * (pos[t] // plan.programs)


def test_wait_hook_with_signals_preset(interpreter):
    m, k, n, chunk_m = 130, 70, 65, 27
    a, b, ref = _operands(m, k, n, seed=2)
    signal = torch.tensor([5, 7, 5, 9, 5], dtype=torch.int32)   # >= generation 5 everywhere
    wait = gc.WaitSpec(signal, generation=5, chunk_m=chunk_m, max_spins=10)
    plain = gc.matmul(a, b, config=CFG, tile_order="round", start_chunk=1, wait=wait)
    rec = gc.tile_records_for(m, n, CFG)
    out = gc.matmul(a, b, config=CFG, tile_order="round", start_chunk=1, wait=wait, tile_records=rec)
    assert torch.equal(out, plain) and signal.tolist() == [5, 7, 5, 9, 5]
    _check_rows(rec, gc.last_plan(), waited=True)


def test_stream_k_tiles_are_recorded_by_the_segment_that_completes_them(interpreter):
    # 7 x 10 = 70 tiles on 4 programs, stream_k=2: the last 6 tiles are shared out by K-steps
    m, k, n = 100, 40, 160
    a, b, _ = _operands(m, k, n, seed=3)
    cfg = dataclasses.replace(CFG, stream_k=2)
    plain = gc.matmul(a, b, config=cfg)
    rec = gc.tile_records_for(m, n, cfg)
    out = gc.matmul(a, b, config=cfg, tile_records=rec)
    plan = gc.last_plan()
    assert plan.sk_tiles > 0 and torch.equal(out, plain)
    rows = rec[:plan.num_tiles]
    assert rows[:, abi.REC_TILE].tolist() == list(range(plan.num_tiles))
    assert (rows[:, abi.REC_START_NS] <= rows[:, abi.REC_END_NS]).all()


def test_epilogue_hook_and_rows_past_the_grid(interpreter):
    m, k, n, chunk_m = 100, 40, 45, 27
    a, b, ref = _operands(m, k, n, seed=4)
    dests = [torch.full((chunk_m, n), float("nan"), dtype=torch.bfloat16) for _ in range(4)]
    signals = torch.zeros(4, dtype=torch.int32)
    rec = torch.full((25, abi.TILE_RECORD_COLUMNS), -1, dtype=torch.int64)   # 7 x 3 tiles: 4 rows spare
    gc.matmul(a, b, config=CFG, tile_order="owner", start_chunk=1, tile_records=rec,
              epilogue=gc.EpilogueSpec.from_tensors(dests, signals, 1, chunk_m))
    plan = gc.last_plan()
    assert signals.tolist() == [1] * 4 and plan.num_tiles == 21
    testing.assert_close(torch.cat(dests)[:m], ref, dtype=torch.bfloat16, norm="fro")
    _check_rows(rec, plan, waited=False)
    assert (rec[21:] == -1).all(), "rows past the tile grid must be left as they are"


def test_tile_box_maps_a_tile_to_its_rows_and_columns(interpreter):
    a, b, _ = _operands(130, 16, 65, seed=5)
    gc.matmul(a, b, config=CFG, chunk_m=33, tile_order="round")
    plan = gc.last_plan()
    assert plan.tile_box(0) == (0, 16, 0, 16) and plan.tile_box(6) == (16, 32, 16, 32)
    assert plan.tile_box(44) == (128, 130, 64, 65)   # the ragged corner, clipped to M and N
    lo, hi = plan.tile_box(12)[:2]                   # M-tile 2: rows 32..47, chunks 0 and 1
    assert (lo // plan.chunk_m, (hi - 1) // plan.chunk_m) == (0, 1)
    with pytest.raises(ValueError, match="tile=45; this plan has tiles 0..44"):
        plan.tile_box(45)
    assert gc.tile_records_for(130, 65, plan).shape == (45, abi.TILE_RECORD_COLUMNS)
    with pytest.raises(ValueError, match="plan is for M=130, N=65"):
        gc.tile_records_for(64, 65, plan)
    with pytest.raises(TypeError, match="GemmConfig"):
        gc.tile_records_for(130, 65, None)


def test_tile_records_for_a_config_fits_either_kernel():
    # a 128x256 config may run as the Gluon kernel's 128x128 tiles (ws_choice): rows for those
    big = gc.GemmConfig(BLOCK_M=128, BLOCK_N=256, BLOCK_K=64)
    assert gc.tile_records_for(4096, 3584, big).shape == (32 * 28, abi.TILE_RECORD_COLUMNS)
    small = gc.GemmConfig(BLOCK_M=64, BLOCK_N=64, BLOCK_K=64)
    rec = gc.tile_records_for(100, 100, small)
    assert rec.shape == (4, abi.TILE_RECORD_COLUMNS) and rec.dtype == torch.int64 and (rec == -1).all()


@pytest.mark.parametrize("records,exc,match", [
    (lambda: [[0] * 6] * 9, TypeError, "tile_records must be a torch.Tensor or None, got list"),
    (lambda: torch.zeros(9, 6, dtype=torch.int32), TypeError, "tile_records.dtype=torch.int32; need torch.int64"),
    (lambda: torch.zeros(8, 6, dtype=torch.int64), ValueError, r"is \(8, 6\); need \[>= 9, 6\].*3x3 grid of 16x16"),
    (lambda: torch.zeros(9, 5, dtype=torch.int64), ValueError, r"is \(9, 5\); need \[>= 9, 6\]"),
    (lambda: torch.zeros(6, 9, dtype=torch.int64).t(), ValueError, "need a contiguous tensor"),
    (lambda: torch.zeros(9, 6, dtype=torch.int64, device="meta"), ValueError, "is on meta; need cpu"),
])
def test_bad_tile_records_name_the_argument_and_the_fix(interpreter, records, exc, match):
    a, b, _ = _operands(40, 16, 40, seed=6)
    with pytest.raises(exc, match=match):
        gc.matmul(a, b, config=CFG, tile_records=records())


# ---- offline sm_90 compile (tests/cpu/test_kernel_tools.py's pattern) -------------------------
def _offline():
    """(compile_kernel, compile_ws_kernel) of tpfuse/gemm/offline.py; skips under the
    interpreter, without Triton's bundled ptxas, and on Triton versions other than the one the
    counts below were read off."""
    import triton
    from pathlib import Path
    if os.environ.get("TRITON_INTERPRET") == "1":
        pytest.skip("compiling needs Triton's compiler, not the interpreter")
    if not (Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas").exists():
        pytest.skip("Triton without its bundled ptxas")
    if not triton.__version__.startswith("3.6."):
        pytest.skip(f"compiler-output checks are pinned to Triton 3.6.x; this is {triton.__version__}")
    from tpfuse.gemm.offline import compile_kernel, compile_ws_kernel
    return compile_kernel, compile_ws_kernel


def _reads(ptx):
    return ptx.count("%globaltimer"), ptx.count("%smid")


# %globaltimer reads in the PTX without records: the wait hook's bounded spin only (pinned to
# what Triton 3.6 makes of it: the flattened loop's pipeliner copies it); the records add the
# tile's start and end, and wait done with a wait hook, once each in the nested loops
@pytest.mark.parametrize("hook,timer_off,timer_added", [("none", (0, 0), 2), ("wait", (3, 12), 3),
                                                        ("epilogue", (0, 0), 2)])
@pytest.mark.parametrize("flatten", [False, True], ids=["nested", "flat"])
def test_offline_gemm_kernel_reads_the_clock_only_with_records(hook, timer_off, timer_added, flatten):
    compile_kernel, _ = _offline()
    cfg = gc.GemmConfig(BLOCK_M=128, BLOCK_N=256, BLOCK_K=64, num_warps=8, num_stages=3, flatten=flatten)
    kw = {"none": {}, "wait": dict(wait=True, tile_order=1),
          "epilogue": dict(epilogue=True, tile_order=2, epi_tma=9, epi_count=4 if flatten else 3)}[hook]
    off = compile_kernel(4096, 4096, 1792, cfg, **kw)
    on = compile_kernel(4096, 4096, 1792, cfg, record_tiles=True, **kw)
    assert _reads(off.asm["ptx"]) == (timer_off[flatten], 0)
    timer_on, smid_on = _reads(on.asm["ptx"])
    if flatten:   # the pipeliner's prologue and epilogue hold copies of the tile's prologue and epilogue
        assert timer_on >= timer_off[flatten] + timer_added and smid_on >= 1
    else:
        assert (timer_on, smid_on) == (timer_off[flatten] + timer_added, 1)
    # the loops stay as they were (flattened: one pipelined loop), shared memory too, no spills
    from test_kernel_tools import _enclosing_loops
    from tpfuse.gemm.offline import sass_of
    ttgir = on.asm["ttgir"]
    assert _enclosing_loops(ttgir, "warp_group_dot") == (1 if flatten else 2)
    assert ttgir.count("async_tma_copy_global_to_local") == off.asm["ttgir"].count("async_tma_copy_global_to_local")
    assert on.metadata.shared == off.metadata.shared
    _, res = sass_of(on.asm["cubin"])
    assert "LOCAL:0" in res and "STACK:0" in res


@pytest.mark.parametrize("hook,timer_off,timer_added", [("none", 0, 2), ("wait", 2, 3), ("epilogue", 0, 2)])
def test_offline_ws_kernel_reads_the_clock_only_with_records(hook, timer_off, timer_added):
    # the load warp reads start (and wait done), the store warp end; no %globaltimer without
    # records but the wait hook's spin (pinned to Triton 3.6's PTX, as above)
    _, compile_ws = _offline()
    kw = {"none": {}, "wait": dict(wait=True, tile_order=1), "epilogue": dict(epi_tma=9)}[hook]
    off = compile_ws(4096, 4096, 1792, **kw)
    on = compile_ws(4096, 4096, 1792, record_tiles=True, **kw)
    assert _reads(off.asm["ptx"]) == (timer_off, 0)
    assert _reads(on.asm["ptx"]) == (timer_off + timer_added, 1)
    from tpfuse.gemm.offline import sass_of
    _, res = sass_of(on.asm["cubin"])
    assert "LOCAL:0" in res and "STACK:0" in res and on.metadata.shared <= 232448


@pytest.mark.parametrize("hook", ["none", "wait", "epilogue"])
def test_offline_stream_k_compiles_with_records(hook):
    """Stream-K with records on compiles (its loop already had a ``t_start``: the tile's first
    K-step; a record time of the same name redefined it with another type, which the GPU run of
    tests/gpu/test_gemm_core.py::test_tile_records_on_gpu caught) and reads the clock only with
    records."""
    compile_kernel, _ = _offline()
    cfg = gc.GemmConfig(BLOCK_M=128, BLOCK_N=128, BLOCK_K=64, num_warps=8, num_stages=4, stream_k=1)
    kw = {"none": {}, "wait": dict(wait=True, tile_order=1), "epilogue": dict(epilogue=True, tile_order=2)}[hook]
    off = compile_kernel(1024, 1024, 4096, cfg, sk_tiles=16, **kw)
    on = compile_kernel(1024, 1024, 4096, cfg, sk_tiles=16, record_tiles=True, **kw)
    assert _reads(on.asm["ptx"])[0] > _reads(off.asm["ptx"])[0] and _reads(on.asm["ptx"])[1] >= 1
