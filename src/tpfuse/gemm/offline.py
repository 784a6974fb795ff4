"""Compile the GEMM kernels for sm_90 without a GPU and report what the compiler made of them.

    python3 -m tpfuse.gemm.offline [--m 512 --n 3584 --k 4096] [--config 128x128x64:num_stages=6]
                                   [--epilogue] [--tile-order owner] [--dump DIR]

Triton ships ptxas, so the TTGIR, PTX and cubin of any config come out on a CPU-only machine.
Prints registers, spill stack, shared memory, and counts of a few instructions (wgmma, TMA
loads/stores, barriers); ``--dump DIR`` writes the TTGIR, PTX and SASS. The compile sees what a
launch would specialize on (16-byte alignment of pointers and of ints that are multiples of 16);
the hook arguments are not specialized, as in :mod:`tpfuse.gemm.launch`. Costs no device time.
The CPU tests (tests/cpu/test_kernel_tools.py) check the compiled code with it.
"""
from __future__ import annotations

import argparse
import importlib
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

from ..kernels import _types, abi
from .config import GemmConfig
from .spec import CompileSpec

__all__ = ["parse_spec", "compile_kernel", "compile_ws_kernel", "sass_of"]


def parse_spec(spec: str) -> GemmConfig | None:
    """``"128x256x64:num_stages=4,flatten=true"`` -> GemmConfig (``"cublas"`` -> None)."""
    if spec == "cublas":
        return None
    tile, _, rest = spec.partition(":")
    bm, bn, bk = (int(x) for x in tile.split("x"))
    kw = dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk)
    for item in filter(None, rest.split(",")):
        key, _, val = item.partition("=")
        kw[key] = val.lower() == "true" if val.lower() in ("true", "false") else int(val)
    return GemmConfig(**kw)

NOT_SPECIALIZED = {"chunk_m", "num_chunks", "start_chunk", "wait_gen", "wait_timeout", "stride_dm",
                   "epi_gen", "wait_signal", "err_ptr", "dest_offs", "signal_ptrs", "counters",
                   "tile_counters", "tile_records", "scale_a", "scale_b"}


def _signature(names, args: dict, cons: dict, aligned) -> tuple[dict, dict, dict]:
    """(signature, attrs, constexprs) for an ASTSource: ``cons`` names are constexprs, a None
    argument becomes one too; ``aligned(name, value)`` says which arguments a launch would
    specialize as 16-byte aligned (divisible by 16)."""
    from triton.runtime.jit import mangle_type
    sig, attrs, cons = {}, {}, dict(cons)
    for i, name in enumerate(names):
        if name in cons:
            sig[name] = "constexpr"
            continue
        v = args[name]
        if v is None:
            sig[name] = "constexpr"
            cons[name] = None
            continue
        sig[name] = "i32" if isinstance(v, int) else mangle_type(v)
        if aligned(name, v):
            attrs[(i,)] = [["tt.divisibility", 16]]
    return sig, attrs, {(names.index(key),): val for key, val in cons.items()}


