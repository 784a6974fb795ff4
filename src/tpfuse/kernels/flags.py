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

from tpfuse.kernels.signals import cta_uniform, record_error, wait_geq


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
                       what, rank, wait2_table, peers2_ptr, num_wait2, lag2, what2, USE_ASM: tl.constexpr):
    """:func:`signal_kernel` over ``sig_table`` (``num_sig`` may be 0) then :func:`wait_kernel`
    (no advance) over ``wait_table`` (``lag``, recorded as ``what``) and then over
    ``wait2_table`` (``lag2``, ``what2``; ``num_wait2`` may be 0), in one launch: the flag steps
    that follow each other on one stream (two-shot gemm_ar: READY out, the DONE2 credits and the
    inbox's READY before its reduce)."""
    gen = tl.load(gen_ptr)
    stop = tl.load(err_ptr, volatile=True) != 0
    if not stop:
        for i in range(num_sig):
            flag = tl.load(sig_table + i).to(tl.pointer_type(tl.int32))
            tl.atomic_xchg(flag, gen, sem="release", scope="sys")
    stop = _wait_table(wait_table, peers_ptr, num_wait, gen - lag, timeout, err_ptr, what, rank, stop, USE_ASM)
    _wait_table(wait2_table, peers2_ptr, num_wait2, gen - lag2, timeout, err_ptr, what2, rank, stop, USE_ASM)


@triton.jit
def _wait_table(table, peers_ptr, num, target, timeout, err_ptr, what, rank, stop, USE_ASM: tl.constexpr):
    """Wait until every flag of ``table[:num]`` reaches ``target`` (bounded), unless ``stop``; a
    timeout is recorded as ``what`` naming the flag's peer and ends the waits.  Returns ``stop``."""
    for i in range(num):
        if not stop:
            flag = tl.load(table + i).to(tl.pointer_type(tl.int32))
            status, seen = wait_geq(flag, target, timeout, err_ptr, USE_ASM)
            if status == 1:
                record_error(err_ptr, what, tl.load(peers_ptr + i).to(tl.int32), target, seen, rank, -1, -1, -1)
            stop = status != 0
    return stop


@triton.jit(do_not_specialize=["numel", "numel2", "num_zero", "num_sig"])
def poison_on_error_kernel(err_ptr, out_ptr, numel, out2_ptr, numel2, zero_ptr, num_zero, gen_ptr, sig_table, num_sig,
                           BLOCK: tl.constexpr):
    """Fill ``out`` (and ``out2``, same dtype, when ``numel2`` > 0) with NaN if the error word
    is set: the outputs of a call of a broken workspace -- the one that timed out and every
    call queued after it, eager or replayed -- are never plausible numbers.  A few programs
    that, without an error, read one word and exit (grid-stride loop otherwise).  Whatever the
    word: the int32 words ``zero[:num_zero]`` = 0 (fused ag_gemm's arrival words, reset for the
    next call in this launch rather than by a ``zero_`` of their own).  Unless the word is set,
    program 0 first writes ``*gen_ptr`` into every word of ``sig_table`` (``num_sig`` may be 0;
    release, system scope: :func:`signal_kernel` in this launch -- two-shot gemm_ar's DONE2
    after its pulls, which precede the launch on its stream)."""
    step = tl.num_programs(0).to(tl.int64) * BLOCK
    start = tl.program_id(0).to(tl.int64) * BLOCK
    for base in range(start, num_zero, step):
        offs = base + tl.arange(0, BLOCK)
        tl.store(zero_ptr + offs, tl.full((BLOCK,), 0, tl.int32), mask=offs < num_zero)
    broken = tl.load(err_ptr, volatile=True) != 0
    if not broken and tl.program_id(0) == 0:
        gen = tl.load(gen_ptr)
        for i in range(num_sig):
            flag = tl.load(sig_table + i).to(tl.pointer_type(tl.int32))
            tl.atomic_xchg(flag, gen, sem="release", scope="sys")
    if broken:
        nan = tl.full((BLOCK,), float("nan"), tl.float32)
        for base in range(start, numel, step):
            offs = base + tl.arange(0, BLOCK)
            tl.store(out_ptr + offs, nan.to(out_ptr.dtype.element_ty), mask=offs < numel)
        for base in range(start, numel2, step):
            offs = base + tl.arange(0, BLOCK)
            tl.store(out2_ptr + offs, nan.to(out2_ptr.dtype.element_ty), mask=offs < numel2)


