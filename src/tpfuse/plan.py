"""The planner: pick a strategy and chunking per shape from the cost model and the tuning cache.

    from tpfuse.plan import plan, choose, record_measurement
    p = plan("ag_gemm", m=16384, n=7168, k=8192, world_size=8, dtype="bf16", hardware="h200")
    print(p.strategy, p.num_chunks, p.predicted_ms, p.explain())

``m`` is the full M; ``n`` and ``k`` are this rank's local sizes (as the ops take them).
``plan`` predicts every registered strategy that declares a schedule (``tpfuse.strategies``) with
the pipeline simulator (``tpfuse.model.simulate``), each with the chunking it runs (its schedule's
``num_chunks``: fused ag_gemm's pieces per rank come from the function fused dispatches with),
and picks the fastest.  Tables of plans (``tpfuse plan``, docs/model.md) are in :mod:`tpfuse.report`.
``choose`` is what ``strategy="auto"`` calls on every op call: the same, restricted to the
strategies the environment can run, cached, and with measured times from the tuning cache
(``record_measurement``) overriding predictions.

Note: ``tpfuse/__init__.py`` re-exports the function ``plan``, which shadows this module as the
attribute ``tpfuse.plan``; import names from it with ``from tpfuse.plan import ...``.
"""

from __future__ import annotations

import functools
import json
import math
import os
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any, Mapping

from tpfuse import dtypes, strategies
from tpfuse.model import cost
from tpfuse.model.hardware import HardwareProfile, get_profile
from tpfuse.model.simulate import OPS, SimResult
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
]


def canonical_dtype(dtype: Any) -> str:
    """``torch.bfloat16`` / ``"bfloat16"`` / ``"bf16"`` -> ``"bf16"`` (:func:`tpfuse.dtypes.name`)."""
    return dtypes.name(dtype)


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
    that was measured), ``host_ms`` (the host time the call pays beyond its GPU work on that
    rank: the host issues ahead of the GPU, so only the part of its dispatch and launches that
    outlasts the device shows; 0 under CUDA graphs), ``exposed_comm_ms`` (prediction minus GEMM alone
    minus ``host_ms``, never more than ``comm_ms``) and ``baseline_ms`` (the stock baseline: the
    NCCL collective on the op's dtype plus one GEMM, what ``tpfuse bench`` calls ``unfused_ms``;
    :attr:`speedup` compares with it).
    ``cuda_graph``: planned for graph replay (no host costs) instead of eager calls.
    ``num_sms``: the chosen strategy's persistent GEMM grid (its schedule's ``sm_budget``; fused:
    every SM but one; 0 for strategies without one).  ``chunks_per_rank``: pieces each rank's
    shard is cut into (fused ag_gemm: ``fused.planned_chunks_per_rank``, what fused dispatches
    with; 1 otherwise).  ``measured``: strategies whose time came from
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
        return "\n".join(lines)


def _simulate(op, strategy, m, n, k, w, dtype, hw, num_chunks, cuda_graph=False, fast=False) -> SimResult:
    return strategies.simulate(op, strategy, m=m, n=n, k=k, world_size=w, dtype=dtype, hw=hw,
                               num_chunks=num_chunks, cuda_graph=cuda_graph, fast=fast)


def _num_sms(strategy: str, w: int, hw: HardwareProfile) -> int:
    """The persistent GEMM grid the strategy runs (its schedule's ``sm_budget``; 0: none)."""
    budget = strategies.schedule(strategy).sm_budget
    return budget(hw, w) if budget is not None and w > 1 else 0


@functools.lru_cache(maxsize=4096)
def _best_per_strategy(op, m, n, k, w, dtype, hw: HardwareProfile, strategy, cuda_graph=False,
                       schedule=None) -> tuple[float, int, SimResult]:
    """(ms, num_chunks, result) of the strategy as it runs: the chunking it is built with
    (its schedule's ``num_chunks``: fused ag_gemm's pieces per rank come from the same
    function fused dispatches with).  Replays one rank (``simulate(fast=True)``): ranks are
    symmetric without skew."""
    nc = strategies.built_num_chunks(op, strategy, m=m, n=n, k=k, world_size=w, dtype=dtype, hw=hw,
                                     cuda_graph=cuda_graph)
    res = _simulate(op, strategy, m, n, k, w, dtype, hw, nc, cuda_graph, fast=True)
    # cached without its task list: thousands of cached replays' tasks made the garbage
    # collector's full passes take seconds (a W = 72 plan stalled 1-3 s on a 2-core box)
    return res.makespan_ms, nc, replace(res, tasks=[])


