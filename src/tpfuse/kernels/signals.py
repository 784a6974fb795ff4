"""Device-side signal primitives: acquire loads, bounded waits, release publishes.

Protocol (DESIGN.md §3): a signal is an int32 word that carries a *generation* (the call
counter). A consumer waits until ``signal >= generation`` (acquire, system scope); a producer
publishes ``signal = generation`` (release, system scope). Nothing is zeroed between calls.

Two variants, chosen by the ``USE_ASM`` constexpr:

* ``USE_ASM=True`` (CUDA): ``ld.global.acquire.sys.b32`` through inline PTX and a wall-clock
  bound read from ``%globaltimer`` (nanoseconds). Both were seen working on the H200 of this
  project (DESIGN.md §6).
* ``USE_ASM=False`` (``TRITON_INTERPRET=1`` and any backend without inline PTX): the acquire
  load is ``atomic_add(ptr, 0, sem="acquire", scope="sys")`` and the bound is a spin count,
  since the interpreter runs atomics but not inline asm.

Error word: int32[ERROR_WORDS], one layout for every wait of the project, defined in
``abi.py`` (ERR_*). The first waiter that times out wins it through a CAS on word ERR_STATUS
and fills in the record (:func:`record_error`), which it also copies to the host-visible mirror
whose address the word holds (ERR_MIRROR), so the host can read it without synchronizing. A
set word means "broken": :func:`wait_geq` returns at once when it finds it set.
"""
import triton
import triton.language as tl

from . import abi

# the error word's layout and the handoff bit are shared with the host side (abi.py)
ERROR_WORDS = abi.ERROR_WORDS
ERR_OK = abi.ERR_OK
ERR_WAIT_TIMEOUT = abi.ERR_WAIT_TIMEOUT


@triton.jit
def ld_acquire_sys(ptr, USE_ASM: tl.constexpr):
    """Acquire load of one int32 at system scope (orders every later read of this thread)."""
    if USE_ASM:
        val = tl.inline_asm_elementwise(
            "ld.global.acquire.sys.b32 $0, [$1];", "=r,l", [ptr],
            dtype=tl.int32, is_pure=False, pack=1)
    else:
        val = tl.atomic_add(ptr, 0, sem="acquire", scope="sys")
    return val


@triton.jit
def now_ns(USE_ASM: tl.constexpr):
    """%globaltimer in ns with USE_ASM, else 0 (callers then bound by spin count)."""
    if USE_ASM:
        t = tl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l", [],
                                      dtype=tl.int64, is_pure=False, pack=1)
    else:
        t = tl.full((), 0, tl.int64)
    return t


@triton.jit
def wait_geq(flag_ptr, target, timeout, err_ptr, USE_ASM: tl.constexpr):
    """Spin until ``*flag_ptr >= target``; bounded.

    ``timeout`` is nanoseconds with USE_ASM (read off %globaltimer) and a spin count without.
    A flag not yet there is re-read only after a look at the error word: a wait that finds it
    set (an earlier timeout broke the workspace) returns at once instead of spinning, and one
    timeout ends every waiter quickly. Returns ``(status, last_seen)``: status 0 when the
    flag reached ``target``, 1 on timeout, 2 when stopped by someone else's error.
    """
    val = ld_acquire_sys(flag_ptr, USE_ASM)
    status = tl.full((), 0, tl.int32)
    start = now_ns(USE_ASM)
    spins = tl.full((), 0, tl.int64)
    while (val < target) & (status == 0):
        if USE_ASM:
            elapsed = now_ns(USE_ASM) - start
        else:
            elapsed = spins
        if elapsed > timeout:
            status = tl.full((), 1, tl.int32)
        else:
            if tl.load(err_ptr, volatile=True) != 0:
                status = tl.full((), 2, tl.int32)
            val = ld_acquire_sys(flag_ptr, USE_ASM)
        spins += 1
    return status, val


ERR_STATUS = tl.constexpr(abi.ERR_STATUS)
ERR_WHAT = tl.constexpr(abi.ERR_WHAT)
ERR_PEER = tl.constexpr(abi.ERR_PEER)
ERR_GENERATION = tl.constexpr(abi.ERR_GENERATION)
ERR_SEEN = tl.constexpr(abi.ERR_SEEN)
ERR_RANK = tl.constexpr(abi.ERR_RANK)
ERR_CHUNK = tl.constexpr(abi.ERR_CHUNK)
ERR_TILE = tl.constexpr(abi.ERR_TILE)
ERR_PROGRAM = tl.constexpr(abi.ERR_PROGRAM)
ERR_MIRROR = tl.constexpr(abi.ERR_MIRROR)
WAIT_GEMM_CHUNK = tl.constexpr(abi.WAIT_GEMM_CHUNK)


