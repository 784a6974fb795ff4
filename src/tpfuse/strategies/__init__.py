"""Strategies: one module per schedule, all with the same three functions and the same meaning,
and the registry that everything else derives the strategy names from.

Each strategy module provides::

    NAME = "ring"                                # the name users pass as strategy=
    MODEL = simulate.P2P_RING                    # its tpfuse.model.simulate.Schedule (the planner replays it)
    DESCRIPTION = "torch.distributed P2P ring steps overlapped with per-shard GEMMs"   # plan's reason quotes it
    ORDER = 10                                   # position in STRATEGY_NAMES (ties in the planner go to the lower)
    def why_unavailable(ctx, device, dtype) -> str | None: ...   # None: it runs here
    def ag_gemm(a_shard, b, ctx) -> (c, a_full)   # a_shard [M/W, K], b [K, N]  -> [M, N], [M, K]
    def gemm_rs(a, b, ctx) -> c_shard             # a [M, K], b [K, N]          -> [M/W, N]
    def gemm_ar(a, b, ctx) -> c                   # a [M, K], b [K, N]          -> [M, N]

Every module of this package whose name does not start with ``_`` is a strategy; adding one is
one new file (plus its tests). ``_checks.STRATEGY_NAMES``, ``simulate.STRATEGIES``, the
planner's reasons and the simulator's schedules all come from here.

Strategies the planner models but this build does not implement yet are model-only entries
(:data:`_MODEL_ONLY`): a name, a schedule, a description, and an availability check that says
why they cannot run. A module with the same ``NAME`` replaces the entry; ``MODEL``,
``DESCRIPTION`` and ``ORDER`` it does not declare are taken from the entry, so a module need
only add ``NAME``, ``why_unavailable`` and the three functions to slot in.

Inputs are validated by :mod:`tpfuse.ops` before a strategy sees them; outputs are always
freshly allocated (never an alias of an input).
"""

from __future__ import annotations

import importlib
import pkgutil
from dataclasses import dataclass
from types import ModuleType
from typing import Callable, Optional

import torch

from tpfuse._dist import GroupContext
from tpfuse.model import simulate

__all__ = ["STRATEGY_NAMES", "IMPLEMENTED_NAMES", "StrategyInfo", "info", "get", "model", "description",
           "why_unavailable", "runnable", "implemented"]

FUNCTIONS = ("ag_gemm", "gemm_rs", "gemm_ar")


@dataclass(frozen=True)
class StrategyInfo:
    """One registered strategy. ``module``: its module name (None: modelled, not implemented)."""
    name: str
    order: int
    model: simulate.Schedule
    description: str
    why_unavailable: Callable[[GroupContext, torch.device, torch.dtype], Optional[str]]
    module: Optional[str] = None

    @property
    def implemented(self) -> bool:
        return self.module is not None


def _symmetric_memory_not_built(name: str):
    """Availability of a symmetric-memory strategy this build has no module for."""
    def why(ctx: GroupContext, device: torch.device, dtype: torch.dtype) -> Optional[str]:
        if device.type != "cuda":
            return f"{name} needs CUDA symmetric memory; the inputs are on {device} and this group is {ctx.backend}"
        if dtype == torch.float64:
            return f"{name} runs bfloat16/float16/float32 only; float64 runs with 'unfused' or 'ring'"
        return f"{name} is not part of this tpfuse build yet; use 'copy_engine', 'ring' or 'unfused'"
    return why


# Modelled by the planner, not implemented here: replaced by a module of the same NAME.
_MODEL_ONLY = (
    StrategyInfo("copy_engine", 20, simulate.COPY_ENGINE_PIPELINE,
                 "copy-engine peer copies (no SMs taken) overlapped with per-chunk GEMMs",
                 _symmetric_memory_not_built("copy_engine")),
    StrategyInfo("fused", 30, simulate.PERSISTENT_KERNEL,
                 "copy-engine pulls waited on per chunk by one persistent GEMM (AG); one GEMM whose epilogue "
                 "stores partials into their owners' buffers (RS, AR)",
                 _symmetric_memory_not_built("fused")),
)


