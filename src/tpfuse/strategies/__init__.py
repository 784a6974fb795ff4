"""Strategies: one module per schedule, all with the same three functions and the same meaning,
and the registry that everything else asks about them (no name list lives anywhere else).

The strategy contract.  A strategy is any module-like object with these attributes (ours are the
modules of this package; ``tpfuse.register_strategy(obj)`` adds one from anywhere)::

    NAME = "ring"                                 # what users pass as strategy=
    DESCRIPTION = "P2P ring steps overlapped with per-shard GEMMs"   # one line; plan's reason quotes it
    DTYPES = tpfuse.dtypes.EVERY                  # its dtype-policy entry: a tuple of tpfuse.dtypes.Rule
    def why_unavailable(ctx, device, dtype) -> str | None: ...   # None: it runs here; else why not
    def ag_gemm(a_shard, b, ctx) -> (c, a_full)    # a_shard [M/W, K], b [K, N] -> [M, N], [M, K]
    def gemm_rs(a, b, ctx) -> c_shard              # a [M, K], b [K, N]         -> [M/W, N]
    def gemm_ar(a, b, ctx) -> c                    # a [M, K], b [K, N]         -> [M, N]

and, optionally (the default after the ``=``)::

    ORDER = 1000                # position among the strategies; ties in the planner go to the lower
    SYMMETRIC_MEMORY = False    # needs CUDA symmetric memory: only inside one NVLink domain; the bed runs these
    KNOBS = None                # its knobs: a frozen dataclass type; the functions then take knobs=
                                # (None: their defaults); pin_knobs() sets them per process group
    SCHEDULE = None             # its model: a tpfuse.model.simulate.Schedule; without one the planner
                                # cannot predict it, so strategy="auto" never picks it
    AUTO = True                 # False: the planner predicts it (with a SCHEDULE) but chooses it
                                # (plan(), strategy="auto") only on a measured time from the tuning
                                # cache, never on the model alone (a model not yet checked on GPUs)

``ctx`` is a :class:`tpfuse._dist.GroupContext` (``rank``, ``world_size``, ``group``, ...).
Inputs are validated by :mod:`tpfuse.ops` before a strategy sees them (2-D, same dtype, a dtype
its ``DTYPES`` takes, M divisible by W where the op needs it); outputs must be freshly allocated
(never an alias of an input).  docs/strategies.md walks through adding one.

Every module of this package whose name does not start with ``_`` is a strategy and is
registered at import through the same door (:func:`register`); :func:`register_module` does it
for a module by name (``tpfuse bench --register-strategy``).  Ask the registry, never a list:
:func:`names`, :func:`info`, :func:`get`, :func:`why_unavailable`, :func:`runnable`,
:func:`simulate`.
"""

from __future__ import annotations

import dataclasses
import importlib
import pkgutil
import threading
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch

from tpfuse import dtypes
from tpfuse._dist import GroupContext
from tpfuse.model import simulate as _engine
from tpfuse.model.simulate import Schedule, SimResult

__all__ = ["StrategyInfo", "register", "unregister", "names", "info", "get", "schedule", "model",
           "description", "why_unavailable", "runnable", "simulate", "built_num_chunks", "pin_knobs", "register_module",
           "knobs_for", "pinned_knobs", "FUNCTIONS"]

FUNCTIONS = ("ag_gemm", "gemm_rs", "gemm_ar")
_REQUIRED = ("NAME", "DESCRIPTION", "DTYPES", "why_unavailable") + FUNCTIONS
_OPTIONAL = {"ORDER": 1000, "SYMMETRIC_MEMORY": False, "KNOBS": None, "SCHEDULE": None, "AUTO": True}


@dataclass(frozen=True)
class StrategyInfo:
    """One registered strategy, as its declaration says (see the module docstring)."""
    name: str
    description: str
    order: int
    dtypes: tuple[dtypes.Rule, ...]
    symmetric_memory: bool
    knobs: Optional[type]
    schedule: Optional[Schedule]
    auto: bool    # chosen on the model alone (False: only on a measured time)
    why_unavailable: Callable[[GroupContext, torch.device, torch.dtype], Optional[str]]
    impl: Any   # the module (or object) with the three functions


def _where(obj: Any) -> str:
    return getattr(obj, "__name__", None) or type(obj).__name__


