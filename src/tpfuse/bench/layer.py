"""``tpfuse bench layer``: a tensor-parallel Llama MLP block, forward + backward, tokens/s per rank.

The block (sequence parallel; ``T`` tokens in all, ``W`` ranks, Llama-3 sizes ``h``, ``ffn``):

    x_shard [T/W, h] --fc1 (ag_gemm)--> [T, 2*ffn/W] --silu(gate) * up--> [T, ffn/W] --fc2 (gemm_rs)--> [T/W, h]

One step is the forward and the backward (input and weight gradients) on random data.
Variants, all on the same shapes in one run:

| variant | what runs |
|---|---|
| ``tpfuse:<strategy>`` | :class:`tpfuse.nn.ColumnParallelLinear` + :class:`tpfuse.nn.RowParallelLinear` (``auto`` and each runnable strategy) |
| ``unfused`` | the same block in plain PyTorch: functional all-gather / reduce-scatter (input dtype) + ``F.linear`` |
| ``asynctp`` | ``unfused`` under ``torch.compile`` with inductor's micro-pipeline TP (async-TP) and symmetric memory enabled for the group |
| ``compute_only`` | the block's GEMMs and elementwise work on local shards, no communication: the roofline |

Per variant: ``ms`` per step (median over steps of the slowest rank), ``tokens_per_s_per_rank`` =
``(T / W) / step time`` (the tokens each rank owns in sequence parallelism), and
``speedup_vs_unfused`` / ``speedup_vs_asynctp``.  On CUDA the ``tpfuse:<strategy>`` variants also
carry ``graph_ms`` (the same step captured in one CUDA graph and replayed) and
``eager_over_graph`` = ``ms / graph_ms``: what eager launching costs the step.  Null fields carry a
reason, as in ``tpfuse bench``.

The one-GPU bed (``--bed W``: W processes on cuda:0 over gloo, MPS) runs the symmetric-memory
strategies only; the block has no bias.  Issue 34 reads it at T = 4096 and 512::

    tpfuse bench layer --bed 2 --tokens 4096 --strategies copy_engine fused --json layer_bed2_t4096.json
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import asdict, dataclass, replace

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from tpfuse.bench import common
from tpfuse.bench.run import _as_ranks, symmetric_strategies
from tpfuse.bench.workloads import MODELS, PHASES

__all__ = ["LayerConfig", "run_layer_bench", "format_layer_rows", "LAYER_ROW_FIELDS", "quick_layer_config"]

LAYER_ROW_FIELDS = ("variant", "strategy", "resolved", "model", "tokens", "hidden", "ffn", "world_size", "dtype",
                    "ms", "spread_pct", "tokens_per_s_per_rank", "speedup_vs_unfused", "speedup_vs_asynctp", "graph_ms",
                    "eager_over_graph", "reasons")
_DTYPES = common.DTYPES


@dataclass(frozen=True)
class LayerConfig:
    world_size: int = 8
    model: str = "8b"
    tokens: int = PHASES["training"]  # T, all ranks together
    scale: int = 1  # divide T, h and ffn by this (CPU runs)
    strategies: tuple[str, ...] | None = None  # None: "auto" and every runnable strategy
    iters: int = 10
    warmup: int = 3
    device: str = "auto"
    bed: int = 0
    dtype: str = "auto"
    asynctp: bool = True  # try the torch.compile async-TP variant (GPU only)


def quick_layer_config(on_gpu: bool = False, **overrides) -> LayerConfig:
    """``--quick``: two ranks, 8B block; on CPU scaled 1/64 (T = 256, h = 64, ffn = 224)."""
    base = LayerConfig(world_size=2, iters=5 if not on_gpu else 10, warmup=2, scale=1 if on_gpu else 64,
                       tokens=PHASES["prefill" if on_gpu else "training"])
    return replace(base, **overrides)


def _sizes(cfg: LayerConfig, world_size: int) -> tuple[int, int, int]:
    """(T, h, ffn) after scaling, T and ffn rounded down to multiples of W (at least W)."""
    if cfg.model not in MODELS:
        raise ValueError(f"model: unknown model {cfg.model!r}; choose from {sorted(MODELS)}")
    h, ffn = MODELS[cfg.model]
    tokens = max(world_size, cfg.tokens // cfg.scale // world_size * world_size)
    ffn = max(world_size, ffn // cfg.scale // world_size * world_size)
    return tokens, max(1, h // cfg.scale), ffn


class TPLlamaMLP(nn.Module):
    """The block with tpfuse layers: fc1 column parallel (gate and up fused), fc2 row parallel."""

    def __init__(self, hidden: int, ffn: int, strategy: str, dtype: torch.dtype, device: torch.device):
        super().__init__()
        from tpfuse.nn import ColumnParallelLinear, RowParallelLinear

        self.fc1 = ColumnParallelLinear(hidden, 2 * ffn, bias=False, strategy=strategy, dtype=dtype, device=device)
        self.fc2 = RowParallelLinear(ffn, hidden, bias=False, strategy=strategy, dtype=dtype, device=device)

    def forward(self, x_shard: torch.Tensor) -> torch.Tensor:
        gate, up = self.fc1(x_shard).chunk(2, dim=-1)
        return self.fc2(F.silu(gate) * up)


class TorchLlamaMLP(nn.Module):
    """The same block as users write it today: functional collectives (input dtype) + ``F.linear``.
    ``communicate=False`` drops the collectives (each rank computes on local shards only)."""

    def __init__(self, hidden: int, ffn: int, world_size: int, dtype: torch.dtype, device: torch.device,
                 communicate: bool = True):
        super().__init__()
        self.w1 = nn.Parameter(torch.randn(2 * ffn // world_size, hidden, dtype=dtype, device=device) / math.sqrt(hidden))
        self.w2 = nn.Parameter(torch.randn(hidden, ffn // world_size, dtype=dtype, device=device) / math.sqrt(ffn))
        self.world_size = world_size
        self.communicate = communicate
        self.group_name = dist.group.WORLD.group_name

    def forward(self, x_shard: torch.Tensor) -> torch.Tensor:
        import torch.distributed._functional_collectives as funcol

        if self.communicate:
            gather = getattr(funcol, "all_gather_single_autograd", None) or funcol.all_gather_tensor_autograd
            x = funcol.wait_tensor(gather(x_shard, 0, self.group_name))  # waited: no collective left in flight
        else:
            x = x_shard.repeat(self.world_size, 1)
        gate, up = F.linear(x, self.w1).chunk(2, dim=-1)
        y = F.linear(F.silu(gate) * up, self.w2)
        if not self.communicate:
            return y[: x_shard.shape[0]]
        scatter = getattr(funcol, "reduce_scatter_single_autograd", None) or funcol.reduce_scatter_tensor_autograd
        return funcol.wait_tensor(scatter(y, "sum", 0, self.group_name))


@contextlib.contextmanager
def _micro_pipeline_tp():
    """Inductor's micro-pipeline TP (async-TP) pass on while compiling and running (restored after)."""
    import torch._inductor.config as inductor_config

    old = inductor_config._micro_pipeline_tp
    inductor_config._micro_pipeline_tp = True
    try:
        yield
    finally:
        inductor_config._micro_pipeline_tp = old


