"""What a release fence costs one warp on this GPU: ``fence.acq_rel.gpu`` against
``fence.acq_rel.sys``, right after the CTA stored a tile's worth of data (as the epilogue hook's
publication does), with every CTA of a full grid fencing at once or a single CTA alone.

    python3 benchmarks/probe_fence.py [--kb 64] [--ctas 132] [--reps 20]

Per CTA, thread 0 reads ``%clock64`` around the fence; the table gives the median and the max
over CTAs of the fence's SM cycles. A diagnostic
(docs/gemm_core.md, "Epilogue hook"); needs a GPU.
"""
from __future__ import annotations

import argparse
import statistics
import sys

import torch
import triton
import triton.language as tl

FENCES = {"none": "", "gpu": "fence.acq_rel.gpu;", "sys": "fence.acq_rel.sys;"}


@triton.jit
def _fence_kernel(buf, out, ELEMS: tl.constexpr, BLOCK: tl.constexpr, FENCE: tl.constexpr):
    pid = tl.program_id(0)
    base = buf + pid.to(tl.int64) * ELEMS
    for i in range(0, ELEMS, BLOCK):
        offs = i + tl.arange(0, BLOCK)
        tl.store(base + offs, (offs + pid).to(tl.int32))
    tl.debug_barrier()
    # one thread times the fence (the asm runs per element; pack=1 and a scalar operand keep it
    # to one instruction per thread, and only the value of the first thread is kept)
    t = tl.inline_asm_elementwise(
        "{\n\t.reg .u64 t0, t1;\n\tmov.u64 t0, %clock64;\n\t" + FENCE
        + "\n\tmov.u64 t1, %clock64;\n\tsub.u64 $0, t1, t0;\n\t}",
        "=l,r", [pid], dtype=tl.int64, is_pure=False, pack=1)
    tl.store(out + pid, t)


def fence_cycles(kind: str, kb: int, ctas: int, reps: int) -> list[int]:
    elems = kb * 1024 // 4
    buf = torch.empty(ctas * elems, dtype=torch.int32, device="cuda")
    out = torch.zeros(ctas, dtype=torch.int64, device="cuda")
    samples = []
    for _ in range(reps):
        _fence_kernel[(ctas,)](buf, out, ELEMS=elems, BLOCK=1024, FENCE=FENCES[kind], num_warps=4)
        torch.cuda.synchronize()
        samples.extend(out.tolist())
    return samples


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--kb", type=int, default=64, help="KB each CTA stores before its fence")
    ap.add_argument("--ctas", type=int, default=torch.cuda.get_device_properties(0).multi_processor_count
                    if torch.cuda.is_available() else 132)
    ap.add_argument("--reps", type=int, default=20)
    args = ap.parse_args(argv)
    print(f"{'fence':6s} {'ctas':>5s} {'median cycles':>14s} {'max cycles':>11s}")
    for ctas in (1, args.ctas):
        for kind in FENCES:
            c = fence_cycles(kind, args.kb, ctas, args.reps)
            print(f"{kind:6s} {ctas:5d} {statistics.median(c):14.0f} {max(c):11d}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
