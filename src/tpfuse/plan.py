"""The planner: pick a strategy and chunking per shape from the cost model and the tuning cache.

    from tpfuse.plan import plan, choose, record_measurement
    p = plan("ag_gemm", m=16384, n=7168, k=8192, world_size=8, dtype="bf16", hardware="h200")
    print(p.strategy, p.num_chunks, p.predicted_ms, p.explain())

``m`` is the full M; ``n`` and ``k`` are this rank's local sizes (as the ops take them).
``plan`` predicts every strategy ("unfused", "ring", "copy_engine", "fused") with the pipeline
simulator (``tpfuse.model.simulate``), each with the chunking it runs (fused ag_gemm's pieces per
rank from ``tpfuse.model.knobs.fused_ag_chunks_per_rank``, the function fused dispatches with),
and picks the fastest.
``choose`` is what ``strategy="auto"`` calls on every op call: the same, restricted to the
strategies the environment can run, cached, and with measured times from the tuning cache
(``record_measurement``) overriding predictions.

Note: ``tpfuse/__init__.py`` re-exports the function ``plan``, which shadows this module as the
attribute ``tpfuse.plan``; import names from it with ``from tpfuse.plan import ...``.
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import os
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Mapping

from tpfuse.model import cost, knobs
from tpfuse.model.hardware import HardwareProfile, get_profile
from tpfuse.model.simulate import OPS, STRATEGIES, SimResult, built_num_chunks, draw_timeline, simulate
from tpfuse import strategies
from tpfuse.tuning import CACHE as _CACHE, cache_key as _cache_key, tuning_cache_path

# A strategy other than unfused is chosen on model predictions alone only if it is predicted at
# least this much faster.  Measured on 2x H200 (BENCHMARKS.md, 2026-11-30): ring predicted within
# 0.1% of unfused on 8b-training-fc1 ran 7% slower (per-step launches and host time).
MIN_MODEL_GAIN = 0.05

__all__ = [
    "Plan",
    "plan",
    "choose",
    "record_measurement",
    "tuning_cache_path",
    "canonical_dtype",
    "tp_sizes",
    "add_plan_arguments",
    "run_plan_cli",
]

_DTYPE_NAMES = {
    "bf16": "bf16", "bfloat16": "bf16",
    "fp16": "fp16", "float16": "fp16", "half": "fp16",
    "fp32": "fp32", "float32": "fp32", "float": "fp32",
    "fp64": "fp64", "float64": "fp64", "double": "fp64",
    "fp8": "fp8", "float8_e4m3fn": "fp8", "float8_e5m2": "fp8",
}


def canonical_dtype(dtype: Any) -> str:
    """``torch.bfloat16`` / ``"bfloat16"`` / ``"bf16"`` -> ``"bf16"`` (likewise fp16, fp32, fp64, fp8)."""
    name = str(dtype).removeprefix("torch.").lower() if dtype is not None else "None"
    if name not in _DTYPE_NAMES:
        raise ValueError(f"dtype: {dtype!r} is not supported; use torch.bfloat16, torch.float16, "
                         "torch.float32 or torch.float64 (or 'bf16', 'fp16', 'fp32', 'fp64')")
    return _DTYPE_NAMES[name]


def _check_int(name: str, value: Any, minimum: int, maximum: int | None = None, why: str = "") -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name}: expected an int, got {type(value).__name__} {value!r}")
    if value < minimum:
        raise ValueError(f"{name}: {value} must be >= {minimum}")
    if maximum is not None and value > maximum:
        shown = value if value < 10**30 else f"{str(value)[:6]}... ({len(str(value))} digits)"
        raise ValueError(f"{name}: {shown} is larger than {maximum}{why}")
    return value


# The largest group tpfuse plans for: the symmetric-memory workspace's flag region holds 4 words
# per rank in 4 KiB (tpfuse.symm.MAX_WORLD_SIZE), and a plan replays every rank's chunks, so the
# planner's time grows with W (~30 ms at W = 256 on one CPU core).
MAX_WORLD_SIZE = 256
# A tensor larger than this describes no real call (the largest profile's GPU has 192 GB); checked
# so that absurd sizes fail at once instead of overflowing the model's arithmetic.
MAX_TENSOR_BYTES = 2**40
_INT64_MAX = 2**63 - 1


def _check_sizes(op: str, m: int, n: int, k: int, world_size: int, dtype: str) -> None:
    """Every tensor of the call (a or a_shard, b, c or c_shard) fits int64 and ``MAX_TENSOR_BYTES``."""
    elt = {"fp8": 1, "bf16": 2, "fp16": 2, "fp32": 4, "fp64": 8}.get(dtype, 8)
    rows = m // world_size
    tensors = {"ag_gemm": (("a_shard [M/W, K]", rows, k), ("b [K, N]", k, n), ("c [M, N]", m, n)),
               "gemm_rs": (("a [M, K]", m, k), ("b [K, N]", k, n), ("c_shard [M/W, N]", rows, n)),
               "gemm_ar": (("a [M, K]", m, k), ("b [K, N]", k, n), ("c [M, N]", m, n))}[op]
    for name, r, c in tensors:
        size = r * c * elt
        if size > MAX_TENSOR_BYTES or r * c > _INT64_MAX:
            raise ValueError(f"{op}: {name} = [{r}, {c}] would take {size / 2**30:.4g} GiB of {dtype}, more than "
                             f"the {MAX_TENSOR_BYTES // 2**30} GiB a plan accepts (no GPU holds it); check m, n and k")


def _validate(op, m, n, k, world_size, dtype, hardware) -> tuple[str, HardwareProfile]:
    if op not in OPS:
        raise ValueError(f"op: unknown op {op!r}; use one of {', '.join(OPS)}")
    for name, value in (("m", m), ("n", n), ("k", k)):
        _check_int(name, value, 0, _INT64_MAX, " (int64)")
    _check_int("world_size", world_size, 1, MAX_WORLD_SIZE,
               " (the most ranks tpfuse plans for: its symmetric workspace holds 256)")
    dtype_name, hw = canonical_dtype(dtype), get_profile(hardware)
    from tpfuse._checks import check_m_divisible  # the ops' own rule and message

    check_m_divisible(op, m, world_size)
    _check_sizes(op, m, n, k, world_size, dtype_name)
    return dtype_name, hw


@dataclass(frozen=True)
class Plan:
    """The planner's decision for one op call shape, with every candidate's prediction.

    ``predicted_ms``: strategy -> ms; ``chunks``: strategy -> the communication chunks it runs
    with (along the full M: copy_engine and fused one per rank, W x ``chunks_per_rank`` for
    fused ag_gemm; gemm_ar one-shot 1).
    ``breakdown``: ``gemm_ms`` (the whole local GEMM alone) and ``comm_ms`` (the collective alone
    on the op's dtype by its fastest transport -- NCCL, copy engine or the fused GEMM's SM stores; not what
    tpfuse's unfused pays, which reduces bf16/fp16 partials in fp32 plus two cast passes; both
    strategy-independent, ``comm_ms`` 0 at world_size 1; no strategy is predicted below
    ``max(gemm_ms, comm_ms)``), ``model_ms`` = ``fill_ms`` + ``steady_ms`` + ``drain_ms`` (the
    chosen strategy's simulated pipeline on its critical rank; equal to its ``predicted_ms`` unless
    that was measured), ``host_ms`` (host dispatch and launch time on that rank while neither
    device engine works: 0 under CUDA graphs), ``exposed_comm_ms`` (prediction minus GEMM alone
    minus ``host_ms``, never more than ``comm_ms``) and ``baseline_ms`` (the stock baseline: the
    NCCL collective on the op's dtype plus one GEMM, what ``tpfuse bench`` calls ``unfused_ms``;
    :attr:`speedup` compares with it).
    ``cuda_graph``: planned for graph replay (no host costs) instead of eager calls.
    ``modelled_ms``: strategies not in this build, predicted for show (``plan(modelled=True)``).
    ``num_sms``: the chosen strategy's persistent GEMM grid (fused:
    ``tpfuse.model.knobs.fused_sm_budget``, every SM but one; 0 for the others).  ``chunks_per_rank``:
    pieces each rank's shard is cut into (fused ag_gemm: ``knobs.fused_ag_chunks_per_rank``,
    what fused dispatches with; 1 otherwise).  ``measured``: strategies whose time came from
    the tuning cache instead of the model.
    """

    op: str
    strategy: str
    num_chunks: int
    m: int
    n: int
    k: int
    world_size: int
    dtype: str
    hardware: str
    num_sms: int
    predicted_ms: Mapping[str, float] = field(compare=False)
    chunks: Mapping[str, int] = field(compare=False)
    breakdown: Mapping[str, float] = field(compare=False)
    measured: tuple[str, ...] = ()
    reason: str = ""
    cuda_graph: bool = False
    modelled_ms: Mapping[str, float] = field(default_factory=dict, compare=False)
    chunks_per_rank: int = 1

    @property
    def chunk_m(self) -> int:
        """Rows of one communication chunk (of the full M)."""
        return math.ceil(self.m / self.num_chunks) if self.num_chunks else self.m

    @property
    def speedup(self) -> float:
        """The stock baseline (``breakdown["baseline_ms"]``: NCCL collective on the op's dtype +
        one GEMM, what users run without tpfuse) over the chosen strategy's predicted time."""
        chosen = self.predicted_ms[self.strategy]
        baseline = self.breakdown.get("baseline_ms", 0.0)
        return baseline / chosen if chosen > 0 and baseline > 0 else 1.0

    @property
    def bound(self) -> str:
        """Which side limits the overlapped pipeline: "gemm", "comm" or "none" (no comm)."""
        if self.breakdown["comm_ms"] == 0:
            return "none"
        return "gemm" if self.breakdown["gemm_ms"] >= self.breakdown["comm_ms"] else "comm"

    def to_dict(self) -> dict:
        d = asdict(self)
        d.update(predicted_ms=dict(self.predicted_ms), chunks=dict(self.chunks),
                 breakdown=dict(self.breakdown), measured=list(self.measured),
                 modelled_ms=dict(self.modelled_ms),
                 chunk_m=self.chunk_m, speedup=self.speedup, bound=self.bound)
        return d

    def _pieces(self) -> str:
        if self.world_size == 1 or strategies.model(self.strategy).kind != "pipeline" or self.op == "gemm_ar":
            return ""
        c = self.chunks_per_rank
        return f"; {c} piece{'s' if c > 1 else ''} per rank"

    def explain(self) -> str:
        """Why this strategy: the shape, the two costs it overlaps, every candidate's time."""
        b = self.breakdown
        coll = {"ag_gemm": "all-gather", "gemm_rs": "reduce-scatter", "gemm_ar": "all-reduce"}[self.op]
        lines = [
            f"{self.op} m={self.m} n={self.n} k={self.k} world_size={self.world_size} {self.dtype} "
            f"on {self.hardware}: chose {self.strategy!r} with {self.num_chunks} chunk(s) "
            f"(chunk_m={self.chunk_m}{self._pieces()}), {self.predicted_ms[self.strategy]:.4f} ms vs the stock "
            f"baseline {b['baseline_ms']:.4f} ms ({self.speedup:.2f}x; the NCCL {coll} on {self.dtype} + one "
            f"GEMM, what `tpfuse bench` calls unfused_ms).",
            f"  GEMM alone {b['gemm_ms']:.4f} ms, {coll} alone {b['comm_ms']:.4f} ms "
            f"({'no communication' if self.bound == 'none' else self.bound + '-bound'}), host "
            f"{b['host_ms']:.4f} ms exposed, {coll} {b['exposed_comm_ms']:.4f} ms exposed; "
            f"chosen pipeline (model, {'CUDA graph' if self.cuda_graph else 'eager'}): fill {b['fill_ms']:.4f} "
            f"+ steady {b['steady_ms']:.4f} + drain {b['drain_ms']:.4f} = {b['model_ms']:.4f} ms.",
            f"  Why: {self.reason}",
            "  Candidates: " + ", ".join(
                f"{s} {ms:.4f} ms" + (f" ({self.chunks[s]} chunks)" if s != "unfused" else " (tpfuse's)")
                + (" [measured]" if s in self.measured else "")
                for s, ms in sorted(self.predicted_ms.items(), key=lambda kv: kv[1])),
        ]
        if self.modelled_ms:
            lines.append("  Modelled only (not in this build, never chosen): " + ", ".join(
                f"{s} {ms:.4f} ms" for s, ms in sorted(self.modelled_ms.items(), key=lambda kv: kv[1])))
        return "\n".join(lines)


