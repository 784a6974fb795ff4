"""The GPU-free diagnostics of the GEMM kernels: config specs, the host's choices between the
kernels and count modes, and the offline sm_90 compile (Triton ships ptxas, so no GPU is needed;
tpfuse/gemm/offline.py)."""
import dataclasses
import json
import os
import re
from pathlib import Path

import pytest
import torch

from tpfuse import gemm as gc
from tpfuse.gemm import launch
from tpfuse.gemm.offline import parse_spec
from tpfuse.kernels import abi


def test_parse_spec():
    assert parse_spec("cublas") is None
    assert parse_spec("128x256x64:stream_k=2,flatten=true,EPI_SUBTILE=2") == gc.GemmConfig(
        BLOCK_M=128, BLOCK_N=256, BLOCK_K=64, stream_k=2, flatten=True, EPI_SUBTILE=2)
    with pytest.raises(ValueError, match="BLOCK_M=96"):
        parse_spec("96x128x64")


def _ptxas():
    try:
        import triton
    except ImportError:
        return False
    return (Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas").exists()


# The compiler-output assertions of the pinned tests below (instruction counts, loop nesting,
# shared memory equalities) hold for what this Triton made of the kernels; another version may
# schedule them differently. The unpinned ones (wgmma and TMA present, no spills, shared memory
# fits) must hold on every Triton the package supports (3.6, 3.7, 3.8 checked).
KNOWN_TRITON = "3.6."


def _known_triton():
    import triton
    if not triton.__version__.startswith(KNOWN_TRITON):
        pytest.skip(f"compiler-output checks are pinned to Triton {KNOWN_TRITON}x; this is {triton.__version__}")


def _offline_tools(pinned=True):
    """(compile_kernel, sass_of) of tpfuse/gemm/offline.py; skips under the interpreter and,
    ``pinned``, on other Triton versions."""
    if os.environ.get("TRITON_INTERPRET") == "1":
        pytest.skip("compiling needs Triton's compiler, not the interpreter")
    if pinned:
        _known_triton()
    from tpfuse.gemm.offline import compile_kernel, sass_of
    return compile_kernel, sass_of


E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
_SK = gc.GemmConfig(BLOCK_M=128, BLOCK_N=128, BLOCK_K=64, num_warps=8, num_stages=4, stream_k=1)
_FP8 = gc.GemmConfig(BLOCK_M=128, BLOCK_N=256, BLOCK_K=128, num_warps=8, num_stages=3)
_FP8_SUB2 = gc.GemmConfig(BLOCK_M=128, BLOCK_N=128, BLOCK_K=128, num_warps=8, num_stages=6, EPI_SUBTILE=2)
# (kernel the plan would launch, shape, config, compile_kernel's keywords, wgmma of the PTX)
_VARIANTS = {
    "plain": ("gemm_kernel", (512, 3584, 4096), gc.GemmConfig(BLOCK_M=128, BLOCK_N=128, BLOCK_K=64, num_warps=8,
                                                             num_stages=6), {}, ".bf16.bf16"),
    "stream_k": ("gemm_sk_kernel", (1024, 1024, 4096), _SK, dict(sk_tiles=16), ".bf16.bf16"),
    "hooked": ("gemm_hooked_kernel", (4096, 4096, 1792), gc.GemmConfig(BLOCK_M=128, BLOCK_N=256, BLOCK_K=64,
                                                                      num_warps=8, num_stages=3, flatten=True),
               dict(epilogue=True, tile_order=2, epi_tma=9, epi_count=4), ".bf16.bf16"),
    "fp8_tensorwise": ("gemm_kernel", (4096, 3584, 4096), _FP8, dict(dtype=E4M3, scale_a=1, scale_b=1), ".e4m3.e4m3"),
    "fp8_rowwise": ("gemm_kernel", (4096, 3584, 4096), _FP8, dict(dtype=E4M3, scale_a=2, scale_b=2), ".e4m3.e4m3"),
    "fp8_rowwise_sub2": ("gemm_kernel", (512, 3584, 4096), _FP8_SUB2, dict(dtype=E4M3, scale_a=2, scale_b=2),
                         ".e4m3.e4m3"),
    "fp8_e5m2_grad": ("gemm_kernel", (4096, 3584, 4096), _FP8, dict(dtype=E5M2, b_dtype=E4M3, scale_a=1, scale_b=1),
                      ".e5m2.e4m3"),
    "fp8_stream_k_rowwise": ("gemm_sk_kernel", (1024, 1024, 4096), dataclasses.replace(_SK, BLOCK_K=128),
                             dict(sk_tiles=16, dtype=E4M3, scale_a=2, scale_b=2), ".e4m3.e4m3"),
    "fp8_hooked_rowwise": ("gemm_hooked_kernel", (4096, 3584, 4096), dataclasses.replace(_FP8, flatten=True),
                           dict(dtype=E4M3, scale_a=2, scale_b=2, epilogue=True, tile_order=2, epi_tma=9,
                                epi_count=4), ".e4m3.e4m3"),
}


@pytest.mark.skipif(not _ptxas(), reason="Triton without its bundled ptxas")
@pytest.mark.parametrize("variant", list(_VARIANTS))
def test_offline_sm90_compile_uses_wgmma_and_tma_without_spills(variant):
    # on every supported Triton: each variant (bf16 and fp8) compiles for sm_90 to wgmma fed by
    # TMA loads, spills nothing and fits sm_90's shared memory
    compile_kernel, sass_of = _offline_tools(pinned=False)
    kernel, (m, n, k), cfg, kw, mma = _VARIANTS[variant]
    kern = compile_kernel(m, n, k, cfg, **kw)
    assert kern.name == kernel
    sass, res = sass_of(kern.asm["cubin"])
    assert re.search(r"wgmma\.mma_async\.sync\.aligned\.m64n\d+k\d+\.f32" + re.escape(mma), kern.asm["ptx"])
    assert re.search(r"\b[HQ]GMMA\.", sass) and "UTMALDG" in sass   # wgmma (QGMMA: fp8) fed by TMA loads
    assert "LOCAL:0" in res and "STACK:0" in res      # no register spills
    assert kern.metadata.shared <= 232448             # fits sm_90's shared memory


@pytest.mark.skipif(not _ptxas(), reason="Triton without its bundled ptxas")
def test_offline_rowwise_scales_are_loaded_once_per_tile_before_the_subtiles():
    # issue 29 (row-wise fp8 ran ~15 % slower than tensor-wise in gemm_kernel on 8B fc2, train):
    # the tile is scaled whole before it is cut into EPI_SUBTILE column slices, so each column
    # scale is loaded once per tile, not per subtile in a replicated layout after the first
    # slice's store (pinned Triton, the tuned 8B fc2 config: 136 global loads and 231 registers
    # per thread before, 14 and 191 after)
    compile_kernel, sass_of = _offline_tools(pinned=True)
    cfg = gc.GemmConfig(BLOCK_M=128, BLOCK_N=256, BLOCK_K=128, num_warps=8, num_stages=4, EPI_SUBTILE=2, flatten=True)
    kern = compile_kernel(16384, 4096, 1792, cfg, dtype=E4M3, scale_a=2, scale_b=2)
    sass, res = sass_of(kern.asm["cubin"])
    regs = int(re.search(r"REG:(\d+)", res).group(1))
    assert len(re.findall(r"\bLDG\.", sass)) <= 16 and regs <= 200, res
    assert "LOCAL:0" in res and "STACK:0" in res


@pytest.mark.skipif(not _ptxas(), reason="Triton without its bundled ptxas")
def test_offline_epilogue_hook_through_tma_keeps_a_staging_buffer_of_its_own():
    # The hook's TMA stores sit at the top level of the tile loop, so Triton's TMA-store
    # pipelining gives them the plain kernel's own staging buffer (shared memory as without
    # the hook) instead of the pipeline's buffers, and no pointer stores are left.
    compile_kernel, sass_of = _offline_tools()
    cfg = gc.GemmConfig(BLOCK_M=128, BLOCK_N=256, BLOCK_K=64, num_warps=8, num_stages=3)
    plain = compile_kernel(4096, 4096, 1792, cfg)
    hooked = compile_kernel(4096, 4096, 1792, cfg, epilogue=True, tile_order=2, epi_tma=8)
    sass, res = sass_of(hooked.asm["cubin"])
    assert hooked.metadata.shared == plain.metadata.shared
    assert "UTMASTG" in sass and not re.search(r"\bSTG\.", sass)   # no pointer stores left
    assert "LOCAL:0" in res and "STACK:0" in res
    # stacked destinations (chunks of one tensor): one descriptor, so the plain kernel's one
    # store path instead of one per chunk
    stacked = compile_kernel(4096, 4096, 1792, cfg, epilogue=True, tile_order=2,
                             epi_tma=abi.EPI_TMA_STACKED)
    sass_st, res_st = sass_of(stacked.asm["cubin"])
    plain_sass, _ = sass_of(plain.asm["cubin"])
    assert stacked.metadata.shared == plain.metadata.shared
    assert sass_st.count("UTMASTG") == plain_sass.count("UTMASTG") > 0
    assert sass.count("UTMASTG") == 8 * plain_sass.count("UTMASTG")
    assert "LOCAL:0" in res_st and "STACK:0" in res_st


@pytest.mark.skipif(not _ptxas(), reason="Triton without its bundled ptxas")
def test_offline_epilogue_counts_tiles_at_gpu_scope_and_publishes_at_system_scope():
    # Per tile: a GPU-scope fence and count; the system-scope fence only where a chunk's
    # signal is published (the returning count, 1, and the counts that return nothing). The default
    # where it can (4; 3 counts after the next main loop instead of inside it) counts with a
    # RED, an atomic that returns nothing, so ptxas has no result register to wait for at the
    # tile loop's next iteration; the poller's handoff (HANDOFF = 1 << 24) is a RED too, so it
    # has no returning atomic at all.
    compile_kernel, sass_of = _offline_tools()
    cfg = gc.GemmConfig(BLOCK_M=128, BLOCK_N=256, BLOCK_K=64, num_warps=8, num_stages=3)
    for mode in (abi.EPI_COUNT_RETURNING, abi.EPI_COUNT_AFTER_LOOP, abi.EPI_COUNT_IN_LOOP):
        kern = compile_kernel(4096, 4096, 1792, cfg, epilogue=True, tile_order=2, epi_tma=8, epi_count=mode)
        sass, _ = sass_of(kern.asm["cubin"])
        atoms = re.findall(r"ATOMG\.E\.ADD\.STRONG\.(\w+)", sass)
        reds = re.findall(r"REDG\.E\.ADD\.STRONG\.(\w+)", sass)
        publishes = re.findall(r"ATOMG\.E\.EXCH\.STRONG\.SYS|STG\.E\.STRONG\.SYS", sass)
        assert publishes, sass[:2000]
        if mode >= 3:
            assert reds and set(reds) == {"GPU"} and not atoms, (reds, atoms)
            assert "0x1000000" in kern.asm["ptx"].replace("16777216", "0x1000000")
        else:
            assert atoms and not reds and set(atoms) == {"GPU"}, atoms


def _enclosing_loops(ttgir: str, op: str) -> int:
    """How many scf.for loops enclose the first ``op`` line of a TTGIR dump (by indentation)."""
    lines = ttgir.splitlines()
    at = next(i for i, line in enumerate(lines) if op in line)
    depth, indent = 0, len(lines[at]) - len(lines[at].lstrip())
    for line in reversed(lines[:at]):
        ind = len(line) - len(line.lstrip())
        if ind < indent and line.strip():
            indent = ind
            depth += "scf.for" in line
    return depth


@pytest.mark.skipif(not _ptxas(), reason="Triton without its bundled ptxas")
def test_offline_hooked_kernels_flatten_into_one_pipelined_loop():
    # flatten=True: Triton fuses the tile and K loops only when the tile loop holds exactly
    # one loop, and pipelines the fused loop only without a tl.debug_barrier in it. The
    # hooks and the round/owner orders must keep both (docs/gemm_core.md, "Kernels").
    compile_kernel, _ = _offline_tools()
    flat = gc.GemmConfig(BLOCK_M=128, BLOCK_N=256, BLOCK_K=64, num_warps=8, num_stages=3, flatten=True)
    plain = compile_kernel(4096, 4096, 1792, flat).asm["ttgir"]
    nested = compile_kernel(4096, 4096, 1792, gc.GemmConfig(BLOCK_M=128, BLOCK_N=256, BLOCK_K=64,
                                                            num_warps=8, num_stages=3)).asm["ttgir"]
    loads = plain.count("async_tma_copy_global_to_local")
    assert _enclosing_loops(plain, "warp_group_dot") == 1 and _enclosing_loops(nested, "warp_group_dot") == 2
    for name, kw in [("wait", dict(wait=True, tile_order=1)),
                     ("owner", dict(tile_order=2)),
                     ("epilogue, TMA stores, counts that return nothing", dict(epilogue=True, tile_order=2, epi_tma=8, epi_count=3)),
                     ("epilogue, stacked TMA stores, counts in the main loop",
                      dict(epilogue=True, tile_order=2, epi_tma=9, epi_count=4)),
                     ("epilogue, pointer stores, plain count", dict(epilogue=True, tile_order=2, epi_count=1))]:
        ttgir = compile_kernel(4096, 4096, 1792, flat, **kw).asm["ttgir"]
        assert _enclosing_loops(ttgir, "warp_group_dot") == 1, f"{name}: tile loop not flattened"
        assert ttgir.count("async_tma_copy_global_to_local") == loads, f"{name}: loads not pipelined"
    # the count inside the K-step body (EPI_COUNT=4) leaves the MMAs asynchronous: one wgmma
    # group in flight, not a wait after each (as ptxas does to a nested K loop with it)
    _, sass_of = _offline_tools()
    sass, _ = sass_of(compile_kernel(4096, 4096, 1792, flat, epilogue=True, tile_order=2, epi_tma=9,
                                     epi_count=4).asm["cubin"])
    assert "WARPGROUP.DEPBAR.LE gsb0, 0x1" in sass


def test_count_mode_follows_the_options():
    auto = gc.GemmOptions()
    assert launch.epi_count_mode(auto, True) == 4 and launch.epi_count_mode(auto, False) == 1
    assert launch.epi_count_mode(auto, True, in_loop=False) == 3   # nested K loops count after it
    for value, mode in (("auto", 4), ("after_loop", 3), ("returning", 1)):
        opts = gc.GemmOptions(epi_count=value)
        assert launch.epi_count_mode(opts, True) == mode
        assert launch.epi_count_mode(opts, False) == 1   # 3 and 4 only where eligible
    # the diagnostic modes are gone: a count that publishes nothing cannot be asked for
    for gone in ("none", "sys", "gpu", "epilogue"):
        with pytest.raises(ValueError, match=f"GemmOptions.epi_count='{gone}'"):
            gc.GemmOptions(epi_count=gone)
    with pytest.raises(TypeError, match="GemmOptions.gluon=1"):
        gc.GemmOptions(gluon=1)


def _offline_ws(pinned=True):
    if os.environ.get("TRITON_INTERPRET") == "1":
        pytest.skip("compiling needs Triton's compiler, not the interpreter")
    if pinned:
        _known_triton()
    from tpfuse.gemm.offline import compile_ws_kernel, sass_of
    return compile_ws_kernel, sass_of


@pytest.mark.skipif(not _ptxas(), reason="Triton without its bundled ptxas")
@pytest.mark.parametrize("epi_tma,stores", [(-1, 4), (8, 32), (9, 4)], ids=["plain", "8_descriptors", "stacked"])
def test_offline_ws_kernel_counts_and_publishes_on_its_store_warp(epi_tma, stores):
    # gemm_ws: three partitions (setmaxnreg moves registers between them), the MMA warps keep
    # one wgmma group in flight and hold no atomic or fence; the hook's wait for the TMA writes
    # (not only their reads), proxy fence, returning GPU-scope count and system-scope
    # publication sit in the store warp's code, once.
    compile_ws, sass_of = _offline_ws()
    kern = compile_ws(4096, 4096, 1792, epi_tma=epi_tma)
    sass, res = sass_of(kern.asm["cubin"])
    ptx = kern.asm["ptx"]
    assert "LOCAL:0" in res and "STACK:0" in res and kern.metadata.shared <= 232448
    assert "setmaxnreg.dec" in ptx and "setmaxnreg.inc" in ptx
    assert "wgmma.wait_group.sync.aligned 1;" in ptx and sass.count("UTMASTG") == stores
    hook = ("atom.add.acq_rel.gpu", "fence.acq_rel.sys", "cp.async.bulk.wait_group 0;", "fence.proxy.async.global",
            "st.relaxed.sys.global")
    for piece in hook:
        assert ptx.count(piece) == (1 if epi_tma >= 0 else 0), piece


@pytest.mark.skipif(not _ptxas(), reason="Triton without its bundled ptxas")
def test_offline_ws_kernel_waits_in_its_poll_warp():
    # the wait hook: one bounded spin (acquire at system scope, %globaltimer only once a flag was
    # not ready, the error word) and the first timeout's claim of the error word in the poll
    # warp, handed on to the load warp through an mbarrier; the proxy fence in the load warp
    # before its TMA loads; no count, no publication
    compile_ws, sass_of = _offline_ws()
    kern = compile_ws(4096, 4096, 1792, wait=True, tile_order=1)
    sass, res = sass_of(kern.asm["cubin"])
    ptx = kern.asm["ptx"]
    assert "LOCAL:0" in res and "STACK:0" in res and kern.metadata.shared <= 232448
    for piece, count in (("ld.global.acquire.sys.b32", 1), ("mov.u64 t0, %globaltimer", 1),
                         ("fence.proxy.async.global", 1), ("atom.add.acq_rel.gpu", 0), ("fence.acq_rel.sys", 0)):
        assert ptx.count(piece) == count, piece
    (poll,) = _partitions_with(ptx, "ld.global.acquire.sys.b32")
    assert re.search(r"atom\.[a-z_.]*cas", poll) and "mbarrier.arrive" in poll
    assert _TMA_LOAD_PTX not in poll and "wgmma" not in poll
    assert poll.index("ld.global.acquire.sys.b32") < poll.index("mov.u64 t0, %globaltimer")
    (load,) = _partitions_with(ptx, "fence.proxy.async.global")
    assert _TMA_LOAD_PTX in load and "mbarrier.try_wait" in load
    assert load.index("fence.proxy.async.global") < load.rindex(_TMA_LOAD_PTX)


@pytest.mark.skipif(not _ptxas(), reason="Triton without its bundled ptxas")
def test_offline_ws_kernel_takes_row_major_b_and_narrow_tiles():
    compile_ws, sass_of = _offline_ws(pinned=False)
    for kw in (dict(b_kmajor=False), dict(block=(128, 128, 64), stages=5)):
        kern = compile_ws(1000, 512, 256, epi_tma=9, tile_order=1, **kw)
        sass, res = sass_of(kern.asm["cubin"])
        assert "HGMMA" in sass and "LOCAL:0" in res and kern.metadata.shared <= 232448, kw


# fp8 variants of the Gluon kernel, compiled with the (block, stages) ws_choice takes for them:
# (ws_choice's keywords, the config asked for, compile_ws_kernel's keywords, wgmma of the PTX)
_WS_FP8 = {
    "e4m3_bf16_tensorwise_stacked": (dict(out_dtype=torch.bfloat16, scale_a=1, scale_b=1), 256,
                                     dict(epi_tma=9), ".e4m3.e4m3"),
    "e4m3_bf16_rowwise_8_descriptors": (dict(out_dtype=torch.bfloat16, scale_a=2, scale_b=2), 256,
                                        dict(epi_tma=8), ".e4m3.e4m3"),
    "e4m3_fp32_rowwise_stacked": (dict(out_dtype=torch.float32, scale_a=2, scale_b=2), 256,
                                  dict(epi_tma=9), ".e4m3.e4m3"),
    "e4m3_fp32_tensorwise_8_descriptors": (dict(out_dtype=torch.float32, scale_a=1, scale_b=1), 128,
                                           dict(epi_tma=8), ".e4m3.e4m3"),
    "e4m3_bf16_rowwise_wait": (dict(out_dtype=torch.bfloat16, scale_a=2, scale_b=2), 256,
                               dict(wait=True, tile_order=1), ".e4m3.e4m3"),
    "e5m2_e4m3_fp16_tensorwise_stacked": (dict(b_dtype=E4M3, out_dtype=torch.float16, scale_a=1, scale_b=1), 256,
                                          dict(epi_tma=9), ".e5m2.e4m3"),
    # no hook: a plain call whose config asks for the Gluon kernel (GemmConfig.gluon)
    "e4m3_bf16_rowwise_plain": (dict(out_dtype=torch.bfloat16, scale_a=2, scale_b=2), 256,
                                dict(epi_tma=-1), ".e4m3.e4m3"),
    "e4m3_bf16_tensorwise_plain_128": (dict(out_dtype=torch.bfloat16, scale_a=1, scale_b=1), 128,
                                       dict(epi_tma=-1), ".e4m3.e4m3"),
    "e4m3_fp32_rowwise_plain": (dict(out_dtype=torch.float32, scale_a=2, scale_b=2), 256,
                                dict(epi_tma=-1), ".e4m3.e4m3"),
}


@pytest.mark.skipif(not _ptxas(), reason="Triton without its bundled ptxas")
@pytest.mark.parametrize("variant", list(_WS_FP8))
def test_offline_ws_kernel_fp8_with_scales(variant):
    # on every supported Triton: the Gluon kernel with fp8 inputs at the (block, stages) ws_choice
    # takes (K-steps of 128; float32 out: 128-wide tiles) compiles to fp8 wgmma (QGMMA) fed by TMA
    # loads, spills nothing and fits sm_90's shared memory beside its staging buffer; the hook's
    # count and publication (or the wait) as for bf16. The scales: one multiply per accumulator
    # element and operand (a tensor-wise pair: their product once, then one per element).
    # Without a hook (a gluon=True config's plain call): no count, no publication, no wait.
    compile_ws, sass_of = _offline_ws(pinned=False)
    ws_kw, bn, kw, mma = _WS_FP8[variant]
    dtype = E5M2 if ws_kw.get("b_dtype") == E4M3 else E4M3
    wait = kw.get("wait", False)
    plain = kw.get("epi_tma") == -1
    cfg = gc.GemmConfig(BLOCK_M=128, BLOCK_N=bn, BLOCK_K=128, num_warps=8, num_stages=3, gluon=plain)
    epi = object() if not (wait or plain) else None
    (block, stages), _ = launch.ws_choice((9, 0), dtype, cfg, epi, object() if wait else None,
                                          kw["epi_tma"] if epi else 0, True, out_tma=True, **ws_kw)
    assert block[2] == 128 and (block[1] == 128) == (ws_kw["out_dtype"] == torch.float32 or bn == 128), block
    m, n, k = 4096, 3584, 4096
    kern = compile_ws(m, n, k, block=block, stages=stages, dtype=dtype, b_dtype=ws_kw.get("b_dtype"),
                      out_dtype=ws_kw["out_dtype"], scale_a=ws_kw["scale_a"], scale_b=ws_kw["scale_b"], **kw)
    sass, res = sass_of(kern.asm["cubin"])
    ptx = kern.asm["ptx"]
    assert "LOCAL:0" in res and "STACK:0" in res and kern.metadata.shared <= 232448, (res, kern.metadata.shared)
    wgmma = re.findall(r"wgmma\.mma_async\.sync\.aligned\.m64n(\d+)k32\.f32" + re.escape(mma), ptx)
    assert wgmma and set(wgmma) == {str(block[1])} and "QGMMA" in sass and "UTMALDG" in sass
    assert "setmaxnreg.dec" in ptx and "setmaxnreg.inc" in ptx
    for piece in ("atom.add.acq_rel.gpu", "fence.acq_rel.sys"):
        assert ptx.count(piece) == (0 if wait or plain else 1), piece
    assert ptx.count("ld.global.acquire.sys.b32") == (1 if wait else 0)
    assert "UTMASTG" in sass and ("fence.proxy.async.global" in ptx) == (not plain)
    import triton
    if triton.__version__.startswith(KNOWN_TRITON):   # pinned: what this Triton made of the scaling
        per_thread = block[0] * block[1] // (abi.WS_NUM_WARPS * 32)   # accumulator elements per MMA thread
        muls = len(re.findall(r"\bmul\.(?:rn\.)?f32", ptx))
        assert muls == (2 * per_thread if ws_kw["scale_a"] == 2 else per_thread + 1), muls
        # global loads besides TMA: the two scales (tensor-wise values or one word per thread of
        # each row-wise vector, moved into the accumulator's layout through shared memory), the
        # hook's signal or the wait's two words.  Row-wise vectors loaded in the accumulator's
        # layout took a load per column a thread holds (67 loads here, 69 with the wait; issue 29)
        loads = len(re.findall(r"\bLDG\.", sass))
        assert loads == (5 if wait else 2 if plain else 3), loads


def test_ws_choice():
    # the Gluon kernel takes one hook on sm_90 -- the epilogue hook where it stores by TMA, or the
    # wait hook into a TMA-stored output -- for 128-row tiles 128 or 256 wide in
    # bf16/fp16; GemmOptions(gluon=False) turns it off. Every "no" says why.
    sm90 = (9, 0)
    big = gc.GemmConfig(BLOCK_M=128, BLOCK_N=256, BLOCK_K=64, num_warps=8, num_stages=3)
    epi, wait = object(), object()

    def choice(*args, **kw):
        return launch.ws_choice(sm90, *args, **kw)[0]
    assert choice(torch.bfloat16, big, epi, None, 8, True) == ((128, 256, 64), 3)
    narrow = dataclasses.replace(big, BLOCK_N=128, BLOCK_K=128)
    assert choice(torch.float16, narrow, epi, None, 9, True) == ((128, 128, 64), 5)
    # the wait hook alone, into a TMA-stored output: its poll warp waits
    assert choice(torch.bfloat16, big, None, wait, 0, True, out_tma=True) == ((128, 256, 64), 3)
    assert choice(torch.bfloat16, big, None, wait, 0, True, out_tma=False) == ()
    assert choice(torch.bfloat16, big, epi, wait, 8, True, out_tma=True) == ()   # both hooks
    for args, why in (((torch.bfloat16, big, None, None, 8, True), "no hook"),
                      ((torch.bfloat16, big, epi, wait, 8, True), "both hooks"),
                      ((torch.bfloat16, big, epi, None, 0, True), "pointer stores"),
                      ((torch.bfloat16, big, epi, None, 8, False), "no inline PTX"),
                      ((torch.float32, big, epi, None, 8, True), "outside the Gluon kernel"),
                      ((torch.bfloat16, dataclasses.replace(big, BLOCK_M=64), epi, None, 8, True), "outside")):
        got, reason = launch.ws_choice(sm90, *args)
        assert got == () and why in reason, (args, reason)
    # no stream-K in the Gluon kernel: narrower tiles where they fill the waves much better
    assert choice(torch.bfloat16, big, epi, None, 8, True, 4096, 3584, 132) == ((128, 128, 64), 5)
    assert choice(torch.bfloat16, big, epi, None, 8, True, 4096, 4096, 132) == ((128, 256, 64), 3)
    off = gc.GemmOptions(gluon=False)
    got, reason = launch.ws_choice(sm90, torch.bfloat16, big, epi, None, 8, True, options=off)
    assert got == () and "gluon=False" in reason
    got, reason = launch.ws_choice((10, 0), torch.bfloat16, big, epi, None, 8, True)   # wgmma is sm_90's
    assert got == () and "sm_90" in reason


def test_ws_choice_fp8():
    # fp8 (e4m3, and the e4m3/e5m2 mixes) with any scale modes into bf16/fp16/float32: the Gluon
    # kernel with K-steps of 128; float32 out takes 128-wide tiles (its staging buffer is twice
    # a 16-bit one's); b must be K-major; 16-bit inputs with scales or another output stay out
    sm90 = (9, 0)
    big = gc.GemmConfig(BLOCK_M=128, BLOCK_N=256, BLOCK_K=128, num_warps=8, num_stages=3)
    narrow = dataclasses.replace(big, BLOCK_N=128, num_stages=6)
    epi, wait = object(), object()

    def choice(dtype, cfg, *args, **kw):
        return launch.ws_choice(sm90, dtype, cfg, *args, **kw)
    for sa, sb in ((0, 0), (1, 1), (2, 2), (1, 2), (2, 0)):
        for out, want in ((torch.bfloat16, ((128, 256, 128), 3)), (torch.float16, ((128, 256, 128), 3)),
                          (torch.float32, ((128, 128, 128), 5))):
            got, why = choice(E4M3, big, epi, None, 8, True, out_dtype=out, scale_a=sa, scale_b=sb)
            assert got == want and "Gluon" in why, (sa, sb, out, why)
        got, why = choice(E4M3, big, None, wait, 0, True, out_tma=True, out_dtype=torch.bfloat16, scale_a=sa,
                          scale_b=sb)
        assert got == ((128, 256, 128), 3) and "poll warp waits" in why
    got, why = choice(E4M3, big, epi, None, 9, True, out_dtype=torch.float32, scale_a=2, scale_b=2)
    assert "128-wide" in why and "float32" in why
    assert choice(E4M3, narrow, epi, None, 8, True, out_dtype=torch.bfloat16)[0] == ((128, 128, 128), 5)
    for a_dt, b_dt in ((E4M3, E5M2), (E5M2, E4M3)):
        assert choice(a_dt, big, epi, None, 9, True, b_dtype=b_dt, out_dtype=torch.float16, scale_a=1,
                      scale_b=1)[0] == ((128, 256, 128), 3)
    # wave fill as for bf16: 8B fc1 prefill (4096 x 3584) on 132 SMs takes 128-wide tiles
    assert choice(E4M3, big, epi, None, 8, True, 4096, 3584, 132, out_dtype=torch.bfloat16, scale_a=2,
                  scale_b=2)[0] == ((128, 128, 128), 5)
    for kw, why in ((dict(b_dtype=E5M2, out_dtype=torch.bfloat16, a_dtype=E5M2), "outside"),
                    (dict(out_dtype=torch.bfloat16, b_kmajor=False), "K-major"),
                    (dict(out_dtype=E4M3), "outside"),
                    (dict(a_dtype=torch.bfloat16, out_dtype=torch.bfloat16, scale_a=1), "with scales"),
                    (dict(a_dtype=torch.bfloat16, out_dtype=torch.float32), "another output dtype"),
                    (dict(a_dtype=torch.float16, b_dtype=torch.float16, out_dtype=torch.float16, scale_b=2),
                     "with scales")):
        got, reason = choice(kw.pop("a_dtype", E4M3), big, epi, None, 8, True, **kw)
        assert got == () and why in reason and "gemm_kernel" in reason, (kw, reason)
    got, reason = choice(E4M3, dataclasses.replace(big, BLOCK_M=64), epi, None, 8, True, out_dtype=torch.bfloat16)
    assert got == () and "128x128 or 128x256" in reason
    # bf16 unscaled as before (its own out dtype given or not)
    assert choice(torch.bfloat16, dataclasses.replace(big, BLOCK_K=64), epi, None, 8, True,
                  out_dtype=torch.bfloat16)[0] == ((128, 256, 64), 3)


# ---- GemmConfig.gluon: plain fp8 calls in the Gluon kernel, where the tuner finds it faster ----
_GLUON_256 = gc.GemmConfig(BLOCK_M=128, BLOCK_N=256, BLOCK_K=128, num_warps=8, num_stages=3, gluon=True)
_GLUON_128 = gc.GemmConfig(BLOCK_M=128, BLOCK_N=128, BLOCK_K=128, num_warps=8, num_stages=5, gluon=True)


def test_gluon_config_round_trip_and_validation():
    for cfg in (_GLUON_256, dataclasses.replace(_GLUON_128, GROUP_M=4, num_programs=66)):
        d = cfg.to_dict()
        assert d["gluon"] is True and gc.GemmConfig.from_dict(json.loads(json.dumps(d))) == cfg
    old = {key: v for key, v in _GLUON_256.to_dict().items() if key != "gluon"}   # a cache entry from before
    assert gc.GemmConfig.from_dict(old) == dataclasses.replace(_GLUON_256, gluon=False)
    assert parse_spec("128x256x128:gluon=true") == _GLUON_256
    # what the Gluon kernel cannot run is refused when the config is made, naming the fix
    for kw, match in ((dict(BLOCK_M=64), "64x256x128 tile"), (dict(BLOCK_N=64), "128x64x128 tile"),
                      (dict(BLOCK_K=64), "128x256x64 tile"), (dict(stream_k=1), "stream_k=1:.*pass stream_k=0"),
                      (dict(EPI_SUBTILE=2), "EPI_SUBTILE=2"), (dict(flatten=True), "flatten=True"),
                      (dict(tma_store=False), "tma_store=False:.*or gluon=False")):
        with pytest.raises(ValueError, match=f"GemmConfig\\(gluon=True\\) with (a )?{match}"):
            dataclasses.replace(_GLUON_256, **kw)
        dataclasses.replace(_GLUON_256, gluon=False, **kw)   # without the flag: a config as before
    with pytest.raises(TypeError, match="GemmConfig.gluon=1"):
        dataclasses.replace(_GLUON_256, gluon=1)


def test_ws_choice_plain_fp8_call_with_a_gluon_config():
    # no hook: the Gluon kernel only where the config asks for it, for fp8 into a TMA-stored
    # output on sm_90, at the config's own tile width (no wave-fill narrowing: the tuner chose
    # it) and the stages that fit; everything else is gemm_kernel with a reason
    sm90 = (9, 0)

    def choice(cfg, dtype=E4M3, capability=sm90, out_tma=True, **kw):
        kw = dict(dict(out_dtype=torch.bfloat16, scale_a=2, scale_b=2), **kw)
        return launch.ws_choice(capability, dtype, cfg, None, None, 0, True, 4096, 3584, 132, out_tma=out_tma, **kw)
    got, why = choice(_GLUON_256)
    assert got == ((128, 256, 128), 3) and "gluon=True" in why and "Gluon kernel" in why, why
    assert choice(_GLUON_128)[0] == ((128, 128, 128), 5)
    for sa, sb in ((0, 0), (1, 1), (1, 2)):
        assert choice(_GLUON_256, scale_a=sa, scale_b=sb)[0] == ((128, 256, 128), 3)
    assert choice(_GLUON_256, dtype=E5M2, b_dtype=E4M3)[0] == ((128, 256, 128), 3)
    got, why = choice(_GLUON_256, out_dtype=torch.float32)
    assert got == ((128, 128, 128), 5) and "128-wide" in why
    # the same config with a hook takes ws_choice's own rule (here: 128-wide tiles fill 4096 x
    # 3584 on 132 SMs better), as does the config without the flag
    for cfg in (_GLUON_256, dataclasses.replace(_GLUON_256, gluon=False)):
        assert launch.ws_choice(sm90, E4M3, cfg, object(), None, 8, True, 4096, 3584, 132,
                                out_dtype=torch.bfloat16)[0] == ((128, 128, 128), 5)
    for cfg, kw, reason in ((dataclasses.replace(_GLUON_256, gluon=False), {}, "no hook"),
                            (_GLUON_256, dict(capability=(10, 0)), "sm_90"),
                            (_GLUON_256, dict(capability=(8, 0)), "sm_90"),
                            (_GLUON_256, dict(dtype=torch.bfloat16, b_dtype=torch.bfloat16, scale_a=0, scale_b=0,
                                              out_dtype=torch.bfloat16), "fp8's"),
                            (_GLUON_256, dict(b_kmajor=False), "K-major"),
                            (_GLUON_256, dict(out_tma=False), "not stored by TMA"),
                            (_GLUON_256, dict(options=gc.GemmOptions(gluon=False)), "gluon=False")):
        got, why = choice(cfg, **kw)
        assert got == () and reason in why and "gemm_kernel" in why, (kw, why)
    got, why = launch.ws_choice(sm90, E4M3, _GLUON_256, None, None, 0, False, out_tma=True, out_dtype=torch.bfloat16)
    assert got == () and "no inline PTX" in why


def _launch_faked(monkeypatch, plan, **hook):
    """One row-wise fp8 ``matmul`` on CPU tensors whose plan is ``plan`` (its m, n, k), plain or
    with ``hook`` (matmul's ``wait=`` or ``epilogue=``, and their keywords), the Gluon launch
    faked (no GPU): returns the one launch's ``(spec, grid, arguments)`` (descriptors as
    ``("desc", address, shape, block)``) and the call's ``a, b, out, scale_a, scale_b`` (with
    the epilogue hook ``out`` is not passed: the tiles go to its destinations)."""
    m, n, k = plan.m, plan.n, plan.k
    launched = []
    monkeypatch.setattr(launch, "_make_plan", lambda *args, **kw: plan)
    monkeypatch.setattr(launch, "_PLANS", {})
    monkeypatch.setattr(launch, "_COMPILED", {})
    monkeypatch.setattr(launch, "_gluon_descriptor", lambda t, shape, strides, block: (
        "desc", t.data_ptr(), tuple(shape), tuple(block)))
    monkeypatch.setattr(launch, "_launch_cached", lambda spec, grid, full, device, jit, direct: launched.append(
        (spec, grid, full)))
    g = torch.Generator().manual_seed(0)
    a = torch.randn(m, k, generator=g).to(E4M3)
    b = torch.randn(n, k, generator=g).to(E4M3).t()
    out = torch.empty(m, n, dtype=torch.bfloat16)
    sa, sb = torch.rand(m, 1, generator=g), torch.rand(1, n, generator=g)
    epilogue = "epilogue" in hook
    got = gc.matmul(a, b, out=None if epilogue else out, scale_a=sa, scale_b=sb, **hook)
    assert got is (None if epilogue else out) and gc.last_plan() is plan
    (one,) = launched
    return one, a, b, out, sa, sb


def test_a_plain_gluon_plan_launches_gemm_ws_without_hooks(monkeypatch):
    # matmul's launch of a hook-free gemm_ws plan (faked: no GPU): the Gluon kernel's arguments
    # with EPILOGUE and WAIT off and no hook buffers, a's, b's and out's descriptors at the
    # plan's block, the scales, the config's GROUP_M and the plan's stages and grid
    m, n, k = 256, 512, 256
    plan = launch.LaunchPlan(m=m, n=n, k=k, config=dataclasses.replace(_GLUON_256, GROUP_M=4), kernel="gemm_ws_kernel",
                             b_kmajor=True, use_tma=True, grid=(4, 1, 1), ws_block=(128, 256, 128), ws_stages=3,
                             out_dtype=torch.bfloat16, scale_a=2, scale_b=2, num_tiles=4)
    (spec, grid, full), a, b, out, sa, sb = _launch_faked(monkeypatch, plan)
    from tpfuse.kernels.gemm_ws import gemm_ws_kernel
    args = dict(zip(gemm_ws_kernel.arg_names, full, strict=True))
    assert grid == (4, 1, 1) and spec[0] == "gemm_ws_kernel"
    assert args["a_desc"] == ("desc", a.data_ptr(), (m, k), (128, 128))
    assert args["b_desc"] == ("desc", b.data_ptr(), (n, k), (256, 128))
    assert args["c_desc"] == ("desc", out.data_ptr(), (m, n), (128, 256))
    assert args["EPILOGUE"] == 0 and args["WAIT"] is False and args["EPI_TMA"] == 0
    assert all(args[name] is None for name in ("wait_signal", "err_ptr", "counters", "signal_ptrs", "tile_records"))
    assert all(args[f"epi_d{q}"] is None for q in range(8))
    assert args["scale_a"] is sa and args["scale_b"] is sb and (args["SCALE_A"], args["SCALE_B"]) == (2, 2)
    assert (args["BLOCK_M"], args["BLOCK_N"], args["BLOCK_K"], args["GROUP_M"], args["STAGES"]) == (128, 256, 128, 4, 3)


def test_fp8_candidates_offer_the_gluon_kernel_on_sm90_only():
    # fp8 on sm_90: one gluon=True config per (BLOCK_N, GROUP_M) of the 128x128x128 and
    # 128x256x128 candidates, at the Gluon kernel's stages; none for bf16 or another GPU, and
    # the rest of the space unchanged; the space grows by far less than 1.3x
    from tpfuse.gemm.config import _SM90_SMEM_BYTES, GLUON_STAGES
    for m, n, k in ((16384, 4096, 1792), (4096, 3584, 4096), (512, 3584, 4096), (128, 8192, 3584)):
        cands = gc.candidate_configs(m, n, k, E4M3)
        ours = [c for c in cands if c.gluon and not c.pingpong]   # gemm_pp's: test_pingpong_candidates
        rest = [c for c in cands if not c.gluon]
        pairs = {(c.BLOCK_N, c.GROUP_M) for c in rest if c.BLOCK_M == 128 and c.BLOCK_N in (128, 256)
                 and c.BLOCK_K == 128 and not c.stream_k}
        assert len(pairs) >= 2 and sorted((c.BLOCK_N, c.GROUP_M) for c in ours) == sorted(pairs), (m, n, k)
        assert {(128, 8), (256, 8)} <= pairs
        for c in ours:
            assert (c.BLOCK_M, c.BLOCK_K, c.num_stages) == (128, 128, GLUON_STAGES[c.BLOCK_N])
            assert c.smem_bytes(1, 2) <= _SM90_SMEM_BYTES
        assert len(cands) <= 1.3 * len(rest) and len(set(cands)) == len(cands)
        for capability in ((10, 0), (8, 9)):
            assert gc.candidate_configs(m, n, k, E4M3, capability=capability) == rest, capability
        assert not any(c.gluon for c in gc.candidate_configs(m, n, k, torch.bfloat16))
    assert GLUON_STAGES == {256: 3, 128: 5}   # ws_choice's rule (the stages that fit sm_90's 227 KiB)


def test_rerank_leaders_by_the_median_of_interleaved_timings():
    # one lucky first timing does not make a winner: the leaders are timed again, in rounds that
    # each start one further along, and ranked by the median of all their timings
    more = {"A": iter([12, 12, 12, 12]), "B": iter([9, 9, 9, 9]), "C": iter([11, 11, 11, 11])}
    calls = []

    def timed(cfg):
        calls.append(cfg)
        return next(more[cfg])
    out = gc.rerank_leaders([("C", 11.5), ("A", 5.0), ("D", 20.0), ("B", 10.0)], timed, finalists=3, rounds=4)
    assert [c for c, _, _ in out] == ["B", "C", "A", "D"]
    assert out[0] == ("B", 9, [10.0, 9, 9, 9, 9]) and out[-1] == ("D", 20.0, [20.0])
    assert calls[:3] == ["A", "B", "C"] and calls[3:6] == ["B", "C", "A"] and len(calls) == 12

    def gone(cfg):
        raise RuntimeError("gone")
    # a leader whose re-timing fails is dropped, with a warning; a lone candidate is not re-timed
    with pytest.warns(UserWarning, match="dropping tuning finalist Z"):
        assert gc.rerank_leaders([("Z", 1.0), ("Y", 2.0)], gone, finalists=1, rounds=1) == [("Y", 2.0, [2.0])]
    assert gc.rerank_leaders([("Z", 1.0)], gone) == [("Z", 1.0, [1.0])]


def test_hook_winners_keep_the_fastest_leader_per_hook():
    # per hook, the leader fastest with it (the median of its re-timings), whatever the plain
    # ranking; a leader that raises with one hook is left out of that hook only, with a warning
    plain = gc.GemmConfig(BLOCK_M=128, BLOCK_N=256, BLOCK_K=128, num_warps=8, num_stages=4)
    pp = gc.GemmConfig(BLOCK_M=128, BLOCK_N=128, BLOCK_K=128, num_warps=8, num_stages=5, gluon=True, pingpong=True)
    other = dataclasses.replace(plain, num_stages=3)
    base = {plain: 49.0, pp: 49.6, other: 50.0}
    cost = {("wait", plain): 1.3, ("wait", pp): 2.3, ("wait", other): 1.2,
            ("epilogue", plain): 2.7, ("epilogue", pp): 0.5}
    calls = []

    def time_hooked(hook, cfg):
        calls.append((hook, cfg))
        if (hook, cfg) not in cost:
            raise RuntimeError("out of shared memory")
        return base[cfg] + cost[hook, cfg]
    with pytest.warns(UserWarning, match="no epilogue-hook timing of"):
        won = gc.hook_winners([plain, pp, other], ("wait", "epilogue"), time_hooked)
    assert won == {"wait": (plain, 50.3), "epilogue": (pp, 50.1)}
    # each leader timed once, then re-timed in 4 rounds; the one that raised is not re-timed
    assert calls.count(("wait", pp)) == 5 and calls.count(("epilogue", other)) == 1
    assert gc.hook_winners([plain], ("wait",), lambda h, c: 1.0) == {"wait": (plain, 1.0)}
    assert gc.hook_winners([plain], (), time_hooked) == {}


def test_tune_refuses_unknown_hooks_and_chunk_counts():
    # before anything is timed; the strategies' hooks are "wait" and "epilogue"
    a = torch.zeros(32, 32, dtype=torch.bfloat16)
    for kw, match in ((dict(hooks=("wait", "reduce")), "hooks="), (dict(chunks=0), "chunks=0"),
                      (dict(chunks=True), "chunks=True"), (dict(chunks=2.0), "chunks=2.0")):
        with pytest.raises(ValueError, match=match):
            gc.tune(a, a, configs=[], save=False, **kw)
    assert gc.HOOK_CHUNKS == 8 and gc.tune.__kwdefaults__["hooks"] == ("wait", "epilogue")


def test_a_failed_direct_launch_warns_and_is_counted_as_jit(monkeypatch):
    # The library's fallback (a change of Triton's launcher) must show: a warning, the JIT path
    # from then on, and launch_counts() that a GPU test asserting direct launches would fail on.
    class Broken:   # a kept launcher (tpfuse._direct.Direct) that Triton's internals no longer fit
        def __call__(self, grid, stream, args):
            raise RuntimeError("launcher changed (test)")
    monkeypatch.setattr(launch, "_DIRECT_BROKEN", [False])
    monkeypatch.setattr(torch._C, "_cuda_getCurrentRawStream", lambda index: 0, raising=False)   # CPU builds lack it
    monkeypatch.setitem(launch._COMPILED, "spec-under-test", Broken())
    compiled = object()
    before = gc.launch_counts()
    with pytest.warns(UserWarning, match="direct kernel launch failed .*launcher changed"):
        launch._launch_cached("spec-under-test", (1, 1, 1), [], torch.device("cpu"), lambda: compiled, True)
    after = gc.launch_counts()
    assert after.get("jit", 0) == before.get("jit", 0) + 1 and after.get("direct", 0) == before.get("direct", 0)
    assert launch._DIRECT_BROKEN[0] and "spec-under-test" not in launch._COMPILED
    # from now on every launch takes the JIT, even where direct launches are asked for
    launch._launch_cached("spec-under-test", (1, 1, 1), [], torch.device("cpu"), lambda: compiled, True)
    assert gc.launch_counts()["jit"] == before.get("jit", 0) + 2 and "spec-under-test" not in launch._COMPILED


# ---- GemmConfig.pingpong: plain fp8 calls in the ping-pong kernel (gemm_pp) ----
_PP = dataclasses.replace(_GLUON_128, pingpong=True)


def test_pingpong_config_round_trip_and_validation():
    for cfg in (_PP, dataclasses.replace(_PP, GROUP_M=4, num_programs=66)):
        d = cfg.to_dict()
        assert d["pingpong"] is True and gc.GemmConfig.from_dict(json.loads(json.dumps(d))) == cfg
    old = {key: v for key, v in _PP.to_dict().items() if key != "pingpong"}   # a cache entry from before
    assert gc.GemmConfig.from_dict(old) == _GLUON_128 and not gc.GemmConfig.from_dict(old).pingpong
    assert parse_spec("128x128x128:num_stages=5,gluon=true,pingpong=true") == _PP
    # only with the Gluon kernel's 128x128x128 tile; the message names the fix
    for kw in (dict(gluon=False), dict(BLOCK_N=256), dict(BLOCK_N=256, num_stages=3)):
        with pytest.raises(ValueError, match=r"GemmConfig\(pingpong=True\).*128x128x128.*or pingpong=False"):
            dataclasses.replace(_PP, **kw)
    with pytest.raises(ValueError, match="pingpong=True"):
        gc.GemmConfig(BLOCK_M=128, BLOCK_N=128, BLOCK_K=64, pingpong=True)
    with pytest.raises(TypeError, match="GemmConfig.pingpong=1"):
        dataclasses.replace(_PP, pingpong=1)
    # its shared memory: two staging buffers, one per consumer (5 stages fit beside bf16's)
    assert _PP.smem_bytes(1, 2) == 5 * 32768 + 2 * 32768 == _GLUON_128.smem_bytes(1, 2) + 32768


def test_pp_choice_plain_fp8_call_with_a_pingpong_config():
    # gemm_pp where ws_choice takes the Gluon kernel for a plain call and the config asks for the
    # ping-pong variant, at the stages that fit beside its two staging buffers; wherever
    # ws_choice says gemm_kernel, gemm_kernel (its reason stands). Hooked calls:
    # test_pp_choice_one_hook_with_a_pingpong_config
    sm90 = (9, 0)

    def choice(cfg, dtype=E4M3, capability=sm90, out_tma=True, **kw):
        kw = dict(dict(out_dtype=torch.bfloat16, scale_a=2, scale_b=2), **kw)
        ws, why_ws = launch.ws_choice(capability, dtype, cfg, None, None, 0, True, 4096, 3584, 132, out_tma=out_tma,
                                      **kw)
        return launch.pp_choice(ws, cfg, "", kw["out_dtype"]), why_ws
    (kernel, ws, why), _ = choice(_PP)
    assert kernel == "gemm_pp_kernel" and ws == ((128, 128, 128), 5) and "gemm_pp" in why and "5 stages" in why
    for sa, sb in ((0, 0), (1, 1), (1, 2)):
        assert choice(_PP, scale_a=sa, scale_b=sb)[0][:2] == ("gemm_pp_kernel", ((128, 128, 128), 5))
    assert choice(_PP, dtype=E5M2, b_dtype=E4M3)[0][:2] == ("gemm_pp_kernel", ((128, 128, 128), 5))
    assert choice(_PP, out_dtype=torch.float16)[0][:2] == ("gemm_pp_kernel", ((128, 128, 128), 5))
    assert choice(_PP, out_dtype=torch.float32)[0][:2] == ("gemm_pp_kernel", ((128, 128, 128), 3))
    (kernel, ws, why), _ = choice(_GLUON_128)   # no pingpong: gemm_ws, nothing more said
    assert (kernel, ws, why) == ("gemm_ws_kernel", ((128, 128, 128), 5), "")
    for kw, reason in ((dict(capability=(10, 0)), "sm_90"), (dict(capability=(8, 0)), "sm_90"),
                       (dict(dtype=torch.bfloat16, b_dtype=torch.bfloat16, scale_a=0, scale_b=0,
                             out_dtype=torch.bfloat16), "fp8's"),
                       (dict(b_kmajor=False), "K-major"), (dict(out_tma=False), "not stored by TMA"),
                       (dict(options=gc.GemmOptions(gluon=False)), "gluon=False")):
        (kernel, ws, why), why_ws = choice(_PP, **kw)
        assert (kernel, ws, why) == ("gemm_kernel", (), "") and reason in why_ws and "gemm_kernel" in why_ws, kw


def test_pp_choice_one_hook_with_a_pingpong_config():
    # a pingpong config's call with one hook: gemm_pp wherever ws_choice takes the Gluon kernel
    # for it (the epilogue hook through TMA descriptors, per chunk or stacked; the wait hook into
    # a TMA-stored output), at gemm_pp's stages, saying which warp runs the hook; wherever
    # ws_choice says gemm_kernel (pointer stores, an output not stored by TMA, both hooks, ...)
    # gemm_kernel; a bf16 call (ws_choice's 128x128x64) gemm_ws
    sm90 = (9, 0)

    def choice(cfg, hook, dtype=E4M3, epi_tma=8, out_tma=True, both=False, capability=sm90, **kw):
        kw = dict(dict(out_dtype=torch.bfloat16, scale_a=2, scale_b=2), **kw)
        epi = object() if hook == "epilogue" or both else None
        wait = object() if hook == "wait" or both else None
        ws, _ = launch.ws_choice(capability, dtype, cfg, epi, wait, epi_tma if epi else 0, True, 4096, 3584, 132,
                                 out_tma=out_tma, **kw)
        return ws, launch.pp_choice(ws, cfg, hook, kw["out_dtype"])
    for hook, role in (("epilogue", "store warp counts and publishes"), ("wait", "poll warp waits")):
        for out_dtype, stages in ((torch.bfloat16, 5), (torch.float16, 5), (torch.float32, 3)):
            for sa, sb in ((0, 0), (1, 1), (2, 2)):
                ws, (kernel, got, why) = choice(_PP, hook, out_dtype=out_dtype, scale_a=sa, scale_b=sb)
                assert ws and kernel == "gemm_pp_kernel" and got == ((128, 128, 128), stages), (hook, out_dtype, why)
                assert f"with the {hook} hook: gemm_pp" in why and role in why and f"{stages} stages" in why
        assert choice(_PP, hook, dtype=E5M2, b_dtype=E4M3)[1][0] == "gemm_pp_kernel"
        # the same call of a config without the flag: gemm_ws, nothing more said
        assert choice(_GLUON_128, hook)[1] == ("gemm_ws_kernel", ((128, 128, 128), 5), "")
        # bf16: ws_choice's K-steps of 64, which gemm_pp has no form of
        kernel, got, why = choice(_PP, hook, dtype=torch.bfloat16, b_dtype=torch.bfloat16, out_dtype=torch.bfloat16,
                                  scale_a=0, scale_b=0)[1]
        assert (kernel, got) == ("gemm_ws_kernel", ((128, 128, 64), 5)) and "gemm_pp is fp8's" in why, why
    assert choice(_PP, "epilogue", epi_tma=abi.EPI_TMA_STACKED)[1][:2] == ("gemm_pp_kernel", ((128, 128, 128), 5))
    # where ws_choice does not take the Gluon kernel, neither kernel runs it (same conditions)
    for hook, kw in (("epilogue", dict(epi_tma=0)), ("wait", dict(out_tma=False)), ("epilogue", dict(both=True)),
                     ("wait", dict(capability=(10, 0))), ("epilogue", dict(b_kmajor=False)),
                     ("wait", dict(options=gc.GemmOptions(gluon=False)))):
        ws, picked = choice(_PP, hook, **kw)
        assert ws == () and picked == ("gemm_kernel", (), ""), (hook, kw)
    with pytest.raises(AssertionError):
        launch.pp_choice(((128, 128, 128), 5), _PP, True)   # the old (plain: bool) form


def _partitions_with(ptx: str, piece: str) -> list[str]:
    """The stretches of a warp-specialized kernel's PTX between one ``setmaxnreg`` and the
    next (each partition's code starts with one: 232 for the consumers, 40 for the load and
    store warps) that hold ``piece``."""
    return [seg for seg in re.split(r"\n\s*setmaxnreg\.\w+\.sync\.aligned\.u32\s+\d+;", ptx) if piece in seg]


_TMA_LOAD_PTX = "cp.async.bulk.tensor.2d.shared::cluster.global"
_TMA_STORE_PTX = "cp.async.bulk.tensor.2d.global.shared"


def _compile_pp(**kw):
    compile_ws, sass_of = _offline_ws()
    kw = dict(dict(block=(128, 128, 128), stages=5, dtype=E4M3, scale_a=2, scale_b=2, pingpong=True), **kw)
    kern = compile_ws(4096, 4096, 1792, **kw)
    sass, res = sass_of(kern.asm["cubin"])
    assert "LOCAL:0" in res and "STACK:0" in res and kern.metadata.shared <= 232448, (res, kern.metadata.shared)
    assert len(re.findall(r"QGMMA\.64x128x32\.F32\.E4M3\.E4M3", sass)) == 16   # both consumers' wgmma
    return kern, sass


@pytest.mark.skipif(not _ptxas(), reason="Triton without its bundled ptxas")
@pytest.mark.parametrize("out_dtype,stages", [(torch.bfloat16, 5), (torch.float32, 3)], ids=["bf16", "fp32"])
@pytest.mark.parametrize("epi_tma", [8, abi.EPI_TMA_STACKED], ids=["8_descriptors", "stacked"])
def test_offline_pp_kernel_counts_and_publishes_on_its_store_warp(epi_tma, out_dtype, stages):
    # gemm_pp with the epilogue hook (owner order, row-wise): gemm_ws's store-warp code, once,
    # in the partition that holds the TMA stores and neither wgmma nor TMA loads: the wait for
    # the TMA writes, the proxy fence, the returning GPU-scope count and the system-scope
    # publication; the store paths as gemm_ws's (one per descriptor, or the plain one)
    plain, plain_sass = _compile_pp(epi_tma=-1, tile_order=0, stages=stages, out_dtype=out_dtype)
    kern, sass = _compile_pp(epi_tma=epi_tma, tile_order=2, stages=stages, out_dtype=out_dtype)
    ptx = kern.asm["ptx"]
    hook = ("atom.add.acq_rel.gpu", "fence.acq_rel.sys", "cp.async.bulk.wait_group 0;", "fence.proxy.async.global",
            "st.relaxed.sys.global")
    for piece in hook:
        assert ptx.count(piece) == 1 and piece not in plain.asm["ptx"], piece
    (store,) = _partitions_with(ptx, "atom.add.acq_rel.gpu")
    assert all(piece in store for piece in hook)
    assert _TMA_STORE_PTX in store and "wgmma" not in store and _TMA_LOAD_PTX not in store
    assert len(_partitions_with(ptx, "wgmma.mma_async")) == 2   # the two consumers, no hook code in them
    per_path = plain_sass.count("UTMASTG")
    assert per_path > 0 and sass.count("UTMASTG") == (8 if epi_tma == 8 else 1) * per_path
    assert kern.metadata.shared >= stages * 32768 + 2 * 128 * 128 * torch.empty(0, dtype=out_dtype).element_size()


@pytest.mark.skipif(not _ptxas(), reason="Triton without its bundled ptxas")
def test_offline_pp_kernel_waits_in_its_poll_warp():
    # gemm_pp with the wait hook (round order): gemm_ws's bounded spin (acquire at system scope,
    # %globaltimer only once a flag was not ready, the error word) and the first timeout's claim
    # of the error word in the poll warp, which hands each tile on through an mbarrier (no TMA,
    # no wgmma); the proxy fence in the partition that issues the TMA loads, before its last
    # load; no count, no publication
    kern, _ = _compile_pp(wait=True, tile_order=1)
    ptx = kern.asm["ptx"]
    for piece, count in (("ld.global.acquire.sys.b32", 1), ("mov.u64 t0, %globaltimer", 1),
                         ("fence.proxy.async.global", 1), ("atom.add.acq_rel.gpu", 0), ("fence.acq_rel.sys", 0)):
        assert ptx.count(piece) == count, piece
    (poll,) = _partitions_with(ptx, "ld.global.acquire.sys.b32")
    assert re.search(r"atom\.[a-z_.]*cas", poll) and "mbarrier.arrive" in poll and "mbarrier.try_wait" in poll
    assert _TMA_LOAD_PTX not in poll and "wgmma" not in poll and "fence.proxy.async.global" not in poll
    # the spin reads the clock only after a first look found the flag not ready
    assert poll.index("ld.global.acquire.sys.b32") < poll.index("mov.u64 t0, %globaltimer")
    (load,) = _partitions_with(ptx, "fence.proxy.async.global")
    assert _TMA_LOAD_PTX in load and "wgmma" not in load and _TMA_STORE_PTX not in load
    assert "mbarrier.try_wait" in load and load.index("fence.proxy.async.global") < load.rindex(_TMA_LOAD_PTX)


@pytest.mark.skipif(not _ptxas(), reason="Triton without its bundled ptxas")
@pytest.mark.parametrize("hook", ["none", "wait", "epilogue"])
def test_offline_pp_kernel_records_tiles_in_its_load_and_store_warps(hook):
    # RECORD_TILES: the start (and, with the wait, wait-done) times in the load warp, the end in
    # the store warp, as gemm_ws; the consumers read no clock (the wait's spin reads it in the
    # poll warp)
    kw = dict(none=dict(epi_tma=-1, tile_order=0), wait=dict(wait=True, tile_order=1),
              epilogue=dict(epi_tma=8, tile_order=2))[hook]
    kern, _ = _compile_pp(record_tiles=True, **kw)
    ptx = kern.asm["ptx"]
    clocks = _partitions_with(ptx, "%globaltimer")
    assert len(clocks) == (3 if hook == "wait" else 2) and not any("wgmma" in seg for seg in clocks)
    (load,) = [seg for seg in clocks if _TMA_LOAD_PTX in seg]
    (store,) = [seg for seg in clocks if _TMA_STORE_PTX in seg]
    # mov.u64 of %globaltimer: the record start, wait done and end one each
    assert load.count("%globaltimer") == (2 if hook == "wait" else 1) and store.count("%globaltimer") == 1


def test_a_plain_pingpong_plan_launches_gemm_pp(monkeypatch):
    # matmul's launch of a gemm_pp plan (faked: no GPU): gemm_ws's argument list, hooks off, the
    # descriptors at 128x128x128, the plan's stages, 4 warps and gemm_pp's register cap; the
    # compiled-kernel key names gemm_pp, so it never reuses a gemm_ws kernel of the same shapes
    m, n, k = 256, 512, 256
    plan = launch.LaunchPlan(m=m, n=n, k=k, config=dataclasses.replace(_PP, GROUP_M=4), kernel="gemm_pp_kernel",
                             b_kmajor=True, use_tma=True, grid=(4, 1, 1), ws_block=(128, 128, 128), ws_stages=5,
                             out_dtype=torch.bfloat16, scale_a=2, scale_b=2, num_tiles=8)
    (spec, grid, full), a, b, out, sa, sb = _launch_faked(monkeypatch, plan)
    from tpfuse.kernels import gemm_pp
    from tpfuse.kernels.gemm_ws import gemm_ws_kernel
    assert gemm_pp.gemm_pp_kernel.arg_names == gemm_ws_kernel.arg_names   # one argument list for both
    args = dict(zip(gemm_pp.gemm_pp_kernel.arg_names, full, strict=True))
    assert grid == (4, 1, 1) and spec[0] == "gemm_pp_kernel"
    assert args["a_desc"] == ("desc", a.data_ptr(), (m, k), (128, 128))
    assert args["b_desc"] == ("desc", b.data_ptr(), (n, k), (128, 128))
    assert args["c_desc"] == ("desc", out.data_ptr(), (m, n), (128, 128))
    assert args["EPILOGUE"] == 0 and args["WAIT"] is False and args["RECORD_TILES"] is False
    assert args["scale_a"] is sa and args["scale_b"] is sb and (args["SCALE_A"], args["SCALE_B"]) == (2, 2)
    assert (args["BLOCK_M"], args["BLOCK_N"], args["BLOCK_K"], args["GROUP_M"], args["STAGES"]) == (128, 128, 128, 4, 5)
    assert args["num_warps"] == gemm_pp.NUM_WARPS == 4



@pytest.mark.parametrize("hook", ["epilogue", "epilogue_route", "wait"])
def test_a_hooked_pingpong_plan_launches_gemm_pp_with_the_hook(monkeypatch, hook):
    # matmul's launch of a hooked gemm_pp plan (faked: no GPU): gemm_ws's hooked argument list,
    # the epilogue's per-chunk destinations as Gluon descriptors at gemm_pp's 128x128 block (as
    # for gemm_ws; Triton's descriptors at the config's block would not fit the kernel), its
    # counters, signals and generation; or the wait's signal, generation, bound and error word
    # with out's descriptor; the owner / round order with its chunks; 4 warps. An epilogue
    # spec without signals: the same stores, EPI_ROUTE, no counters or signals
    m, n, k, chunk_m = 512, 256, 256, 128
    route = hook == "epilogue_route"
    hook = "epilogue" if route else hook
    order = "owner" if hook == "epilogue" else "round"
    plan = launch.LaunchPlan(m=m, n=n, k=k, config=_PP, kernel="gemm_pp_kernel", b_kmajor=True, use_tma=True,
                             grid=(4, 1, 1), ws_block=(128, 128, 128), ws_stages=5, out_dtype=torch.bfloat16,
                             scale_a=2, scale_b=2, num_tiles=8, tile_order=order, chunk_m=chunk_m, num_chunks=4,
                             start_chunk=1, epi_tma=4 if hook == "epilogue" else 0)
    if hook == "epilogue":
        gapped = torch.empty(4 * (chunk_m + 8), n, dtype=torch.bfloat16)   # not stacked: 4 descriptors
        dests = [gapped[q * (chunk_m + 8):q * (chunk_m + 8) + chunk_m] for q in range(4)]
        spec = gc.EpilogueSpec.from_tensors(dests, None if route else torch.zeros(4, dtype=torch.int32), 3, chunk_m)
        kw = dict(epilogue=spec, tile_order=order, start_chunk=1)
    else:
        spec = gc.WaitSpec(torch.zeros(4, dtype=torch.int32), 3, chunk_m, timeout_ns=12345,
                           error=torch.zeros(launch.ERROR_WORDS, dtype=torch.int32))
        kw = dict(wait=spec, tile_order=order, start_chunk=1, check=False)
    (key, grid, full), a, b, out, sa, sb = _launch_faked(monkeypatch, plan, **kw)
    from tpfuse.kernels import gemm_pp
    args = dict(zip(gemm_pp.gemm_pp_kernel.arg_names, full, strict=True))
    assert key[0] == "gemm_pp_kernel" and grid == (4, 1, 1) and args["num_warps"] == gemm_pp.NUM_WARPS
    assert args["a_desc"] == ("desc", a.data_ptr(), (m, k), (128, 128))
    assert args["TILE_ORDER"] == launch.TILE_ORDERS.index(order)
    assert (args["chunk_m"], args["num_chunks"], args["start_chunk"]) == (chunk_m, 4, 1)
    assert args["scale_a"] is sa and args["scale_b"] is sb and args["STAGES"] == 5
    if hook == "epilogue":
        mode = abi.EPI_ROUTE if route else abi.EPI_SIGNALLED
        assert args["EPILOGUE"] == mode and args["WAIT"] is False and args["EPI_TMA"] == 4
        for q in range(8):
            assert args[f"epi_d{q}"] == (("desc", dests[q].data_ptr(), (chunk_m, n), (128, 128)) if q < 4 else None)
        assert args["c_desc"] == args["epi_d0"]
        assert args["counters"] is spec.counters and args["signal_ptrs"] is spec.signal_ptrs and args["epi_gen"] == 3
        assert (args["counters"] is None) == route and (args["signal_ptrs"] is None) == route
        assert args["wait_signal"] is None and args["err_ptr"] is None
    else:
        assert args["WAIT"] is True and args["EPILOGUE"] == 0 and args["EPI_TMA"] == 0
        assert args["wait_signal"] is spec.signal and args["wait_gen"] == 3 and args["wait_timeout"] == 12345
        assert args["err_ptr"] is spec.error
        assert args["c_desc"] == ("desc", out.data_ptr(), (m, n), (128, 128))
        assert args["counters"] is None and all(args[f"epi_d{q}"] is None for q in range(8))


def test_pingpong_candidates():
    # fp8 on sm_90: one pingpong=True config per GROUP_M of the 128x128x128 candidates (the
    # gluon one's twin at the same stages: gemm_kernel runs the same config where gemm_pp
    # cannot), at most 3 more per shape; none for bf16 or another GPU
    from tpfuse.gemm.config import _SM90_SMEM_BYTES
    for m, n, k in ((16384, 4096, 1792), (4096, 4096, 1792), (4096, 3584, 4096), (512, 3584, 4096)):
        cands = gc.candidate_configs(m, n, k, E4M3)
        pp = [c for c in cands if c.pingpong]
        groups = {c.GROUP_M for c in cands if (c.BLOCK_M, c.BLOCK_N, c.BLOCK_K) == (128, 128, 128)
                  and not c.gluon and not c.stream_k}
        assert 1 <= len(pp) <= 3 and sorted(c.GROUP_M for c in pp) == sorted(groups), (m, n, k)
        for c in pp:
            assert dataclasses.replace(c, pingpong=False) in cands and c.gluon
            assert (c.BLOCK_M, c.BLOCK_N, c.BLOCK_K, c.num_stages) == (128, 128, 128, 5)
            assert c.smem_bytes(1, 2) <= _SM90_SMEM_BYTES
        for capability in ((10, 0), (8, 9)):
            assert not any(c.pingpong for c in gc.candidate_configs(m, n, k, E4M3, capability=capability))
        assert not any(c.pingpong for c in gc.candidate_configs(m, n, k, torch.bfloat16))


@pytest.mark.skipif(not _ptxas(), reason="Triton without its bundled ptxas")
@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("scale", [1, 2], ids=["tensorwise", "rowwise"])
def test_offline_pp_kernel_fp8(out_dtype, scale):
    # on every supported Triton: gemm_pp at the stages pp_choice takes compiles for sm_90; wgmma
    # m64n128k32 (QGMMA) fed by TMA loads, whole-tile TMA stores, no spills, sm_90's shared
    # memory; two consumer partitions, each issuing its own accumulator's wgmma (8 per 128-deep
    # K-step: 2 row halves x 4 K-steps of 32, so 16 sites), each raising its registers to 232
    # (setmaxnreg) while the load/store warpgroup drops to 40
    compile_ws, sass_of = _offline_ws(pinned=False)
    (kernel, (block, stages), _) = launch.pp_choice(((128, 128, 128), 5), _PP, "", out_dtype)
    assert kernel == "gemm_pp_kernel"
    kern = compile_ws(4096, 3584, 1792, block=block, stages=stages, tile_order=0, dtype=E4M3, out_dtype=out_dtype,
                      scale_a=scale, scale_b=scale, pingpong=True)
    sass, res = sass_of(kern.asm["cubin"])
    ptx = kern.asm["ptx"]
    assert "LOCAL:0" in res and "STACK:0" in res, res
    assert kern.metadata.shared <= 232448, kern.metadata.shared
    # the two staging buffers and the ring are all there (a smaller allocation: a buffer missing)
    out_size = torch.empty(0, dtype=out_dtype).element_size()
    assert kern.metadata.shared >= stages * 32768 + 2 * 128 * 128 * out_size
    wgmma = re.findall(r"wgmma\.mma_async\.sync\.aligned\.(m\d+n\d+k\d+)\.f32\.e4m3\.e4m3", ptx)
    assert wgmma == ["m64n128k32"] * 16, wgmma
    assert len(re.findall(r"QGMMA\.64x128x32\.F32\.E4M3\.E4M3", sass)) == 16
    assert "UTMALDG" in sass and "UTMASTG" in sass
    assert re.findall(r"setmaxnreg\.dec\.sync\.aligned\.u32\s+(\d+)", ptx).count("40") >= 2
    raised = re.findall(r"setmaxnreg\.(?:inc|dec)\.sync\.aligned\.u32\s+232", ptx)
    assert len(raised) == 2, raised   # consumer 0 (the default partition: down from 256) and consumer 1
    # each consumer waits for its turn and hands it over: 2 ordering arrives beside the stages'
    assert ptx.count("mbarrier.try_wait.parity") >= 6
    assert "fence.proxy.async.global" not in ptx and "atom.add" not in ptx   # no hook code
    import triton
    if triton.__version__.startswith(KNOWN_TRITON):   # pinned: the scales' loads (two per consumer)
        assert len(re.findall(r"\bLDG\.", sass)) == 4


@pytest.mark.skipif(not _ptxas(), reason="Triton without its bundled ptxas")
@pytest.mark.parametrize("pingpong", [False, True], ids=["ws", "pp"])
def test_offline_epilogue_hook_compiles_with_fewer_descriptors_than_eight(pingpong):
    # gemm_rs at W < 8: the per-chunk descriptors past the last chunk are None.  A @gluon.jit
    # helper that returned the eight as a tuple failed to compile there ("cannot convert None
    # ... to tensor"; only the H200 runs caught it): both kernels build the tuple inline, one
    # store path per descriptor given
    compile_ws, sass_of = _offline_ws()
    kw = dict(block=(128, 128, 128), stages=5, dtype=E4M3, scale_a=2, scale_b=2, pingpong=True) if pingpong else {}
    plain = compile_ws(4096, 4096, 1792, epi_tma=-1, tile_order=0, **kw)
    kern = compile_ws(4096, 4096, 1792, epi_tma=4, tile_order=2, **kw)
    per_path = sass_of(plain.asm["cubin"])[0].count("UTMASTG")
    assert per_path > 0 and sass_of(kern.asm["cubin"])[0].count("UTMASTG") == 4 * per_path


@pytest.mark.skipif(not _ptxas(), reason="Triton without its bundled ptxas")
@pytest.mark.parametrize("kernel", ["triton", "ws", "pp"])
def test_offline_epilogue_without_signals_counts_and_fences_nothing(kernel):
    # The fused GEMM+RS/AR's hook (an EpilogueSpec without signals): the same routed stores,
    # and none of the signalled hook's atomics, system-scope fences or publications (on the
    # H200 the signalled count and publication cost a 49 us fp8 call ~4 %: BENCHMARKS.md)
    def compile_both():
        if kernel == "triton":
            compile_kernel, sass_of = _offline_tools(pinned=False)
            cfg = gc.GemmConfig(BLOCK_M=128, BLOCK_N=256, BLOCK_K=64, num_warps=8, num_stages=3)
            return [sass_of(compile_kernel(4096, 4096, 1792, cfg, epilogue=True, tile_order=2, epi_tma=8,
                                           signals=s).asm["cubin"])[0] for s in (True, False)]
        compile_ws, sass_of = _offline_ws()
        kw = dict(block=(128, 128, 128), stages=5, dtype=E4M3, scale_a=1, scale_b=1, pingpong=kernel == "pp")
        return [sass_of(compile_ws(4096, 4096, 1792, epi_tma=8, tile_order=2, signals=s, **kw).asm["cubin"])[0]
                for s in (True, False)]

    signalled, routed = compile_both()
    sync = r"ATOMG|REDG|MEMBAR\.\w+\.SYS|STRONG\.SYS"
    assert re.search(sync, signalled), "the signalled hook lost its count or publication"
    assert not re.search(sync, routed), re.findall(sync, routed)
    assert routed.count("UTMASTG") == signalled.count("UTMASTG") > 0   # the same routed stores


def _route_plan(monkeypatch, cfg, signals=False, m=4096, chunks=8):
    """_make_plan of an fp8 epilogue-hook call (owner order, ``chunks`` destinations of one
    allocation each, with or without signals) as on sm_90 with TMA, but without inline PTX, so
    gemm_kernel takes it (ws_choice: "no inline PTX"); CPU tensors, as under the interpreter."""
    monkeypatch.setattr(launch, "interpreting", lambda: True)
    monkeypatch.setattr(launch, "_tma_ok", lambda *args: (True, ""))
    n, k, chunk_m = 1024, 256, m // chunks
    a = torch.zeros(m, k).to(E4M3)
    b = torch.zeros(n, k).to(E4M3).t()
    dests = [torch.empty(chunk_m, n, dtype=torch.bfloat16) for _ in range(chunks)]
    sig = torch.zeros(chunks, dtype=torch.int32) if signals else None
    spec = gc.EpilogueSpec.from_tensors(dests, sig, 1, chunk_m)
    return launch._make_plan(a, b, None, cfg, "owner", None, 1, None, spec, None, None, gc.GemmOptions(),
                             scale_a=torch.ones(()), scale_b=torch.ones(()))


def test_the_hook_without_signals_stores_by_pointer_in_a_flattened_tile_loop(monkeypatch):
    # On the H200 every fp8 gemm_kernel config with flatten=True failed to compile with the hook
    # without signals through per-chunk TMA descriptors (Triton's FuseNestedLoops: "scf.if ...
    # source has 1 operands, but target successor needs 2"; Triton 3.6, 3.7 and 3.8 alike).
    # Plans take pointer stores there and say why; nested loops, stacked destinations and the
    # signalled hook keep their descriptors.
    flat = dataclasses.replace(_FP8, flatten=True)
    plan = _route_plan(monkeypatch, flat)
    assert plan.kernel == "gemm_kernel" and plan.epi_tma == 0 and plan.spec.EPI_TMA == 0
    assert plan.spec.FLATTEN and any("pointer stores" in r for r in plan.reasons), plan.reasons
    for cfg, signals in ((_FP8, False), (flat, True)):
        plan = _route_plan(monkeypatch, cfg, signals)
        assert plan.epi_tma == plan.spec.EPI_TMA == 8, (cfg, signals)
        assert not any("pointer stores" in r for r in plan.reasons)
    routed = gc.EpilogueSpec.from_tensors([torch.empty(64, 16)] * 2, None, 1, 64)
    assert launch.route_tma_fallback(routed, abi.EPI_TMA_STACKED, True) == (abi.EPI_TMA_STACKED, "")
    assert launch.route_tma_fallback(None, 0, True) == (0, "")


@pytest.mark.skipif(not _ptxas(), reason="Triton without its bundled ptxas")
def test_what_plans_launch_with_the_hook_without_signals_compiles():
    # the offline sm_90 compile of the route-only hook in gemm_kernel: flattened with pointer
    # stores (what plans take, above), nested with per-chunk descriptors, flattened with stacked
    # destinations; and the per-chunk descriptors in a flattened loop still fail (when a Triton
    # compiles them, route_tma_fallback can go: this test then says so)
    compile_kernel, sass_of = _offline_tools(pinned=False)
    flat = dataclasses.replace(_FP8, flatten=True, EPI_SUBTILE=2)
    kw = dict(epilogue=True, tile_order=2, signals=False, dtype=E4M3, scale_a=2, scale_b=2)
    for cfg, epi_tma in ((flat, 0), (_FP8, 8), (flat, abi.EPI_TMA_STACKED)):
        sass, _ = sass_of(compile_kernel(4096, 4096, 1792, cfg, epi_tma=epi_tma, **kw).asm["cubin"])
        assert ("UTMASTG" in sass) == (epi_tma > 0), (cfg, epi_tma)
    with pytest.raises(Exception, match="PassManager::run failed"):
        compile_kernel(4096, 4096, 1792, flat, epi_tma=8, **kw)


def test_fp8_hooks_run_in_the_gemm_kernel_config_the_tuner_chose():
    # an fp8 config chosen for the shape (tuning cache or passed in) that is not a Gluon one:
    # the wait hook and the hook without signals run gemm_kernel, the kernel it was timed in;
    # the signalled hook, a Gluon config, default_config's (not chosen) and bf16 take the
    # Gluon kernel as before
    sm90 = (9, 0)
    dests = [torch.empty(128, 256, dtype=torch.bfloat16) for _ in range(2)]
    routed = gc.EpilogueSpec.from_tensors(dests, None, 1, 128)
    signalled = gc.EpilogueSpec.from_tensors(dests, torch.zeros(2, dtype=torch.int32), 1, 128)
    wait = object()

    def choice(cfg, epi, hook_wait, chosen=True, dtype=E4M3):
        return launch.ws_choice(sm90, dtype, cfg, epi, hook_wait, 2 if epi is not None else 0, True,
                                out_tma=epi is None, out_dtype=torch.bfloat16 if dtype == E4M3 else None,
                                chosen=chosen)
    for epi, hook_wait, what in ((None, wait, "wait hook"), (routed, None, "without signals")):
        got, why = choice(_FP8, epi, hook_wait)
        assert got == () and what in why and "timed in" in why, why
        assert choice(_FP8, epi, hook_wait, chosen=False)[0] == ((128, 256, 128), 3)
        assert choice(_GLUON_256, epi, hook_wait)[0] == ((128, 256, 128), 3)
        bf16 = dataclasses.replace(_FP8, BLOCK_K=64)
        assert choice(bf16, epi, hook_wait, dtype=torch.bfloat16)[0] == ((128, 256, 64), 3)
    got, why = choice(_FP8, signalled, None)
    assert got == ((128, 256, 128), 3) and "counts and publishes" in why
