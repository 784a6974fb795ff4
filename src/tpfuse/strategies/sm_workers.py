"""``sm_workers``: a budget of worker CTAs moves the data (16-byte loads/stores over peer
pointers) beside the GEMM, through a ready queue of local staging slots with credits.

The design's "independent workers" (DESIGN §2): compute produces chunks, worker CTAs
(``comm_sms`` of them, :mod:`tpfuse.kernels.sm_workers`) move them, credits flow back.  For
rank r of W (``peers`` = r+1, r+2, ... mod W)::

  ag_gemm   compute: begin (credits: peers done reading r's slot of the last call)
                     r's slot <- a_shard; READY[r] on every peer; a_full[r] <- a_shard; arrival
                     words of r's chunks = 1; ONE persistent GEMM (tpfuse.gemm.matmul, wait
                     hook, round order from r's chunk) on fused's SM budget less the workers'
            workers: for each peer chunk (peer order): wait READY[p] >= gen, pull it into
                     a_full (vector ld/st), the last worker CTA sets the chunk's arrival word
            side:    after the workers: DONE[r] on every peer (credits back)
  gemm_rs   compute: begin (credits: every owner reduced the last call's partials)
                     for each piece j of a peer owner's rows (owner order, ``chunk_rows`` each):
                         slot s = j % slots, use u = j // slots
                         wait free[s] >= u   (a credit: the workers drained use u-1; bounded)
                         ring[s] <- a[piece rows] @ b          (PRODUCING)
                         ready[s] = u + 1                      (READY)
                     a[r rows] @ b -> r's own inbox[r];  wait READY from every peer;
                     c_shard = sum of inbox[0..W-1] in float32, rank order; DONE[r] on every peer
            workers: for each piece j: wait ready[s] >= u + 1 (IN_FLIGHT), push ring[s] into the
                     owner's inbox[r] (peer memory); the last worker CTA of the piece then
                     releases free[s] = u + 1 (FREE: "local source reusable") and, once every
                     piece of the owner is complete (a join counter: the CTAs skip pieces they
                     have no block of, so pieces complete out of order), READY[r] on the owner
                     ("remote visible": a system-scope release that covers every worker CTA's
                     stores)
  gemm_ar   outputs up to ``knobs.ONE_SHOT_MAX_BYTES``: copy_engine's one-shot path;
            else the gemm_rs schedule over near-equal row chunks (M need not divide by W),
            each owner reduces its inbox into its gather slot (READY2 / DONE2 credits, as
            copy_engine's two-shot), and the workers pull every peer's reduced chunk into c.

The ring (``slots`` chunk buffers of local GMEM) and its ``ready``/``free`` words are this
rank's own: one producer (the compute stream), one consumer (the workers).  The words count
uses *within a call* and are reset to 0 on the compute stream after the workers finished, so
the targets are the same constants every call and a CUDA graph may replay them; cross-rank
flags carry the workspace's device-memory generation (:mod:`tpfuse.symm`).  Slot life cycle
(``free[s]``, ``ready[s]`` and the use u): FREE (``free == ready == u``) -> PRODUCING (the
producer passed its credit wait) -> READY (``ready == u + 1``) -> IN_FLIGHT (a worker passed
its wait) -> FREE (``free == u + 1``).

**Workers and GEMM are two co-resident launches** on two streams, not one persistent launch
with roles by program id: the GEMM is the GEMM core unchanged (its wait hook is what ``fused``
uses), the workers are a 100-line kernel, and co-residency comes from the SM budget -- the
GEMM's grid leaves ``comm_sms`` SMs free (:func:`gemm_programs`), on one GPU shared by W
processes within ``fused``'s per-process budget.  The workers are launched before the GEMM (a
GEMM first, with kernels issued after it, timed out in ``fused`` while their first JIT compile
outlasted the GEMM's bounded spins).  gemm_rs's producer GEMMs are one cuBLAS call per piece:
the GEMM core's epilogue hook cannot take a credit per slot.

**Launch order and module loading.**  CUDA loads a kernel's module at its first launch (lazy
loading, the default since CUDA 12; a Triton kernel's module is loaded at its first launch too,
not when it is compiled), and a load may wait for the device's running work.  A kernel that
spins on words set only by kernels issued after it must therefore not be followed by a first
launch: gemm_rs's first call in the bed timed out so (the workers spun on ring chunk 0 while
the producer's first cuBLAS GEMM waited to be loaded).  So the producer's kernels are launched
once before the workers, on the first call of each ring (shape, knobs) and operand layout
(:meth:`Ring.warm_up`: the credit and READY kernels with values that change nothing, each
distinct piece GEMM into its own slot): that call issues this extra work, and its module loads
may wait for the GPU, as the first call's allocations may.  ag_gemm and gemm_ar's gather need
none: there the side stream's workers are the producers, launched first, and what follows
them (the AG GEMM, whose tiles wait on the workers' arrival words; the flag and copy kernels
after them) waits on them, never they on it -- a first load there waits for the workers, which
finish without it.

Knobs: :class:`SmWorkersKnobs` (``knobs=`` of the three functions, else
:func:`default_knobs`, a pure function of the shape, W and the GPU).  Observability: pass a
dict as ``stats=`` (eager calls) and it is filled after the call by :func:`summarize`, which
reads the kernels' stamps back (a device sync: only a call that asked for stats makes it):
bytes in flight, producer stalls on credits, ready-queue depth, issue-to-completion latency per
chunk, bytes still moving when the GEMM ended.

Errors, as in ``copy_engine`` and ``fused``: no eager call waits for the GPU (except the first
call of a workspace capacity, the module loads of a ring's first call, and a call given ``stats=``).  Every wait -- the flag kernels',
the worker CTAs', the ring's credit wait and the AG GEMM's per-chunk waits -- shares the
workspace's error word; a timed-out wait records rank, peer, chunk and generation there and in
its host-visible mirror (this strategy's ring waits are ``abi.WAIT_SLOT_FREE`` /
``WAIT_SLOT_READY``).  A set word breaks the workspace: later kernels stop waiting and publish
nothing, the outputs of that call and of every call queued after it are NaN, and the next call
on the group (or :func:`tpfuse.synchronize`, or the watchdog's log line) reports it
(tpfuse/symm.py).  float32 is refused (the GEMM core multiplies it in TF32), as in ``fused``.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch

from tpfuse import dtypes, symm, timeline, watchdog
from tpfuse._dist import GroupContext, breadcrumb, new_output
from tpfuse.kernels import abi
from tpfuse.model import cost as model_cost
from tpfuse.model import steps as model_steps
from tpfuse.model.simulate import Schedule
from tpfuse.strategies import _symm_steps as steps
from tpfuse.strategies import copy_engine
from tpfuse.strategies.fused import GEMM_WAIT_SLACK_S, TILE_M

__all__ = ["NAME", "DESCRIPTION", "ORDER", "DTYPES", "SYMMETRIC_MEMORY", "KNOBS", "SCHEDULE", "AUTO", "why_unavailable", "ag_gemm", "gemm_rs", "gemm_ar",
           "SmWorkersKnobs", "default_knobs", "gemm_programs", "summarize", "make_copy", "WAIT_SLOT_READY",
           "WAIT_SLOT_FREE"]

NAME = "sm_workers"
# Its SCHEDULE (end of this file) rests on a worker bandwidth curve that no GPU run has
# calibrated yet (tpfuse.model.cost.worker_gbps: leads; `tpfuse bench comm`'s sm_workers grid
# is to fit it) and on no multi-GPU measurement of this strategy: the planner predicts it, but
# `auto` picks it only where the tuning cache holds a measured time for it (strategies/__init__.py).
AUTO = False
DESCRIPTION = ("worker CTAs move the chunks over peer pointers (16-byte loads/stores) from a ready queue of "
               "local staging slots with credits, beside one GEMM (AG) or per-chunk GEMMs (RS, AR)")
ORDER = 40

# its Triton GEMM would multiply float32 in TF32: half precision only (as fused)
DTYPES = (dtypes.HALF,)
SYMMETRIC_MEMORY = True

# Codes of this strategy's own waits in the workspace's error word (abi.ERR_WHAT; explained to
# tpfuse.watchdog.describe by the register_wait calls below)
WAIT_SLOT_FREE = abi.WAIT_SLOT_FREE     # the producer waited for the workers to drain a ring slot (a credit)
WAIT_SLOT_READY = abi.WAIT_SLOT_READY   # a worker waited for the producer to fill a ring slot


def _explain_slot_free(words: list[int], *, op: str, waiter: int, timeout_s: float) -> str:
    peer, gen, seen, chunk = (words[abi.ERR_PEER], words[abi.ERR_GENERATION], words[abi.ERR_SEEN],
                              words[abi.ERR_CHUNK])
    return (f"tpfuse {op} ({NAME}): rank {waiter}'s producer waited more than {timeout_s:g} s "
            f"(TPFUSE_TIMEOUT_S) for a FREE slot {words[abi.ERR_TILE]} of its staging ring (chunk {chunk}, for "
            f"owner rank {peer}: wanted the slot's use count >= {gen}, last saw {seen}). Its worker CTAs did not "
            f"drain the slot: they wait on an earlier chunk, or a peer rank is dead or late.")


def _explain_slot_ready(words: list[int], *, op: str, waiter: int, timeout_s: float) -> str:
    peer, gen, seen, chunk = (words[abi.ERR_PEER], words[abi.ERR_GENERATION], words[abi.ERR_SEEN],
                              words[abi.ERR_CHUNK])
    return (f"tpfuse {op} ({NAME}): rank {waiter}'s worker CTAs waited more than {timeout_s:g} s "
            f"(TPFUSE_TIMEOUT_S) for ring chunk {chunk} (for owner rank {peer}) to be produced (wanted use "
            f">= {gen}, last saw {seen}); its producer stalled.")


watchdog.register_wait(WAIT_SLOT_FREE, "ring credit", "the workers to drain a staging-ring slot (sm_workers' producer)",
                       _explain_slot_free)
watchdog.register_wait(WAIT_SLOT_READY, "ring ready", "the producer to fill a staging-ring slot (sm_workers' workers)",
                       _explain_slot_ready)

# Defaults of the knobs, with their sources.
# ~15 SMs reach NVLink4/5 line rate with KB-sized SM-driven messages (published measurements
# cited in issue 30; Triton-distributed's NUM_COMM_SMS is of that order): a lead until the
# `tpfuse bench comm` sm_workers grid measures it on our machines.
COMM_SMS = 16
# Double buffering: the producer fills one slot while the workers drain the other (DESIGN §3).
SLOTS = 2
# 16 KiB per worker CTA per iteration: the block of the SM copy that `tpfuse bench comm`
# measures (tpfuse/bench/comm.py, 4096 int32 words per program).
BLOCK_BYTES = 16384
_NUM_WARPS = 8        # 256 threads x 64 B: four 16-byte vectors each in flight per iteration
MAX_COMM_SMS = 1024   # worker programs: one scratch word each


@dataclass(frozen=True)
class SmWorkersKnobs:
    """Knobs of ``sm_workers`` (defaults: :func:`default_knobs`).

    ``comm_sms``: worker CTAs (one SM each); the AG GEMM's grid leaves them free.
    ``slots``: chunk buffers of gemm_rs/gemm_ar's local staging ring (queue depth).
    ``block_bytes``: bytes one worker CTA loads per iteration before storing them (its bytes in
    flight): a power of two, 256 .. 65536.
    ``chunk_rows``: rows per communication chunk (None: one chunk per rank's rows).  ag_gemm:
    must divide the shard's rows (each chunk has its own arrival word); gemm_rs/gemm_ar: each
    owner's rows are cut into pieces of at most this many rows, one ring slot each.
    """

    comm_sms: int
    slots: int = SLOTS
    block_bytes: int = BLOCK_BYTES
    chunk_rows: int | None = None

    def __post_init__(self):
        for name in ("comm_sms", "slots", "block_bytes", "chunk_rows"):
            value = getattr(self, name)
            if value is None and name == "chunk_rows":
                continue
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"SmWorkersKnobs.{name}={value!r}: must be a positive int"
                                 + (" or None" if name == "chunk_rows" else ""))
        if self.comm_sms > MAX_COMM_SMS:
            raise ValueError(f"SmWorkersKnobs.comm_sms={self.comm_sms}: at most {MAX_COMM_SMS} worker CTAs")
        b = self.block_bytes
        if b & (b - 1) or not 256 <= b <= 65536:
            raise ValueError(f"SmWorkersKnobs.block_bytes={b}: must be a power of two from 256 to 65536")


KNOBS = SmWorkersKnobs


def default_knobs(world_size: int, sm_count: int, *, shared_gpu: bool = False) -> SmWorkersKnobs:
    """The knobs a call takes without ``knobs=``: :data:`COMM_SMS` worker CTAs (at most a
    quarter of the SMs), on one GPU shared by W processes (the bed) a quarter of each
    process's budget (``fused.model_sm_budget``: SMs // (W + 1)); :data:`SLOTS` slots,
    :data:`BLOCK_BYTES`, one chunk per rank."""
    from tpfuse.strategies.fused import model_sm_budget as fused_sm_budget

    if shared_gpu:
        comm = max(1, fused_sm_budget(sm_count, world_size, shared_gpu=True) // 4)
    else:
        comm = max(1, min(COMM_SMS, sm_count // 4))
    return SmWorkersKnobs(comm_sms=comm)


def gemm_programs(sm_count: int, world_size: int, comm_sms: int, *, shared_gpu: bool = False) -> int:
    """Programs of the AG GEMM: ``fused``'s budget (every SM but one; SMs // (W + 1) on a
    shared GPU) less the workers' ``comm_sms``, at least 1 -- the GEMM's tiles spin on chunks
    the workers deliver, so the workers must find SMs while the whole GEMM grid is resident."""
    from tpfuse.strategies.fused import model_sm_budget as fused_sm_budget

    return max(1, fused_sm_budget(sm_count, world_size, shared_gpu=shared_gpu) - comm_sms)


def why_unavailable(ctx: GroupContext, device: torch.device, dtype: torch.dtype) -> str | None:
    """None if sm_workers can run for this group, device and dtype, else why not."""
    reason = copy_engine.why_unavailable(ctx, device, dtype)
    if reason is not None:
        return reason.replace("copy_engine", NAME)
    if not dtypes.accepts(DTYPES, dtype):
        return (f"{NAME} runs {dtypes.describe(DTYPES)} only: its Triton GEMM multiplies float32 in TF32; "
                "float32 runs with 'copy_engine' (cuBLAS, full fp32)")
    try:
        import triton  # noqa: F401
    except ImportError:
        return f"{NAME} needs triton (pip install triton)"
    return None


# --------------------------------------------------------------------------------------------
# helpers: the device, streams, per-workspace state
# --------------------------------------------------------------------------------------------
def _cuda(device: torch.device) -> bool:
    return device.type == "cuda" and not symm._interpreting()


def _sm_count(device: torch.device) -> int:
    from tpfuse.gemm.device import num_sms

    return num_sms(device)


def _knobs(knobs: SmWorkersKnobs | None, world_size: int, device: torch.device) -> SmWorkersKnobs:
    if knobs is None:
        return default_knobs(world_size, _sm_count(device), shared_gpu=symm.shared_gpu())
    if not isinstance(knobs, SmWorkersKnobs):
        raise TypeError(f"knobs: expected a tpfuse.strategies.sm_workers.SmWorkersKnobs, got {type(knobs).__name__}")
    return knobs


def _state(ws: symm.Workspace, key: tuple, make):
    """What this strategy keeps with the workspace under ``key`` (built by ``make()`` once)."""
    key = (NAME,) + key
    value = ws.state.get(key)
    if value is None:
        value = make()
        ws.state[key] = value
    return value


def _words(ws: symm.Workspace, name: str, count: int, dtype=torch.int32) -> torch.Tensor:
    """This rank's zeroed words ``name`` (local memory), kept with the workspace."""
    return _state(ws, ("words", name, count, dtype), lambda: torch.zeros(count, dtype=dtype, device=ws.spec.device))