def _comm_alone_ms(op, m, n, k, w, dtype, hw: HardwareProfile) -> float:
    """The collective alone on ``dtype`` data by its fastest transport: NCCL (measured at this W
    where the profile has it), copy engine, or SM stores by the fused GEMM's grid.  Strategy-
    independent and a floor for all of them: unfused and ring move fp32 partials for bf16/fp16
    reductions (more bytes, plus casts), copy_engine/fused move the op's dtype."""
    if w <= 1 or m <= 0:
        return 0.0
    grids = [sched.sm_budget(hw, w) for sched in map(strategies.schedule, strategies.names())
             if sched is not None and sched.sm_budget is not None]
    stores = [cost.p2p_collective_ms(op, m, n, k, w, dtype, hw, "sm", num_sms=max(grids))] if grids else []
    return min([cost.collective_ms(op, m, n, k, w, dtype, hw),
                cost.p2p_collective_ms(op, m, n, k, w, dtype, hw, "ce")] + stores)


def _reason(op, strategy, w, predicted, gemm_ms, comm_ms, measured, margin_kept=False, *,
            empty=False, multi_node=False, cuda_graph=False) -> str:
    """Why the chosen strategy, in sentences whose numbers add up (hidden <= the collective)."""
    if w == 1:
        return "world_size is 1: there is no communication to overlap, so the plain GEMM (unfused) is used."
    if empty:
        return "the GEMM is empty (m, n or k is 0): there is nothing to overlap, so unfused runs it."
    src = " (measured times from the tuning cache)" if measured else ""
    nccl = ", ".join(s for s in predicted if not strategies.info(s).symmetric_memory)
    where = (f"world_size {w} spans hosts (more than one NVLink domain), so only the strategies without "
             f"symmetric memory ({nccl}) are candidates; " if multi_node else "")
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


def _held_back(strategy: str | None, predicted: Mapping[str, float]) -> str:
    """The sentence on a strategy predicted fastest but not chosen on its model ("" if none)."""
    if strategy is None:
        return ""
    return (f" {strategy} is predicted faster ({predicted[strategy]:.4f} ms), but its model is not yet checked "
            f"on GPUs (it declares AUTO = False): it is chosen only on a measured time in the tuning cache "
            f"(tpfuse.plan.record_measurement) or when asked for by name.")


def _runnable_dtype(candidates: tuple[str, ...], dtype: str) -> tuple[str, ...]:
    """``candidates`` whose dtype-policy entry takes ``dtype`` (``tpfuse.dtypes``)."""
    return tuple(s for s in candidates if dtypes.accepts(strategies.info(s).dtypes, dtype))


def _critical_rank(res: SimResult):
    """The rank whose end is the makespan (its fill + steady + drain is the prediction)."""
    return max(res.ranks, key=lambda r: (r.end, -r.rank))


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
               measured: Mapping[str, float], *, cuda_graph: bool = False) -> Plan:
    """Predict ``candidates`` (those with a schedule, that take ``dtype`` and, above the
    profile's NVLink domain, need no symmetric memory; "unfused" always) and choose."""
    multi_node = w > hw.max_domain
    names = strategies.names()
    candidates = _runnable_dtype(tuple(candidates), dtype)
    if multi_node:
        candidates = tuple(s for s in candidates if not strategies.info(s).symmetric_memory)
    candidates = tuple(s for s in names if (s in candidates and strategies.schedule(s) is not None)
                       or s == "unfused")
    gemm_ms = cost.gemm_time_ms(m, n, k, dtype, hw) if m > 0 else 0.0
    comm_ms = _comm_alone_ms(op, m, n, k, w, dtype, hw)
    predicted, chunks, results = {}, {}, {}
    for s in candidates:
        # keyed on the schedule too: a name registered again with another schedule is predicted anew
        predicted[s], chunks[s], results[s] = _best_per_strategy(op, m, n, k, w, dtype, hw, s, cuda_graph,
                                                                 strategies.schedule(s))
    used = tuple(s for s in candidates if s in measured)
    for s in used:
        predicted[s] = float(measured[s])
    margin_kept = False
    empty = m * n * k == 0
    held_back = None
    if w == 1 or empty:
        chosen = "unfused"
    else:
        # deterministic: fastest; ties go to the earlier (simpler) strategy in ORDER.  A strategy
        # declaring AUTO = False is chosen only on a measured time, never on its model alone.
        def key(s):
            return round(predicted[s], 9), names.index(s)

        eligible = [s for s in candidates if strategies.info(s).auto or s in used]
        chosen = min(eligible, key=key)
        fastest = min(candidates, key=key)
        held_back = fastest if fastest != chosen else None
        # A model-only win must be clear: within MIN_MODEL_GAIN of unfused, keep unfused
        # (measured times from the tuning cache are taken as they are).
        if (chosen != "unfused" and not (chosen in used and "unfused" in used)
                and predicted[chosen] > predicted["unfused"] * (1.0 - MIN_MODEL_GAIN)):
            chosen, margin_kept = "unfused", True
    res = results[chosen]
    crit = _critical_rank(res)
    comm_ms = comm_ms if w > 1 else 0.0
    # the host issues ahead of the GPU: only the part of its work that outlasts the device shows
    host_ms = crit.host_tail
    breakdown = {"gemm_ms": gemm_ms, "comm_ms": comm_ms, "host_ms": host_ms,
                 "model_ms": res.makespan_ms, "fill_ms": crit.fill, "steady_ms": crit.steady,
                 "drain_ms": crit.drain,
                 "exposed_comm_ms": min(comm_ms, max(0.0, predicted[chosen] - gemm_ms - host_ms)),
                 "baseline_ms": _stock_baseline_ms(op, m, n, k, w, dtype, hw, gemm_ms, cuda_graph)}
    sched = strategies.schedule(chosen)
    per_rank = chunks[chosen] // w if sched.kind == "pipeline" and op != "gemm_ar" and w > 1 else 1
    return Plan(op=op, strategy=chosen, num_chunks=chunks[chosen], m=m, n=n, k=k, world_size=w,
                dtype=dtype, hardware=hw.name, num_sms=_num_sms(chosen, w, hw), chunks_per_rank=per_rank,
                predicted_ms=predicted, chunks=chunks, breakdown=breakdown, measured=used,
                reason=_reason(op, chosen, w, predicted, gemm_ms, comm_ms, used, margin_kept,
                               empty=empty, multi_node=multi_node, cuda_graph=cuda_graph) + _held_back(held_back, predicted),
                cuda_graph=cuda_graph)


