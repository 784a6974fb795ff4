"""Cost of the epilogue hook alone: the owner tile order with and without the hook, interleaved
CUDA-graph timings (L2 flushed before each call). The hook runs in several variants: as
``matmul`` picks it for one destination tensor per chunk (as peer buffers are: TMA stores
through one descriptor per destination where it can, per-tile count at GPU scope that returns
nothing, one poller per chunk), with the chunks of one tensor as destinations (``epi_stacked``:
one descriptor for all), with the count after the next tile's main loop instead of inside it
(``epi_count_after``: ``TPFUSE_EPI_COUNT=epilogue``), with the returning count read
at once (``TPFUSE_EPI_COUNT=gpu``), at system scope (``=sys``), with no
count at all (``=none``: stores only, no signal published), with one chunk (one destination,
but also another tile order than the 8-chunk baseline), and with pointer stores (the spec
without its ``dests``). A diagnostic; needs a GPU.

    python3 benchmarks/probe_epilogue.py [--rounds 7] [--config 128x256x64:num_stages=3] [--shapes M,N,K ...]
    python3 benchmarks/probe_epilogue.py --bench benchmarks/results/gemm_core_h200.json --phases train prefill
    ncu ... python3 benchmarks/probe_epilogue.py --bench ... --only 8B-fc2-prefill --once

With ``--bench`` each shape (rows of those phases) runs with the config that benchmark chose.
``--wait`` adds the round order and the wait hook (signals pre-set) against it; ``--noflat``
adds a twin of every kernel with the config's ``flatten`` off (name + ``~``, compared with the
flattened one), to see what the flattened tile loop buys in one run.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys
from pathlib import Path
from unittest import mock

import torch

ROOT = Path(__file__).resolve().parents[1]
for p in (ROOT, ROOT / "benchmarks"):
    if str(p) not in sys.path:
        sys.path.insert(0, str(p))

from tpfuse import gemm_core as gc  # noqa: E402
from profile_kernels import graph_ms, parse_spec  # noqa: E402

SHAPES = ((16384, 4096, 1792), (4096, 3584, 4096), (16384, 8192, 3584), (2048, 4096, 1792))
# name -> (chunks: None = --chunks, environment, pointer stores, stacked destinations)
VARIANTS = {"epi": (None, {}, False, False),
            "epi_stacked": (None, {}, False, True),
            "epi_count_after": (None, {"TPFUSE_EPI_COUNT": "epilogue"}, False, False),
            "epi_gpu_count": (None, {"TPFUSE_EPI_COUNT": "gpu"}, False, False),
            "epi_sys_count": (None, {"TPFUSE_EPI_COUNT": "sys"}, False, False),
            "epi_no_count": (None, {"TPFUSE_EPI_COUNT": "none"}, False, False),   # publishes nothing
            "epi_1chunk": (1, {}, False, False),
            "epi_ptr": (None, {}, True, False)}


def _with_env(env: dict, fn):
    """fn run with ``env`` set (plans are keyed by these variables, so each gets its own)."""
    def call():
        with mock.patch.dict(os.environ, env):
            return fn()
    return call


def _cases(args):
    """(m, n, k, config, label) per shape."""
    if not args.bench:
        cfg = parse_spec(args.config)
        shapes = [tuple(int(x) for x in sh.split(",")) for sh in args.shapes] if args.shapes else SHAPES
        return [(m, n, k, cfg, args.config) for m, n, k in shapes]
    rows = json.loads(Path(args.bench).read_text())["rows"]
    return [(r["m"], r["n"], r["k"], gc.GemmConfig(**r["config"]), r["name"])
            for r in rows if r.get("phase") in args.phases]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--config", default="128x256x64")
    ap.add_argument("--bench", help="a benchmarks/gemm_core.py JSON: its shapes and chosen configs")
    ap.add_argument("--shapes", nargs="*", default=[], metavar="M,N,K",
                    help="without --bench: these shapes (default: four training/prefill ones) with --config")
    ap.add_argument("--phases", nargs="+", default=["train", "prefill"])
    ap.add_argument("--chunks", type=int, default=8)
    ap.add_argument("--variants", nargs="+", default=["epi", "epi_gpu_count", "epi_no_count", "epi_ptr"],
                    choices=list(VARIANTS))
    ap.add_argument("--once", action="store_true",
                    help="run each variant once after a warm-up and time nothing (for ncu)")
    ap.add_argument("--only", nargs="*", default=[], help="labels (or MxNxK) of the shapes to run")
    ap.add_argument("--wait", action="store_true", help="also the round order and the wait hook on it")
    ap.add_argument("--noflat", action="store_true", help="also every kernel with flatten off")
    args = ap.parse_args(argv)
    summary = []
    for m, n, k, cfg, label in _cases(args):
        if args.only and label not in args.only and f"{m}x{n}x{k}" not in args.only:
            continue
        a = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        b = (torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k ** 0.5).t()
        out = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
        ref = torch.matmul(a, b)
        chunk_m = -(-m // args.chunks)
        sigs = {}
        sep = {}   # chunks -> separate destination tensors
        wsig = torch.full((args.chunks,), 7, dtype=torch.int32, device="cuda")
        wait = gc.WaitSpec(wsig, 7, chunk_m, timeout_ns=5_000_000_000, error=gc.new_error_word("cuda"))

        def kernels(cfg, tag=""):
            fns = {"owner" + tag: lambda: gc.matmul(a, b, out=out, config=cfg, tile_order="owner",
                                                    start_chunk=1, chunk_m=chunk_m)}
            for name in args.variants:
                chunks, env, pointer, stacked = VARIANTS[name]
                chunks = chunks or args.chunks
                cm = -(-m // chunks)
                sig = sigs.setdefault(name, torch.zeros(chunks, dtype=torch.int32, device="cuda"))
                # one allocation per chunk, as peer buffers are (checked against ``out`` after
                # copying back), or chunks of ``out`` itself (stacked: one TMA descriptor)
                if not stacked and chunks not in sep:
                    sep[chunks] = [torch.empty(min(cm, m - c * cm), n, device="cuda", dtype=torch.bfloat16)
                                   for c in range(chunks)]
                dests = [out[c * cm:(c + 1) * cm] for c in range(chunks)] if stacked else sep[chunks]
                epi = gc.EpilogueSpec.from_tensors(dests, sig, 7, cm)
                if pointer:
                    epi = dataclasses.replace(epi, dests=())
                fns[name + tag] = _with_env(env, lambda epi=epi, chunks=chunks: gc.matmul(
                    a, b, config=cfg, tile_order="owner", start_chunk=min(1, chunks - 1), epilogue=epi))
            if args.wait:
                fns["round" + tag] = lambda: gc.matmul(a, b, out=out, config=cfg, tile_order="round",
                                                       start_chunk=1, chunk_m=chunk_m)
                fns["wait" + tag] = lambda: gc.matmul(a, b, out=out, config=cfg, tile_order="round",
                                                      start_chunk=1, wait=wait, check=False)
            return fns

        fns = kernels(cfg)
        # each kernel against its base: the hooks against their tile order alone, and with
        # --noflat the nested twin against the flattened kernel
        pairs = {name: "owner" for name in args.variants}
        if args.wait:
            pairs["wait"] = "round"
        if args.noflat and cfg.flatten:
            twins = kernels(dataclasses.replace(cfg, flatten=False), "~")
            pairs.update({name: name[:-1] for name in twins})
            fns.update(twins)
        for name, fn in fns.items():
            out.fill_(float("nan"))
            base = name.rstrip("~")
            separate = base in VARIANTS and not VARIANTS[base][3]
            for d in sep[VARIANTS[base][0] or args.chunks] if separate else ():
                d.fill_(float("nan"))
            if base in sigs:
                sigs[base].zero_()
            fn()
            torch.cuda.synchronize()
            if separate:   # separate destinations: gather them
                out.copy_(torch.cat(sep[VARIANTS[base][0] or args.chunks]))
            err = ((out.float() - ref.float()).norm() / ref.float().norm()).item()
            assert err < 2e-2, (label, name, err)
            if base in sigs and VARIANTS[base][1].get("TPFUSE_EPI_COUNT") != "none":
                assert bool((sigs[base] == 7).all()), (label, name, sigs[base].tolist())
        if args.once:
            torch.cuda.synchronize()
            for fn in fns.values():
                fn()
            torch.cuda.synchronize()
            print(f"{label}: ran {', '.join(fns)} once each", flush=True)
            continue
        t = {name: [] for name in fns}
        for r in range(args.rounds):
            for name in (list(fns) if r % 2 == 0 else list(fns)[::-1]):
                t[name].append(graph_ms(fns[name]))
        over = {name: statistics.median(e / o for e, o in zip(t[name], t[base])) - 1
                for name, base in pairs.items()}
        summary.append((label, over))
        print(f"{label} {m}x{n}x{k}: " + "  ".join(f"{name} {statistics.median(t[name]) * 1e3:.1f} us"
                                                   for name in fns)
              + "  | against its base, median of paired rounds: "
              + "  ".join(f"{name} {statistics.median(e - o for e, o in zip(t[name], t[base])) * 1e3:+.2f} us"
                          for name, base in pairs.items()), flush=True)
    if args.once:
        return 0
    cols = list(dict.fromkeys(name for _, over in summary for name in over))
    print("overhead of each kernel against its base (median of paired rounds): "
          + ", ".join(f"{name} vs {name[:-1] if name.endswith('~') else ('round' if name == 'wait' else 'owner')}"
                      for name in cols))
    print(f"{'shape':24s}" + "".join(f"{name:>15s}" for name in cols))
    for label, over in summary:
        print(f"{label:24s}" + "".join(f"{100 * over[name]:+14.1f}%" if name in over else f"{'-':>15s}"
                                       for name in cols))
    return 0


if __name__ == "__main__":
    sys.exit(main())
