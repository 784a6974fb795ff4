"""Symmetric-memory workspaces: the one owner of the buffers, flags, generation and side stream
that the symmetric-memory strategies (``copy_engine``) use for one (group, op, dtype, device).

Layout of one rank's symmetric allocation (``torch.distributed._symmetric_memory.empty`` +
``rendezvous``; every rank allocates the same size, so every rank can address every other's)::

    [ flags: int32[FLAG_WORDS], zeroed at creation ][ data: capacity bytes ]

The flags are ours alone: torch's ``barrier``/``put_signal`` use the signal pad, which we never
touch (a flag written there hung the next barrier on the H200 bed).  Words, by region, each of
``world_size`` words indexed by the *other* rank::

    READY[src]  = g   src's data for call g is in place (written by src)
    DONE[dst]   = g   dst finished reading this rank's data of call g (written by dst): a credit
    READY2, DONE2     the same for a second phase (gemm_ar's gather of the reduced chunks)

Generations: the workspace's call counter ``gen`` lives in device memory and is advanced by the
first kernel of every call (:meth:`Workspace.begin`), so eager calls and CUDA graph replays
advance it alike.  Waiters wait for ``flag >= gen`` (or ``>= gen - 1`` for credits), so nothing
is zeroed between calls and ranks may be a call apart.  Every rank must make the same sequence
of calls on a workspace (they do: every op call is collective).

Ownership (slot life cycle FREE -> PRODUCING -> READY -> IN_FLIGHT -> FREE): a rank overwrites
a slot that peers read only after every peer returned its credit for the previous call
(``DONE[peer] >= gen - 1``).  "Remote visible" is the READY flag written after the copy; "local
source reusable" is the credit.

Bounded waits and errors, with no device sync on the call path (DESIGN.md §3; docs/ops.md,
"How errors surface"): every wait spins at most ``timeout_s()`` seconds (``TPFUSE_TIMEOUT_S``,
default 10), then records who waited for whom in the workspace's error word (device memory,
layout in tpfuse/kernels/abi.py) and in its host-visible mirror (pinned memory,
:class:`tpfuse.watchdog.HostRecord`).  A set word means *broken*: every later kernel of the
workspace returns from its waits at once, signals nothing, and the outputs of the call that
timed out and of every call queued after it are NaN (eager calls and graph replays alike).  The
host learns of it without synchronizing: the next call on the group raises ``TimeoutError``
(:func:`get_workspace` reads the mirrors), :func:`synchronize` waits for the GPU and raises, and
the watchdog thread logs one line.  Calls then raise until :func:`release_workspaces`.

Host syncs: only where a workspace is created or grown (allocation and rendezvous, the first
call of a capacity); the flag and pointer tables a new shape needs are copied to the device from
pinned memory, asynchronously.  Every other eager call returns without waiting for the GPU.

Capacity grows (to the next power of two) when a call needs more; the sizes come from fields
every rank agrees on (M, K for ag_gemm; M, N for gemm_rs/gemm_ar), so every rank grows at the
same call.  Outgrown allocations are kept (peers may still be reading them) until
:func:`release_workspaces`.  Importing this module never touches CUDA.
"""
from __future__ import annotations

import functools
import gc
import importlib
import operator
import os
import sys
import weakref
from dataclasses import dataclass

import torch

from tpfuse import watchdog
from tpfuse.kernels import abi
from tpfuse.kernels.abi import ERROR_WORDS

__all__ = [
    "Workspace", "WorkspaceSpec", "get_workspace", "release_workspaces", "check_workspaces", "synchronize",
    "timeout_s", "FLAG_WORDS", "WAIT_KINDS",
]

FLAG_BYTES = 4096                  # flag region; data starts 4 KiB in (aligned for TMA / vectors)
FLAG_WORDS = FLAG_BYTES // 4
_REGIONS = ("READY", "DONE", "READY2", "DONE2")
MAX_WORLD_SIZE = FLAG_WORDS // len(_REGIONS)
_MIN_CAPACITY = 1 << 20            # bytes: small calls share one allocation instead of growing often

# Codes of the waits (error word abi.ERR_WHAT) and what a timeout of each means, in the user's words.
WAIT_KINDS = watchdog.WAIT_KINDS
WAIT_CREDIT, WAIT_READY, WAIT_CREDIT2, WAIT_READY2 = abi.WAIT_CREDIT, abi.WAIT_READY, abi.WAIT_CREDIT2, abi.WAIT_READY2
_POISON_PROGRAMS = 64              # grid of the NaN fill (a grid-stride loop once it fills)
# Grid of the publish kernel (Workspace.publish): one program per PUBLISH_BYTES_PER_PROGRAM bytes
# of the shard, at most PUBLISH_MAX_PROGRAMS.  A program of 8 warps has one block of 4096
# elements in flight per iteration (16 KiB when the shard's addresses and rows allow 4-byte
# elements), so 32 KiB each is two iterations, enough to amortize its flag checks,
# and a small shard (decode: a few hundred KiB) still spreads over enough programs to copy in a
# few us instead of one CTA's ~20 GB/s.  The cap keeps the grid a minor share of the GPU: 64
# CTAs of 8 warps are at most 1/8 of the H200's warp slots (they co-reside with other kernels,
# no shared memory), leaving SMs for a same-device peer's copies and the fused GEMM's budget,
# and at most 64 programs spin on a late credit.  On a GPU the group's processes share
# (:func:`shared_gpu`, the one-GPU bed) each takes PUBLISH_MAX_PROGRAMS // W: at W = 4, four
# grids of 64 spinning on credits starved the same-device copies those credits wait for (the
# bed's host bench timed out at 64 programs each and ran at 16 and at 4).  The price: above a
# few MiB the copy runs at the SM copy's rate (bench comm on one H200: 395-593 GB/s at 32 SMs in
# two runs), below what ``copy_`` takes with the whole GPU -- a lead, not a measurement of this
# kernel.
PUBLISH_BYTES_PER_PROGRAM = 32 << 10
PUBLISH_MAX_PROGRAMS = 64
_PUBLISH_BLOCK = 4096              # elements a program copies per iteration (16 KiB of 4-byte elements)
_PUBLISH_WARPS = 8
_REDUCE_BLOCK = (4, 256)           # rows, columns of the reduce kernel's block (one program each)


def gather_programs(chunk_bytes: int, cap: int | None = None) -> int:
    """Programs of the gather launch (:meth:`Workspace.gather`) whose largest chunk has
    ``chunk_bytes``: one per PUBLISH_BYTES_PER_PROGRAM bytes of it, at least 1, at most ``cap``
    (None: PUBLISH_MAX_PROGRAMS).  Sized by one chunk, not by all of them: the programs take the
    peers' chunks one after another (each after its READY2), so one chunk is what the grid copies
    at a time, and publish's 32 KiB per program (two blocks each) spreads a decode-sized chunk over
    enough SMs while a large one stops at the cap that spinning grids keep to."""
    cap = PUBLISH_MAX_PROGRAMS if cap is None else cap
    return min(cap, max(1, triton_cdiv(chunk_bytes, PUBLISH_BYTES_PER_PROGRAM)))


# Bytes a gather program loads before it stores them (tpfuse/kernels/flags.py ``_copy_rows``: one
# block of _PUBLISH_BLOCK elements per iteration, 4-byte ones where the chunks' sizes and addresses
# allow, as a two-shot gemm_ar's rows of 2- or 4-byte elements do): the simulator's bytes in flight.
GATHER_BLOCK_BYTES = 4 * _PUBLISH_BLOCK


def shared_gpu() -> bool:
    """Whether the group's processes may share one GPU (the one-GPU bed: PyTorch's
    ``TORCH_SYMM_MEM_ALLOW_OVERLAPPING_DEVICES=1``): spinning grids then divide the SMs."""
    return os.environ.get("TORCH_SYMM_MEM_ALLOW_OVERLAPPING_DEVICES") == "1"


