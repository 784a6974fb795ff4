"""Knobs of the fused strategy chosen per shape from the model: pure functions, cached.

``tpfuse/strategies/fused.py`` calls them at dispatch with the profile of its GPU
(:func:`tpfuse.model.hardware.detect`), and the planner (:mod:`tpfuse.plan`) predicts fused with
exactly the same values, so a plan describes what runs.

================================  ======================================================  ============
function                          what                                                    where used
================================  ======================================================  ============
:func:`fused_sm_budget`           programs of the persistent GEMM: every SM but one,      dispatch,
                                  or SMs // (W+1) on one GPU shared by W processes        simulator
:func:`fused_ag_chunks_per_rank`  c, the pieces each rank's shard is cut into for fused   dispatch,
                                  ag_gemm (one arrival word per piece): the fastest of    planner
                                  {1, 2, 4} in the simulator; >1 only where every piece
                                  keeps >= FUSED_TILE_M rows
================================  ======================================================  ============
"""

from __future__ import annotations

import functools
from typing import Any

from tpfuse.model.hardware import HardwareProfile, get_profile

__all__ = ["FUSED_TILE_M", "PIECES_PER_RANK", "MIN_PIECE_GAIN", "ONE_SHOT_MAX_BYTES", "ar_one_shot",
           "fused_sm_budget", "piece_candidates", "fused_ag_chunks_per_rank"]

# Rows of the fused GEMM's CTA tile: BLOCK_M of 28 of the 30 tuned configs in
# benchmarks/results/gemm_core_h200_2026-12-01_run21.json (rows[].config.BLOCK_M; 64 for the two 8B decode shapes).
# A tile waits for every piece its rows touch, so pieces shorter than this split tiles for nothing.
FUSED_TILE_M = 128
PIECES_PER_RANK = (1, 2, 4)
# More pieces only when predicted at least this much faster: every piece costs a copy, an
# arrival word and their host calls, which the model only estimates (leads, no measurement).
MIN_PIECE_GAIN = 0.01

# gemm_ar of copy_engine and fused reads every peer's whole partial in place (one-shot) up to
# this many output bytes, and reduce-scatters + gathers above it.  A lead, not a measurement:
# one-shot moves W times the bytes but has one flag round trip instead of two; it is measured
# only once a multi-GPU run is.
ONE_SHOT_MAX_BYTES = 1 << 20


def ar_one_shot(m: int, n: int, element_size: int) -> bool:
    """Whether a symmetric-memory gemm_ar of output [m, n] takes the one-shot path."""
    return m * n * element_size <= ONE_SHOT_MAX_BYTES


_DTYPES = {"bfloat16": "bf16", "bf16": "bf16", "float16": "fp16", "fp16": "fp16", "half": "fp16",
           "float32": "fp32", "fp32": "fp32", "float": "fp32"}


def fused_sm_budget(hw: HardwareProfile | int, world_size: int, *, shared_gpu: bool = False) -> int:
    """Programs of the fused persistent GEMM, as ``tpfuse.strategies.fused.sm_budget`` chooses
    them: every SM of ``hw`` (a profile or an SM count) but one, which the side stream's flag
    kernels need while the GEMM's tiles spin on the chunks those kernels let through, except
    when the group's processes share one GPU (``shared_gpu``: the bed,
    ``TORCH_SYMM_MEM_ALLOW_OVERLAPPING_DEVICES=1``): then ``SMs // (W + 1)`` each, at least 1,
    so that W spinning grids leave SMs for the same-device copies they wait for."""
    sms = hw if isinstance(hw, int) else hw.sm_count
    if shared_gpu and world_size > 1:
        return max(1, sms // (world_size + 1))
    return max(1, sms - 1) if world_size > 1 else sms


def piece_candidates(m_shard: int) -> tuple[int, ...]:
    """Pieces per rank worth simulating for a shard of ``m_shard`` rows: those of
    :data:`PIECES_PER_RANK` that cut it into equal pieces of at least :data:`FUSED_TILE_M` rows
    (1 always)."""
    return tuple(c for c in PIECES_PER_RANK
                 if c == 1 or (m_shard % c == 0 and m_shard // c >= FUSED_TILE_M))


def _dtype_name(dtype: Any) -> str:
    name = str(dtype).removeprefix("torch.").lower()
    if name not in _DTYPES:
        raise ValueError(f"dtype: {dtype!r}; fused runs bfloat16, float16 (and float32 in the model)")
    return _DTYPES[name]


@functools.lru_cache(maxsize=8192)
def fused_ag_chunks_per_rank(m_shard: int, n: int, k: int, world_size: int, dtype: Any,
                             hw: HardwareProfile | str, *, cuda_graph: bool = False,
                             num_sms: int | None = None) -> int:
    """Pieces per rank (c) for fused ``ag_gemm`` of ``a_shard [m_shard, k] @ b [k, n]`` on
    ``world_size`` ranks: the ``c`` of :func:`piece_candidates` whose simulated fused ag_gemm
    (``tpfuse.model.simulate``, one chunk of ``m_shard / c`` rows per arrival word) is fastest,
    more pieces only when at least :data:`MIN_PIECE_GAIN` faster; 1 for W = 1 or empty inputs.

    ``dtype``: torch dtype or name; ``hw``: profile or name; ``cuda_graph``: the call replays
    from a CUDA graph (no host time; more pieces cost host calls in eager mode); ``num_sms``:
    the GEMM's grid (None: :func:`fused_sm_budget`, every SM).  Pure and cached: every rank of
    a group computes the same value from the same arguments."""
    from tpfuse.model.simulate import simulate

    if world_size <= 1 or m_shard <= 0 or n <= 0 or k <= 0:
        return 1
    hw = get_profile(hw)
    name = _dtype_name(dtype)
    best_c, best_ms = 1, None
    for c in piece_candidates(m_shard):
        ms = simulate("ag_gemm", "fused", m=m_shard * world_size, n=n, k=k, world_size=world_size,
                      dtype=name, hw=hw, num_chunks=world_size * c, num_sms=num_sms,
                      cuda_graph=cuda_graph, fast=True).makespan_ms
        if best_ms is None or ms < best_ms * (1.0 - MIN_PIECE_GAIN):
            best_c, best_ms = c, ms
    return best_c
