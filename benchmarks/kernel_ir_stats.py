"""Counts of a few ops in the compiled GEMM kernel's TTGIR, per config: is the K loop pipelined
(async TMA copies, barrier waits), how many loops. A diagnostic for one shape; needs a GPU.

    python3 benchmarks/kernel_ir_stats.py [--m 512 --n 3584 --k 4096]
"""
from __future__ import annotations

import argparse
import dataclasses
import re
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from tpfuse import gemm_core as gc  # noqa: E402

OPS = ("async_tma_copy_global_to_local", "wait_barrier", "warp_group_dot", "scf.for", "scf.if",
       "local_alloc", "tt.descriptor_load", "tt.atomic_rmw")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--m", type=int, default=512)
    ap.add_argument("--n", type=int, default=3584)
    ap.add_argument("--k", type=int, default=4096)
    args = ap.parse_args(argv)
    a = torch.randn(args.m, args.k, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(args.n, args.k, device="cuda", dtype=torch.bfloat16)
    base = gc.GemmConfig(BLOCK_M=128, BLOCK_N=128, BLOCK_K=128, num_warps=8, num_stages=3)
    for cfg in (base, dataclasses.replace(base, stream_k=1),
                dataclasses.replace(base, stream_k=1, flatten=True)):
        gc._COMPILED.clear()
        gc.matmul(a, w.t(), config=cfg)
        gc.matmul(a, w.t(), config=cfg)
        torch.cuda.synchronize()
        (kernel,) = list(gc._COMPILED.values())[-1:]
        ir = kernel.asm["ttgir"]
        counts = {op: len(re.findall(re.escape(op), ir)) for op in OPS}
        print(f"stream_k={cfg.stream_k} flatten={cfg.flatten}: "
              + ", ".join(f"{k}={v}" for k, v in counts.items())
              + f"; regs={getattr(kernel, 'n_regs', '?')} spills={getattr(kernel, 'n_spills', '?')} "
              f"smem={kernel.metadata.shared}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