def _side(ws: symm.Workspace):
    """The side stream's context (none on CPU, where kernels run one after another)."""
    return torch.cuda.stream(ws.stream) if ws.spec.device.type == "cuda" else contextlib.nullcontext()


def _side_waits_main(ws: symm.Workspace) -> None:
    if ws.spec.device.type == "cuda":
        ws.stream.wait_stream(torch.cuda.current_stream())


def _main_waits_side(ws: symm.Workspace, *tensors: torch.Tensor) -> None:
    if ws.spec.device.type == "cuda":
        torch.cuda.current_stream().wait_stream(ws.stream)
        for t in tensors:
            t.record_stream(ws.stream)


def _bound(device: torch.device) -> int:
    """The spin bound of the kernels: ns with inline PTX, else spins (~1 ms each interpreted)."""
    return int(symm.timeout_s() * 1e9) if _cuda(device) else max(1, int(symm.timeout_s() * 1000))


def _launch(kernel, grid: tuple, *args, num_warps: int = 1, **constexprs) -> None:
    """``kernel[grid](*args, **constexprs)``: every launch of this strategy's kernels (one place
    to fake in the host-cost test, tests/cpu/test_host_overhead.py)."""
    kernel[grid](*args, num_warps=num_warps, **constexprs)


# --------------------------------------------------------------------------------------------
# the task table and the worker launch
# --------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Task:
    """One worker task (a row of the kernel's table; columns ``kernels.sm_workers.T_*``).
    ``dst`` is relative to the launch's ``dst_base`` (0: absolute).  Waits and publishes: an
    int32 word's byte address (0: none) and its value ``const + per_gen * gen``.  ``join``: the
    index of a join counter in the launch's counters (after the tasks' own; -1: none) shared by
    ``join_n`` tasks that all carry the same ``pub2``: it is published once, when the last of
    them completes (the worker CTAs skip tasks they have no block of, so one task's completion
    says nothing of the tasks before it)."""

    src: int
    dst: int
    numel: int
    wait: int = 0
    wait_const: int = 0
    wait_gen: int = 0
    what: int = 0
    peer: int = -1
    chunk: int = -1
    pub1: int = 0
    pub1_const: int = 0
    pub1_gen: int = 0
    pub2: int = 0
    pub2_const: int = 0
    pub2_gen: int = 0
    join: int = -1
    join_n: int = 0

    def row(self) -> list[int]:
        return [self.src, self.dst, self.numel, self.wait, self.wait_const, self.wait_gen, self.what, self.peer,
                self.chunk, self.pub1, self.pub1_const, self.pub1_gen, self.pub2, self.pub2_const, self.pub2_gen,
                self.join, self.join_n]


