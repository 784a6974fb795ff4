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
import threading
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from tpfuse import _fp8, dtypes, strategies
from tpfuse._dist import GroupContext

__all__ = ["OPS", "check_call", "check_m_divisible", "check_memory", "call_buffers", "agreement_enabled", "agree", "signature",
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
    if x.is_nested:
        raise ValueError(f"{op}: {name} is a nested tensor; the ops take one dense 2-D matrix {layout}: "
                         f"pad it (torch.nested.to_padded_tensor) or concatenate its pieces along dim 0")
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
    if op == "gemm_rs":
        check_m_divisible(op, a.shape[0], ctx.world_size)
    _fp8.check_scaled(op, a_name, a, b, scale_a, scale_b, out_dtype)
    if not torch.compiler.is_compiling():  # traced sizes are symbolic; the eager call checks them
        check_memory(op, a, b, ctx.world_size)


def check_m_divisible(op: str, m: int, world_size: int) -> None:
    """``ValueError`` unless the full M divides by the world size (ag_gemm and gemm_rs shard rows);
    the ops and the planner share it, so both refuse alike."""
    if op in ("ag_gemm", "gemm_rs") and m % world_size != 0:
        what = ("each rank gets M/W rows of the result" if op == "gemm_rs"
                else "each rank holds M/W rows of a_shard")
        rows = "M = {m} rows of a" if op == "gemm_rs" else "M = {m} rows of the gathered a"
        raise ValueError(f"{op}: {rows.format(m=m)} must be divisible by the world size {world_size} ({what}); "
                         f"pad M to {-(-m // world_size) * world_size}")


_INT64_MAX = 2**63 - 1


@functools.lru_cache(maxsize=16)
def device_memory_bytes(device: torch.device) -> int:
    """Total memory of ``device``: the GPU's (``total_memory``), or the host's RAM for the CPU."""
    if device.type == "cuda":
        return int(torch.cuda.get_device_properties(device).total_memory)
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):  # not a POSIX host: no bound but int64
        return _INT64_MAX


def _accumulate_bytes(dtype: torch.dtype) -> int:
    return 8 if dtype == torch.float64 else 4


def call_buffers(op: str, a: torch.Tensor, b: torch.Tensor, world_size: int) -> list[tuple[str, list[int], int]]:
    """(name, shape, bytes) of what a call may allocate: its outputs, the fp32 (fp64) partial
    products of a reduction, and a contiguous copy of an input that is not contiguous (a stride-0
    expanded input takes no memory until copied)."""
    rows, k, n = int(a.shape[0]), int(a.shape[1]), int(b.shape[1])
    elt = a.element_size()
    acc = _accumulate_bytes(a.dtype)
    if op == "ag_gemm":
        m = rows * world_size
        out = [("c [M, N]", [m, n], m * n * elt), ("gathered a [M, K]", [m, k], m * k * elt)]
    else:
        out = [("partial products a @ b [M, N]", [rows, n], rows * n * acc)]
        shard = rows // world_size if op == "gemm_rs" else rows
        out.append(("c_shard [M/W, N]" if op == "gemm_rs" else "c [M, N]", [shard, n], shard * n * elt))
    for name, x in (("a_shard" if op == "ag_gemm" else "a", a), ("b", b)):
        if not x.is_contiguous():
            out.append((f"a contiguous copy of {name}", list(x.shape), x.numel() * elt))
    return out


def check_memory(op: str, a: torch.Tensor, b: torch.Tensor, world_size: int) -> None:
    """``ValueError`` for a call whose buffers (:func:`call_buffers`) overflow int64 or exceed the
    device's memory, before anything is allocated: the same answer on every rank for the agreed
    sizes, and a posted error for a rank whose local size alone is too large."""
    buffers = call_buffers(op, a, b, world_size)
    total = sum(size for _, _, size in buffers)
    name, shape, size = max(buffers, key=lambda buf: buf[2])
    if max(max(shape) if shape else 0, total) > _INT64_MAX:
        raise ValueError(f"{op}: {name} {shape} overflows int64 ({total} bytes in all); such sizes cannot "
                         "be allocated anywhere -- check M, K and N")
    memory = device_memory_bytes(a.device)
    if total > memory:
        raise ValueError(
            f"{op}: this call needs {total / 2**30:.1f} GiB ({name} {shape} alone is {size / 2**30:.1f} GiB) "
            f"but {a.device} has {memory / 2**30:.1f} GiB of memory; shard it over more ranks or split M")


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
    # Ranks that disagree on the per-call round would run different numbers of rounds.
    fields += (("TPFUSE_DEBUG", _debug_label()),)
    return Signature(op, fields, local)


def _debug_label() -> str:
    setting = _debug_setting()
    if setting is None:
        return "unset"
    return "0 (off)" if setting in ("0", "", "false", "False") else f"{setting} (on)"


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
    """Sequence numbers of agreement rounds per process group (every member counts the same), and
    the groups whose rounds went out of step.  Threads may run rounds on different groups at once."""

    def __init__(self) -> None:
        self.next: dict[dist.ProcessGroup, int] = {}
        self.broken: dict[dist.ProcessGroup, str] = {}
        self.lock = threading.Lock()

    def take(self, group: dist.ProcessGroup) -> int:
        with self.lock:
            seq = self.next.get(group, 0)
            self.next[group] = seq + 1
            return seq


