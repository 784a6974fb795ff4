"""Process-group plumbing shared by ops and strategies: who am I, who are my ring neighbours.

Nothing here talks over the network except where a function says so.
"""

from __future__ import annotations

import functools
import mmap
import os
import threading
from dataclasses import dataclass

import torch
import torch.distributed as dist

__all__ = [
    "GroupContext", "group_context", "resolve_group_name", "poison_enabled", "new_output", "breadcrumb",
    "clear_breadcrumb", "enter_call", "leave_call",
    "all_gather_rows", "reduce_scatter_rows", "row_bounds",
]


@dataclass(frozen=True)
class GroupContext:
    """What an op needs to know about its process group, read once per call."""

    group: dist.ProcessGroup
    group_name: str
    rank: int  # rank within the group
    world_size: int
    backend: str  # "gloo", "nccl", ...

    def global_rank(self, group_rank: int) -> int:
        return dist.get_global_rank(self.group, group_rank)

    @property
    def next_rank(self) -> int:
        """Global rank of the ring successor (group rank + 1)."""
        return self.global_rank((self.rank + 1) % self.world_size)

    @property
    def prev_rank(self) -> int:
        """Global rank of the ring predecessor (group rank - 1)."""
        return self.global_rank((self.rank - 1) % self.world_size)

    @property
    def device_type(self) -> str:
        """Device type the backend's collectives take ("cuda" for NCCL, "cpu" otherwise)."""
        return "cuda" if "nccl" in self.backend else "cpu"


def group_context(group: dist.ProcessGroup | None) -> GroupContext:
    """Resolve ``group`` (None = WORLD) into a :class:`GroupContext`.

    Raises ``RuntimeError`` if torch.distributed is not initialized and ``TypeError`` if
    ``group`` is not a ProcessGroup.
    """
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError(
            "tpfuse ops need an initialized torch.distributed process group; call "
            "torch.distributed.init_process_group(...) first (a single process can use "
            "world_size=1), or use tpfuse.spawn.run_ranks to start CPU ranks."
        )
    if group is None:
        group = dist.group.WORLD
    if not isinstance(group, dist.ProcessGroup):
        raise TypeError(
            f"group: expected a torch.distributed.ProcessGroup or None (= WORLD), got {type(group).__name__}"
        )
    # A group's name, rank, size and backend never change: resolve them once per group object
    # (this sits on every op call).  The cache holds the group itself, so an id is never reused
    # by a new group while its entry lives; a destroyed and re-created WORLD is a new object.
    hit = _CONTEXTS.get(id(group))
    if hit is not None and hit.group is group:
        return hit
    ctx = GroupContext(
        group=group,
        group_name=group.group_name,
        rank=dist.get_rank(group),
        world_size=dist.get_world_size(group),
        backend=str(dist.get_backend(group)),
    )
    if len(_CONTEXTS) >= 1024:
        _CONTEXTS.clear()
    _CONTEXTS[id(group)] = ctx
    return ctx


_CONTEXTS: dict[int, GroupContext] = {}


def resolve_group_name(group_name: str) -> dist.ProcessGroup:
    """The ProcessGroup registered under ``group_name`` (custom ops carry names, not objects)."""
    return dist.distributed_c10d._resolve_process_group(group_name)


@functools.lru_cache(maxsize=1)
def poison_enabled() -> bool:
    """``TPFUSE_POISON=1`` fills every freshly allocated output with NaN (tests use it so an
    element that a strategy forgot to write shows up as NaN instead of stale memory)."""
    return os.environ.get("TPFUSE_POISON", "0") == "1"


