"""tpfuse: tensor-parallel GEMMs fused with the collective next to them.

    c = tpfuse.ag_gemm(a_shard, b, group)      # all_gather(a_shard) @ b
    c_shard = tpfuse.gemm_rs(a, b, group)      # reduce_scatter(a @ b)
    c = tpfuse.gemm_ar(a, b, group)            # all_reduce(a @ b)
    p = tpfuse.plan("ag_gemm", m=..., n=..., k=..., world_size=..., dtype=..., hardware="h200")
    tpfuse.register_strategy(my_strategy)      # a strategy of your own (docs/strategies.md)

Importing tpfuse needs no GPU, no Triton GPU backend and no process group.
"""

from tpfuse import autograd as _autograd  # noqa: F401  (registers the custom ops' backward formulas)
from tpfuse.ops import ag_gemm, gemm_ar, gemm_rs
from tpfuse.plan import Plan, plan  # binds tpfuse.plan to the function; the module stays importable
from tpfuse import nn  # noqa: E402  (tpfuse.nn.ColumnParallelLinear / RowParallelLinear)
from tpfuse.strategies import register as register_strategy
from tpfuse.symm import check_workspaces, release_workspaces, synchronize

__version__ = "0.1.0"
__all__ = ["ag_gemm", "gemm_rs", "gemm_ar", "plan", "Plan", "nn", "register_strategy", "release_workspaces",
           "check_workspaces", "synchronize", "__version__"]
