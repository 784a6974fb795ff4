"""Does the input set change a timing? Our kernel and cuBLAS on the benchmark's input sets
(``gemm_core.make_inputs``: enough copies to exceed L2, rotated), each set alone and rotated as
the benchmark does, in interleaved rounds of CUDA-graph replays (L2 flushed before each call).

    python3 benchmarks/probe_sets.py [--shapes 512,7168,8192 512,3584,4096] [--rounds 5] [--sets 4]

Prints per shape and variant the median time over rounds, each set's data pointers modulo 2 MiB
(where an allocation starts within a large page), and ours/cuBLAS per set. A diagnostic; the
config is the benchmark JSON's for the shape (``--bench``) or the default.
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
from gemm_core import Shape, capture_graphs, make_inputs  # noqa: E402


def main(argv=None) -> int:
    import triton
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", nargs="+", default=["512,7168,8192", "512,13312,16384", "512,3584,4096"])
    ap.add_argument("--bench", default=str(ROOT / "benchmarks/results/gemm_core_h200.json"))
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--sets", type=int, default=0, help="input sets (0: as the benchmark makes them)")
    ap.add_argument("--rep", type=int, default=20)
    args = ap.parse_args(argv)
    rows = json.loads(Path(args.bench).read_text())["rows"] if Path(args.bench).exists() else []
    for spec in args.shapes:
        m, n, k = (int(x) for x in spec.split(","))
        cfgs = [r["config"] for r in rows if (r["m"], r["n"], r["k"]) == (m, n, k)]
        cfg = gc.GemmConfig(**cfgs[0]) if cfgs else gc.default_config(m, n, k)
        sets = make_inputs(Shape(spec, "probe", m, n, k), torch.bfloat16)
        while len(sets) < args.sets:
            sets += make_inputs(Shape(spec, "probe", m, n, k), torch.bfloat16)
        if args.sets:
            sets = sets[:args.sets]
        fns = {"ours": lambda a, b, c: gc.matmul(a, b, out=c, config=cfg),
               "cublas": lambda a, b, c: torch.matmul(a, b, out=c)}
        steps = {}
        for name, fn in fns.items():
            for i, st in enumerate(sets):
                steps[f"{name}[{i}]"] = capture_graphs(fn, [st])
            steps[f"{name}[rot]"] = capture_graphs(fn, sets)
        t = {key: [] for key in steps}
        keys = list(steps)
        for rd in range(args.rounds):
            for key in (keys if rd % 2 == 0 else keys[::-1]):
                t[key].append(triton.testing.do_bench(steps[key][0], warmup=5, rep=args.rep, return_mode="median"))
        med = {key: statistics.median(v) * 1e3 for key, v in t.items()}
        print(f"{m}x{n}x{k} config {cfg.to_dict()}")
        for i, (a, b, c) in enumerate(sets):
            offs = [x.data_ptr() % (2 << 20) for x in (a, b, c)]
            print(f"  set {i}: a/b/c at +{offs} within 2 MiB; ours {med[f'ours[{i}]']:.1f} us, cublas "
                  f"{med[f'cublas[{i}]']:.1f} us, ratio {med[f'cublas[{i}]'] / med[f'ours[{i}]']:.3f}")
        print(f"  rotated: ours {med['ours[rot]']:.1f} us, cublas {med['cublas[rot]']:.1f} us, "
              f"ratio {med['cublas[rot]'] / med['ours[rot]']:.3f}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
