"""The three public ops: validate -> agree -> decide -> dispatch.

| op | per-rank input | per-rank output | unfused meaning |
|---|---|---|---|
| ``ag_gemm`` | ``a_shard [M/W, K]``, ``b [K, N]`` | ``c [M, N]`` (and ``a_full [M, K]``) | ``all_gather(a_shard, dim=0) @ b`` |
| ``gemm_rs`` | ``a [M, K]``, ``b [K, N]`` | ``c_shard [M/W, N]`` | ``reduce_scatter_sum(a @ b, dim=0)`` |
| ``gemm_ar`` | ``a [M, K]``, ``b [K, N]`` | ``c [M, N]`` | ``all_reduce_sum(a @ b)`` |

K and N are this rank's local sizes.  Each op is also a ``torch.library`` custom op
(``torch.ops.tpfuse.ag_gemm`` etc., taking the group by name) with a fake implementation, so
``torch.compile`` traces it as one node and CUDA graphs can capture it.  Eager calls with nothing
for the dispatcher to do (no autograd, no dispatch mode, not tracing) call the strategy directly.

Per call: one dict lookup of the call shape (and, with ``TPFUSE_DEBUG=1`` or CPU tensors on
gloo, one agreement round).  Per new call shape: validation.  Per new agreed signature and
group: one agreement round that checks the agreed fields on every rank and decides the strategy
for the whole group (:func:`group_decision`).  docs/ops.md has the details.
"""

from __future__ import annotations


import operator
from dataclasses import dataclass, field
from types import ModuleType

import torch
import torch.distributed as dist

from tpfuse import _checks, _fp8, dtypes, strategies
from tpfuse._dist import GroupContext, enter_call, group_context, leave_call, resolve_group_name

__all__ = ["ag_gemm", "gemm_rs", "gemm_ar", "resolve_strategy", "traced_strategy", "group_decision", "why_unavailable",
           "clear_decisions"]


# --------------------------------------------------------------------------------------------
# Custom ops: the dispatch target of the public functions (group passed by name).
# --------------------------------------------------------------------------------------------


def _context_by_name(group_name: str) -> GroupContext:
    # Not cached: a destroyed and re-created group may come back under the same name.
    return group_context(resolve_group_name(group_name))


@torch.library.custom_op("tpfuse::ag_gemm", mutates_args=())
def _ag_gemm_op(a_shard: torch.Tensor, b: torch.Tensor, group_name: str, strategy: str) -> tuple[torch.Tensor, torch.Tensor]:
    """All-gather ``a_shard`` [M/W, K] over the group, multiply by ``b`` [K, N]: returns (c [M, N], a_full [M, K])."""
    ctx = _context_by_name(group_name)
    return strategies.get(strategy).ag_gemm(a_shard, b, ctx, **strategies.knobs_for(strategy, ctx))


@_ag_gemm_op.register_fake
def _(a_shard, b, group_name, strategy):
    world_size = _context_by_name(group_name).world_size
    m = a_shard.shape[0] * world_size
    return a_shard.new_empty((m, b.shape[1])), a_shard.new_empty((m, a_shard.shape[1]))


@torch.library.custom_op("tpfuse::gemm_rs", mutates_args=())
def _gemm_rs_op(a: torch.Tensor, b: torch.Tensor, group_name: str, strategy: str) -> torch.Tensor:
    """Reduce-scatter (sum) of ``a`` [M, K] @ ``b`` [K, N] over the group: returns c_shard [M/W, N]."""
    ctx = _context_by_name(group_name)
    return strategies.get(strategy).gemm_rs(a, b, ctx, **strategies.knobs_for(strategy, ctx))


