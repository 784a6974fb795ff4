"""``tpfuse demo``: the three ops on a scaled-down Llama-3 workload, every runnable strategy,
each checked against a float64 reference and timed next to ``unfused``.

Without a GPU it spawns ``world_size`` gloo ranks on this machine (float32: CPU bf16 matmul is
slow and tells nothing); with GPUs it puts one NCCL rank on each (bfloat16).  CPU timings show
that the pipeline runs and overlaps on gloo, nothing about GPU speed.

The strategies of a cell are timed in turns, one call each per round (as ``tpfuse bench`` does).
Timed as run in production: the ranks set ``TPFUSE_DEBUG=0`` (no per-call agreement round, as on
NCCL).  Each row carries its noise band (``spread_pct``); ``auto`` that resolved to ``unfused`` is
the baseline itself and says so instead of a ratio.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass, field

import torch

import tpfuse
from tpfuse import dtypes
from tpfuse.bench.common import slowest_median, spread_pct, timed_rounds
from tpfuse.bench.workloads import Workload, scaled_down, workload_matrix

__all__ = ["DemoConfig", "DemoRow", "run_demo", "format_table"]


@dataclass(frozen=True)
class DemoConfig:
    world_size: int = 4
    model: str = "8b"
    scale: int = 8  # divide M, N, K of the Llama cell by this
    repeats: int = 5
    strategies: tuple[str, ...] = ("unfused", "ring", "auto")
    device: str = "auto"  # "cpu", "cuda" or "auto"


@dataclass(frozen=True)
class DemoRow:
    name: str
    op: str
    strategy: str
    m: int
    n: int
    k: int
    ms: float  # median over repeats of the slowest rank's time per call
    max_rel_err: float
    resolved: str = ""  # what "auto" picked
    world_size: int = 0  # ranks it ran on (with GPUs: min(--world-size, GPUs))
    spread_pct: float | None = None  # interquartile range of the repeats, % of ms (None: < 4 repeats)
    extra: dict = field(default_factory=dict)


def demo_cells(config: DemoConfig) -> list[Workload]:
    """fc1 and fc2 of the prefill phase, and fc2 of decode (gemm_ar), scaled down."""
    cells = [w for w in workload_matrix((config.world_size,), models=(config.model,), phases=("prefill", "decode"))
             if (w.phase, w.gemm) in {("prefill", "fc1"), ("prefill", "fc2"), ("decode", "fc2")}]
    out = []
    for w in cells:
        small = scaled_down(w, config.scale if w.phase != "decode" else max(1, config.scale // 4))
        out.append(small)
    return out


def _inputs(w: Workload, rank: int, world_size: int, device: torch.device, dtype: torch.dtype):
    """(this rank's a, b, float64 reference of this rank's output); identical seeds on all ranks."""
    g = torch.Generator().manual_seed(zlib.crc32(f"{w.name}:{w.m}:{w.n}:{w.k}".encode()))
    if w.op == "ag_gemm":
        a_full = torch.randn(w.m, w.k, generator=g, dtype=torch.float64)
        bs = [torch.randn(w.k, w.n, generator=g, dtype=torch.float64) / w.k**0.5 for _ in range(world_size)]
        rows = w.m // world_size
        a = a_full[rank * rows:(rank + 1) * rows]
        ref = a_full.to(dtype).double() @ bs[rank].to(dtype).double()
        return a.to(device, dtype), bs[rank].to(device, dtype), ref
    a_all = [torch.randn(w.m, w.k, generator=g, dtype=torch.float64) for _ in range(world_size)]
    bs = [torch.randn(w.k, w.n, generator=g, dtype=torch.float64) / w.k**0.5 for _ in range(world_size)]
    ref = sum(x.to(dtype).double() @ y.to(dtype).double() for x, y in zip(a_all, bs))
    if w.op == "gemm_rs":
        rows = w.m // world_size
        ref = ref[rank * rows:(rank + 1) * rows]
    return a_all[rank].to(device, dtype), bs[rank].to(device, dtype), ref


def _call(op: str, a: torch.Tensor, b: torch.Tensor, strategy: str) -> torch.Tensor:
    if op == "ag_gemm":
        return tpfuse.ag_gemm(a, b, strategy=strategy)
    return getattr(tpfuse, op)(a, b, strategy=strategy)


def demo_job(rank: int, world_size: int, w: Workload, strategies: tuple[str, ...], repeats: int,
             use_cuda: bool) -> dict[str, dict]:
    """Runs on every rank: the strategies of one cell timed in turns (one warm-up call each, then
    ``repeats`` rounds of one call each: a slow spell of the machine lands on all of them), and
    each one's last output checked.  Returns ``{strategy: {"times", "err", "resolved"}}``."""
    device = torch.device("cuda", torch.cuda.current_device()) if use_cuda else torch.device("cpu")
    dtype = dtypes.default(device.type)
    a, b, ref = _inputs(w, rank, world_size, device, dtype)
    resolved = {s: s for s in strategies}
    if "auto" in strategies:
        from tpfuse._dist import group_context
        from tpfuse.ops import resolve_strategy

        resolved["auto"] = resolve_strategy(w.op, "auto", a, b, group_context(None))
    outs: dict[str, torch.Tensor] = {}

    def call(strategy: str):
        def fn(_: int) -> None:
            outs[strategy] = _call(w.op, a, b, strategy)
        return fn

    timed = timed_rounds({s: call(s) for s in strategies}, repeats, 1, device)
    result = {}
    for s in strategies:
        out = outs[s]
        err = ((out.double().cpu() - ref).abs().max() / ref.abs().max().clamp_min(1e-30)).item()
        if not torch.isfinite(out).all():
            err = float("inf")
        result[s] = {"times": timed[s][0], "err": err, "resolved": resolved[s]}
    return result