@dataclass
class Launch:
    """A worker launch's device tables (kept with the workspace): the tasks, one counter per
    task and one per join group (zero between launches), whether every source and destination is 16-byte aligned
    (then the whole blocks of every stripe are: a block is a power of two >= 256 bytes), and
    the tasks."""

    table: torch.Tensor
    counters: torch.Tensor
    aligned: bool
    tasks: tuple


def _launch_tables(ws: symm.Workspace, key: tuple, make_tasks) -> Launch:
    def make():
        from tpfuse.kernels import sm_workers as K

        tasks = tuple(make_tasks())
        rows = [t.row() for t in tasks]
        assert all(len(r) == K.TASK_COLUMNS.value for r in rows)
        device = ws.spec.device
        table = torch.tensor(rows, dtype=torch.int64, device=device).reshape(len(rows), K.TASK_COLUMNS.value)
        elem = torch.empty((), dtype=ws.spec.dtype).element_size()
        aligned = all(t.src % 16 == 0 and t.dst % 16 == 0 for t in tasks)   # whole blocks: BLOCK x elem is
        counters = max([1, len(tasks)] + [t.join + 1 for t in tasks])   # the tasks', then the join groups'
        return Launch(table, torch.zeros(counters, dtype=torch.int32, device=device), aligned, tasks)

    return _state(ws, ("launch",) + key, make)


def launch_workers(ws: symm.Workspace, launch: Launch, kn: SmWorkersKnobs, *, dst_base: int = 0,
                   task_lo: int = 0, task_hi: int | None = None, stats: torch.Tensor | None = None) -> None:
    """Enqueue the worker kernel on the current stream: ``kn.comm_sms`` programs over tasks
    ``[task_lo, task_hi)`` of ``launch`` (destinations offset by ``dst_base`` bytes)."""
    from tpfuse.kernels.sm_workers import worker_kernel

    hi = len(launch.tasks) if task_hi is None else task_hi
    if hi <= task_lo:
        return
    elem = torch.empty((), dtype=ws.spec.dtype).element_size()
    vec = 16 // elem if launch.aligned and dst_base % 16 == 0 else 1
    device = ws.spec.device
    _launch(worker_kernel, (kn.comm_sms,),
            launch.table, task_lo, hi, dst_base, ws.gen, launch.counters, ws.error,
            stats if stats is not None else launch.counters, _words(ws, "scratch", MAX_COMM_SMS), _bound(device),
            ws.rank, ELEM=8 * elem, BLOCK=kn.block_bytes // elem, VEC=vec, USE_ASM=_cuda(device),
            STATS=stats is not None, num_warps=_NUM_WARPS if device.type == "cuda" else 1)


