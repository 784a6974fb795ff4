"""One-off probe (2026-11-30): (A) does cuBLAS time depend on the data's scale (randn weights as
in calibrate_gemm vs randn/sqrt(k) as in gemm_core.py)? (B) stream-K vs data-parallel kernel
time on two shapes. Prints a table; needs a GPU."""
import dataclasses
import math
import sys
from pathlib import Path

import torch
import triton.testing

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))
from tpfuse import gemm_core as gc  # noqa: E402
import gemm_core as gb  # noqa: E402


def measure(m, n, k, scale, kind):
    g = torch.Generator(device="cuda").manual_seed(m + n + k)
    sets = []
    for _ in range(4):
        a = torch.randn(m, k, device="cuda", dtype=torch.bfloat16, generator=g)
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16, generator=g)
        if kind == "uniform":
            w = torch.rand(n, k, device="cuda", dtype=torch.bfloat16, generator=g)
        sets.append((a, (w * scale).t()))
    out = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
    i = [0]

    def fn():
        a, b = sets[i[0] % 4]
        i[0] += 1
        torch.matmul(a, b, out=out)
    return triton.testing.do_bench(fn, warmup=10, rep=40, return_mode="median")


print("A: cuBLAS ms by weight data (3 interleaved passes, median)")
shapes = [(2048, 3584, 4096), (1024, 7168, 4096), (4096, 28672, 8192), (128, 26624, 16384), (16, 4096, 1792)]
variants = [("randn", 1.0, "normal"), ("randn/sqrt(k)", None, "normal"), ("rand[0,1)", 1.0, "uniform")]
res = {}
for p in range(3):
    for (m, n, k) in shapes:
        for name, sc, kind in variants:
            res.setdefault((m, n, k, name), []).append(measure(m, n, k, sc if sc else 1 / math.sqrt(k), kind))
for (m, n, k) in shapes:
    row = [f"{m}x{n}x{k}"]
    for name, _, _ in variants:
        t = sorted(res[(m, n, k, name)])[1]
        row.append(f"{name} {t * 1e3:8.1f} us ({2 * m * n * k / t / 1e9:5.0f} TF)")
    print("  " + " | ".join(row))

print("B: ours, CUDA-graph median us")
for (m, n, k) in [(512, 3584, 4096), (2048, 7168, 8192), (128, 3584, 4096)]:
    s = gb.Shape("probe", "probe", m, n, k)
    sets = gb.make_inputs(s, torch.bfloat16)
    bases = [gc.GemmConfig(BLOCK_M=128, BLOCK_N=128, BLOCK_K=128, num_warps=8, num_stages=3),
             gc.GemmConfig(BLOCK_M=128, BLOCK_N=256, BLOCK_K=64, num_warps=8, num_stages=3, EPI_SUBTILE=2)]
    if m <= 256:
        bases = [gc.GemmConfig(BLOCK_M=64, BLOCK_N=64, BLOCK_K=256, num_warps=4, num_stages=3)]
    line = [f"{m}x{n}x{k}"]
    for base in bases:
        for mode, flat in ((0, False), (1, False), (1, True)):
            cfg = dataclasses.replace(base, stream_k=mode, flatten=flat)
            fn = lambda a, b, c, cfg=cfg: gc.matmul(a, b, out=c, config=cfg)  # noqa: E731
            t = gb.graph_bench(fn, sets, 30)
            line.append(f"{base.BLOCK_M}x{base.BLOCK_N}x{base.BLOCK_K} sk{mode}{'f' if flat else ''} {t * 1e3:.1f}")
    print("  " + " | ".join(line))
