"""Input validation for the three ops, and the cross-rank agreement round.

Validation is local and pure (types, names, shapes, dtypes, devices, layouts): the same checks in
the same order on every rank, before any communication, so bad input that every rank shares fails
on every rank at once.  Bad input on *some* ranks only, or ranks calling with different shapes,
would leave the others waiting in a collective; an agreement round (:func:`exchange`) closes that
hole: every rank posts its call's signature in the user's words (or its local error) through the
process group's store, and a mismatch or an error becomes an exception on every rank.  When rounds
run (every call, or the first call of each new signature) is in docs/ops.md.
"""

from __future__ import annotations

import datetime
import functools
import json
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

from tpfuse import _fp8, dtypes, strategies
from tpfuse._dist import GroupContext

__all__ = ["OPS", "check_call", "agreement_enabled", "agree", "signature",
           "call_signature", "Signature", "exchange", "payload_of", "check_rows", "agree_timeout_s"]

OPS = ("ag_gemm", "gemm_rs", "gemm_ar")
_OPERANDS = {
    "ag_gemm": ("a_shard", "[M/W, K]"),
    "gemm_rs": ("a", "[M, K]"),
    "gemm_ar": ("a", "[M, K]"),
}


def _check_matrix(op: str, name: str, layout: str, x: object) -> torch.Tensor:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{op}: {name} must be a torch.Tensor {layout}, got {type(x).__name__}")
    if x.layout != torch.strided:
        raise ValueError(
            f"{op}: {name} must be a dense (strided) tensor {layout}, got layout {x.layout}; "
            f"convert it with {name}.to_dense()"
        )
    if x.dim() != 2:
        raise ValueError(
            f"{op}: {name} must be a 2-D matrix {layout}, got shape {tuple(x.shape)}; "
            f"flatten leading dims first (x.reshape(-1, x.shape[-1])) or use tpfuse.nn layers"
        )
    if x.device.type == "meta":
        raise ValueError(
            f"{op}: {name} is on the meta device (shape only, no data); the ops compute on real "
            f"tensors -- move it to the rank's CPU or GPU (torch.compile traces them with fake tensors itself)"
        )
    return x


def check_call(op: str, a: object, b: object, ctx: GroupContext, strategy: object,
               return_gathered: object = False, scale_a: object = None, scale_b: object = None,
               out_dtype: object = None) -> None:
    """Raise ``TypeError``/``ValueError`` for a call that no strategy may run.

    Checks only this rank's arguments (no communication); the same checks in the same order
    on every rank.  Strategy *availability* (including whether the named strategy takes the
    dtype) is checked separately by :func:`tpfuse.strategies.why_unavailable`.  fp8 operands,
    scales and ``out_dtype``: :func:`tpfuse._fp8.check_scaled`.
    """
    names = strategies.names()
    if not isinstance(strategy, str):
        raise TypeError(f"{op}: strategy must be a string, got {type(strategy).__name__} {strategy!r}; "
                        f"use 'auto' or one of {', '.join(names)}")
    if strategy != "auto" and strategy not in names:
        raise ValueError(
            f"{op}: unknown strategy {strategy!r}; choose one of {', '.join(names)} or 'auto'"
        )
    if not isinstance(return_gathered, bool):
        raise TypeError(f"{op}: return_gathered must be a bool, got {type(return_gathered).__name__} "
                        f"{return_gathered!r}; pass True or False")
    a_name, a_layout = _OPERANDS[op]
    a = _check_matrix(op, a_name, a_layout, a)
    b = _check_matrix(op, "b", "[K, N]", b)
    fp8 = _fp8.is_fp8(a.dtype) or _fp8.is_fp8(b.dtype)
    if a.dtype != b.dtype and not fp8:
        raise TypeError(
            f"{op}: {a_name} is {a.dtype} but b is {b.dtype}; cast one of them (b.to({a_name}.dtype))"
        )
    takers = [s for s in names if dtypes.accepts(strategies.info(s).dtypes, a.dtype)]
    if not takers and not fp8:
        raise TypeError(
            f"{op}: dtype {a.dtype} is not supported; use one of "
            f"{', '.join(sorted({str(d) for s in names for d in dtypes.inputs(strategies.info(s).dtypes)}))} "
            f"(float8_e4m3fn with scale_a and scale_b)"
        )
    if a.device != b.device:
        raise ValueError(f"{op}: {a_name} is on {a.device} but b is on {b.device}; move both to one device")
    if ctx.device_type == "cuda" and a.device.type != "cuda":
        raise ValueError(
            f"{op}: the group's backend is {ctx.backend!r}, which needs CUDA tensors, but "
            f"{a_name} is on {a.device}; move the inputs to the rank's GPU"
        )
    if a.shape[1] != b.shape[0]:
        raise ValueError(
            f"{op}: inner dimensions differ: {a_name} is {tuple(a.shape)} {a_layout} and b is "
            f"{tuple(b.shape)} [K, N], so K = {a.shape[1]} vs {b.shape[0]}; pass b as [K, N] "
            f"(for an nn.Linear weight [N, K], pass weight.t())"
        )
    if op == "gemm_rs" and a.shape[0] % ctx.world_size != 0:
        raise ValueError(
            f"gemm_rs: M = {a.shape[0]} rows of a must be divisible by the world size "
            f"{ctx.world_size} (each rank gets M/W rows of the result); pad M to "
            f"{-(-a.shape[0] // ctx.world_size) * ctx.world_size}"
        )
    _fp8.check_scaled(op, a_name, a, b, scale_a, scale_b, out_dtype)


