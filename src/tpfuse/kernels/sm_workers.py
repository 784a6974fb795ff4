"""Kernels of the ``sm_workers`` strategy (tpfuse/strategies/sm_workers.py): communication
worker CTAs that move chunks over peer pointers, and the one-program flag kernels of its
staging ring.

**Worker kernel.**  A grid of ``comm_sms`` programs (one CTA, so one SM, each) works through a
*task table* in order.  Task t's ``blocks(t) = max(1, ceil(numel[t] / BLOCK))`` blocks are dealt
round-robin over the G programs (G = grid size) starting at program ``first(t)`` = (blocks of
the table's tasks before t) mod G, so consecutive small tasks go to consecutive programs; the
``parts(t) = min(G, blocks(t))`` programs that get a block *participate*, the others skip the
task outright (no wait, no barrier, no count)::

    for task t in [task_lo, task_hi):
        k = (pid - first(t)) mod G;  skip the task unless k < blocks(t)
        wait until *wait[t] >= target(t)         (acquire, system scope; bounded; skipped if wait[t] == 0)
        dst[t][b] = src[t][b] for this program's blocks b = k, k + G, ... (the last one masked)
        CTA barrier; counters[t] += 1           (acq_rel, GPU scope)
        the program that made it parts(t) (the last participant): counters[t] = 0 (for the
            next launch), then *pub1[t] = value1(t)   (release, system scope; skipped if 0),
            then, if the task is in a join group (join[t] >= 0): counters[join[t]] += 1
            (acq_rel, GPU scope) and only the task that makes it join_n[t] resets it and goes on;
            *pub2[t] = value2(t)                  (release, system scope; skipped if 0)

``first(t)`` counts from the table's task 0 whatever ``task_lo``, so a task is dealt alike in
one launch over the table and in a launch of its own (the CPU ring path, one per piece).
Because programs skip tasks, a task's completion no longer implies that the tasks before it
completed (before, every program walked every task, so the last count of task t came after
every program's stores of every earlier task).  What needed that -- gemm_rs/gemm_ar's READY to
an owner after the owner's *last* piece, which covers all its pieces -- is a join group: every
piece of the owner carries the READY as ``pub2`` with one join counter, and READY is published
by whichever piece completes last.  A task that waits for an earlier task's words (a ring
slot's next use waits for ``ready``, which the producer sets after the ``free`` credit of the
use before) still sees them in order: words are published only by complete tasks.  And a
timeout no longer holds back the tasks after it that other programs copy: they complete and
publish while the error word is clear, as a task before the timeout did.

``target`` and the published values are ``const + per_gen * gen`` with ``gen`` the workspace's
generation in device memory (so a CUDA graph replay publishes the generation of the replay),
e.g. a peer's READY flag (``0 + 1 * gen``) or a ring slot's use count (``u + 1 + 0 * gen``).

Memory ordering: the peer data a task reads was published by its owner with a system-scope
release and is read after this program's system-scope acquire of the flag (``wait_geq``).  The
publisher's release is cumulative over every participant's stores: each program's stores
precede its counter increment (the CTA barrier orders the CTA's threads before the one thread
that increments; the increment is a release), and the last incrementer acquires them all
(acq_rel read-modify-write) before its own system-scope release of ``pub1``; a join group's
counter chains the same way over its tasks' last incrementers before ``pub2``.  So one release
makes the whole task (group) *remote visible* (a peer's READY) and the source *reusable* (a
ring slot's FREE word): two words with two readers, written at the point where both hold.

Stripes are 16-byte vectors when the host says every address and length is 16-byte aligned
(``VEC`` elements per vector): the unmasked body of each stripe loads ``BLOCK`` elements per
iteration (the bytes one worker CTA has in flight), and a masked tail copies what is left.

A wait that times out records (what, peer, target, last seen, rank, chunk, program) in the
workspace's error word through ``signals.record_error`` (the first one wins; the record is
copied to the host-visible mirror, so the host learns of it without a sync); the program then
stops, and so, within one spin, does every other wait of the workspace.  A task's wait is made
by its participants only (at least one: every task has a block), so each wait that can time
out has a program to record it; a program that skipped it meets the error word at its own
next wait that finds its flag not yet there, as before.  The error word is read
first: a program that finds it set ("broken", tpfuse/kernels/abi.py) copies nothing, and the
last program of a task publishes nothing once it is set, so the peers time out (and fill NaN)
rather than read what this rank no longer guards.  Every wait is bounded.

**Stats** (``STATS=True``): ``stats[t] = [first wait start, first copy start, last copy end,
waited (0/1 per participant, summed)]`` in ``%globaltimer`` ns (0 without inline PTX), over the
task's ``parts(t)`` participants (before, over all G programs): "waited" is at most parts(t),
and a participant may reach a task's wait earlier than before (it skipped the tasks between).

**Ring kernels** (one program, one warp, on the compute stream): :func:`slot_acquire_kernel`
(the producer waits for a FREE slot: ``free[slot] >= use``, counting stalls and their time) and
:func:`slot_ready_kernel` (``ready[slot] = use + 1`` after the chunk's GEMM, with a time stamp).
Both do nothing once the error word is set.
"""
import triton
import triton.language as tl

