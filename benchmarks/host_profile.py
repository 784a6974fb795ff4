"""Where the host time of one ``tpfuse.gemm.matmul`` call goes (GPU never the bottleneck).

    python3 benchmarks/host_profile.py [--calls N]
    python3 benchmarks/host_profile.py --bed 2 [--m 2048 --n 1536 --k 2048 --calls 40]   # MPS first

Times N calls of a 64x64x64 bf16 GEMM (ours and ``torch.matmul``), then profiles ours with
cProfile and prints the functions with the most own time. Needs a CUDA GPU.

``--bed W`` (issue 34.4): W processes on cuda:0 (the one-GPU bed, as ``python -m tpfuse.bench.host
--bed W``); rank 0 cProfiles N eager calls of every op x {copy_engine, fused} with 60 ms of GPU
work queued ahead (so the host never waits) and prints, per op and strategy, the host us per
call and the functions with the most own time.
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
    ap.add_argument("--bed", type=int, default=0, metavar="W", help="profile eager op calls in the one-GPU bed")
    ap.add_argument("--m", type=int, default=2048)
    ap.add_argument("--n", type=int, default=1536)
    ap.add_argument("--k", type=int, default=2048)
    ap.add_argument("--top", type=int, default=30)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        ap.error("needs a CUDA GPU")
    if args.bed:
        from tpfuse.bench import common

        if args.calls == 2000:   # the default of the GEMM profile: within 60 ms of queued GPU work, 40
            args.calls = 40

        with common.open_ranks(common.plan_ranks(args.bed, "cuda", args.bed)) as ranks:
            print(ranks.run(_bed_profile, args, timeout=1800)[0])
        return 0
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


def _bed_profile(rank: int, world_size: int, args) -> str:
    """cProfile of ``args.calls`` eager calls per op x strategy on every rank (all ranks must
    call), rank 0's report; the GPU is kept busy ahead so that no call waits for it."""
    import torch.distributed as dist

    import tpfuse
    from tpfuse.bench.host import _sleep_cycles_per_ms

    dev = torch.device("cuda", torch.cuda.current_device())
    cycles = _sleep_cycles_per_ms()
    report = []
    with torch.no_grad():
        for op in ("ag_gemm", "gemm_rs", "gemm_ar"):
            a = torch.randn(args.m // world_size if op == "ag_gemm" else args.m, args.k, device=dev, dtype=torch.bfloat16)
            b = torch.randn(args.n, args.k, device=dev, dtype=torch.bfloat16).t()
            fn = getattr(tpfuse, op)
            for strategy in ("copy_engine", "fused"):
                for _ in range(5):
                    fn(a, b, strategy=strategy)
                torch.cuda.synchronize()
                dist.barrier()
                torch.cuda._sleep(int(60 * cycles))
                prof = cProfile.Profile()
                t = time.perf_counter()
                prof.enable()
                for _ in range(args.calls):
                    fn(a, b, strategy=strategy)
                prof.disable()
                us = (time.perf_counter() - t) / args.calls * 1e6
                torch.cuda.synchronize()
                tpfuse.synchronize()
                dist.barrier()
                s = io.StringIO()
                pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(args.top)
                report.append(f"### {op} {strategy} W={world_size} rank {rank}: {us:.0f} us/call under cProfile "
                              f"(GPU busy ahead)\n{s.getvalue()}")
    return "\n".join(report)


if __name__ == "__main__":
    raise SystemExit(main())