def _simulate(op, strategy, m, n, k, w, dtype, hw, num_chunks, cuda_graph=False, fast=False) -> SimResult:
    return simulate(op, strategy, m=m, n=n, k=k, world_size=w, dtype=dtype, hw=hw,
                    num_chunks=num_chunks, cuda_graph=cuda_graph, fast=fast)


def _num_sms(strategy: str, w: int, hw: HardwareProfile) -> int:
    """The persistent GEMM grid the strategy runs (fused: every SM on a multi-GPU machine)."""
    sched = strategies.model(strategy)
    persistent = sched.kind == "pipeline" and not sched.separate_kernels
    return knobs.fused_sm_budget(hw, w) if persistent and w > 1 else 0


@functools.lru_cache(maxsize=4096)
def _best_per_strategy(op, m, n, k, w, dtype, hw: HardwareProfile, strategy, cuda_graph=False,
                       ) -> tuple[float, int, SimResult]:
    """(ms, num_chunks, result) of the strategy as it runs: the chunking it is built with
    (``simulate.built_num_chunks``: fused ag_gemm's pieces per rank come from the same
    ``knobs.fused_ag_chunks_per_rank`` that fused dispatches with).  Replays one rank
    (``simulate(fast=True)``): ranks are symmetric without skew."""
    nc = built_num_chunks(op, strategy, m=m, n=n, k=k, world_size=w, dtype=dtype, hw=hw, cuda_graph=cuda_graph)
    res = _simulate(op, strategy, m, n, k, w, dtype, hw, nc, cuda_graph, fast=True)
    return res.makespan_ms, nc, res