from tpfuse.kernels.signals import cta_uniform, ld_acquire_sys, now_ns, record_error, wait_geq

# Columns of the int64 task table (the host side, tpfuse/strategies/sm_workers.py, reads the
# ``.value`` of these: one definition for both sides).
T_SRC = tl.constexpr(0)           # byte address of the source elements
T_DST = tl.constexpr(1)           # byte address of the destination elements
T_NUMEL = tl.constexpr(2)         # elements to copy
T_WAIT = tl.constexpr(3)          # byte address of the int32 flag to wait for (0: no wait)
T_WAIT_CONST = tl.constexpr(4)    # target = const + per_gen * gen
T_WAIT_GEN = tl.constexpr(5)
T_WHAT = tl.constexpr(6)          # the wait's code in the error word (abi.py WAIT_*)
T_PEER = tl.constexpr(7)          # group rank the wait is for (error word)
T_CHUNK = tl.constexpr(8)         # communication chunk (error word ERR_CHUNK, stats)
T_PUB1 = tl.constexpr(9)          # byte address of an int32 published when the task is done (0: none)
T_PUB1_CONST = tl.constexpr(10)
T_PUB1_GEN = tl.constexpr(11)
T_PUB2 = tl.constexpr(12)
T_PUB2_CONST = tl.constexpr(13)
T_PUB2_GEN = tl.constexpr(14)
T_JOIN = tl.constexpr(15)         # index in counters of the task's join group's counter (-1: none, pub2 on its own)
T_JOIN_N = tl.constexpr(16)       # tasks in the join group: the one completing last publishes pub2
TASK_COLUMNS = tl.constexpr(17)

# Columns of the int64 stats table (one row per task)
S_WAIT_START = tl.constexpr(0)    # min over participants: the task's wait began
S_COPY_START = tl.constexpr(1)    # min over participants: the wait was over, loads issued
S_COPY_END = tl.constexpr(2)      # max over participants: the program's stores issued and counted
S_WAITED = tl.constexpr(3)        # participants whose wait found the flag not yet there
STATS_COLUMNS = tl.constexpr(4)


