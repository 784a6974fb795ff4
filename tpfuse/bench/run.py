"""``tpfuse bench``: every runnable strategy on the workload matrix, timed on the ranks.

Per cell (one GPU per rank, NCCL; or gloo ranks on CPU): each strategy's latency, the local GEMM
alone, the collective alone (NCCL), the planner's prediction for each strategy, and what
``"auto"`` resolved to.  Timing (DESIGN §7): random data, inputs rotated over copies larger than
the L2 cache, a warm-up, then ``iters`` timed calls, each started after a barrier; per call the
slowest rank's time (CUDA events on GPU, ``perf_counter`` on CPU); the median over calls.

Writes ``{"meta": ..., "rows": [...]}`` JSON and prints a table.  Ratios quoted from it should
come from one run (the rows of one JSON).
"""

from __future__ import annotations

import datetime
import json
import math
import platform
import statistics
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable

import torch
import torch.distributed as dist

import tpfuse
from tpfuse.bench.workloads import Workload, scaled_down, workload_matrix

__all__ = ["BenchConfig", "run_bench", "format_rows"]

L2_BYTES = 60 * 2**20  # H200 (the largest L2 we run on); rotating past it on smaller GPUs is harmless


@dataclass(frozen=True)
class BenchConfig:
    world_size: int = 2
    models: tuple[str, ...] = ("8b", "70b")
    phases: tuple[str, ...] = ("training", "prefill", "decode")
    strategies: tuple[str, ...] = ("unfused", "ring", "auto")
    iters: int = 20
    warmup: int = 3
    scale: int = 1  # divide M, N, K by this (CPU runs)
    hardware: str = "h200"  # planner profile for the predicted columns
    device: str = "auto"
    extra: dict = field(default_factory=dict)


def _timed(fn: Callable[[int], object], iters: int, warmup: int, device: torch.device) -> tuple[list[float], list[float]]:
    """Per-call ms on this rank, and the host ms each call took to return (launch cost);
    ``fn(i)`` runs call ``i`` (i picks the input copy)."""
    for i in range(warmup):
        fn(i)
    out, host = [], []
    for i in range(iters):
        dist.barrier()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            t0 = time.perf_counter()
            fn(i)
            host.append((time.perf_counter() - t0) * 1e3)
            end.record()
            end.synchronize()
            out.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            fn(i)
            out.append((time.perf_counter() - t0) * 1e3)
            host.append(out[-1])
    return out, host


def _copies(w: Workload, rank: int, world_size: int, device, dtype) -> list[tuple[torch.Tensor, torch.Tensor]]:
    rows = w.m // world_size if w.op == "ag_gemm" else w.m
    per_copy = (rows * w.k + w.k * w.n + w.m * w.n) * torch.empty((), dtype=dtype).element_size()
    n = max(2, min(8, math.ceil(3 * L2_BYTES / per_copy))) if device.type == "cuda" else 1
    g = torch.Generator(device=device).manual_seed(1000 * rank + 7)
    out = []
    for _ in range(n):
        a = torch.randn(rows, w.k, generator=g, device=device, dtype=dtype)
        weight = torch.randn(w.n, w.k, generator=g, device=device, dtype=dtype) / math.sqrt(w.k)
        out.append((a, weight.t()))
    return out