@functools.lru_cache(maxsize=1)
def timeout_s() -> float:
    """Bound of every spin-wait, in seconds: ``TPFUSE_TIMEOUT_S`` (default 10; finite, at most a
    day: :func:`tpfuse._settings.parse_timeout_s`)."""
    from tpfuse._settings import timeout_setting

    return timeout_setting()


@functools.lru_cache(maxsize=1)
def _interpreting() -> bool:
    """``TRITON_INTERPRET=1``, read once (a process setting; :func:`refresh_settings`)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def refresh_settings() -> None:
    """Read the environment settings this module caches again (``TPFUSE_TIMEOUT_S``,
    ``TRITON_INTERPRET``): for tests that change them.  Workspaces keep the bounds they have."""
    timeout_s.cache_clear()
    _interpreting.cache_clear()


def flag_index(region: str, other: int, world_size: int) -> int:
    """Word of ``region`` indexed by rank ``other``; checked to fit the flag region."""
    if not 0 <= other < world_size <= MAX_WORLD_SIZE:
        raise AssertionError(f"flag {region}[{other}] out of range for world size {world_size}")
    return _REGIONS.index(region) * world_size + other


def _kernel(module: str, name: str):
    """Kernel ``name`` of ``module`` as ``sys.modules`` holds it now (tests swap interpreted
    kernel modules in and out): a dict lookup per launch, where a function-level ``from ...
    import`` cost ~1 us of host time through importlib's Python fallback."""
    mod = sys.modules.get(module)
    if mod is None:
        mod = importlib.import_module(module)
    return getattr(mod, name)


@dataclass(frozen=True)
class WorkspaceSpec:
    """What a workspace is for; two calls share one workspace when these agree."""

    group_name: str
    op: str
    dtype: torch.dtype
    device: torch.device
    rank: int
    world_size: int
    capacity: int          # bytes of the data region