def _runnable_for_group(group: Any, world_size: int, dtype: str, built: tuple[str, ...]) -> tuple[str, ...]:
    import torch

    from tpfuse._dist import group_context

    ctx = group_context(group)
    if ctx.world_size != world_size:
        raise ValueError(f"world_size: {world_size} but the group has {ctx.world_size} ranks; pass "
                         f"world_size={ctx.world_size} (or no group)")
    device = torch.device("cuda", torch.cuda.current_device()) if ctx.device_type == "cuda" else torch.device("cpu")
    runnable = strategies.runnable(ctx, device, dtypes.torch_dtype(dtype))
    return tuple(s for s in built if s in runnable)


def _is_process_group(group: Any) -> bool:
    import torch.distributed as dist

    return dist.is_available() and isinstance(group, dist.ProcessGroup)


def plan(op: str, *, m: int, n: int, k: int, world_size: int, dtype: Any = "bf16",
         hardware: str | HardwareProfile = "h200", cuda_graph: bool = False, group: Any = None) -> Plan:
    """Predict every registered strategy that declares a schedule for one op shape and choose
    the fastest (model only, no tuning cache).

    ``m``: full M; ``n``, ``k``: this rank's local sizes; ``dtype``: torch dtype or name;
    ``hardware``: profile name (``tpfuse.model.hardware.PROFILES``) or a ``HardwareProfile``.
    ``cuda_graph``: the call is replayed from a CUDA graph (no host costs); default eager.
    Strategies whose dtype-policy entry does not take ``dtype`` (float64: unfused and ring only),
    that declare no schedule, or that need symmetric memory above the profile's NVLink domain,
    are left out.  ``group``: a real
    ``torch.distributed`` ProcessGroup of ``world_size`` ranks: also leave out what this
    environment cannot run for it (``tpfuse.strategies.why_unavailable``, on the group's device).
    """
    dtype_name, hw = _validate(op, m, n, k, world_size, dtype, hardware)
    if not isinstance(cuda_graph, bool):
        raise TypeError(f"cuda_graph: expected a bool, got {type(cuda_graph).__name__} {cuda_graph!r}")
    if group is not None and not _is_process_group(group):
        raise TypeError(f"group: expected a torch.distributed.ProcessGroup (or None: plan without one), got "
                        f"{type(group).__name__} {group!r}")
    built = strategies.names()
    if group is not None:
        built = _runnable_for_group(group, world_size, dtype_name, built)
    return _make_plan(op, m, n, k, world_size, dtype_name, hw, built, {}, cuda_graph=cuda_graph)


# --- auto: choose() + tuning cache (tpfuse.tuning) -----------------------------------------------


def record_measurement(op: str, m: int, n: int, k: int, world_size: int, dtype: Any,
                       hardware: str | HardwareProfile, strategy: str, ms: float) -> None:
    """Store a measured time for (shape, strategy); ``choose`` then prefers it over the model."""
    dtype_name, hw = _validate(op, m, n, k, world_size, dtype, hardware)
    if strategy not in strategies.names():
        raise ValueError(f"strategy: unknown strategy {strategy!r}; use one of {strategies.names()}")
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
    names = strategies.names()
    bad = [c for c in cands if c not in names]
    if bad:
        raise ValueError(f"candidates: unknown strategies {bad}; use names from {names}")
    cands = tuple(s for s in names if s in cands or s == "unfused")
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
