"""Host side of the persistent Triton GEMM core (kernels: ``tpfuse/kernels/gemm.py`` and, for
hooks on sm_90, ``tpfuse/kernels/gemm_ws.py``).

``matmul(a, b)`` computes ``a @ b`` with one persistent kernel; the fused strategies call the
same function with hooks:

================  =====================================  ==========================================
argument          shape / dtype                          meaning
================  =====================================  ==========================================
``a``             ``[M, K]`` bf16/fp16/fp32, unit        left operand (the gathered input in AG)
                  column stride
``b``             ``[K, N]`` same dtype, row-major or    right operand; ``weight.t()`` of an
                  column-major                           ``[N, K]`` weight works without a copy
``out``           ``[M, N]`` same dtype                  result (ignored when ``epilogue`` is set)
``wait``          :class:`WaitSpec`                      consumer hook: tile waits for its A chunks
``epilogue``      :class:`EpilogueSpec`                  producer hook: tiles go to per-chunk
                                                         destinations, chunks are signalled
``num_sms``       int or None                            SM budget: caps the persistent grid
``options``       :class:`GemmOptions` or None           launch-path switches (benchmarks, tests)
``tile_records``  int64 ``[>= num_tiles, 6]`` or     debug timeline: per tile, program, SM,
                  None (:func:`tile_records_for`)        start / wait done / end (``abi.REC_*``)
================  =====================================  ==========================================

Communication chunks are ``chunk_m`` rows: chunk ``c`` is rows ``[c*chunk_m, min((c+1)*chunk_m, M))``
and ``num_chunks = ceil(M / chunk_m)``. Tile orders: ``"grouped"`` (GROUP_M swizzle, best L2
reuse), ``"round"`` (start at chunk ``start_chunk`` and go round; AG passes its local rank),
``"owner"`` (finish one chunk's rows before the next, starting at ``start_chunk``; RS passes
``(rank + 1) % world_size`` so that the first peer's chunk is ready first).

:class:`PreparedMatmul` repeats one call site's call on new tensors of the same kind with the
per-call planning and argument building left out (the fused strategies' GEMM).
:func:`last_plan` returns the :class:`LaunchPlan` of the latest call (which kernel, grid,
stores and counts, and why: ``last_plan().explain()``); :func:`launch_counts` counts launches
by path (JIT, direct, interpreter). Layout of the package, imports pointing down:
``config`` (GemmConfig, GemmOptions, heuristics; pure) <- ``hooks`` (WaitSpec, EpilogueSpec,
error words) <- ``device`` (lazy probes) <- ``cache`` (tuning cache) <- ``launch`` (plans,
launches, matmul) <- ``tune`` (tuning) <- this module.

Nothing here touches a GPU or imports Triton at import time.
"""
from ..kernels.abi import ERROR_WORDS, TILE_ORDERS, TILE_RECORD_COLUMNS
from .config import GemmConfig, GemmOptions, candidate_configs, default_config, stream_k_tiles
from .hooks import EpilogueSpec, WaitSpec, check_error_word, new_error_word
from .launch import LaunchPlan, PreparedMatmul, clear_plans, last_plan, launch_counts, matmul, tile_records_for
from .tune import HOOK_CHUNKS, hook_winners, rerank_leaders, tune

__all__ = [
    "matmul", "PreparedMatmul", "GemmConfig", "GemmOptions", "WaitSpec", "EpilogueSpec", "LaunchPlan",
    "last_plan", "launch_counts", "clear_plans", "default_config", "candidate_configs", "stream_k_tiles", "tune",
    "rerank_leaders", "hook_winners", "HOOK_CHUNKS", "check_error_word", "new_error_word", "TILE_ORDERS", "ERROR_WORDS",
    "tile_records_for", "TILE_RECORD_COLUMNS",
]
