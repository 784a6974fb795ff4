"""One-program kernels for the symmetric-memory workspace's flags (tpfuse/symm.py), and the
NaN fill of a broken workspace's outputs.

A flag is an int32 word in a symmetric buffer that carries a *generation*: the workspace's call
counter, kept in device memory (``gen_ptr``) so that a CUDA graph replay advances it too.  A
waiter waits until ``flag >= generation - lag`` (acquire, system scope); a signaller writes
``flag = generation`` (release, system scope).  Nothing is zeroed between calls.

Flags are addressed through int64 tables of byte addresses (this rank's words or a peer's,
mapped by the rendezvous), so one launch covers every peer.  Each flag kernel is one program of
one warp: it never takes the SMs a same-device peer copy needs (the one-GPU bed).

Why kernels and not ``stream_write_value32``: a stream memory operation takes its value from the
host, so a graph would replay the generation it was captured with; these read it from device
memory.

The error word (``err_ptr``: int32[abi.ERROR_WORDS], layout in tpfuse/kernels/abi.py) is read
first by every kernel here: once set ("broken") a wait returns at once, a signal writes
nothing (so peers time out instead of reading data this rank no longer guards), and the NaN
fill fills.  The first waiter that times out records the error (signals.record_error), in
device memory and in the host-visible mirror.
"""
import triton
import triton.language as tl

from tpfuse.kernels.signals import record_error, wait_geq


@triton.jit
def wait_kernel(gen_ptr, table_ptr, peers_ptr, num_flags, lag, timeout, err_ptr, what, rank,
                ADVANCE: tl.constexpr, USE_ASM: tl.constexpr):
    """With ADVANCE: ``*gen_ptr += 1`` first.  Then for each ``i < num_flags``: wait until the
    int32 at address ``table[i]`` is ``>= *gen_ptr - lag``; on timeout record ``peers[i]`` in
    the error word and stop.  A wait that finds the error word already set returns at once
    (the workspace is broken: its outputs become NaN)."""
    gen = tl.load(gen_ptr)
    if ADVANCE:
        gen = gen + 1
        tl.store(gen_ptr, gen)
    target = gen - lag
    stop = tl.load(err_ptr, volatile=True) != 0
    for i in range(num_flags):
        if not stop:
            flag = tl.load(table_ptr + i).to(tl.pointer_type(tl.int32))
            status, seen = wait_geq(flag, target, timeout, err_ptr, USE_ASM)
            if status == 1:
                record_error(err_ptr, what, tl.load(peers_ptr + i).to(tl.int32), target, seen, rank, -1, -1, -1)
            stop = status != 0


@triton.jit
def signal_kernel(gen_ptr, table_ptr, num_flags, err_ptr):
    """For each ``i < num_flags``: the int32 at address ``table[i]`` = ``*gen_ptr`` (release,
    system scope: every write this rank's streams made before this launch is visible first).
    Nothing when the error word is set: a broken rank stops publishing, so its peers time out
    (and fill NaN) rather than read what it no longer guards."""
    gen = tl.load(gen_ptr)
    if tl.load(err_ptr, volatile=True) == 0:
        for i in range(num_flags):
            flag = tl.load(table_ptr + i).to(tl.pointer_type(tl.int32))
            tl.atomic_xchg(flag, gen, sem="release", scope="sys")


@triton.jit
def signal_wait_kernel(gen_ptr, sig_table, num_sig, wait_table, peers_ptr, num_wait, lag, timeout, err_ptr,
                       what, rank, USE_ASM: tl.constexpr):
    """:func:`signal_kernel` over ``sig_table`` then :func:`wait_kernel` (no advance) over
    ``wait_table``, in one launch: the two flag steps that follow each other on one stream."""
    gen = tl.load(gen_ptr)
    stop = tl.load(err_ptr, volatile=True) != 0
    if not stop:
        for i in range(num_sig):
            flag = tl.load(sig_table + i).to(tl.pointer_type(tl.int32))
            tl.atomic_xchg(flag, gen, sem="release", scope="sys")
    target = gen - lag
    for i in range(num_wait):
        if not stop:
            flag = tl.load(wait_table + i).to(tl.pointer_type(tl.int32))
            status, seen = wait_geq(flag, target, timeout, err_ptr, USE_ASM)
            if status == 1:
                record_error(err_ptr, what, tl.load(peers_ptr + i).to(tl.int32), target, seen, rank, -1, -1, -1)
            stop = status != 0


@triton.jit(do_not_specialize=["numel", "numel2"])
def poison_on_error_kernel(err_ptr, out_ptr, numel, out2_ptr, numel2, BLOCK: tl.constexpr):
    """Fill ``out`` (and ``out2``, same dtype, when ``numel2`` > 0) with NaN if the error word
    is set: the outputs of a call of a broken workspace -- the one that timed out and every
    call queued after it, eager or replayed -- are never plausible numbers.  A few programs
    that, without an error, read one word and exit (grid-stride loop otherwise)."""
    if tl.load(err_ptr, volatile=True) != 0:
        nan = tl.full((BLOCK,), float("nan"), tl.float32)
        step = tl.num_programs(0).to(tl.int64) * BLOCK
        start = tl.program_id(0).to(tl.int64) * BLOCK
        for base in range(start, numel, step):
            offs = base + tl.arange(0, BLOCK)
            tl.store(out_ptr + offs, nan.to(out_ptr.dtype.element_ty), mask=offs < numel)
        for base in range(start, numel2, step):
            offs = base + tl.arange(0, BLOCK)
            tl.store(out2_ptr + offs, nan.to(out2_ptr.dtype.element_ty), mask=offs < numel2)