@triton.jit
def record_error(err_ptr, what, peer, generation, last_seen, rank, chunk, tile, program):
    """First timeout wins the error word (a CAS on its status, device memory); later ones leave
    it as it is. The winner fills in the record (abi.py's layout) and, when the word carries the
    address of a host-visible mirror (words ERR_MIRROR, int64; 0 = none), copies the record
    there with plain stores, then the status by a system-scope release, so a host
    thread that sees the mirror's status set reads a complete record without a device sync."""
    old = tl.atomic_cas(err_ptr + ERR_STATUS, 0, 1, sem="acq_rel", scope="sys")
    if old == 0:
        tl.store(err_ptr + ERR_WHAT, what)
        tl.store(err_ptr + ERR_PEER, peer)
        tl.store(err_ptr + ERR_GENERATION, generation)
        tl.store(err_ptr + ERR_SEEN, last_seen)
        tl.store(err_ptr + ERR_RANK, rank)
        tl.store(err_ptr + ERR_CHUNK, chunk)
        tl.store(err_ptr + ERR_TILE, tile)
        tl.store(err_ptr + ERR_PROGRAM, program)
        mirror = tl.load((err_ptr + ERR_MIRROR).to(tl.pointer_type(tl.int64)), volatile=True)
        if mirror != 0:
            host = mirror.to(tl.pointer_type(tl.int32))
            tl.store(host + ERR_WHAT, what)
            tl.store(host + ERR_PEER, peer)
            tl.store(host + ERR_GENERATION, generation)
            tl.store(host + ERR_SEEN, last_seen)
            tl.store(host + ERR_RANK, rank)
            tl.store(host + ERR_CHUNK, chunk)
            tl.store(host + ERR_TILE, tile)
            tl.store(host + ERR_PROGRAM, program)
            # release at system scope: the record's stores are visible before the status
            tl.atomic_xchg(host + ERR_STATUS, 1, sem="release", scope="sys")


@triton.jit
def record_timeout(err_ptr, tile, chunk, generation, last_seen):
    """The GEMM wait hook's timeout (tile ``tile`` waited for chunk ``chunk``): :func:`record_error`
    with what = WAIT_GEMM_CHUNK; the peer and rank are not known in the kernel (-1; the host
    that owns the word knows its rank)."""
    record_error(err_ptr, WAIT_GEMM_CHUNK, -1, generation, last_seen, -1, chunk, tile, tl.program_id(0))


@triton.jit
def publish(flag_ptr, generation):
    """``*flag_ptr = generation`` with release semantics at system scope."""
    tl.atomic_xchg(flag_ptr, generation, sem="release", scope="sys")


@triton.jit
def reset_and_publish(counter_ptr, signal_slot, generation, publish_it):
    """A chunk whose count is complete (and acquired): reset its counter to 0 for the next
    launch and, if ``publish_it``, publish ``generation`` to the int32 whose address is stored at
    ``signal_slot``."""
    tl.atomic_xchg(counter_ptr, 0, sem="relaxed", scope="gpu")
    if publish_it:
        publish(tl.load(signal_slot).to(tl.pointer_type(tl.int32)), generation)


