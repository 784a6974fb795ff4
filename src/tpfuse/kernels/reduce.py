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
"""
import triton
import triton.language as tl


@triton.jit
def reduce_kernel(table_ptr, num_src, out_ptr, rows, cols, src_stride, out_stride, err_ptr,
                  BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
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
