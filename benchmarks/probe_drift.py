"""Do timings drift under sustained load, and with what? Our kernel (one or more configs) and
cuBLAS on one shape, timed in interleaved rounds (CUDA-graph replays, L2 flushed before each
call) for ``--seconds``, with the GPU's SM clock, power draw, temperature and active clock
throttle reasons read by ``nvidia-smi`` after every round.

    python3 benchmarks/probe_drift.py [--shape 512,13312,16384] [--seconds 60] \
        [--configs 128x256x64:num_stages=3,flatten=true 128x128x64:num_stages=4,stream_k=1]

Prints one line per round (times in us, ours/cuBLAS ratios, the GPU readings). A diagnostic;
config specs as in benchmarks/profile_kernels.py.
"""
from __future__ import annotations

import argparse
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
for p in (ROOT, ROOT / "benchmarks"):
    if str(p) not in sys.path:
        sys.path.insert(0, str(p))

from tpfuse import gemm_core as gc  # noqa: E402
from gemm_core import Shape, capture_graphs, make_inputs  # noqa: E402
from profile_kernels import parse_spec  # noqa: E402

QUERIES = ("clocks.sm,power.draw,temperature.gpu,clocks_event_reasons.active",
           "clocks.sm,power.draw,temperature.gpu,clocks_throttle_reasons.active",   # older drivers
           "clocks.sm,power.draw,temperature.gpu")


def gpu_readings(query: str) -> str:
    try:
        r = subprocess.run(["nvidia-smi", f"--query-gpu={query}", "--format=csv,noheader"],
                           capture_output=True, text=True, timeout=10)
        return r.stdout.strip() if r.returncode == 0 else ""
    except (OSError, subprocess.SubprocessError):
        return ""


def main(argv=None) -> int:
    import triton
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="512,13312,16384")
    ap.add_argument("--configs", nargs="+",
                    default=["128x256x64:num_stages=3,flatten=true", "128x128x64:num_stages=4,stream_k=1"])
    ap.add_argument("--seconds", type=float, default=60)
    ap.add_argument("--rep", type=int, default=20)
    args = ap.parse_args(argv)
    m, n, k = (int(x) for x in args.shape.split(","))
    sets = make_inputs(Shape(args.shape, "probe", m, n, k), torch.bfloat16)
    fns = {"cublas": lambda a, b, c: torch.matmul(a, b, out=c)}
    for spec in args.configs:
        cfg = parse_spec(spec)
        fns[spec] = lambda a, b, c, cfg=cfg: gc.matmul(a, b, out=c, config=cfg)
    ref = torch.matmul(sets[0][0], sets[0][1]).float()
    for name, fn in fns.items():   # correct before timed
        c = sets[0][2]
        c.fill_(float("nan"))
        fn(*sets[0])
        err = ((c.float() - ref).norm() / ref.norm()).item()
        if not err < 2e-2:
            raise SystemExit(f"{name}: relative error {err}")
    steps = {name: capture_graphs(fn, sets) for name, fn in fns.items()}
    names = list(fns)
    query = next((q for q in QUERIES if gpu_readings(q)), "")
    print(f"{m}x{n}x{k}, {len(sets)} input set(s); columns: " + ", ".join(names) + f"; ratios cublas/ours; {query}")
    t0 = time.time()
    rd = 0
    while time.time() - t0 < args.seconds:
        us = {}
        for name in (names if rd % 2 == 0 else names[::-1]):
            us[name] = 1e3 * triton.testing.do_bench(steps[name][0], warmup=5, rep=args.rep, return_mode="median")
        ratios = " ".join(f"{us['cublas'] / us[nm]:.3f}" for nm in names[1:])
        print(f"[{time.time() - t0:5.1f}s] " + " ".join(f"{us[nm]:7.1f}" for nm in names) + f" | {ratios} | "
              + (gpu_readings(query) if query else "no nvidia-smi readings"), flush=True)
        rd += 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