# --- publish: begin + copy of the shard + READY in one launch (issue 34) -------------------------
#
# ag_gemm's first step (tpfuse/strategies/_symm_steps.py ``publish_shard``) was three launches and
# one to three copies: the credit wait (``wait_kernel`` with ADVANCE), ``copy_`` into this rank's
# slot (+ an fp8 shard's scale rows), ``signal_kernel`` of READY, then ``copy_`` into the gathered
# output's own rows (+ scale rows) and, in fused, a stream write per own arrival word.  One grid
# does it all:
#
#   every program:  gen = *gen_ptr + 1;  wait DONE credits >= gen - 1 (bounded; a timeout records
#                   (what, peer, generation, seen, rank) exactly as wait_kernel does);  unless
#                   broken: copy its stripe of the shard (and scale rows) into the slot and the
#                   optional second destination;  CTA barrier;  counter += 1 (acq_rel, GPU scope)
#   the last one:   counter = 0 (a CUDA graph replays the launch);  *gen_ptr = gen (the
#                   generation advance of Workspace.begin: every program read the old value
#                   before its increment, which the last one acquired);  the local words = value;
#                   unless broken (error word read again): READY[i] = gen on every peer (release,
#                   system scope: cumulative over every program's stores, which it acquired),
#                   then (copy_engine, fused) wait for every peer's READY to this rank (bounded,
#                   recorded as WAIT_READY naming the peer): the side stream's pulls that follow
#                   the launch need no flag kernel of their own
#
# The warps of a program spin independently and may leave a wait with different outcomes, and the
# branches after a wait hold CTA barriers (record_error's CAS, the copy's barrier): so each
# outcome is made the CTA's through a scratch word (signals.cta_uniform, as sm_workers' workers do).
# Nothing waits for another program: the grid needs no co-residency.

@triton.jit
def _copy_rows(src, src_stride, dst, dst2, rows, row_bytes, pid, num_programs, BLOCK: tl.constexpr,
               ELEM: tl.constexpr, CONTIG: tl.constexpr, DST2: tl.constexpr, ALIGNED: tl.constexpr):
    """This program's stripe of ``dst[r, :] = src[r, :]`` (and ``dst2``) for ``rows`` rows of
    ``row_bytes`` bytes, copied as ELEM-byte integers (bit-exact whatever the dtype; the host
    checked that every address, ``src_stride`` and ``row_bytes`` are ELEM multiples): ``dst`` and
    ``dst2`` contiguous, ``src`` rows ``src_stride`` bytes apart (CONTIG: ``src_stride ==
    row_bytes``, one flat run).  Blocks pid, pid + G, ... of BLOCK elements; with CONTIG whole
    blocks unmasked (16-byte vectors when ALIGNED: every address a 16-byte multiple) and one
    masked tail."""
    if ELEM == 4:
        ty = tl.int32
    elif ELEM == 2:
        ty = tl.int16
    else:
        ty = tl.int8
    s = src.to(tl.pointer_type(ty))
    d = dst.to(tl.pointer_type(ty))
    d2 = dst2.to(tl.pointer_type(ty))
    row = row_bytes // ELEM
    n = rows.to(tl.int64) * row
    if CONTIG:
        whole = n // BLOCK
        for blk in range(pid, whole, num_programs):
            offs = tl.arange(0, BLOCK).to(tl.int64) + blk * BLOCK
            ps = s + offs
            pd = d + offs
            pd2 = d2 + offs
            if ALIGNED:
                ps = tl.multiple_of(ps, 16)
                pd = tl.multiple_of(pd, 16)
                pd2 = tl.multiple_of(pd2, 16)
            x = tl.load(ps)
            tl.store(pd, x)
            if DST2:
                tl.store(pd2, x)
        if pid == whole % num_programs:
            offs = whole * BLOCK + tl.arange(0, BLOCK).to(tl.int64)
            mask = offs < n
            x = tl.load(s + offs, mask=mask)
            tl.store(d + offs, x, mask=mask)
            if DST2:
                tl.store(d2 + offs, x, mask=mask)
    else:
        stride = src_stride // ELEM
        blocks = (n + BLOCK - 1) // BLOCK
        for blk in range(pid, blocks, num_programs):
            offs = tl.arange(0, BLOCK).to(tl.int64) + blk * BLOCK
            mask = offs < n
            r = offs // row
            x = tl.load(s + r * stride + (offs - r * row), mask=mask)
            tl.store(d + offs, x, mask=mask)
            if DST2:
                tl.store(d2 + offs, x, mask=mask)


