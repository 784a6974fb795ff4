"""Cost of the epilogue hook alone: owner tile order with and without the hook, interleaved
CUDA-graph timings (L2 flushed before each call), for a few shapes. The hook runs twice: as
``matmul`` picks it (TMA stores, one descriptor per destination, when it can) and with pointer
stores (the spec without its ``dests``). A diagnostic; needs a GPU.

    python3 benchmarks/probe_epilogue.py [--rounds 7] [--config 128x256x64:num_stages=3]
"""
from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
for p in (ROOT, ROOT / "benchmarks"):
    if str(p) not in sys.path:
        sys.path.insert(0, str(p))

from tpfuse import gemm_core as gc  # noqa: E402
from profile_kernels import graph_ms, parse_spec  # noqa: E402

SHAPES = ((16384, 4096, 1792), (4096, 3584, 4096), (16384, 8192, 3584), (2048, 4096, 1792))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--config", default="128x256x64")
    ap.add_argument("--chunks", type=int, default=8)
    ap.add_argument("--epi-config", default="", help="config of the hooked call (default: --config)")
    args = ap.parse_args(argv)
    cfg = parse_spec(args.config)
    epi_cfg = parse_spec(args.epi_config) if args.epi_config else cfg
    for m, n, k in SHAPES:
        a = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        b = (torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k ** 0.5).t()
        out = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
        chunk_m = -(-m // args.chunks)
        dests = [out[c * chunk_m:(c + 1) * chunk_m] for c in range(args.chunks)]
        sig = torch.zeros(args.chunks, dtype=torch.int32, device="cuda")
        epi = gc.EpilogueSpec.from_tensors(dests, sig, 7, chunk_m)
        epi_ptr = dataclasses.replace(epi, dests=())   # no descriptors: pointer stores
        ref = torch.matmul(a, b)
        fns = {"owner": lambda: gc.matmul(a, b, out=out, config=cfg, tile_order="owner", start_chunk=1,
                                          chunk_m=chunk_m),
               "owner+epi": lambda: gc.matmul(a, b, config=epi_cfg, tile_order="owner", start_chunk=1,
                                              epilogue=epi),
               "owner+epi_ptr": lambda: gc.matmul(a, b, config=epi_cfg, tile_order="owner", start_chunk=1,
                                                  epilogue=epi_ptr)}
        for name, fn in fns.items():
            out.fill_(float("nan"))
            sig.zero_()
            fn()
            torch.cuda.synchronize()
            err = ((out.float() - ref.float()).norm() / ref.float().norm()).item()
            assert err < 2e-2, (name, err)
            if name != "owner":
                assert bool((sig == 7).all()), sig.tolist()
        t = {name: [] for name in fns}
        for r in range(args.rounds):
            for name in (list(fns) if r % 2 == 0 else list(fns)[::-1]):
                t[name].append(graph_ms(fns[name]))
        over = {name: statistics.median(e / o for e, o in zip(t[name], t["owner"])) - 1
                for name in ("owner+epi", "owner+epi_ptr")}
        print(f"{m}x{n}x{k} {args.config} / {args.epi_config or args.config}: owner {statistics.median(t['owner']) * 1e3:8.1f} us  "
              f"owner+epi {statistics.median(t['owner+epi']) * 1e3:8.1f} us  hook {100 * over['owner+epi']:+.1f} %  "
              f"(pointer stores {statistics.median(t['owner+epi_ptr']) * 1e3:8.1f} us  "
              f"{100 * over['owner+epi_ptr']:+.1f} %)", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