@dataclass(frozen=True)
class _LayerJob:
    cfg: LayerConfig
    mode: str
    dtype: str


def layer_job(rank: int, world_size: int, job: _LayerJob) -> dict:
    """Runs on every rank: per-step ms of every variant (or the reason it did not run)."""
    from tpfuse import strategies
    from tpfuse._dist import group_context
    from tpfuse.ops import resolve_strategy

    cfg = job.cfg
    device = torch.device("cuda", torch.cuda.current_device()) if job.mode != "cpu-gloo" else torch.device("cpu")
    dtype = _DTYPES[job.dtype]
    tokens, hidden, ffn = _sizes(cfg, world_size)
    ctx = group_context(None)
    runnable = strategies.runnable(ctx, device, dtype)
    names = cfg.strategies if cfg.strategies is not None else ("auto", *runnable)
    g = torch.Generator(device=device).manual_seed(17 + rank)
    sets = 2 if device.type == "cuda" else 1
    xs = [torch.randn(tokens // world_size, hidden, generator=g, device=device, dtype=dtype).requires_grad_(True)
          for _ in range(sets)]
    grads = [torch.randn(tokens // world_size, hidden, generator=g, device=device, dtype=dtype) for _ in range(sets)]
    # What "auto" picks for fc1's ag_gemm and fc2's gemm_rs at these shapes.
    probe_a = torch.empty((), dtype=dtype, device=device).expand(tokens // world_size, hidden)
    probe_b = torch.empty((), dtype=dtype, device=device).expand(hidden, 2 * ffn // world_size)
    probe_c = torch.empty((), dtype=dtype, device=device).expand(tokens, ffn // world_size)
    probe_d = torch.empty((), dtype=dtype, device=device).expand(ffn // world_size, hidden)
    auto = (resolve_strategy("ag_gemm", "auto", probe_a, probe_b, ctx),
            resolve_strategy("gemm_rs", "auto", probe_c, probe_d, ctx))
    resolved = f"fc1 {auto[0]}, fc2 {auto[1]}"
    blocks: dict[str, nn.Module | None] = {}
    skipped: dict[str, str] = {}
    bed = job.mode == "one-gpu-bed"
    for s in names:
        if s != "auto" and s not in runnable:
            skipped[f"tpfuse:{s}"] = strategies.why_unavailable(s, ctx, device, dtype) or "not runnable here"
        elif bed and not set(auto if s == "auto" else (s,)) <= set(symmetric_strategies()):
            picked = f"auto resolved to {resolved}, which" if s == "auto" else s
            skipped[f"tpfuse:{s}"] = f"{picked} sends CUDA tensors through the process group, and the bed's group is gloo"
        else:
            blocks[f"tpfuse:{s}"] = TPLlamaMLP(hidden, ffn, s, dtype, device)
    if bed:
        skipped["unfused"] = "one-GPU bed: its gloo group cannot carry CUDA tensors (and NCCL refuses two ranks on one GPU)"
    else:
        blocks["unfused"] = TorchLlamaMLP(hidden, ffn, world_size, dtype, device)
    blocks["compute_only"] = TorchLlamaMLP(hidden, ffn, world_size, dtype, device, communicate=False)
    if device.type != "cuda":
        skipped["asynctp"] = "no CUDA (PyTorch async-TP needs CUDA symmetric memory)"
    elif not cfg.asynctp:
        skipped["asynctp"] = "async-TP variant off (--no-asynctp)"
    else:
        why = common.attempt(lambda: common.enable_symmetric_memory(ctx.group_name))  # agreed: every rank or none
        if why is None:
            blocks["asynctp"] = torch.compile(TorchLlamaMLP(hidden, ffn, world_size, dtype, device), fullgraph=True)
        else:
            skipped["asynctp"] = f"symmetric memory unavailable: {why}"

    out: dict[str, dict] = {}
    working = {}
    for name, block in blocks.items():
        params = list(block.parameters())
        # The async-TP pass must be on when the compiled block (re)compiles: every call is inside.
        flag = _micro_pipeline_tp if name == "asynctp" else contextlib.nullcontext

        def step(i: int, block=block, params=params, flag=flag) -> None:
            for p in params:
                p.grad = None
            xs[i % sets].grad = None
            with flag():
                block(xs[i % sets]).backward(grads[i % sets])

        reason = common.attempt(lambda step=step: step(0))
        if reason is None:
            working[name] = step
        else:
            out[name] = {"reason": reason}
    for name, (times, _) in common.timed_rounds(working, cfg.iters, cfg.warmup, device).items():
        out[name] = {"times": times}
    for name, step in working.items():   # the same step as one CUDA graph replay (tpfuse variants)
        if name.startswith("tpfuse:"):
            times, why = common.graph_timed(step, cfg.iters, device)
            out[name]["graph"] = {"times": times} if times else {"reason": why}
    out.update({name: {"reason": why} for name, why in skipped.items()})
    order = [f"tpfuse:{s}" for s in names] + ["unfused", "asynctp", "compute_only"]
    return {"variants": {name: out[name] for name in order}, "sizes": (tokens, hidden, ffn), "resolved": resolved,
            "checks": common.checks_on(device)}


def run_layer_bench(cfg: LayerConfig, progress=None, ranks=None) -> dict:
    """Run the block variants on the ranks; returns ``{"meta", "rows"}``."""
    setup, dtype = common.setup_and_dtype(cfg.world_size, cfg.device, cfg.bed, cfg.dtype, ranks)
    tokens, hidden, ffn = _sizes(cfg, setup.world_size)
    meta = common.bench_meta(setup, dtype=dtype, config=asdict(cfg), tokens=tokens, hidden=hidden, ffn=ffn,
                             timing="one step = forward + backward (input and weight grads); barrier before "
                                    "each step; the slowest rank's time; median over iters")
    if progress is not None:
        progress(0, 1, f"layer {cfg.model} T={tokens} h={hidden} ffn={ffn}")
    opened = contextlib.nullcontext(_as_ranks(ranks)) if ranks is not None else common.open_ranks(setup)
    with opened as pool:
        per_rank = pool.run(layer_job, _LayerJob(cfg, setup.mode, dtype), timeout=1800)
    if progress is not None:
        progress(1, 1, "done")
    rows = _layer_rows(per_rank, cfg.model, dtype, setup.world_size)
    meta["checks"] = per_rank[0]["checks"]
    return {"meta": meta, "rows": rows}


def _layer_rows(per_rank: list[dict], model: str, dtype: str, world_size: int) -> list[dict]:
    tokens, hidden, ffn = per_rank[0]["sizes"]
    ms: dict[str, float | None] = {}
    spread: dict[str, float | None] = {}
    why: dict[str, str] = {}
    for name in per_rank[0]["variants"]:
        entries = [r["variants"][name] for r in per_rank]
        failed = next((e["reason"] for e in entries if "reason" in e), None)
        ms[name] = None if failed else common.slowest_median([e["times"] for e in entries])
        spread[name] = None if failed else common.spread_pct([e["times"] for e in entries])
        if failed:
            why[name] = failed
    rows = []
    for name, value in ms.items():
        reasons = {"ms": why[name]} if name in why else {}
        row = {"variant": name, "strategy": name.split(":", 1)[1] if name.startswith("tpfuse:") else None,
               "resolved": per_rank[0]["resolved"] if name == "tpfuse:auto" else None, "model": model,
               "tokens": tokens, "hidden": hidden, "ffn": ffn, "world_size": world_size, "dtype": dtype, "ms": value,
               "spread_pct": spread[name],
               "tokens_per_s_per_rank": None if value is None else (tokens / world_size) / (value / 1e3)}
        if value is None:
            reasons["tokens_per_s_per_rank"] = reasons["spread_pct"] = reasons["ms"]
        elif spread[name] is None:
            reasons["spread_pct"] = "fewer than 4 timed steps"
        for field, base in (("speedup_vs_unfused", "unfused"), ("speedup_vs_asynctp", "asynctp")):
            if value is None or ms[base] is None:
                row[field] = None
                missing = "ms" if value is None else base
                reasons[field] = f"{missing} not measured ({why.get(name if value is None else base, 'null')})"
            else:
                row[field] = ms[base] / value
        row["graph_ms"] = row["eager_over_graph"] = None
        if name.startswith("tpfuse:") and value is not None:
            graphs = [r["variants"][name].get("graph", {"reason": "not captured"}) for r in per_rank]
            failed = next((g["reason"] for g in graphs if "reason" in g), None)
            if failed is None:
                row["graph_ms"] = common.slowest_median([g["times"] for g in graphs])
                row["eager_over_graph"] = value / row["graph_ms"]
            else:
                reasons["graph_ms"] = reasons["eager_over_graph"] = failed
        else:
            why_not = ("ms not measured" if value is None else "only the tpfuse variants are replayed as graphs")
            reasons["graph_ms"] = reasons["eager_over_graph"] = why_not
        row["reasons"] = reasons
        rows.append({k: row[k] for k in LAYER_ROW_FIELDS})
    return rows


def format_layer_rows(result: dict) -> list[list[str]]:
    def fmt(v, spec=".3f"):
        return "-" if v is None else format(v, spec)

    table = [["variant", "ms / step", "spread", "tokens/s/rank", "x unfused", "x asynctp", "graph ms", "eager / graph"]]
    for r in result["rows"]:
        name = r["variant"] + (f" ({r['resolved']})" if r["resolved"] else "")
        spread = "-" if r["spread_pct"] is None else f"{r['spread_pct']:.0f}%"
        table.append([name, fmt(r["ms"]), spread, fmt(r["tokens_per_s_per_rank"], ".0f"), fmt(r["speedup_vs_unfused"], ".2f"),
                      fmt(r["speedup_vs_asynctp"], ".2f"), fmt(r.get("graph_ms")), fmt(r.get("eager_over_graph"), ".2f")])
    return table