@triton.jit
def _wait_one(flag_addr, peer_addr, target, timeout, err_ptr, what, rank, scratch, USE_ASM: tl.constexpr):
    """Wait (bounded) until the int32 at the address held in ``*flag_addr`` reaches ``target``,
    the outcome made the CTA's (``cta_uniform`` on the program's ``scratch`` word: the warps spin
    independently); a timeout is recorded as ``what`` naming rank ``*peer_addr``.  Returns
    whether the caller's waits stop here (timed out, or the workspace broke meanwhile)."""
    flag = tl.load(flag_addr).to(tl.pointer_type(tl.int32))
    status, seen = wait_geq(flag, target, timeout, err_ptr, USE_ASM)
    status = cta_uniform(status, scratch)
    if status == 1:
        record_error(err_ptr, what, tl.load(peer_addr).to(tl.int32), target, seen, rank, -1, -1, -1)
    return status != 0


@triton.jit(do_not_specialize=["num_credits", "num_ready", "num_local", "local_value", "timeout", "what", "rank",
                               "num_in", "what_in", "a_stride", "a_rows", "a_row_bytes", "b_stride", "b_rows",
                               "b_row_bytes"])
def publish_kernel(gen_ptr, sync_ptr, err_ptr, credits_ptr, peers_ptr, num_credits, ready_ptr, num_ready,
                   local_ptr, num_local, local_value, timeout, what, rank, in_ptr, in_peers_ptr, num_in, what_in,
                   a_src, a_stride, a_dst, a_dst2, a_rows, a_row_bytes,
                   b_src, b_stride, b_dst, b_dst2, b_rows, b_row_bytes,
                   BLOCK: tl.constexpr, A_ELEM: tl.constexpr, A_CONTIG: tl.constexpr, A_ALIGNED: tl.constexpr,
                   B_CONTIG: tl.constexpr, HAS_B: tl.constexpr, DST2: tl.constexpr, USE_ASM: tl.constexpr):
    """The publish step of ag_gemm in one grid (the comment above): credits, the copies of job
    A (the shard, as A_ELEM-byte integers) and job B (HAS_B: its float32 scale rows) into their slots (and second destinations,
    DST2), the generation advance, the local words and READY; then the last program waits
    until every word of ``in`` (``num_in`` may be 0: the peers' READY for this rank) reaches
    the call's generation, recording a timeout as ``what_in`` naming ``in_peers[i]``.  Tables:
    ``credits``/``peers`` (the DONE words waited on and the rank each concerns), ``ready``
    (every peer's READY word for this rank), ``local`` (this rank's words set to
    ``local_value``), ``in``/``in_peers``, int64 byte addresses.  ``sync``: int32 [counter,
    one scratch word per program]."""
    pid = tl.program_id(0)
    num_programs = tl.num_programs(0)
    scratch = sync_ptr + 1 + pid
    gen = tl.load(gen_ptr) + 1
    target = gen - 1
    stop = cta_uniform((tl.load(err_ptr, volatile=True) != 0).to(tl.int32), scratch) != 0
    for i in range(num_credits):
        if not stop:
            stop = _wait_one(credits_ptr + i, peers_ptr + i, target, timeout, err_ptr, what, rank, scratch, USE_ASM)
    if not stop:   # broken (now or before): nothing is written where peers may still read
        _copy_rows(a_src, a_stride, a_dst, a_dst2, a_rows, a_row_bytes, pid, num_programs, BLOCK, A_ELEM, A_CONTIG,
                   DST2, A_ALIGNED)
        if HAS_B:   # float32 scale rows: 4-byte elements
            _copy_rows(b_src, b_stride, b_dst, b_dst2, b_rows, b_row_bytes, pid, num_programs, BLOCK, 4, B_CONTIG,
                       DST2, False)
    tl.debug_barrier()   # every thread's stores before the count (cumulativity)
    old = tl.atomic_add(sync_ptr, 1, sem="acq_rel", scope="gpu")
    last = old == num_programs - 1
    if last:
        tl.store(sync_ptr, 0)
        tl.store(gen_ptr, gen)
        for i in range(num_local):
            tl.store(tl.load(local_ptr + i).to(tl.pointer_type(tl.int32)), local_value)
        if cta_uniform((tl.load(err_ptr, volatile=True) == 0).to(tl.int32), scratch) != 0:
            for i in range(num_ready):
                flag = tl.load(ready_ptr + i).to(tl.pointer_type(tl.int32))
                tl.atomic_xchg(flag, gen, sem="release", scope="sys")
    # The last program then waits for the peers' READY of this call: what follows the launch on
    # its stream (the pulls from their slots) may read their shards.  Broken, each wait returns
    # at once (wait_geq reads the error word).  Out of the branch above: nested in it, the loop's
    # CTA barriers cost ptxas a stack frame for its convergence barriers.
    stop = False
    for i in range(tl.where(last, num_in, 0)):
        if not stop:
            stop = _wait_one(in_ptr + i, in_peers_ptr + i, gen, timeout, err_ptr, what_in, rank, scratch, USE_ASM)