# --------------------------------------------------------------------------------------------
# Cross-rank agreement: one small exchange through the process group's store
# --------------------------------------------------------------------------------------------


@functools.lru_cache(maxsize=1)
def _debug_setting() -> str | None:
    return os.environ.get("TPFUSE_DEBUG")


def agreement_enabled(ctx: GroupContext, data_device_type: str | None = None) -> bool:
    """Whether every call (not only the first of each signature) runs an agreement round.

    ``TPFUSE_DEBUG=1`` forces it on, ``TPFUSE_DEBUG=0`` off (every rank must see the same
    setting).  Unset: on when the group's collectives and the call's data (``data_device_type``,
    when given) are on the CPU (gloo with CPU tensors, where a store round costs little next to
    a CPU GEMM), off otherwise: for NCCL, and for CUDA tensors on a gloo group (the one-GPU bed,
    where the round cost ~0.43 ms per call against ~0.5 ms for the whole symmetric-memory call,
    ``python -m tpfuse.bench.host --bed 2``).  Never for world size 1 or under torch.compile
    tracing.  With it off, the first call of each new signature still runs one round (the
    always-on guard).
    """
    if ctx.world_size == 1 or torch.compiler.is_compiling():
        return False
    setting = _debug_setting()
    if setting is not None:
        return setting not in ("0", "", "false", "False")
    return ctx.device_type != "cuda" and data_device_type in (None, "cpu")


# An agreement round waits this many times TPFUSE_TIMEOUT_S (the bound of the device-side waits,
# default 10 s): a peer may be compiling its first call's kernels while the others wait for it.
AGREE_TIMEOUT_FACTOR = 30


def agree_timeout_s() -> float:
    """Seconds a rank waits in an agreement round for the others: ``AGREE_TIMEOUT_FACTOR`` x
    ``TPFUSE_TIMEOUT_S`` (default 30 x 10 s = 300 s)."""
    from tpfuse.symm import timeout_s

    return AGREE_TIMEOUT_FACTOR * timeout_s()


@dataclass(frozen=True)
class Signature:
    """A call in the user's words: ``fields`` every rank must agree on, ``local`` this rank's own.

    ``fields`` is a tuple of (name, value) pairs -- the decision cache key of :mod:`tpfuse.ops`;
    ``local`` is (name, value) of the size that may differ per rank (N for ag_gemm, K otherwise).
    """

    op: str
    fields: tuple[tuple[str, object], ...]
    local: tuple[str, int]