def run_demo(config: DemoConfig, progress=None) -> list[DemoRow]:
    """Spawn the ranks, run every cell (its strategies in turns), return one row per (cell, strategy).

    ``progress(done, total, label)`` is called before each cell.
    """
    from tpfuse.spawn import RankPool

    use_cuda = config.device == "cuda" or (config.device == "auto" and torch.cuda.is_available())
    world_size = config.world_size
    if use_cuda:
        world_size = min(world_size, torch.cuda.device_count())
        config = DemoConfig(**{**config.__dict__, "world_size": world_size})
    jobs = demo_cells(config)
    rows: list[DemoRow] = []
    # TPFUSE_DEBUG=0: time what runs in production (no per-call agreement round; see common._RANK_ENV)
    env = {"TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NCCL_NVLS_ENABLE": "0", "TPFUSE_DEBUG": "0"}
    with RankPool(world_size, backend="nccl" if use_cuda else "gloo", env=env) as pool:
        for i, w in enumerate(jobs):
            if progress is not None:
                progress(i, len(jobs), f"{w.op}: {', '.join(config.strategies)}")
            per_rank = pool.run(demo_job, w, tuple(config.strategies), config.repeats, use_cuda, timeout=300)
            for strategy in config.strategies:
                mine = [r[strategy] for r in per_rank]
                rows.append(DemoRow(
                    name=f"{w.model}-{w.phase}-{w.gemm}", op=w.op, strategy=strategy, m=w.m, n=w.n, k=w.k,
                    ms=slowest_median([r["times"] for r in mine]), max_rel_err=max(r["err"] for r in mine),
                    resolved=mine[0]["resolved"], world_size=world_size,
                    spread_pct=spread_pct([r["times"] for r in mine]),
                ))
    if progress is not None:
        progress(len(jobs), len(jobs), "done")
    return rows


def _vs_unfused(r: DemoRow, base: DemoRow | None) -> str:
    """``unfused ms / ms``; "same strategy" for unfused itself (and auto that picked it); "(noise)"
    after a ratio that is inside the noise band of either row."""
    if base is None or r.ms <= 0:
        return "-"
    concrete = r.resolved if r.strategy == "auto" else r.strategy
    if concrete == "unfused":
        return "baseline" if r is base else "same strategy"
    speedup = base.ms / r.ms
    band = max(r.spread_pct or 0.0, base.spread_pct or 0.0)
    return f"{speedup:.2f}x" + (" (noise)" if abs(speedup - 1.0) * 100 <= band else "")


def format_table(rows: list[DemoRow]) -> list[list[str]]:
    """Header + one line per row: op, strategy, shape, ms, its spread, speedup vs unfused, max rel error."""
    base = {(r.name, r.op): r for r in rows if r.strategy == "unfused"}
    table = [["cell", "op", "strategy", "M x N x K (local)", "ms", "spread", "vs unfused", "max rel err"]]
    for r in rows:
        strategy = r.strategy if r.strategy != "auto" else f"auto->{r.resolved}"
        spread = "-" if r.spread_pct is None else f"{r.spread_pct:.0f}%"
        table.append([r.name, r.op, strategy, f"{r.m}x{r.n}x{r.k}", f"{r.ms:.2f}", spread,
                      _vs_unfused(r, base.get((r.name, r.op))), f"{r.max_rel_err:.1e}"])
    return table
