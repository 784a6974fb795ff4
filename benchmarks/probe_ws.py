"""The warp-specialized Gluon kernel (tpfuse/kernels/gemm_ws.py) against the Triton kernel and
cuBLAS: correctness first (plain and epilogue hook, odd shapes, every order, per-chunk and
stacked destinations, two generations), then interleaved CUDA-graph timings (L2 flushed before
each call) of, per shape, the Triton kernel in the owner order alone (``owner``, the benchmark's
config) and with the epilogue hook (``epi``), the Gluon kernel alone (``ws``) and with the hook
(``ws_epi``), and torch.matmul. Destinations are one allocation per chunk, as peer buffers are.
``--plain``: no hooks -- the benchmark's plain call against the Gluon kernel's tiles and cuBLAS;
``--wait``: the wait hook in the round order. A diagnostic; needs an sm_90 GPU.

    python3 benchmarks/probe_ws.py --bench benchmarks/results/gemm_core_h200.json [--rounds 7]
    python3 benchmarks/probe_ws.py --no-check --plain --phases prefill_chunk --blocks 128x256x64:3 128x128x64:5
    python3 benchmarks/probe_ws.py --no-check --wait
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
for p in (ROOT, ROOT / "benchmarks"):
    if str(p) not in sys.path:
        sys.path.insert(0, str(p))

from tpfuse import gemm_core as gc  # noqa: E402
from tpfuse.kernels import gemm_ws  # noqa: E402
from profile_kernels import graph_ms  # noqa: E402


def _hook(m, n, chunks, chunk_m, dtype, stacked=False, out=None):
    """(dests, counters, signals, signal_ptrs) for the epilogue hook."""
    if stacked:
        dests = [out[c * chunk_m:(c + 1) * chunk_m] for c in range(chunks)]
    else:
        dests = [torch.full((min(chunk_m, m - c * chunk_m), n), float("nan"), device="cuda", dtype=dtype)
                 for c in range(chunks)]
    sig = torch.zeros(chunks, dtype=torch.int32, device="cuda")
    ptrs = torch.tensor([sig.data_ptr() + 4 * c for c in range(chunks)], dtype=torch.int64, device="cuda")
    return dests, torch.zeros(chunks, dtype=torch.int32, device="cuda"), sig, ptrs


def check() -> int:
    """Gluon kernel against torch.matmul; signals and counters after two generations."""
    torch.manual_seed(0)
    bad = 0
    cases = [  # m, n, k, order, chunks, start, stacked, kmajor, dtype, block
        (517, 264, 200, "grouped", 0, 0, False, True, torch.bfloat16, (128, 256, 64)),
        (1000, 520, 328, "grouped", 0, 0, False, False, torch.float16, (128, 256, 64)),
        (2048, 1024, 512, "owner", 8, 3, False, True, torch.bfloat16, (128, 256, 64)),
        (2048, 1024, 512, "owner", 8, 0, False, False, torch.bfloat16, (128, 256, 64)),
        (1536, 776, 264, "owner", 3, 2, False, True, torch.bfloat16, (128, 256, 64)),
        (1000, 512, 256, "owner", 10, 4, True, True, torch.bfloat16, (128, 256, 64)),   # 100-row chunks straddle
        (4096, 4096, 1792, "owner", 8, 1, False, True, torch.bfloat16, (128, 256, 64)),
        (4096, 4096, 1792, "round", 8, 5, False, True, torch.bfloat16, (128, 256, 64)),
        (300, 256, 4096, "owner", 2, 1, True, True, torch.bfloat16, (128, 256, 64)),
        (2048, 1024, 512, "owner", 8, 3, False, True, torch.bfloat16, (128, 128, 64)),
    ]
    for m, n, k, order, chunks, start, stacked, kmajor, dtype, block in cases:
        a = torch.randn(m, k, device="cuda", dtype=dtype)
        b = (torch.randn(n, k, device="cuda", dtype=dtype) / k ** 0.5).t() if kmajor else \
            torch.randn(k, n, device="cuda", dtype=dtype) / k ** 0.5
        ref = (a.float() @ b.float())
        tag = f"{m}x{n}x{k} {order} chunks={chunks} start={start} stacked={stacked} kmajor={kmajor} {dtype} {block}"
        try:
            if chunks == 0:
                out = torch.full((m, n), float("nan"), device="cuda", dtype=dtype)
                gemm_ws.launch(a, b, out=out, tile_order=order, block=block)
                torch.cuda.synchronize()
                got = out
                ok_sig = True
            else:
                cm = -(-m // chunks)
                out = torch.full((m, n), float("nan"), device="cuda", dtype=dtype)
                dests, counters, sig, ptrs = _hook(m, n, chunks, cm, dtype, stacked, out)
                oks = []
                for gen in (1, 2):
                    for d in dests:
                        d.fill_(float("nan"))
                    gemm_ws.launch(a, b, dests=dests, stacked=stacked, chunk_m=cm, start_chunk=start,
                                   tile_order=order, counters=counters, signal_ptrs=ptrs, generation=gen,
                                   block=block)
                    torch.cuda.synchronize()
                    oks.append(bool((sig == gen).all()) and bool((counters == 0).all()))
                got = out if stacked else torch.cat(dests)
                ok_sig = all(oks)
            err = ((got.float() - ref).norm() / ref.norm()).item()
            ok = err < 1e-2 and ok_sig and not torch.isnan(got).any().item()
            print(f"{'ok ' if ok else 'BAD'} {tag}: rel err {err:.2e} signals/counters {'ok' if ok_sig else 'WRONG'}",
                  flush=True)
            bad += not ok
        except Exception as e:   # report and go on: one broken case should not hide the rest
            print(f"BAD {tag}: {type(e).__name__}: {e}", flush=True)
            bad += 1
    return bad


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--bench", default=str(ROOT / "benchmarks/results/gemm_core_h200.json"))
    ap.add_argument("--phases", nargs="+", default=["train", "prefill"])
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--chunks", type=int, default=8)
    ap.add_argument("--only", nargs="*", default=[])
    ap.add_argument("--blocks", nargs="+", default=["128x256x64:3"], help="Gluon tiles BMxBNxBK:stages")
    ap.add_argument("--diag", nargs="*", type=int, default=[],
                    help="also the first block's hook with pieces left out (gemm_ws diag: 1 no count, "
                         "2 no publication, 3 red count, 4 no proxy fence); signals are not all set then")
    ap.add_argument("--no-check", action="store_true")
    ap.add_argument("--plain", action="store_true",
                    help="no hooks: the benchmark's plain call (ours, grouped) against the Gluon kernel's "
                         "--blocks and cuBLAS")
    ap.add_argument("--wait", action="store_true",
                    help="the wait hook (signals pre-set), round order: gemm_kernel alone (round) and the Gluon "
                         "kernel alone (ws_round) and with the hook (ws_wait), in the tile gemm_core would take")
    ap.add_argument("--no-time", action="store_true")
    args = ap.parse_args(argv)
    bad = 0 if args.no_check else check()
    if args.no_time:
        return 1 if bad else 0
    rows = [r for r in json.loads(Path(args.bench).read_text())["rows"] if r.get("phase") in args.phases]
    summary = []
    for r in rows:
        if args.only and r["name"] not in args.only:
            continue
        m, n, k, cfg = r["m"], r["n"], r["k"], gc.GemmConfig(**r["config"])
        a = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        b = (torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k ** 0.5).t()
        out = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
        cm = -(-m // args.chunks)
        dests, counters, sig, ptrs = _hook(m, n, args.chunks, cm, torch.bfloat16)
        epi = gc.EpilogueSpec.from_tensors(dests, sig, 7, cm)
        fns = {"cublas": lambda: torch.matmul(a, b, out=out),
               "owner": lambda: gc.matmul(a, b, out=out, config=cfg, tile_order="owner", start_chunk=1, chunk_m=cm),
               "epi": lambda: gc.matmul(a, b, config=cfg, tile_order="owner", start_chunk=1, epilogue=epi)}
        for spec in args.blocks:
            tiles, stages = spec.split(":")
            blk = tuple(int(x) for x in tiles.split("x"))
            fns[f"ws{spec}"] = lambda blk=blk, st=int(stages): gemm_ws.launch(
                a, b, out=out, tile_order="owner", chunk_m=cm, start_chunk=1, block=blk, stages=st)
            fns[f"ws_epi{spec}"] = lambda blk=blk, st=int(stages): gemm_ws.launch(
                a, b, dests=dests, chunk_m=cm, start_chunk=1, tile_order="owner", counters=counters,
                signal_ptrs=ptrs, generation=7, block=blk, stages=st)
        blk0, st0 = args.blocks[0].split(":")
        for dg in args.diag:
            fns[f"diag{dg}"] = lambda dg=dg, blk=tuple(int(x) for x in blk0.split("x")), st=int(st0): gemm_ws.launch(
                a, b, dests=dests, chunk_m=cm, start_chunk=1, tile_order="owner", counters=counters,
                signal_ptrs=ptrs, generation=7, block=blk, stages=st, diag=dg)
        if args.wait:
            wsig = torch.full((args.chunks,), 7, dtype=torch.int32, device="cuda")
            werr = gc.new_error_word("cuda")   # not `err`: the check below takes that name
            blk, st = gc._ws_choice(a.device, a.dtype, cfg, None, object(), 0, True, m, n,
                                    gc._num_programs(a.device), out_tma=True) or ((128, 256, 64), 3)
            common = dict(out=out, tile_order="round", chunk_m=cm, start_chunk=1, block=blk, stages=st)
            fns = {"cublas": fns["cublas"],
                   "round": lambda: gc.matmul(a, b, out=out, config=cfg, tile_order="round", start_chunk=1, chunk_m=cm),
                   "ws_round": lambda: gemm_ws.launch(a, b, **common)}
            fns["ws_wait"] = lambda: gemm_ws.launch(a, b, wait_signal=wsig, wait_gen=7, wait_timeout_ns=10**9,
                                                    err=werr, **common)
        if args.plain:
            fns = {"cublas": fns["cublas"], "ours": lambda: gc.matmul(a, b, out=out, config=cfg)}
            for spec in args.blocks:
                tiles, stages = spec.split(":")
                fns[f"ws{spec}"] = lambda blk=tuple(int(x) for x in tiles.split("x")), st=int(stages): gemm_ws.launch(
                    a, b, out=out, block=blk, stages=st)
        ref = torch.matmul(a, b).float()
        for name, fn in fns.items():
            out.fill_(float("nan"))
            sig.zero_()
            fn()
            torch.cuda.synchronize()
            got = torch.cat(dests) if "epi" in name or "diag" in name else out
            err = ((got.float() - ref).norm() / ref.norm()).item()
            counters.zero_()   # the diagnostics leave counts behind
            if err > 2e-2 or ("epi" in name and not bool((sig == 7).all())):
                print(f"BAD {r['name']} {name}: rel err {err:.2e} signals {sig.tolist()}", flush=True)
                bad += 1
        t = {name: [] for name in fns}
        for rd in range(args.rounds):
            for name in (list(fns) if rd % 2 == 0 else list(fns)[::-1]):
                t[name].append(graph_ms(fns[name]))
        med = {name: statistics.median(v) * 1e3 for name, v in t.items()}

        def rel(x, y):
            return 100 * (statistics.median(p / q for p, q in zip(t[x], t[y])) - 1)
        if args.wait:
            gc.check_error_word(werr)
            summary.append((r["name"], {"ws_round/round": rel("ws_round", "round"),
                                        "ws_wait/ws_round": rel("ws_wait", "ws_round"),
                                        "ws_wait/round": rel("ws_wait", "round"),
                                        "cublas/round": rel("cublas", "round")}))
            print(f"{r['name']} {m}x{n}x{k} [{blk}:{st}]: " + "  ".join(f"{nm} {v:.1f} us" for nm, v in med.items()),
                  flush=True)
            continue
        if args.plain:   # cuBLAS time over each one's: the benchmark's ratio
            summary.append((r["name"], {f"cublas/{nm}": rel("cublas", nm) for nm in fns if nm != "cublas"}))
            print(f"{r['name']} {m}x{n}x{k} [{r['config']}]: " + "  ".join(f"{nm} {v:.1f} us" for nm, v in med.items()),
                  flush=True)
            continue
        cols = {"epi/owner": rel("epi", "owner")}
        for spec in args.blocks:
            cols[f"ws{spec}/owner"] = rel(f"ws{spec}", "owner")
            cols[f"ws_epi{spec}/owner"] = rel(f"ws_epi{spec}", "owner")
            cols[f"ws_epi{spec}/ws"] = rel(f"ws_epi{spec}", f"ws{spec}")
        for dg in args.diag:
            cols[f"diag{dg}/ws"] = rel(f"diag{dg}", f"ws{args.blocks[0]}")
        cols["owner/cublas"] = rel("owner", "cublas")
        summary.append((r["name"], cols))
        print(f"{r['name']} {m}x{n}x{k} [{r['config']}]: " + "  ".join(f"{nm} {v:.1f} us" for nm, v in med.items()),
              flush=True)
    if summary:
        names = list(summary[0][1])
        print("median of paired rounds, % (positive: the first is slower)")
        print(f"{'shape':22s}" + "".join(f"{nm:>24s}" for nm in names))
        for label, cols in summary:
            print(f"{label:22s}" + "".join(f"{cols[nm]:+23.1f}%" for nm in names))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