def _comm_alone_ms(op, m, n, k, w, dtype, hw: HardwareProfile) -> float:
    """The collective alone on ``dtype`` data by its fastest transport: NCCL (measured at this W
    where the profile has it), copy engine, or SM stores by the fused GEMM's grid.  Strategy-
    independent and a floor for all of them: unfused and ring move fp32 partials for bf16/fp16
    reductions (more bytes, plus casts), copy_engine/fused move the op's dtype."""
    if w <= 1 or m <= 0:
        return 0.0
    return min(cost.collective_ms(op, m, n, k, w, dtype, hw),
               cost.p2p_collective_ms(op, m, n, k, w, dtype, hw, "ce"),
               cost.p2p_collective_ms(op, m, n, k, w, dtype, hw, "sm", num_sms=knobs.fused_sm_budget(hw, w)))


def _reason(op, strategy, w, predicted, gemm_ms, comm_ms, measured, margin_kept=False, *,
            empty=False, multi_node=False, cuda_graph=False) -> str:
    """Why the chosen strategy, in sentences whose numbers add up (hidden <= the collective)."""
    if w == 1:
        return "world_size is 1: there is no communication to overlap, so the plain GEMM (unfused) is used."
    if empty:
        return "the GEMM is empty (m, n or k is 0): there is nothing to overlap, so unfused runs it."
    src = " (measured times from the tuning cache)" if measured else ""
    where = (f"world_size {w} spans hosts (more than one NVLink domain), so only the NCCL strategies "
             "(unfused, ring) are candidates; " if multi_node else "")
    mode = "CUDA-graph replay (no host time)" if cuda_graph else "eager calls (host dispatch and launches included)"
    if margin_kept:
        best = min((s for s in predicted if s != "unfused"), key=lambda s: predicted[s])
        gain = 1.0 - predicted[best] / predicted["unfused"]
        return (f"{where}{best} is predicted only {100 * gain:.1f}% faster than unfused, under the "
                f"{100 * MIN_MODEL_GAIN:.0f}% margin a model-only prediction must clear (host launch "
                "and per-step costs the model does not see ate such wins on 2x H200); unfused is kept. "
                "A measurement in the tuning cache (tpfuse.plan.record_measurement) overrides this.")
    if strategy == "unfused":
        return (f"{where}no overlapped strategy is predicted faster{src} for {mode}: the {comm_ms:.4f} ms "
                "of communication is too small to pay for per-chunk latencies, flags, extra launches and "
                "smaller GEMMs.")
    exposed = min(comm_ms, max(0.0, predicted[strategy] - gemm_ms))
    hidden = comm_ms - exposed
    saved = predicted["unfused"] - predicted[strategy]
    bound = "GEMM" if gemm_ms >= comm_ms else "communication"
    how = strategies.description(strategy)
    return (f"{where}{strategy} ({how}) takes {predicted[strategy]:.4f} ms{src} for {mode}, "
            f"{predicted[strategy] - gemm_ms:.4f} ms beyond the {gemm_ms:.4f} ms GEMM: it hides "
            f"{hidden:.4f} ms of the {comm_ms:.4f} ms collective and saves {saved:.4f} ms against "
            f"unfused (which also pays its own casts, fp32 partials and launches); the pipeline is "
            f"{bound}-bound, the best possible is max(GEMM, comm) = {max(gemm_ms, comm_ms):.4f} ms.")