@triton.jit
def _blocks(row_ptr, BLOCK: tl.constexpr):
    """A task's blocks: ceil(numel / BLOCK), at least 1 (a task of 0 elements still has one
    participant, which counts it and publishes its words)."""
    return tl.maximum((tl.load(row_ptr + T_NUMEL) + BLOCK - 1) // BLOCK, 1)


@triton.jit
def _copy_stripe(src, dst, numel, k, num_programs, BLOCK: tl.constexpr, VEC: tl.constexpr):
    """The ``k``-th participant's stripe of ``dst[:numel] = src[:numel]``: blocks k, k + G, ...
    of BLOCK elements, unmasked (vectors of VEC elements) while whole, then the masked tail."""
    whole = numel // BLOCK
    for blk in range(k, whole, num_programs):
        offs = tl.arange(0, BLOCK).to(tl.int64) + blk * BLOCK   # blk: int64 (whole is)
        s = src + offs
        d = dst + offs
        if VEC > 1:   # host-checked: every address and BLOCK are 16-byte multiples
            s = tl.multiple_of(s, 16)
            d = tl.multiple_of(d, 16)
        tl.store(d, tl.load(s))
    if (k == whole % num_programs) & (whole * BLOCK < numel):
        offs = whole.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < numel
        tl.store(dst + offs, tl.load(src + offs, mask=mask), mask=mask)


@triton.jit
def _publish_if(row_ptr, COL: tl.constexpr, gen):
    addr = tl.load(row_ptr + COL)
    if addr != 0:
        value = (tl.load(row_ptr + COL + 1) + tl.load(row_ptr + COL + 2) * gen).to(tl.int32)
        tl.atomic_xchg(addr.to(tl.pointer_type(tl.int32)), value, sem="release", scope="sys")


@triton.jit(do_not_specialize=["task_lo", "task_hi", "dst_base", "timeout", "rank"])
def worker_kernel(tasks_ptr, task_lo, task_hi, dst_base, gen_ptr, counters_ptr, err_ptr, stats_ptr,
                  scratch_ptr, timeout, rank, ELEM: tl.constexpr, BLOCK: tl.constexpr, VEC: tl.constexpr,
                  USE_ASM: tl.constexpr, STATS: tl.constexpr):
    """Tasks ``[task_lo, task_hi)`` of the table (module docstring); destinations are
    ``dst_base`` + the table's (a byte address: the call's fresh output, or 0); elements are
    copied as ELEM-bit integers (bit-exact whatever the dtype).  ``scratch``: one int32 per
    program (signals.cta_uniform).  ``counters``: one int32 per task, then the join groups'."""
    pid = tl.program_id(0)
    num_programs = tl.num_programs(0)
    if ELEM == 16:
        ty = tl.int16
    elif ELEM == 32:
        ty = tl.int32
    else:
        ty = tl.int8
    scratch = scratch_ptr + pid
    gen = tl.load(gen_ptr).to(tl.int64)
    stop = cta_uniform((tl.load(err_ptr, volatile=True) != 0).to(tl.int32), scratch) != 0
    first = tl.full((), 0, tl.int64)   # first(t): the table's blocks before t, mod G
    for u in range(0, task_lo):
        first = (first + _blocks(tasks_ptr + u * TASK_COLUMNS, BLOCK)) % num_programs
    for t in range(task_lo, task_hi):
        row = tasks_ptr + t * TASK_COLUMNS
        blocks = _blocks(row, BLOCK)
        k = (pid + num_programs - first) % num_programs   # this program's place in the dealing
        first = (first + blocks) % num_programs
        if not stop:
            if k < blocks:   # a participant (CTA-uniform: the table is read-only)
                flag = tl.load(row + T_WAIT)
                t_wait = now_ns(USE_ASM)
                status = tl.full((), 0, tl.int32)
                seen = tl.full((), 0, tl.int32)
                target = tl.full((), 0, tl.int32)
                waited = tl.full((), 0, tl.int64)
                if flag != 0:
                    target = (tl.load(row + T_WAIT_CONST) + tl.load(row + T_WAIT_GEN) * gen).to(tl.int32)
                    flag_ptr = flag.to(tl.pointer_type(tl.int32))
                    waited = (ld_acquire_sys(flag_ptr, USE_ASM) < target).to(tl.int64)
                    status, seen = wait_geq(flag_ptr, target, timeout, err_ptr, USE_ASM)
                status = cta_uniform(status, scratch)
                if status == 1:
                    record_error(err_ptr, tl.load(row + T_WHAT).to(tl.int32), tl.load(row + T_PEER).to(tl.int32),
                                 target, seen, rank, tl.load(row + T_CHUNK).to(tl.int32), -1, pid)
                stop = status != 0
                if not stop:
                    t_copy = now_ns(USE_ASM)
                    src = tl.load(row + T_SRC).to(tl.pointer_type(ty))
                    dst = (tl.load(row + T_DST) + dst_base).to(tl.pointer_type(ty))
                    _copy_stripe(src, dst, tl.load(row + T_NUMEL), k, num_programs, BLOCK, VEC)
                    tl.debug_barrier()   # every thread's stores before the count (cumulativity)
                    old = tl.atomic_add(counters_ptr + t, 1, sem="acq_rel", scope="gpu")
                    if old == tl.minimum(blocks, num_programs) - 1:   # the last participant
                        tl.store(counters_ptr + t, 0)
                        if tl.load(err_ptr, volatile=True) == 0:   # broken: publish nothing
                            _publish_if(row, T_PUB1, gen)
                        join = tl.load(row + T_JOIN)
                        group_done = join < 0
                        if join >= 0:   # pub2 once every task of the join group is complete
                            joined = tl.atomic_add(counters_ptr + join, 1, sem="acq_rel", scope="gpu")
                            group_done = joined == tl.load(row + T_JOIN_N) - 1
                            if group_done:
                                tl.store(counters_ptr + join, 0)
                        if group_done:
                            if tl.load(err_ptr, volatile=True) == 0:
                                _publish_if(row, T_PUB2, gen)
                    if STATS:
                        srow = stats_ptr + t * STATS_COLUMNS
                        tl.atomic_min(srow + S_WAIT_START, t_wait, sem="relaxed", scope="gpu")
                        tl.atomic_min(srow + S_COPY_START, t_copy, sem="relaxed", scope="gpu")
                        tl.atomic_max(srow + S_COPY_END, now_ns(USE_ASM), sem="relaxed", scope="gpu")
                        tl.atomic_add(srow + S_WAITED, waited, sem="relaxed", scope="gpu")


@triton.jit(do_not_specialize=["slot", "use", "timeout", "rank", "peer", "chunk", "what"])
def slot_acquire_kernel(free_ptr, slot, use, err_ptr, stall_ptr, timeout, rank, peer, chunk, what,
                        USE_ASM: tl.constexpr):
    """The producer takes ring slot ``slot`` for its ``use``-th use of this call: wait until
    ``free[slot] >= use`` (every earlier use drained by the workers; acquire, system scope,
    bounded).  ``stall = [stalls, stalled ns]`` counts the waits that found it not yet free.
    On timeout: the error word (``what``, ``peer`` = the owner of the chunk waiting, target
    ``use``, ``chunk``, the slot in ERR_TILE).  Returns at once when the error word is set."""
    flag = free_ptr + slot
    if tl.load(err_ptr, volatile=True) == 0:
        seen0 = tl.atomic_add(flag, 0, sem="acquire", scope="sys")
        if seen0 < use:
            start = now_ns(USE_ASM)
            status, seen = wait_geq(flag, use, timeout, err_ptr, USE_ASM)
            tl.atomic_add(stall_ptr, 1, sem="relaxed", scope="gpu")
            tl.atomic_add(stall_ptr + 1, now_ns(USE_ASM) - start, sem="relaxed", scope="gpu")
            if status == 1:
                record_error(err_ptr, what, peer, use, seen, rank, chunk, slot, -1)


@triton.jit(do_not_specialize=["slot", "use", "chunk"])
def slot_ready_kernel(ready_ptr, slot, use, stamp_ptr, chunk, err_ptr, USE_ASM: tl.constexpr):
    """After the chunk's GEMM (stream order): ``stamp[chunk]`` = %globaltimer (the chunk entered
    the ready queue; 0 without inline PTX), then ``ready[slot] = use + 1`` (release, system
    scope); nothing once the error word is set (the workers stop anyway)."""
    tl.store(stamp_ptr + chunk, now_ns(USE_ASM))
    if tl.load(err_ptr, volatile=True) == 0:
        tl.atomic_xchg(ready_ptr + slot, use + 1, sem="release", scope="sys")


@triton.jit(do_not_specialize=["index"])
def stamp_kernel(stamp_ptr, index, USE_ASM: tl.constexpr):
    """``stamp[index]`` = %globaltimer (0 without inline PTX): a point in a stream's order."""
    tl.store(stamp_ptr + index, now_ns(USE_ASM))