@triton.jit
def bulk_writes_done():
    """Wait until this thread's TMA (bulk async) stores have written global memory, then order
    them (async proxy) before this thread's later generic-proxy accesses, e.g. a release."""
    tl.inline_asm_elementwise(
        "cp.async.bulk.wait_group 0;\n\tfence.proxy.async.global;\n\tmov.u32 $0, 0;", "=r", [],
        dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def cta_barrier(USE_ASM: tl.constexpr):
    """Every thread of the CTA waits here, and its memory accesses before are ordered before
    every thread's accesses after (``bar.sync``). With USE_ASM it is inline PTX: Triton 3.6
    does not pipeline the loads of a flattened tile loop (FLATTEN) with a ``tl.debug_barrier``
    in its body."""
    cta_barrier_if(1, USE_ASM)


@triton.jit
def cta_uniform(value, scratch_ptr):
    """``value`` as one thread of the CTA holds it, in every thread: the warps of a CTA spin on a
    flag independently and may leave the spin with different outcomes (one sees the flag just as
    another times out, or sees another program's error); the branches after it hold CTA
    barriers, which every thread must reach.  ``scratch_ptr``: an int32 word of this program's
    own.  (A scalar store is made by one thread; the barrier orders it before every thread's
    load, and the load before the next store.)"""
    tl.store(scratch_ptr, value)
    tl.debug_barrier()
    out = tl.load(scratch_ptr, volatile=True)
    tl.debug_barrier()
    return out


# EPI_COUNT=3 (tpfuse/kernels/gemm.py): a chunk's counter holds its count of stored tiles, plus
# HANDOFF once the chunk's poller has stopped polling it (at most once per launch).
HANDOFF = tl.constexpr(abi.HANDOFF)

# Inline PTX of the EPI_COUNT=3 primitives below. "me": the CTA's last thread (not warp 0, which
# issues the TMA loads and stores), or where the asm works per element, a valid element.
_LAST = ("{\n\t.reg .pred me, done, pub;\n\t.reg .u32 tid, last, seen;\n\t.reg .u64 sig;\n\t"
         "mov.u32 tid, %tid.x;\n\tmov.u32 last, %ntid.x;\n\tsub.u32 last, last, 1;\n\t"
         "setp.eq.u32 me, tid, last;\n\t")
# once ``done`` (the count acquired complete): one fence.acq_rel.sys is both the acquire of that
# count and the system-scope release of what follows; reset the counter at $2 for the next
# launch and, if ``ok`` ($6) != 0 (pub), write generation $5 to the int32 at ``sig`` (its address,
# loaded earlier, alongside the counter's read, so that no round trip is left before the store)
_PUBLISH = ("setp.ne.and.s32 pub, $6, 0, done;\n\t@done fence.acq_rel.sys;\n\t"
            "@done st.relaxed.gpu.global.b32 [$2], 0;\n\t@pub st.relaxed.sys.global.b32 [sig], $5;\n\t")
_RED_IF_ASM = tl.constexpr(_LAST + "setp.ne.and.s32 me, $3, 0, me;\n\t"
                           "@me red.release.gpu.global.add.u32 [$1], $2;\n\tmov.u32 $0, 0;\n\t}")
_POLL_READ_ASM = tl.constexpr(
    _LAST + "setp.ge.and.s32 me, $2, 0, me;\n\tmov.u32 $0, -1;\n\tmov.u64 $1, 0;\n\t"
    "@me ld.global.u64 $1, [$4];\n\t@me ld.relaxed.gpu.global.u32 $0, [$3];\n\t}")
_POLL_ASM = tl.constexpr(
    _LAST + "setp.ge.and.s32 me, $1, 0, me;\n\tmov.u32 $0, $1;\n\tmov.b64 sig, $3;\n\t"
    "setp.eq.and.u32 done, $7, $4, me;\n\t" + _PUBLISH + "@done mov.u32 $0, -1;\n\t}")
# the handoff needs no release and returns nothing: a relaxed RMW still carries every earlier
# count's release on to the read that finds the count complete (PTX observation order runs
# through atomic RMWs)
_HANDOFF_ASM = tl.constexpr(
    _LAST + "setp.ge.and.s32 me, $1, 0, me;\n\t"
    f"@me red.relaxed.gpu.global.add.u32 [$2], {HANDOFF.value};\n\tmov.u32 $0, 0;\n\t}}")
_END_ASM = tl.constexpr(
    _LAST + "setp.ne.s32 me, $1, 0;\n\t@me ld.global.u64 sig, [$3];\n\t"
    "@me ld.relaxed.gpu.global.u32 seen, [$2];\n\t"
    "setp.eq.and.u32 done, seen, $4, me;\n\t" + _PUBLISH + "mov.u32 $0, 0;\n\t}")


@triton.jit
def count_release_red(counter_ptr, n, USE_ASM: tl.constexpr):
    """Add ``n`` to ``*counter_ptr`` with release semantics at GPU scope, returning nothing.

    With USE_ASM it is the CTA's last thread's ``red.release.gpu``: no register waits for the
    round trip. A returning atomic does not do: inside the tile loop ptxas waits for its result
    register at the loop's next iteration, whenever the result is read (on the H200 ~1 us per
    tile, most of the epilogue hook's cost; a probe of 2026-11-30, in git history)."""
    count_release_red_if(1, counter_ptr, n, USE_ASM)


@triton.jit
def count_release_red_if(valid, counter_ptr, n, USE_ASM: tl.constexpr):
    """:func:`count_release_red` where ``valid`` != 0, with the condition inside the PTX (no
    ``if``: see ``_count_in_loop`` in tpfuse/kernels/gemm.py)."""
    if USE_ASM:
        tl.inline_asm_elementwise(_RED_IF_ASM, "=r,l,r,r", [counter_ptr, n, valid], dtype=tl.int32,
                                  is_pure=False, pack=1)
    else:
        tl.atomic_add(counter_ptr, tl.where(valid != 0, n, 0), sem="release", scope="gpu")


@triton.jit
def cta_barrier_if(valid, USE_ASM: tl.constexpr):
    """:func:`cta_barrier` where ``valid`` != 0; ``valid`` must be the same in every thread of
    the CTA (a predicated ``bar.sync``)."""
    if USE_ASM:
        tl.inline_asm_elementwise("{\n\t.reg .pred p;\n\tsetp.ne.s32 p, $1, 0;\n\t@p bar.sync 0;\n\t"
                                  "mov.u32 $0, 0;\n\t}", "=r,r", [valid], dtype=tl.int32,
                                  is_pure=False, pack=1)
    else:
        tl.debug_barrier()


@triton.jit
def poll_read(q, counter_ptr, signal_slot, USE_ASM: tl.constexpr):
    """Read the counter of chunk ``q`` (``-1``: none; then -1) and the address of its signal
    (stored at ``signal_slot``) for :func:`poll_publish`: issued early, the two round trips
    overlap each other and what the program does before that. Returns ``(seen, signal
    address)``. With USE_ASM only the CTA's last thread reads (the others get -1 and 0)."""
    if USE_ASM:
        seen, sig = tl.inline_asm_elementwise(
            _POLL_READ_ASM, "=r,=l,r,l,l", [q, counter_ptr.to(tl.int64), signal_slot.to(tl.int64)],
            dtype=(tl.int32, tl.int64), is_pure=False, pack=1)
    else:
        seen = tl.full((), -1, tl.int32)
        sig = tl.full((), 0, tl.int64)
        if q >= 0:
            sig = tl.load(signal_slot)
            seen = tl.atomic_add(counter_ptr, 0, sem="acquire", scope="gpu")
    return seen, sig


@triton.jit
def poll_publish(q, seen, sig, counter_ptr, target, generation, ok, USE_ASM: tl.constexpr):
    """Chunk ``q`` (``-1``: none) whose counter :func:`poll_read` read as ``seen``: when that is
    ``target`` every tile of the chunk was counted, so (acquire: a fence after the read) reset
    the counter for the next launch and, if ``ok`` != 0, publish ``generation`` (release,
    system scope) to the int32 at address ``sig``. Returns -1 once published, else ``q``.
    With USE_ASM only the CTA's last thread's result counts (the other threads get ``q``
    back: pass it only back in here or to :func:`handoff_red`, never branch on it)."""
    if USE_ASM:
        res = tl.inline_asm_elementwise(
            _POLL_ASM, "=r,r,l,l,r,r,r,r",
            [q, counter_ptr.to(tl.int64), sig, target, generation, ok, seen],
            dtype=tl.int32, is_pure=False, pack=1)
    else:
        res = q
        if q >= 0:
            if seen == target:
                tl.atomic_xchg(counter_ptr, 0, sem="relaxed", scope="gpu")
                if ok != 0:
                    publish(sig.to(tl.pointer_type(tl.int32)), generation)
                res = -1
    return res


@triton.jit
def handoff_red(q, counter_ptr, USE_ASM: tl.constexpr):
    """The poller of chunk ``q`` (``-1``: none) stops polling it: add HANDOFF to its counter
    (GPU scope, relaxed; with USE_ASM from the CTA's last thread, returning nothing). Whoever
    comes later in the counter's coherence order, the chunk's last count or this, reads
    ``target + HANDOFF`` in :func:`publish_handed_off` at its program's end and publishes."""
    if USE_ASM:
        tl.inline_asm_elementwise(_HANDOFF_ASM, "=r,r,l", [q, counter_ptr.to(tl.int64)],
                                  dtype=tl.int32, is_pure=False, pack=1)
    else:
        if q >= 0:
            tl.atomic_add(counter_ptr, HANDOFF, sem="relaxed", scope="gpu")


@triton.jit
def publish_handed_off(counter_ptrs, signal_slots, targets, valid, generation, ok, USE_ASM: tl.constexpr):
    """At a program's end, after its last count and handoff and a CTA barrier: for every chunk
    (vectors, one element per chunk; ``valid`` == 0 skips one) whose counter reads ``target +
    HANDOFF`` -- complete, its poller gone -- acquire, reset the counter and publish as
    :func:`poll_publish` does (with USE_ASM the signal addresses are read beside the counters).
    A chunk may be published twice this way, with the same generation."""
    if USE_ASM:
        tl.inline_asm_elementwise(
            _END_ASM, "=r,r,l,l,r,r,r",
            [valid, counter_ptrs.to(tl.int64), signal_slots.to(tl.int64), targets + HANDOFF, generation, ok],
            dtype=tl.int32, is_pure=False, pack=1)
    else:
        seen = tl.atomic_add(counter_ptrs, 0, mask=valid != 0, sem="acquire", scope="gpu")
        done = (valid != 0) & (seen == targets + HANDOFF)
        tl.atomic_xchg(counter_ptrs, 0, mask=done, sem="relaxed", scope="gpu")
        sig = tl.load(signal_slots, mask=done & (ok != 0), other=0).to(tl.pointer_type(tl.int32))
        tl.atomic_xchg(sig, generation, mask=done & (ok != 0), sem="release", scope="sys")