# Strategies that run only the op's fast dtypes (DESIGN §1: float64 is for unfused and ring).
_FAST_DTYPE_ONLY = ("copy_engine", "fused")
# What a group spanning hosts can run (DESIGN §3: symmetric memory only inside one NVLink domain).
_NCCL_STRATEGIES = ("unfused", "ring")


# fused's Triton GEMM would multiply float32 in TF32: it refuses float32 (strategies/fused.py).
_NO_FP32 = ("fused",)


def _runnable_dtype(candidates: tuple[str, ...], dtype: str) -> tuple[str, ...]:
    """``candidates`` without the strategies that cannot run ``dtype`` (float64: unfused and ring
    only; float32: not fused)."""
    if dtype == "fp64":
        return tuple(s for s in candidates if s not in _FAST_DTYPE_ONLY)
    if dtype == "fp32":
        return tuple(s for s in candidates if s not in _NO_FP32)
    return candidates


def _critical_rank(res: SimResult):
    """The rank whose end is the makespan (its fill + steady + drain is the prediction)."""
    return max(res.ranks, key=lambda r: (r.end, -r.rank))


def _exposed_host_ms(res: SimResult, rank: int) -> float:
    """Time on ``rank``'s timeline when its host works (dispatch, launches) and neither device
    engine does: the host time the prediction pays on top of the GEMM and the communication."""
    def union(engines: tuple[str, ...]) -> list[tuple[float, float]]:
        spans = sorted((t.start, t.end) for t in res.tasks
                       if t.rank == rank and t.engine in engines and t.end > t.start)
        out: list[tuple[float, float]] = []
        for lo, hi in spans:
            if out and lo <= out[-1][1]:
                out[-1] = (out[-1][0], max(out[-1][1], hi))
            else:
                out.append((lo, hi))
        return out

    device = union(("gemm", "comm"))
    exposed = 0.0
    for lo, hi in union(("host",)):
        covered = sum(max(0.0, min(hi, d_hi) - max(lo, d_lo)) for d_lo, d_hi in device if d_lo < hi and d_hi > lo)
        exposed += (hi - lo) - covered
    return exposed