def _validated(obj: Any) -> StrategyInfo:
    """``obj``'s declaration as a :class:`StrategyInfo`, or a ``TypeError``/``ValueError`` that
    names the attribute and the fix."""
    where = f"register_strategy({_where(obj)})"
    missing = [a for a in _REQUIRED if not hasattr(obj, a)]
    if missing:
        raise TypeError(f"{where}: the strategy does not define {', '.join(missing)}; a strategy declares "
                        f"{', '.join(_REQUIRED)} (see tpfuse/strategies/__init__.py or docs/strategies.md)")
    name = obj.NAME
    if not isinstance(name, str) or not name.isidentifier() or name == "auto":
        raise ValueError(f"{where}: NAME={name!r} must be a Python identifier string other than 'auto'")
    desc = obj.DESCRIPTION
    if not isinstance(desc, str) or not desc.strip() or "\n" in desc:
        raise ValueError(f"{where}: DESCRIPTION={desc!r} must be one non-empty line")
    for fn in ("why_unavailable",) + FUNCTIONS:
        if not callable(getattr(obj, fn)):
            raise TypeError(f"{where}: {fn} must be a function, got {type(getattr(obj, fn)).__name__}")
    rules = obj.DTYPES
    if not isinstance(rules, tuple) or not rules or not all(isinstance(r, dtypes.Rule) for r in rules):
        raise TypeError(f"{where}: DTYPES must be a non-empty tuple of tpfuse.dtypes.Rule "
                        f"(e.g. tpfuse.dtypes.EVERY), got {rules!r}")
    opt = {a: getattr(obj, a, default) for a, default in _OPTIONAL.items()}
    if isinstance(opt["ORDER"], bool) or not isinstance(opt["ORDER"], int):
        raise TypeError(f"{where}: ORDER must be an int, got {opt['ORDER']!r}")
    for flag in ("SYMMETRIC_MEMORY", "AUTO"):
        if not isinstance(opt[flag], bool):
            raise TypeError(f"{where}: {flag} must be a bool, got {opt[flag]!r}")
    knobs = opt["KNOBS"]
    if knobs is not None and not (isinstance(knobs, type) and dataclasses.is_dataclass(knobs)
                                  and knobs.__dataclass_params__.frozen):
        raise TypeError(f"{where}: KNOBS must be a frozen dataclass type or None, got {knobs!r}")
    sched = opt["SCHEDULE"]
    if sched is not None and not isinstance(sched, Schedule):
        raise TypeError(f"{where}: SCHEDULE must be a tpfuse.model.simulate.Schedule or None, "
                        f"got {type(sched).__name__}")
    return StrategyInfo(name, desc, opt["ORDER"], rules, opt["SYMMETRIC_MEMORY"], knobs, sched, opt["AUTO"],
                        obj.why_unavailable, obj)


class _Registry:
    """The strategies by name, in (ORDER, name) order, and the knobs pinned per group; one lock,
    one owner."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._entries: dict[str, StrategyInfo] = {}
        self._names: tuple[str, ...] = ()
        self._pins: dict[tuple[str, str], Any] = {}   # (group name, strategy) -> its knobs
        self.pins_generation = 0                       # bumped by every pin (the ops' call cache keys on it)

    def add(self, obj: Any) -> StrategyInfo:
        entry = _validated(obj)
        with self._lock:
            if entry.name in self._entries:
                raise ValueError(f"register_strategy: the name {entry.name!r} is taken (by "
                                 f"{_where(self._entries[entry.name].impl)}); choose another NAME")
            self._entries[entry.name] = entry
            self._sort()
        return entry

    def remove(self, name: str) -> None:
        with self._lock:
            if name not in self._entries:
                raise ValueError(f"unregister: no strategy named {name!r}")
            del self._entries[name]
            self._sort()
            self._pins = {key: k for key, k in self._pins.items() if key[1] != name}
            self.pins_generation += 1

    def pin(self, group_name: str, name: str, knobs: Any) -> None:
        with self._lock:
            if knobs is None:
                self._pins.pop((group_name, name), None)
            else:
                self._pins[(group_name, name)] = knobs
            self.pins_generation += 1

    def pinned(self, group_name: str, name: str) -> Any:
        return self._pins.get((group_name, name)) if self._pins else None

    def pinned_in(self, group_name: str) -> str:
        if not self._pins:
            return ""
        return "; ".join(f"{s}={k!r}" for (g, s), k in sorted(self._pins.items(), key=lambda kv: kv[0][1])
                         if g == group_name)

    def _sort(self) -> None:
        self._entries = dict(sorted(self._entries.items(), key=lambda kv: (kv[1].order, kv[0])))
        self._names = tuple(self._entries)

    def names(self) -> tuple[str, ...]:
        return self._names

    def get(self, name: str) -> StrategyInfo:
        try:
            return self._entries[name]
        except (KeyError, TypeError):
            raise ValueError(f"unknown strategy {name!r}; choose one of {', '.join(self._names)}") from None


_REGISTRY = _Registry()


def register(obj: Any) -> StrategyInfo:
    """Add the strategy ``obj`` declares (the contract above); ``tpfuse.register_strategy``.

    From then on ``tpfuse.ag_gemm/gemm_rs/gemm_ar(strategy=NAME)`` run it, ``tpfuse.plan``
    predicts it (with a ``SCHEDULE``) and ``tpfuse bench`` times it.  Register it on every rank,
    before the first call that names it.  A taken name is a ``ValueError``; a missing or
    ill-typed attribute a ``TypeError``/``ValueError`` naming it."""
    return _REGISTRY.add(obj)


def register_module(module_name: str) -> Any:
    """Import the module ``module_name`` and register it as a strategy (the module is the
    declaration), once: a module already registered is left as it is.  What ``tpfuse bench
    --register-strategy`` runs in every process.  Returns the module."""
    try:
        mod = importlib.import_module(module_name)
    except ImportError as exc:
        raise ValueError(f"cannot import {module_name} ({exc}); give an importable module name") from None
    if not hasattr(mod, "NAME"):
        raise ValueError(f"{module_name} does not declare a strategy (no NAME); see docs/strategies.md")
    if mod.NAME in _REGISTRY.names() and get(mod.NAME) is mod:
        return mod
    register(mod)
    return mod


def unregister(name: str) -> None:
    """Remove strategy ``name`` (for tests that register their own)."""
    _REGISTRY.remove(name)


def pin_knobs(name: str, knobs: Any, group: Any = None) -> None:
    """Run strategy ``name`` with ``knobs`` (an instance of its ``KNOBS``; None: its defaults
    again) on the process group ``group`` (None: the default group) in this process.  A
    per-group setting: pin the same on every rank of the group; the agreement round of the next
    call checks that they did (a mismatch is a ``ValueError`` on every rank)."""
    from tpfuse._dist import group_context

    entry = info(name)
    if entry.knobs is None:
        raise ValueError(f"pin_knobs: strategy {name!r} declares no KNOBS; it has nothing to pin")
    if knobs is not None and not isinstance(knobs, entry.knobs):
        raise TypeError(f"pin_knobs: knobs for {name!r} must be a {entry.knobs.__name__}, got "
                        f"{type(knobs).__name__} {knobs!r}")
    _REGISTRY.pin(group_context(group).group_name, name, knobs)


def knobs_for(name: str, ctx: GroupContext) -> dict:
    """``{"knobs": ...}`` when strategy ``name`` has knobs pinned on ``ctx``'s group, else ``{}``:
    the keyword arguments the ops pass to its functions."""
    knobs = _REGISTRY.pinned(ctx.group_name, name)
    return {} if knobs is None else {"knobs": knobs}


def pinned_knobs(ctx: GroupContext) -> str:
    """Every knob pinned on ``ctx``'s group, as text ("" if none): a field of the agreed call
    signature, so that every rank checks the others pinned the same."""
    return _REGISTRY.pinned_in(ctx.group_name)


def pins_generation() -> int:
    """Changes whenever a knob is pinned (call caches key on it)."""
    return _REGISTRY.pins_generation


def names() -> tuple[str, ...]:
    """Every registered strategy, in ORDER (the planner breaks ties by it)."""
    return _REGISTRY.names()


def info(name: str) -> StrategyInfo:
    """The registry entry of strategy ``name`` (``ValueError`` for an unknown name)."""
    return _REGISTRY.get(name)


def get(name: str) -> Any:
    """The object with strategy ``name``'s three functions (for ours, ``tpfuse.strategies.<name>``)."""
    return info(name).impl