_ROUNDS = _Rounds()
_THREAD = threading.local()


def _store() -> dist.Store:
    """This thread's handle on the default group's store.

    One c10d store client used from two threads at once stalls (set/wait interleave on its one
    socket); ``Store.clone()`` gives each thread its own connection to the same store.
    """
    default = dist.distributed_c10d._get_default_store()
    mine = getattr(_THREAD, "store", None)
    if mine is None or _THREAD.base is not default:
        mine = _THREAD.store = default.clone()
        _THREAD.base = default
    return mine


def _key(ctx: GroupContext, seq: int, rank: int) -> str:
    return f"tpfuse/agree/{ctx.group_name}/{seq}/{rank}"


def _outcome_key(group_name: str, seq: int) -> str:
    return f"tpfuse/agree/{group_name}/{seq}/outcome"


# A rank whose first wait of a round takes this long posts a note ("rank r waits in a round of
# group G"), so that a peer waiting in another group for it can tell that the two called with
# different group objects; such a deadlock is reported after the notes agree for _MISMATCH_S.
_NOTE_AFTER_S = 0.5
_MISMATCH_S = 2.0
_POLL_S = 0.02


class _Notes:
    """The rounds this process is waiting in, posted under ``tpfuse/note/<global rank>``."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.waiting: dict[str, dict] = {}  # group name -> {"seq", "members", "label", "thread"}

    def key(self, global_rank: int) -> str:
        return f"tpfuse/note/{global_rank}"

    def post(self, store: dist.Store, group_name: str, note: dict | None) -> None:
        with self.lock:
            if note is None:
                self.waiting.pop(group_name, None)
            else:
                self.waiting[group_name] = note
            store.set(self.key(dist.get_rank()), json.dumps(self.waiting))

    def read(self, store: dist.Store, global_rank: int) -> dict[str, dict]:
        key = self.key(global_rank)
        return json.loads(store.get(key)) if store.check([key]) else {}


_NOTES = _Notes()


def _members(ctx: GroupContext) -> list[int]:
    return [ctx.global_rank(r) for r in range(ctx.world_size)]


def _other_group_deadlock(store: dist.Store, ctx: GroupContext, missing: list[int]) -> tuple[str, str, str] | None:
    """The first missing rank that waits in a round of *another* group that this rank belongs
    to, has not posted to, and has no call waiting in: (description, this rank's posting key in
    that round, that round's outcome key); else None."""
    me = dist.get_rank()
    with _NOTES.lock:
        mine = dict(_NOTES.waiting)
    for r in missing:
        for name, note in _NOTES.read(store, ctx.global_rank(r)).items():
            if name == ctx.group_name or me not in note["members"] or name in mine:
                continue
            my_key = f"tpfuse/agree/{name}/{note['seq']}/{note['members'].index(me)}"
            if not store.check([my_key]):
                return (f"rank {r} of group {ctx.group_name!r} is in a call of {note['label']} on group "
                        f"{name!r} (global ranks {note['members']}, thread {note['thread']!r}), which this "
                        f"rank is in no call on", my_key, _outcome_key(name, note["seq"]))
    return None


def _abandon(store: dist.Store, ctx: GroupContext, seq: int, message: str, mismatch: bool = False) -> bool:
    """Leave round ``seq`` without an answer: mark its outcome aborted, overwrite this rank's
    posting with the error (a late peer reads it instead of a stale signature) and mark the
    group's rounds broken.  Returns False if another rank had already completed the round (every
    rank posted: this one may go on)."""
    if not _poison(store, _outcome_key(ctx.group_name, seq), _key(ctx, seq, ctx.rank), message, mismatch):
        return False
    _ROUNDS.broken[ctx.group] = message
    return True


def _poison(store: dist.Store, outcome_key: str, posting_key: str, message: str, mismatch: bool) -> bool:
    """Mark a round's outcome aborted (unless it completed) and post ``message`` as this rank's
    error in it; False if the round had completed."""
    if store.compare_set(outcome_key, "", "abort").decode() == "ok":
        return False
    store.set(posting_key, json.dumps({"error": message, "abandoned": True, "mismatch": mismatch}))
    return True


def exchange(ctx: GroupContext, label: str, payload: dict, *, wait: bool = True) -> list[dict] | None:
    """One agreement round: post this rank's ``payload`` (JSON) and, with ``wait``, return every
    rank's, in group-rank order.

    Goes through the default group's c10d store (TCPStore), never through the backend: no CUDA
    tensor, no device sync, and a bounded wait (:func:`agree_timeout_s`) instead of the
    process-group timeout.  ``wait=False`` posts and returns (a rank with a local error posts it
    and raises at once; the waiting ranks read it).  Each rank deletes its key of the previous
    round once this round completed (every rank has posted this one, so all read the last one).

    A round ends one way on every rank: the first rank to see every posting marks its outcome
    "ok" (one ``compare_set``); a rank that gives up (timeout, or a peer waiting in another group
    with the same members) marks it "abort" and overwrites its posting with the error, so a rank
    that arrives later raises too instead of entering a collective nobody else will join.
    """
    broken = _ROUNDS.broken.get(ctx.group)
    if broken is not None:
        raise RuntimeError(f"{label}: {broken}")
    error = None
    try:
        timeout = agree_timeout_s()  # read before posting: a bad setting is this rank's error
    except ValueError as exc:
        error, payload, wait = exc, payload_of(exc, None), False
    store = _store()
    seq = _ROUNDS.take(ctx.group)
    mine = json.dumps(payload)
    # Post only into an empty slot: a peer that saw this rank in a call on another group has ended
    # this round already and left its reason in this rank's slot (never overwrite it).
    posted = store.compare_set(_key(ctx, seq, ctx.rank), "", mine).decode()
    if error is not None:
        raise error
    if posted != mine:
        message = (f"another rank ended this agreement round before this rank arrived: "
                   f"{json.loads(posted)['error']}")
        _ROUNDS.broken[ctx.group] = message
        raise _agreed(f"{label}: {message}")
    if not wait:
        return None
    keys = [_key(ctx, seq, r) for r in range(ctx.world_size)]
    _wait(store, ctx, label, keys, seq, timeout)
    if store.compare_set(_outcome_key(ctx.group_name, seq), "", "ok").decode() != "ok":
        rows = [json.loads(v) for v in store.multi_get(keys)]
        gone = [row for row in rows if row.get("abandoned")] or [{"error": "another rank gave up on this round"}]
        message = (f"another rank left this agreement round before this rank arrived: {gone[0]['error']}; "
                   "the group's agreement rounds are out of step now: re-create the process group")
        _ROUNDS.broken[ctx.group] = message
        if gone[0].get("mismatch"):
            raise _agreed(f"{label}: {message}")
        raise RuntimeError(f"{label}: {message}")
    return exchange_rows(store, keys, ctx, seq)


def _wait(store: dist.Store, ctx: GroupContext, label: str, keys: list[str], seq: int, timeout: float) -> None:
    """Wait for every posting of round ``seq`` (or return once another rank completed it); raise ``TimeoutError`` after ``timeout`` s, or
    ``ValueError`` once a missing rank is seen waiting in a round of another group of ours."""
    start = time.monotonic()
    try:
        store.wait(keys, datetime.timedelta(seconds=min(timeout, _NOTE_AFTER_S)))
        return
    except (dist.DistError, RuntimeError):
        pass
    thread = threading.current_thread().name
    _NOTES.post(store, ctx.group_name, {"seq": seq, "members": _members(ctx), "label": label, "thread": thread})
    seen_since = None
    try:
        while True:
            if store.check(keys):
                return
            missing = [r for r, k in enumerate(keys) if not store.check([k])]
            if not missing:
                return
            now = time.monotonic()
            if now - start >= timeout:
                message = (
                    f"the other ranks did not all reach tpfuse's agreement step: rank(s) {missing} of group "
                    f"{ctx.group_name!r} posted nothing within {timeout:g} s (30 x TPFUSE_TIMEOUT_S). They may "
                    f"still be busy, may have raised before it (a rank whose `group` argument is not a "
                    f"ProcessGroup reports its error over the default group only), or may be running a call "
                    f"whose signature they had seen before while this rank's differs. The group's agreement "
                    f"rounds are out of step now: re-create the process group"
                )
                if _abandon(store, ctx, seq, message):
                    raise TimeoutError(f"{label}: {message}")
                return
            other = _other_group_deadlock(store, ctx, missing)
            seen_since = (seen_since or now) if other else None
            if other and now - seen_since >= _MISMATCH_S:
                message = (
                    f"ranks called with different process groups: rank {dist.get_rank()} (thread {thread!r}) is in "
                    f"a call of {label} on group {ctx.group_name!r} (global ranks {_members(ctx)}), while "
                    f"{other[0]}. Every rank must call with the same group object (the same members are not "
                    f"enough: WORLD and a new_group of the same ranks are different groups); both groups' "
                    f"agreement rounds are out of step now: re-create them")
                if _abandon(store, ctx, seq, message, mismatch=True):
                    _poison(store, other[2], other[1], message, mismatch=True)  # the peer's round ends too
                    raise _agreed(f"{label}: {message}")
                return
            time.sleep(_POLL_S)  # polls, not store.wait: c10d logs a warning for every wait that times out
    finally:
        _NOTES.post(store, ctx.group_name, None)


def exchange_rows(store: dist.Store, keys: list[str], ctx: GroupContext, seq: int) -> list[dict]:
    rows = [json.loads(v) for v in store.multi_get(keys)]
    if seq > 0:
        store.delete_key(_key(ctx, seq - 1, ctx.rank))
        if ctx.rank == 0:
            store.delete_key(_outcome_key(ctx.group_name, seq - 1))
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
        f"op, strategy, dtype, device type, layout and shapes (only the local {allowed} may differ), "
        f"under the same TPFUSE_DEBUG setting"
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