def _stock_baseline_ms(op, m, n, k, w, dtype, hw: HardwareProfile, gemm_ms: float, cuda_graph: bool) -> float:
    """What users run without tpfuse, by the same model: the NCCL collective on the op's dtype plus
    one GEMM, issued as two eager calls (the first call's host time is exposed, the second is
    issued while the first runs; none under CUDA graphs) -- what ``tpfuse bench`` times as
    ``unfused_ms``.  tpfuse's own ``unfused`` strategy differs (fp32 partials, casts, dispatch)."""
    if m * n * k == 0 and gemm_ms == 0.0:
        return 0.0
    coll = cost.collective_ms(op, m, n, k, w, dtype, hw) if w > 1 and m > 0 else 0.0
    return gemm_ms + coll + (0.0 if cuda_graph else hw.host_call_us * 1e-3)


def _make_plan(op, m, n, k, w, dtype, hw: HardwareProfile, candidates: tuple[str, ...],
               measured: Mapping[str, float], *, cuda_graph: bool = False,
               modelled: tuple[str, ...] = ()) -> Plan:
    multi_node = w > hw.max_domain
    candidates = _runnable_dtype(tuple(candidates), dtype)
    if multi_node:
        candidates = tuple(s for s in candidates if s in _NCCL_STRATEGIES)
    candidates = tuple(s for s in STRATEGIES if s in candidates or s == "unfused")
    modelled = tuple(s for s in _runnable_dtype(modelled, dtype) if s not in candidates
                     and not (multi_node and s not in _NCCL_STRATEGIES))
    gemm_ms = cost.gemm_time_ms(m, n, k, dtype, hw) if m > 0 else 0.0
    comm_ms = _comm_alone_ms(op, m, n, k, w, dtype, hw)
    predicted, chunks, results = {}, {}, {}
    for s in candidates:
        predicted[s], chunks[s], results[s] = _best_per_strategy(op, m, n, k, w, dtype, hw, s, cuda_graph)
    modelled_ms = {s: _best_per_strategy(op, m, n, k, w, dtype, hw, s, cuda_graph)[0] for s in modelled}
    used = tuple(s for s in candidates if s in measured)
    for s in used:
        predicted[s] = float(measured[s])
    margin_kept = False
    empty = m * n * k == 0
    if w == 1 or empty:
        chosen = "unfused"
    else:
        # deterministic: fastest; ties go to the earlier (simpler) strategy in STRATEGIES order
        chosen = min(candidates, key=lambda s: (round(predicted[s], 9), STRATEGIES.index(s)))
        # A model-only win must be clear: within MIN_MODEL_GAIN of unfused, keep unfused
        # (measured times from the tuning cache are taken as they are).
        if (chosen != "unfused" and not (chosen in used and "unfused" in used)
                and predicted[chosen] > predicted["unfused"] * (1.0 - MIN_MODEL_GAIN)):
            chosen, margin_kept = "unfused", True
    res = results[chosen]
    crit = _critical_rank(res)
    comm_ms = comm_ms if w > 1 else 0.0
    host_ms = _exposed_host_ms(res, crit.rank)
    breakdown = {"gemm_ms": gemm_ms, "comm_ms": comm_ms, "host_ms": host_ms,
                 "model_ms": res.makespan_ms, "fill_ms": crit.fill, "steady_ms": crit.steady,
                 "drain_ms": crit.drain,
                 "exposed_comm_ms": min(comm_ms, max(0.0, predicted[chosen] - gemm_ms - host_ms)),
                 "baseline_ms": _stock_baseline_ms(op, m, n, k, w, dtype, hw, gemm_ms, cuda_graph)}
    sched = strategies.model(chosen)
    per_rank = chunks[chosen] // w if sched.kind == "pipeline" and op != "gemm_ar" and w > 1 else 1
    return Plan(op=op, strategy=chosen, num_chunks=chunks[chosen], m=m, n=n, k=k, world_size=w,
                dtype=dtype, hardware=hw.name, num_sms=_num_sms(chosen, w, hw), chunks_per_rank=per_rank,
                predicted_ms=predicted, chunks=chunks, breakdown=breakdown, measured=used,
                reason=_reason(op, chosen, w, predicted, gemm_ms, comm_ms, used, margin_kept,
                               empty=empty, multi_node=multi_node, cuda_graph=cuda_graph),
                cuda_graph=cuda_graph, modelled_ms=modelled_ms)


_TORCH_DTYPES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32", "fp64": "float64"}