@_gemm_rs_op.register_fake
def _(a, b, group_name, strategy):
    world_size = _context_by_name(group_name).world_size
    return a.new_empty((a.shape[0] // world_size, b.shape[1]))


@torch.library.custom_op("tpfuse::gemm_ar", mutates_args=())
def _gemm_ar_op(a: torch.Tensor, b: torch.Tensor, group_name: str, strategy: str) -> torch.Tensor:
    """All-reduce (sum) of ``a`` [M, K] @ ``b`` [K, N] over the group: returns c [M, N]."""
    ctx = _context_by_name(group_name)
    return strategies.get(strategy).gemm_ar(a, b, ctx, **strategies.knobs_for(strategy, ctx))


@_gemm_ar_op.register_fake
def _(a, b, group_name, strategy):
    return a.new_empty((a.shape[0], b.shape[1]))


# fp8: the scaled ops (as PyTorch has fused_all_gather_scaled_matmul beside fused_all_gather_matmul).
# The scales and out_dtype are op arguments, so torch.compile and CUDA graphs see them.


@torch.library.custom_op("tpfuse::ag_gemm_scaled", mutates_args=())
def _ag_gemm_scaled_op(a_shard: torch.Tensor, b: torch.Tensor, group_name: str, strategy: str,
                       scale_a: torch.Tensor, scale_b: torch.Tensor, out_dtype: torch.dtype
                       ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """fp8 ``ag_gemm``: returns (c [M, N] in out_dtype, a_full [M, K] fp8, scale_a_full)."""
    ctx = _context_by_name(group_name)
    return strategies.get(strategy).ag_gemm(a_shard, b, ctx, scale_a, scale_b, out_dtype,
                                            **strategies.knobs_for(strategy, ctx))


@_ag_gemm_scaled_op.register_fake
def _(a_shard, b, group_name, strategy, scale_a, scale_b, out_dtype):
    m = a_shard.shape[0] * _context_by_name(group_name).world_size
    scale_full = scale_a.new_empty((m, 1)) if scale_a.dim() == 2 else scale_a.new_empty(scale_a.shape)
    return a_shard.new_empty((m, b.shape[1]), dtype=out_dtype), a_shard.new_empty((m, a_shard.shape[1])), scale_full


@torch.library.custom_op("tpfuse::gemm_rs_scaled", mutates_args=())
def _gemm_rs_scaled_op(a: torch.Tensor, b: torch.Tensor, group_name: str, strategy: str,
                       scale_a: torch.Tensor, scale_b: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    """fp8 ``gemm_rs``: float32 partials reduce-scattered, rounded once to out_dtype: c_shard [M/W, N]."""
    ctx = _context_by_name(group_name)
    return strategies.get(strategy).gemm_rs(a, b, ctx, scale_a, scale_b, out_dtype,
                                            **strategies.knobs_for(strategy, ctx))


@_gemm_rs_scaled_op.register_fake
def _(a, b, group_name, strategy, scale_a, scale_b, out_dtype):
    world_size = _context_by_name(group_name).world_size
    return a.new_empty((a.shape[0] // world_size, b.shape[1]), dtype=out_dtype)


@torch.library.custom_op("tpfuse::gemm_ar_scaled", mutates_args=())
def _gemm_ar_scaled_op(a: torch.Tensor, b: torch.Tensor, group_name: str, strategy: str,
                       scale_a: torch.Tensor, scale_b: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    """fp8 ``gemm_ar``: float32 partials all-reduced, rounded once to out_dtype: c [M, N]."""
    ctx = _context_by_name(group_name)
    return strategies.get(strategy).gemm_ar(a, b, ctx, scale_a, scale_b, out_dtype,
                                            **strategies.knobs_for(strategy, ctx))


@_gemm_ar_scaled_op.register_fake
def _(a, b, group_name, strategy, scale_a, scale_b, out_dtype):
    return a.new_empty((a.shape[0], b.shape[1]), dtype=out_dtype)


def _takes_fp8(strategy: str) -> bool:
    """Whether ``strategy``'s dtype-policy entry has a rule for fp8 inputs."""
    return any(set(rule.inputs) & set(_fp8.FP8_DTYPES) for rule in strategies.info(strategy).dtypes)


def why_unavailable(strategy: str, ctx: GroupContext, device: torch.device, dtype: torch.dtype, *,
                    op: str | None = None, scale_a: torch.Tensor | None = None) -> str | None:
    """:func:`tpfuse.strategies.why_unavailable`, with the fp8 question first: does the
    strategy's dtype-policy entry (``DTYPES``) take fp8 at all.

    An fp8 call runs the strategy's own schedule with scaled GEMMs, so past that its device and
    backend facts are those of its bfloat16 path.
    """
    if _fp8.is_fp8(dtype):
        if not _takes_fp8(strategy):
            runs = [s for s in strategies.names() if _takes_fp8(s)]
            return f"{strategy} does not run fp8 in this build; use one of {', '.join(map(repr, runs))}"
        dtype = dtypes.HALF.inputs[0]   # its half-precision path's device and backend facts
    return strategies.why_unavailable(strategy, ctx, device, dtype)


def _runnable(ctx: GroupContext, device: torch.device, dtype: torch.dtype, op: str,
              scale_a: torch.Tensor | None) -> list[str]:
    return [s for s in strategies.names()
            if why_unavailable(s, ctx, device, dtype, op=op, scale_a=scale_a) is None]


# --------------------------------------------------------------------------------------------
# Strategy choice: one decision per (group, agreed signature), made from what every rank posted
# --------------------------------------------------------------------------------------------

# (group, world size, backend, agreed fields) -> concrete strategy.  Every rank of a group sees the
# same sequence of agreed signatures in a correct program, so hits, misses and the clearing below
# happen at the same call on every rank.
_DECISIONS: dict[tuple, str] = {}
_MAX_DECISIONS = 4096


def clear_decisions() -> None:
    """Forget every cached decision and per-shape check (call it on every rank, at the same point)."""
    _DECISIONS.clear()
    _CALLS.clear()


def _problem_size(op: str, a: torch.Tensor, b: torch.Tensor, world_size: int) -> tuple[int, int, int]:
    """(m, n, k) as the planner takes them: m is the full M, n and k are local."""
    m = a.shape[0] * world_size if op == "ag_gemm" else a.shape[0]
    return m, b.shape[1], a.shape[1]


def _hardware_name(device: torch.device) -> str:
    from tpfuse.model.hardware import detect

    return detect(device).name if device.type == "cuda" else "cpu-gloo"


def _decision_inputs(op: str, strategy: str, a: torch.Tensor, b: torch.Tensor, ctx: GroupContext,
                     scale_a: torch.Tensor | None = None) -> dict:
    """What this rank contributes to an ``auto`` decision: its runnable strategies, hardware
    profile and the tuning-cache times measured for its own local shape."""
    if strategy != "auto":
        return {}
    from tpfuse.plan import measured_times

    m, n, k = _problem_size(op, a, b, ctx.world_size)
    hardware = _hardware_name(a.device)
    measured = measured_times(op, m=m, n=n, k=k, world_size=ctx.world_size, dtype=a.dtype, hardware=hardware) \
        if m * n * k > 0 else {}
    return {"candidates": _runnable(ctx, a.device, a.dtype, op, scale_a), "hardware": hardware,
            "measured": measured}


def _decide(op: str, strategy: str, rows: list[dict], world_size: int) -> str:
    """The strategy for a signature, as a pure function of every rank's posted row.

    A named strategy is itself (each rank checked it can run it).  ``auto`` plans the largest
    local size of any rank (N for ag_gemm, K otherwise) among the strategies every rank can run,
    on rank 0's hardware profile, with the tuning-cache times of the lowest rank whose local size
    is that largest one (its cache key is the planned shape).  Empty problems run ``unfused``.
    """
    if strategy != "auto":
        return strategy
    fields = dict((name, value) for name, value in rows[0]["fields"])
    local = [row["local"][1] for row in rows]
    big = max(local)
    if op == "ag_gemm":
        m, n, k = fields["M/W (rows of a_shard)"] * world_size, big, fields["K"]
    else:
        m, n, k = fields["M (rows of a)"], fields["N"], big
    if m * n * k == 0:
        return "unfused"  # nothing to overlap; unfused handles every empty dimension
    if any("candidates" not in row for row in rows):
        raise RuntimeError(f"{op}: ranks are out of step (some did not post decision inputs for a new "
                           "signature); every rank must run the same sequence of tpfuse calls")
    common = set(rows[0]["candidates"]).intersection(*(row["candidates"] for row in rows[1:]))
    candidates = tuple(s for s in strategies.names() if s in common)
    from tpfuse.plan import choose

    measured = rows[local.index(big)]["measured"]
    return choose(op, m=m, n=n, k=k, world_size=world_size, dtype=fields["dtype"],
                  hardware=rows[0]["hardware"], candidates=candidates, measured=measured).strategy


def group_decision(op: str, strategy: str, a: torch.Tensor, b: torch.Tensor, ctx: GroupContext, *,
                   return_gathered: bool = False, label: str | None = None, guard: bool = True,
                   scale_a: torch.Tensor | None = None, scale_b: torch.Tensor | None = None,
                   out_dtype: torch.dtype | None = None) -> str:
    """The concrete strategy of a validated call, the same on every rank of the group.

    Cached per (group, agreed signature); the first call of a signature runs one agreement round
    (:func:`tpfuse._checks.exchange`) that both checks the agreed fields (the always-on guard)
    and carries what the decision needs.  ``guard=False`` skips the round for a named strategy
    (nothing to decide; used at trace time, where the shapes are stand-ins).
    """
    sig = _checks.call_signature(op, strategy, a, b, return_gathered, strategies.pinned_knobs(ctx),
                                 scale_a, scale_b, out_dtype)
    key = (ctx.group, ctx.world_size, ctx.backend, sig.fields)
    chosen = _DECISIONS.get(key)
    if chosen is not None:
        return chosen
    if strategy != "auto" and not guard:
        return strategy
    try:
        inputs = _decision_inputs(op, strategy, a, b, ctx, scale_a)
    except Exception as exc:  # noqa: BLE001 - e.g. an unreadable tuning cache: post it, do not strand the peers
        _checks.agree(ctx, label or op, exc, None)
        raise
    payload = _checks.payload_of(None, sig, **inputs)
    rows = [payload] if ctx.world_size == 1 else _checks.exchange(ctx, label or op, payload)
    _checks.check_rows(label or op, rows, None)
    chosen = _decide(op, strategy, rows, ctx.world_size)
    if len(_DECISIONS) >= _MAX_DECISIONS:
        clear_decisions()
    _DECISIONS[key] = chosen
    return chosen


def resolve_strategy(op: str, strategy: str, a: torch.Tensor, b: torch.Tensor, ctx: GroupContext, *,
                     guard: bool = True, scale_a: torch.Tensor | None = None, scale_b: torch.Tensor | None = None,
                     out_dtype: torch.dtype | None = None) -> str:
    """The concrete strategy a validated call runs: ``strategy`` itself if it can run here (else a
    ``ValueError`` saying why), or the group's decision among what every rank can run for ``"auto"``.
    ``scale_a``, ``scale_b``, ``out_dtype``: those of an fp8 call (only their kinds are read)."""
    if strategy != "auto":
        reason = why_unavailable(strategy, ctx, a.device, a.dtype, op=op, scale_a=scale_a)
        if reason is not None:
            raise ValueError(f"{op}: strategy {strategy!r} cannot run here: {reason}")
    return group_decision(op, strategy, a, b, ctx, guard=guard, scale_a=scale_a, scale_b=scale_b,
                          out_dtype=out_dtype)


@torch.compiler.assume_constant_result
def _strategy_for_shapes(op: str, strategy: str, m: int, k: int, n: int, dtype: torch.dtype,
                         device: torch.device, group_name: str, scaled: tuple | None = None) -> str:
    """:func:`resolve_strategy` for ``a`` [m, k] and ``b`` [k, n] from plain values.

    The planner behind "auto" reads files and caches, which Dynamo cannot trace; marked as a
    constant result, it runs once at trace time and its answer is baked into the graph.  The
    stand-in operands are one-element tensors expanded to the shapes (only shape, dtype and
    device are read).  ``scaled`` (fp8): (b's dtype, scale_a row-wise, scale_b row-wise, out_dtype).
    """
    def stand_in(shape: tuple[int, ...], of: torch.dtype) -> torch.Tensor:
        return torch.empty((), dtype=of, device=device).expand(shape)

    kw = {}
    b_dtype = dtype
    if scaled is not None:
        b_dtype, rowwise_a, rowwise_b, out_dtype = scaled
        kw = dict(scale_a=stand_in((m, 1) if rowwise_a else (), torch.float32),
                  scale_b=stand_in((1, n) if rowwise_b else (), torch.float32), out_dtype=out_dtype)
    return resolve_strategy(op, strategy, stand_in((m, k), dtype), stand_in((k, n), b_dtype),
                            group_context(resolve_group_name(group_name)), guard=False, **kw)


def traced_strategy(op: str, strategy: str, a: torch.Tensor, b: torch.Tensor, ctx: GroupContext,
                    scale_a: torch.Tensor | None = None, scale_b: torch.Tensor | None = None,
                    out_dtype: torch.dtype | None = None) -> str:
    """The strategy under ``torch.compile``: fixed at trace time.

    A named strategy does not depend on sizes, so shapes stay dynamic.  For "auto",
    ``operator.index`` specializes the symbolic sizes (with a guard): the graph is valid for the
    sizes its strategy was chosen for and recompiles for others (every rank traces the same
    program, so the decision round runs on every rank).
    """
    m = k = n = 1
    if strategy == "auto":
        m, k, n = (operator.index(size) for size in (a.shape[0], a.shape[1], b.shape[1]))
    scaled = None
    if _fp8.is_fp8(a.dtype):
        scaled = (b.dtype, scale_a.dim() == 2, scale_b.dim() == 2, out_dtype or _fp8.DEFAULT_OUT_DTYPE)
    return _strategy_for_shapes(op, strategy, m, k, n, a.dtype, b.device, ctx.group_name, scaled)


# --------------------------------------------------------------------------------------------
# Public API
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Call:
    """What a validated call shape resolved to on this rank (the per-shape work, cached)."""

    ctx: GroupContext
    strategy: str
    module: ModuleType
    signature: _checks.Signature
    per_call_round: bool
    world: object  # the default group when the call was cached (group=None follows WORLD)
    knobs: dict = field(default_factory=dict)   # strategies.knobs_for(strategy, ctx); the key holds the pins' generation


# (op, group, strategy, return_gathered, types, shapes, dtypes, devices, layouts) -> _Call: a hit
# means this exact call passed every local check before, so only the cheap parts run again.
_CALLS: dict[tuple, _Call] = {}


def _world() -> object:
    return dist.distributed_c10d._world.default_pg


def _scale_key(scale) -> tuple | None:
    """What the per-shape cache needs to know of a scale (its checks read nothing else)."""
    return None if scale is None else (type(scale), scale.shape, scale.dtype, scale.device)


def _prepare(op: str, a, b, group, strategy, return_gathered=False, scale_a=None, scale_b=None,
             out_dtype=None) -> _Call:
    """Validate, agree and decide; everything that can fail fails before any data moves, on every
    rank (with the per-call round) or on every rank of a new signature (without it)."""
    try:
        key = (op, group, strategy, return_gathered, type(a), type(b), a.shape, b.shape, a.dtype, b.dtype,
               a.device, b.device, a.layout, b.layout, strategies.pins_generation())
        if scale_a is not None or scale_b is not None or out_dtype is not None:
            key += (_scale_key(scale_a), _scale_key(scale_b), out_dtype)
        hit = _CALLS.get(key) if return_gathered.__class__ is bool else None
    except Exception:  # noqa: BLE001 - not tensors, unhashable group, nested tensors...: the slow path explains
        key = hit = None
    if hit is not None and hit.world is _world():
        if hit.per_call_round:
            _checks.agree(hit.ctx, op, None, hit.signature)
        return hit
    return _prepare_slow(op, a, b, group, strategy, return_gathered, key, scale_a, scale_b, out_dtype)


def _prepare_slow(op, a, b, group, strategy, return_gathered, key, scale_a=None, scale_b=None,
                  out_dtype=None) -> _Call:
    scaled = dict(scale_a=scale_a, scale_b=scale_b, out_dtype=out_dtype)
    if (_fake(a) or _fake(b)) and _fake_mode_active():
        # Shape propagation (FakeTensorMode): nothing runs and nothing is exchanged -- one rank may
        # do it alone.  Local checks only; the custom op's fake impl gives the same shapes for
        # every strategy.
        ctx = group_context(group)
        _checks.check_call(op, a, b, ctx, strategy, return_gathered, **scaled)
        chosen = "unfused" if strategy == "auto" else strategy
        return _Call(ctx, chosen, strategies.get("unfused"), None, False, _world())
    error: Exception | None = None
    try:
        ctx = group_context(group)
    except TypeError as exc:
        # This rank cannot name its group: it reports over the default group, which is what
        # the other ranks use when they pass group=None (docs/ops.md, "Bad input").
        error, ctx = exc, group_context(None)
    sig = None
    if error is None:
        try:
            if _fake(a) or _fake(b):
                raise ValueError(f"{op}: got a FakeTensor outside FakeTensorMode (it has no data); pass real "
                                 "tensors, or call inside the FakeTensorMode that made it (shape propagation)")
            _checks.check_call(op, a, b, ctx, strategy, return_gathered, **scaled)
            if strategy != "auto":
                reason = why_unavailable(strategy, ctx, a.device, a.dtype, op=op, scale_a=scale_a)
                if reason is not None:
                    raise ValueError(f"{op}: strategy {strategy!r} cannot run here: {reason}")
            sig = _checks.call_signature(op, strategy, a, b, return_gathered, strategies.pinned_knobs(ctx),
                                         **scaled)
        except Exception as exc:  # noqa: BLE001 - every local failure is posted, or the peers would wait
            error = exc
    per_call = _checks.agreement_enabled(ctx, getattr(getattr(a, "device", None), "type", None))
    if error is not None:
        _checks.agree(ctx, op, error, None)  # posts the error (world size > 1) and raises
    if per_call and (ctx.group, ctx.world_size, ctx.backend, sig.fields) in _DECISIONS:
        _checks.agree(ctx, op, None, sig)  # the decision is known: the per-call round only checks
    chosen = group_decision(op, strategy, a, b, ctx, return_gathered=return_gathered, **scaled)
    call = _Call(ctx, chosen, strategies.get(chosen), sig, per_call, _world(), strategies.knobs_for(chosen, ctx))
    if key is not None:
        if len(_CALLS) >= 4 * _MAX_DECISIONS:
            _CALLS.clear()
        _CALLS[key] = call
    return call


def _fake(x: object) -> bool:
    from torch._subclasses.fake_tensor import FakeTensor

    return isinstance(x, FakeTensor)


def _fake_mode_active() -> bool:
    """Whether a FakeTensorMode is on the dispatch stack (shape propagation, not a real call)."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

    return any(isinstance(mode, FakeTensorMode) for mode in _get_current_dispatch_mode_stack())


def _direct(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether an eager call may skip the custom op's dispatcher and call the strategy itself.

    Only plain tensors with no autograd to record, outside tracing (every caller has checked
    ``torch.compiler.is_compiling()`` first), and with no Python dispatch or function mode active
    (FakeTensorMode, profilers' modes...): there the custom op's fake impl and autograd formula
    are needed.  The result is the same either way.
    """
    return (a.__class__ in _PLAIN and b.__class__ in _PLAIN
            and not (torch.is_grad_enabled() and (a.requires_grad or b.requires_grad))
            and not torch._C._len_torch_dispatch_stack()
            and not torch._C._is_torch_function_mode_enabled())


_PLAIN = (torch.Tensor, torch.nn.Parameter)


def _traced(op: str, a, b, group, strategy, return_gathered=False, **scaled) -> tuple[GroupContext, str]:
    ctx = group_context(group)
    _checks.check_call(op, a, b, ctx, strategy, return_gathered, **scaled)  # local checks become guards
    return ctx, traced_strategy(op, strategy, a, b, ctx, **scaled)


def _scaled_call(a) -> bool:
    """Whether a call takes the scaled (fp8) path: its ``a`` is fp8 (the checks refused every
    other way of passing fp8 operands or scales)."""
    return isinstance(a, torch.Tensor) and _fp8.is_fp8(a.dtype)


def ag_gemm(a_shard: torch.Tensor, b: torch.Tensor, group: dist.ProcessGroup | None = None, *,
            scale_a: torch.Tensor | None = None, scale_b: torch.Tensor | None = None,
            out_dtype: torch.dtype | None = None, strategy: str = "auto", return_gathered: bool = False):
    """AllGather + GEMM: ``all_gather(a_shard, dim=0) @ b``.

    | tensor | shape | sharding |
    |---|---|---|
    | ``a_shard`` | [M/W, K] | rows of A, rank r holds rows r*M/W .. (r+1)*M/W |
    | ``b`` | [K, N] | this rank's own (e.g. ``weight.t()`` of a column-parallel [N, K] weight) |
    | returns ``c`` | [M, N] | all rows, this rank's columns |
    | ``a_full`` (``return_gathered=True``) | [M, K] | the gathered A, bit-exact copy of every shard |

    ``strategy``: "auto" (the planner), "unfused", "ring", "copy_engine", "fused".

    fp8 (``torch._scaled_mm``'s meaning): ``a_shard`` and ``b`` float8_e4m3fn (one of them may be
    float8_e5m2), ``scale_a`` float32 0-d (tensor-wise: the scale of the whole gathered A, the same
    on every rank) or [M/W, 1] (row-wise, this shard's rows; gathered with them), ``scale_b`` 0-d
    or [1, N]; ``c = (a_full * scale_a_full) @ (b * scale_b)`` accumulated in float32 and rounded
    to ``out_dtype`` (default bfloat16; float16, float32).  K and N must be multiples of 16.
    ``return_gathered=True`` returns ``(c, a_full, scale_a_full)`` (row-wise: [M, 1]; tensor-wise:
    a copy of ``scale_a``).  docs/ops.md, "fp8".
    """
    if _scaled_call(a_shard):
        return _ag_gemm_scaled(a_shard, b, group, strategy, return_gathered, scale_a, scale_b, out_dtype)
    if torch.compiler.is_compiling():
        ctx, chosen = _traced("ag_gemm", a_shard, b, group, strategy, return_gathered,
                              scale_a=scale_a, scale_b=scale_b, out_dtype=out_dtype)
        c, a_full = torch.ops.tpfuse.ag_gemm(a_shard, b, ctx.group_name, chosen)
        return (c, a_full) if return_gathered else c
    token = enter_call(group, "ag_gemm")
    try:
        call = _prepare("ag_gemm", a_shard, b, group, strategy, return_gathered, scale_a, scale_b, out_dtype)
        if _direct(a_shard, b):
            c, a_full = call.module.ag_gemm(a_shard, b, call.ctx, **call.knobs)
        else:
            c, a_full = torch.ops.tpfuse.ag_gemm(a_shard, b, call.ctx.group_name, call.strategy)
    finally:
        if token is not None:
            leave_call(token)
    return (c, a_full) if return_gathered else c


def _ag_gemm_scaled(a_shard, b, group, strategy, return_gathered, scale_a, scale_b, out_dtype):
    out = out_dtype or _fp8.DEFAULT_OUT_DTYPE
    if torch.compiler.is_compiling():
        ctx, chosen = _traced("ag_gemm", a_shard, b, group, strategy, return_gathered,
                              scale_a=scale_a, scale_b=scale_b, out_dtype=out_dtype)
        c, a_full, scale_full = torch.ops.tpfuse.ag_gemm_scaled(a_shard, b, ctx.group_name, chosen, scale_a,
                                                                scale_b, out)
    else:
        token = enter_call(group, "ag_gemm")
        try:
            call = _prepare("ag_gemm", a_shard, b, group, strategy, return_gathered, scale_a, scale_b, out_dtype)
            if _direct(a_shard, b):
                c, a_full, scale_full = call.module.ag_gemm(a_shard, b, call.ctx, scale_a, scale_b, out,
                                                            **call.knobs)
            else:
                c, a_full, scale_full = torch.ops.tpfuse.ag_gemm_scaled(a_shard, b, call.ctx.group_name,
                                                                        call.strategy, scale_a, scale_b, out)
        finally:
            if token is not None:
                leave_call(token)
    return (c, a_full, scale_full) if return_gathered else c


def gemm_rs(a: torch.Tensor, b: torch.Tensor, group: dist.ProcessGroup | None = None, *,
            scale_a: torch.Tensor | None = None, scale_b: torch.Tensor | None = None,
            out_dtype: torch.dtype | None = None, strategy: str = "auto"):
    """GEMM + ReduceScatter: ``reduce_scatter_sum(a @ b, dim=0)``.

    | tensor | shape | sharding |
    |---|---|---|
    | ``a`` | [M, K] | all rows, this rank's K slice (K may differ per rank) |
    | ``b`` | [K, N] | this rank's K rows (e.g. ``weight.t()`` of a row-parallel [N, K] weight) |
    | returns ``c_shard`` | [M/W, N] | rows r*M/W .. (r+1)*M/W of the sum over ranks |

    M must be divisible by W.  bf16/fp16 partials are summed in float32, then rounded once.
    fp8: ``scale_a`` 0-d or [M, 1], ``scale_b`` 0-d or [1, N], ``out_dtype`` as for
    :func:`ag_gemm`; the float32 partials are summed, then rounded once to ``out_dtype``.
    """
    return _reduce_op("gemm_rs", a, b, group, strategy, scale_a, scale_b, out_dtype)


def gemm_ar(a: torch.Tensor, b: torch.Tensor, group: dist.ProcessGroup | None = None, *,
            scale_a: torch.Tensor | None = None, scale_b: torch.Tensor | None = None,
            out_dtype: torch.dtype | None = None, strategy: str = "auto"):
    """GEMM + AllReduce: ``all_reduce_sum(a @ b)``.

    | tensor | shape | sharding |
    |---|---|---|
    | ``a`` | [M, K] | all rows, this rank's K slice |
    | ``b`` | [K, N] | this rank's K rows |
    | returns ``c`` | [M, N] | the full sum, equal on every rank |

    bf16/fp16 partials are summed in float32, then rounded once.  fp8: as for :func:`gemm_rs`.
    """
    return _reduce_op("gemm_ar", a, b, group, strategy, scale_a, scale_b, out_dtype)


def _reduce_op(op: str, a: torch.Tensor, b: torch.Tensor, group, strategy: str, scale_a=None, scale_b=None,
               out_dtype=None) -> torch.Tensor:
    """gemm_rs / gemm_ar: traced -> the custom op with the strategy fixed at trace time; eager ->
    validate and decide, then the strategy directly (or through the custom op, see _direct)."""
    fp8 = _scaled_call(a)
    out = out_dtype or _fp8.DEFAULT_OUT_DTYPE
    if torch.compiler.is_compiling():
        ctx, chosen = _traced(op, a, b, group, strategy, scale_a=scale_a, scale_b=scale_b, out_dtype=out_dtype)
        if fp8:
            return getattr(torch.ops.tpfuse, op + "_scaled")(a, b, ctx.group_name, chosen, scale_a, scale_b, out)
        return getattr(torch.ops.tpfuse, op)(a, b, ctx.group_name, chosen)
    token = enter_call(group, op)
    try:
        call = _prepare(op, a, b, group, strategy, False, scale_a, scale_b, out_dtype)
        if fp8:
            if _direct(a, b):
                return getattr(call.module, op)(a, b, call.ctx, scale_a, scale_b, out,
                                                **call.knobs)
            return getattr(torch.ops.tpfuse, op + "_scaled")(a, b, call.ctx.group_name, call.strategy, scale_a,
                                                             scale_b, out)
        if _direct(a, b):
            return getattr(call.module, op)(a, b, call.ctx, **call.knobs)
        return getattr(torch.ops.tpfuse, op)(a, b, call.ctx.group_name, call.strategy)
    finally:
        if token is not None:
            leave_call(token)
