"""Sum of W partial matrices in float32, in a fixed source order, rounded once.

``out[r, c] = round(sum_{i = 0 .. num_src-1} float32(src_i[r, c]))`` where ``src_i`` is the
``[rows, cols]`` matrix at byte address ``table[i]`` with row stride ``src_stride`` elements
(unit column stride) -- this rank's inbox slots or peers' buffers mapped by the rendezvous.
The order of the sum is the order of the table, the same on every rank, so every rank that
reduces the same partials gets bitwise the same result (deterministic, unlike a ring sum whose
order depends on the rank), and bf16/fp16 partials lose less than in a bf16 NCCL sum.

When the workspace's error word (``err_ptr``, tpfuse/kernels/abi.py) is set -- a wait of this
call or of an earlier one timed out -- ``out`` is NaN instead: the reduce is the last kernel
that writes a gemm_rs (or one-shot gemm_ar) output, so it is also the NaN fill (no extra launch).

Two more steps ride in the same launch (issue 34: every launch costs host time):

* OUT2: the rounded sum is stored into ``out2`` too (two-shot gemm_ar: the owner's reduced rows
  go to its gather slot and to its own output rows, instead of a ``copy_`` of one into the other).
* SIGNAL: the flag step after the reduce (its DONE credits, two-shot: and READY2), by the last
  program to finish: every program counts itself in ``sync`` (acq_rel, GPU scope, after a CTA
  barrier: its loads and stores come first), the last one resets the counter (a CUDA graph
  replays the launch) and, unless the error word is set, writes ``*gen_ptr`` into every word of
  ``sig_table`` (release, system scope: cumulative over every program's loads and stores, which
  it acquired) -- what ``signal_kernel`` launched after the reduce did.
"""
import triton
import triton.language as tl


@triton.jit(do_not_specialize=["num_sig"])
def reduce_kernel(table_ptr, num_src, out_ptr, rows, cols, src_stride, out_stride, err_ptr,
                  out2_ptr, out2_stride, gen_ptr, sync_ptr, sig_table, num_sig,
                  BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr, OUT2: tl.constexpr, SIGNAL: tl.constexpr):
    pid = tl.program_id(0)
    tiles_c = (cols + BLOCK_C - 1) // BLOCK_C
    r = (pid // tiles_c) * BLOCK_R + tl.arange(0, BLOCK_R)
    c = (pid % tiles_c) * BLOCK_C + tl.arange(0, BLOCK_C)
    mask = (r[:, None] < rows) & (c[None, :] < cols)
    src_offs = r.to(tl.int64)[:, None] * src_stride + c[None, :]
    acc = tl.full((BLOCK_R, BLOCK_C), 0.0, tl.float32)   # tl.full, not tl.zeros: a builtin also under the interpreter
    for i in range(num_src):
        src = tl.load(table_ptr + i).to(tl.pointer_type(out_ptr.dtype.element_ty))
        acc += tl.load(src + src_offs, mask=mask, other=0.0).to(tl.float32)
    if tl.load(err_ptr, volatile=True) != 0:
        acc = tl.full((BLOCK_R, BLOCK_C), float("nan"), tl.float32)
    out_offs = r.to(tl.int64)[:, None] * out_stride + c[None, :]
    tl.store(out_ptr + out_offs, acc.to(out_ptr.dtype.element_ty), mask=mask)
    if OUT2:
        out2_offs = r.to(tl.int64)[:, None] * out2_stride + c[None, :]
        tl.store(out2_ptr + out2_offs, acc.to(out2_ptr.dtype.element_ty), mask=mask)
    if SIGNAL:
        tl.debug_barrier()   # every thread's loads and stores before the count
        old = tl.atomic_add(sync_ptr, 1, sem="acq_rel", scope="gpu")
        if old == tl.num_programs(0) - 1:
            tl.store(sync_ptr, 0)
            if tl.load(err_ptr, volatile=True) == 0:   # broken: nothing signalled (peers time out)
                gen = tl.load(gen_ptr)
                for i in range(num_sig):
                    flag = tl.load(sig_table + i).to(tl.pointer_type(tl.int32))
                    tl.atomic_xchg(flag, gen, sem="release", scope="sys")