def call_signature(op: str, strategy: str, a: torch.Tensor, b: torch.Tensor,
                   return_gathered: bool = False, knobs: str = "", scale_a: torch.Tensor | None = None,
                   scale_b: torch.Tensor | None = None, out_dtype: torch.dtype | None = None) -> Signature:
    """The :class:`Signature` of a call that passed :func:`check_call`; ``knobs``: the knobs
    pinned on the group (``tpfuse.strategies.pinned_knobs``), agreed when there are any (fp8
    calls add b's dtype, the kind of each scale and the output dtype to the agreed fields)."""
    a_name, _ = _OPERANDS[op]
    rows = ("M/W (rows of a_shard)" if op == "ag_gemm" else "M (rows of a)", int(a.shape[0]))
    if op == "ag_gemm":
        agreed, local = ("K", int(a.shape[1])), ("N", int(b.shape[1]))
    else:
        agreed, local = ("N", int(b.shape[1])), ("K", int(a.shape[1]))
    fields = (("op", op), ("strategy", strategy), ("dtype", str(a.dtype)), ("device type", a.device.type),
              ("layout", str(a.layout)), rows, agreed)
    if op == "ag_gemm":
        fields += (("return_gathered", bool(return_gathered)),)
    if knobs:
        fields += (("pinned knobs", knobs),)
    if _fp8.is_fp8(a.dtype):
        fields += (("b dtype", str(b.dtype)), ("scale_a", _fp8.scale_kind(scale_a)),
                   ("scale_b", _fp8.scale_kind(scale_b)), ("out_dtype", str(out_dtype or _fp8.DEFAULT_OUT_DTYPE)))
    return Signature(op, fields, local)


def signature(op: str, strategy: str, a: torch.Tensor, b: torch.Tensor, extra: int = 0, **scaled) -> Signature:
    """:func:`call_signature` with ``return_gathered`` given as an int (the layers' spelling);
    ``scaled``: ``scale_a``, ``scale_b``, ``out_dtype`` of an fp8 call."""
    return call_signature(op, strategy, a, b, bool(extra), **scaled)


def _agreed(message: str) -> ValueError:
    """A ``ValueError`` that a round raised on every rank of it (another rank's error, a mismatch):
    marked so that a caller collecting errors for a later :func:`agree` does not post it again
    (that rank would then run one round more than the others and hang the next call)."""
    exc = ValueError(message)
    exc.tpfuse_agreed = True
    return exc


class _Rounds:
    """Sequence numbers of agreement rounds per process group (every member counts the same)."""

    def __init__(self) -> None:
        self.next: dict[dist.ProcessGroup, int] = {}
        self.broken: dict[dist.ProcessGroup, str] = {}

    def take(self, group: dist.ProcessGroup) -> int:
        seq = self.next.get(group, 0)
        self.next[group] = seq + 1
        return seq


_ROUNDS = _Rounds()


def _store() -> dist.Store:
    return dist.distributed_c10d._get_default_store()


def _key(ctx: GroupContext, seq: int, rank: int) -> str:
    return f"tpfuse/agree/{ctx.group_name}/{seq}/{rank}"


