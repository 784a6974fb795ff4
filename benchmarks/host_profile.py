"""Where the host time of one ``tpfuse.gemm.matmul`` call goes (GPU never the bottleneck).

    python3 benchmarks/host_profile.py [--calls N]

Times N calls of a 64x64x64 bf16 GEMM (ours and ``torch.matmul``), then profiles ours with
cProfile and prints the functions with the most own time. Needs a CUDA GPU.
"""
from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1] / "src"
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from tpfuse import gemm as gc  # noqa: E402


def per_call_us(fn, n: int) -> float:
    for _ in range(50):
        fn()
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(n):
        fn()
    dt = time.perf_counter() - t
    torch.cuda.synchronize()
    return dt / n * 1e6


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--calls", type=int, default=2000)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        ap.error("needs a CUDA GPU")
    a = torch.randn(64, 64, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(64, 64, device="cuda", dtype=torch.bfloat16)
    out = torch.empty(64, 64, device="cuda", dtype=torch.bfloat16)
    cfg = gc.GemmConfig(BLOCK_M=64, BLOCK_N=64, BLOCK_K=64, num_warps=4, num_stages=3)
    ours = lambda: gc.matmul(a, w.t(), out=out, config=cfg)  # noqa: E731
    torch_mm = lambda: torch.matmul(a, w.t(), out=out)  # noqa: E731
    empty = torch.empty(0, device="cuda")
    print(f"per call: ours {per_call_us(ours, args.calls):.1f} us, torch.matmul "
          f"{per_call_us(torch_mm, args.calls):.1f} us, torch.empty(0) {per_call_us(lambda: torch.empty(0, device='cuda'), args.calls):.1f} us, "
          f"tensor.zero_ {per_call_us(lambda: empty.zero_(), args.calls):.1f} us")
    if torch.cuda.get_device_capability()[0] == 9:   # the Gluon kernel's wait hook (tpfuse.gemm.launch.ws_choice)
        big = gc.GemmConfig(BLOCK_M=128, BLOCK_N=256, BLOCK_K=64, num_warps=8, num_stages=3)
        a2 = torch.randn(256, 64, device="cuda", dtype=torch.bfloat16)
        w2 = torch.randn(256, 64, device="cuda", dtype=torch.bfloat16)
        out2 = torch.empty(256, 256, device="cuda", dtype=torch.bfloat16)
        wait = gc.WaitSpec(torch.ones(2, dtype=torch.int32, device="cuda"), 1, 128,
                           error=gc.new_error_word("cuda"))
        got = {}
        for direct in (True, False):
            opts = gc.GemmOptions(direct_launch=direct)
            got["1" if direct else "0"] = per_call_us(
                lambda: gc.matmul(a2, w2.t(), out=out2, config=big, wait=wait, check=False, options=opts), args.calls)
        gc.check_error_word(wait.error)
        assert gc.last_plan().kernel == "gemm_ws_kernel", gc.last_plan().explain()
        print(f"per call, the Gluon kernel's wait hook (256x256x64): direct launch {got['1']:.1f} us, "
              f"Triton's JIT launch {got['0']:.1f} us")
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(args.calls):
        ours()
    prof.disable()
    torch.cuda.synchronize()
    s = io.StringIO()
    pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(25)
    print(s.getvalue())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
