"""``tpfuse bench``: every runnable strategy on the workload matrix, with the overlap breakdown.

One row per (workload cell, strategy), strategies from :func:`tpfuse.strategies.runnable` for
the group, device and dtype (plus ``"auto"``), all measured in one run so that ratios compare
numbers taken side by side.  Every row has every field of :data:`ROW_FIELDS`; a field the
environment cannot measure is ``null`` and ``row["reasons"][field]`` says why.

| field | meaning |
|---|---|
| ``ms`` | the tpfuse call, eager (median over calls of the slowest rank), as run in production: no per-call agreement round (``meta["checks"]``) |
| ``spread_pct`` | the noise band of ``ms``: interquartile range of the per-call times, % of the median |
| ``unfused_ms`` | what users run today: the collective in the input dtype (NCCL / gloo) + ``torch.matmul`` |
| ``asynctp_ms`` | ``torch.ops.symm_mem.fused_all_gather_matmul`` / ``fused_matmul_reduce_scatter`` |
| ``gemm_ms`` | the local GEMM alone (``[M, K] @ [K, N]``, full M) |
| ``comm_ms`` | the collective alone, input dtype |
| ``exposed_comm_ms`` | ``ms - gemm_ms`` |
| ``overlap_efficiency`` | ``max(gemm_ms, comm_ms) / ms`` (1 = perfect overlap) |
| ``speedup_vs_unfused`` / ``speedup_vs_asynctp`` | ``unfused_ms / ms`` / ``asynctp_ms / ms`` |
| ``predicted_ms`` | :func:`tpfuse.plan` for this strategy (``auto``: the strategy it resolved to) |
| ``host_us`` | host time per eager call until it returned (on CPU: the whole call) |
| ``agree_ms`` | one per-call agreement round alone: what ``TPFUSE_DEBUG=1`` (the default for CPU tensors on gloo) adds to each call |
| ``graph_ms`` | the call captured in a CUDA graph, per replay |

Timing: see :mod:`tpfuse.bench.common` (random data rotated past the L2 cache, warm-up,
barrier before each call, the variants of a cell interleaved round by round, slowest rank,
median).  ``tpfuse.strategies.unfused`` is a row of its
own (it reduces bf16/fp16 in fp32), not the ``unfused_ms`` baseline.
"""

from __future__ import annotations

import contextlib
import json
import math
import sys
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Callable

import torch
import torch.distributed as dist

import tpfuse
from tpfuse import _fp8
from tpfuse.bench import common
from tpfuse.bench.workloads import Workload, scaled_down, workload_matrix
from tpfuse.spawn import RankError

__all__ = ["BenchConfig", "ROW_FIELDS", "run_bench", "format_rows", "write_result", "quick_config"]

L2_BYTES = 60 * 2**20  # H200 (the largest L2 we run on); rotating past it on smaller GPUs is harmless


def symmetric_strategies() -> tuple[str, ...]:
    """Strategies that move data through symmetric memory, not the process group (they declare
    ``SYMMETRIC_MEMORY``): the only ones that run in the one-GPU bed (its gloo group cannot carry
    CUDA tensors)."""
    from tpfuse import strategies

    return tuple(s for s in strategies.names() if strategies.info(s).symmetric_memory)
# Every row has these keys, in this order (the table above; null + a reason where not measured).
ROW_FIELDS = ("cell", "model", "phase", "gemm", "op", "m", "n", "k", "world_size", "dtype", "strategy", "resolved",
              "ms", "spread_pct", "unfused_ms", "asynctp_ms", "gemm_ms", "comm_ms", "exposed_comm_ms", "overlap_efficiency",
              "speedup_vs_unfused", "speedup_vs_asynctp", "predicted_ms", "host_us", "agree_ms", "graph_ms", "reasons")


@dataclass(frozen=True)
class BenchConfig:
    """What ``tpfuse bench`` runs.  ``strategies=None``: every runnable one, plus ``"auto"``."""

    world_size: int = 8
    models: tuple[str, ...] = ("8b", "70b")
    phases: tuple[str, ...] = ("training", "prefill", "decode")
    strategies: tuple[str, ...] | None = None
    iters: int = 20
    warmup: int = 3
    scale: int = 1  # divide M, N, K by this (CPU runs)
    hardware: str = "auto"  # planner profile for predicted_ms: auto = the detected GPU, or cpu-gloo
    device: str = "auto"  # "auto" | "cpu" | "cuda"
    bed: int = 0  # > 0: that many processes share cuda:0 (the one-GPU bed)
    dtype: str = "auto"  # "auto" = bf16 on CUDA, fp32 on CPU; or bf16 / fp16 / fp32
    graph: bool = True  # also time CUDA-graph replay (GPU only)
    timeline: bool = False  # record the first cell's timeline (see run_bench)
    strategy_modules: tuple[str, ...] = ()  # strategies of your own: modules registered in every process first