def _new_stats(tasks: int, device: torch.device) -> torch.Tensor:
    from tpfuse.kernels import sm_workers as K

    stats = torch.zeros(tasks, K.STATS_COLUMNS.value, dtype=torch.int64, device=device)
    stats[:, K.S_WAIT_START.value] = 2**62
    stats[:, K.S_COPY_START.value] = 2**62
    return stats


def _addr(t: torch.Tensor) -> int:
    return t.data_ptr()


def _flag_addr(ws: symm.Workspace, region: str, owner: int, index: int) -> int:
    """Byte address of ``region[index]`` in rank ``owner``'s flags (checked to fit)."""
    return ws.flags[owner].data_ptr() + 4 * symm.flag_index(region, index, ws.world_size)


# --------------------------------------------------------------------------------------------
# ag_gemm
# --------------------------------------------------------------------------------------------
def _ag_chunk_rows(m_shard: int, kn: SmWorkersKnobs) -> int:
    rows = m_shard if kn.chunk_rows is None else kn.chunk_rows
    if m_shard % rows:
        raise ValueError(f"sm_workers ag_gemm: knobs.chunk_rows={rows} does not divide the shard's {m_shard} rows; "
                         f"pass a divisor of {m_shard} (each chunk has its own arrival word) or None")
    return rows


def _ag_tasks(ws: symm.Workspace, m_shard: int, k: int, chunk_m: int, arrived: torch.Tensor) -> list[Task]:
    """Pull tasks of ag_gemm, peers in order rank+1, rank+2, ...: chunk c of peer p's slot ->
    rows of a_full (relative to its base), after READY[p] >= gen; the last worker CTA sets the
    chunk's arrival word (1: reset after the GEMM)."""
    rank, world_size = ws.rank, ws.world_size
    elem = torch.empty((), dtype=ws.spec.dtype).element_size()
    per_rank = m_shard // chunk_m
    tasks = []
    for p in steps.peers(rank, world_size):
        slot = ws.data(p, (m_shard, k))
        for q in range(per_rank):
            chunk = p * per_rank + q
            tasks.append(Task(src=_addr(slot) + q * chunk_m * k * elem, dst=chunk * chunk_m * k * elem,
                              numel=chunk_m * k, wait=_flag_addr(ws, "READY", rank, p), wait_gen=1,
                              what=symm.WAIT_READY, peer=p, chunk=chunk,
                              pub1=_addr(arrived) + 4 * chunk, pub1_const=1))
    return tasks


