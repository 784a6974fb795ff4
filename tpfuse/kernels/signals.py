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

Error word (int32[ERROR_WORDS], zero = no error), written once by the first program that
times out (first writer wins through a CAS on word 0)::

    [0] status   ERR_WAIT_TIMEOUT
    [1] tile     linear tile id in tile-order space
    [2] chunk    chunk index whose signal never reached the generation
    [3] generation awaited
    [4] last value seen in signal[chunk]
    [5] program id that timed out
"""
import triton
import triton.language as tl

ERROR_WORDS = 8
ERR_OK = 0
ERR_WAIT_TIMEOUT = 1


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
    The spin also stops as soon as another program has written the error word, so one
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


@triton.jit
def record_timeout(err_ptr, tile, chunk, generation, last_seen):
    """First timeout wins the error word; later ones leave it as it is."""
    old = tl.atomic_cas(err_ptr, 0, 1, sem="acq_rel", scope="sys")
    if old == 0:
        tl.store(err_ptr + 1, tile)
        tl.store(err_ptr + 2, chunk)
        tl.store(err_ptr + 3, generation)
        tl.store(err_ptr + 4, last_seen)
        tl.store(err_ptr + 5, tl.program_id(0))


@triton.jit
def publish(flag_ptr, generation):
    """``*flag_ptr = generation`` with release semantics at system scope."""
    tl.atomic_xchg(flag_ptr, generation, sem="release", scope="sys")


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
    if USE_ASM:
        tl.inline_asm_elementwise("bar.sync 0;\n\tmov.u32 $0, 0;", "=r", [], dtype=tl.int32,
                                  is_pure=False, pack=1)
    else:
        tl.debug_barrier()


@triton.jit
def count_release_async(counter_ptr):
    """The CTA's last thread adds 1 to ``*counter_ptr`` (release, GPU scope) and returns the old
    value without waiting for it: the atomic's round trip overlaps whatever the program does
    before it reads the result (:func:`publish_if_last`, a tile later). Other threads get -1.
    Not thread 0: warp 0 issues the TMA loads and stores, and an atomic in flight there held
    them up (H200: ~1.5 us per tile against about half that from the last warp)."""
    return tl.inline_asm_elementwise(
        "{\n\t.reg .pred first;\n\t.reg .u32 tid, last;\n\tmov.u32 tid, %tid.x;\n\t"
        "mov.u32 last, %ntid.x;\n\tsub.u32 last, last, 1;\n\t"
        "setp.eq.u32 first, tid, last;\n\tmov.u32 $0, -1;\n\t"
        "@first atom.release.gpu.global.add.u32 $0, [$1], 1;\n\t}",
        "=r,l", [counter_ptr], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def publish_if_last(counter_ptr, signal_slot, old, last, generation, ok):
    """The CTA's last thread, with ``old`` from its :func:`count_release_async` on ``counter_ptr``: when
    ``old == last`` every other count of the chunk came first, so it acquires them (a fence
    after the atomic: PTX's acquire pattern), resets the counter for the next launch and, if
    ``ok`` != 0, publishes ``generation`` (release, system scope) to the int32 whose address is
    stored at ``signal_slot`` (read only then, so no other thread waits for that load)."""
    return tl.inline_asm_elementwise(
        "{\n\t.reg .pred is_last, do_pub;\n\t.reg .u32 tid, last;\n\t.reg .u64 sig;\n\t"
        "mov.u32 tid, %tid.x;\n\tmov.u32 last, %ntid.x;\n\tsub.u32 last, last, 1;\n\t"
        "setp.eq.u32 is_last, tid, last;\n\t"
        "setp.eq.and.s32 is_last, $3, $4, is_last;\n\t"
        "@is_last fence.acq_rel.gpu;\n\t@is_last st.relaxed.gpu.global.b32 [$1], 0;\n\t"
        "setp.ne.and.s32 do_pub, $6, 0, is_last;\n\t@do_pub ld.global.u64 sig, [$2];\n\t"
        "@do_pub st.release.sys.global.b32 [sig], $5;\n\tmov.u32 $0, 0;\n\t}",
        "=r,l,l,r,r,r,r", [counter_ptr, signal_slot, old, last, generation, ok],
        dtype=tl.int32, is_pure=False, pack=1)