def schedule(name: str) -> Optional[Schedule]:
    """The simulator schedule strategy ``name`` declares (None: it declares none)."""
    return info(name).schedule


model = schedule


def description(name: str) -> str:
    """One line on how strategy ``name`` overlaps communication (the planner's reasons quote it)."""
    return info(name).description


def why_unavailable(name: str, ctx: GroupContext, device: torch.device, dtype: torch.dtype) -> str | None:
    """None if strategy ``name`` can run here, else why not: its own check (it knows best
    why), and its dtype-policy entry when that does not take ``dtype`` (both when both apply)."""
    entry = info(name)
    reasons = [entry.why_unavailable(ctx, device, dtype)]
    if not dtypes.accepts(entry.dtypes, dtype) and str(dtype).removeprefix("torch.") not in (reasons[0] or ""):
        takes = [s for s in names() if dtypes.accepts(info(s).dtypes, dtype)]
        reasons.append(f"{name} takes {dtypes.describe(entry.dtypes)}, not {dtype}; "
                       f"{dtype} runs with {', '.join(repr(s) for s in takes) or 'no strategy'}")
    return "; ".join(r for r in reasons if r) or None


def runnable(ctx: GroupContext, device: torch.device, dtype: torch.dtype) -> tuple[str, ...]:
    """Strategies that can run for this group, device and dtype."""
    return tuple(s for s in names() if why_unavailable(s, ctx, device, dtype) is None)


def _schedule_of(name: str) -> Schedule:
    sched = schedule(name)
    if sched is None:
        raise ValueError(f"strategy {name!r} declares no SCHEDULE, so the simulator cannot replay it; "
                         "give it one (tpfuse.model.simulate.Schedule, docs/strategies.md)")
    return sched


def simulate(op: str, strategy: str, **kwargs) -> SimResult:
    """:func:`tpfuse.model.simulate.simulate` of the schedule strategy ``strategy`` declares."""
    return _engine.simulate(op, _schedule_of(strategy), name=strategy, **kwargs)


def built_num_chunks(op: str, strategy: str, **kwargs) -> int:
    """The communication chunks strategy ``strategy`` runs ``op`` with (its schedule's count)."""
    return _engine.built_num_chunks(op, _schedule_of(strategy), **kwargs)


def _discover() -> None:
    for sub in pkgutil.iter_modules(__path__):
        if not sub.name.startswith("_"):
            register(importlib.import_module(f"{__name__}.{sub.name}"))


_discover()