def compile_kernel(m: int, n: int, k: int, cfg, epilogue: bool = False, tile_order: int = 0,
                   wait: bool = False, sk_tiles: int = 0, epi_tma: int = 0, epi_count: int = 1,
                   record_tiles: bool = False, dtype: torch.dtype = _types.HEURISTIC_DTYPE,
                   b_dtype: torch.dtype | None = None, out_dtype: torch.dtype | None = None,
                   scale_a: int = _types.SCALE_NONE, scale_b: int = _types.SCALE_NONE,
                   signals: bool = True):
    """triton.compile of the Triton GEMM variant tpfuse.gemm.launch would launch for
    ``a[m, k] @ weight[n, k].t()`` in ``dtype`` (``b_dtype``: the weight's, default the same;
    TMA path) on sm_90: ``gemm_kernel``, ``gemm_sk_kernel`` (a ``stream_k`` config with
    ``sk_tiles``) or ``gemm_hooked_kernel`` (``epilogue`` / ``wait``; ``epi_tma`` > 0: the
    epilogue hook stores through that many TMA descriptors (chunks of ``m // epi_tma`` rows), or
    ``EPI_TMA_STACKED`` (9) through one over all of ``c``); ``record_tiles``: the per-tile
    timeline on (RECORD_TILES). ``out_dtype``: the output's (default: the input's, bfloat16 for
    fp8); ``scale_a`` / ``scale_b``: scale modes (``kernels/_types.py`` ``SCALE_*``); ``signals``
    False: the epilogue hook routes only (an EpilogueSpec without signals)."""
    import triton
    import triton.language as tl
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from triton.tools.tensor_descriptor import TensorDescriptor

    # the module as sys.modules has it now (a test run may have re-imported it after using
    # the interpreter), not a stale attribute of the package
    km = importlib.import_module("tpfuse.kernels.gemm")
    stacked = epi_tma == abi.EPI_TMA_STACKED
    b_dtype = dtype if b_dtype is None else b_dtype
    if out_dtype is None:
        out_dtype = _types.FP8_DEFAULT_OUT if _types.is_fp8(dtype) else dtype

    bm, bn, bk = cfg.BLOCK_M, cfg.BLOCK_N, cfg.BLOCK_K
    a = torch.empty(m, k, dtype=dtype)
    w = torch.empty(n, k, dtype=b_dtype)
    c = torch.empty(m, n, dtype=out_dtype)
    i32, i64, f32 = (torch.empty(4, dtype=t) for t in (torch.int32, torch.int64, torch.float32))
    scales = {_types.SCALE_NONE: None, _types.SCALE_TENSOR: torch.empty(1), _types.SCALE_VECTOR: torch.empty(max(m, n))}
    args = dict(a=TensorDescriptor.from_tensor(a, [bm, bk]), b=TensorDescriptor.from_tensor(w, [bn, bk]),
                c=c if epilogue or not cfg.tma_store else TensorDescriptor.from_tensor(c, [bm, bn // cfg.EPI_SUBTILE]),
                M=m, N=n, K=k, stride_am=k, stride_ak=1, stride_bk=1, stride_bn=k, stride_cm=n, stride_cn=1,
                chunk_m=m, num_chunks=1, start_chunk=0, scale_a=scales[scale_a], scale_b=scales[scale_b],
                wait_signal=i32, wait_gen=0, wait_timeout=0,
                err_ptr=i32, dest_offs=i64, stride_dm=0, signal_ptrs=i64 if signals else None,
                counters=i32 if signals else None, epi_gen=0,
                **{f"epi_d{q}": TensorDescriptor.from_tensor(c if stacked else c[:max(m // epi_tma, 1)],
                                                            [bm, bn // cfg.EPI_SUBTILE])
                   if q < (1 if stacked else epi_tma) else None for q in range(8)},
                ws=f32, tile_counters=i32, sk_tiles=sk_tiles,
                tile_records=torch.empty(4, abi.TILE_RECORD_COLUMNS, dtype=torch.int64) if record_tiles else None)
    spec = CompileSpec(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=cfg.GROUP_M, EPI_SUBTILE=cfg.EPI_SUBTILE,
                       TILE_ORDER=tile_order, USE_TMA=True, TMA_STORE=cfg.tma_store, B_KMAJOR=True,
                       C_DTYPE=_types.tl_name(out_dtype), SCALE_A=scale_a, SCALE_B=scale_b, FLATTEN=cfg.flatten,
                       DOT_FP32=False, USE_ASM=True, RECORD_TILES=record_tiles,
                       STREAM_K=bool(cfg.stream_k) and sk_tiles > 0, WAIT=wait,
                       EPILOGUE=(abi.EPI_SIGNALLED if signals else abi.EPI_ROUTE) if epilogue else 0,
                       DEST_ALIGNED=8 if epilogue else 0, EPI_TMA=epi_tma, EPI_COUNT=epi_count).project()
    kernel = getattr(km, spec.KERNEL)
    sig, attrs, constexprs = _signature(
        kernel.arg_names, args, spec.constexprs(tl),
        lambda name, v: name not in NOT_SPECIALIZED and (isinstance(v, torch.Tensor) or (isinstance(v, int) and v and v % 16 == 0)))
    src = ASTSource(fn=kernel, signature=sig, attrs=attrs, constexprs=constexprs)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32),
                          options=dict(num_warps=cfg.num_warps, num_stages=cfg.num_stages))


def compile_ws_kernel(m: int, n: int, k: int, block=(128, 256, 64), stages: int = 3, epi_tma: int = -1,
                      tile_order: int = 2, b_kmajor: bool = True, wait: bool = False, record_tiles: bool = False,
                      dtype: torch.dtype = _types.HEURISTIC_DTYPE, b_dtype: torch.dtype | None = None,
                      out_dtype: torch.dtype | None = None, scale_a: int = _types.SCALE_NONE,
                      scale_b: int = _types.SCALE_NONE, pingpong: bool = False, signals: bool = True):
    """triton.compile of the warp-specialized Gluon kernel (tpfuse/kernels/gemm_ws.py) for
    ``a[m, k] @ b`` (``weight[n, k].t()`` or row-major ``[k, n]``) on sm_90, launched as
    tpfuse.gemm.launch launches it; ``epi_tma``: -1 no hook (plain output), else the epilogue hook through
    that many per-chunk descriptors (chunks of ``m // epi_tma`` rows) or, 9, one over stacked
    destinations; ``wait``: the wait hook (without the epilogue hook); ``record_tiles``: the per-tile
    timeline on (RECORD_TILES). ``dtype`` (a's; ``b_dtype`` the weight's, default the same),
    ``out_dtype`` (default: the input's, bfloat16 for fp8) and the scale modes ``scale_a`` /
    ``scale_b`` (``kernels/_types.py`` ``SCALE_*``) as :func:`compile_kernel` takes them; fp8
    wants ``block``'s K at 128 (ws_choice's). ``pingpong``: the ping-pong kernel
    (tpfuse/kernels/gemm_pp.py; fp8, 128x128x128, b K-major; the hooks and records as for
    gemm_ws) with its own launch geometry (4 warps per consumer, ``gemm_pp.MAXNREG``). ``signals``
    False: the epilogue hook routes only (an EpilogueSpec without signals)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    from .launch import _gluon_descriptor as make_descriptor
    W = importlib.import_module("tpfuse.kernels.gemm_ws")
    kernel, num_warps, maxnreg = W.gemm_ws_kernel, abi.WS_NUM_WARPS, abi.WS_MAXNREG
    if pingpong:
        P = importlib.import_module("tpfuse.kernels.gemm_pp")
        kernel, num_warps, maxnreg = P.gemm_pp_kernel, P.NUM_WARPS, P.MAXNREG
    bm, bn, bk = block
    b_dtype = dtype if b_dtype is None else b_dtype
    if out_dtype is None:
        out_dtype = _types.FP8_DEFAULT_OUT if _types.is_fp8(dtype) else dtype
    a = torch.empty(m, k, dtype=dtype)
    c = torch.empty(m, n, dtype=out_dtype)
    if b_kmajor:
        b_desc = make_descriptor(torch.empty(n, k, dtype=b_dtype), (n, k), (k, 1), (bn, bk))
    else:
        b_desc = make_descriptor(torch.empty(k, n, dtype=b_dtype), (k, n), (n, 1), (bk, bn))
    c_desc = make_descriptor(c, (m, n), (n, 1), (bm, bn))
    hook = epi_tma >= 0
    descs = 1 if epi_tma == W.EPI_TMA_STACKED.value else max(epi_tma, 0)
    chunks = max(descs, 1)
    scales = {_types.SCALE_NONE: None, _types.SCALE_TENSOR: torch.empty(1), _types.SCALE_VECTOR: torch.empty(max(m, n))}
    args = dict(a_desc=make_descriptor(a, (m, k), (k, 1), (bm, bk)), b_desc=b_desc, c_desc=c_desc, M=m, N=n, K=k,
                chunk_m=m // chunks, num_chunks=chunks, start_chunk=0,
                wait_signal=torch.empty(4, dtype=torch.int32) if wait else None, wait_gen=1, wait_timeout=10**9,
                err_ptr=torch.empty(8, dtype=torch.int32) if wait else None,
                counters=torch.empty(4, dtype=torch.int32) if hook and signals else None,
                signal_ptrs=torch.empty(4, dtype=torch.int64) if hook and signals else None, epi_gen=1,
                **{f"epi_d{q}": c_desc if q < descs else None for q in range(8)},
                tile_records=torch.empty(4, abi.TILE_RECORD_COLUMNS, dtype=torch.int64) if record_tiles else None,
                scale_a=scales[scale_a], scale_b=scales[scale_b])
    cons = dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=8, STAGES=stages, TILE_ORDER=tile_order,
                B_KMAJOR=b_kmajor,
                EPILOGUE=(abi.EPI_SIGNALLED if signals else abi.EPI_ROUTE) if hook else 0, EPI_TMA=max(epi_tma, 0),
                WAIT=wait, RECORD_TILES=record_tiles,
                SCALE_A=scale_a, SCALE_B=scale_b, num_warps=num_warps)
    sig, attrs, constexprs = _signature(kernel.arg_names, args, cons,
                                        lambda name, v: name in ("M", "N", "K") and v % 16 == 0)
    src = GluonASTSource(fn=kernel, signature=sig, attrs=attrs, constexprs=constexprs)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=num_warps, maxnreg=maxnreg))


def sass_of(cubin: bytes) -> tuple[str, str]:
    """(SASS, resource usage) of a cubin, with the cuobjdump that Triton ships."""
    import triton
    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "k.cubin")
        Path(path).write_bytes(cubin)
        sass = subprocess.run([str(tool), "--dump-sass", path], capture_output=True, text=True).stdout
        res = subprocess.run([str(tool), "--dump-resource-usage", path], capture_output=True, text=True).stdout
    return sass, " ".join(line.strip() for line in res.splitlines() if "REG" in line)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--m", type=int, default=512)
    ap.add_argument("--n", type=int, default=3584)
    ap.add_argument("--k", type=int, default=4096)
    ap.add_argument("--config", nargs="+", default=["128x128x64:num_stages=6"],
                    help="specs as parse_spec reads them: 128x256x64:num_stages=4,flatten=true")
    ap.add_argument("--epilogue", action="store_true", help="epilogue hook on (pointer stores to destinations)")
    ap.add_argument("--epilogue-tma", type=int, default=0, metavar="CHUNKS",
                    help="with --epilogue: store through CHUNKS TMA descriptors (one per chunk; "
                         "9: one over stacked destinations)")
    ap.add_argument("--wait", action="store_true", help="wait hook on")
    ap.add_argument("--tile-order", default="grouped", choices=["grouped", "round", "owner"])
    ap.add_argument("--dump", type=Path, help="write TTGIR, PTX and SASS per config here")
    args = ap.parse_args(argv)
    order = ["grouped", "round", "owner"].index(args.tile_order)
    for spec in args.config:
        cfg = parse_spec(spec)
        kern = compile_kernel(args.m, args.n, args.k, cfg, epilogue=args.epilogue, tile_order=order,
                              wait=args.wait, sk_tiles=1 if cfg.stream_k else 0,
                              epi_tma=args.epilogue_tma if args.epilogue else 0)
        sass, res = sass_of(kern.asm["cubin"])
        counts = {op: len(re.findall(pat, sass)) for op, pat in
                  (("HGMMA", r"HGMMA\."), ("UTMALDG", r"UTMALDG"), ("UTMASTG", r"UTMASTG"),
                   ("STG", r"\bSTG\."), ("BAR.SYNC", r"BAR\.SYNC"), ("MEMBAR", r"MEMBAR"))}
        print(f"{spec:44s} {res}  smem={kern.metadata.shared}  " + " ".join(f"{k}={v}" for k, v in counts.items()))
        if args.dump:
            args.dump.mkdir(parents=True, exist_ok=True)
            tag = re.sub(r"[^A-Za-z0-9]+", "_", spec)
            for ext, text in (("ttgir", kern.asm["ttgir"]), ("ptx", kern.asm["ptx"]), ("sass", sass)):
                (args.dump / f"{tag}.{ext}").write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