def bench_job(rank: int, world_size: int, w: Workload, config: BenchConfig, use_cuda: bool) -> dict:
    """Runs on every rank: per-call ms lists for every variant of cell ``w``."""
    from tpfuse._dist import all_gather_rows, group_context, reduce_scatter_rows
    from tpfuse.ops import resolve_strategy

    device = torch.device("cuda", torch.cuda.current_device()) if use_cuda else torch.device("cpu")
    dtype = torch.bfloat16 if use_cuda else torch.float32
    sets = _copies(w, rank, world_size, device, dtype)
    ctx = group_context(None)
    times: dict[str, list[float]] = {}
    host: dict[str, list[float]] = {}
    resolved = resolve_strategy(w.op, "auto", sets[0][0], sets[0][1], ctx)
    op = getattr(tpfuse, w.op)
    for s in config.strategies:
        times[s], host[s] = _timed(lambda i, s=s: op(*sets[i % len(sets)], strategy=s), config.iters,
                                   config.warmup, device)
    # the parts alone: the local GEMM on full-M rows, and the collective (NCCL/gloo) alone
    if w.op == "ag_gemm":
        full = [torch.empty(w.m, w.k, device=device, dtype=dtype) for _ in sets]
        gemm = lambda i: torch.matmul(full[i % len(sets)], sets[i % len(sets)][1])  # noqa: E731
        comm = lambda i: all_gather_rows(full[i % len(sets)], sets[i % len(sets)][0], None)  # noqa: E731
    else:
        outs = [torch.randn(w.m, w.n, device=device, dtype=dtype) for _ in sets]
        shards = [torch.empty(w.m // world_size, w.n, device=device, dtype=dtype) for _ in sets]
        gemm = lambda i: torch.matmul(*sets[i % len(sets)])  # noqa: E731
        if w.op == "gemm_rs":
            comm = lambda i: reduce_scatter_rows(shards[i % len(sets)], outs[i % len(sets)], None)  # noqa: E731
        else:
            comm = lambda i: dist.all_reduce(outs[i % len(sets)])  # noqa: E731
    times["gemm_alone"], host["gemm_alone"] = _timed(gemm, config.iters, config.warmup, device)
    if world_size > 1:
        times["comm_alone"], host["comm_alone"] = _timed(comm, config.iters, config.warmup, device)
    else:
        times["comm_alone"] = host["comm_alone"] = [0.0] * config.iters
    return {"times": times, "host": host, "resolved": resolved}


def _cells(config: BenchConfig, world_size: int) -> list[Workload]:
    cells = workload_matrix((world_size,), models=config.models, phases=config.phases)
    return [scaled_down(c, config.scale) if config.scale > 1 else c for c in cells]


def run_bench(config: BenchConfig, progress=None) -> dict:
    """Spawn the ranks, run every cell; returns ``{"meta", "rows"}`` (one row per cell)."""
    from tpfuse.spawn import RankPool

    use_cuda = config.device == "cuda" or (config.device == "auto" and torch.cuda.is_available())
    world_size = min(config.world_size, torch.cuda.device_count()) if use_cuda else config.world_size
    cells = _cells(config, world_size)
    env = {"TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NCCL_NVLS_ENABLE": "0"}
    meta = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "device": torch.cuda.get_device_name() if use_cuda else platform.processor() or platform.machine(),
        "num_gpus": torch.cuda.device_count() if use_cuda else 0, "world_size": world_size,
        "backend": "nccl" if use_cuda else "gloo", "torch": torch.__version__, "tpfuse": tpfuse.__version__,
        "config": {k: v for k, v in asdict(config).items() if k != "extra"},
        "timing": "per call: barrier, then CUDA events (GPU) / perf_counter (CPU) around one call; "
                  "the slowest rank's time per call; median over iters; random data rotated past L2",
    }
    try:
        import triton
        meta["triton"] = triton.__version__
    except ImportError:
        pass
    rows = []
    with RankPool(world_size, backend="nccl" if use_cuda else "gloo", env=env) as pool:
        for i, w in enumerate(cells):
            if progress is not None:
                progress(i, len(cells), w.name)
            per_rank = pool.run(bench_job, w, config, use_cuda, timeout=600)
            ms = {key: statistics.median(max(r["times"][key][j] for r in per_rank) for j in range(config.iters))
                  for key in per_rank[0]["times"]}
            host_ms = {key: statistics.median(max(r["host"][key][j] for r in per_rank) for j in range(config.iters))
                       for key in per_rank[0]["host"]}
            p = tpfuse.plan(w.op, m=w.m, n=w.n, k=w.k, world_size=world_size, dtype=w.dtype, hardware=config.hardware)
            base = ms.get("unfused")
            row = {"name": w.name, "op": w.op, "m": w.m, "n": w.n, "k": w.k, "world_size": world_size,
                   "auto_resolved": per_rank[0]["resolved"], "ms": ms, "host_ms": host_ms,
                   "speedup_vs_unfused": {s: base / ms[s] for s in config.strategies if base and ms[s] > 0},
                   "predicted_ms": {s: p.predicted_ms[s] for s in config.strategies if s in p.predicted_ms},
                   "predicted_gemm_ms": p.breakdown["gemm_ms"], "predicted_comm_ms": p.breakdown["comm_ms"],
                   "planner_choice": p.strategy}
            best = min((ms[s] for s in config.strategies), default=float("nan"))
            floor = max(ms["gemm_alone"], ms["comm_alone"])
            row["overlap_efficiency"] = floor / best if best > 0 else float("nan")
            rows.append(row)
    if progress is not None:
        progress(len(cells), len(cells), "done")
    return {"meta": meta, "rows": rows}


def format_rows(result: dict) -> list[list[str]]:
    """Header + one line per cell: measured ms per strategy, parts alone, prediction."""
    strategies = result["meta"]["config"]["strategies"]
    head = ["cell", "op", *[f"{s} ms" for s in strategies], "GEMM alone", "comm alone", "best/unfused",
            "overlap eff", "auto ->", "pred unfused/ring", "host ms unfused/ring"]
    table = [head]
    for r in result["rows"]:
        ms = r["ms"]
        best = min(ms[s] for s in strategies)
        pred = r["predicted_ms"]
        table.append([r["name"], r["op"], *[f"{ms[s]:.3f}" for s in strategies], f"{ms['gemm_alone']:.3f}",
                      f"{ms['comm_alone']:.3f}", f"{ms['unfused'] / best:.2f}x" if "unfused" in ms else "-",
                      f"{r['overlap_efficiency']:.2f}", r["auto_resolved"],
                      f"{pred.get('unfused', float('nan')):.3f}/{pred.get('ring', float('nan')):.3f}",
                      "/".join(f"{r['host_ms'][s]:.3f}" for s in ("unfused", "ring") if s in r.get("host_ms", {}))])
    return table


def write_result(result: dict, out: str | Path) -> Path:
    """Write the JSON (to ``out`` if it ends in .json, else ``out/bench_<device>_w<W>.json``)."""
    out = Path(out)
    if out.suffix != ".json":
        dev = "".join(ch if ch.isalnum() else "_" for ch in result["meta"]["device"].lower()).strip("_") or "cpu"
        out = out / f"bench_{dev}_w{result['meta']['world_size']}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(result, indent=1))
    tmp.replace(out)  # never a half-written file
    return out
