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
import importlib.metadata
import json
import math
import os
import statistics
import tempfile
import threading
import warnings
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any, Mapping

from tpfuse import dtypes, strategies
from tpfuse.model import cost
from tpfuse.model.hardware import HardwareProfile, get_profile
from tpfuse.model.simulate import OPS, SimResult

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


def _check_int(name: str, value: Any, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name}: expected an int, got {type(value).__name__} {value!r}")
    if value < minimum:
        raise ValueError(f"{name}: {value} must be >= {minimum}")
    return value


def _validate(op, m, n, k, world_size, dtype, hardware) -> tuple[str, HardwareProfile]:
    if op not in OPS:
        raise ValueError(f"op: unknown op {op!r}; use one of {', '.join(OPS)}")
    _check_int("m", m, 0)
    _check_int("n", n, 0)
    _check_int("k", k, 0)
    _check_int("world_size", world_size, 1)
    return canonical_dtype(dtype), get_profile(hardware)


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
    that was measured) and ``exposed_comm_ms`` (prediction minus GEMM alone).
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
        """Predicted unfused time over the chosen strategy's."""
        chosen = self.predicted_ms[self.strategy]
        return self.predicted_ms["unfused"] / chosen if chosen > 0 else 1.0

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
            f"(chunk_m={self.chunk_m}{self._pieces()}), {self.predicted_ms[self.strategy]:.4f} ms vs unfused "
            f"{self.predicted_ms['unfused']:.4f} ms ({self.speedup:.2f}x).",
            f"  GEMM alone {b['gemm_ms']:.4f} ms, {coll} alone {b['comm_ms']:.4f} ms "
            f"({'no communication' if self.bound == 'none' else self.bound + '-bound'}); "
            f"chosen pipeline (model, {'CUDA graph' if self.cuda_graph else 'eager'}): fill {b['fill_ms']:.4f} "
            f"+ steady {b['steady_ms']:.4f} + drain {b['drain_ms']:.4f} = {b['model_ms']:.4f} ms.",
            f"  Why: {self.reason}",
            "  Candidates: " + ", ".join(
                f"{s} {ms:.4f} ms" + (f" ({self.chunks[s]} chunks)" if s != "unfused" else "")
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


def _runnable_dtype(candidates: tuple[str, ...], dtype: str) -> tuple[str, ...]:
    """``candidates`` whose dtype-policy entry takes ``dtype`` (``tpfuse.dtypes``)."""
    return tuple(s for s in candidates if dtypes.accepts(strategies.info(s).dtypes, dtype))


def _critical_rank(res: SimResult):
    """The rank whose end is the makespan (its fill + steady + drain is the prediction)."""
    return max(res.ranks, key=lambda r: (r.end, -r.rank))


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
    if w == 1 or empty:
        chosen = "unfused"
    else:
        # deterministic: fastest; ties go to the earlier (simpler) strategy in ORDER
        chosen = min(candidates, key=lambda s: (round(predicted[s], 9), names.index(s)))
        # A model-only win must be clear: within MIN_MODEL_GAIN of unfused, keep unfused
        # (measured times from the tuning cache are taken as they are).
        if (chosen != "unfused" and not (chosen in used and "unfused" in used)
                and predicted[chosen] > predicted["unfused"] * (1.0 - MIN_MODEL_GAIN)):
            chosen, margin_kept = "unfused", True
    res = results[chosen]
    crit = _critical_rank(res)
    breakdown = {"gemm_ms": gemm_ms, "comm_ms": comm_ms if w > 1 else 0.0,
                 "model_ms": res.makespan_ms, "fill_ms": crit.fill, "steady_ms": crit.steady,
                 "drain_ms": crit.drain, "exposed_comm_ms": max(0.0, predicted[chosen] - gemm_ms)}
    sched = strategies.schedule(chosen)
    per_rank = chunks[chosen] // w if sched.kind == "pipeline" and op != "gemm_ar" and w > 1 else 1
    return Plan(op=op, strategy=chosen, num_chunks=chunks[chosen], m=m, n=n, k=k, world_size=w,
                dtype=dtype, hardware=hw.name, num_sms=_num_sms(chosen, w, hw), chunks_per_rank=per_rank,
                predicted_ms=predicted, chunks=chunks, breakdown=breakdown, measured=used,
                reason=_reason(op, chosen, w, predicted, gemm_ms, comm_ms, used, margin_kept,
                               empty=empty, multi_node=multi_node, cuda_graph=cuda_graph),
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
    built = strategies.names()
    if group is not None:
        built = _runnable_for_group(group, world_size, dtype_name, built)
    return _make_plan(op, m, n, k, world_size, dtype_name, hw, built, {}, cuda_graph=cuda_graph)


# --- auto: choose() + tuning cache -----------------------------------------------------------------
def tuning_cache_path() -> Path:
    """``$TPFUSE_CACHE_DIR/tuning.json``, else ``~/.cache/tpfuse/tuning.json``."""
    root = os.environ.get("TPFUSE_CACHE_DIR")
    return Path(root if root else Path.home() / ".cache" / "tpfuse") / "tuning.json"


@functools.lru_cache(maxsize=None)
def _versions() -> str:
    import torch

    try:
        triton = importlib.metadata.version("triton")
    except importlib.metadata.PackageNotFoundError:
        triton = "none"
    try:
        ours = importlib.metadata.version("tpfuse")
    except importlib.metadata.PackageNotFoundError:
        ours = "dev"
    return f"torch={torch.__version__}|triton={triton}|tpfuse={ours}"


def _cache_key(op, m, n, k, w, dtype, hw_name) -> str:
    return f"{op}|m={m}|n={n}|k={k}|W={w}|{dtype}|{hw_name}|{_versions()}"


class _TuningCache:
    """The JSON tuning cache, loaded once per path; a missing or corrupt file is an empty cache."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._path: Path | None = None
        self._entries: dict[str, dict] = {}
        self.generation = 0
        self._warned: set[str] = set()

    def _load(self, path: Path) -> None:
        self._path, self._entries = path, {}
        self.generation += 1
        if not path.exists():
            return
        try:
            data = json.loads(path.read_text())
            if not isinstance(data, dict) or not isinstance(data.get("entries"), dict):
                raise ValueError("no 'entries' object")
            self._entries = data["entries"]
        except (OSError, ValueError) as exc:
            if str(path) not in self._warned:
                self._warned.add(str(path))
                warnings.warn(f"tpfuse: tuning cache {str(path)!r} is unreadable ({exc}); ignoring it "
                              "(it is rewritten on the next record_measurement; delete it to silence this)",
                              RuntimeWarning, stacklevel=4)

    def current(self) -> tuple[int, Path]:
        path = tuning_cache_path()
        with self._lock:
            if path != self._path:
                self._load(path)
            return self.generation, path

    def measured(self, key: str) -> dict[str, float]:
        with self._lock:
            entry = self._entries.get(key, {})
            return {s: statistics.median(v) for s, v in entry.get("measured", {}).items() if v}

    def record(self, key: str, fields: dict, strategy: str, ms: float) -> None:
        self.current()
        with self._lock:
            entry = self._entries.setdefault(key, dict(fields, measured={}))
            entry["measured"].setdefault(strategy, []).append(ms)
            entry["measured"][strategy] = entry["measured"][strategy][-16:]
            path = self._path
            path.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(prefix=".tuning.", suffix=".json", dir=path.parent)
            try:
                with os.fdopen(fd, "w") as f:
                    json.dump({"version": 1, "entries": self._entries}, f, indent=1, sort_keys=True)
                os.replace(tmp, path)  # atomic: readers see the old or the new file, never half
            except BaseException:
                Path(tmp).unlink(missing_ok=True)
                raise
            self.generation += 1


_CACHE = _TuningCache()


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