class _AgPlan:
    """What an ag_gemm call of one (shape, chunk) needs, built once per workspace: the flag
    tables, the arrival words, the worker launch, and the GEMM's wait spec on the workspace's
    error word (a broken workspace stops the GEMM's waits too)."""

    def __init__(self, ws: symm.Workspace, m_shard: int, k: int, chunk_m: int):
        from tpfuse.gemm import WaitSpec

        rank, world_size = ws.rank, ws.world_size
        self.peers = steps.peers(rank, world_size)
        self.credits = ws.incoming("DONE", self.peers)
        self.ready_out = ws.outgoing("READY", self.peers)
        self.done_out = ws.outgoing("DONE", self.peers)
        self.per_rank = m_shard // chunk_m
        self.mine = slice(rank * m_shard, (rank + 1) * m_shard)
        self.own_words = slice(rank * self.per_rank, (rank + 1) * self.per_rank)
        self.arrived = _words(ws, "arrived", world_size * self.per_rank)
        self.launch = _launch_tables(ws, ("ag", m_shard, k, chunk_m),
                                     lambda: _ag_tasks(ws, m_shard, k, chunk_m, self.arrived))
        # fused's convention: the tiles wait GEMM_WAIT_SLACK_S longer than the workers' flag
        # waits, so that when a peer is dead the workers' wait, which knows the peer, records
        # first; a recorded error ends the tiles' waits at once anyway
        bound_s = symm.timeout_s() + GEMM_WAIT_SLACK_S
        self.wait = WaitSpec(signal=self.arrived, generation=1, chunk_m=chunk_m, timeout_ns=int(bound_s * 1e9),
                             max_spins=max(1, int(bound_s * 1000)), error=ws.error, rank=rank)
        self.start_chunk = rank * self.per_rank
        per_rank = self.per_rank
        self.chunk_owner = lambda chunk: min(chunk // per_rank, world_size - 1)


def _ag_plan(ws: symm.Workspace, m_shard: int, k: int, chunk_m: int) -> _AgPlan:
    return steps.cached(ws, ("sm_workers ag", m_shard, k, chunk_m), lambda: _AgPlan(ws, m_shard, k, chunk_m))


def ag_publish(a_shard: torch.Tensor, ws: symm.Workspace, kn: SmWorkersKnobs) -> None:
    """Phase 1 of ag_gemm: begin (credits), this rank's slot <- a_shard, READY[rank] on peers."""
    m_shard, k = a_shard.shape
    plan = _ag_plan(ws, m_shard, k, _ag_chunk_rows(m_shard, kn))
    steps.publish_shard(ws, a_shard, plan.credits, plan.ready_out)


def ag_pull_and_gemm(a_shard: torch.Tensor, b: torch.Tensor, ws: symm.Workspace, kn: SmWorkersKnobs,
                     a_full: torch.Tensor, c: torch.Tensor, stats: dict | None = None) -> None:
    """Phase 2 of ag_gemm: the workers pull the peers' chunks (side stream) while one GEMM
    waits per tile for their arrival words; then DONE[rank] on every peer.  No NaN fill here
    (:func:`ag_gemm` ends with it)."""
    from tpfuse.gemm import matmul

    world_size = ws.world_size
    m_shard, k = a_shard.shape
    plan = _ag_plan(ws, m_shard, k, _ag_chunk_rows(m_shard, kn))
    dev = a_shard.device
    ws.host.chunk_owner = plan.chunk_owner   # names the peer if the GEMM's wait records first
    a_full[plan.mine].copy_(a_shard)
    plan.arrived[plan.own_words].fill_(1)
    launch = plan.launch
    task_stats = _new_stats(len(launch.tasks), dev) if stats is not None else None
    stamps = _words(ws, "stamps", 2, torch.int64) if stats is not None else None
    _side_waits_main(ws)
    with _side(ws):
        with timeline.span("copy", f"{kn.comm_sms} workers pull {len(launch.tasks)} chunks", device=dev):
            launch_workers(ws, launch, kn, dst_base=_addr(a_full), stats=task_stats)
        ws.signal(plan.done_out)
    programs = None
    if dev.type == "cuda":
        programs = gemm_programs(_sm_count(dev), world_size, kn.comm_sms, shared_gpu=symm.shared_gpu())
    with timeline.span("gemm", "GEMM (waits per chunk)", device=dev):
        matmul(a_full, b, out=c, tile_order="round", start_chunk=plan.start_chunk, wait=plan.wait, check=False,
               num_sms=programs)
    if stamps is not None:
        _stamp(stamps, 0, dev)
    _main_waits_side(ws, a_full)
    plan.arrived.zero_()   # after the GEMM and the workers: the next call's words start at 0
    if stats is not None:
        stats.update(summarize(launch.tasks, task_stats, kn, elem=a_shard.element_size(),
                               gemm_end_ns=stamps[0], programs=programs))


def _stamp(stamps: torch.Tensor, index: int, device: torch.device) -> None:
    from tpfuse.kernels.sm_workers import stamp_kernel

    _launch(stamp_kernel, (1,), stamps, index, USE_ASM=_cuda(device))


def _check_stats(stats) -> None:
    if stats is None:
        return
    if not isinstance(stats, dict):
        raise TypeError(f"stats: expected a dict to fill (or None), got {type(stats).__name__}")
    if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
        raise ValueError("stats: sm_workers fills stats= after reading the kernels' stamps back (a device sync), "
                         "which a CUDA graph capture cannot do; pass stats= to an eager call")


def ag_gemm(a_shard: torch.Tensor, b: torch.Tensor, ctx: GroupContext, *, knobs: SmWorkersKnobs | None = None,
            stats: dict | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    world_size = ctx.world_size
    m_shard, k = a_shard.shape
    n = b.shape[1]
    if world_size == 1 or m_shard * k == 0 or n == 0:
        return copy_engine.ag_gemm(a_shard, b, ctx)
    kn = _knobs(knobs, world_size, a_shard.device)
    _ag_chunk_rows(m_shard, kn)       # every rank raises before the rendezvous
    _check_stats(stats)
    a_full = new_output((world_size * m_shard, k), dtype=a_shard.dtype, device=a_shard.device)
    c = new_output((world_size * m_shard, n), dtype=a_shard.dtype, device=a_shard.device)
    ws = symm.get_workspace(ctx, "ag_gemm", a_shard.dtype, a_shard.device, a_shard.nbytes)
    breadcrumb("sm_workers ag_gemm: publishing the local shard")
    ag_publish(a_shard, ws, kn)
    ag_pull_and_gemm(a_shard, b, ws, kn, a_full, c, stats)
    steps.finish(ws, c, a_full)   # NaN when broken: a wait of this call (workers', GEMM's) or an earlier one
    return c, a_full


# --------------------------------------------------------------------------------------------
# gemm_rs / gemm_ar phase 1: per-chunk GEMMs into the staging ring, workers push to the owners
# --------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Piece:
    """Rows ``[lo, hi)`` of ``a @ b`` (owned by ``owner``) through ring slot ``slot`` on its
    ``use``-th use of the call; ``last``: the owner's last piece (its READY follows)."""

    owner: int
    lo: int
    hi: int
    slot: int
    use: int
    last: bool


def ring_pieces(rank: int, world_size: int, bounds: list[tuple[int, int]], chunk_rows: int | None,
                slots: int) -> list[Piece]:
    """The pieces of phase 1 in production order: owners rank+1, rank+2, ... (this rank's own
    rows go straight to its inbox, not through the ring), each owner's rows cut into pieces of
    at most ``chunk_rows`` rows (None: one piece), piece j through slot j % slots."""
    pieces = []
    for owner in steps.peers(rank, world_size):
        lo, hi = bounds[owner]
        step = (hi - lo) if chunk_rows is None else chunk_rows
        cuts = list(range(lo, hi, max(1, step))) or [lo]
        for x, start in enumerate(cuts):
            j = len(pieces)
            pieces.append(Piece(owner, start, min(hi, start + max(1, step)) if hi > lo else hi,
                                j % slots, j // slots, x == len(cuts) - 1))
    return pieces


class Ring:
    """The local staging ring of one (workspace, shape, knobs): ``slots`` buffers of
    ``slot_rows x n`` elements, the ``ready``/``free`` words, the worker tasks, and the
    per-call stamps (ready time per piece, the GEMMs' end) and stall counters for ``stats``."""

    def __init__(self, ws: symm.Workspace, bounds, slot_rows: int, n: int, kn: SmWorkersKnobs):
        rank, world_size = ws.rank, ws.world_size
        dev, dtype = ws.spec.device, ws.spec.dtype
        self.pieces = ring_pieces(rank, world_size, bounds, kn.chunk_rows, kn.slots)
        piece_rows = max([p.hi - p.lo for p in self.pieces] + [1])
        self.slot_elems = -(-piece_rows * n // 8) * 8          # 16-byte aligned slots
        self.n = n
        self.buffer = torch.empty(kn.slots * self.slot_elems, dtype=dtype, device=dev)
        self.words = torch.zeros(2 * kn.slots, dtype=torch.int32, device=dev)
        self.ready, self.free = self.words[:kn.slots], self.words[kn.slots:]
        self.stamps = torch.zeros(len(self.pieces) + 1, dtype=torch.int64, device=dev)
        self.stalls = torch.zeros(2, dtype=torch.int64, device=dev)
        elem = self.buffer.element_size()
        tasks = []
        per_owner = {o: sum(q.owner == o for q in self.pieces) for o in {q.owner for q in self.pieces}}
        for j, p in enumerate(self.pieces):
            lo, _ = bounds[p.owner]
            inbox = ws.data(p.owner, (slot_rows, n), offset=rank * slot_rows * n)
            # the owner's READY covers all its pieces: with several, each carries it and a join
            # counter (after the pieces' own, one per owner), and the piece completing last publishes it
            several = per_owner[p.owner] > 1
            tasks.append(Task(src=_addr(self.slot(p.slot)), dst=_addr(inbox) + (p.lo - lo) * n * elem,
                              numel=(p.hi - p.lo) * n, wait=_addr(self.ready) + 4 * p.slot, wait_const=p.use + 1,
                              what=WAIT_SLOT_READY, peer=p.owner, chunk=j,
                              pub1=_addr(self.free) + 4 * p.slot, pub1_const=p.use + 1,
                              pub2=_flag_addr(ws, "READY", p.owner, rank) if p.last or several else 0, pub2_gen=1,
                              join=len(self.pieces) + p.owner if several else -1,
                              join_n=per_owner[p.owner] if several else 0))
        self.tasks = tasks
        self.own_rows = slice(*bounds[rank])
        # this rank's inbox slots in rank order (views of the rows it owns); its own is written directly
        self.sources = [ws.data(rank, (slot_rows, n), offset=src * slot_rows * n)[: bounds[rank][1] - bounds[rank][0]]
                        for src in range(world_size)]
        self.warmed: set = set()   # operand layouts whose producer kernels are loaded (:meth:`warm_up`)

    def warm_up(self, ws: symm.Workspace, a: torch.Tensor, b: torch.Tensor) -> None:
        """Load every kernel the producer launches while the workers spin, before they are
        launched: once per ring and per operand layout (the call's first of a shape), on the
        current stream.  Why: CUDA loads a module at its kernel's first launch (lazy loading,
        the default since CUDA 12; a Triton kernel's module likewise, at its first launch, not
        when compiled), and a load may wait for the device's running work -- the worker CTAs,
        which spin on ``ready`` words only the producer's kernels set: the first gemm_rs call
        timed out in the bed (chunk 0 never produced).  So this issues the producer's own
        launches with values that change nothing: the credit wait with use 0 (returns at once),
        the READY kernel writing ready[0] = 0 (the words are 0 between calls), the stamp, and
        each distinct piece GEMM (cuBLAS picks its kernel by shape, strides, alignment, dtype)
        and the own rows' GEMM with the call's operand views into their real outputs (the
        slots, this rank's own inbox slot: nobody reads them before this call writes them).
        Skipped while a CUDA graph is captured (nothing runs then; this stays to do)."""
        layout = (tuple(a.stride()), tuple(b.stride()), a.data_ptr() % 256, b.data_ptr() % 256)
        if layout in self.warmed:   # every call after the first: one set lookup
            return
        from tpfuse.kernels.sm_workers import slot_acquire_kernel, slot_ready_kernel

        dev = a.device
        if dev.type == "cuda" and torch.cuda.is_current_stream_capturing():
            return
        asm = _cuda(dev)
        if not self.warmed:
            _launch(slot_acquire_kernel, (1,), self.free, 0, 0, ws.error, self.stalls, _bound(dev), ws.rank, 0, 0,
                    WAIT_SLOT_FREE, USE_ASM=asm)
            _launch(slot_ready_kernel, (1,), self.ready, 0, -1, self.stamps, 0, ws.error, USE_ASM=asm)
            _stamp(self.stamps, len(self.pieces), dev)
        elem = a.element_size()
        seen = set()
        for p in self.pieces:
            rows = p.hi - p.lo
            out = self.slot(p.slot)[:rows * self.n].view(rows, self.n)
            key = (rows, (a.data_ptr() + p.lo * a.stride(0) * elem) % 256, out.data_ptr() % 256)
            if key not in seen:
                seen.add(key)
                torch.matmul(a[p.lo:p.hi], b, out=out)
        torch.matmul(a[self.own_rows], b, out=self.sources[ws.rank])
        self.warmed.add(layout)

    def slot(self, s: int) -> torch.Tensor:
        return self.buffer[s * self.slot_elems:(s + 1) * self.slot_elems]

    def produce(self, ws: symm.Workspace, j: int, a: torch.Tensor, b: torch.Tensor) -> None:
        """Piece j on the current stream: wait for its slot's credit, GEMM into it, READY."""
        from tpfuse.kernels.sm_workers import slot_acquire_kernel, slot_ready_kernel

        p = self.pieces[j]
        dev = a.device
        if p.use > 0:
            _launch(slot_acquire_kernel, (1,), self.free, p.slot, p.use, ws.error, self.stalls, _bound(dev),
                    ws.rank, p.owner, j, WAIT_SLOT_FREE, USE_ASM=_cuda(dev))
        rows = p.hi - p.lo
        out = self.slot(p.slot)[:rows * self.n].view(rows, self.n)
        with timeline.span("gemm", f"GEMM piece {j} -> owner {p.owner}", device=dev, chunk=j):
            torch.matmul(a[p.lo:p.hi], b, out=out)
        _launch(slot_ready_kernel, (1,), self.ready, p.slot, p.use, self.stamps, j, ws.error, USE_ASM=_cuda(dev))


def _ring(ws: symm.Workspace, bounds, slot_rows: int, n: int, kn: SmWorkersKnobs) -> tuple[Ring, Launch]:
    key = ("ring", tuple(bounds), slot_rows, n, kn.slots, kn.chunk_rows)
    ring = _state(ws, key, lambda: Ring(ws, bounds, slot_rows, n, kn))
    return ring, _launch_tables(ws, key, lambda: ring.tasks)


def push_partials(a: torch.Tensor, b: torch.Tensor, ws: symm.Workspace, bounds: list[tuple[int, int]],
                  slot_rows: int, kn: SmWorkersKnobs, stats: dict | None = None) -> list[torch.Tensor]:
    """Phase 1 of gemm_rs/gemm_ar (after ``ws.begin``): every peer owner's rows through the
    ring into its inbox slot for this rank (the owner's READY[rank] after its last piece), this
    rank's own rows straight into its own inbox.  Returns this rank's inbox slots in rank order.

    On CUDA one worker launch on the side stream covers every piece, issued before the
    producer's GEMMs; on a CPU device (the interpreter: kernels run one after another, so a
    worker launch could not wait for a GEMM issued after it) each piece's worker launch follows
    its GEMM -- the same kernels, words and credits, serialized.  The first call of a ring and
    operand layout first launches the producer's kernels once (:meth:`Ring.warm_up`), so that
    none of them is a first launch (a module load) while the workers spin."""
    rank, n = ws.rank, b.shape[1]
    dev = a.device
    ring, launch = _ring(ws, bounds, slot_rows, n, kn)
    ring.warm_up(ws, a, b)   # first call of a shape/layout only: the producer's kernels loaded
    task_stats = _new_stats(len(launch.tasks), dev) if stats is not None else None
    if stats is not None:
        ring.stalls.zero_()
    concurrent = dev.type == "cuda"
    if concurrent:
        _side_waits_main(ws)
        with _side(ws):
            with timeline.span("copy", f"{kn.comm_sms} workers push {len(launch.tasks)} pieces", device=dev):
                launch_workers(ws, launch, kn, stats=task_stats)
    for j in range(len(ring.pieces)):
        ring.produce(ws, j, a, b)
        if not concurrent:
            launch_workers(ws, launch, kn, task_lo=j, task_hi=j + 1, stats=task_stats)
    if stats is not None:
        _stamp(ring.stamps, len(ring.pieces), dev)
    with timeline.span("gemm", f"GEMM own rows {rank}", device=dev, chunk=rank):
        torch.matmul(a[ring.own_rows], b, out=ring.sources[rank])
    _main_waits_side(ws)
    ring.words.zero_()   # after the workers: the next call's uses count from 0
    if stats is not None:
        stats.update(summarize(launch.tasks, task_stats, kn, elem=a.element_size(),
                               gemm_end_ns=ring.stamps[-1], ready_ns=ring.stamps[:-1], stalls=ring.stalls))
    return ring.sources


def gemm_rs(a: torch.Tensor, b: torch.Tensor, ctx: GroupContext, *, knobs: SmWorkersKnobs | None = None,
            stats: dict | None = None) -> torch.Tensor:
    m, n, k = a.shape[0], b.shape[1], a.shape[1]
    world_size = ctx.world_size
    if world_size == 1 or m * n * k == 0:
        return copy_engine.gemm_rs(a, b, ctx)
    kn = _knobs(knobs, world_size, a.device)
    _check_stats(stats)
    shard = m // world_size
    c_shard = new_output((shard, n), dtype=a.dtype, device=a.device)
    ws = symm.get_workspace(ctx, "gemm_rs", a.dtype, a.device, world_size * shard * n * a.element_size())
    peers = steps.peers(ctx.rank, world_size)
    breadcrumb("sm_workers gemm_rs: producing partials into the ring")
    ws.begin(ws.incoming("DONE", peers))
    bounds = [(r * shard, (r + 1) * shard) for r in range(world_size)]
    sources = push_partials(a, b, ws, bounds, shard, kn, stats)
    steps.reduce_inbox(ws, ("rs", shard, n), peers, sources, c_shard)   # NaN when broken
    ws.signal(ws.outgoing("DONE", peers))
    return c_shard


# --------------------------------------------------------------------------------------------
# gemm_ar
# --------------------------------------------------------------------------------------------
def gather_tasks(ws: symm.Workspace, bounds, gathered, n: int) -> list[Task]:
    """Pull tasks of gemm_ar's phase 2: peer p's reduced chunk (its gather slot) -> rows of c
    (relative to c's base), after READY2[p] >= gen."""
    rank, world_size = ws.rank, ws.world_size
    elem = torch.empty((), dtype=ws.spec.dtype).element_size()
    tasks = []
    for p in steps.peers(rank, world_size):
        lo, hi = bounds[p]
        tasks.append(Task(src=_addr(gathered(p)), dst=lo * n * elem, numel=(hi - lo) * n,
                          wait=_flag_addr(ws, "READY2", rank, p), wait_gen=1, what=symm.WAIT_READY2, peer=p, chunk=p))
    return tasks


def gemm_ar(a: torch.Tensor, b: torch.Tensor, ctx: GroupContext, *, knobs: SmWorkersKnobs | None = None,
            stats: dict | None = None) -> torch.Tensor:
    m, n, k = a.shape[0], b.shape[1], a.shape[1]
    world_size, rank = ctx.world_size, ctx.rank
    if world_size == 1 or m * n * k == 0 or copy_engine.ar_mode(m, n, a.element_size()) == "one_shot":
        # small outputs: every rank reads every partial in place (nothing for workers to queue)
        return copy_engine.gemm_ar(a, b, ctx)
    kn = _knobs(knobs, world_size, a.device)
    _check_stats(stats)
    bounds = steps.row_bounds(m, world_size)
    slot_rows = -(-m // world_size)
    ws = steps.two_shot_workspace(ctx, a.dtype, a.device, slot_rows * n)   # copy_engine's layout and credits
    gather_at = steps.two_shot_gather_offset(ws)
    peers = steps.peers(rank, world_size)
    c = new_output((m, n), dtype=a.dtype, device=a.device)
    views = steps.cached(ws, ("sm_workers ar2 gathered", m, n), lambda: [
        ws.data(owner, (slot_rows, n), offset=gather_at)[: hi - lo] for owner, (lo, hi) in enumerate(bounds)])

    breadcrumb("sm_workers gemm_ar: producing partials into the ring")
    ws.begin(ws.incoming("DONE", peers))
    sources = push_partials(a, b, ws, bounds, slot_rows, kn, stats)
    ar_gather(ws, kn, peers, sources, bounds, views.__getitem__, c)
    steps.finish(ws, c)   # NaN when broken: the workers copy whatever a broken peer left
    return c


def ar_gather(ws: symm.Workspace, kn: SmWorkersKnobs, peers: list[int], sources: list[torch.Tensor], bounds,
              gathered, c: torch.Tensor) -> None:
    """Phase 2 of gemm_ar: once every peer pulled the last call's reduced chunk (DONE2, lag 1),
    reduce this rank's inbox into its gather slot, free the inbox (DONE), announce the chunk
    (READY2); the workers pull every peer's reduced chunk into ``c``, then DONE2 to the peers."""
    rank, n = ws.rank, c.shape[1]
    ws.wait(ws.incoming("DONE2", peers), symm.WAIT_CREDIT2, lag=1)
    mine = gathered(rank)
    steps.reduce_inbox(ws, ("ar2",) + tuple(c.shape), peers, sources, mine)
    ws.signal(ws.outgoing(("DONE", "READY2"), peers))   # free the inbox, announce the chunk: one launch
    lo, hi = bounds[rank]
    c[lo:hi].copy_(mine)
    launch = _launch_tables(ws, ("gather", tuple(bounds), n), lambda: gather_tasks(ws, bounds, gathered, n))
    _side_waits_main(ws)
    with _side(ws):
        with timeline.span("copy", f"{kn.comm_sms} workers pull {len(launch.tasks)} reduced chunks", device=c.device):
            launch_workers(ws, launch, kn, dst_base=_addr(c))
        ws.signal(ws.outgoing("DONE2", peers))
    _main_waits_side(ws, c)


# --------------------------------------------------------------------------------------------
# the worker kernel alone (``tpfuse bench comm``)
# --------------------------------------------------------------------------------------------
def make_copy(src: torch.Tensor, dst: torch.Tensor, chunk_bytes: int, knobs: SmWorkersKnobs):
    """A callable that enqueues ``dst <- src`` by the worker kernel on ``dst``'s device (a pull,
    as ag_gemm's workers make; ``src`` may be a peer GPU's memory with peer access on): tasks of
    ``chunk_bytes`` (the communication chunk), ``knobs.comm_sms`` CTAs, ``knobs.block_bytes`` in
    flight per CTA, no waits or flags.  ``src``, ``dst``: contiguous vectors of one dtype
    (1, 2 or 4 bytes per element) and size."""
    from tpfuse.kernels.sm_workers import worker_kernel

    if src.shape != dst.shape or src.dtype != dst.dtype or src.dim() != 1 or not (
            src.is_contiguous() and dst.is_contiguous()) or src.element_size() not in (1, 2, 4):
        raise ValueError(f"make_copy: src and dst must be contiguous vectors of one shape and a 1, 2 or 4-byte dtype, "
                         f"got {src.dtype} {tuple(src.shape)} and {dst.dtype} {tuple(dst.shape)}")
    if chunk_bytes < 1:
        raise ValueError(f"make_copy: chunk_bytes={chunk_bytes} must be >= 1")
    elem = src.element_size()
    per = max(1, chunk_bytes // elem)
    total = src.numel()
    tasks = [Task(src=src.data_ptr() + i * elem, dst=dst.data_ptr() + i * elem, numel=min(per, total - i))
             for i in range(0, total, per)]
    device = dst.device
    table = torch.tensor([t.row() for t in tasks] or [Task(0, 0, 0).row()], dtype=torch.int64, device=device)
    counters = torch.zeros(max(1, len(tasks)), dtype=torch.int32, device=device)
    words = torch.zeros(1 + symm.ERROR_WORDS + MAX_COMM_SMS, dtype=torch.int32, device=device)
    e = symm.ERROR_WORDS
    gen, error, scratch = words[:1], words[1:1 + e], words[1 + e:]   # error: no mirror (its address word is 0)
    vec = 16 // elem if all(t.src % 16 == 0 and t.dst % 16 == 0 for t in tasks) else 1
    cuda = _cuda(device)

    def run() -> None:
        with torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext():
            worker_kernel[(knobs.comm_sms,)](table, 0, len(tasks), 0, gen, counters, error, counters, scratch,
                                             _bound(device), 0, ELEM=8 * elem, BLOCK=knobs.block_bytes // elem,
                                             VEC=vec, USE_ASM=cuda, STATS=False,
                                             num_warps=_NUM_WARPS if device.type == "cuda" else 1)

    return run


# --------------------------------------------------------------------------------------------
# observability
# --------------------------------------------------------------------------------------------
def summarize(tasks, task_stats: torch.Tensor, kn: SmWorkersKnobs, *, elem: int, gemm_end_ns=None,
              ready_ns: torch.Tensor | None = None, stalls: torch.Tensor | None = None,
              programs: int | None = None) -> dict:
    """What one call's workers did (synchronizes), from the kernels' %globaltimer stamps (all
    zero without inline PTX):

    ``chunks``: per task, its chunk, peer, bytes, ``wait_ns`` (its wait began -> the first
    worker CTA passed it), ``latency_ns`` (issue -> completion: the first CTA's loads -> the
    last CTA's stores and count), ``waited_ctas`` (CTAs whose wait found the flag not there);
    all over the task's participating CTAs only, min(comm_sms, its blocks of ``block_bytes``):
    the others skip it (tpfuse/kernels/sm_workers.py), so ``waited_ctas`` is at most that, and
    a participant may reach the wait sooner, having skipped the tasks between;
    ``max_bytes_in_flight``: the most bytes of tasks in progress at once, at most what the
    workers can hold (``comm_sms x block_bytes``, also given as ``bytes_in_flight_bound``);
    ``producer_stalls`` / ``producer_stall_ns`` (RS, AR): the producer's credit waits that
    found no FREE slot, and their time; ``max_ready_queue_depth`` (RS, AR): the most pieces
    READY and not yet taken by a worker; ``bytes_outstanding_at_gemm_end``: bytes of tasks
    not complete when the (last) GEMM ended; ``comm_sms``, ``slots``, ``block_bytes``,
    ``gemm_programs`` (AG)."""
    from tpfuse.kernels import sm_workers as K

    rows = task_stats.tolist() if task_stats is not None else [[0, 0, 0, 0] for _ in tasks]
    chunks, events = [], []
    for t, r in zip(tasks, rows):
        start, issue, end = r[K.S_WAIT_START.value], r[K.S_COPY_START.value], r[K.S_COPY_END.value]
        issue = issue if issue < 2**62 else end
        start = start if start < 2**62 else issue
        nbytes = t.numel * elem
        chunks.append(dict(chunk=t.chunk, peer=t.peer, bytes=nbytes, wait_ns=issue - start, latency_ns=end - issue,
                           waited_ctas=r[K.S_WAITED.value], issue_ns=issue, end_ns=end))
        events += [(issue, 1, nbytes), (end, 0, -nbytes)]
    bound = kn.comm_sms * kn.block_bytes
    in_flight = peak = 0
    for _, _, delta in sorted(events):   # ends before starts at one instant
        in_flight += delta
        peak = max(peak, in_flight)
    out = dict(comm_sms=kn.comm_sms, slots=kn.slots, block_bytes=kn.block_bytes, chunks=chunks,
               bytes_in_flight_bound=bound, max_bytes_in_flight=min(bound, peak))
    if programs is not None:
        out["gemm_programs"] = programs
    if gemm_end_ns is not None:
        end = int(gemm_end_ns)
        out["bytes_outstanding_at_gemm_end"] = sum(c["bytes"] for c in chunks if c["end_ns"] > end)
    if stalls is not None:
        count, ns = stalls.tolist()
        out["producer_stalls"], out["producer_stall_ns"] = count, ns
    if ready_ns is not None:
        ready = ready_ns.tolist()
        queue = [(ready[j], 1) for j in range(len(chunks))] + [(c["issue_ns"], -1) for c in chunks]
        depth = deepest = 0
        for _, delta in sorted(queue, key=lambda e: (e[0], e[1])):   # taken before added at one instant
            depth += delta
            deepest = max(deepest, depth)
        out["max_ready_queue_depth"] = deepest
    return out


# --------------------------------------------------------------------------------------------
# the simulator's model of this file (tpfuse.model.simulate runs it)
# --------------------------------------------------------------------------------------------
def _model_knobs(hw, world_size: int) -> SmWorkersKnobs:
    """The knobs a call runs with on ``hw`` (:func:`default_knobs`; one process per GPU)."""
    return default_knobs(world_size, hw.sm_count)


def model_gemm_programs(hw, world_size: int) -> int:
    """The AG GEMM's grid the simulator replays: :func:`gemm_programs` with the default knobs."""
    return gemm_programs(hw.sm_count, world_size, _model_knobs(hw, world_size).comm_sms)


def _schedule(g, c) -> None:
    """Workers as a resource: every chunk they move costs ``cost.worker_transfer_time_ms`` of
    (chunk bytes, ``comm_sms`` workers, ``block_bytes`` in flight each) on the rank's comm
    engine, in task order; the GEMMs beside them get the SMs the workers leave."""
    kn = _model_knobs(c.hw, c.w)

    def move(nbytes: float) -> float:
        return model_cost.worker_transfer_time_ms(nbytes, c.hw, workers=kn.comm_sms, in_flight_bytes=kn.block_bytes)

    def staged(g, c, bounds):
        return model_steps.staged_partials(g, c, bounds, move=move, slots=kn.slots, chunk_rows=kn.chunk_rows,
                                           producer_sms=max(1, c.hw.sm_count - kn.comm_sms))

    if c.op == "ag_gemm":
        model_steps.pull_pieces_into_one_gemm(g, c, move=move, workers=True)
    elif c.op == "gemm_rs":
        model_steps.reduce_scatter(g, c, staged, done_in_reduce=False)
    elif copy_engine.ar_one_shot(c.m, c.n, c.elt):
        model_steps.one_shot_all_reduce(g, c)      # copy_engine's one-shot, as gemm_ar runs it
    else:
        model_steps.two_shot_all_reduce(g, c, staged, move=move, workers=True)


# chunks as copy_engine: one per rank (the default chunk_rows=None); gemm_ar one-shot: the whole partial
SCHEDULE = Schedule(_schedule, kind="pipeline", num_chunks=copy_engine.SCHEDULE.num_chunks, sm_budget=model_gemm_programs,
                    tile_m=TILE_M)