def quick_config(on_gpu: bool = False, **overrides) -> BenchConfig:
    """``--quick``: 8B prefill + decode on two ranks with few calls; on CPU scaled 1/64 (seconds),
    on GPU at full size."""
    base = BenchConfig(world_size=2, models=("8b",), phases=("prefill", "decode"), iters=10,
                       warmup=2, scale=1 if on_gpu else 64)
    return replace(base, **overrides)


@dataclass(frozen=True)
class _CellJob:
    """What every rank needs to time one cell (sent to the ranks)."""

    workload: Workload
    strategies: tuple[str, ...] | None
    iters: int
    warmup: int
    dtype: str
    mode: str
    graph: bool
    progress: bool = False   # rank 0 prints each step of the cell on stderr (long GPU runs)
    strategy_modules: tuple[str, ...] = ()   # registered on the rank before the cell (BenchConfig)


_DTYPES = common.OP_DTYPES


def _copies(w: Workload, rank: int, device: torch.device,
            dtype: torch.dtype) -> tuple[list[tuple[torch.Tensor, torch.Tensor]], list[dict]]:
    """Input sets (random, never zeros): enough copies to exceed 3 x L2 on GPU, one on CPU; and
    each set's extra op arguments ({} but for fp8: e4m3 quantized with tensor-wise scales, whose
    ``scale_a``, ``scale_b`` and ``out_dtype`` they are)."""
    rows = w.m // w.world_size if w.op == "ag_gemm" else w.m
    per_copy = (rows * w.k + w.k * w.n + w.m * w.n) * torch.empty((), dtype=dtype).element_size()
    n = max(2, min(8, math.ceil(3 * L2_BYTES / per_copy))) if device.type == "cuda" else 1
    g = torch.Generator(device=device).manual_seed(1000 * rank + 7)
    out, kws = [], []
    fp8 = _fp8.is_fp8(dtype)
    make = torch.float32 if fp8 else dtype
    for _ in range(n):
        a = torch.randn(rows, w.k, generator=g, device=device, dtype=make)
        weight = torch.randn(w.n, w.k, generator=g, device=device, dtype=make) / math.sqrt(w.k)
        if fp8:
            (a, scale_a), (weight, scale_b) = (_fp8.quantize(x, dtype, "tensor") for x in (a, weight))
            kws.append(dict(scale_a=scale_a, scale_b=scale_b, out_dtype=_fp8.DEFAULT_OUT_DTYPE))
        else:
            kws.append({})
        out.append((a, weight.t()))
    return out, kws


def _asynctp_fn(w: Workload, sets, group_name: str, device: torch.device) -> tuple[Callable | None, str | None]:
    """PyTorch's async-TP op for this cell, or (None, why it cannot run here)."""
    if device.type != "cuda":
        return None, "no CUDA (PyTorch async-TP needs CUDA symmetric memory)"
    if w.op == "gemm_ar":
        return None, "PyTorch async-TP has no fused matmul + all-reduce (only all-gather and reduce-scatter)"
    if _fp8.is_fp8(sets[0][0].dtype):
        return None, "fp8: PyTorch's scaled async-TP ops are checked against ours in tests/gpu/bed.py (case fp8)"
    why = common.attempt(lambda: common.enable_symmetric_memory(group_name))  # agreed: every rank or none
    if why is not None:
        return None, f"symmetric memory unavailable: {why}"
    n = len(sets)
    if w.op == "ag_gemm":
        return (lambda i: torch.ops.symm_mem.fused_all_gather_matmul(sets[i % n][0], [sets[i % n][1]], 0, group_name)), None
    return (lambda i: torch.ops.symm_mem.fused_matmul_reduce_scatter(sets[i % n][0], sets[i % n][1], "sum", 0,
                                                                      group_name)), None


