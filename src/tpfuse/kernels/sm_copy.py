"""An SM-driven copy: a grid-stride loop of plain loads and stores, for ``tpfuse bench comm``.

A grid of ``num_programs`` programs (one CTA each, so at most one SM each) copies ``n`` words
from ``src_ptr`` to ``dst_ptr``; the pointers may be on different GPUs with peer access on (a
push over NVLink when launched on the source GPU).  The bandwidth such a copy reaches with
1..N SMs is what a fused kernel's communication SMs can move, against the copy engine's
``cudaMemcpyPeer`` which uses none.
"""
import triton
import triton.language as tl


@triton.jit
def sm_copy_kernel(src_ptr, dst_ptr, n, BLOCK: tl.constexpr):
    """Program p copies blocks p, p + grid, p + 2 * grid, ... of ``BLOCK`` words each."""
    pid = tl.program_id(0)
    step = tl.num_programs(0) * BLOCK
    for start in range(pid * BLOCK, n, step):
        offs = start + tl.arange(0, BLOCK)
        mask = offs < n
        tl.store(dst_ptr + offs, tl.load(src_ptr + offs, mask=mask), mask=mask)