def _runnable_for_group(group: Any, world_size: int, dtype: str, built: tuple[str, ...]) -> tuple[str, ...]:
    import torch

    from tpfuse import strategies
    from tpfuse._dist import group_context

    ctx = group_context(group)
    if ctx.world_size != world_size:
        raise ValueError(f"world_size: {world_size} but the group has {ctx.world_size} ranks; pass "
                         f"world_size={ctx.world_size} (or no group)")
    if dtype not in _TORCH_DTYPES:
        return ("unfused",)
    device = torch.device("cuda", torch.cuda.current_device()) if ctx.device_type == "cuda" else torch.device("cpu")
    runnable = strategies.runnable(ctx, device, getattr(torch, _TORCH_DTYPES[dtype]))
    return tuple(s for s in built if s in runnable)


def _is_process_group(group: Any) -> bool:
    import torch.distributed as dist

    return dist.is_available() and isinstance(group, dist.ProcessGroup)


def implemented_strategies() -> tuple[str, ...]:
    """The strategies this build implements (asked of :mod:`tpfuse.strategies`), in planner order."""
    from tpfuse import strategies

    built = strategies.implemented()
    return tuple(s for s in STRATEGIES if s in built)


def plan(op: str, *, m: int, n: int, k: int, world_size: int, dtype: Any = "bf16",
         hardware: str | HardwareProfile = "h200", cuda_graph: bool = False,
         modelled: bool = False, group: Any = None) -> Plan:
    """Predict the strategies this build implements for one op shape and choose the fastest
    (model only, no tuning cache).

    ``m``: full M; ``n``, ``k``: this rank's local sizes; ``dtype``: torch dtype or name;
    ``hardware``: profile name (``tpfuse.model.hardware.PROFILES``) or a ``HardwareProfile``.
    ``cuda_graph``: the call is replayed from a CUDA graph (no host costs); default eager.
    ``modelled``: also predict the strategies not in this build (``Plan.modelled_ms``; never
    chosen).  Strategies that cannot run ``dtype`` (float64: unfused and ring only) or, above
    the profile's NVLink domain, need symmetric memory, are left out.  ``group``: a real
    ``torch.distributed`` ProcessGroup of ``world_size`` ranks: also leave out what this
    environment cannot run for it (``tpfuse.strategies.why_unavailable``, on the group's device).
    """
    dtype_name, hw = _validate(op, m, n, k, world_size, dtype, hardware)
    if not isinstance(cuda_graph, bool):
        raise TypeError(f"cuda_graph: expected a bool, got {type(cuda_graph).__name__} {cuda_graph!r}")
    if not isinstance(modelled, bool):
        raise TypeError(f"modelled: expected a bool, got {type(modelled).__name__} {modelled!r}; pass True or False")
    if group is not None and not _is_process_group(group):
        raise TypeError(f"group: expected a torch.distributed.ProcessGroup (or None: plan without one), got "
                        f"{type(group).__name__} {group!r}")
    built = implemented_strategies()
    if group is not None:
        built = _runnable_for_group(group, world_size, dtype_name, built)
    others = tuple(s for s in STRATEGIES if s not in built) if modelled else ()
    return _make_plan(op, m, n, k, world_size, dtype_name, hw, built, {}, cuda_graph=cuda_graph,
                      modelled=others)


# --- auto: choose() + tuning cache (tpfuse.tuning) -----------------------------------------------


def record_measurement(op: str, m: int, n: int, k: int, world_size: int, dtype: Any,
                       hardware: str | HardwareProfile, strategy: str, ms: float) -> None:
    """Store a measured time for (shape, strategy); ``choose`` then prefers it over the model."""
    dtype_name, hw = _validate(op, m, n, k, world_size, dtype, hardware)
    if strategy not in STRATEGIES:
        raise ValueError(f"strategy: unknown strategy {strategy!r}; use one of {STRATEGIES}")
    if not (isinstance(ms, (int, float)) and math.isfinite(ms) and ms > 0):
        raise ValueError(f"ms: {ms!r} must be a positive finite number of milliseconds")
    key = _cache_key(op, m, n, k, world_size, dtype_name, hw.name)
    fields = {"op": op, "m": m, "n": n, "k": k, "world_size": world_size, "dtype": dtype_name,
              "hardware": hw.name}
    _CACHE.record(key, fields, strategy, float(ms))


@functools.lru_cache(maxsize=8192)
def _choose_cached(op, m, n, k, w, dtype, hw, candidates, generation, path, cuda_graph=False) -> Plan:
    measured = _CACHE.measured(_cache_key(op, m, n, k, w, dtype, hw.name))
    return _make_plan(op, m, n, k, w, dtype, hw, candidates, measured, cuda_graph=cuda_graph)


def measured_times(op: str, *, m: int, n: int, k: int, world_size: int, dtype: Any,
                   hardware: str | HardwareProfile) -> dict[str, float]:
    """strategy -> median measured ms in this process's tuning cache for exactly this shape."""
    dtype_name, hw = _validate(op, m, n, k, world_size, dtype, hardware)
    _CACHE.current()
    return _CACHE.measured(_cache_key(op, m, n, k, world_size, dtype_name, hw.name))