# --- gather: two-shot gemm_ar's phase 2 in one launch (issue 34) --------------------------------
#
# After the reduce (which wrote this rank's reduced chunk into its gather slot and its own rows of
# the output, then raised READY2), every peer's reduced chunk is pulled into the output: copy_engine
# waits for the READY2 words, copies each chunk and raises DONE2 in its NaN fill -- W + 1 operations.
# One grid does it all:
#
#   every program:  gen = *gen_ptr (the call's begin advanced it);  for each peer in order: wait
#                   READY2 >= gen (bounded; a timeout records (what, peer, generation, seen, rank)
#                   as wait_kernel does) and, unless broken, copy its stripe of the peer's chunk
#                   into the output;  CTA barrier;  counter += 1 (acq_rel, GPU scope)
#   the last one:   counter = 0 (a CUDA graph replays the launch);  error word read again: set ->
#                   the whole output NaN (this program alone, grid-stride: the error path only),
#                   nothing raised;  else DONE2[i] = gen on every peer (release, system scope:
#                   cumulative over every program's copies, which it acquired)
#
# The NaN fill covers every element, the rows already copied and this rank's own included: when
# the programs disagree (one copied a peer's chunk before another timed out on the next peer) the
# output is never part real data.  Outcomes of waits are made CTA-uniform as in publish_kernel,
# and nothing waits for another program: the grid needs no co-residency.

@triton.jit(do_not_specialize=["num_peers", "num_done", "timeout", "what", "rank", "numel"])
def gather_kernel(gen_ptr, sync_ptr, err_ptr, ready_ptr, peers_ptr, jobs_ptr, num_peers, done_ptr, num_done,
                  timeout, what, rank, out_ptr, numel,
                  BLOCK: tl.constexpr, ELEM: tl.constexpr, ALIGNED: tl.constexpr, USE_ASM: tl.constexpr):
    """Two-shot gemm_ar's phase 2 in one grid (the comment above).  Tables (int64): ``ready`` /
    ``peers`` (each peer's READY2 word for this rank, and that peer's rank), ``jobs`` = [source
    addresses (each peer's gather slot); byte offsets into ``out``; bytes] of ``num_peers``
    entries each, ``done`` (every peer's DONE2 word for this rank).  Chunks are copied as
    ELEM-byte integers (the host checked every address, offset and size is an ELEM multiple),
    16-byte vectors when ALIGNED.  ``sync``: int32 [counter, one scratch word per program]."""
    pid = tl.program_id(0)
    num_programs = tl.num_programs(0)
    scratch = sync_ptr + 1 + pid
    gen = tl.load(gen_ptr)
    base = out_ptr.to(tl.pointer_type(tl.int8))
    stop = cta_uniform((tl.load(err_ptr, volatile=True) != 0).to(tl.int32), scratch) != 0
    for i in range(num_peers):
        if not stop:
            stop = _wait_one(ready_ptr + i, peers_ptr + i, gen, timeout, err_ptr, what, rank, scratch, USE_ASM)
        if not stop:   # the chunk as nbytes / ELEM rows of one element: one flat run
            nbytes = tl.load(jobs_ptr + 2 * num_peers + i)
            dst = base + tl.load(jobs_ptr + num_peers + i)
            _copy_rows(tl.load(jobs_ptr + i), ELEM, dst, dst, nbytes // ELEM, ELEM, pid, num_programs, BLOCK, ELEM,
                       True, False, ALIGNED)
    tl.debug_barrier()   # every thread's loads and stores before the count (cumulativity)
    old = tl.atomic_add(sync_ptr, 1, sem="acq_rel", scope="gpu")
    if old == num_programs - 1:
        tl.store(sync_ptr, 0)
        if cta_uniform((tl.load(err_ptr, volatile=True) != 0).to(tl.int32), scratch) != 0:
            nan = tl.full((BLOCK,), float("nan"), tl.float32).to(out_ptr.dtype.element_ty)
            for start in range(0, numel, BLOCK):
                offs = start + tl.arange(0, BLOCK).to(tl.int64)
                tl.store(out_ptr + offs, nan, mask=offs < numel)
        else:
            for i in range(num_done):
                flag = tl.load(done_ptr + i).to(tl.pointer_type(tl.int32))
                tl.atomic_xchg(flag, gen, sem="release", scope="sys")