def exchange(ctx: GroupContext, label: str, payload: dict, *, wait: bool = True) -> list[dict] | None:
    """One agreement round: post this rank's ``payload`` (JSON) and, with ``wait``, return every
    rank's, in group-rank order.

    Goes through the default group's c10d store (TCPStore), never through the backend: no CUDA
    tensor, no device sync, and a bounded wait (:func:`agree_timeout_s`) instead of the
    process-group timeout.  ``wait=False`` posts and returns (a rank with a local error posts it
    and raises at once; the waiting ranks read it).  Each rank deletes its key of the previous
    round once this round completed (every rank has posted this one, so all read the last one).
    """
    broken = _ROUNDS.broken.get(ctx.group)
    if broken is not None:
        raise RuntimeError(f"{label}: {broken}")
    store = _store()
    seq = _ROUNDS.take(ctx.group)
    store.set(_key(ctx, seq, ctx.rank), json.dumps(payload))
    if not wait:
        return None
    keys = [_key(ctx, seq, r) for r in range(ctx.world_size)]
    timeout = agree_timeout_s()
    try:
        store.wait(keys, datetime.timedelta(seconds=timeout))
    except (dist.DistError, RuntimeError) as exc:
        missing = [r for r, k in enumerate(keys) if not store.check([k])]
        if not missing:  # arrived just now
            return exchange_rows(store, keys, ctx, seq)
        message = (
            f"the other ranks did not all reach tpfuse's agreement step: rank(s) {missing} of group "
            f"{ctx.group_name!r} posted nothing within {timeout:g} s (30 x TPFUSE_TIMEOUT_S). They may "
            f"still be busy, may have raised before it (a rank whose `group` argument is not a "
            f"ProcessGroup reports its error over the default group only), or may be running a call "
            f"whose signature they had seen before while this rank's differs. The group's agreement "
            f"rounds are out of step now: re-create the process group"
        )
        _ROUNDS.broken[ctx.group] = message
        raise TimeoutError(f"{label}: {message}") from exc
    return exchange_rows(store, keys, ctx, seq)


def exchange_rows(store: dist.Store, keys: list[str], ctx: GroupContext, seq: int) -> list[dict]:
    rows = [json.loads(v) for v in store.multi_get(keys)]
    if seq > 0:
        store.delete_key(_key(ctx, seq - 1, ctx.rank))
    return rows


def payload_of(error: Exception | None, sig: Signature | None, **extra: object) -> dict:
    """What a rank posts: its error (type and message) or its signature, plus decision inputs."""
    if error is not None:
        return {"error": f"{type(error).__name__}: {error}"}
    return {"error": None, "op": sig.op, "fields": [list(f) for f in sig.fields],
            "local": list(sig.local), **extra}


def check_rows(label: str, rows: list[dict], error: Exception | None) -> None:
    """Raise on every rank if any rank posted an error or the agreed fields differ.

    The rank with the error re-raises its own; the others get a ``ValueError`` naming the
    rank(s) and their messages.  A mismatch names every differing field with each rank's value.
    """
    bad = [r for r, row in enumerate(rows) if row.get("error")]
    if error is not None:
        raise error
    if bad:
        details = "; ".join(f"rank {r}: {rows[r]['error']}" for r in bad)
        raise _agreed(f"{label}: invalid input on rank(s) {bad} of the group ({details}); "
                      "no communication was started")
    first = rows[0]["fields"]
    if all(row["fields"] == first for row in rows[1:]):
        return
    names = [name for name, _ in first]
    if any([n for n, _ in row["fields"]] != names for row in rows):  # different ops or arities
        names = ["op"]
    parts = []
    for i, name in enumerate(names):
        values = [dict((n, v) for n, v in row["fields"]).get(name) for row in rows]
        if len(set(map(repr, values))) > 1:
            by_value: dict[str, list[int]] = {}
            for r, v in enumerate(values):
                by_value.setdefault(str(v), []).append(r)
            parts.append(f"{name} ({', '.join(f'{v} on rank(s) {rs}' for v, rs in by_value.items())})")
    op = rows[0].get("op", label)
    allowed = "N" if op == "ag_gemm" else "K"
    raise _agreed(
        f"{label}: ranks disagree on {' and '.join(parts)}; every rank must call {op} with the same "
        f"op, strategy, dtype, device type, layout and shapes (only the local {allowed} may differ)"
    )


def agree(ctx: GroupContext, op: str, error: Exception | None, signature: Signature | None) -> None:
    """One agreement round for a call: raise on every rank if any rank failed validation or the
    signatures differ.  A rank with an error posts it and raises without waiting."""
    if ctx.world_size == 1 or getattr(error, "tpfuse_agreed", False):
        if error is not None:
            raise error  # it came out of a round every rank ran: do not post it again
        return
    if error is not None:
        exchange(ctx, op, payload_of(error, None), wait=False)
        raise error
    rows = exchange(ctx, op, payload_of(None, signature))
    check_rows(op, rows, None)