class Workspace:
    """Buffers, flags, generation, error word and side stream of one (group, op, dtype, device).

    Built by :func:`get_workspace` (collective: a rendezvous) or, for tests, directly from one
    tensor per rank (``buffers[r]`` is rank r's uint8 allocation as this process addresses it).
    """

    def __init__(self, spec: WorkspaceSpec, buffers: list[torch.Tensor], keepalive: object = None):
        if len(buffers) != spec.world_size:
            raise AssertionError(f"{len(buffers)} buffers for world size {spec.world_size}")
        if spec.world_size > MAX_WORLD_SIZE:
            raise ValueError(f"world size {spec.world_size} is above the {MAX_WORLD_SIZE} ranks a workspace holds flags for")
        for b in buffers:
            if b.dtype != torch.uint8 or b.numel() < FLAG_BYTES + spec.capacity:
                raise AssertionError(f"buffer {b.dtype} {b.numel()} B; need uint8 of {FLAG_BYTES + spec.capacity} B")
        self.spec = spec
        self._buffers = buffers
        self._keepalive = keepalive
        device = spec.device
        self.flags = [b[:FLAG_BYTES].view(torch.int32) for b in buffers]
        self.gen = torch.zeros(1, dtype=torch.int32, device=device)
        self.error = torch.zeros(ERROR_WORDS, dtype=torch.int32, device=device)
        # the publish kernel's [counter, one scratch word per program] (Workspace.publish)
        self.publish_sync = torch.zeros(1 + PUBLISH_MAX_PROGRAMS, dtype=torch.int32, device=device)
        # the gather kernel's, likewise (Workspace.gather): its own, so that a publish and a gather
        # of one workspace never share a counter, whatever the streams they run on
        self.gather_sync = torch.zeros(1 + PUBLISH_MAX_PROGRAMS, dtype=torch.int32, device=device)
        # the reduce kernel's count of finished programs (its SIGNAL step; reset by its last program)
        self.reduce_sync = torch.zeros(1, dtype=torch.int32, device=device)
        # the int64 flag table the NaN fill is given when it raises none: its launches then have one
        # specialization with a signal or without (the one _allocate compiles ahead)
        self._no_signal = torch.zeros(1, dtype=torch.int64, device=device)
        # the host-visible mirror of the error word; the word carries its address (abi.ERR_MIRROR)
        self.host = watchdog.HostRecord.allocate(device, op=spec.op, group=spec.group_name, rank=spec.rank,
                                                 timeout_s=timeout_s())
        self.error.view(torch.int64)[abi.ERR_MIRROR // 2] = self.host.address
        watchdog.watch(self.host)
        self.broken: str | None = None
        self.calls = 0                      # host count of begun calls (messages only)
        self._tables: dict[object, tuple[torch.Tensor, torch.Tensor]] = {}
        self._views: dict[object, torch.Tensor] = {}
        self._fixed: dict[tuple, tuple] = {}      # Workspace._launch: fixed launches, prepared
        self._publish: dict[tuple, list] = {}     # Workspace.publish: per table set, fixed arguments and launches
        self._kept: dict[tuple, object] = {}      # Workspace._launch_kept: reduce / NaN fill launches by call key
        self._reduces: dict[tuple, tuple] = {}    # Workspace.reduce: per key and shape, its table, grid and checks
        self._gather: dict[object, tuple] = {}    # Workspace.gather: per call key, its table and fixed arguments
        self.state: dict[object, object] = {}   # what a strategy keeps with its buffers (never evicted)
        self._stream: torch.cuda.Stream | None = None
        self._wait_bound: tuple[int, bool] | None = None   # (spin bound, inline PTX), fixed at the first wait

    # -- addressing ---------------------------------------------------------------------------
    @property
    def rank(self) -> int:
        return self.spec.rank

    @property
    def world_size(self) -> int:
        return self.spec.world_size

    def data(self, owner: int, shape: tuple[int, ...], offset: int = 0) -> torch.Tensor:
        """Rank ``owner``'s data region as a contiguous ``shape`` tensor of the workspace dtype,
        starting ``offset`` elements in (a peer's is its memory mapped into this process)."""
        key = (owner, shape, offset)
        view = self._views.get(key)
        if view is None:
            elem = torch.empty((), dtype=self.spec.dtype).element_size()
            numel = 1
            for s in shape:
                numel *= s
            if (offset + numel) * elem > self.spec.capacity:
                raise AssertionError(f"view {shape} at {offset} exceeds the {self.spec.capacity} B capacity")
            flat = self._buffers[owner][FLAG_BYTES:FLAG_BYTES + self.spec.capacity].view(self.spec.dtype)
            view = flat[offset:offset + numel].view(shape)
            if len(self._views) > 256:
                self._views.clear()
            self._views[key] = view
        return view

    def flag_table(self, region: str | tuple[str, ...], entries: list[tuple[int, int]]) -> tuple[torch.Tensor, torch.Tensor]:
        """Device int64 tables for the flag kernels: byte addresses of ``region[index]`` in rank
        ``owner``'s flags for each ``(owner, index)``, and the other rank each entry concerns.
        A tuple of regions gives one table of them all, region by region (one launch)."""
        key = (region, tuple(entries))
        hit = self._tables.get(key)
        if hit is None:
            addrs, peers = [], []
            for reg in ((region,) if isinstance(region, str) else region):
                for owner, index in entries:
                    word = flag_index(reg, index, self.world_size)
                    addrs.append(self.flags[owner].data_ptr() + 4 * word)
                    peers.append(owner if owner != self.rank else index)
            hit = (_device_table(addrs, self.spec.device), _device_table(peers, self.spec.device))
            self._tables[key] = hit
        return hit

    def pointer_table(self, key: object, tensors: list[torch.Tensor]) -> torch.Tensor:
        """Device int64 table of ``tensors``' addresses (for the reduce kernel), cached by ``key``
        (the tensors are views of the workspace's buffers, which live as long as it does)."""
        hit = self._tables.get(("ptr", key))
        if hit is None:
            hit = _device_table([t.data_ptr() for t in tensors], self.spec.device)
            self._tables[("ptr", key)] = hit
        return hit

    def reduce(self, key: object, sources: list[torch.Tensor], out: torch.Tensor, *,
               out2: torch.Tensor | None = None, signal: tuple[torch.Tensor, torch.Tensor] | None = None) -> tuple | None:
        """Enqueue ``out = sum(sources)`` in float32, in list order, rounded once (every source a
        ``[rows, cols]`` view with the same row stride and unit column stride; NaN when broken),
        in the same launch also into ``out2`` (same shape and dtype, unit column stride) and, once
        every program is done, :meth:`signal` of ``signal`` (tpfuse/kernels/reduce.py).  Returns
        (kept key, grid, arguments) of the launch (None: an empty output, nothing reduced)."""
        reduce_kernel = _kernel("tpfuse.kernels.reduce", "reduce_kernel")

        rows, cols = out.shape
        if rows * cols == 0:
            if signal is not None:
                self.signal(signal)
            return None
        # what depends on the sources (fixed per key: views of the workspace) and the shape only,
        # checked and built once: the sources' walk cost more host time than the launch
        fixed_key = (key, out2 is None, None if signal is None else id(signal[0]))
        fixed = self._reduces.get(fixed_key)
        if fixed is None or fixed[0] != out.shape:
            stride = sources[0].stride(0)
            if any(s.shape != out.shape or s.stride() != (stride, 1) for s in sources):
                raise AssertionError("reduce: sources must be [rows, cols] views with one row stride")
            table = self.pointer_table(key, sources)
            sig = table if signal is None else signal[0]   # num_sig = 0 without SIGNAL: never read
            grid = (triton_cdiv(rows, _REDUCE_BLOCK[0]) * triton_cdiv(cols, _REDUCE_BLOCK[1]),)
            fixed = (out.shape, stride, table, len(sources), sig, 0 if signal is None else sig.numel(), grid,
                     table.data_ptr() % 16 == 0, sig.data_ptr() % 16 == 0,
                     dict(BLOCK_R=_REDUCE_BLOCK[0], BLOCK_C=_REDUCE_BLOCK[1], OUT2=out2 is not None,
                          SIGNAL=signal is not None))
            if len(self._reduces) >= 64:
                self._reduces.clear()
            self._reduces[fixed_key] = fixed
        _, stride, table, num_sources, sig, num_sig, grid, table_aligned, sig_aligned, constexprs = fixed
        if out.stride(1) != 1:
            raise AssertionError("reduce: the output needs unit column stride")
        if out2 is not None and (out2.shape != out.shape or out2.dtype != out.dtype or out2.stride(1) != 1):
            raise AssertionError(f"reduce: second output {tuple(out2.shape)} {out2.dtype} for {tuple(out.shape)} {out.dtype}")
        dst2 = out if out2 is None else out2
        args = (table, num_sources, out, rows, cols, stride, out.stride(0), self.error, dst2, dst2.stride(0),
                self.gen, self.reduce_sync, sig, num_sig)
        # the tables' (int64) and the outputs' alignment, the outputs' dtype, the integers
        kept = ("reduce", table_aligned, sig_aligned, out.dtype, out.data_ptr() % 16 == 0, dst2.data_ptr() % 16 == 0,
                rows, cols, stride, out.stride(0), dst2.stride(0), out2 is None, signal is None)
        self._launch_kept(kept, reduce_kernel, grid, args, constexprs, 4)
        return kept, grid, (*args, *constexprs.values())

    def reducer(self, key: object, sources: list[torch.Tensor], shape: tuple[int, int], *,
                signal: tuple[torch.Tensor, torch.Tensor] | None = None, into: torch.Tensor | None = None,
                rows: tuple[int, int] | None = None) -> "_Reducer":
        """``f(out)`` = :meth:`reduce` ``(key, sources, out, signal=signal)`` for a plan that
        reduces the same sources into a new contiguous ``shape`` output every call (gemm_rs);
        with ``into`` (a tensor of ``shape`` that outlives the calls) ``f(full)`` =
        :meth:`reduce` ``(key, sources, into, out2=full[rows[0]:rows[1]], signal=signal)``, ``full``
        a new contiguous output with rows as long as ``into``'s (two-shot gemm_ar's own rows).
        After the first call of a compiled variant (the new output's 16-byte alignment) a call
        fills in its address and launches, without :meth:`reduce`'s per-call checks and keys."""
        return _Reducer(self, key, sources, tuple(shape), signal, into, rows)

    def _launch_kept(self, kept: tuple, kernel, grid: tuple, args: tuple, constexprs: dict, num_warps: int) -> None:
        """:meth:`_launch` of ``kernel``, whose launch for call key ``kept`` is kept after the first:
        ``kept`` must hold everything the JIT specializes on that the workspace does not fix (the
        call's tensors by dtype and 16-byte alignment, the integers by value), so
        later launches skip :func:`_spec_key`'s walk over every argument."""
        hit = self._kept.get(kept)
        if hit is not None:
            try:
                hit(grid + (1,) * (3 - len(grid)), torch._C._cuda_getCurrentRawStream(self.spec.device.index),
                    (*args, *constexprs.values()))
                return
            except Exception:   # noqa: BLE001 - _run launches through the JIT (and warns if that fails too)
                self._kept.clear()
        direct = self._launch(kernel, *args, grid=grid, num_warps=num_warps, **constexprs)
        if direct is not None:
            if len(self._kept) >= 256:
                self._kept.clear()
            self._kept[kept] = direct

    def incoming(self, region: str | tuple[str, ...], peers: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's ``region[p]`` for each peer ``p``: what peers write and this rank waits on."""
        key = ("in", region, tuple(peers))
        hit = self._tables.get(key)
        if hit is None:
            hit = self._tables[key] = self.flag_table(region, [(self.rank, p) for p in peers])
        return hit

    def outgoing(self, region: str | tuple[str, ...], peers: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """Peer ``p``'s ``region[rank]`` for each ``p``: what this rank writes to tell them."""
        key = ("out", region, tuple(peers))
        hit = self._tables.get(key)
        if hit is None:
            hit = self._tables[key] = self.flag_table(region, [(p, self.rank) for p in peers])
        return hit

    # -- streams ------------------------------------------------------------------------------
    @property
    def stream(self) -> torch.cuda.Stream:
        """The side stream the copies run on (one per workspace)."""
        if self._stream is None:
            self._stream = torch.cuda.Stream(device=self.spec.device)
        return self._stream

    def current_stream(self) -> torch.cuda.Stream:
        """``torch.cuda.current_stream()`` (the current device's), one ``Stream`` object kept per
        stream: torch's builds a new one in Python on every call (~4 us of host time on this box,
        as much as the rest of a flag launch).  A ``Stream`` is only its (id, device, type), so
        the kept one is interchangeable with a new one."""
        if self.spec.device.type != "cuda":
            return torch.cuda.current_stream()
        raw = torch._C._cuda_getCurrentStream(torch._C._cuda_getDevice())
        stream = _STREAMS.get(raw)
        if stream is None:
            stream = torch.cuda.current_stream()
            if (stream.stream_id, stream.device_index, stream.device_type) == raw:
                if len(_STREAMS) >= 64:
                    _STREAMS.clear()
                _STREAMS[raw] = stream
        return stream

    def on_stream(self) -> "_OnStream":
        """``with ws.on_stream():`` is ``with torch.cuda.stream(ws.stream):`` (the side stream is
        the current stream inside, the previous one again after, exceptions included), cheaper on
        the host when the current device is the workspace's (every call of the strategies)."""
        return _OnStream(self.stream)

    # -- flag kernels -------------------------------------------------------------------------
    def _launch(self, kernel, *args, fixed: tuple | None = None, grid: tuple = (1,), num_warps: int = 1,
                **constexprs):
        """``kernel`` on ``grid`` (one program of one warp unless told).  ``fixed``: a key naming
        these arguments, which are all the workspace's own (generation, flag tables, error word,
        bounds): the launch is kept under it, and :meth:`_fire` repeats it without building
        arguments or keys.  Returns what :func:`_run` does."""
        direct = _run(kernel, grid, args, constexprs, num_warps, self.spec.device)
        if fixed is not None and direct is not None:
            self._fixed[fixed] = (direct, _addresses((*args, *constexprs.values())), self.spec.device.index)
        return direct

    def _fire(self, fixed: tuple) -> bool:
        """Repeat the launch kept under ``fixed`` (:meth:`_launch`) on the current stream; False
        where none is kept (first launch, not CUDA, interpreted) or it failed (:func:`_run` then
        says why)."""
        hit = self._fixed.get(fixed)
        if hit is None:
            return False
        try:
            hit[0](_GRID_1, torch._C._cuda_getCurrentRawStream(hit[2]), hit[1])
            return True
        except Exception:   # noqa: BLE001 - the caller launches through _run, which warns once and takes the JIT
            self._fixed.clear()
            return False

    def _bound(self) -> tuple[int, bool]:
        if self._wait_bound is None:
            asm = self.spec.device.type == "cuda" and not _interpreting()
            bound = int(timeout_s() * 1e9) if asm else max(1, int(timeout_s() * 1000))   # ns, or spins (~1 ms each interpreted)
            self._wait_bound = (bound, asm)
        return self._wait_bound

    def wait(self, table: tuple[torch.Tensor, torch.Tensor], what: int, *, lag: int = 0,
             advance: bool = False) -> None:
        """Enqueue on the current stream: (``advance``: gen += 1, then) wait until every flag of
        ``table`` is ``>= gen - lag``; bounded by :func:`timeout_s`; at once when broken."""
        wait_kernel = _kernel("tpfuse.kernels.flags", "wait_kernel")

        addrs, peers = table
        fixed = _wait_key(table, what, lag, advance)
        if self._fire(fixed):
            return
        bound, asm = self._bound()
        self._launch(wait_kernel, self.gen, addrs, peers, addrs.numel(), lag, bound, self.error, what,
                     self.rank, ADVANCE=advance, USE_ASM=asm, fixed=fixed)

    def signal(self, table: tuple[torch.Tensor, torch.Tensor]) -> None:
        """Enqueue on the current stream: every flag of ``table`` = gen (release, system scope);
        nothing once the workspace is broken."""
        signal_kernel = _kernel("tpfuse.kernels.flags", "signal_kernel")

        addrs, _ = table
        fixed = ("signal", id(addrs))
        if not self._fire(fixed) and addrs.numel():
            self._launch(signal_kernel, self.gen, addrs, addrs.numel(), self.error, fixed=fixed)

    def signal_wait(self, signals: tuple[torch.Tensor, torch.Tensor] | None, waits: tuple[torch.Tensor, torch.Tensor],
                    what: int, *, lag: int = 0, then: tuple | None = None) -> None:
        """:meth:`signal` of ``signals`` (None: none) then :meth:`wait` of ``waits`` (no advance)
        and of ``then`` = (table, what, lag) if given, one launch."""
        signal_wait_kernel = _kernel("tpfuse.kernels.flags", "signal_wait_kernel")

        sig = waits[0] if signals is None else signals[0]
        fixed = _signal_wait_key(signals, waits, what, lag, then)
        if self._fire(fixed):
            return
        bound, asm = self._bound()
        w2, what2, lag2 = (waits, what, lag) if then is None else then
        self._launch(signal_wait_kernel, self.gen, sig, 0 if signals is None else sig.numel(), waits[0], waits[1],
                     waits[0].numel(), lag, bound, self.error, what, self.rank, w2[0], w2[1],
                     0 if then is None else w2[0].numel(), lag2, what2, USE_ASM=asm, fixed=fixed)

    def beginner(self, credits: tuple[torch.Tensor, torch.Tensor], what: int = WAIT_CREDIT) -> "_Flag":
        """``f()`` = :meth:`begin` ``(credits, what)`` for a plan that begins every call so, its
        launch repeated directly after the first (no kernel lookup, key or dict per call)."""
        def issue() -> None:
            self.begin(credits, what)
        return _Flag(self, _wait_key(credits, what, 1, True), issue, counts=True)

    def signal_waiter(self, signals: tuple[torch.Tensor, torch.Tensor] | None,
                      waits: tuple[torch.Tensor, torch.Tensor], what: int) -> "_Flag":
        """``f()`` = :meth:`signal_wait` ``(signals, waits, what)`` for a plan, prepared likewise."""
        def issue() -> None:
            self.signal_wait(signals, waits, what)
        return _Flag(self, _signal_wait_key(signals, waits, what, 0, None), issue)

    def begin(self, credits: tuple[torch.Tensor, torch.Tensor], what: int = WAIT_CREDIT) -> None:
        """First work of a call: refuse a broken workspace (raising what the host knows, no
        sync), advance the generation and wait for the credits of the previous call
        (``flag >= gen - 1``)."""
        self.check(self.spec.op)
        self.calls += 1
        self.wait(credits, what, lag=1, advance=True)

    def _spinning_grid_cap(self) -> int:
        """Most programs of a grid whose programs spin on peers' flags (the publish and gather
        launches): PUBLISH_MAX_PROGRAMS, or a W-th of it where the group's processes share one
        GPU (the comment at PUBLISH_BYTES_PER_PROGRAM says why)."""
        return max(1, PUBLISH_MAX_PROGRAMS // self.world_size) if shared_gpu() else PUBLISH_MAX_PROGRAMS

    def publish(self, credits: tuple[torch.Tensor, torch.Tensor], ready: tuple[torch.Tensor, torch.Tensor],
                src: torch.Tensor, slot: torch.Tensor, dst2: torch.Tensor | None = None,
                scale: torch.Tensor | None = None, scale_slot: torch.Tensor | None = None,
                scale_dst2: torch.Tensor | None = None, local: torch.Tensor | None = None, local_value: int = 1,
                what: int = WAIT_CREDIT, wait_in: tuple[torch.Tensor, torch.Tensor] | None = None) -> None:
        """:meth:`begin` (``credits``), ``slot`` <- ``src`` (and ``dst2`` <- ``src``; ``scale``
        likewise into ``scale_slot``/``scale_dst2``), this rank's words at the int64 addresses of
        ``local`` = ``local_value``, :meth:`signal` of ``ready``, then :meth:`wait` of
        ``wait_in`` if given (the peers' READY: recorded as ``WAIT_READY``): ONE launch
        (tpfuse/kernels/flags.py ``publish_kernel``) instead of up to four flag kernels and four
        copies.  ``src``/``scale``: 2-D with unit column stride (any row stride), copied as
        bytes; destinations contiguous.  Broken: nothing is copied, signalled or waited for (the
        generation still advances, the local words are still set: the outputs are NaN anyway)."""
        self.check(self.spec.op)
        self.calls += 1
        self._publish_launch(credits, ready, src, slot, dst2, scale, scale_slot, scale_dst2, local, local_value,
                             what, wait_in)

    def _publish_launch(self, credits, ready, src, slot, dst2, scale, scale_slot, scale_dst2, local, local_value,
                        what, wait_in) -> tuple:
        """:meth:`publish`'s launch (no check, no count); returns (kept key, grid, its arguments)."""
        publish_kernel = _kernel("tpfuse.kernels.flags", "publish_kernel")
        key = (id(credits[0]), id(ready[0]), None if local is None else id(local), what,
               None if wait_in is None else id(wait_in[0]), slot.data_ptr(),
               tuple(src.shape), src.dtype, dst2 is None, scale is None, None if scale_slot is None else scale_slot.data_ptr())
        fixed = self._publish.get(key)
        if fixed is None:
            if len(self._publish) >= 64:
                self._publish.clear()
            rows, row_bytes = src.shape[0], src.shape[1] * src.element_size()
            b_rows = b_bytes = 0
            if scale is not None:
                b_rows, b_bytes = scale.shape[0], scale.shape[1] * scale.element_size()
            for d, like in ((slot, src), (dst2, src), (scale_slot, scale), (scale_dst2, scale)):
                if d is not None and (not d.is_contiguous() or d.nbytes != like.nbytes):
                    raise AssertionError(f"publish: destination {tuple(d.shape)} {d.dtype} for {tuple(like.shape)} {like.dtype}")
            cap = self._spinning_grid_cap()
            grid = (min(cap, max(1, triton_cdiv(rows * row_bytes + b_rows * b_bytes, PUBLISH_BYTES_PER_PROGRAM))),)
            if scale is not None and (scale_dst2 is None) != (dst2 is None):
                raise AssertionError("publish: a second destination for the shard and its scale rows, or for neither")
            bound, asm = self._bound()
            table = local if local is not None else credits[0]   # num_local = 0: never read
            waits = credits if wait_in is None else wait_in       # num_in = 0: never read
            fixed = self._publish[key] = [grid, (self.gen, self.publish_sync, self.error, credits[0], credits[1],
                                                 credits[0].numel(), ready[0], ready[0].numel(), table,
                                                 0 if local is None else local.numel(),
                                                 local_value, bound, what, self.rank, waits[0], waits[1],
                                                 0 if wait_in is None else wait_in[0].numel(), WAIT_READY),
                                          rows, row_bytes, b_rows, b_bytes, asm]
        grid, head, rows, row_bytes, b_rows, b_bytes, asm = fixed
        esize = src.element_size()
        a_stride = src.stride(0) * esize
        a_contig = rows <= 1 or a_stride == row_bytes
        d2 = slot if dst2 is None else dst2
        low = src.data_ptr() | slot.data_ptr() | d2.data_ptr()
        a_aligned = a_contig and low % 16 == 0
        low |= a_stride | row_bytes
        a_elem = 4 if low % 4 == 0 else 2 if low % 2 == 0 else 1
        if scale is None:
            b_args = (src, 0, slot, slot, 0, 0)
            b_contig = True
        else:
            b_stride = scale.stride(0) * scale.element_size()
            b_contig = b_rows <= 1 or b_stride == b_bytes
            b_args = (scale, b_stride, scale_slot, scale_slot if scale_dst2 is None else scale_dst2, b_rows, b_bytes)
        args = head + (src, a_stride, slot, d2, rows, row_bytes) + b_args
        constexprs = dict(BLOCK=_PUBLISH_BLOCK, A_ELEM=a_elem, A_CONTIG=a_contig, A_ALIGNED=a_aligned, B_CONTIG=b_contig,
                          HAS_B=scale is not None, DST2=dst2 is not None, USE_ASM=asm)
        # what the compiled variant depends on beyond the fixed arguments: the constexprs, the
        # call's pointers' 16-byte alignment and its strides' integer width
        spec = (a_elem, a_contig, a_aligned, b_contig, src.data_ptr() % 16 == 0, d2.data_ptr() % 16 == 0,
                b_args[0].data_ptr() % 16 == 0, b_args[3].data_ptr() % 16 == 0,
                a_stride < 2**31, b_args[1] < 2**31)
        self._launch_kept(("publish", key, spec), publish_kernel, grid, args, constexprs, _PUBLISH_WARPS)
        return ("publish", key, spec), grid, (*args, *constexprs.values())

    def publisher(self, credits: tuple[torch.Tensor, torch.Tensor], ready: tuple[torch.Tensor, torch.Tensor],
                  slot: torch.Tensor, rows: tuple[int, int], *,
                  wait_in: tuple[torch.Tensor, torch.Tensor] | None = None,
                  local: torch.Tensor | None = None) -> "_Publisher":
        """``f(src, full)`` = :meth:`publish` ``(credits, ready, src, slot, full[rows[0]:rows[1]],
        local=local, wait_in=wait_in)`` (no scale rows; ``local``: a table of this rank's words
        set to 1, fused's own arrival words) for a plan that makes that publish every call with a
        new ``full`` (ag_gemm's gathered output: contiguous, the same shape and dtype every call;
        ``src`` of ``slot``'s shape): after the first call of a compiled variant (the source's
        strides and both tensors' 16-byte alignment) a call fills in the addresses and launches,
        without :meth:`publish`'s per-call checks, keys and slicing."""
        return _Publisher(self, credits, ready, slot, rows, wait_in, local)

    def gather(self, key: object, ready: tuple[torch.Tensor, torch.Tensor], sources: list[torch.Tensor],
               offsets: list[int], out: torch.Tensor, done: tuple[torch.Tensor, torch.Tensor],
               what: int = WAIT_READY2) -> None:
        """Enqueue ONE launch on the current stream (tpfuse/kernels/flags.py ``gather_kernel``):
        for each i in order, wait until the flag ``ready[0][i]`` is ``>= gen`` (bounded; a timeout
        records ``what`` naming rank ``ready[1][i]``) and copy ``sources[i]`` (contiguous, ``out``'s
        dtype, as bytes) into contiguous ``out`` from element ``offsets[i]`` on; then :meth:`signal`
        of ``done``.  Broken (before the launch or by one of its waits): ``out`` is NaN, every
        element, and nothing is signalled.  Two-shot gemm_ar's phase 2 in one launch instead of
        W + 1 operations (a wait, a copy per peer, the NaN fill).  ``key`` names everything but ``out``'s address: the table of sources,
        offsets and sizes is built on its first call."""
        gather_kernel = _kernel("tpfuse.kernels.flags", "gather_kernel")

        fixed = self._gather.get(key)
        if fixed is None:
            if len(self._gather) >= 64:
                self._gather.clear()
            fixed = self._gather[key] = self._gather_plan(ready, sources, offsets, out, done, what)
        grid, head, where, low, numel, asm = fixed
        if out.numel() != numel or not out.is_contiguous():
            raise AssertionError(f"gather: output {tuple(out.shape)} (contiguous: {out.is_contiguous()}) for a plan "
                                 f"of {numel} elements")
        ptr = out.data_ptr()
        low |= ptr
        elem = 4 if low % 4 == 0 else 2 if low % 2 == 0 else 1
        aligned = (where | ptr) % 16 == 0
        self._launch_kept(("gather", key, out.dtype, ptr % 16 == 0, elem, aligned), gather_kernel, grid,
                          head + (out, numel), dict(BLOCK=_PUBLISH_BLOCK, ELEM=elem, ALIGNED=aligned, USE_ASM=asm),
                          _PUBLISH_WARPS)

    def _gather_plan(self, ready, sources, offsets, out, done, what) -> tuple:
        """:meth:`gather`'s fixed part: (grid, the arguments before ``out``, the low bits of every
        address and byte offset, of those and every size, ``out``'s numel, inline PTX)."""
        if ready[0].numel() != len(sources) or len(offsets) != len(sources):
            raise AssertionError(f"gather: {len(sources)} sources, {len(offsets)} offsets, {ready[0].numel()} flags")
        if not out.is_floating_point() or not out.is_contiguous():
            raise AssertionError(f"gather: output {out.dtype} (contiguous: {out.is_contiguous()}); the NaN fill needs "
                                 f"a contiguous floating-point one")
        addrs, dsts, sizes = [], [], []
        for src, off in zip(sources, offsets):
            if not src.is_contiguous() or src.dtype != out.dtype or off < 0 or off + src.numel() > out.numel():
                raise AssertionError(f"gather: source {tuple(src.shape)} {src.dtype} at element {off} of output "
                                     f"{tuple(out.shape)} {out.dtype}")
            addrs.append(src.data_ptr())
            dsts.append(off * out.element_size())
            sizes.append(src.nbytes)
        where = functools.reduce(operator.or_, addrs + dsts, 0)
        low = functools.reduce(operator.or_, sizes, where)
        grid = (gather_programs(max(sizes, default=0), self._spinning_grid_cap()),)
        if grid[0] >= self.gather_sync.numel():
            raise AssertionError(f"gather: {grid[0]} programs, scratch words for {self.gather_sync.numel() - 1}")
        bound, asm = self._bound()
        jobs = _device_table(addrs + dsts + sizes, self.spec.device)
        head = (self.gen, self.gather_sync, self.error, ready[0], ready[1], jobs, len(sources), done[0],
                done[0].numel(), bound, what, self.rank)
        return grid, head, where, low, out.numel(), asm

    def poison_on_error(self, *outputs: torch.Tensor, zero: torch.Tensor | None = None,
                        signal: tuple[torch.Tensor, torch.Tensor] | None = None) -> tuple | None:
        """Enqueue: NaN into ``outputs`` (floating point, the workspace's dtype) if the workspace
        is broken -- a wait of this call or of an earlier one timed out.  Runs on every call that
        has no other kernel to fill its outputs (the reduce does it for gemm_rs); one launch per
        two outputs.  ``zero``: contiguous int32 words set to 0 in the first launch, broken or
        not (fused ag_gemm's arrival words: one launch less per call than their own ``zero_``).
        ``signal``: a flag table raised (:meth:`signal`, nothing when broken) in the first launch
        (two-shot gemm_ar's DONE2 after its pulls: one launch less per call).  Returns (kept key,
        grid, arguments) of its last launch (None: nothing launched)."""
        poison_on_error_kernel = _kernel("tpfuse.kernels.flags", "poison_on_error_kernel")

        todo = [t for t in outputs if t is not None and t.numel() and t.is_floating_point()]
        if not todo:
            if zero is not None:
                zero.zero_()
            if signal is not None:
                self.signal(signal)
            return None
        block = 1024
        launched = None
        for i in range(0, len(todo), 2):
            out = todo[i]
            out2 = todo[i + 1] if i + 1 < len(todo) else out
            n2 = out2.numel() if i + 1 < len(todo) else 0
            grid = (min(_POISON_PROGRAMS, triton_cdiv(max(out.numel(), n2), block)),)
            words, num_words = (self.error, 0) if zero is None else (zero, zero.numel())
            sig, num_sig = (self._no_signal, 0) if signal is None else (signal[0], signal[0].numel())
            zero = signal = None
            numel = out.numel()
            kept = ("poison", words.dtype, words.data_ptr() % 16 == 0, sig.data_ptr() % 16 == 0, out.dtype, out2.dtype, out.data_ptr() % 16 == 0,
                    out2.data_ptr() % 16 == 0, numel, n2, num_words, num_sig)
            args = (self.error, out, numel, out2, n2, words, num_words, self.gen, sig, num_sig)
            self._launch_kept(kept, poison_on_error_kernel, grid, args, dict(BLOCK=block), 4)
            launched = kept, grid, (*args, block)
        return launched

    def poisoner(self, shape: tuple[int, ...], dtype: torch.dtype, shape2: tuple[int, ...] | None,
                 dtype2: torch.dtype | None, *, signal: tuple[torch.Tensor, torch.Tensor] | None = None,
                 zero: torch.Tensor | None = None) -> "_Poisoner":
        """``f(out, out2)`` = :meth:`poison_on_error` ``(out, out2, zero=zero, signal=signal)`` (``zero``:
        words that outlive the calls, fused's arrival words) for a plan whose
        calls end with the NaN fill of two new contiguous floating-point outputs of these shapes and
        dtypes (``shape2`` None: ``f(out)``, one output), none empty (one launch): after the first
        call of a compiled variant (their 16-byte alignment) a call fills in the addresses and
        launches."""
        return _Poisoner(self, tuple(shape), dtype, None if shape2 is None else tuple(shape2), dtype2, signal, zero)

    def close(self) -> None:
        """Drop the buffers and everything built on them (plans, tables, views, kept launches):
        :func:`release_workspaces` after its device sync.  A closed workspace refuses calls."""
        for cache in (self.state, self._tables, self._views, self._fixed, self._publish, self._kept,
                      self._reduces, self._gather):
            cache.clear()
        self._buffers, self.flags, self._keepalive = [], [], None
        self.broken = (f"tpfuse {self.spec.op}: this workspace was released (tpfuse.release_workspaces()); "
                       f"the next call builds a new one")

    def failed(self) -> bool:
        """True once a wait of this workspace timed out, as far as the host can see now (its
        mirror; no sync) -- or once :meth:`check` marked it broken."""
        return self.broken is not None or self.host.failed()

    def check(self, op: str | None = None, again: type = RuntimeError) -> None:
        """Raise if the workspace is broken, without a device sync: ``TimeoutError`` with the
        record the first time the host sees it (the mirror), ``again`` (``RuntimeError``) on
        later calls."""
        if self.broken is not None:
            raise again(self.broken)
        if not self.host.failed():
            return
        message = self.host.message().replace(f"tpfuse {self.spec.op}:", f"tpfuse {op or self.spec.op}:", 1)
        message += f" (This workspace has begun {self.calls} calls.)"
        self.broken = (f"tpfuse {op or self.spec.op}: this rank's symmetric-memory workspace is broken by an earlier "
                       f"timeout ({message}); call tpfuse.release_workspaces() on every rank, then call again")
        raise TimeoutError(message)


_STREAMS: dict[tuple, torch.cuda.Stream] = {}   # Workspace.current_stream: (id, device, type) -> Stream


class _OnStream:
    """``torch.cuda.stream(stream)`` for a ``torch.cuda.Stream`` of the current device, through
    the three torch._C calls that context ends in (torch's own costs a device query, two
    ``Stream`` objects, device comparisons and wrapper calls on every use; several per op call):
    remember the device's current stream, make ``stream`` current, restore the remembered one on
    exit.  Any other case (another device, a stand-in stream in tests) takes ``torch.cuda.stream``."""

    __slots__ = ("stream", "prev", "slow")

    def __init__(self, stream):
        self.stream = stream
        self.prev = self.slow = None

    def __enter__(self) -> None:
        s = self.stream
        if s.__class__ is torch.cuda.Stream and torch._C._cuda_getDevice() == s.device_index:
            prev = torch._C._cuda_getCurrentStream(s.device_index)
            torch._C._cuda_setStream(stream_id=s.stream_id, device_index=s.device_index, device_type=s.device_type)
            self.prev = prev
        else:
            self.slow = torch.cuda.stream(s)
            self.slow.__enter__()

    def __exit__(self, *exc) -> None:
        if self.slow is not None:
            self.slow.__exit__(*exc)
            return
        prev = self.prev
        torch._C._cuda_setStream(stream_id=prev[0], device_index=prev[1], device_type=prev[2])


def _addresses(args: tuple) -> tuple:
    """``args`` with every tensor replaced by its address.  Triton's launcher takes an int for a
    pointer argument as it is, where for a tensor it calls ``data_ptr()`` and asks the driver
    for the device pointer (``cuPointerGetAttribute``, one driver call per pointer per launch);
    under UVA the two are the same address for every tensor the workspace's kernels take."""
    return tuple(a.data_ptr() if isinstance(a, torch.Tensor) else a for a in args)


class _Site:
    """The kept launches of one plan's call site (its publish, NaN fill or reduce): per compiled
    variant -- what the per-call tensors change in the compiled kernel (their 16-byte
    alignment, a stride) -- the direct launcher and the argument list with every tensor as its
    address; a call puts the per-call addresses at ``holes`` and launches.  Not CUDA, under
    the interpreter, or before a variant's first launch: the caller takes the general path and
    keeps what it launched (:meth:`keep`)."""

    __slots__ = ("ws", "holes", "variants")

    def __init__(self, ws: "Workspace", holes: tuple[int, ...]):
        self.ws = ws
        self.holes = holes
        self.variants: dict = {}

    def launch(self, variant, values: tuple) -> bool:
        hit = self.variants.get(variant)
        if hit is None:
            return False
        direct, args, grid = hit
        args = list(args)
        for i, v in zip(self.holes, values):
            args[i] = v
        direct(grid, torch._C._cuda_getCurrentRawStream(self.ws.spec.device.index), args)
        return True

    def keep(self, variant, launched: tuple | None) -> None:
        """Keep the launch the general path just made (``launched``: (kept key, grid, arguments))
        where it went through a direct launcher."""
        if launched is None:
            return
        kept, grid, args = launched
        direct = self.ws._kept.get(kept)
        if direct is not None:
            if len(self.variants) >= 16:
                self.variants.clear()
            self.variants[variant] = (direct, _addresses(args), grid + (1,) * (3 - len(grid)))


def _healthy(ws: "Workspace") -> bool:
    """Not broken as far as the host knows (the general path raises what it knows)."""
    return ws.broken is None and not ws.host.failed()


# the per-call arguments of the kernels (tpfuse/kernels/flags.py, reduce.py), by position
_PUBLISH_A_SRC, _PUBLISH_A_DST2, _PUBLISH_B_SRC = 18, 21, 24
_POISON_OUT, _POISON_OUT2 = 1, 3
_REDUCE_OUT, _REDUCE_DST2 = 2, 8


def _wait_key(table: tuple[torch.Tensor, torch.Tensor], what: int, lag: int, advance: bool) -> tuple:
    """The kept-launch key of :meth:`Workspace.wait` (and so of :meth:`Workspace.beginner`)."""
    return ("wait", id(table[0]), what, lag, advance)


def _signal_wait_key(signals: tuple[torch.Tensor, torch.Tensor] | None, waits: tuple[torch.Tensor, torch.Tensor],
                     what: int, lag: int, then: tuple | None) -> tuple:
    """The kept-launch key of :meth:`Workspace.signal_wait` (and of :meth:`Workspace.signal_waiter`)."""
    return ("signal_wait", None if signals is None else id(signals[0]), id(waits[0]), what, lag,
            None if then is None else (id(then[0][0]), then[1], then[2]))


class _Flag:
    """:meth:`Workspace.beginner` / :meth:`Workspace.signal_waiter`: ``issue`` (the general
    path) until the launch it keeps under ``fixed`` (:meth:`Workspace._launch`) exists, then that
    launch directly -- after :meth:`Workspace.begin`'s refusal of a broken workspace and its count
    where ``counts``.  ``fixed`` must be the key the general path keeps its launch under."""

    __slots__ = ("ws", "fixed", "issue", "counts", "hit")

    def __init__(self, ws: "Workspace", fixed: tuple, issue, counts: bool = False):
        self.ws, self.fixed, self.issue, self.counts = ws, fixed, issue, counts
        self.hit = None

    def __call__(self) -> None:
        hit, ws = self.hit, self.ws
        if hit is not None and (not self.counts or _healthy(ws)):
            try:
                hit[0](_GRID_1, torch._C._cuda_getCurrentRawStream(hit[2]), hit[1])
                if self.counts:
                    ws.calls += 1
                return
            except Exception:   # noqa: BLE001 - the general path launches through _run, which warns once
                self.hit = None
                ws._fixed.clear()
        self.issue()
        self.hit = ws._fixed.get(self.fixed)


class _Publisher:
    """:meth:`Workspace.publisher`."""

    __slots__ = ("ws", "credits", "ready", "slot", "lo", "hi", "offset", "wait_in", "local", "site")

    def __init__(self, ws, credits, ready, slot, rows, wait_in, local=None):
        self.ws, self.credits, self.ready, self.slot, self.wait_in = ws, credits, ready, slot, wait_in
        self.local = local
        self.lo, self.hi = rows
        self.offset = rows[0] * (slot.shape[1] if slot.dim() == 2 else 1) * slot.element_size()   # bytes into full
        self.site = _Site(ws, (_PUBLISH_A_SRC, _PUBLISH_A_DST2, _PUBLISH_B_SRC))

    def __call__(self, src: torch.Tensor, full: torch.Tensor) -> None:
        ws = self.ws
        if src.stride(-1) != 1 and src.shape[-1] > 1:
            src = src.contiguous()
        ptr, dst2 = src.data_ptr(), full.data_ptr() + self.offset
        variant = (src.stride(0), ptr % 16, dst2 % 16)
        if _healthy(ws) and self.site.launch(variant, (ptr, dst2, ptr)):
            ws.calls += 1
            return
        ws.check(ws.spec.op)
        ws.calls += 1
        self.site.keep(variant, ws._publish_launch(self.credits, self.ready, src, self.slot, full[self.lo:self.hi],
                                                   None, None, None, self.local, 1, WAIT_CREDIT, self.wait_in))


class _Poisoner:
    """:meth:`Workspace.poisoner`."""

    __slots__ = ("ws", "spec", "signal", "zero", "site", "two")

    def __init__(self, ws, shape, dtype, shape2, dtype2, signal, zero=None):
        self.two = shape2 is not None
        outs = ((shape, dtype), (shape2, dtype2)) if self.two else ((shape, dtype),)
        if any(not d.is_floating_point or 0 in sh for sh, d in outs):
            raise AssertionError(f"poisoner: outputs {outs}: non-empty floating-point ones")
        self.ws, self.spec, self.signal, self.zero = ws, (shape, dtype, shape2, dtype2), signal, zero
        self.site = _Site(ws, (_POISON_OUT, _POISON_OUT2))

    def __call__(self, out: torch.Tensor, out2: torch.Tensor | None = None) -> None:
        ptr = out.data_ptr()
        ptr2 = out2.data_ptr() if self.two else ptr
        if self.site.launch((ptr % 16, ptr2 % 16), (ptr, ptr2)):
            return
        shape, dtype, shape2, dtype2 = self.spec
        got = (tuple(out.shape), out.dtype) + ((tuple(out2.shape), out2.dtype) if self.two else (None, None))
        if got != self.spec or not out.is_contiguous() or (self.two and not out2.is_contiguous()):
            raise AssertionError(f"poisoner: outputs {got} for a plan of {self.spec}")
        self.site.keep((ptr % 16, ptr2 % 16), self.ws.poison_on_error(out, out2, zero=self.zero, signal=self.signal))


class _Reducer:
    """:meth:`Workspace.reducer`."""

    __slots__ = ("ws", "key", "sources", "shape", "signal", "into", "rows", "offset", "site")

    def __init__(self, ws, key, sources, shape, signal, into, rows):
        self.ws, self.key, self.sources, self.shape, self.signal, self.into = ws, key, sources, shape, signal, into
        self.rows = rows
        if into is not None and (tuple(into.shape) != shape or into.stride() != (shape[1], 1) or rows is None
                                 or rows[1] - rows[0] != shape[0]):
            raise AssertionError(f"reducer: into {tuple(into.shape)} {into.stride()}, rows {rows} for {shape}")
        self.offset = 0 if into is None else rows[0] * shape[1] * into.element_size()   # bytes into full
        self.site = _Site(ws, (_REDUCE_OUT, _REDUCE_DST2) if into is None else (_REDUCE_DST2,))

    def __call__(self, out: torch.Tensor) -> None:
        ptr = out.data_ptr() + self.offset
        if self.site.launch(ptr % 16, (ptr, ptr) if self.into is None else (ptr,)):
            return
        if self.into is None:
            if tuple(out.shape) != self.shape or not out.is_contiguous():
                raise AssertionError(f"reducer: output {tuple(out.shape)} (contiguous: {out.is_contiguous()}) for a "
                                     f"plan of {self.shape}")
            launched = self.ws.reduce(self.key, self.sources, out, signal=self.signal)
        else:
            if out.dim() != 2 or out.shape[1] != self.shape[1] or out.shape[0] < self.rows[1] or not out.is_contiguous():
                raise AssertionError(f"reducer: output {tuple(out.shape)} (contiguous: {out.is_contiguous()}) for "
                                     f"rows {self.rows} of {self.shape[1]} columns")
            launched = self.ws.reduce(self.key, self.sources, self.into, out2=out[self.rows[0]:self.rows[1]],
                                      signal=self.signal)
        self.site.keep(ptr % 16, launched)

def triton_cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _device_table(values: list[int], device: torch.device) -> torch.Tensor:
    """An int64 table on ``device`` without waiting for the GPU: on CUDA copied from pinned
    memory, asynchronously (the caching host allocator keeps the source until the copy ran).
    Under a CUDA graph capture the copy would be replayed from a source since reused, so there it
    is the plain copy, which refuses loudly (build tables with an eager call first)."""
    host = torch.tensor(values, dtype=torch.int64)
    if device.type != "cuda" or torch.cuda.is_current_stream_capturing():
        return host.to(device)
    return host.pin_memory().to(device, non_blocking=True)


# Direct launches of the workspace's small kernels (the pattern of tpfuse/gemm/launch.py):
# Triton's JIT launch binds and specializes every argument on every call (tens of us of host
# time, several times per op call); the first launch of a specialization goes through it and
# keeps the CompiledKernel, later ones launch that directly (tpfuse/_direct.py).  The key holds
# everything the JIT specializes on: the kernel, the device, its constexprs and warps, each
# pointer's dtype and 16-byte alignment, each integer's size class, divisibility by 16 and
# equality to 1.  The flag kernels' arguments are all the workspace's own (Workspace._launch):
# those launches skip even the key.
_COMPILED: dict = {}    # key -> (kernel, Direct)
_DIRECT_BROKEN = [False]
_GRID_1 = (1, 1, 1)


def _spec_key(kernel, device: torch.device, num_warps: int, constexprs: dict, args: tuple) -> tuple:
    key = [id(kernel), device.index, num_warps, *constexprs.items()]   # id: hashing a JITFunction hashes its source
    for x in args:
        if x.__class__ is int:
            key.append((-2**31 <= x < 2**31, x % 16 == 0, x == 1))
        elif isinstance(x, torch.Tensor):
            key.append((x.dtype, x.data_ptr() % 16 == 0))
        else:
            key.append(x)
    return tuple(key)


def _run(kernel, grid: tuple, args: tuple, constexprs: dict, num_warps: int, device: torch.device):
    """``kernel[grid](*args, **constexprs)`` (constexprs are the kernel's last parameters, in
    order), launched directly once compiled on CUDA.  Returns the :class:`tpfuse._direct.Direct`
    that launches this specialization (None: interpreted, not CUDA, or through the JIT only)."""
    if device.type != "cuda" or _interpreting():
        kernel[grid](*args, num_warps=num_warps, **constexprs)
        return None
    key = None
    if not _DIRECT_BROKEN[0]:
        key = _spec_key(kernel, device, num_warps, constexprs, args)
        hit = _COMPILED.get(key)
        if hit is not None and hit[0] is kernel:
            try:
                # a CompiledKernel reads grid[0..2]: a 1-D grid raised IndexError on the H200 bed
                hit[1](grid + (1,) * (3 - len(grid)), torch._C._cuda_getCurrentRawStream(device.index),
                       (*args, *constexprs.values()))
                return hit[1]
            except Exception as exc:   # a change of Triton's internals: say so once, then always JIT
                import warnings

                warnings.warn(f"tpfuse.symm: direct kernel launch failed ({type(exc).__name__}: {exc}); using "
                              f"Triton's JIT launch from now on (slower on the host)", RuntimeWarning, stacklevel=2)
                _DIRECT_BROKEN[0] = True
                _COMPILED.clear()
                key = None
    compiled = kernel[grid](*args, num_warps=num_warps, **constexprs)
    if key is not None and compiled is not None:
        from tpfuse._direct import Direct

        direct = Direct(compiled)
        _COMPILED[key] = (kernel, direct)
        return direct
    return None


# --------------------------------------------------------------------------------------------
# The factory and the registry of live workspaces
# --------------------------------------------------------------------------------------------

_LIVE: dict[tuple, Workspace] = {}
_RETIRED: list[Workspace] = []     # outgrown: peers may still read them until released


def _next_capacity(need: int, old: int) -> int:
    cap = max(_MIN_CAPACITY, old)
    while cap < need:
        cap *= 2
    return cap


def _allocate(spec: WorkspaceSpec, group) -> Workspace:
    """Collective: allocate this rank's symmetric buffer, zero its flags, rendezvous."""
    import torch.distributed._symmetric_memory as symm_mem

    buf = symm_mem.empty(FLAG_BYTES + spec.capacity, dtype=torch.uint8, device=spec.device)
    buf[:FLAG_BYTES].zero_()
    torch.cuda.synchronize(spec.device)   # zeroed before any peer can learn the address
    handle = symm_mem.rendezvous(buf, spec.group_name)
    size = FLAG_BYTES + spec.capacity
    buffers = [buf if r == spec.rank else handle.get_buffer(r, (size,), torch.uint8, 0)
               for r in range(spec.world_size)]
    ws = Workspace(spec, buffers, keepalive=(buf, handle))
    # Compile the NaN fill now, for one and two outputs (16-byte aligned, as fresh outputs are)
    probe = torch.empty(16, dtype=spec.dtype, device=spec.device)
    ws.poison_on_error(probe)
    ws.poison_on_error(probe, probe)
    return ws


def get_workspace(ctx, op: str, dtype: torch.dtype, device: torch.device, need: int) -> Workspace:
    """The workspace of (ctx's group, op, dtype, device) with at least ``need`` data bytes;
    created (collectively) on first use and grown the same way.  ``need`` must be a function of
    what every rank agrees on."""
    key = (ctx.group_name, op, dtype, device)
    check_group(ctx.group_name, op)
    ws = _LIVE.get(key)
    if ws is not None and ws.spec.capacity >= need:
        return ws
    if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        raise RuntimeError(
            f"tpfuse {op}: strategy copy_engine needs a {need} B symmetric-memory workspace that does not exist "
            f"yet, and a CUDA graph is being captured (allocating it is a collective rendezvous). Call the op "
            f"once eagerly with the largest shape before capturing (a warm-up call).")
    old = 0
    if ws is not None:
        old = ws.spec.capacity
        _RETIRED.append(ws)
    spec = WorkspaceSpec(ctx.group_name, op, dtype, device, ctx.rank, ctx.world_size, _next_capacity(need, old))
    ws = _allocate(spec, ctx.group)
    _LIVE[key] = ws
    try:   # a destroyed group takes its workspaces along
        weakref.finalize(ctx.group, _drop_group, ctx.group_name)
    except TypeError:
        pass
    return ws


def _drop_group(group_name: str) -> None:
    for key in [k for k in _LIVE if k[0] == group_name]:
        _RETIRED.append(_LIVE.pop(key))


def check_group(group_name: str | None, op: str | None = None, again: type = RuntimeError) -> None:
    """Raise if a workspace of ``group_name`` (None: of any group) is broken, live or outgrown
    (``TimeoutError`` with the facts the first time, ``again`` later; see
    :meth:`Workspace.check`).  Host memory reads only, no device sync: every call of a
    symmetric-memory strategy starts here."""
    for (name, ws_op, _, _), ws in _LIVE.items():
        if group_name is None or name == group_name:
            if ws.broken is not None or ws.host.failed():
                ws.check(op if op == ws_op or op is None else f"{op} (after {ws_op})", again)
    for ws in _RETIRED:
        if group_name is None or ws.spec.group_name == group_name:
            if ws.broken is not None or ws.host.failed():
                ws.check(op, again)


def synchronize(group=None) -> None:
    """Wait for this process's GPU work (``torch.cuda.synchronize``), then raise ``TimeoutError``
    if a wait of any symmetric-memory workspace of ``group`` (a ProcessGroup; None: of every
    group) timed out -- the explicit check for eager code, tests and CUDA graph replays (the
    next tpfuse call on the group would raise it too)."""
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()
    name = None if group is None else getattr(group, "group_name", group)
    check_group(name, again=TimeoutError)


def release_workspaces() -> None:
    """Free every symmetric-memory workspace of this process (after waiting for the GPU).

    Call it on every rank at the same point (no tpfuse op in flight anywhere): the next call
    builds fresh ones with a rendezvous.  This also clears workspaces broken by a timeout.

    The memory is freed here, while the GPU is idle, not whenever Python's cycle collector next
    runs: a workspace's plans hold the workspace (their prepared launches name it), a cycle that
    kept the buffers (and their peer mappings) alive past the release until some later
    collection, inside whatever call it fell in."""
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()
    released = list(_LIVE.values()) + _RETIRED
    _LIVE.clear()
    _RETIRED.clear()
    while released:
        released.pop().close()
    gc.collect()   # whatever else still ties a released workspace's buffers in a cycle


def check_workspaces() -> None:
    """Raise ``TimeoutError`` if a wait of any workspace timed out: :func:`synchronize` over
    every group (kept for code written before it).  Synchronizes."""
    synchronize(None)