def new_output(shape: tuple[int, ...], *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """``torch.empty`` for op outputs and staging buffers, poisoned with NaN under TPFUSE_POISON=1."""
    out = torch.empty(shape, dtype=dtype, device=device)
    if poison_enabled() and out.is_floating_point():
        out.fill_(float("nan"))
    return out


# group -> [thread, op, conflict message or None] of the call in flight on it in this process.
_IN_FLIGHT: dict[object, list] = {}


def enter_call(group: object, op: str) -> object | None:
    """Register an eager call of ``op`` on ``group`` (None = WORLD) from this thread.

    Returns the token :func:`leave_call` takes, or None where nothing was registered (a call nested
    in one of this thread's own, or a ``group`` that is not a hashable object: validation
    explains it).  A call from another thread while one is in flight on the same group raises
    ``RuntimeError`` at once, naming both, and marks the one in flight so that it raises too
    when it ends: the two calls' messages may have paired with different calls on the peers, so
    neither result can be trusted.
    """
    key = dist.distributed_c10d._world.default_pg if group is None else group
    me = threading.current_thread()
    entry = [me, op, None]
    try:
        held = _IN_FLIGHT.setdefault(key, entry)
    except TypeError:  # unhashable: not a ProcessGroup, the checks raise on it
        return None
    if held is entry:
        return key
    if held[0] is me:
        return None
    message = (
        f"{op} was called from thread {me.name!r} while {held[1]} was in flight on the same process group "
        f"({getattr(key, 'group_name', key)!r}) from thread {held[0].name!r}. tpfuse ops, like torch's "
        f"collectives, do not run concurrently on one group (their messages would interleave and pair "
        f"wrongly): serialize the calls (one lock per group), or give each thread its own group "
        f"(dist.new_group); both calls raise")
    held[2] = message
    raise RuntimeError(message)


def leave_call(key: object) -> None:
    """End the call :func:`enter_call` registered (``key`` is its token); raise ``RuntimeError`` if
    another thread called on the group meanwhile."""
    entry = _IN_FLIGHT.pop(key, None)
    if entry is not None and entry[2] is not None:
        raise RuntimeError(f"{entry[1]}: its result is discarded: {entry[2]}")


_CRUMB_BYTES = 200  # a breadcrumb is one line, padded to this size
_CRUMBS: dict[str, bytes] = {}   # message -> its padded bytes (the strategies' messages are a few constants)


@functools.lru_cache(maxsize=1)
def _breadcrumb_map() -> mmap.mmap | None:
    """This rank's breadcrumb file (``TPFUSE_BREADCRUMBS``/rank<RANK>.txt), mapped: a crumb is a
    store into the page cache, which the harness's read of the file sees, dead process or not."""
    folder = os.environ.get("TPFUSE_BREADCRUMBS")
    if not folder:
        return None
    rank = os.environ.get("RANK", "x")
    try:
        fd = os.open(os.path.join(folder, f"rank{rank}.txt"), os.O_RDWR | os.O_CREAT, 0o644)
        try:
            os.ftruncate(fd, _CRUMB_BYTES)
            crumbs = mmap.mmap(fd, _CRUMB_BYTES)
        finally:
            os.close(fd)
    except (OSError, ValueError):
        return None
    crumbs[:] = b" " * _CRUMB_BYTES
    return crumbs


def breadcrumb(message: str) -> None:
    """Record the last thing this rank did, for the spawn harness's hang reports.

    A no-op unless ``TPFUSE_BREADCRUMBS`` names a folder (set by :mod:`tpfuse.spawn`).  One
    store of the padded message into the mapped file: it sits on every op's path, so it must cost
    well under a microsecond (a ``pwrite`` per call cost ~5 us of host time on the one-GPU bed's
    host, a cProfile of eager calls showed).
    """
    crumbs = _breadcrumb_map()
    if crumbs is None:
        return
    data = _CRUMBS.get(message)
    if data is None:
        data = (message.encode("utf-8", "replace")[:_CRUMB_BYTES - 1] + b"\n").ljust(_CRUMB_BYTES, b" ")
        if len(_CRUMBS) < 1024:
            _CRUMBS[message] = data
    crumbs[:] = data


def clear_breadcrumb() -> None:
    """Forget the last step (the spawn harness calls it before each job, so that a hang report
    never names a step left over from an earlier job)."""
    crumbs = _breadcrumb_map()
    if crumbs is not None:
        crumbs[:] = b" " * _CRUMB_BYTES


def all_gather_rows(out: torch.Tensor, inp: torch.Tensor, group: dist.ProcessGroup) -> None:
    """``out[r*m:(r+1)*m] = inp`` of rank r, for every rank (torch 2.13 renamed the collective)."""
    fn = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    fn(out, inp, group=group)


def reduce_scatter_rows(out: torch.Tensor, inp: torch.Tensor, group: dist.ProcessGroup) -> None:
    """``out`` = rows r*m:(r+1)*m of the sum of every rank's ``inp`` (sum reduction)."""
    fn = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    fn(out, inp, group=group)


def row_bounds(m: int, world_size: int) -> list[tuple[int, int]]:
    """Near-equal row ranges per owner rank, like ``torch.tensor_split`` (first ones larger)."""
    base, extra = divmod(m, world_size)
    bounds, start = [], 0
    for r in range(world_size):
        stop = start + base + (1 if r < extra else 0)
        bounds.append((start, stop))
        start = stop
    return bounds
