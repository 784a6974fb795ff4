"""GEMM configurations and the heuristics that pick them: pure functions, no device, no Triton.

:class:`GemmConfig` is one kernel configuration (tile, pipeline depth, epilogue subtiles,
stream-K); :func:`default_config` is the heuristic used when the tuning cache has no entry;
:func:`candidate_configs` is the tuning space of one shape. :class:`GemmOptions` holds the
switches of the launch paths (inline PTX signals, TMA epilogue stores, the epilogue count,
the Gluon kernel, the direct launch): callers pass them explicitly; nothing is read from the
environment.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Optional

import torch

from ..kernels import _types

__all__ = ["GemmConfig", "GemmOptions", "default_config", "candidate_configs", "fit_shared_memory", "stream_k_tiles",
           "SUPPORTED_DTYPES"]

SUPPORTED_DTYPES = _types.INPUT_DTYPES   # the kernels' input dtypes (kernels/_types.py)

# Shared memory per block on sm_90 with the opt-in limit (CUDA guide, H100/H200: 227 KiB).
_SM90_SMEM_BYTES = 232448
# Streaming multiprocessors of the NVIDIA H200 SXM (the GPU the heuristics were measured on);
# the pure heuristics take it as an argument, matmul() passes the real device's count.
_H200_NUM_SMS = 132
# Its compute capability (sm_90): the Gluon kernel's candidates are sm_90's
_H200_CAPABILITY = (9, 0)


# --------------------------------------------------------------------------------------------
# configs
# --------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class GemmConfig:
    """One kernel configuration. Tile = BLOCK_M x BLOCK_N x BLOCK_K; the epilogue stores the
    tile in ``EPI_SUBTILE`` column slices (1 or 2); ``num_programs`` caps the persistent grid
    (None: one program per SM; ``matmul(num_sms=...)`` caps it further). ``stream_k`` 1 or 2 shares the tiles of the
    last, partly filled wave (2: that wave and one full wave more) out to every program by
    BLOCK_K steps, so no SM idles at the end (docs/gemm_core.md, "Kernels"); 0 = off.
    ``tma_store`` False keeps TMA loads but stores the output through pointers: no staging
    buffer, so its shared memory can hold one more pipeline stage (hooks and plain-pointer
    launches are not affected).

    ``gluon`` True: plain calls run the warp-specialized Gluon kernel (gemm_ws) instead of
    gemm_kernel; sm_90, fp8, 128-row tiles 128 or 256 wide, K-steps of 128. The Gluon kernel
    takes this config's tile and GROUP_M and its own pipeline depth (3 stages of 128x256, 5 of
    128x128; ``launch.ws_choice``); where it cannot run (another GPU, 16/32-bit inputs, b not
    K-major, an output not stored by TMA) the call runs gemm_kernel with the rest of the config,
    ``num_stages`` included. Hooked calls keep ``ws_choice``'s own rule. The tuner offers it
    for fp8 on sm_90 (:func:`candidate_configs`) and keeps it where it is faster.

    ``pingpong`` True (with ``gluon`` True and a 128x128x128 tile): where the Gluon kernel would
    run an fp8 call at 128x128x128 -- plain, with one hook, with ``tile_records`` -- its
    ping-pong variant runs it (gemm_pp: two consumer warpgroups on alternate 128x128 tiles, one's
    epilogue under the other's MMAs; its own stages, :data:`PINGPONG_STAGES`; the hooks in
    gemm_ws's warps and code; ``launch.pp_choice`` says why). Plain calls: bitwise gemm_kernel
    in the GPU tests (one H200 run); hooked calls and records: offline sm_90 compile only, not
    run on a GPU."""
    BLOCK_M: int = 128
    BLOCK_N: int = 256
    BLOCK_K: int = 64
    GROUP_M: int = 8
    num_warps: int = 8
    num_stages: int = 3
    EPI_SUBTILE: int = 1
    flatten: bool = False
    num_programs: Optional[int] = None
    stream_k: int = 0
    tma_store: bool = True
    gluon: bool = False
    pingpong: bool = False

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
        if self.stream_k not in (0, 1, 2):
            raise ValueError(f"GemmConfig.stream_k={self.stream_k!r}: must be 0 (off), 1 (the last partial "
                             "wave) or 2 (the last partial wave and one full wave)")
        if not isinstance(self.gluon, bool):
            raise TypeError(f"GemmConfig.gluon={self.gluon!r}: must be a bool")
        if self.gluon:
            self._check_gluon()
        if not isinstance(self.pingpong, bool):
            raise TypeError(f"GemmConfig.pingpong={self.pingpong!r}: must be a bool")
        if self.pingpong and (not self.gluon or (self.BLOCK_M, self.BLOCK_N, self.BLOCK_K) != (128, 128, 128)):
            raise ValueError(f"GemmConfig(pingpong=True) with gluon={self.gluon} and a {self.BLOCK_M}x{self.BLOCK_N}x"
                             f"{self.BLOCK_K} tile: the ping-pong kernel (gemm_pp) is a Gluon kernel of 128x128x128 "
                             "tiles; pass gluon=True with BLOCK_M=BLOCK_N=BLOCK_K=128, or pingpong=False")

    def _check_gluon(self) -> None:
        """What the Gluon kernel (kernels/gemm_ws.py) cannot run: other tiles, stream-K,
        subtiled or pointer stores (it stores whole tiles by TMA), a fused tile/K loop."""
        if self.BLOCK_M != 128 or self.BLOCK_N not in (128, 256) or self.BLOCK_K != 128:
            raise ValueError(f"GemmConfig(gluon=True) with a {self.BLOCK_M}x{self.BLOCK_N}x{self.BLOCK_K} tile: "
                             "the Gluon kernel takes 128x128x128 or 128x256x128 (fp8 K-steps of 128); pass one "
                             "of those or gluon=False")
        for name, off in (("stream_k", 0), ("EPI_SUBTILE", 1), ("flatten", False), ("tma_store", True)):
            if getattr(self, name) != off:
                raise ValueError(f"GemmConfig(gluon=True) with {name}={getattr(self, name)!r}: the Gluon kernel "
                                 "has no stream-K, stores whole tiles by TMA and keeps its own loops; pass "
                                 f"{name}={off!r} or gluon=False")

    def smem_bytes(self, elem_size: int, out_elem_size: Optional[int] = None) -> int:
        """Shared memory estimate: pipelined A and B stages of ``elem_size``-byte inputs plus one
        TMA-store subtile of ``out_elem_size``-byte outputs (default: the inputs'; none with
        ``tma_store=False``: the pointer store's layout conversion reuses the stages; two with
        ``pingpong``: one per consumer)."""
        out_elem_size = elem_size if out_elem_size is None else out_elem_size
        stages = (self.BLOCK_M + self.BLOCK_N) * self.BLOCK_K * elem_size * self.num_stages
        staging = self.BLOCK_M * (self.BLOCK_N // self.EPI_SUBTILE) * out_elem_size if self.tma_store else 0
        return stages + staging * (2 if self.pingpong else 1)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "GemmConfig":
        """Inverse of :meth:`to_dict`; fields missing from ``d`` (entries written before they
        existed, e.g. ``stream_k``) take their defaults; removed fields: see ``_REMOVED_FIELDS``."""
        names = {f.name for f in dataclasses.fields(cls)}
        for name, off in _REMOVED_FIELDS.items():   # entries written when the field existed
            if name in d:
                if d[name] != off:
                    raise ValueError(f"GemmConfig.from_dict: {name}={d[name]!r} is no longer supported "
                                     f"(removed; docs/gemm_core.md, 'Tried and not kept')")
                d = {key: v for key, v in d.items() if key != name}
        unknown = set(d) - names
        if unknown:
            raise ValueError(f"GemmConfig.from_dict: unknown fields {sorted(unknown)}")
        return cls(**d)


# Fields GemmConfig had once, with the value that meant "off": an entry of an older tuning
# cache with the field off still loads; one with it on is refused (the feature is gone).
_REMOVED_FIELDS = {"warp_specialize": False, "split_k": 1}


def default_config(m: int, n: int, k: int, dtype: torch.dtype = _types.HEURISTIC_DTYPE,
                   num_sms: int = _H200_NUM_SMS) -> GemmConfig:
    """Heuristic config for one GEMM shape (pure; used when the tuning cache has no entry).

    From the tuning winners on one NVIDIA H200, bf16, per-rank Llama-3 shapes at TP 8
    (the deep-stages tuning log of 2026-11-30, in git history up to a1b897c): 128x256x64
    tiles, 8 warps, 3 stages for M >= 2048; 128x128x64 with 6 stages when 128x256 tiles leave
    most SMs idle (M=512, N=3584: 56 tiles for 132 SMs; one tile per SM and cold inputs want
    many loads in flight); decode (M <= 128) streams B through deep pipelines, with narrow tiles
    when B is small (8B: 64x64x128 x 6 stages) and wider ones as B grows (70B: 128x64x64 x 8,
    405B: 128x128x64 x 5). ``num_sms`` is not used by the tile choice today (kept so the
    heuristic can depend on the grid, as stream-K's candidates do).

    fp8 (1-byte inputs, not yet measured: the lead's fp8 GEMM benchmark tunes them): the same
    tiles with BLOCK_K doubled, 128 where bf16 takes 64 -- the same bytes per pipeline stage and
    the usual fp8 K-step on Hopper (one wgmma takes K = 32 of fp8) -- and the stages that fit
    beside a bf16 staging buffer.
    """
    if _types.is_fp8(dtype):
        return _fp8_tiles(m, n, k)
    return _default_tiles(m, n, k, dtype)


def _fp8_tiles(m: int, n: int, k: int) -> GemmConfig:
    if m <= 128:
        if n * k >= 100_000_000:
            return GemmConfig(BLOCK_M=128, BLOCK_N=128, BLOCK_K=128, num_warps=8, num_stages=5)
        if n * k >= 25_000_000:
            return GemmConfig(BLOCK_M=128, BLOCK_N=64, BLOCK_K=128, num_warps=4, num_stages=8)
        return GemmConfig(BLOCK_M=64, BLOCK_N=64, BLOCK_K=256, num_warps=4, num_stages=6)
    if -(-m // 128) * -(-n // 256) < 100:
        return GemmConfig(BLOCK_M=128, BLOCK_N=128, BLOCK_K=128, num_warps=8, num_stages=6)
    return GemmConfig(BLOCK_M=128, BLOCK_N=256, BLOCK_K=128, num_warps=8, num_stages=3)


def _grid(m: int, n: int, k: int, cfg: GemmConfig) -> tuple[int, int]:
    """(output tiles, BLOCK_K steps) of ``cfg`` on an ``m x n x k`` GEMM."""
    return -(-m // cfg.BLOCK_M) * -(-n // cfg.BLOCK_N), -(-k // cfg.BLOCK_K)


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


def candidate_configs(m: int, n: int, k: int, dtype: torch.dtype = _types.HEURISTIC_DTYPE,
                      smem_limit: int = _SM90_SMEM_BYTES,
                      num_sms: int = _H200_NUM_SMS, capability: tuple = _H200_CAPABILITY) -> list[GemmConfig]:
    """Small tuning space for one shape, pruned by shared memory; stream-K variants only for
    shapes whose tiles end in a partly filled wave (:func:`_stream_k_candidates`). fp8: the
    16-bit space with BLOCK_K doubled (the same bytes per stage; BLOCK_K 128 for most tiles),
    a bf16 output's staging buffer counted, plus one more stage (stream-K: one and two more)
    where they fit, and on sm_90 (``capability`` major 9) the Gluon kernel's variants
    (:func:`_gluon_candidates`)."""
    elem = _types.element_size(dtype)
    if _types.is_fp8(dtype):
        base = candidate_configs(m, n, k, _types.HEURISTIC_DTYPE, smem_limit=10**9, num_sms=num_sms,
                                 capability=capability)
        out = [dataclasses.replace(c, BLOCK_K=min(2 * c.BLOCK_K, 256)) for c in base]
        # stream-K: two stages deeper as well (the 16-bit space has one depth per stream-K
        # tile; the plain 128x128 tiles have four). H200, 405B fc1 M=512 tensor-wise (208 tiles
        # of 128x256 on 132 SMs), 7 paired CUDA-graph rounds: 128x128x128 stream-K with 6
        # stages 0.903 of torch._scaled_mm, the best candidate without them (128x256x128, 4
        # stages) 0.823
        out += [dataclasses.replace(c, num_stages=c.num_stages + d) for c in out
                for d in ((1, 2) if c.stream_k else (1,))]
        if capability[0] == 9:   # the Gluon kernel's wgmma is sm_90's
            out += _gluon_candidates(out)
        out_elem = _types.element_size(_types.FP8_DEFAULT_OUT)
        return [c for c in dict.fromkeys(out) if c.smem_bytes(elem, out_elem) <= smem_limit]
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
    out += _stream_k_candidates(m, n, k, num_sms)
    # dict.fromkeys: once each (the decode and prefill lists share tiles), in first-seen order
    return [c for c in dict.fromkeys(out) if c.smem_bytes(elem) <= smem_limit]


# The Gluon kernel's pipeline depth per tile width (launch.ws_choice): as many stages as fit
# beside a 16-bit output's staging buffer in sm_90's 227 KiB, for 128-row tiles of K-steps
# 64 (bf16) or 128 (fp8): the same bytes per stage.
GLUON_STAGES = {256: 3, 128: 5}
# The ping-pong kernel's (gemm_pp) per output element size: as many 32 KiB fp8 stages of
# 128x128x128 as fit beside its two 128x128 staging buffers in sm_90's 227 KiB (232448 bytes,
# less ~1 KiB of barriers and the row-wise scales' layout conversion): 16-bit out 2 x 32 KiB,
# 5 stages; float32 out 2 x 64 KiB, 3 (offline sm_90 compile: 230552 and 230520 bytes row-wise).
PINGPONG_STAGES = {2: 5, 4: 3}


def _gluon_candidates(configs: list[GemmConfig]) -> list[GemmConfig]:
    """gluon=True variants of fp8 candidates the Gluon kernel can take: one per (BLOCK_N,
    GROUP_M) of the 128x128x128 and 128x256x128 tiles among ``configs``, at the stages it runs
    (:data:`GLUON_STAGES`; other stages would time the same kernel again). Why: carrying the
    wait hook, the Gluon kernel was faster than the plain gemm_kernel call on 14 of the 24
    training/prefill rows of the fp8 GEMM benchmark (H200, 2438ed7,
    benchmarks/results/gemm_core_fp8_h200.json; 8B fc2 train row-wise by 6.9 %). As plain calls
    (the same benchmark at 8a0facf) the tuner kept them on 7 of the 60 rows.

    And the ping-pong variant (``pingpong=True``, gemm_pp) once per GROUP_M of the 128x128x128
    tiles among ``configs``: torch's row-wise ``_scaled_mm`` (CUTLASS's ping-pong schedule) was
    ~17 % faster than the Gluon kernel on M=16384 N=4096 K=1792 (issue 29), and gemm_ws's MMA
    warps idle through each tile's epilogue (5-10 % on short-K shapes). The fp8 benchmark at
    8a0facf: kept on 15 of the 60 rows (8B fc2 train row-wise 0.890 of _scaled_mm, 0.78-0.83 in
    gemm_kernel)."""
    keys = dict.fromkeys((c.BLOCK_N, c.GROUP_M) for c in configs
                         if c.BLOCK_M == 128 and c.BLOCK_N in GLUON_STAGES and c.BLOCK_K == 128 and not c.stream_k)
    out = [GemmConfig(BLOCK_M=128, BLOCK_N=bn, BLOCK_K=128, GROUP_M=group_m, num_warps=8,
                      num_stages=GLUON_STAGES[bn], gluon=True) for bn, group_m in keys]
    return out + [dataclasses.replace(c, pingpong=True) for c in out if c.BLOCK_N == 128]


# Tiles that stream-K candidates are made of: the prefill winners (128x256 with the epilogue
# in two subtiles, so the reduction holds half a tile of partials at a time; 128x128 with
# BLOCK_K 128 and 64) and, for decode-sized M, the narrow tiles that stream B.
# All keep <= 128 fp32 accumulator registers per thread, so adding partials does not spill.
_STREAM_K_BASES = (
    GemmConfig(BLOCK_M=128, BLOCK_N=256, BLOCK_K=64, num_warps=8, num_stages=3, EPI_SUBTILE=2),
    GemmConfig(BLOCK_M=128, BLOCK_N=128, BLOCK_K=128, num_warps=8, num_stages=3),
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




def fit_shared_memory(cfg: GemmConfig, elem_size: int, out_elem_size: int, limit: int) -> GemmConfig:
    """``cfg`` fitted into ``limit`` bytes of shared memory (:meth:`GemmConfig.smem_bytes`'
    estimate) for inputs and outputs of these element sizes: ``cfg`` itself when it fits; else
    its TMA store in two column halves (``EPI_SUBTILE=2``: half the staging buffer, the same
    values stored) if that fits, else also fewer pipeline stages (at least 1). Why: a config is
    kept per shape and input dtype (the tuning cache, ``default_config``), but its staging buffer
    grows with the output's element size -- fp8 128x128x128 with 6 stages fits beside a bf16
    tile (224 KiB), not beside a float32 one (256 KiB, more than sm_90's 227); 128x256x128 with
    3 stages neither (272 KiB)."""
    if cfg.smem_bytes(elem_size, out_elem_size) <= limit:
        return cfg
    if cfg.tma_store and cfg.EPI_SUBTILE == 1 and not cfg.gluon:
        cfg = dataclasses.replace(cfg, EPI_SUBTILE=2)
    while cfg.num_stages > 1 and cfg.smem_bytes(elem_size, out_elem_size) > limit:
        cfg = dataclasses.replace(cfg, num_stages=cfg.num_stages - 1)
    return cfg


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



@dataclass(frozen=True)
class GemmOptions:
    """Switches of the launch paths, for benchmarks and tests that compare them; the defaults
    are the product. Part of every plan's key, so two options objects never share a plan.

    ============== ========= =====================================================================
    field          default   off / other values
    ============== ========= =====================================================================
    signal_asm     True      False: the hooks' signal primitives without inline PTX (the
                             interpreter's atomics-only variant, also on CUDA; spin-count bound)
    epi_tma        True      False: the epilogue hook stores through pointers, never by TMA
    epi_count      "auto"    how the epilogue hook counts stored tiles: "auto" (4 in flattened
                             tile loops, else 3, where every tile lies in one chunk; else 1),
                             "after_loop" (3 where 4 would be taken), "returning" (always 1)
    gluon          True      False: never the warp-specialized Gluon kernel (gemm_ws), for hooks
                             or for configs that ask for it (GemmConfig.gluon)
    direct_launch  True      False: every launch through Triton's JIT (no cached direct launch)
    ============== ========= =====================================================================
    """
    signal_asm: bool = True
    epi_tma: bool = True
    epi_count: str = "auto"
    gluon: bool = True
    direct_launch: bool = True

    def __post_init__(self):
        for name in ("signal_asm", "epi_tma", "gluon", "direct_launch"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"GemmOptions.{name}={getattr(self, name)!r}: must be a bool")
        if self.epi_count not in EPI_COUNT_CHOICES:
            raise ValueError(f"GemmOptions.epi_count={self.epi_count!r}: choose one of {EPI_COUNT_CHOICES}")


EPI_COUNT_CHOICES = ("auto", "after_loop", "returning")
DEFAULT_OPTIONS = GemmOptions()
