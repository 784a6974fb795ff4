"""One-program kernels for the symmetric-memory workspace's flags (tpfuse/symm.py).

A flag is an int32 word in a symmetric buffer that carries a *generation*: the workspace's call
counter, kept in device memory (``gen_ptr``) so that a CUDA graph replay advances it too.  A
waiter waits until ``flag >= generation - lag`` (acquire, system scope); a signaller writes
``flag = generation`` (release, system scope).  Nothing is zeroed between calls.

Flags are addressed through int64 tables of byte addresses (this rank's words or a peer's,
mapped by the rendezvous), so one launch covers every peer.  Each kernel is one program of one
warp: it never takes the SMs a same-device peer copy needs (the one-GPU bed).

Why kernels and not ``stream_write_value32``: a stream memory operation takes its value from the
host, so a graph would replay the generation it was captured with; these read it from device
memory.

Error word (int32[8], zero = no error; the first waiter that times out wins it by CAS)::

    [0] status      1 = timeout
    [1] what        the wait's code (tpfuse/symm.py: WAIT_KINDS)
    [2] peer        group rank whose flag never arrived
    [3] generation  awaited (flag >= generation - lag)
    [4] last value seen in the flag
    [5] rank        the waiting rank
"""
import triton
import triton.language as tl

from tpfuse.kernels.signals import wait_geq


@triton.jit
def _record(err_ptr, what, peer, target, seen, rank):
    old = tl.atomic_cas(err_ptr, 0, 1, sem="acq_rel", scope="sys")
    if old == 0:
        tl.store(err_ptr + 1, what)
        tl.store(err_ptr + 2, peer)
        tl.store(err_ptr + 3, target)
        tl.store(err_ptr + 4, seen)
        tl.store(err_ptr + 5, rank)


@triton.jit
def wait_kernel(gen_ptr, table_ptr, peers_ptr, num_flags, lag, timeout, err_ptr, what, rank,
                ADVANCE: tl.constexpr, USE_ASM: tl.constexpr):
    """With ADVANCE: ``*gen_ptr += 1`` first.  Then for each ``i < num_flags``: wait until the
    int32 at address ``table[i]`` is ``>= *gen_ptr - lag``; on timeout record ``peers[i]`` in
    the error word and stop.  A wait that finds the error word already set stops at once (the
    call is failing; its host check raises)."""
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
                _record(err_ptr, what, tl.load(peers_ptr + i), target, seen, rank)
            stop = status != 0


@triton.jit
def signal_kernel(gen_ptr, table_ptr, num_flags):
    """For each ``i < num_flags``: the int32 at address ``table[i]`` = ``*gen_ptr`` (release,
    system scope: every write this rank's streams made before this launch is visible first)."""
    gen = tl.load(gen_ptr)
    for i in range(num_flags):
        flag = tl.load(table_ptr + i).to(tl.pointer_type(tl.int32))
        tl.atomic_xchg(flag, gen, sem="release", scope="sys")


@triton.jit(do_not_specialize=["numel"])
def poison_on_error_kernel(err_ptr, out_ptr, numel, BLOCK: tl.constexpr):
    """Fill ``out`` with NaN if the error word is set: a captured call whose wait timed out must
    not hand back plausible numbers (no host check runs inside a CUDA graph)."""
    if tl.load(err_ptr, volatile=True) != 0:
        offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        nan = tl.full((BLOCK,), float("nan"), tl.float32)
        tl.store(out_ptr + offs, nan.to(out_ptr.dtype.element_ty), mask=offs < numel)