def _from_module(mod: ModuleType, entry: Optional[StrategyInfo]) -> StrategyInfo:
    where = f"tpfuse/strategies/{mod.__name__.rsplit('.', 1)[-1]}.py"
    missing = [n for n in ("NAME", "why_unavailable", *FUNCTIONS) if not hasattr(mod, n)]
    missing += [n for n in ("MODEL", "DESCRIPTION") if not hasattr(mod, n) and entry is None]
    if missing:
        raise ImportError(f"{where} is a strategy module but does not define {', '.join(missing)} "
                          "(see tpfuse/strategies/__init__.py)")
    schedule = getattr(mod, "MODEL", entry.model if entry else None)
    if not isinstance(schedule, simulate.Schedule):
        raise ImportError(f"{where}: MODEL must be a tpfuse.model.simulate.Schedule, got {type(schedule).__name__}")
    return StrategyInfo(mod.NAME, getattr(mod, "ORDER", entry.order if entry else 1000), schedule,
                        getattr(mod, "DESCRIPTION", entry.description if entry else ""),
                        mod.why_unavailable, mod.__name__)


def _discover() -> dict[str, StrategyInfo]:
    found = {e.name: e for e in _MODEL_ONLY}
    for sub in pkgutil.iter_modules(__path__):
        if sub.name.startswith("_"):
            continue
        mod = importlib.import_module(f"{__name__}.{sub.name}")
        if not hasattr(mod, "NAME") and not any(hasattr(mod, f) for f in FUNCTIONS):
            continue   # a helper module, not a strategy
        entry = _from_module(mod, found.get(getattr(mod, "NAME", None)))
        if entry.name in found and found[entry.name].implemented:
            raise ImportError(f"two strategy modules declare NAME={entry.name!r}: "
                              f"{found[entry.name].module} and {entry.module}")
        found[entry.name] = entry
    return dict(sorted(found.items(), key=lambda kv: (kv[1].order, kv[0])))


_REGISTRY = _discover()
STRATEGY_NAMES: tuple[str, ...] = tuple(_REGISTRY)
IMPLEMENTED_NAMES: tuple[str, ...] = tuple(n for n, e in _REGISTRY.items() if e.implemented)


def info(name: str) -> StrategyInfo:
    """The registry entry of strategy ``name``."""
    try:
        return _REGISTRY[name]
    except KeyError:
        raise ValueError(f"unknown strategy {name!r}; choose one of {', '.join(STRATEGY_NAMES)}") from None


def get(name: str) -> ModuleType:
    """The strategy module ``tpfuse.strategies.<name>``."""
    entry = _REGISTRY.get(name)
    if entry is None or not entry.implemented:
        raise ValueError(f"strategy {name!r} is not implemented; choose one of {', '.join(IMPLEMENTED_NAMES)}")
    return importlib.import_module(entry.module)


def model(name: str) -> simulate.Schedule:
    """The simulator schedule of strategy ``name`` (implemented or model-only)."""
    return info(name).model


def description(name: str) -> str:
    """One line on how strategy ``name`` overlaps communication (the planner's reasons quote it)."""
    return info(name).description


def why_unavailable(name: str, ctx: GroupContext, device: torch.device, dtype: torch.dtype) -> str | None:
    """None if strategy ``name`` can run here, else a sentence saying why not."""
    return info(name).why_unavailable(ctx, device, dtype)


def runnable(ctx: GroupContext, device: torch.device, dtype: torch.dtype) -> tuple[str, ...]:
    """Strategies that can run for this group, device and dtype (always includes 'unfused')."""
    return tuple(s for s in STRATEGY_NAMES if why_unavailable(s, ctx, device, dtype) is None)


def implemented() -> tuple[str, ...]:
    """Names of the strategies this build contains (the planner chooses only among these)."""
    return IMPLEMENTED_NAMES
