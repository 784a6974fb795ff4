"""Host side of the persistent Triton GEMM core (kernel: ``tpfuse/kernels/gemm.py``).

``matmul(a, b)`` computes ``a @ b`` with one persistent kernel; the fused strategies call the
same function with hooks:

==============  =====================================  ==========================================
argument        shape / dtype                          meaning
==============  =====================================  ==========================================
``a``           ``[M, K]`` bf16/fp16/fp32, unit        left operand (the gathered input in AG)
                column stride
``b``           ``[K, N]`` same dtype, row-major or    right operand; ``weight.t()`` of an
                column-major                           ``[N, K]`` weight works without a copy
``out``         ``[M, N]`` same dtype                  result (ignored when ``epilogue`` is set)
``wait``        :class:`WaitSpec`                      consumer hook: tile waits for its A chunks
``epilogue``    :class:`EpilogueSpec`                  producer hook: tiles go to per-chunk
                                                       destinations, chunks are signalled
==============  =====================================  ==========================================

Communication chunks are ``chunk_m`` rows: chunk ``c`` is rows ``[c*chunk_m, min((c+1)*chunk_m, M))``
and ``num_chunks = ceil(M / chunk_m)``. Tile orders: ``"grouped"`` (GROUP_M swizzle, best L2
reuse), ``"round"`` (start at chunk ``start_chunk`` and go round; AG passes its local rank),
``"owner"`` (finish one chunk's rows before the next, starting at ``start_chunk``; RS passes
``(rank + 1) % world_size`` so that the first peer's chunk is ready first).

Nothing here touches a GPU or imports Triton at import time: device probes are
``functools.lru_cache``-d and Triton is imported on first launch.
"""
from __future__ import annotations

import dataclasses
import functools
import json
import os
import statistics
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Sequence

import torch

__all__ = [
    "GemmConfig", "WaitSpec", "EpilogueSpec", "matmul", "default_config", "candidate_configs",
    "tune", "check_error_word", "new_error_word", "TILE_ORDERS", "ERROR_WORDS",
]

TILE_ORDERS = ("grouped", "round", "owner")
ERROR_WORDS = 8          # int32 words of the error word; layout in tpfuse/kernels/signals.py
_MAX_GENERATION = 2**31 - 1
_SUPPORTED = (torch.bfloat16, torch.float16, torch.float32)

# Shared memory per block on sm_90 with the opt-in limit (CUDA guide, H100/H200: 227 KiB).
_SM90_SMEM_BYTES = 232448
# Streaming multiprocessors of the NVIDIA H200 SXM (the GPU the heuristics were measured on);
# the pure heuristics take it as an argument, matmul() passes the real device's count.
_H200_NUM_SMS = 132