def choose(op: str, *, m: int, n: int, k: int, world_size: int, dtype: Any,
           hardware: str | HardwareProfile, candidates: tuple[str, ...],
           measured: Mapping[str, float] | None = None, cuda_graph: bool = False) -> Plan:
    """``plan`` restricted to ``candidates`` (what this environment can run; "unfused" is always
    added), with measured times from the tuning cache overriding the model -- or from
    ``measured`` when given (the ops pass one rank's times so that every rank decides alike).
    Cached: cheap on every op call; a ``record_measurement`` or a change of ``TPFUSE_CACHE_DIR``
    invalidates it."""
    frozen_measured = None if measured is None else tuple(sorted(measured.items()))
    fast_key = (op, m, n, k, world_size, dtype, hardware, candidates, frozen_measured, cuda_graph,
                os.environ.get("TPFUSE_CACHE_DIR"), os.environ.get("HOME"))
    try:
        hit = _FAST.get(fast_key)
    except TypeError:  # an unhashable argument: let validation explain it
        hit, fast_key = None, None
    if hit is not None and hit[0] == _CACHE.generation:
        return hit[1]
    dtype_name, hw = _validate(op, m, n, k, world_size, dtype, hardware)
    cands = tuple(candidates)
    bad = [c for c in cands if c not in STRATEGIES]
    if bad:
        raise ValueError(f"candidates: unknown strategies {bad}; use names from {STRATEGIES}")
    cands = tuple(s for s in STRATEGIES if s in cands or s == "unfused")
    cands = _runnable_dtype(cands, dtype_name)
    generation, path = _CACHE.current()
    if frozen_measured is not None:
        result = _make_plan(op, m, n, k, world_size, dtype_name, hw, cands, dict(frozen_measured),
                            cuda_graph=cuda_graph)
    else:
        result = _choose_cached(op, m, n, k, world_size, dtype_name, hw, cands, generation, str(path),
                                cuda_graph)
    if fast_key is not None:
        if len(_FAST) > 8192:
            _FAST.clear()
        _FAST[fast_key] = (generation, result)
    return result


# (raw choose() arguments, cache location) -> (tuning-cache generation, Plan): skips validation
# and hashing the profile on the hot path (~1 us instead of ~30 us per op call).
_FAST: dict[tuple, tuple[int, Plan]] = {}


# --- CLI: `tpfuse plan` (tpfuse/cli.py calls these two) ---------------------------------------------
def tp_sizes(hw: HardwareProfile) -> tuple[int, ...]:
    """The TP degrees worth tabulating on a machine: 2/4/8, or 8..72 in an NVL72 domain."""
    if hw.max_domain >= 72:
        return (8, 16, 32, 72)
    return tuple(w for w in (2, 4, 8) if w <= hw.max_domain)