def _parts(w: Workload, sets, kws, device, dtype) -> tuple[Callable, Callable, Callable]:
    """(gemm alone, collective alone, collective + matmul as users write it), input dtype."""
    from tpfuse._dist import all_gather_rows, reduce_scatter_rows

    n, world_size = len(sets), w.world_size
    if _fp8.is_fp8(dtype):
        return _parts_fp8(w, sets, kws, device)
    if w.op == "ag_gemm":
        full = [torch.randn(w.m, w.k, device=device, dtype=dtype) for _ in sets]
        gemm = lambda i: torch.matmul(full[i % n], sets[i % n][1])  # noqa: E731
        comm = lambda i: all_gather_rows(full[i % n], sets[i % n][0], None)  # noqa: E731

        def torch_way(i):
            all_gather_rows(full[i % n], sets[i % n][0], None)
            return torch.matmul(full[i % n], sets[i % n][1])
        return gemm, comm, torch_way
    outs = [torch.randn(w.m, w.n, device=device, dtype=dtype) for _ in sets]
    shards = [torch.empty(w.m // world_size, w.n, device=device, dtype=dtype) for _ in sets]
    gemm = lambda i: torch.matmul(*sets[i % n])  # noqa: E731
    if w.op == "gemm_rs":
        comm = lambda i: reduce_scatter_rows(shards[i % n], outs[i % n], None)  # noqa: E731

        def torch_way(i):
            reduce_scatter_rows(shards[i % n], torch.matmul(*sets[i % n]), None)
            return shards[i % n]
    else:
        comm = lambda i: dist.all_reduce(outs[i % n])  # noqa: E731

        def torch_way(i):
            partial = torch.matmul(*sets[i % n])
            dist.all_reduce(partial)
            return partial
    return gemm, comm, torch_way


def _parts_fp8(w: Workload, sets, scales, device) -> tuple[Callable, Callable, Callable]:
    """fp8 :func:`_parts`: the all-gather moves the fp8 bytes, the GEMM is ``torch._scaled_mm``
    (bf16 out), RS/AR reduce its float32 partials (what ``unfused`` runs)."""
    from tpfuse._dist import all_gather_rows, reduce_scatter_rows
    from tpfuse.strategies._scaled import mm, wire

    n, world_size = len(sets), w.world_size
    out_dtype = _fp8.DEFAULT_OUT_DTYPE   # what the ops return for fp8 by default
    partial_dtype = tpfuse.dtypes.reduce_dtype(sets[0][0].dtype, (tpfuse.dtypes.FP8,))

    def gemm_of(a, i, out_dtype):
        return mm(a, sets[i % n][1], scales[i % n]["scale_a"], scales[i % n]["scale_b"], out_dtype)

    if w.op == "ag_gemm":
        full = [torch.empty(w.m, w.k, device=device, dtype=sets[0][0].dtype) for _ in sets]
        for f in full:
            f.view(torch.uint8).random_(0, 0x7f)   # finite e4m3 bytes (0x7f is NaN)
        gemm = lambda i: gemm_of(full[i % n], i, out_dtype)  # noqa: E731
        comm = lambda i: all_gather_rows(wire(full[i % n]), wire(sets[i % n][0]), None)  # noqa: E731

        def torch_way(i):
            comm(i)
            return gemm(i)
        return gemm, comm, torch_way
    outs = [torch.randn(w.m, w.n, device=device) for _ in sets]   # float32 partials
    shards = [torch.empty(w.m // world_size, w.n, device=device) for _ in sets]
    gemm = lambda i: gemm_of(sets[i % n][0], i, out_dtype)  # noqa: E731
    if w.op == "gemm_rs":
        comm = lambda i: reduce_scatter_rows(shards[i % n], outs[i % n], None)  # noqa: E731

        def torch_way(i):
            reduce_scatter_rows(shards[i % n], gemm_of(sets[i % n][0], i, partial_dtype), None)
            return shards[i % n].to(out_dtype)
    else:
        comm = lambda i: dist.all_reduce(outs[i % n])  # noqa: E731

        def torch_way(i):
            partial = gemm_of(sets[i % n][0], i, partial_dtype)
            dist.all_reduce(partial)
            return partial.to(out_dtype)
    return gemm, comm, torch_way


def strategy_plan(names, runnable, resolved: str, mode: str, why_unavailable) -> tuple[list[str], dict[str, str]]:
    """Which of ``names`` to time, and why each other one is not: not runnable here
    (``why_unavailable(name)``), or -- in the one-GPU bed -- a strategy that sends CUDA tensors
    through the process group (gloo there), ``auto`` included when it resolves to one."""
    to_run, skipped = [], {}
    for s in names:
        concrete = resolved if s == "auto" else s
        if s != "auto" and s not in runnable:
            skipped[s] = why_unavailable(s) or "not runnable here"
        elif mode == "one-gpu-bed" and concrete not in symmetric_strategies():
            skipped[s] = (f"{'auto resolved to ' if s == 'auto' else ''}{concrete} sends CUDA tensors through "
                          "the process group, and the one-GPU bed's group is gloo")
        else:
            to_run.append(s)
    return to_run, skipped


def cell_job(rank: int, world_size: int, job: _CellJob) -> dict:
    """Runs on every rank: per-call ms for every variant of one cell, or the reason it did not run."""
    from tpfuse import strategies
    from tpfuse._dist import group_context
    from tpfuse.ops import resolve_strategy

    started = time.monotonic()   # progress lines say the seconds since
    for module in job.strategy_modules:
        strategies.register_module(module)
    w = job.workload
    device = torch.device("cuda", torch.cuda.current_device()) if job.mode != "cpu-gloo" else torch.device("cpu")
    dtype = _DTYPES[job.dtype]
    sets, kw = _copies(w, rank, device, dtype)   # kw: fp8, each set's scales and out_dtype
    ctx = group_context(None)
    n = len(sets)
    runnable = strategies.runnable(ctx, device, dtype)
    names = tuple(job.strategies) if job.strategies is not None else (*runnable, "auto")
    resolved = resolve_strategy(w.op, "auto", sets[0][0], sets[0][1], ctx, **kw[0])
    op = getattr(tpfuse, w.op)
    to_run, skipped = strategy_plan(names, runnable, resolved, job.mode,
                                    lambda s: strategies.why_unavailable(s, ctx, device, dtype))
    variants: dict[str, Callable] = {s: (lambda i, s=s: op(*sets[i % n], strategy=s, **kw[i % n])) for s in to_run}
    gemm, comm, torch_way = _parts(w, sets, kw, device, dtype)
    variants["@gemm"] = gemm
    if job.mode == "one-gpu-bed":
        why = "one-GPU bed: its gloo group cannot carry CUDA tensors (and NCCL refuses two ranks on one GPU)"
        skipped["@comm"] = skipped["@unfused"] = why
    else:
        variants["@comm"], variants["@unfused"] = comm, torch_way
    asynctp, why = _asynctp_fn(w, sets, ctx.group_name, device)
    if asynctp is None:
        skipped["@asynctp"] = why
    else:
        variants["@asynctp"] = asynctp
    if world_size > 1:
        variants["@agree"] = common.agreement_round(w.op, *sets[0], **kw[0])
    else:
        skipped["@agree"] = "world size 1: calls run no agreement round"

    # Keys: strategy names, and "@"-prefixed baselines (never a strategy name).
    def say(step: str) -> None:   # with the seconds since the cell began: where a long run spends them
        if job.progress and rank == 0:
            print(f"  {w.name}: {step} (+{time.monotonic() - started:.1f} s)", file=sys.stderr, flush=True)

    out: dict[str, dict] = {}
    working = {}
    for name, fn in variants.items():
        say(f"first call of {name}")
        reason = common.attempt(lambda fn=fn: fn(0))
        if reason is None:
            working[name] = fn
        else:
            out[name] = {"reason": reason}
    say(f"timing {len(working)} variants x {job.iters} calls")
    for name, (times, host) in common.timed_rounds(working, job.iters, job.warmup, device).items():
        out[name] = {"times": times, "host": host}
    for name in names:  # graph replay of the tpfuse calls that ran eagerly
        if name not in working:
            continue
        if job.graph:
            say(f"graph replay of {name}")
            out[name]["graph"], out[name]["graph_reason"] = common.graph_timed(working[name], job.iters, device)
        else:
            out[name]["graph"], out[name]["graph_reason"] = None, ("no CUDA (graphs need a GPU)" if device.type != "cuda"
                                                                   else "graph timing off (--no-graph)")
    out.update({name: {"reason": why} for name, why in skipped.items()})
    unavailable = {s: strategies.why_unavailable(s, ctx, device, dtype) for s in strategies.names()
                   if s not in runnable}
    return {"variants": out, "strategies": names, "resolved": resolved, "unavailable": unavailable,
            "checks": common.checks_on(device)}


def timeline_job(rank: int, world_size: int, job: _CellJob) -> list[dict]:
    """Runs on every rank: one recorded call per strategy of the cell.  The call before it is
    recorded too and dropped: recording compiles other kernel variants (per-tile records), and
    the first call's JIT would otherwise fill the picture."""
    from tpfuse import timeline

    w = job.workload
    device = torch.device("cuda", torch.cuda.current_device()) if job.mode != "cpu-gloo" else torch.device("cpu")
    sets, kw = _copies(w, rank, device, _DTYPES[job.dtype])
    op = getattr(tpfuse, w.op)
    events: list[dict] = []
    for s in job.strategies or ():
        for _warm_up_then_kept in range(2):
            common._barrier(device)
            with timeline.recording(rank) as rec:
                with rec.span("call", s, device=device):
                    op(*sets[0], strategy=s, **kw[0])
        events += [ev.to_dict() for ev in rec.events()]
    return events


# --------------------------------------------------------------------------------------------
# Rows
# --------------------------------------------------------------------------------------------


def _first_failure(exc: RankError) -> str:
    """The exception line of the first failing rank's traceback (e.g. ``TimeoutError: ...``)."""
    rank = min(exc.failures)
    lines = [ln.strip() for ln in exc.failures[rank].strip().splitlines() if ln.strip()]
    return f"rank {rank}: {(lines or ['?'])[-1]}"[:300]


def _failed_cell_rows(w: Workload, strategies, reason: str, predicted: dict[str, float], dtype: str) -> list[dict]:
    """Rows of a cell whose job raised: every measured field null with ``reason``."""
    rows = []
    for s in strategies:
        row = {"cell": w.name, "model": w.model, "phase": w.phase, "gemm": w.gemm, "op": w.op, "m": w.m, "n": w.n,
               "k": w.k, "world_size": w.world_size, "dtype": dtype, "strategy": s, "resolved": None}
        reasons = {}
        for field in ROW_FIELDS:
            if field == "ms" or field.endswith(("_ms", "_us", "_pct", "efficiency")) or field.startswith("speedup"):
                row[field] = None
                reasons[field] = f"the cell failed: {reason}"
        row["predicted_ms"] = predicted.get(s)
        if row["predicted_ms"] is not None:
            reasons.pop("predicted_ms")
        row["reasons"] = reasons
        rows.append({k: row[k] for k in ROW_FIELDS})
    return rows


def _median_of(per_rank: list[dict], name: str, key: str = "times") -> tuple[float | None, str | None]:
    entries = [r["variants"][name] for r in per_rank]
    if any("reason" in e for e in entries):
        return None, next(e["reason"] for e in entries if "reason" in e)
    if key == "graph" and any(e.get("graph") is None for e in entries):
        return None, next(e["graph_reason"] for e in entries if e.get("graph") is None)
    return common.slowest_median([e[key] for e in entries]), None


def _rows_for_cell(w: Workload, per_rank: list[dict], predicted: dict[str, float], dtype: str) -> list[dict]:
    base = {"cell": w.name, "model": w.model, "phase": w.phase, "gemm": w.gemm, "op": w.op, "m": w.m, "n": w.n,
            "k": w.k, "world_size": w.world_size, "dtype": dtype}
    shared: dict[str, float | None] = {}
    shared_reasons: dict[str, str] = {}
    for field, name in (("unfused_ms", "@unfused"), ("asynctp_ms", "@asynctp"), ("gemm_ms", "@gemm"),
                        ("comm_ms", "@comm"), ("agree_ms", "@agree")):
        shared[field], why = _median_of(per_rank, name)
        if why is not None:
            shared_reasons[field] = why
    resolved = per_rank[0]["resolved"]
    rows = []
    for s in per_rank[0]["strategies"]:
        row = {**base, "strategy": s, "resolved": resolved if s == "auto" else s, **shared}
        reasons = dict(shared_reasons)
        row["ms"], why = _median_of(per_rank, s)
        if why is not None:
            reasons["ms"] = why
            reasons["spread_pct"] = why
            row["spread_pct"] = None
        else:
            row["spread_pct"] = common.spread_pct([r["variants"][s]["times"] for r in per_rank])
            if row["spread_pct"] is None:
                reasons["spread_pct"] = "fewer than 4 timed calls"
        host_ms, _ = _median_of(per_rank, s, "host")
        row["host_us"] = None if host_ms is None else host_ms * 1e3
        row["graph_ms"], why = _median_of(per_rank, s, "graph") if row["ms"] is not None else (None, reasons["ms"])
        if why is not None:
            reasons["graph_ms"] = why
        if row["host_us"] is None:
            reasons["host_us"] = reasons["ms"]
        _derive(row, reasons)
        p = predicted.get(row["resolved"])
        row["predicted_ms"] = p
        if p is None:
            reasons["predicted_ms"] = f"the planner models no strategy {row['resolved']!r}"
        row["reasons"] = reasons
        rows.append({k: row[k] for k in ROW_FIELDS})
    return rows


def _derive(row: dict, reasons: dict) -> None:
    """The ratio fields from the measured ones (null, with the missing input named, if one is)."""
    ms, gemm, comm = row["ms"], row["gemm_ms"], row["comm_ms"]

    def need(field: str, *inputs: str) -> bool:
        missing = [f for f in inputs if row[f] is None]
        if missing:
            row[field] = None
            reasons[field] = f"{missing[0]} not measured ({reasons.get(missing[0], 'null')})"
        return not missing

    if need("exposed_comm_ms", "ms", "gemm_ms"):
        row["exposed_comm_ms"] = ms - gemm
    if need("overlap_efficiency", "ms", "gemm_ms", "comm_ms"):
        row["overlap_efficiency"] = max(gemm, comm) / ms if ms > 0 else None
    if need("speedup_vs_unfused", "ms", "unfused_ms"):
        row["speedup_vs_unfused"] = row["unfused_ms"] / ms if ms > 0 else None
    if need("speedup_vs_asynctp", "ms", "asynctp_ms"):
        row["speedup_vs_asynctp"] = row["asynctp_ms"] / ms if ms > 0 else None


def _cells(config: BenchConfig, world_size: int) -> list[Workload]:
    cells = workload_matrix((world_size,), models=config.models, phases=config.phases)
    return [scaled_down(c, config.scale) if config.scale > 1 else c for c in cells]


def _hardware(config: BenchConfig, setup: common.RankSetup):
    from tpfuse.model.hardware import detect, get_profile

    if config.hardware != "auto":
        return get_profile(config.hardware)
    return detect(torch.device("cuda", 0)) if setup.device_type == "cuda" else get_profile("cpu-gloo")


def run_bench(config: BenchConfig, progress=None, ranks=None, on_cell=None) -> dict:
    """Run every cell on the ranks; returns ``{"meta", "rows"}`` (and ``"timeline"``: the first
    cell's recorded events, when ``config.timeline``).  ``ranks``: an open set of ranks (e.g. a
    ``RankPool`` of the right kind) to reuse instead of starting new ones.  ``on_cell(result)``
    after every cell: the cells so far, ``meta["complete"]`` False (the CLI writes it, so a run
    cut short keeps what it measured)."""
    from tpfuse import strategies

    for module in config.strategy_modules:   # here for the planner's predictions; the ranks do it per cell
        strategies.register_module(module)
    setup, dtype = common.setup_and_dtype(config.world_size, config.device, config.bed, config.dtype, ranks,
                                          allowed=common.OP_DTYPES)
    cells = _cells(config, setup.world_size)
    hw = _hardware(config, setup)
    meta = common.bench_meta(setup, hardware_profile=hw.name, dtype=dtype,
                             config={k: v for k, v in asdict(config).items()},
                             timing="per call: barrier, then CUDA events (GPU) / perf_counter (CPU) around one "
                                    "call; the slowest rank's time per call; median over iters; random data "
                                    "rotated past L2; graph_ms replays one captured input set")
    rows: list[dict] = []
    events: list[dict] = []
    not_runnable: dict[str, str] = {}  # strategies this group/device/dtype cannot run, and why
    failed: dict[str, str] = {}       # cells whose job raised on a rank, and why
    names = config.strategies         # a failed cell's rows: the strategies of the cells before it
    opened = contextlib.nullcontext(_as_ranks(ranks)) if ranks is not None else common.open_ranks(setup)
    with opened as pool:
        for i, w in enumerate(cells):
            if progress is not None:
                progress(i, len(cells), w.name)
            job = _CellJob(w, config.strategies, config.iters, config.warmup, dtype, setup.mode, config.graph,
                           progress=progress is not None, strategy_modules=config.strategy_modules)
            p = tpfuse.plan(w.op, m=w.m, n=w.n, k=w.k, world_size=w.world_size, dtype=dtype, hardware=hw)
            try:
                per_rank = pool.run(cell_job, job, timeout=1800)
            except RankError as exc:   # e.g. a strategy's TimeoutError: record it, go on with the next cell
                failed[w.name] = _first_failure(exc)
                if progress is not None:
                    print(f"  {w.name}: FAILED: {failed[w.name]}", file=sys.stderr, flush=True)
                rows += _failed_cell_rows(w, names or ("auto",), failed[w.name], dict(p.predicted_ms), dtype)
                continue
            names = per_rank[0]["strategies"]
            meta["checks"] = per_rank[0]["checks"]
            rows += _rows_for_cell(w, per_rank, dict(p.predicted_ms), dtype)
            not_runnable.update(per_rank[0].get("unavailable", {}))
            if on_cell is not None and i + 1 < len(cells):
                on_cell({"meta": {**meta, "complete": False, "cells_done": i + 1, "cells": len(cells)},
                         "rows": list(rows)})
            if config.timeline and i == 0:
                ran = tuple(r["strategy"] for r in rows if r["ms"] is not None and r["strategy"] != "auto")
                events = [ev for rank_events in pool.run(timeline_job, replace(job, strategies=ran), timeout=600)
                          for ev in rank_events]
    if progress is not None:
        progress(len(cells), len(cells), "done")
    skipped = {}
    for r in rows:
        if r["ms"] is None:
            skipped.setdefault(r["strategy"], r["reasons"]["ms"])
    meta["complete"] = True
    meta["cells_failed"] = failed
    meta["strategies_not_run"] = skipped
    meta["strategies_not_runnable"] = not_runnable
    result = {"meta": meta, "rows": rows}
    if config.timeline:
        result["timeline"] = {"cell": cells[0].name if cells else None, "events": events}
    return result


def _as_ranks(ranks):
    from tpfuse.spawn import RankPool

    return common._PoolRanks(ranks) if isinstance(ranks, RankPool) else ranks


# --------------------------------------------------------------------------------------------
# Output
# --------------------------------------------------------------------------------------------


def _fmt(value, spec: str = ".3f") -> str:
    return "-" if value is None else format(value, spec)


def format_rows(result: dict) -> list[list[str]]:
    """Header + one line per row (``-`` for null; the reasons are in the JSON)."""
    head = ["cell", "strategy", "ms", "spread", "unfused", "asynctp", "gemm", "comm", "exposed", "overlap",
            "x unfused", "x asynctp", "predicted", "host us", "agree ms", "graph ms"]
    table = [head]
    for r in result["rows"]:
        name = r["strategy"] if r["strategy"] != "auto" else f"auto->{r['resolved']}"
        spread = "-" if r["spread_pct"] is None else f"{r['spread_pct']:.0f}%"
        table.append([r["cell"], name, _fmt(r["ms"]), spread, _fmt(r["unfused_ms"]), _fmt(r["asynctp_ms"]), _fmt(r["gemm_ms"]),
                      _fmt(r["comm_ms"]), _fmt(r["exposed_comm_ms"]), _fmt(r["overlap_efficiency"], ".2f"),
                      _fmt(r["speedup_vs_unfused"], ".2f"), _fmt(r["speedup_vs_asynctp"], ".2f"),
                      _fmt(r["predicted_ms"]), _fmt(r["host_us"], ".0f"), _fmt(r["agree_ms"]), _fmt(r["graph_ms"])])
    return table


def null_reasons(result: dict) -> dict[str, str]:
    """One reason per null field over all rows (the first seen), for a footnote under the table."""
    out: dict[str, str] = {}
    for r in result["rows"]:
        for field, why in r["reasons"].items():
            out.setdefault(field, why)
    return out


def write_result(result: dict, out: str | Path) -> Path:
    """Write the JSON (to ``out`` if it ends in .json, else ``out/bench_<device>_w<W>.json``), whole or not at all."""
    out = Path(out)
    if out.suffix != ".json":
        dev = "".join(ch if ch.isalnum() else "_" for ch in result["meta"]["device"].lower()).strip("_") or "cpu"
        out = out / f"bench_{dev}_w{result['meta']['world_size']}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(result, indent=1))
    tmp.replace(out)  # never a half-written file
    return out