# --------------------------------------------------------------------------------------------
# configs
# --------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class GemmConfig:
    """One kernel configuration. Tile = BLOCK_M x BLOCK_N x BLOCK_K; the epilogue stores the
    tile in ``EPI_SUBTILE`` column slices (1 or 2); ``num_programs`` caps the persistent grid
    (None: one program per SM). ``split_k`` > 1 cuts K into that many slices of whole
    BLOCK_K steps, each its own work item; the last slice of a tile to finish adds the others'
    fp32 partials (docs/gemm_core.md, "Split-K"). ``stream_k`` 1 or 2 shares the tiles of the
    last, partly filled wave (2: that wave and one full wave more) out to every program by
    BLOCK_K steps, so no SM idles at the end (docs/gemm_core.md, "Stream-K"); 0 = off.
    ``tma_store`` False keeps TMA loads but stores the output through pointers: no staging
    buffer, so its shared memory can hold one more pipeline stage (hooks and plain-pointer
    launches are not affected)."""
    BLOCK_M: int = 128
    BLOCK_N: int = 256
    BLOCK_K: int = 64
    GROUP_M: int = 8
    num_warps: int = 8
    num_stages: int = 3
    EPI_SUBTILE: int = 1
    flatten: bool = False
    warp_specialize: bool = False
    num_programs: Optional[int] = None
    split_k: int = 1
    stream_k: int = 0
    tma_store: bool = True

    def __post_init__(self):
        for name in ("BLOCK_M", "BLOCK_N", "BLOCK_K"):
            v = getattr(self, name)
            if v < 16 or v & (v - 1):
                raise ValueError(f"GemmConfig.{name}={v}: must be a power of two >= 16")
        if self.EPI_SUBTILE not in (1, 2):
            raise ValueError(f"GemmConfig.EPI_SUBTILE={self.EPI_SUBTILE}: must be 1 or 2")
        if self.GROUP_M < 1:
            raise ValueError(f"GemmConfig.GROUP_M={self.GROUP_M}: must be >= 1")
        if self.num_programs is not None and self.num_programs < 1:
            raise ValueError(f"GemmConfig.num_programs={self.num_programs}: must be >= 1 or None")
        if not isinstance(self.split_k, int) or self.split_k < 1:
            raise ValueError(f"GemmConfig.split_k={self.split_k!r}: must be an int >= 1 (1 = no split-K)")
        if self.stream_k not in (0, 1, 2):
            raise ValueError(f"GemmConfig.stream_k={self.stream_k!r}: must be 0 (off), 1 (the last partial "
                             "wave) or 2 (the last partial wave and one full wave)")
        if self.stream_k and self.split_k > 1:
            raise ValueError(f"GemmConfig: split_k={self.split_k} and stream_k={self.stream_k} together; "
                             "choose one way of cutting K")

    def smem_bytes(self, elem_size: int) -> int:
        """Shared memory estimate: pipelined A and B stages plus one TMA-store subtile (none
        with ``tma_store=False``: the pointer store's layout conversion reuses the stages)."""
        stages = (self.BLOCK_M + self.BLOCK_N) * self.BLOCK_K * elem_size * self.num_stages
        return stages + (self.BLOCK_M * (self.BLOCK_N // self.EPI_SUBTILE) * elem_size if self.tma_store else 0)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "GemmConfig":
        """Inverse of :meth:`to_dict`; fields missing from ``d`` (entries written before they
        existed, e.g. ``split_k``) take their defaults."""
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = set(d) - names
        if unknown:
            raise ValueError(f"GemmConfig.from_dict: unknown fields {sorted(unknown)}")
        return cls(**d)


def default_config(m: int, n: int, k: int, dtype: torch.dtype = torch.bfloat16,
                   num_sms: int = _H200_NUM_SMS) -> GemmConfig:
    """Heuristic config for one GEMM shape (pure; used when the tuning cache has no entry).

    From the tuning winners on one NVIDIA H200, bf16, per-rank Llama-3 shapes at TP 8
    (``benchmarks/results/gemm_core_h200_2026-11-30_deep_stages_tuning_log.json``): 128x256x64
    tiles, 8 warps, 3 stages for M >= 2048; 128x128x64 with 6 stages when 128x256 tiles leave
    most SMs idle (M=512, N=3584: 56 tiles for 132 SMs; one tile per SM and cold inputs want
    many loads in flight); decode (M <= 128) streams B through deep pipelines, with narrow tiles
    when B is small (8B: 64x64x128 x 6 stages) and wider ones as B grows (70B: 128x64x64 x 8,
    405B: 128x128x64 x 5).

    Split-K (kept to shapes none of the measured ones hits: graph-timed tuning on 2026-11-30
    picked no split-K candidate for any of the 30 shapes, smaller tiles won): when the
    chosen tiles would keep at most a quarter of ``num_sms`` busy, ``split_k`` is the largest of
    2, 4, 8 that keeps ``tiles * split_k <= num_sms`` and at least 4 BLOCK_K steps per slice.
    """
    cfg = _default_tiles(m, n, k, dtype)
    tiles, k_steps = _grid(m, n, k, cfg)
    if tiles <= num_sms // 4 and cfg.BLOCK_M * cfg.BLOCK_N <= 128 * 128:
        fits = _one_wave_splits(tiles, k_steps, num_sms)
        if fits:
            cfg = dataclasses.replace(cfg, split_k=fits[-1])
    return cfg


def _grid(m: int, n: int, k: int, cfg: GemmConfig) -> tuple[int, int]:
    """(output tiles, BLOCK_K steps) of ``cfg`` on an ``m x n x k`` GEMM."""
    return -(-m // cfg.BLOCK_M) * -(-n // cfg.BLOCK_N), -(-k // cfg.BLOCK_K)


def _one_wave_splits(tiles: int, k_steps: int, num_sms: int) -> list[int]:
    """split_k values of 2, 4, 8 that keep ``tiles * split_k`` in one wave and >= 4 BLOCK_K
    steps per slice, ascending."""
    return [s for s in (2, 4, 8) if tiles * s <= num_sms and k_steps // s >= 4]


def _default_tiles(m: int, n: int, k: int, dtype: torch.dtype) -> GemmConfig:
    if dtype == torch.float32:   # tf32; not tuned
        return GemmConfig(BLOCK_M=128, BLOCK_N=128, BLOCK_K=32, num_warps=8, num_stages=3)
    if m <= 128:
        if n * k >= 100_000_000:
            return GemmConfig(BLOCK_M=128, BLOCK_N=128, BLOCK_K=64, num_warps=8, num_stages=5)
        if n * k >= 25_000_000:
            return GemmConfig(BLOCK_M=128, BLOCK_N=64, BLOCK_K=64, num_warps=4, num_stages=8)
        return GemmConfig(BLOCK_M=64, BLOCK_N=64, BLOCK_K=128, num_warps=4, num_stages=6)
    big_tiles = -(-m // 128) * -(-n // 256)
    if big_tiles < 100:   # H200 has 132 SMs; 8B M=512 (56, 64 tiles) lost with 128x256, 70B (112, 128) won
        return GemmConfig(BLOCK_M=128, BLOCK_N=128, BLOCK_K=64, num_warps=8, num_stages=6)
    return GemmConfig(BLOCK_M=128, BLOCK_N=256, BLOCK_K=64, num_warps=8, num_stages=3)


def candidate_configs(m: int, n: int, k: int, dtype: torch.dtype = torch.bfloat16,
                      smem_limit: int = _SM90_SMEM_BYTES,
                      num_sms: int = _H200_NUM_SMS) -> list[GemmConfig]:
    """Small tuning space for one shape, pruned by shared memory; split-K variants only for
    shapes whose output tiles leave SMs idle (:func:`_split_k_candidates`)."""
    elem = torch.empty((), dtype=dtype).element_size()
    out = []
    if m <= 256:   # decode: bound by reading B; narrow tiles put more programs in flight,
        # deep pipelines more bytes (2026-11-30, M=128 N=3584 K=4096, L2 flushed: 64x64x128
        # with 6 stages 18.1 us against 21.9 us for 64x64x256 with 3)
        for bm, bn, bk, w, s in [(64, 64, 128, 4, 4), (64, 128, 64, 4, 4), (64, 128, 128, 4, 3),
                                 (128, 64, 128, 4, 4), (64, 64, 256, 4, 3), (128, 128, 64, 8, 4),
                                 (64, 64, 128, 4, 6), (64, 64, 64, 4, 12), (128, 64, 64, 4, 8),
                                 (128, 128, 64, 8, 6)]:
            out.append(GemmConfig(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, num_warps=w, num_stages=s))
        # one stage more in the TMA-store staging buffer's place (pointer stores)
        for bm, bn, bk, w, s in [(64, 64, 128, 4, 7), (128, 64, 64, 4, 9)]:
            out.append(GemmConfig(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, num_warps=w, num_stages=s,
                                  tma_store=False))
    # 128x128 with 5-6 stages: one tile per SM and cold inputs want many loads in flight
    # (2026-11-30, M=512 N=3584 K=4096, L2 flushed: 4 stages 33.6 us, 6 stages 28.5 us)
    for bn, s, sub, flat in [(256, 3, 1, False), (256, 3, 2, False), (256, 4, 1, False),
                             (256, 4, 2, False), (256, 3, 1, True), (256, 3, 2, True),
                             (128, 3, 1, False), (128, 4, 1, False), (128, 4, 2, False),
                             (128, 4, 1, True), (128, 5, 1, False), (128, 6, 1, False),
                             (128, 6, 2, False), (128, 6, 1, True)]:
        out.append(GemmConfig(BLOCK_M=128, BLOCK_N=bn, BLOCK_K=64, num_warps=8, num_stages=s,
                              EPI_SUBTILE=sub, flatten=flat))
    out.append(GemmConfig(BLOCK_M=128, BLOCK_N=256, BLOCK_K=64, GROUP_M=16, num_warps=8, num_stages=3))
    out.append(GemmConfig(BLOCK_M=128, BLOCK_N=256, BLOCK_K=64, GROUP_M=4, num_warps=8, num_stages=3,
                          flatten=True))
    if m <= 1024:
        out.append(GemmConfig(BLOCK_M=64, BLOCK_N=256, BLOCK_K=64, num_warps=4, num_stages=4))
        out.append(GemmConfig(BLOCK_M=64, BLOCK_N=128, BLOCK_K=64, num_warps=4, num_stages=5))
        # 7 stages of 128x128x64 fit only without the TMA store's staging buffer: with one
        # tile per SM, loads in flight set the pace (see the 5-6 stage note above)
        out.append(GemmConfig(BLOCK_M=128, BLOCK_N=128, BLOCK_K=64, num_warps=8, num_stages=7,
                              tma_store=False))
    out.append(GemmConfig(BLOCK_M=128, BLOCK_N=128, BLOCK_K=128, num_warps=8, num_stages=3))
    out.append(GemmConfig(BLOCK_M=256, BLOCK_N=128, BLOCK_K=64, num_warps=8, num_stages=3))
    out.append(GemmConfig(BLOCK_M=128, BLOCK_N=256, BLOCK_K=64, num_warps=8, num_stages=3,
                          warp_specialize=True))
    out += _split_k_candidates(m, n, k, num_sms)
    out += _stream_k_candidates(m, n, k, num_sms)
    # dict.fromkeys: once each (the decode and prefill lists share tiles), in first-seen order
    return [c for c in dict.fromkeys(out) if c.smem_bytes(elem) <= smem_limit]


# Tiles that split-K candidates are made of: the 128x256 prefill winner (epilogue in two
# subtiles, so the reduction holds half a tile of partials at a time) and two decode winners.
# All keep <= 128 fp32 accumulator registers per thread, so adding partials does not spill.
_SPLIT_K_BASES = (
    GemmConfig(BLOCK_M=128, BLOCK_N=256, BLOCK_K=64, num_warps=8, num_stages=3, EPI_SUBTILE=2),
    GemmConfig(BLOCK_M=128, BLOCK_N=128, BLOCK_K=128, num_warps=8, num_stages=3),
    GemmConfig(BLOCK_M=64, BLOCK_N=128, BLOCK_K=128, num_warps=4, num_stages=3),
)


def _split_k_candidates(m: int, n: int, k: int, num_sms: int) -> list[GemmConfig]:
    """Split-K variants (at most ~6) for shapes with idle SMs. Per base tile:

    * few tiles (``tiles <= num_sms / 2``): the largest ``split_k`` of 2, 4, 8 with
      ``tiles * split_k <= num_sms`` (one full wave), and twice that if it stays within two waves;
    * a ragged second wave (128x256 only; ``num_sms < tiles < 2 * num_sms`` with the grid less
      than 85 % busy over the waves): the ``split_k`` of 2, 3, 4 that fills the waves best, if
      it fills them >= 90 % (e.g. 208 tiles on 132 SMs: 79 % busy; split 3: 95 %).

    Every slice keeps >= 4 BLOCK_K steps (>= 16 for the ragged-wave case, where K must be long
    enough to pay for writing and re-reading the partials)."""
    out = []
    for base in _SPLIT_K_BASES:
        tiles, k_steps = _grid(m, n, k, base)
        splits = []
        if tiles <= num_sms // 2:
            fits = _one_wave_splits(tiles, k_steps, num_sms)
            if fits:
                splits.append(fits[-1])
                s2 = 2 * fits[-1]
                if s2 <= 8 and tiles * s2 <= 2 * num_sms and k_steps // s2 >= 4:
                    splits.append(s2)
        elif base.BLOCK_N == 256 and num_sms < tiles < 2 * num_sms:
            def busy(items):
                return items / (-(-items // num_sms) * num_sms)
            best = max((2, 3, 4), key=lambda s: busy(tiles * s))
            if busy(tiles) < 0.85 and busy(tiles * best) >= 0.9 and k_steps // best >= 16:
                splits.append(best)
        out += [dataclasses.replace(base, split_k=s) for s in splits]
    return out


# Tiles that stream-K candidates are made of: the prefill winners (128x256 with the epilogue
# in two subtiles, so the reduction holds half a tile of partials at a time; 128x128 with
# BLOCK_K 128 and 64) and, for decode-sized M, the narrow tiles that stream B.
_STREAM_K_BASES = _SPLIT_K_BASES[:2] + (
    GemmConfig(BLOCK_M=128, BLOCK_N=128, BLOCK_K=64, num_warps=8, num_stages=4),
)
_STREAM_K_DECODE_BASES = (
    GemmConfig(BLOCK_M=64, BLOCK_N=64, BLOCK_K=256, num_warps=4, num_stages=3),
    GemmConfig(BLOCK_M=64, BLOCK_N=128, BLOCK_K=128, num_warps=4, num_stages=3),
)


def _stream_k_candidates(m: int, n: int, k: int, num_sms: int) -> list[GemmConfig]:
    """Stream-K variants for shapes whose tiles end in a partly filled wave, within the first
    four waves (later, the tail is a small part of the time). Mode 1 for each base; mode 2 too
    when the last wave is under half full (mode 1 would give each program only a few
    steps). Skipped where a program would get fewer than 8 BLOCK_K steps."""
    out = []
    for base in _STREAM_K_BASES + (_STREAM_K_DECODE_BASES if m <= 256 else ()):
        tiles, k_steps = _grid(m, n, k, base)
        if tiles % num_sms == 0 or tiles >= 4 * num_sms:
            continue
        modes = [1] + ([2] if num_sms < tiles and tiles % num_sms < num_sms // 2 else [])
        for mode in modes:
            if stream_k_tiles(tiles, num_sms, mode) * k_steps >= 8 * num_sms:
                out.append(dataclasses.replace(base, stream_k=mode))
                if mode == 1:   # the segment loop flattened into its K loop (one pipelined loop)
                    out.append(dataclasses.replace(base, stream_k=mode, flatten=True))
    return out


# --------------------------------------------------------------------------------------------
# hook specs
# --------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class WaitSpec:
    """Consumer hook: a tile waits until ``signal[c] >= generation`` for every chunk ``c`` its
    A rows touch, before loading them.

    ``signal``: int32 ``[num_chunks]`` (or longer) on a's device, e.g. a symmetric signal pad.
    ``error``: int32 ``[ERROR_WORDS]`` zeroed error word (see :func:`new_error_word`); None
    allocates one per call. ``timeout_ns`` bounds the spin on GPU (%globaltimer);
    ``max_spins`` bounds it where inline PTX is not available (``TRITON_INTERPRET=1``).
    ``rank`` only labels the TimeoutError.
    """
    signal: torch.Tensor
    generation: int
    chunk_m: int
    timeout_ns: int = 10_000_000_000
    max_spins: int = 100_000
    error: Optional[torch.Tensor] = None
    rank: Optional[int] = None


@dataclass(frozen=True)
class EpilogueSpec:
    """Producer hook: rows of chunk ``c`` go to that chunk's destination (row ``r`` of ``a @ b``
    lands in row ``r - c*chunk_m`` of a ``[>= chunk rows, N]`` buffer with row stride
    ``dest_stride`` elements and unit column stride); once every tile touching chunk ``c`` is
    stored, the kernel publishes ``*signal_ptrs[c] = generation`` (release, system scope).

    ``base``: any tensor of the output dtype on a's device; destinations are addressed from it.
    ``dest_offsets``: int64 ``[num_chunks]`` element offsets of each destination from
    ``base.data_ptr()`` (peer buffers in the fused strategies). ``signal_ptrs``: int64
    ``[num_chunks]`` addresses of int32 signal words. ``counters``: int32 ``[num_chunks]`` zeros,
    left at zero by every completed launch. ``align_elems``: elements per 16 bytes when every
    destination and the row stride are 16-byte aligned (vector stores), else 0. ``dests``: the
    destination tensors, one per chunk, when known (:meth:`from_tensors` keeps them): with them,
    16-byte alignment, at most 8 chunks and ``chunk_m`` a multiple of the tile height, a
    TMA-path launch stores each tile through a TMA descriptor per destination instead of
    pointer stores; destinations that are consecutive row blocks of one tensor (``out[c *
    chunk_m:]`` slices) take one descriptor for all chunks, whatever their number and height
    (``TPFUSE_EPI_TMA=0`` turns both off).
    Build one with :meth:`from_tensors`; for the next call, :meth:`with_generation`.
    """
    base: torch.Tensor
    dest_offsets: torch.Tensor
    signal_ptrs: torch.Tensor
    counters: torch.Tensor
    generation: int
    chunk_m: int
    dest_stride: int
    align_elems: int = 0
    keepalive: tuple = ()
    dests: tuple = ()

    @classmethod
    def from_tensors(cls, dests: Sequence[torch.Tensor], signals: torch.Tensor | Sequence[torch.Tensor],
                     generation: int, chunk_m: int,
                     counters: Optional[torch.Tensor] = None) -> "EpilogueSpec":
        """``dests[c]``: ``[rows >= chunk rows, N]`` tensor for chunk ``c``; ``signals``: an int32
        ``[num_chunks]`` tensor (signal ``c`` = ``signals[c]``) or one int32 tensor per chunk
        (its first element is the signal)."""
        if len(dests) == 0:
            raise ValueError("EpilogueSpec.from_tensors: dests is empty; pass one tensor per chunk")
        stride = dests[0].stride(0)
        for i, d in enumerate(dests):
            if d.dim() != 2 or d.stride(1) != 1 or d.stride(0) != stride or d.dtype != dests[0].dtype:
                raise ValueError(f"EpilogueSpec.from_tensors: dests[{i}] is {d.dtype} {tuple(d.shape)} with strides "
                                 f"{d.stride()}; all must be 2-D {dests[0].dtype} with strides ({stride}, 1)")
        device = dests[0].device
        if isinstance(signals, torch.Tensor):
            if signals.dtype != torch.int32 or signals.numel() < len(dests):
                raise ValueError(f"EpilogueSpec.from_tensors: signals must be int32 with >= {len(dests)} "
                                 f"elements, got {signals.dtype} with {signals.numel()}")
            sig_addrs = [signals.data_ptr() + 4 * i for i in range(len(dests))]
            sig_keep = (signals,)
        else:
            if len(signals) != len(dests):
                raise ValueError(f"EpilogueSpec.from_tensors: {len(signals)} signals for {len(dests)} dests")
            sig_addrs = [s.data_ptr() for s in signals]
            sig_keep = tuple(signals)
        e = dests[0].element_size()
        origin = dests[0].data_ptr()
        offsets = [(d.data_ptr() - origin) // e for d in dests]
        aligned = all(d.data_ptr() % 16 == 0 for d in dests) and (stride * e) % 16 == 0
        if counters is None:
            counters = torch.zeros(len(dests), dtype=torch.int32, device=device)
        return cls(dests[0], torch.tensor(offsets, dtype=torch.int64, device=device),
                   torch.tensor(sig_addrs, dtype=torch.int64, device=device), counters,
                   generation, chunk_m, stride, align_elems=16 // e if aligned else 0,
                   keepalive=tuple(dests) + sig_keep, dests=tuple(dests))

    def with_generation(self, generation: int) -> "EpilogueSpec":
        """The same spec for the next call: ``generation`` changed; the buffers, and what was
        derived from them once (the destinations' TMA descriptors, whether they are stacked),
        kept -- a ``dataclasses.replace`` copy would build those again on its first call."""
        new = dataclasses.replace(self, generation=generation)
        for cache in ("_tma_descs", "_stacked"):   # frozen dataclass: caches, not fields
            if cache in self.__dict__:
                new.__dict__[cache] = self.__dict__[cache]
        return new


def new_error_word(device) -> torch.Tensor:
    """A zeroed int32 error word for :class:`WaitSpec` (reuse it across calls while it stays 0)."""
    return torch.zeros(ERROR_WORDS, dtype=torch.int32, device=device)


def check_error_word(error: torch.Tensor, *, rank: Optional[int] = None,
                     timeout_ns: Optional[int] = None) -> None:
    """Raise TimeoutError if a wait hook recorded a timeout in ``error`` (synchronizes)."""
    words = error.tolist()
    if words[0] == 0:
        return
    who = f"rank {rank}" if rank is not None else "this rank"
    bound = f" more than {timeout_ns} ns" if timeout_ns is not None else ""
    raise TimeoutError(
        f"tpfuse GEMM wait hook timed out on {who}: tile {words[1]} (program {words[5]}) waited "
        f"{bound} for signal[chunk={words[2]}] >= generation {words[3]}, last value seen "
        f"{words[4]}. The producer of chunk {words[2]} never published this generation: a peer "
        f"rank is dead, late or on another call. Zero the error word before reusing it.")


# --------------------------------------------------------------------------------------------
# lazy probes
# --------------------------------------------------------------------------------------------
def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


@functools.lru_cache(maxsize=None)
def _device_info(index: int) -> dict:
    p = torch.cuda.get_device_properties(index)
    return {"name": p.name, "num_sms": p.multi_processor_count,
            "capability": (p.major, p.minor)}


@functools.lru_cache(maxsize=None)
def _triton():
    try:
        import triton
        import triton.language as tl
        from .kernels import gemm as kernel_module
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise RuntimeError(f"tpfuse.gemm_core needs triton (pip install 'tpfuse[triton]'): {e}") from e
    return triton, tl, kernel_module


@functools.lru_cache(maxsize=None)
def _warn_once(msg: str) -> None:
    warnings.warn(msg, stacklevel=3)


def _num_programs(device: torch.device) -> int:
    if device.type == "cuda":
        return _device_info(device.index if device.index is not None else torch.cuda.current_device())["num_sms"]
    return 4  # interpreter: a few programs, so the persistent loop runs several tiles each


def _tma_ok(device, a, b, out, b_kmajor) -> tuple[bool, str]:
    if device.type != "cuda" or _interpreting():
        return False, "not on CUDA"
    idx = device.index if device.index is not None else torch.cuda.current_device()
    if _device_info(idx)["capability"][0] < 9:
        return False, "TMA needs compute capability >= 9.0"
    e = a.element_size()
    strides = [a.stride(0), b.stride(1) if b_kmajor else b.stride(0)]
    if out is not None:
        strides.append(out.stride(0))
    tensors = [a, b] + ([out] if out is not None else [])
    if any((s * e) % 16 for s in strides) or any(t.data_ptr() % 16 for t in tensors):
        return False, (f"TMA needs 16-byte aligned base pointers and row strides; got strides "
                       f"{strides} of {e}-byte elements")
    return True, ""


# --------------------------------------------------------------------------------------------
# tuning cache
# --------------------------------------------------------------------------------------------
def _cache_path() -> Path:
    root = os.environ.get("TPFUSE_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "tpfuse")
    return Path(root) / "gemm_core.json"


def _cache_key(m, n, k, dtype, b_kmajor, gpu) -> str:
    triton, _, _ = _triton()
    return (f"{m}x{n}x{k}|{str(dtype).replace('torch.', '')}|b={'kmajor' if b_kmajor else 'nmajor'}"
            f"|{gpu}|torch={torch.__version__}|triton={triton.__version__}")


def _load_cache() -> dict:
    p = _cache_path()
    try:
        return json.loads(p.read_text())
    except (OSError, ValueError):
        return {}


def _lookup(m, n, k, dtype, b_kmajor, device) -> Optional[GemmConfig]:
    if device.type != "cuda":
        return None
    gpu = _device_info(device.index if device.index is not None else torch.cuda.current_device())["name"]
    entry = _load_cache().get(_cache_key(m, n, k, dtype, b_kmajor, gpu))
    if not entry:
        return None
    try:
        return GemmConfig.from_dict(entry["config"])
    except (TypeError, ValueError, KeyError) as e:   # written by another tpfuse version
        _warn_once(f"tpfuse.gemm_core: ignoring tuning-cache entry for {m}x{n}x{k} in {_cache_path()} ({e}); "
                   "re-run tune() to replace it")
        return None


def tune(a: torch.Tensor, b: torch.Tensor, *, configs: Optional[Sequence[GemmConfig]] = None,
         rep_ms: int = 20, save: bool = True, graphs: Optional[bool] = None,
         ) -> tuple[GemmConfig, list[tuple[GemmConfig, float]]]:
    """Time every candidate config on ``a @ b`` (median, ``triton.testing.do_bench``), store the
    fastest in the JSON cache and return ``(best, [(config, ms), ...])``, fastest first (the
    leaders re-timed, :func:`rerank_leaders`; their ms the median of their timings). A config
    that fails to compile or launch (out of shared memory or registers, a Triton limitation) is
    skipped with a warning; only an error that leaves the CUDA context unusable (an illegal
    address) ends the search, since nothing can run on that device afterwards.

    ``graphs`` (default: on CUDA) times CUDA-graph replays of one call: eager timings of a small
    GEMM measure the host's launch cost, and would pick a config by launch noise."""
    triton, _, _ = _triton()
    m, k = a.shape
    n = b.shape[1]
    configs = (list(configs) if configs is not None
               else candidate_configs(m, n, k, a.dtype, num_sms=_num_programs(a.device)))
    out = torch.empty(m, n, dtype=a.dtype, device=a.device)
    if graphs is None:
        graphs = a.device.type == "cuda" and not _interpreting()

    def timed(cfg: GemmConfig) -> float:
        def call():
            matmul(a, b, out=out, config=cfg)
        if not graphs:
            return triton.testing.do_bench(call, warmup=5, rep=rep_ms, return_mode="median")
        side = torch.cuda.Stream(a.device)
        side.wait_stream(torch.cuda.current_stream(a.device))
        with torch.cuda.stream(side):   # compile and warm up outside the capture
            call()
            call()
        torch.cuda.current_stream(a.device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            call()
        try:
            return triton.testing.do_bench(graph.replay, warmup=5, rep=rep_ms, return_mode="median")
        finally:
            del graph

    timings = []
    for cfg in configs:
        try:
            ms = timed(cfg)
        except Exception as e:  # compile or launch failure (e.g. out of shared memory): skip, say why
            _warn_once(f"tpfuse.gemm_core.tune: skipping config {cfg}: {type(e).__name__}: {e}"[:600])
            continue
        timings.append((cfg, ms))
    if not timings:
        raise RuntimeError(f"tpfuse.gemm_core.tune: no config ran for shape {m}x{n}x{k}")
    timings = [(cfg, ms) for cfg, ms, _ in rerank_leaders(timings, timed)]
    best = timings[0][0]
    if save and a.device.type == "cuda":
        gpu = _device_info(a.device.index if a.device.index is not None else torch.cuda.current_device())["name"]
        p = _cache_path()
        data = _load_cache()
        data[_cache_key(m, n, k, a.dtype, b.stride(0) == 1 and b.stride(1) != 1, gpu)] = {
            "config": best.to_dict(), "ms": min(t[1] for t in timings)}
        p.parent.mkdir(parents=True, exist_ok=True)
        tmp = p.with_suffix(".tmp")
        tmp.write_text(json.dumps(data, indent=1, sort_keys=True))
        tmp.replace(p)
        _PLANS.clear()   # plans made before hold the configs chosen before
    return best, timings


def rerank_leaders(timings: Sequence[tuple], timed, finalists: int = 6, rounds: int = 4) -> list[tuple]:
    """Rank tuning candidates more robustly than by one timing each: the ``finalists`` fastest
    of ``timings`` (``[(config, ms)]``) are timed ``rounds`` more times by ``timed(config)``, in
    interleaved rounds (each in a rotated order) so drift hits all alike, and ranked by the
    median of their timings. Returns ``[(config, ms, [timings])]``, fastest first: the leaders
    by that median, then the rest by their one timing. One timing is not enough: under the
    power cap the SM clock moves between ~1450 and ~1800 MHz from one timing to the next, and a
    config's single timing on 405B fc1 at M = 512 moved by +-4 % (H200, 2026-12-01,
    ``benchmarks/probe_drift.py``), as much as the configs differ. A leader whose re-timing
    raises is dropped."""
    ranked = sorted(timings, key=lambda t: t[1])
    lead = [[cfg, [ms]] for cfg, ms in ranked[:max(finalists, 0)]] if len(ranked) > 1 else []
    for r in range(rounds if lead else 0):
        for entry in lead[r % len(lead):] + lead[:r % len(lead)]:
            if entry[1] is None:
                continue
            try:
                entry[1].append(timed(entry[0]))
            except Exception as e:  # noqa: BLE001 - it ran once; say why it no longer does
                _warn_once(f"tpfuse.gemm_core: dropping tuning finalist {entry[0]}: {type(e).__name__}: {e}"[:600])
                entry[1] = None
    out = sorted(((cfg, statistics.median(ts), ts) for cfg, ts in lead if ts is not None), key=lambda t: t[1])
    return out + [(cfg, ms, [ms]) for cfg, ms in ranked[len(lead):]]


# --------------------------------------------------------------------------------------------
# matmul
# --------------------------------------------------------------------------------------------
def _check_operands(a, b, out):
    for name, t in (("a", a), ("b", b)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"matmul: {name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 2:
            raise ValueError(f"matmul: {name} must be 2-D, got shape {tuple(t.shape)}; flatten leading dims first")
    if a.dtype not in _SUPPORTED:
        raise TypeError(f"matmul: a.dtype={a.dtype} is not supported; use bfloat16, float16 or float32 (tf32)")
    if b.dtype != a.dtype:
        raise TypeError(f"matmul: b.dtype={b.dtype} differs from a.dtype={a.dtype}; cast one of them")
    if a.shape[1] != b.shape[0]:
        raise ValueError(f"matmul: a is {tuple(a.shape)} and b is {tuple(b.shape)}; need a [M, K] and b [K, N]")
    if a.device != b.device:
        raise ValueError(f"matmul: a is on {a.device} and b on {b.device}; move them to one device")
    if a.device.type != "cuda" and not _interpreting():
        raise ValueError(f"matmul: tensors are on {a.device}; the Triton core needs CUDA "
                         "(or TRITON_INTERPRET=1 for CPU debugging)")
    if a.stride(1) != 1 and a.shape[1] > 1:
        raise ValueError(f"matmul: a has strides {a.stride()}; need unit column stride (call a.contiguous())")
    if b.stride(1) == 1 or b.shape[1] == 1:
        b_kmajor = False
    elif b.stride(0) == 1 or b.shape[0] == 1:
        b_kmajor = True
    else:
        raise ValueError(f"matmul: b has strides {b.stride()}; need row-major [K, N] or column-major "
                         "(weight.t() of a contiguous [N, K] weight); call b.contiguous()")
    m, n = a.shape[0], b.shape[1]
    if out is not None:
        if out.shape != (m, n) or out.dtype != a.dtype or out.device != a.device:
            raise ValueError(f"matmul: out is {tuple(out.shape)} {out.dtype} on {out.device}; "
                             f"need ({m}, {n}) {a.dtype} on {a.device}")
        if out.stride(1) != 1 and n > 1:
            raise ValueError(f"matmul: out has strides {out.stride()}; need unit column stride")
    return b_kmajor


def _check_chunks(m, chunk_m, name):
    if not isinstance(chunk_m, int) or chunk_m < 1:
        raise ValueError(f"matmul: {name}={chunk_m!r}; need a positive int (rows per communication chunk)")
    return -(-m // chunk_m)


def _check_generation(gen, name):
    if not isinstance(gen, int) or not 1 <= gen <= _MAX_GENERATION:
        raise ValueError(f"matmul: {name}={gen!r}; need an int in [1, 2**31 - 1] (signals are int32)")


@dataclass(frozen=True)
class _Plan:
    """Everything about a call that its shapes, strides, dtype, config and options decide."""
    m: int
    n: int
    k: int
    b_kmajor: bool
    use_tma: bool
    cfg: GemmConfig
    grid: tuple
    chunk_m: int
    num_chunks: int
    start_chunk: int
    use_asm: bool
    constexprs: tuple   # values of the kernel's constexpr parameters, in signature order
    num_warps: int
    num_stages: int
    num_tiles: int = 0  # output tiles (split-K: workspace and counters are sized by it)
    sk_tiles: int = 0   # stream-K: the last tiles of the order, shared out by K-steps
    epi_tma: int = 0    # epilogue hook through TMA: number of destination descriptors (0: pointers)
    ws: tuple = ()      # epilogue hook in the warp-specialized Gluon kernel: (block, stages); () = gemm_kernel


_PLANS: dict = {}      # call signature -> _Plan
_LAST_PLAN: list = [None]   # the plan of the latest call (diagnostics: which kernel ran)
_SPLIT_K_BUFFERS: dict = {}   # (device, raw stream) -> (fp32 workspace, int32 tile counters)
_COMPILED: dict = {}   # (call signature, alignment/int-width specialization) -> Triton CompiledKernel
_MAX_PLANS = 4096      # a bound, not a tuned number: plans are small, shapes in a model are few


def _make_plan(a, b, out, config, tile_order, chunk_m, start_chunk, wait, epilogue, use_tma) -> _Plan:
    b_kmajor = _check_operands(a, b, out)
    if tile_order not in TILE_ORDERS:
        raise ValueError(f"matmul: tile_order={tile_order!r}; choose one of {TILE_ORDERS}")
    m, k = a.shape
    n = b.shape[1]
    device = a.device
    chunk_sources = [("chunk_m", chunk_m), ("wait.chunk_m", wait.chunk_m if wait else None),
                     ("epilogue.chunk_m", epilogue.chunk_m if epilogue else None)]
    given = [(nm, v) for nm, v in chunk_sources if v is not None]
    if len({v for _, v in given}) > 1:
        raise ValueError(f"matmul: chunk sizes disagree: {given}; the tile order and both hooks share one chunk_m")
    chunk_m = given[0][1] if given else None
    if tile_order != "grouped" and chunk_m is None:
        raise ValueError(f"matmul: tile_order={tile_order!r} needs chunk_m (rows per chunk)")
    num_chunks = _check_chunks(m, chunk_m, given[0][0]) if chunk_m is not None else 1
    if not isinstance(start_chunk, int) or not 0 <= start_chunk < max(num_chunks, 1):
        raise ValueError(f"matmul: start_chunk={start_chunk!r}; need 0 <= start_chunk < num_chunks={num_chunks}")
    cfg = config or (_lookup(m, n, k, a.dtype, b_kmajor, device) if m and n and k else None) \
        or default_config(m, n, k, a.dtype, num_sms=_num_programs(device))
    if not isinstance(cfg, GemmConfig):
        raise TypeError(f"matmul: config must be a GemmConfig, got {type(cfg).__name__}")
    if m == 0 or n == 0 or k == 0:   # nothing to launch; matmul() handles these
        return _Plan(m, n, k, b_kmajor, False, cfg, (0,), chunk_m or 1, num_chunks, start_chunk,
                     False, (), cfg.num_warps, cfg.num_stages)

    triton, tl, km = _triton()
    c_out = None if epilogue is not None else out
    if use_tma is None:
        use_tma, why = _tma_ok(device, a, b, c_out, b_kmajor)
        if not use_tma and device.type == "cuda" and torch.cuda.get_device_capability(device)[0] >= 9:
            _warn_once(f"tpfuse.gemm_core: plain-pointer path instead of TMA ({why})")
    elif use_tma:
        ok, why = _tma_ok(device, a, b, c_out, b_kmajor)
        if not ok:
            raise ValueError(f"matmul: use_tma=True but {why}; pass use_tma=None to fall back")
    k_steps = triton.cdiv(k, cfg.BLOCK_K)
    if cfg.split_k > k_steps:
        raise ValueError(f"matmul: config.split_k={cfg.split_k} but K={k} has only {k_steps} steps of "
                         f"BLOCK_K={cfg.BLOCK_K} and every K-slice needs at least one; use split_k <= {k_steps} "
                         "or a smaller BLOCK_K")
    num_tiles = triton.cdiv(m, cfg.BLOCK_M) * triton.cdiv(n, cfg.BLOCK_N)
    programs = cfg.num_programs or _num_programs(device)
    sk_tiles = stream_k_tiles(num_tiles, programs, cfg.stream_k)
    # stream-K shares its steps out to every program; otherwise no more programs than work items
    grid = (programs if sk_tiles else min(num_tiles * cfg.split_k, programs), 1, 1)
    use_asm = (device.type == "cuda" and not _interpreting()
               and os.environ.get("TPFUSE_SIGNAL_ASM", "1") != "0")
    c_dtype = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16, torch.float32: tl.float32}[a.dtype]
    epi_tma = _epilogue_tma_dests(epilogue, use_tma and cfg.tma_store, num_chunks, cfg.BLOCK_M)
    constexprs = (cfg.BLOCK_M, cfg.BLOCK_N, cfg.BLOCK_K, cfg.GROUP_M, cfg.EPI_SUBTILE,
                  TILE_ORDERS.index(tile_order), bool(use_tma), b_kmajor, c_dtype,
                  wait is not None, epilogue is not None, use_asm, cfg.flatten, cfg.warp_specialize,
                  _interpreting(), epilogue.align_elems if epilogue is not None else 0, cfg.split_k,
                  sk_tiles > 0, epi_tma, cfg.tma_store,
                  _epi_count_mode((use_asm or _interpreting()) and cfg.split_k == 1
                                  and not cfg.warp_specialize and num_chunks <= km.MAX_POLLED_CHUNKS.value
                                  and num_tiles < km.MAX_COUNTED_TILES.value
                                  and (num_chunks == 1 or chunk_m % cfg.BLOCK_M == 0), cfg.flatten)
                  if epilogue is not None else 1)
    ws = _ws_choice(device, a.dtype, cfg, epilogue, wait, epi_tma, use_asm, m, n, programs,
                    out_tma=bool(use_tma) and cfg.tma_store and epilogue is None)
    if ws:   # one program per SM or fewer, no more than tiles of the Gluon kernel's own tile
        ws_tiles = triton.cdiv(m, ws[0][0]) * triton.cdiv(n, ws[0][1])
        grid = (min(ws_tiles, cfg.num_programs or _num_programs(device)), 1, 1)
    return _Plan(m, n, k, b_kmajor, bool(use_tma), cfg, grid, chunk_m or 1, num_chunks, start_chunk,
                 use_asm, constexprs, cfg.num_warps, cfg.num_stages, num_tiles, sk_tiles, epi_tma, ws)


def _wave_fill(tiles: int, programs: int) -> float:
    """Share of the programs' tile slots that hold a tile, over whole waves."""
    return tiles / (-(-tiles // programs) * programs)


def _ws_choice(device, dtype, cfg, epilogue, wait, epi_tma, use_asm, m=0, n=0, programs=0,
               out_tma=False) -> tuple:
    """``(block, stages)`` of the warp-specialized Gluon kernel (tpfuse/kernels/gemm_ws.py) for a
    launch with one hook, or ``()`` for gemm_kernel. Taken on sm_90 for bf16/fp16, for configs
    of 128-row tiles 128 or 256 wide without split-K, with either the epilogue hook where it
    stores by TMA (``epi_tma``: every destination 16-byte aligned, per-chunk descriptors or
    stacked destinations) -- its store warp counts and publishes off the MMA warps, which in
    gemm_kernel wait ~0.9 us per tile for it -- or the wait hook into a TMA-stored ``out``
    (``out_tma``) -- its load warp waits, not the MMA warps. Not with both hooks at once. The Gluon kernel takes the config's tile and GROUP_M, K-steps
    of 64 and as many stages as fit beside its staging buffer; it has no stream-K, so where
    128-wide tiles fill the waves of ``programs`` better by more than 5 points than 256-wide
    ones (8B fc1 at M = 4096: 0.97 against 0.85), it takes those. ``TPFUSE_WS=0`` keeps
    gemm_kernel for both hooks."""
    one_hook = (epilogue is not None and wait is None and epi_tma) or (wait is not None and epilogue is None and out_tma)
    if (not one_hook or not use_asm or cfg.split_k != 1
            or dtype not in (torch.bfloat16, torch.float16) or cfg.BLOCK_M != 128 or cfg.BLOCK_N not in (128, 256)
            or os.environ.get("TPFUSE_WS", "1") == "0"):
        return ()
    idx = device.index if device.index is not None else torch.cuda.current_device()
    if _device_info(idx)["capability"][0] != 9:
        return ()
    bn = cfg.BLOCK_N
    if bn == 256 and m and n and programs:
        fill = {w: _wave_fill(-(-m // 128) * -(-n // w), programs) for w in (128, 256)}
        if fill[128] > fill[256] + 0.05:
            bn = 128
    return ((128, bn, 64), 3 if bn == 256 else 5)


_MAX_TMA_DESTS = 8   # one kernel argument each; more chunks store through pointers


def _epi_count_mode(eligible_async: bool = True, in_loop: bool = True) -> int:
    """How the epilogue hook counts stored tiles (kernel constexpr EPI_COUNT).

    3: a release at GPU scope that returns nothing (no warp waits for it), made after the next
    tile's main loop, one poller per chunk publishing it, handoff at the poller's end; where
    every tile lies in one chunk, on CUDA (inline PTX) or in the interpreter, without split-K or
    warp specialization, with at most 64 chunks (``eligible_async``); 4: the same with the
    count made a few K-steps into the next tile's main loop instead, so a chunk is published
    most of a tile earlier, in flattened tile loops (``in_loop``: in a nested K loop ptxas
    then serializes the wgmma instructions); 1: acq_rel at GPU scope, read at once, the
    chunk's last count publishing it. The default (``TPFUSE_EPI_COUNT`` unset or ``auto``)
    takes 4, else 3, else 1. Diagnostics: ``=epilogue`` 3 where 4 would be taken; ``=gpu``
    forces 1; ``=sys`` 2 (system scope); ``=none`` 0: no count and no publication, so no
    signal is ever set -- for timing only. See ``_count_and_publish`` and ``_mainloop`` in
    tpfuse/kernels/gemm.py."""
    mode = os.environ.get("TPFUSE_EPI_COUNT", "auto")
    modes = {"none": 0, "gpu": 1, "sys": 2, "auto": (4 if in_loop else 3) if eligible_async else 1,
             "epilogue": 3 if eligible_async else 1}
    if mode not in modes:
        raise ValueError(f"TPFUSE_EPI_COUNT={mode!r}; use 'auto' (default), 'epilogue', 'gpu', 'sys', or "
                         "'none' (timing diagnostic: signals are never published)")
    if mode == "none":
        _warn_once("tpfuse.gemm_core: TPFUSE_EPI_COUNT=none: the epilogue hook publishes no "
                   "signals (timing diagnostic)")
    return modes[mode]


def _epilogue_tma_dests(epilogue, tma_store, num_chunks, block_m) -> int:
    """How many TMA descriptors the epilogue hook stores through (0: pointer stores), or
    ``EPI_TMA_STACKED``: one descriptor over destinations that are consecutive row blocks of one
    tensor (:func:`_stacked`), any number of chunks of any height. ``tma_store``: a TMA-path
    launch whose config stores by TMA (``tma_store=False`` configs gave the staging buffer's
    shared memory to the pipeline). Separate destinations need every tile inside one chunk
    (chunk_m a multiple of BLOCK_M): a tile's rows in a later chunk would need a negative TMA row
    coordinate, which stores do not take."""
    if (epilogue is None or not tma_store or len(epilogue.dests) < num_chunks or num_chunks < 1
            or epilogue.align_elems == 0 or os.environ.get("TPFUSE_EPI_TMA", "1") == "0"):
        return 0
    if _stacked(epilogue):
        return _triton()[2].EPI_TMA_STACKED.value
    if num_chunks > _MAX_TMA_DESTS or (num_chunks > 1 and epilogue.chunk_m % block_m):
        return 0
    return num_chunks


def _stacked(epilogue: "EpilogueSpec") -> bool:
    """True when ``epilogue.dests`` are two or more consecutive row blocks of one tensor:
    dests[c] starts ``c * chunk_m`` rows (of ``dest_stride``) after dests[0], with the same
    width (the chunks of one output buffer: a rank's own symmetric buffer, or
    ``out[c * chunk_m:]`` slices). Row r of ``a @ b`` then goes to row r from dests[0]: the very
    addresses the per-chunk descriptors would write, so where the tensors live does not matter.
    Decided once per spec, from pointers only: it is on the per-call path (the plan key)."""
    got = epilogue.__dict__.get("_stacked")   # frozen dataclass: a cache, not a field
    if got is None:
        dests = epilogue.dests
        if len(dests) > 1:
            base, width = dests[0].data_ptr(), dests[0].shape[1]
            row_bytes = epilogue.dest_stride * dests[0].element_size()
            got = all(d.data_ptr() == base + c * epilogue.chunk_m * row_bytes and d.shape[1] == width
                      for c, d in enumerate(dests))
        else:
            got = False
        epilogue.__dict__["_stacked"] = got
    return got


def _epilogue_descriptor_args(epilogue, plan) -> tuple:
    """The kernel's _MAX_TMA_DESTS descriptor arguments: the destinations' descriptors, then None."""
    descs = _epilogue_descriptors(epilogue, plan) if plan.epi_tma else ()
    return descs + (None,) * (_MAX_TMA_DESTS - len(descs))


def _epilogue_descriptors(epilogue: "EpilogueSpec", plan: "_Plan") -> tuple:
    """One TMA descriptor per chunk over that chunk's rows of its destination (or, stacked
    destinations, one over all M rows from the first), kept on the spec (so they live as long
    as it does) per launch geometry."""
    cfg = plan.cfg
    # the Gluon kernel (plan.ws) stores whole tiles through descriptors that carry their layout
    block = plan.ws[0][:2] if plan.ws else (cfg.BLOCK_M, cfg.BLOCK_N // cfg.EPI_SUBTILE)
    cache = epilogue.__dict__.setdefault("_tma_descs", {})   # frozen dataclass: not a field
    key = (plan.m, plan.n, plan.chunk_m, plan.epi_tma, block, bool(plan.ws))
    descs = cache.get(key)
    if descs is None:
        if plan.ws:
            from .kernels.gemm_ws import make_descriptor as TensorDescriptor
        else:
            from triton.tools.tensor_descriptor import TensorDescriptor
        stacked = plan.epi_tma == _triton()[2].EPI_TMA_STACKED.value
        descs = []
        for q, d in enumerate(epilogue.dests[:plan.num_chunks if stacked else plan.epi_tma]):
            rows = min(plan.chunk_m, plan.m - q * plan.chunk_m)
            if d.shape[0] < rows or d.shape[1] < plan.n:
                raise ValueError(f"matmul: epilogue.dests[{q}] is {tuple(d.shape)}; chunk {q} needs at least "
                                 f"({rows}, {plan.n})")
            if not stacked:
                descs.append(TensorDescriptor(d, [rows, plan.n], [d.stride(0), 1], list(block)))
        if stacked:   # every chunk's rows checked above, so all M rows lie in the storage
            d0 = epilogue.dests[0]
            descs.append(TensorDescriptor(d0, [plan.m, plan.n], [d0.stride(0), 1], list(block)))
        descs = cache[key] = tuple(descs)
    return descs


def stream_k_tiles(tiles: int, programs: int, mode: int) -> int:
    """How many tiles (the last of the order) a ``stream_k=mode`` config shares out by K-steps
    over ``programs`` programs: none when the tiles fill whole waves; all of them when they
    are fewer than the programs; else the last partial wave (mode 1) or it and one full wave
    before it (mode 2: more steps per program, so fewer and longer segments)."""
    if mode == 0 or tiles == 0 or tiles % programs == 0:
        return 0
    if tiles < programs:
        return tiles
    return tiles % programs + (programs if mode == 2 else 0)


def _split_k_buffers(plan: _Plan, device) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 workspace ``[num_tiles, split_k, BLOCK_M, BLOCK_N]`` (stream-K: ``[programs, 2,
    BLOCK_M, BLOCK_N]``) and int32 ``[num_tiles]`` tile counters for a split-K or stream-K
    launch on the current stream, cached and grown as needed.

    One pair per (device, stream): launches on one stream run one after the other and can
    share it; launches on two streams may overlap, so they must not. The counters are
    allocated zeroed and every completed launch leaves them at zero (the last slice of each
    tile resets its counter), so no memset runs between calls. Under CUDA graph capture a
    new pair is allocated from the graph's pool on the capture stream, its zeroing captured."""
    cfg = plan.cfg
    slots = plan.grid[0] * 2 if plan.sk_tiles else plan.num_tiles * cfg.split_k
    ws_numel = slots * cfg.BLOCK_M * cfg.BLOCK_N
    key = (device, torch._C._cuda_getCurrentRawStream(device.index) if device.type == "cuda" else 0)
    ws, counters = _SPLIT_K_BUFFERS.get(key, (None, None))
    if ws is None or ws.numel() < ws_numel:
        ws = torch.empty(ws_numel, dtype=torch.float32, device=device)
    if counters is None or counters.numel() < plan.num_tiles:
        counters = torch.zeros(plan.num_tiles, dtype=torch.int32, device=device)
    _SPLIT_K_BUFFERS[key] = (ws, counters)
    return ws, counters


def _launch(plan: _Plan, plan_key, args: list, device) -> None:
    """Launch gemm_kernel. The first call of a specialization goes through Triton's JIT (which
    compiles and caches); later ones call the compiled kernel directly (:func:`_launch_cached`).
    Specialization of the kernel depends only on the plan and on the 16-byte alignment of the
    plain-pointer operands (hook arguments are not specialized)."""
    _, _, km = _triton()
    full = args + list(plan.constexprs)
    if _interpreting() or device.type != "cuda":
        km.gemm_kernel[plan.grid](*full, num_warps=plan.num_warps, num_stages=plan.num_stages)
        return
    spec = (plan_key, tuple(x.data_ptr() % 16 == 0 for x in args[:3] if isinstance(x, torch.Tensor)),
            tuple(-2**31 <= x < 2**31 for x in args[12:] if isinstance(x, int)))
    _launch_cached(spec, plan.grid, full, device,
                   lambda: km.gemm_kernel[plan.grid](*full, num_warps=plan.num_warps, num_stages=plan.num_stages))


def _launch_cached(spec, grid, full: list, device, jit_launch) -> None:
    """Launch a kernel on CUDA: the first call of specialization ``spec`` through Triton's JIT
    (``jit_launch()``, which compiles, caches and returns the ``CompiledKernel``); later ones
    call that compiled kernel directly with ``full`` (every parameter, constexprs included, in
    signature order), skipping the JIT's argument binding -- tens of microseconds of host time
    per call, which decode-sized GEMMs cannot hide. ``spec`` must capture everything the JIT
    specializes on. ``TPFUSE_FAST_LAUNCH=0`` always takes the JIT."""
    fast = os.environ.get("TPFUSE_FAST_LAUNCH", "1") != "0"
    compiled = _COMPILED.get(spec) if fast else None
    if compiled is not None:
        try:
            compiled[grid](*full, stream=torch._C._cuda_getCurrentRawStream(device.index))
            return
        except Exception as e:  # a Triton internals change: say so once, then use the JIT path
            _warn_once(f"tpfuse.gemm_core: direct kernel launch failed ({type(e).__name__}: {e}); "
                       "using Triton's JIT launch (slower on the host); set TPFUSE_FAST_LAUNCH=0 to silence")
            os.environ["TPFUSE_FAST_LAUNCH"] = "0"
            _COMPILED.clear()
    compiled = jit_launch()
    if fast:
        _COMPILED[spec] = compiled


def matmul(a: torch.Tensor, b: torch.Tensor, *, out: Optional[torch.Tensor] = None,
           config: Optional[GemmConfig] = None, tile_order: str = "grouped",
           chunk_m: Optional[int] = None, start_chunk: int = 0,
           wait: Optional[WaitSpec] = None, epilogue: Optional[EpilogueSpec] = None,
           check: bool = True, use_tma: Optional[bool] = None) -> Optional[torch.Tensor]:
    """``a [M, K] @ b [K, N]`` with the persistent Triton core.

    Returns ``out`` (allocated when None) or, with ``epilogue``, None (tiles went to the
    chunk destinations). ``chunk_m`` defaults to the hook spec's; tile orders ``"round"`` and
    ``"owner"`` need one. ``start_chunk`` is the first chunk in those orders. With ``wait`` and
    ``check=True`` the call synchronizes and raises TimeoutError from the error word; with
    ``check=False`` call :func:`check_error_word` yourself. ``use_tma`` None = where possible.

    Everything decided by shapes, strides, dtypes, config and options is validated once and
    cached (a "plan"); per call only the hook specs' buffers and generations are checked.
    """
    try:
        # Base-pointer alignment is part of the key: a view with the same shape and strides but
        # an odd offset cannot take a plan made for TMA (16-byte aligned bases).
        key = (a.shape, a.stride(), a.dtype, a.device, a.data_ptr() % 16 == 0,
               b.shape, b.stride(), b.dtype, b.device, b.data_ptr() % 16 == 0,
               None if out is None else (out.shape, out.stride(), out.dtype, out.device,
                                         out.data_ptr() % 16 == 0),
               config, tile_order, chunk_m, start_chunk, wait is not None and wait.chunk_m,
               epilogue is not None and (epilogue.chunk_m, epilogue.align_elems, len(epilogue.dests),
                                         _stacked(epilogue)),
               use_tma, os.environ.get("TRITON_INTERPRET"), os.environ.get("TPFUSE_SIGNAL_ASM"),
               os.environ.get("TPFUSE_EPI_TMA"), os.environ.get("TPFUSE_EPI_COUNT"),
               os.environ.get("TPFUSE_WS"))
        plan = _PLANS.get(key)
    except (AttributeError, TypeError):   # not tensors / unhashable: full validation says why
        key, plan = None, None
    if plan is None:
        plan = _make_plan(a, b, out, config, tile_order, chunk_m, start_chunk, wait, epilogue, use_tma)
        if key is not None:
            if len(_PLANS) >= _MAX_PLANS:
                _PLANS.clear()
            _PLANS[key] = plan
    _LAST_PLAN[0] = plan
    m, n, k = plan.m, plan.n, plan.k
    device = a.device
    if out is None and epilogue is None:
        out = torch.empty(m, n, dtype=a.dtype, device=device)
    if m == 0 or n == 0:
        return out if epilogue is None else None
    if k == 0 and epilogue is None and wait is None:
        return out.zero_()
    if k == 0:
        raise ValueError("matmul: K=0 with hooks; nothing to compute, publish the chunks on the host instead")

    num_chunks = plan.num_chunks
    if wait is not None:
        _check_generation(wait.generation, "wait.generation")
        s = wait.signal
        if s.dtype != torch.int32 or s.device != device or s.numel() < num_chunks:
            raise ValueError(f"matmul: wait.signal is {s.dtype} with {s.numel()} elements on {s.device}; "
                             f"need int32 with >= num_chunks={num_chunks} elements on {device}")
        if wait.error is not None and (wait.error.dtype != torch.int32 or wait.error.numel() < ERROR_WORDS):
            raise ValueError(f"matmul: wait.error must be int32 with {ERROR_WORDS} words; use new_error_word()")
    if epilogue is not None:
        _check_generation(epilogue.generation, "epilogue.generation")
        if epilogue.base.dtype != a.dtype or epilogue.base.device != device:
            raise ValueError(f"matmul: epilogue.base is {epilogue.base.dtype} on {epilogue.base.device}; "
                             f"need {a.dtype} on {device} (the destinations' dtype)")
        for nm, t, dt in (("dest_offsets", epilogue.dest_offsets, torch.int64),
                          ("signal_ptrs", epilogue.signal_ptrs, torch.int64),
                          ("counters", epilogue.counters, torch.int32)):
            if t.dtype != dt or t.numel() < num_chunks or t.device != device:
                raise ValueError(f"matmul: epilogue.{nm} is {t.dtype} with {t.numel()} elements on {t.device}; "
                                 f"need {dt} with >= num_chunks={num_chunks} elements on {device}")

    cfg = plan.cfg
    err = None
    if wait is not None:
        err = wait.error if wait.error is not None else new_error_word(device)
    if plan.ws:
        from .kernels import gemm_ws
        block, stages = plan.ws
        common = dict(chunk_m=plan.chunk_m, start_chunk=plan.start_chunk, tile_order=tile_order, block=block,
                      group_m=cfg.GROUP_M, stages=stages, grid=plan.grid[0])
        if epilogue is not None:
            gemm_ws.launch(a, b, dests=epilogue.dests, stacked=plan.epi_tma == _triton()[2].EPI_TMA_STACKED.value,
                           counters=epilogue.counters, signal_ptrs=epilogue.signal_ptrs,
                           generation=epilogue.generation, epi_descs=_epilogue_descriptors(epilogue, plan), **common)
            return None
        gemm_ws.launch(a, b, out=out, wait_signal=wait.signal, wait_gen=wait.generation,
                       wait_timeout_ns=wait.timeout_ns, err=err, **common)
        if check:
            check_error_word(err, rank=wait.rank, timeout_ns=wait.timeout_ns)
        return out
    bm, bn, bk = cfg.BLOCK_M, cfg.BLOCK_N, cfg.BLOCK_K
    if plan.use_tma:
        from triton.tools.tensor_descriptor import TensorDescriptor
        a_arg = TensorDescriptor(a, [m, k], [a.stride(0), 1], [bm, bk])
        if plan.b_kmajor:
            b_arg = TensorDescriptor(b, [n, k], [b.stride(1), 1], [bn, bk])
        else:
            b_arg = TensorDescriptor(b, [k, n], [b.stride(0), 1], [bk, bn])
        c_arg = (TensorDescriptor(out, [m, n], [out.stride(0), 1], [bm, bn // cfg.EPI_SUBTILE])
                 if epilogue is None and cfg.tma_store else out)
    else:
        a_arg, b_arg, c_arg = a, b, out
    if epilogue is not None:
        c_arg = epilogue.base   # typed origin of the destinations' offsets

    args = [
        a_arg, b_arg, c_arg, m, n, k,
        a.stride(0), a.stride(1), b.stride(0), b.stride(1),
        out.stride(0) if out is not None else 0, out.stride(1) if out is not None else 0,
        plan.chunk_m, num_chunks, plan.start_chunk,
        wait.signal if wait else None, wait.generation if wait else 0,
        (wait.timeout_ns if plan.use_asm else wait.max_spins) if wait else 0, err,
        epilogue.dest_offsets if epilogue else None, epilogue.dest_stride if epilogue else 0,
        epilogue.signal_ptrs if epilogue else None, epilogue.counters if epilogue else None,
        epilogue.generation if epilogue else 0,
        *_epilogue_descriptor_args(epilogue, plan),
        *(_split_k_buffers(plan, device) if cfg.split_k > 1 or plan.sk_tiles else (None, None)),
        plan.sk_tiles,
    ]
    _launch(plan, key, args, device)
    if wait is not None and check:
        check_error_word(err, rank=wait.rank, timeout_ns=wait.timeout_ns if plan.use_asm else None)
    return out if epilogue is None else None