def add_plan_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of ``tpfuse plan``."""
    parser.add_argument("--op", choices=OPS, help="one cell: the op")
    parser.add_argument("--m", type=int, help="one cell: full M (tokens)")
    parser.add_argument("--n", type=int, help="one cell: local N")
    parser.add_argument("--k", type=int, help="one cell: local K")
    parser.add_argument("--world-size", type=int, help="TP degree W (with the matrix: only this W)")
    parser.add_argument("--dtype", default="bf16", help="bf16 (default), fp16, fp32, fp64")
    parser.add_argument("--hardware", default="h200", help="hardware profile (default h200)")
    parser.add_argument("--model", choices=("8b", "70b", "405b"), help="matrix: only this Llama-3 size")
    parser.add_argument("--phase", choices=("training", "prefill", "decode"), help="matrix: only this phase")
    parser.add_argument("--all", action="store_true", help="the whole workload matrix for the hardware")
    parser.add_argument("--timeline", metavar="OUT.png", help="draw the chosen strategy's simulated timeline")
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    parser.add_argument("--cuda-graph", action="store_true",
                        help="plan for CUDA-graph replay (no host costs) instead of eager calls")


def _check_cli_args(args) -> None:
    """Argument errors of ``tpfuse plan`` (one line each, before any work)."""
    if args.world_size is not None and args.world_size < 1:
        raise ValueError(f"--world-size: {args.world_size} must be >= 1 (the TP degree)")
    cell_args = {"--op": args.op, "--m": args.m, "--n": args.n, "--k": args.k}
    given = [name for name, value in cell_args.items() if value is not None]
    if args.all and given:
        raise ValueError(f"--all plans the whole workload matrix and ignores {', '.join(given)}; "
                         "drop --all for one cell, or drop the cell options")
    if given and (args.model is not None or args.phase is not None):
        raise ValueError("--model/--phase select rows of the workload matrix; they do not combine "
                         "with one cell (--op/--m/--n/--k)")
    if args.timeline:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            raise ValueError("--timeline needs matplotlib, which is not installed "
                             "(pip install matplotlib), or drop --timeline") from None
    get_profile(args.hardware)
    canonical_dtype(args.dtype)


def _cells(args) -> list[tuple[str, Plan]]:
    hw = get_profile(args.hardware)
    cell_args = [args.op, args.m, args.n, args.k]
    if any(a is not None for a in cell_args) and not args.all:
        if any(a is None for a in cell_args) or args.world_size is None:
            raise ValueError("one cell needs --op, --m, --n, --k and --world-size; "
                             "or give none of them for the workload matrix")
        p = plan(args.op, m=args.m, n=args.n, k=args.k, world_size=args.world_size,
                 dtype=args.dtype, hardware=hw, modelled=True, cuda_graph=args.cuda_graph)
        return [(f"{args.op} {args.m}x{args.n}x{args.k}", p)]
    from tpfuse.bench.workloads import workload_matrix

    sizes = (args.world_size,) if args.world_size else tp_sizes(hw)
    cells = workload_matrix(
        world_sizes=sizes, dtype=canonical_dtype(args.dtype),
        models=(args.model,) if args.model else ("8b", "70b", "405b"),
        phases=(args.phase,) if args.phase else ("training", "prefill", "decode"))
    return [(c.name, plan(c.op, m=c.m, n=c.n, k=c.k, world_size=c.world_size, dtype=c.dtype,
                          hardware=hw, modelled=True, cuda_graph=args.cuda_graph)) for c in cells]


def _print_table(rows: list[tuple[str, Plan]], title: str) -> None:
    header = ["cell", "op", "W", "strategy", "chunks", "pred ms", "stock ms†", "speedup†",
              "tpfuse unfused ms", "exposed comm ms", "bound", "modelled only*"]

    def modelled(p: Plan) -> str:
        if not p.modelled_ms:
            return "-"
        s, ms = min(p.modelled_ms.items(), key=lambda kv: kv[1])
        return f"{s} {ms:.4f}*"

    body = [[name, p.op, str(p.world_size), p.strategy, str(p.num_chunks),
             f"{p.predicted_ms[p.strategy]:.4f}", f"{p.breakdown['baseline_ms']:.4f}",
             f"{p.speedup:.2f}x", f"{p.predicted_ms['unfused']:.4f}", f"{p.breakdown['exposed_comm_ms']:.4f}",
             p.bound, modelled(p)]
            for name, p in rows]
    try:
        from rich.console import Console
        from rich.table import Table
    except ImportError:
        widths = [max(len(r[i]) for r in [header] + body) for i in range(len(header))]
        print(title)
        for r in [header] + body:
            print("  ".join(c.ljust(wd) for c, wd in zip(r, widths)))
        print(_modelled_note())
        return
    table = Table(title=title)
    for i, h in enumerate(header):
        table.add_column(h, justify="left" if i in (0, 1, 3, 10, 11) else "right")
    for r in body:
        table.add_row(*r)
    widest = [max(len(r[i]) for r in [header] + body) for i in range(len(header))]
    Console(file=sys.stdout, width=max(140, sum(widest) + 3 * len(header) + 4)).print(table)
    print(_modelled_note())


def _modelled_note() -> str:
    return ("† stock: the NCCL collective on the op's dtype + one GEMM (what `tpfuse bench` calls unfused_ms); "
            "speedup = stock / pred.  tpfuse unfused: tpfuse's own unfused strategy, one candidate.\n"
            "* modelled only: the fastest strategy this build does not implement, as predicted; never "
            f"chosen (this build implements {', '.join(implemented_strategies())})")


def run_plan_cli(args: argparse.Namespace) -> int:
    """``tpfuse plan``: a table (or JSON) of predictions for one cell or the workload matrix."""
    try:
        _check_cli_args(args)
        rows = _cells(args)
    except (ValueError, TypeError) as exc:
        print(f"tpfuse plan: {exc}", file=sys.stderr)
        return 2
    hw = get_profile(args.hardware)
    if args.json:
        print(json.dumps([dict(p.to_dict(), cell=name) for name, p in rows], indent=1))
    else:
        cal = f"calibrated: {hw.calibrated}" if hw.calibrated else "uncalibrated datasheet/lead numbers"
        _print_table(rows, f"tpfuse plan -- PREDICTED on {hw.name} ({cal})")
        if len(rows) == 1:
            print(rows[0][1].explain())
    if args.timeline:
        out = Path(args.timeline)
        for i, (name, p) in enumerate(rows):
            path = out if len(rows) == 1 else out.with_name(f"{out.stem}-{name}{out.suffix or '.png'}")
            res = _simulate(p.op, p.strategy, p.m, p.n, p.k, p.world_size, p.dtype, hw, p.num_chunks,
                            p.cuda_graph)
            draw_timeline(res, path, title=f"{name}: {p.strategy}, {p.num_chunks} chunks, "
                          f"{p.predicted_ms[p.strategy]:.3f} ms predicted on {hw.name} "
                          f"(unfused {p.predicted_ms['unfused']:.3f} ms)")
            if not args.json:
                print(f"timeline: {path}")
    return 0
