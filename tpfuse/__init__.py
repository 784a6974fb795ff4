"""tpfuse: tensor-parallel GEMMs fused with the collective next to them.

    c = tpfuse.ag_gemm(a_shard, b, group)      # all_gather(a_shard) @ b
    c_shard = tpfuse.gemm_rs(a, b, group)      # reduce_scatter(a @ b)
    c = tpfuse.gemm_ar(a, b, group)            # all_reduce(a @ b)

Importing tpfuse needs no GPU, no Triton GPU backend and no process group.
"""

from tpfuse.ops import ag_gemm, gemm_ar, gemm_rs

__version__ = "0.1.0"
__all__ = ["ag_gemm", "gemm_rs", "gemm_ar", "__version__"]
