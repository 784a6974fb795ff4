"""Plans and launches of the GEMM core: :func:`matmul` validates a call once per signature,
keeps what it decided in a :class:`LaunchPlan` (which kernel, which grid, which epilogue
stores and counts, and why), and launches ``gemm_kernel`` (``tpfuse/kernels/gemm.py``) or,
on sm_90, for one hook or a plain fp8 call whose config asks for it (``GemmConfig.gluon``), the
warp-specialized Gluon kernel (``tpfuse/kernels/gemm_ws.py``; :func:`ws_choice` decides) or, for
an fp8 call whose config asks for that too (``GemmConfig.pingpong``), its ping-pong variant
(``tpfuse/kernels/gemm_pp.py``; :func:`pp_choice`).

The first launch of a kernel specialization goes through Triton's JIT (which compiles and
caches); later ones call the compiled kernel directly, skipping the JIT's argument binding --
tens of microseconds of host time per call that decode-sized GEMMs cannot hide.
:func:`launch_counts` says which path each launch took.

Nothing here touches a GPU or imports Triton at import time.
"""
from __future__ import annotations

import collections
import dataclasses
import functools
import threading
from dataclasses import dataclass
from typing import Optional

import torch

from .._direct import launch_tma
from ..kernels import _types, abi
from . import cache
from .config import (DEFAULT_OPTIONS, GLUON_STAGES, PINGPONG_STAGES, GemmConfig, GemmOptions, default_config,
                     fit_shared_memory, stream_k_tiles)
from .device import device_index, device_info, interpreting, num_sms, triton_modules, warn_once
from .hooks import ERROR_WORDS, MAX_GENERATION, EpilogueSpec, WaitSpec, check_error_word, new_error_word, stacked_dests
from .spec import CompileSpec, PersistentSpec

__all__ = ["matmul", "PreparedMatmul", "LaunchPlan", "last_plan", "launch_counts", "clear_plans", "tile_records_for",
           "TILE_ORDERS"]

TILE_ORDERS = abi.TILE_ORDERS
_SCALE_NAMES = {_types.SCALE_NONE: "none", _types.SCALE_TENSOR: "tensor-wise", _types.SCALE_VECTOR: "row-wise"}


# --------------------------------------------------------------------------------------------
# the plan
# --------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class LaunchPlan:
    """What one call signature launches, and why (:meth:`explain`). ``kernel``: "gemm_kernel",
    "gemm_ws_kernel" (the Gluon kernel), "gemm_pp_kernel" (its ping-pong variant, fp8
    calls) or "none" (empty M, N or K: nothing to launch).
    ``config``: the GemmConfig asked for or chosen (``config_source`` says which: "argument",
    "tuning cache", "tuning cache (wait hook)" or "tuning cache (epilogue hook)" -- a hooked
    call takes the config :func:`tpfuse.gemm.tune` kept for its hook, if any -- or "heuristic");
    the Gluon kernels take its tile and GROUP_M and their own ``ws_block`` / ``ws_stages``.
    ``grid[0]``: persistent programs. ``epi_tma``: the epilogue hook's TMA descriptors (0:
    pointer stores; ``abi.EPI_TMA_STACKED``: one over stacked destinations). ``epi_count``:
    gemm_kernel's epilogue count (``abi.EPI_COUNT_*``; 0 without the hook). ``sk_tiles``: tiles
    shared out by K-steps (stream-K).

    The launched kernel's tile grid (the rows of ``matmul(tile_records=...)``): ``tile_shape``
    (BLOCK_M, BLOCK_N: the config's, or the Gluon kernel's ``ws_block``), ``tile_grid``
    (M-tiles, N-tiles), ``num_tiles``, and :meth:`tile_box` (tile id -> its rows and columns).
    ``record_tiles``: the launch writes per-tile records (RECORD_TILES).

    ``out_dtype``: the output's dtype (the inputs' own, or for fp8 inputs the one asked for);
    ``scale_a`` / ``scale_b``: the scale modes (``kernels/_types.py`` ``SCALE_*``).
    ``spec``: gemm_kernel family's compile spec, projected to the variant launched
    (:mod:`tpfuse.gemm.spec`; ``variant`` names its kernel); None for the Gluon kernel."""
    m: int
    n: int
    k: int
    config: GemmConfig
    kernel: str = "gemm_kernel"
    config_source: str = "argument"
    options: GemmOptions = DEFAULT_OPTIONS
    b_kmajor: bool = False
    use_tma: bool = False
    grid: tuple = (1, 1, 1)
    tile_order: str = "grouped"
    chunk_m: int = 1
    num_chunks: int = 1
    start_chunk: int = 0
    use_asm: bool = False
    num_tiles: int = 0
    sk_tiles: int = 0
    epi_tma: int = 0
    epi_count: int = 0
    ws_block: tuple = ()
    ws_stages: int = 0
    record_tiles: bool = False
    reasons: tuple = ()
    out_dtype: Optional[torch.dtype] = None
    scale_a: int = _types.SCALE_NONE
    scale_b: int = _types.SCALE_NONE
    spec: Optional[PersistentSpec] = dataclasses.field(default=None, repr=False)

    @property
    def variant(self) -> str:
        """The Triton kernel launched: "gemm_kernel", "gemm_sk_kernel", "gemm_hooked_kernel",
        "gemm_ws_kernel", "gemm_pp_kernel" (Gluon) or "none"."""
        return self.spec.KERNEL if self.spec is not None and self.kernel == "gemm_kernel" else self.kernel

    @property
    def programs(self) -> int:
        return self.grid[0]

    @property
    def tile_shape(self) -> tuple[int, int]:
        """(BLOCK_M, BLOCK_N) of the launched kernel's tiles."""
        return tuple(self.ws_block[:2]) if self.ws_block else (self.config.BLOCK_M, self.config.BLOCK_N)

    @property
    def tile_grid(self) -> tuple[int, int]:
        """(M-tiles, N-tiles) of the launched kernel: tile ``t`` is M-tile ``t // tile_grid[1]``,
        N-tile ``t % tile_grid[1]``; ``num_tiles`` is their product."""
        bm, bn = self.tile_shape
        return -(-self.m // bm), -(-self.n // bn)

    def tile_box(self, tile: int) -> tuple[int, int, int, int]:
        """``(row_lo, row_hi, col_lo, col_hi)`` of the output that tile ``tile`` (the row of a
        tile record, ``abi.REC_TILE``) computes, clipped to M and N; its rows touch chunks
        ``row_lo // chunk_m`` to ``(row_hi - 1) // chunk_m``."""
        if not 0 <= tile < self.num_tiles:
            raise ValueError(f"LaunchPlan.tile_box: tile={tile}; this plan has tiles 0..{self.num_tiles - 1}")
        (bm, bn), grid_n = self.tile_shape, self.tile_grid[1]
        pid_m, pid_n = divmod(tile, grid_n)
        return pid_m * bm, min((pid_m + 1) * bm, self.m), pid_n * bn, min((pid_n + 1) * bn, self.n)

    def explain(self) -> str:
        """A few lines: the kernel, tile, grid, stores and counts, and the reasons behind them."""
        cfg = self.config
        tile = (f"{self.ws_block[0]}x{self.ws_block[1]}x{self.ws_block[2]}, {self.ws_stages} stages"
                if self.ws_block else
                f"{cfg.BLOCK_M}x{cfg.BLOCK_N}x{cfg.BLOCK_K}, {cfg.num_stages} stages, {cfg.num_warps} warps")
        variant = f"{self.variant}, " if self.variant != self.kernel else ""
        dtypes = "" if self.out_dtype is None else f"out {_types.dtype_name(self.out_dtype)}"
        if self.scale_a or self.scale_b:
            dtypes += (f", scale_a {_SCALE_NAMES[self.scale_a]}, scale_b "
                       + _SCALE_NAMES[self.scale_b].replace("row", "column"))
        lines = [f"{self.m}x{self.n}x{self.k}: {self.kernel} ({tile}; config from {self.config_source}), "
                 f"{variant}{self.programs} programs over {self.num_tiles} tiles, tile order {self.tile_order!r}, "
                 f"{self.num_chunks} chunk(s) of {self.chunk_m} rows" + (f"; {dtypes}" if dtypes else ""),
                 f"  loads: {'TMA' if self.use_tma else 'pointers'}; b {'k-major' if self.b_kmajor else 'n-major'}"
                 + (f"; stream-K over the last {self.sk_tiles} tiles" if self.sk_tiles else "")]
        if self.epi_count or self.epi_tma:
            stores = ("pointer stores" if not self.epi_tma else "one TMA descriptor over stacked destinations"
                      if self.epi_tma == abi.EPI_TMA_STACKED else f"{self.epi_tma} TMA descriptors")
            lines.append(f"  epilogue hook: {stores}; count mode {self.epi_count}")
        if self.record_tiles:
            lines.append(f"  per-tile records: {self.num_tiles} rows, a {self.tile_grid[0]}x{self.tile_grid[1]} grid "
                         f"of {self.tile_shape[0]}x{self.tile_shape[1]} tiles")
        lines += [f"  - {r}" for r in self.reasons]
        return "\n".join(lines)


_PLANS: dict = {}            # call signature -> LaunchPlan
_PLANS_EPOCH = [0]           # clear_plans() count: a PreparedMatmul's kept launch is of one epoch
_LAST_PLAN: list = [None]    # the plan of the latest call (last_plan())
# this thread's latest direct Gluon launch's parts, for PreparedMatmul (per thread: another
# thread's launch must never be taken for this one's)
_LAST_WS_LOCAL = threading.local()
_MAX_PLANS = 4096            # a bound, not a tuned number: plans are small, shapes in a model are few
_STREAM_K_BUFFERS: dict = {}  # (device, raw stream) -> (fp32 workspace, int32 tile counters)
_COMPILED: dict = {}         # kernel specialization -> its tpfuse._direct.Direct (direct launch)
_LAUNCHES = collections.Counter()   # launch_counts()
_DIRECT_BROKEN: list = [False]      # a direct launch failed once: the JIT from then on (warned)


def last_plan() -> Optional[LaunchPlan]:
    """The :class:`LaunchPlan` of the latest :func:`matmul` call in this process (None before any)."""
    return _LAST_PLAN[0]


def launch_counts() -> dict:
    """Launches so far by path: ``"jit"`` (through Triton's JIT: the first of a specialization,
    or every one with ``GemmOptions(direct_launch=False)``), ``"direct"`` (the cached compiled
    kernel called directly; ``"direct_tma"`` counts those of them that took the Gluon kernel's
    descriptors expanded by tpfuse, no descriptor objects built: tpfuse/_direct.py, launch_tma),
    ``"interpreter"`` (TRITON_INTERPRET=1), and ``"compiled"`` (distinct compiled kernels the JIT
    launches returned). A copy; compare two calls' counts."""
    return dict(_LAUNCHES)


def clear_plans() -> None:
    """Forget every plan (the next call of each signature decides again, e.g. after tuning),
    and every :class:`PreparedMatmul`'s kept launch with them."""
    _PLANS.clear()
    _PLANS_EPOCH[0] += 1


def tile_records_for(m: int, n: int, config_or_plan: GemmConfig | LaunchPlan,
                     device: torch.device | str | None = None) -> torch.Tensor:
    """An int64 ``[rows, abi.TILE_RECORD_COLUMNS]`` tensor of -1 for ``matmul(a [m, K], b [K, n],
    ..., tile_records=)``.

    With a :class:`LaunchPlan` (``last_plan()`` of a call of the same signature: records change
    nothing a plan decides), ``rows = plan.num_tiles``. With the call's :class:`GemmConfig`,
    enough rows for either kernel: its tiles, or, for a 128x256 config, the 128x128 tiles the
    Gluon kernel may take instead (``ws_choice``); rows past ``last_plan().num_tiles`` then stay
    -1."""
    if isinstance(config_or_plan, LaunchPlan):
        if (config_or_plan.m, config_or_plan.n) != (m, n):
            raise ValueError(f"tile_records_for: the plan is for M={config_or_plan.m}, N={config_or_plan.n}, "
                             f"not M={m}, N={n}; pass the plan of this call's shapes")
        rows = config_or_plan.num_tiles
    elif isinstance(config_or_plan, GemmConfig):
        bm, bn = config_or_plan.BLOCK_M, config_or_plan.BLOCK_N
        if (bm, bn) == (128, 256):
            bn = 128
        rows = -(-m // bm) * -(-n // bn)
    else:
        raise TypeError(f"tile_records_for: config_or_plan is {type(config_or_plan).__name__}; pass the call's "
                        "GemmConfig (e.g. default_config(...)) or a LaunchPlan (last_plan())")
    return torch.full((rows, abi.TILE_RECORD_COLUMNS), -1, dtype=torch.int64, device=device)


# --------------------------------------------------------------------------------------------
# validation
# --------------------------------------------------------------------------------------------
def _check_operands(a, b, out, out_dtype=None):
    """(b_kmajor, the output's dtype) of a valid call; raises naming the argument otherwise."""
    for name, t in (("a", a), ("b", b)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"matmul: {name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 2:
            raise ValueError(f"matmul: {name} must be 2-D, got shape {tuple(t.shape)}; flatten leading dims first")
    names = ", ".join(_types.dtype_name(d) for d in _types.INPUT_DTYPES)
    if a.dtype not in _types.INPUT_DTYPES:
        raise TypeError(f"matmul: a.dtype={a.dtype} is not supported; use one of {names}")
    fp8 = _types.is_fp8(a.dtype)
    if fp8 and (a.dtype, b.dtype) not in _types.FP8_PAIRS:
        pairs = ", ".join(f"{_types.dtype_name(x)} x {_types.dtype_name(y)}" for x, y in _types.FP8_PAIRS)
        raise TypeError(f"matmul: a.dtype={a.dtype} with b.dtype={b.dtype}; fp8 operands pair as {pairs} "
                        "(torch._scaled_mm's); cast b")
    if not fp8 and b.dtype != a.dtype:
        raise TypeError(f"matmul: b.dtype={b.dtype} differs from a.dtype={a.dtype}; cast one of them")
    if a.shape[1] != b.shape[0]:
        raise ValueError(f"matmul: a is {tuple(a.shape)} and b is {tuple(b.shape)}; need a [M, K] and b [K, N]")
    if a.device != b.device:
        raise ValueError(f"matmul: a is on {a.device} and b on {b.device}; move them to one device")
    if a.device.type != "cuda" and not interpreting():
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
    m, k = a.shape
    n = b.shape[1]
    if out_dtype is None:   # fp8: torch._scaled_mm's default; else the inputs' own dtype
        out_dtype = _types.FP8_DEFAULT_OUT if fp8 else a.dtype
    if not isinstance(out_dtype, torch.dtype) or out_dtype not in _types.FP8_OUT_DTYPES:
        outs = ", ".join(_types.dtype_name(d) for d in _types.FP8_OUT_DTYPES)
        raise TypeError(f"matmul: out_dtype={out_dtype!r}; choose one of {outs} (fp8 outputs are not produced)")
    if fp8:
        q = _types.FP8_MULTIPLE
        if k % q or n % q:
            raise ValueError(f"matmul: fp8 a {tuple(a.shape)} @ b {tuple(b.shape)}: K={k} and N={n} must be "
                             f"multiples of {q} (fp8 tensor-core MMAs and 16-byte TMA rows, as torch._scaled_mm "
                             f"asks); pad K (zeros in a and b) and N (zero columns of b) to multiples of {q}")
        if not b_kmajor and n > 1:
            raise ValueError(f"matmul: fp8 b has strides {b.stride()}; fp8 MMAs read b column-major: pass "
                             "weight.t() of a contiguous [N, K] weight (as torch._scaled_mm asks)")
    if out is not None:
        if out.shape != (m, n) or out.dtype != out_dtype or out.device != a.device:
            raise ValueError(f"matmul: out is {tuple(out.shape)} {out.dtype} on {out.device}; "
                             f"need ({m}, {n}) {out_dtype} on {a.device}")
        if out.stride(1) != 1 and n > 1:
            raise ValueError(f"matmul: out has strides {out.stride()}; need unit column stride")
    return b_kmajor, out_dtype


def _scale_mode(scale, name, rows, cols, dim):
    """The kernels' SCALE_* mode of ``scale`` for an operand of ``rows x cols`` scaled along
    ``dim`` ("row" of a: ``[M, 1]``; "column" of b: ``[1, N]``); raises naming the fix."""
    if scale is None:
        return _types.SCALE_NONE
    want = f"[{rows}, 1]" if dim == "row" else f"[1, {cols}]"
    if not isinstance(scale, torch.Tensor):
        raise TypeError(f"matmul: {name} must be a torch.Tensor or None, got {type(scale).__name__}")
    if scale.dtype != torch.float32:
        raise TypeError(f"matmul: {name}.dtype={scale.dtype}; need torch.float32 (a 0-d/1-element tensor-wise "
                        f"scale or {want} {dim}-wise scales, torch._scaled_mm's layout)")
    if scale.numel() == 1:
        return _types.SCALE_TENSOR
    shape = (rows, 1) if dim == "row" else (1, cols)
    if tuple(scale.shape) != shape:
        raise ValueError(f"matmul: {name} has shape {tuple(scale.shape)}; need a 0-d/1-element tensor "
                         f"(tensor-wise) or {want} ({dim}-wise)")
    if not scale.is_contiguous():
        raise ValueError(f"matmul: {name} has strides {scale.stride()}; need a contiguous tensor")
    return _types.SCALE_VECTOR


def _check_chunks(m, chunk_m, name):
    if not isinstance(chunk_m, int) or chunk_m < 1:
        raise ValueError(f"matmul: {name}={chunk_m!r}; need a positive int (rows per communication chunk)")
    return -(-m // chunk_m)


def _check_generation(gen, name):
    if not isinstance(gen, int) or not 1 <= gen <= MAX_GENERATION:
        raise ValueError(f"matmul: {name}={gen!r}; need an int in [1, 2**31 - 1] (signals are int32)")


def _check_num_sms(num_sms):
    if num_sms is None:
        return
    if not isinstance(num_sms, int) or isinstance(num_sms, bool):
        raise TypeError(f"matmul: num_sms={num_sms!r} ({type(num_sms).__name__}); pass a positive int "
                        "(the SM budget that caps the persistent grid) or None for the whole GPU")
    if num_sms < 1:
        raise ValueError(f"matmul: num_sms={num_sms}; need a positive int (SMs the persistent grid may "
                         "use) or None for the whole GPU")


def _check_tile_records(t, plan, device):
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"matmul: tile_records must be a torch.Tensor or None, got {type(t).__name__}")
    if t.dtype != torch.int64:
        raise TypeError(f"matmul: tile_records.dtype={t.dtype}; need torch.int64 (tile_records_for() allocates it)")
    cols = abi.TILE_RECORD_COLUMNS
    if t.dim() != 2 or t.shape[1] != cols or t.shape[0] < plan.num_tiles:
        gm, gn = plan.tile_grid if plan.num_tiles else (0, 0)
        raise ValueError(f"matmul: tile_records is {tuple(t.shape)}; need [>= {plan.num_tiles}, {cols}]: a row "
                         f"per tile of the {gm}x{gn} grid of {plan.tile_shape[0]}x{plan.tile_shape[1]} tiles "
                         "(tile_records_for() allocates it)")
    if t.device != device:
        raise ValueError(f"matmul: tile_records is on {t.device}; need {device} (a's device)")
    if not t.is_contiguous():
        raise ValueError(f"matmul: tile_records has strides {t.stride()}; need a contiguous tensor (the kernel "
                         f"writes row t at element t * {cols}); allocate it with tile_records_for()")


def _tma_ok(device, a, b, out, b_kmajor) -> tuple[bool, str]:
    if device.type != "cuda" or interpreting():
        return False, "not on CUDA"
    if device_info(device_index(device))["capability"][0] < 9:
        return False, "TMA needs compute capability >= 9.0"
    rows = [(a, a.stride(0)), (b, b.stride(1) if b_kmajor else b.stride(0))]
    if out is not None:
        rows.append((out, out.stride(0)))
    if any((s * t.element_size()) % 16 for t, s in rows) or any(t.data_ptr() % 16 for t, _ in rows):
        return False, (f"TMA needs 16-byte aligned base pointers and row strides; got row strides "
                       f"{[s for _, s in rows]} of {[t.element_size() for t, _ in rows]}-byte elements")
    return True, ""


# --------------------------------------------------------------------------------------------
# decisions (pure given their arguments)
# --------------------------------------------------------------------------------------------
def _wave_fill(tiles: int, programs: int) -> float:
    """Share of the programs' tile slots that hold a tile, over whole waves."""
    return tiles / (-(-tiles // programs) * programs)


def _ws_dtypes_why_not(dtype, b_dtype, out_dtype, scale_a, scale_b, b_kmajor) -> str:
    """Why the Gluon kernel cannot take these dtypes, scales and b layout ("" if it can)."""
    b_dtype = dtype if b_dtype is None else b_dtype
    out_dtype = dtype if out_dtype is None and dtype in _types.WS_DTYPES else out_dtype
    if dtype in _types.WS_DTYPES:
        if b_dtype != dtype or out_dtype != dtype or scale_a or scale_b:
            return (f"{_types.dtype_name(dtype)} with scales or another output dtype: outside the Gluon kernel's "
                    "(bf16/fp16 in and out unscaled, or fp8); gemm_kernel")
        return ""
    if _types.is_fp8(dtype):
        if (dtype, b_dtype) not in _types.FP8_PAIRS or out_dtype not in _types.FP8_OUT_DTYPES:
            return (f"fp8 {dtype} x {b_dtype} into {out_dtype}: outside the Gluon kernel's (fp8 pairs "
                    "into bf16/fp16/float32); gemm_kernel")
        if not b_kmajor:
            return "fp8 b not K-major: sm_90's fp8 wgmma reads b K-major (weight.t()); gemm_kernel"
        return ""
    return f"{dtype} outside the Gluon kernel's (bf16/fp16 in and out, or fp8): gemm_kernel"


def ws_choice(capability, dtype, cfg, epilogue, wait, epi_tma, use_asm, m=0, n=0, programs=0,
              out_tma=False, options: GemmOptions = DEFAULT_OPTIONS, *, b_dtype=None, out_dtype=None,
              scale_a=_types.SCALE_NONE, scale_b=_types.SCALE_NONE, b_kmajor=True,
              chosen: bool = False) -> tuple[tuple, str]:
    """``((block, stages), why)`` of the warp-specialized Gluon kernel (tpfuse/kernels/gemm_ws.py)
    for a launch with one hook or a hook-free fp8 launch whose config asks for it, or ``((), why
    not)`` for gemm_kernel.

    Hooks: taken on sm_90
    (``capability`` major 9) for configs of 128-row tiles 128 or 256 wide, with either the
    epilogue hook where it stores by TMA (``epi_tma``: every destination 16-byte aligned,
    per-chunk descriptors or stacked destinations) -- its store warp counts and publishes off
    the MMA warps, which in gemm_kernel wait ~0.9 us per tile for it -- or the wait hook into a
    TMA-stored ``out`` (``out_tma``) -- its poll warp waits, not the load or MMA warps. Not with both
    hooks at once. ``options.gluon=False`` keeps gemm_kernel.

    Dtypes: bf16/fp16 in and out (``b_dtype``, ``out_dtype`` None: ``dtype``), unscaled,
    K-steps of 64; or fp8 (``dtype`` x ``b_dtype`` one of ``_types.FP8_PAIRS``, ``b_kmajor``:
    sm_90's fp8 wgmma reads b K-major) into bf16/fp16/float32 with any scale modes
    (``scale_a``/``scale_b``, ``_types.SCALE_*``; applied to the fp32 accumulator as gemm.py
    does), K-steps of 128 (the same bytes per stage). Stages: as many as fit beside the output
    staging buffer in sm_90's 227 KiB (3 for 128x256 tiles, 5 for 128x128); a float32 output's
    staging buffer is twice a 16-bit one's, so fp8 into float32 takes 128-wide tiles (a
    128x256 one would leave room for 2 stages). No stream-K, so where 128-wide tiles fill the
    waves of ``programs`` better by more than 5 points than 256-wide ones (8B fc1 at M = 4096:
    0.97 against 0.85), it takes those.

    fp8 hooks with a config ``chosen`` for the shape (the tuning cache's, or passed in; not
    default_config's) that is not a Gluon one (``cfg.gluon`` False): gemm_kernel, the kernel the
    config was timed in (:func:`tpfuse.gemm.tune` times the hooked calls of its finalists in
    the kernels this rule gives them, and keeps the fastest per hook) -- for the wait hook and
    the epilogue hook without signals (routed stores: nothing to move off the MMA warps). The
    signalled epilogue hook still takes the Gluon kernel (its store warp counts and publishes).

    No hook: only with ``cfg.gluon`` (the tuner keeps such a config where it timed faster), for
    fp8 into a TMA-stored ``out`` (``out_tma``), with the dtype, tile, capability and options
    rules above; the config's own tile width (the tuner chose it; float32 out: 128-wide), its
    stages by :data:`~tpfuse.gemm.config.GLUON_STAGES`."""
    plain = epilogue is None and wait is None
    if plain and not cfg.gluon:
        return (), "no hook: gemm_kernel"
    if plain and not _types.is_fp8(dtype):
        return (), (f"GemmConfig(gluon=True) with {_types.dtype_name(dtype)} inputs: the plain Gluon launch is "
                    "fp8's; gemm_kernel with the rest of the config")
    if plain and not out_tma:
        return (), ("GemmConfig(gluon=True) into an output not stored by TMA (misaligned, or not on sm_90): "
                    "gemm_kernel with the rest of the config")
    if epilogue is not None and wait is not None:
        return (), "both hooks at once: gemm_kernel (the Gluon kernel takes one)"
    if chosen and not cfg.gluon and _types.is_fp8(dtype) and not (epilogue is not None and epilogue.signalled):
        return (), ("fp8 " + ("wait hook" if wait is not None else "epilogue hook without signals")
                    + " with a gemm_kernel config chosen for the shape (by tuning, or passed in): "
                    "gemm_kernel, the kernel it was timed in")
    if epilogue is not None and not epi_tma:
        return (), "epilogue hook through pointer stores: gemm_kernel (the Gluon kernel stores by TMA)"
    if wait is not None and not out_tma:
        return (), "wait hook into an output not stored by TMA: gemm_kernel"
    if not options.gluon:
        return (), "GemmOptions(gluon=False): gemm_kernel"
    if not use_asm:
        return (), "no inline PTX (signal_asm off or not on CUDA): gemm_kernel"
    why_not = _ws_dtypes_why_not(dtype, b_dtype, out_dtype, scale_a, scale_b, b_kmajor)
    if why_not:
        return (), why_not
    if cfg.BLOCK_M != 128 or cfg.BLOCK_N not in (128, 256):
        return (), ("config outside the Gluon kernel's (128x128 or 128x256 tiles): gemm_kernel")
    if capability[0] != 9:
        return (), f"compute capability {capability}: the Gluon kernel's wgmma is sm_90's; gemm_kernel"
    fp8 = _types.is_fp8(dtype)
    bn, narrowed = cfg.BLOCK_N, ""
    if bn == 256 and fp8 and out_dtype == torch.float32:
        bn, narrowed = 128, " with 128-wide tiles (a 128x256 float32 staging buffer leaves room for 2 stages)"
    if bn == 256 and m and n and programs and not plain:
        fill = {w: _wave_fill(-(-m // 128) * -(-n // w), programs) for w in (128, 256)}
        if fill[128] > fill[256] + 0.05:
            bn, narrowed = 128, " with 128-wide tiles, which fill the waves better"
    if plain:
        why = ("GemmConfig(gluon=True), no hook, on sm_90: gemm_ws, not gemm_kernel (the warp-specialized "
               "Gluon kernel: TMA loads and stores in warps of their own, fp8 scaled in the MMA warps)")
    else:
        why = ("one hook on sm_90: the warp-specialized Gluon kernel (its "
               + ("store warp counts and publishes" if epilogue is not None else "poll warp waits")
               + ", not the MMA warps" + (", fp8 scaled in the MMA warps" if fp8 else "") + ")")
    return ((128, bn, 128 if fp8 else 64), GLUON_STAGES[bn]), why + narrowed


def pp_choice(ws: tuple, cfg: GemmConfig, hook: str = "", out_dtype=None) -> tuple[str, tuple, str]:
    """``(kernel, (block, stages), why)`` for a launch that :func:`ws_choice` gave ``ws``:
    "gemm_pp_kernel" (tpfuse/kernels/gemm_pp.py: two consumer warpgroups on alternate 128x128
    tiles, one's epilogue under the other's MMAs) at :data:`~tpfuse.gemm.config.PINGPONG_STAGES`
    where the config asks for it (``cfg.pingpong``) and ws_choice took the Gluon kernel at
    gemm_pp's 128x128x128 (fp8): a plain call (``hook`` "") or one with one hook (``hook``
    "wait" or "epilogue"), which ws_choice takes only where gemm_ws can run it -- the epilogue
    hook through TMA descriptors, the wait hook into a TMA-stored output -- and gemm_pp runs it
    in the same warps, with gemm_ws's per-tile hook code; per-tile records too. Else
    "gemm_ws_kernel" with ``ws`` where ws_choice took the Gluon kernel, "gemm_kernel" where it
    did not (``ws`` empty: ws_choice's reason stands). ``why`` is "" where the config does not
    ask for gemm_pp."""
    assert hook in ("", "wait", "epilogue"), hook
    if not ws:
        return "gemm_kernel", ws, ""
    if not cfg.pingpong:
        return "gemm_ws_kernel", ws, ""
    if ws[0] != (128, 128, 128):
        return "gemm_ws_kernel", ws, (f"GemmConfig(pingpong=True) with a {ws[0][0]}x{ws[0][1]}x{ws[0][2]} Gluon "
                                      "launch: gemm_ws (gemm_pp is fp8's, 128x128x128)")
    stages = PINGPONG_STAGES[_types.element_size(out_dtype or _types.FP8_DEFAULT_OUT)]
    if hook:
        role = "its store warp counts and publishes" if hook == "epilogue" else "its poll warp waits"
        return "gemm_pp_kernel", ((128, 128, 128), stages), (
            f"GemmConfig(pingpong=True) with the {hook} hook: gemm_pp, gemm_ws's ping-pong variant ({role}, as "
            f"gemm_ws's; {stages} stages)")
    return "gemm_pp_kernel", ((128, 128, 128), stages), (
        "GemmConfig(pingpong=True): gemm_pp, gemm_ws's ping-pong variant (two consumer warpgroups on alternate "
        f"128x128 tiles, one's epilogue under the other's MMAs; {stages} stages)")


def epilogue_mode(epilogue: Optional[EpilogueSpec]) -> int:
    """The kernels' EPILOGUE constexpr for a spec: 0 (none), ``abi.EPI_SIGNALLED`` (rows routed,
    tiles counted, chunks published) or ``abi.EPI_ROUTE`` (a spec without signals: rows routed)."""
    if epilogue is None:
        return 0
    return abi.EPI_SIGNALLED if epilogue.signalled else abi.EPI_ROUTE


def epi_count_mode(options: GemmOptions = DEFAULT_OPTIONS, eligible_async: bool = True,
                   in_loop: bool = True) -> int:
    """How gemm_kernel's epilogue hook counts stored tiles (kernel constexpr EPI_COUNT).

    ``abi.EPI_COUNT_AFTER_LOOP`` (3): a release at GPU scope that returns nothing (no warp
    waits for it), made after the next tile's main loop, one poller per chunk publishing it,
    handoff at the poller's end; where every tile lies in one chunk, on CUDA (inline PTX) or in
    the interpreter, with at most 64 chunks
    (``eligible_async``). ``EPI_COUNT_IN_LOOP`` (4): the same with the count made a few K-steps
    into the next tile's main loop instead, so a chunk is published most of a tile earlier, in
    flattened tile loops (``in_loop``: in a nested K loop ptxas then serializes the wgmma
    instructions). ``EPI_COUNT_RETURNING`` (1): acq_rel at GPU scope, read at once, the chunk's
    last count publishing it. ``options.epi_count``: "auto" takes 4, else 3, else 1;
    "after_loop" 3 where 4 would be taken; "returning" always 1."""
    if options.epi_count == "returning" or not eligible_async:
        return abi.EPI_COUNT_RETURNING
    if options.epi_count == "after_loop" or not in_loop:
        return abi.EPI_COUNT_AFTER_LOOP
    return abi.EPI_COUNT_IN_LOOP


def epilogue_tma_dests(epilogue, tma_store, num_chunks, block_m, options: GemmOptions = DEFAULT_OPTIONS) -> int:
    """How many TMA descriptors the epilogue hook stores through (0: pointer stores), or
    ``abi.EPI_TMA_STACKED``: one descriptor over destinations that are consecutive row blocks of
    one tensor (:func:`tpfuse.gemm.hooks.stacked_dests`), any number of chunks of any height.
    ``tma_store``: a TMA-path launch whose config stores by TMA (``tma_store=False`` configs
    gave the staging buffer's shared memory to the pipeline). Separate destinations need every
    tile inside one chunk (chunk_m a multiple of BLOCK_M): a tile's rows in a later chunk would
    need a negative TMA row coordinate, which stores do not take."""
    if (epilogue is None or not tma_store or len(epilogue.dests) < num_chunks or num_chunks < 1
            or epilogue.align_elems == 0 or not options.epi_tma):
        return 0
    if stacked_dests(epilogue):
        return abi.EPI_TMA_STACKED
    if num_chunks > abi.MAX_TMA_DESTS or (num_chunks > 1 and epilogue.chunk_m % block_m):
        return 0
    return num_chunks


def route_tma_fallback(epilogue, epi_tma: int, flatten: bool) -> tuple[int, str]:
    """gemm_kernel's EPI_TMA for a launch that :func:`ws_choice` left to it: ``epi_tma``, or 0
    (pointer stores) with the reason where the epilogue hook without signals would store
    through per-chunk TMA descriptors in a flattened tile loop (``flatten``). Triton 3.6, 3.7
    and 3.8 fail to compile that loop: their FuseNestedLoops pass builds an invalid ``scf.if``
    ("region control flow edge ... source has 1 operands, but target successor needs 2") when
    the tile's last work is the per-chunk stores, each under an ``if``; with signals the counts
    follow them and it compiles, as do pointer stores and one descriptor over stacked
    destinations (offline sm_90 compiles, tests/cpu/test_kernel_tools.py)."""
    if (epilogue is None or epilogue.signalled or not flatten or not 0 < epi_tma <= abi.MAX_TMA_DESTS):
        return epi_tma, ""
    return 0, ("epilogue hook without signals in a flattened tile loop: pointer stores, not per-chunk TMA "
               "descriptors (Triton's loop flattening fails on those: route_tma_fallback)")


# LaunchPlan.config_source of a config no tuning chose (ws_choice's ``chosen`` is False for it)
_HEURISTIC_SOURCE = "heuristic (default_config)"


def _make_plan(a, b, out, config, tile_order, chunk_m, start_chunk, wait, epilogue, use_tma, num_sms_cap,
               options, record_tiles=False, out_dtype=None, scale_a=None, scale_b=None) -> LaunchPlan:
    b_kmajor, out_dtype = _check_operands(a, b, out, out_dtype)
    mode_a = _scale_mode(scale_a, "scale_a", a.shape[0], a.shape[1], "row")
    mode_b = _scale_mode(scale_b, "scale_b", b.shape[0], b.shape[1], "column")
    for name, t in (("scale_a", scale_a), ("scale_b", scale_b)):
        if t is not None and t.device != a.device:
            raise ValueError(f"matmul: {name} is on {t.device}; need {a.device} (a's device)")
    if tile_order not in TILE_ORDERS:
        raise ValueError(f"matmul: tile_order={tile_order!r}; choose one of {TILE_ORDERS}")
    if not isinstance(options, GemmOptions):
        raise TypeError(f"matmul: options must be a GemmOptions or None, got {type(options).__name__}")
    _check_num_sms(num_sms_cap)
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
    source = "argument"
    cfg = config
    hook = "wait" if wait is not None else "epilogue" if epilogue is not None else None
    if cfg is None and m and n and k and hook is not None:   # the config tuned with this hook, if any
        cfg, source = cache.lookup(m, n, k, a.dtype, b_kmajor, device, hook), f"tuning cache ({hook} hook)"
    if cfg is None and m and n and k:
        cfg, source = cache.lookup(m, n, k, a.dtype, b_kmajor, device), "tuning cache"
    if cfg is None:
        cfg, source = default_config(m, n, k, a.dtype, num_sms=num_sms(device)), _HEURISTIC_SOURCE
    if not isinstance(cfg, GemmConfig):
        raise TypeError(f"matmul: config must be a GemmConfig, got {type(cfg).__name__}")
    common = dict(config=cfg, config_source=source, options=options, b_kmajor=b_kmajor, tile_order=tile_order,
                  chunk_m=chunk_m or 1, num_chunks=num_chunks, start_chunk=start_chunk, record_tiles=record_tiles,
                  out_dtype=out_dtype, scale_a=mode_a, scale_b=mode_b)
    if m == 0 or n == 0 or k == 0:   # nothing to launch; matmul() handles these
        return LaunchPlan(m, n, k, kernel="none", grid=(0,), reasons=("empty M, N or K: no launch",), **common)

    reasons = []
    triton, tl, km = triton_modules()
    c_out = None if epilogue is not None else out
    if use_tma is None:
        use_tma, why = _tma_ok(device, a, b, c_out, b_kmajor)
        if not use_tma:
            reasons.append(f"plain-pointer loads: {why}")
            if device.type == "cuda" and torch.cuda.get_device_capability(device)[0] >= 9:
                warn_once(f"tpfuse.gemm: plain-pointer path instead of TMA ({why})")
    elif use_tma:
        ok, why = _tma_ok(device, a, b, c_out, b_kmajor)
        if not ok:
            raise ValueError(f"matmul: use_tma=True but {why}; pass use_tma=None to fall back")
    else:
        reasons.append("plain-pointer loads: use_tma=False")
    num_tiles = triton.cdiv(m, cfg.BLOCK_M) * triton.cdiv(n, cfg.BLOCK_N)
    programs = cfg.num_programs or num_sms(device)
    if num_sms_cap is not None and num_sms_cap < programs:
        programs = num_sms_cap
        reasons.append(f"num_sms={num_sms_cap} caps the persistent grid")
    sk_tiles = stream_k_tiles(num_tiles, programs, cfg.stream_k)
    # stream-K shares its steps out to every program; otherwise no more programs than work items
    grid = (programs if sk_tiles else min(num_tiles, programs), 1, 1)
    use_asm = device.type == "cuda" and not interpreting() and options.signal_asm
    epi_tma = epilogue_tma_dests(epilogue, use_tma and cfg.tma_store, num_chunks, cfg.BLOCK_M, options)
    epi_count = 0
    if epilogue is not None and not epilogue.signalled:
        reasons.append("epilogue hook without signals: rows routed to their chunks' destinations, "
                       "no count, no publication")
    elif epilogue is not None:
        epi_count = epi_count_mode(options, (use_asm or interpreting())
                                   and num_chunks <= abi.MAX_POLLED_CHUNKS
                                   and num_tiles < abi.HANDOFF
                                   and (num_chunks == 1 or chunk_m % cfg.BLOCK_M == 0), cfg.flatten)

    def compile_spec(cfg: GemmConfig):
        return CompileSpec(BLOCK_M=cfg.BLOCK_M, BLOCK_N=cfg.BLOCK_N, BLOCK_K=cfg.BLOCK_K, GROUP_M=cfg.GROUP_M,
                           EPI_SUBTILE=cfg.EPI_SUBTILE, TILE_ORDER=TILE_ORDERS.index(tile_order), USE_TMA=bool(use_tma),
                           TMA_STORE=cfg.tma_store, B_KMAJOR=b_kmajor, C_DTYPE=_types.tl_name(out_dtype),
                           SCALE_A=mode_a, SCALE_B=mode_b, FLATTEN=cfg.flatten, DOT_FP32=interpreting(),
                           USE_ASM=use_asm, RECORD_TILES=record_tiles, STREAM_K=sk_tiles > 0, WAIT=wait is not None,
                           EPILOGUE=epilogue_mode(epilogue),
                           DEST_ALIGNED=epilogue.align_elems if epilogue is not None else 0, EPI_TMA=epi_tma,
                           EPI_COUNT=epi_count or abi.EPI_COUNT_RETURNING).project()
    spec = compile_spec(cfg)
    capability = device_info(device_index(device))["capability"] if device.type == "cuda" else (0, 0)
    ws, why_ws = ws_choice(capability, a.dtype, cfg, epilogue, wait, epi_tma, use_asm, m, n, programs,
                           out_tma=bool(use_tma) and cfg.tma_store and epilogue is None, options=options,
                           b_dtype=b.dtype, out_dtype=out_dtype, scale_a=mode_a, scale_b=mode_b, b_kmajor=b_kmajor,
                           chosen=source != _HEURISTIC_SOURCE)
    if epilogue is not None or wait is not None or cfg.gluon:
        reasons.append(why_ws)
    if cfg.gluon and not ws and epilogue is None and wait is None:
        warn_once(f"tpfuse.gemm: {why_ws} ({m}x{n}x{k})")
    kernel, ws, why_pp = pp_choice(ws, cfg, "epilogue" if epilogue is not None else "wait" if wait is not None else "",
                                   out_dtype)
    if why_pp:
        reasons.append(why_pp)
    if not ws:
        epi_tma, why_ptr = route_tma_fallback(epilogue, epi_tma, cfg.flatten)
        if why_ptr:
            reasons.append(why_ptr)
            spec = compile_spec(cfg)
    if not ws and source != "argument" and device.type == "cuda" and not interpreting():
        # a cached or heuristic config was chosen for a shape and input dtype, whatever the
        # output's (config.fit_shared_memory); one passed in is launched as given
        limit = device_info(device_index(device))["smem_per_block"]
        sizes = _types.element_size(a.dtype), _types.element_size(out_dtype)
        fitted = fit_shared_memory(cfg, *sizes, limit) if limit else cfg
        if fitted != cfg:
            reasons.append(f"EPI_SUBTILE {cfg.EPI_SUBTILE} -> {fitted.EPI_SUBTILE}, num_stages {cfg.num_stages} -> "
                           f"{fitted.num_stages}: the config from the {source} needs ~{cfg.smem_bytes(*sizes)} bytes "
                           f"of shared memory with a {_types.dtype_name(out_dtype)} output, the device has {limit}")
            common["config"] = fitted
            spec = compile_spec(fitted)   # EPI_SUBTILE is a constexpr of the kernel
    if ws:   # one program per SM or fewer, no more than tiles of the Gluon kernel's own tile
        num_tiles = triton.cdiv(m, ws[0][0]) * triton.cdiv(n, ws[0][1])
        grid = (min(num_tiles, programs), 1, 1)
        sk_tiles = 0
    return LaunchPlan(m, n, k, kernel=kernel, use_tma=bool(use_tma), grid=grid,
                      use_asm=use_asm, num_tiles=num_tiles, sk_tiles=sk_tiles, epi_tma=epi_tma,
                      epi_count=epi_count if not ws else 0, ws_block=ws[0] if ws else (),
                      ws_stages=ws[1] if ws else 0, reasons=tuple(reasons), spec=None if ws else spec, **common)


# --------------------------------------------------------------------------------------------
# launch helpers
# --------------------------------------------------------------------------------------------
def _epilogue_descriptor_args(epilogue, plan) -> tuple:
    """gemm_kernel's MAX_TMA_DESTS descriptor arguments: the destinations' descriptors, then None."""
    descs = _epilogue_descriptors(epilogue, plan) if plan.epi_tma else ()
    return descs + (None,) * (abi.MAX_TMA_DESTS - len(descs))


def _epilogue_descriptors(epilogue: EpilogueSpec, plan: LaunchPlan) -> tuple:
    """One TMA descriptor per chunk over that chunk's rows of its destination (or, stacked
    destinations, one over all M rows from the first), kept on the spec (so they live as long
    as it does) per launch geometry."""
    cfg = plan.config
    ws = plan.kernel in ("gemm_ws_kernel", "gemm_pp_kernel")
    # the Gluon kernels store whole tiles through descriptors that carry their layout
    block = plan.ws_block[:2] if ws else (cfg.BLOCK_M, cfg.BLOCK_N // cfg.EPI_SUBTILE)
    cache_ = epilogue.__dict__.setdefault("_tma_descs", {})   # frozen dataclass: not a field
    key = (plan.m, plan.n, plan.chunk_m, plan.epi_tma, block, ws)
    descs = cache_.get(key)
    if descs is None:
        if ws:
            make = _gluon_descriptor
        else:
            from triton.tools.tensor_descriptor import TensorDescriptor as make
        stacked = plan.epi_tma == abi.EPI_TMA_STACKED
        descs = []
        for q, d in enumerate(epilogue.dests[:plan.num_chunks if stacked else plan.epi_tma]):
            rows = min(plan.chunk_m, plan.m - q * plan.chunk_m)
            if d.shape[0] < rows or d.shape[1] < plan.n:
                raise ValueError(f"matmul: epilogue.dests[{q}] is {tuple(d.shape)}; chunk {q} needs at least "
                                 f"({rows}, {plan.n})")
            if not stacked:
                descs.append(make(d, [rows, plan.n], [d.stride(0), 1], list(block)))
        if stacked:   # every chunk's rows checked above, so all M rows lie in the storage
            d0 = epilogue.dests[0]
            descs.append(make(d0, [plan.m, plan.n], [d0.stride(0), 1], list(block)))
        descs = cache_[key] = tuple(descs)
    return descs


@functools.lru_cache(maxsize=None)
def _shared_layout(block: tuple, dtype: str):
    """The shared layout the Gluon kernel stages a ``block`` of ``dtype`` in (per call: cached)."""
    from triton.experimental.gluon import language as gl
    return gl.NVMMASharedLayout.get_default_for(list(block), getattr(gl, dtype))


def _gluon_descriptor(t, shape, strides, block):
    """A Gluon TMA descriptor of ``t`` (bf16/fp16/fp8/float32, unit column stride) with the shared layout
    the Gluon kernel stages ``block`` in (same arguments as triton's TensorDescriptor)."""
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
    return TensorDescriptor(t, list(shape), list(strides), list(block), _shared_layout(tuple(block), _types.tl_name(t.dtype)))


def _desc_triple(desc) -> tuple:
    """(address, shape, strides) of a Gluon descriptor (for tpfuse._direct.launch_tma)."""
    return desc.base.data_ptr(), desc.shape, desc.strides


def _stream_k_buffers(plan: LaunchPlan, device) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 workspace ``[programs, 2, BLOCK_M, BLOCK_N]`` and int32 ``[num_tiles]`` tile
    counters for a stream-K launch on the current stream, cached and grown as needed.

    One pair per (device, stream): launches on one stream run one after the other and can
    share it; launches on two streams may overlap, so they must not. The counters are
    allocated zeroed and every completed launch leaves them at zero (the segment that completes
    a tile resets its counter), so no memset runs between calls. Under CUDA graph capture a
    new pair is allocated from the graph's pool on the capture stream, its zeroing captured."""
    cfg = plan.config
    ws_numel = plan.grid[0] * 2 * cfg.BLOCK_M * cfg.BLOCK_N
    key = (device, torch._C._cuda_getCurrentRawStream(device.index) if device.type == "cuda" else 0)
    ws, counters = _STREAM_K_BUFFERS.get(key, (None, None))
    if ws is None or ws.numel() < ws_numel:
        ws = torch.empty(ws_numel, dtype=torch.float32, device=device)
    if counters is None or counters.numel() < plan.num_tiles:
        counters = torch.zeros(plan.num_tiles, dtype=torch.int32, device=device)
    _STREAM_K_BUFFERS[key] = (ws, counters)
    return ws, counters


def _launch_cached(spec, grid, full: list, device, jit_launch, direct: bool) -> None:
    """Launch a kernel on CUDA: the first call of specialization ``spec`` through Triton's JIT
    (``jit_launch()``, which compiles, caches and returns the ``CompiledKernel``); later ones
    call that compiled kernel directly with ``full`` (every parameter, constexprs included, in
    signature order). ``spec`` must capture everything the JIT specializes on. ``direct``
    False (``GemmOptions(direct_launch=False)``) always takes the JIT. A direct launch that
    fails (a change of Triton's internals) warns once and turns direct launches off for the
    process; :func:`launch_counts` shows it."""
    direct = direct and not _DIRECT_BROKEN[0]
    compiled = _COMPILED.get(spec) if direct else None
    if compiled is not None:
        try:
            compiled(grid, torch._C._cuda_getCurrentRawStream(device.index), full)   # a tpfuse._direct.Direct
            _LAUNCHES["direct"] += 1
            return
        except Exception as e:  # a Triton internals change: say so once, then use the JIT path
            warn_once(f"tpfuse.gemm: direct kernel launch failed ({type(e).__name__}: {e}); using Triton's "
                      "JIT launch from now on (slower on the host); GemmOptions(direct_launch=False) silences this")
            _DIRECT_BROKEN[0] = True
            _COMPILED.clear()
            direct = False
    compiled = jit_launch()
    _LAUNCHES["jit"] += 1
    if id(compiled) not in _SEEN_COMPILED:
        _SEEN_COMPILED[id(compiled)] = compiled   # kept: Triton caches it anyway
        _LAUNCHES["compiled"] += 1
    if direct and compiled is not None:
        from .._direct import Direct

        _COMPILED[spec] = Direct(compiled)


_SEEN_COMPILED: dict = {}   # id -> CompiledKernel returned by a JIT launch


@functools.lru_cache(maxsize=256)
def _kernel_layout(spec: PersistentSpec, tl, km) -> tuple:
    """(kernel, its runtime argument names, its constexprs by name, their values in signature
    order) of a projected spec's variant in kernel module ``km`` (the one triton_modules() has
    now: tests re-import it under the interpreter): per spec once, not per call. The kernels
    take their constexprs after every runtime argument."""
    kernel = getattr(km, spec.KERNEL)
    constexprs = spec.constexprs(tl)
    names = list(kernel.arg_names)
    runtime = tuple(n for n in names if n not in constexprs)
    if names != list(runtime) + list(constexprs):
        raise AssertionError(f"{spec.KERNEL}: constexprs must follow the runtime arguments in the "
                             f"order of {type(spec).__name__}'s fields")
    return kernel, runtime, constexprs, tuple(constexprs.values())


def _launch_gemm_kernel(plan: LaunchPlan, plan_key, values: dict, device) -> None:
    """Launch the plan's variant of the Triton GEMM family (``plan.spec.KERNEL``) with its
    runtime arguments taken by name from ``values`` (which may hold more) and its constexprs
    from ``plan.spec``. Its specialization depends only on the plan (the projected spec is part
    of it), the 16-byte alignment of the tensor arguments and the width of the ints."""
    kernel, runtime, constexprs, constexpr_values = _kernel_layout(plan.spec, *triton_modules()[1:])
    args = [values[name] for name in runtime]
    cfg = plan.config
    if interpreting() or device.type != "cuda":
        kernel[plan.grid](*args, **constexprs, num_warps=cfg.num_warps, num_stages=cfg.num_stages)
        _LAUNCHES["interpreter"] += 1
        return
    spec = (plan_key, tuple(x.data_ptr() % 16 == 0 for x in args if isinstance(x, torch.Tensor)),
            tuple(-2**31 <= x < 2**31 for x in args if isinstance(x, int)))
    _launch_cached(spec, plan.grid, args + list(constexpr_values), device,
                   lambda: kernel[plan.grid](*args, **constexprs, num_warps=cfg.num_warps, num_stages=cfg.num_stages),
                   plan.options.direct_launch)


def _launch_ws(plan: LaunchPlan, a, b, *, out=None, dests=(), stacked=False, epi_mode=0, counters=None,
               signal_ptrs=None, generation=0, epi_descs=None, wait_signal=None, wait_gen=0, wait_timeout_ns=0,
               err=None, tile_records=None, scale_a=None, scale_b=None) -> None:
    """The Gluon kernel on ``a [M, K] @ b [K, N]`` (``b`` row-major or ``weight.t()``) into
    ``out``, or with ``dests`` (the epilogue hook) into one destination per chunk (``stacked``:
    consecutive row blocks of one tensor, ``epi_descs`` their descriptors) and, ``epi_mode``
    ``abi.EPI_SIGNALLED``, counting in ``counters`` and publishing ``generation`` to the int32 at
    each ``signal_ptrs[c]`` (``abi.EPI_ROUTE``: the stores only). With
    ``wait_signal`` (the wait hook, into ``out``): the poll warp waits ahead of a tile's loads
    until ``wait_signal[c] >= wait_gen`` for every chunk ``c`` its rows touch, for at most
    ``wait_timeout_ns``, recording a timeout in ``err``. ``tile_records``: the per-tile timeline
    (RECORD_TILES). ``scale_a`` / ``scale_b``: fp8's scales (modes ``plan.scale_a`` /
    ``plan.scale_b``), applied by the MMA warps. :func:`matmul` validated everything.
    ``plan.kernel`` "gemm_pp_kernel": the ping-pong variant (the same hooks, one at a time, and
    records), which takes the same arguments at its own warps and register cap."""
    if plan.kernel == "gemm_pp_kernel":
        from ..kernels.gemm_pp import MAXNREG as maxnreg, NUM_WARPS as num_warps, gemm_pp_kernel as kernel
    else:
        from ..kernels.gemm_ws import gemm_ws_kernel as kernel
        num_warps, maxnreg = abi.WS_NUM_WARPS, abi.WS_MAXNREG
    m, k = a.shape
    n = b.shape[1]
    bm, bn, bk = plan.ws_block
    group_m, stages, grid = plan.config.GROUP_M, plan.ws_stages, plan.grid[0]
    chunk_m, num_chunks, start_chunk = plan.chunk_m, plan.num_chunks, plan.start_chunk
    b_kmajor = plan.b_kmajor
    epilogue = epi_mode if len(dests) > 0 else 0   # the kernel's EPILOGUE constexpr
    if epilogue:
        epi = list(epi_descs)
        epi_tma = abi.EPI_TMA_STACKED if stacked else len(epi)
    else:
        epi, epi_tma = [], 0
    num_epi = len(epi)
    epi = epi + [None] * (abi.MAX_TMA_DESTS - len(epi))
    tile_order_idx = TILE_ORDERS.index(plan.tile_order)
    wait = wait_signal is not None
    record = tile_records is not None
    ints = (chunk_m, num_chunks, start_chunk, wait_gen, wait_timeout_ns, generation)
    # Everything the JIT specializes on (the descriptors' dtypes, blocks and layouts follow from
    # the dtype, block, b_kmajor and destinations; the hook ints and pointers are not
    # specialized but for their width and dtype), so a cached compiled kernel fits this call
    c0 = dests[0] if epilogue else out
    mode_a, mode_b = plan.scale_a, plan.scale_b
    hooks = (wait_signal, err, counters, signal_ptrs)
    # the plan fixes the rest of the key below (shapes, strides, dtypes, blocks, order): per plan,
    # it is built once for each of these
    local = (epilogue, epi_tma, num_epi, wait, record, c0.stride(), tuple(-2**31 <= x < 2**31 for x in ints),
             tuple(None if t is None else t.dtype for t in hooks))
    specs = plan.__dict__.get("_ws_specs")   # frozen dataclass: not a field
    if specs is None:
        specs = plan.__dict__.setdefault("_ws_specs", {})
    spec = specs.get(local)
    if spec is None:
        spec = specs[local] = (
            plan.kernel, a.device, a.dtype, b.dtype, c0.dtype, mode_a, mode_b, m, n, k, a.stride(), b.stride(),
            c0.stride(), bm, bn, bk, group_m, stages, tile_order_idx, b_kmajor, epilogue, epi_tma, num_epi,
            wait, record, local[6], local[7])
    head = [None, None, None, m, n, k, chunk_m, num_chunks, start_chunk, wait_signal, wait_gen,
            wait_timeout_ns, err, counters, signal_ptrs, generation]
    tail = [tile_records, scale_a, scale_b, bm, bn, bk, group_m, stages, tile_order_idx, b_kmajor, epilogue, epi_tma,
            wait, record, mode_a, mode_b, num_warps]
    # The short path: the compiled kernel called with its descriptors expanded here (address,
    # shape, strides), no descriptor objects built (tpfuse/_direct.py, launch_tma)
    direct = _COMPILED.get(spec) if plan.options.direct_launch and not _DIRECT_BROKEN[0] else None
    if direct is not None and direct.tma is not None:
        descs = _operand_descs(plan, a, b, None if epilogue else out)
        if epilogue:
            descs[2] = _desc_triple(epi[0])
            for q in range(num_epi):
                descs[len(head) + q] = _desc_triple(epi[q])
        args = head + epi + tail
        if launch_tma(direct, (grid, 1, 1), torch._C._cuda_getCurrentRawStream(a.device.index), args, descs):
            _LAUNCHES["direct"] += 1
            _LAUNCHES["direct_tma"] += 1
            # what PreparedMatmul repeats: the arguments but the descriptors of a, b (and out) and the scales
            _LAST_WS_LOCAL.parts = (plan, direct, (grid, 1, 1), args, descs, bool(epilogue), len(head) + len(epi) + 1)
            return
    a_desc = _gluon_descriptor(a, (m, k), (a.stride(0), 1), (bm, bk))
    if b_kmajor:
        b_desc = _gluon_descriptor(b.t(), (n, k), (b.stride(1), 1), (bn, bk))
    else:
        b_desc = _gluon_descriptor(b, (k, n), (b.stride(0), 1), (bk, bn))
    c_desc = epi[0] if epilogue else _gluon_descriptor(out, (m, n), (out.stride(0), 1), (bm, bn))
    full = [a_desc, b_desc, c_desc] + head[3:] + epi + tail
    _launch_cached(spec, (grid, 1, 1), full, a.device, lambda: kernel[(grid, )](
        a_desc, b_desc, c_desc, m, n, k, chunk_m, num_chunks, start_chunk, wait_signal, wait_gen, wait_timeout_ns,
        err, counters, signal_ptrs, generation, *epi, tile_records, scale_a, scale_b,
        BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=group_m, STAGES=stages, TILE_ORDER=tile_order_idx,
        B_KMAJOR=b_kmajor, EPILOGUE=epilogue, EPI_TMA=epi_tma, WAIT=wait, RECORD_TILES=record,
        SCALE_A=mode_a, SCALE_B=mode_b,
        num_warps=num_warps, maxnreg=maxnreg), plan.options.direct_launch)


# --------------------------------------------------------------------------------------------
# matmul
# --------------------------------------------------------------------------------------------
def matmul(a: torch.Tensor, b: torch.Tensor, *, out: Optional[torch.Tensor] = None,
           config: Optional[GemmConfig] = None, tile_order: str = "grouped",
           chunk_m: Optional[int] = None, start_chunk: int = 0,
           wait: Optional[WaitSpec] = None, epilogue: Optional[EpilogueSpec] = None,
           check: bool = True, use_tma: Optional[bool] = None, num_sms: Optional[int] = None,
           options: Optional[GemmOptions] = None,
           tile_records: Optional[torch.Tensor] = None, scale_a: Optional[torch.Tensor] = None,
           scale_b: Optional[torch.Tensor] = None, out_dtype: Optional[torch.dtype] = None) -> Optional[torch.Tensor]:
    """``a [M, K] @ b [K, N]`` with the persistent Triton core (times ``scale_a`` and ``scale_b``).

    fp8 (``a``, ``b`` in ``torch.float8_e4m3fn``, or e5m2 with e4m3 either way round, as
    ``torch._scaled_mm`` takes them): ``b`` column-major (``weight.t()``), K and N multiples of
    16 (else ValueError: pad them); ``scale_a`` / ``scale_b`` float32, a 0-d/1-element tensor
    (tensor-wise) or ``[M, 1]`` / ``[1, N]`` (row-wise, column-wise), applied to the fp32
    product in the epilogue (``torch._scaled_mm``'s meaning); None: no scale. A row-wise
    ``scale_a`` is indexed by the global row, like ``a`` (with the wait hook, the gathered
    rows' scales). ``out_dtype``: bfloat16 (the default for fp8), float16 or float32; for other
    inputs the default is their own dtype. Scales and another ``out_dtype`` work for 16/32-bit
    inputs too (the Gluon kernel is then not taken).

    Returns ``out`` (allocated when None) or, with ``epilogue``, None (tiles went to the
    chunk destinations). ``chunk_m`` defaults to the hook spec's; tile orders ``"round"`` and
    ``"owner"`` need one. ``start_chunk`` is the first chunk in those orders. With ``wait`` and
    ``check=True`` the call synchronizes and raises TimeoutError from the error word; with
    ``check=False`` call :func:`check_error_word` yourself. ``use_tma`` None = where possible.
    ``num_sms``: an SM budget; the persistent grid is at most ``min(num_sms, what the config
    launches)`` programs (None: the whole GPU), so co-running kernels keep SMs free.
    ``options``: :class:`GemmOptions` (None: the defaults, the product).

    ``tile_records`` (a debug timeline, off when None): an int64 ``[>= num_tiles,
    abi.TILE_RECORD_COLUMNS]`` contiguous tensor on a's device (:func:`tile_records_for`);
    row ``t`` of tile ``t`` of the launched kernel's grid (``last_plan().tile_grid``, not the
    tile order) gets ``[tile, program, SM, start, wait done, end]`` (columns ``abi.REC_*``;
    %globaltimer ns on CUDA, a per-program logical clock without inline PTX). Every row below
    ``last_plan().num_tiles`` is written once per launch, the rest are left as they are; K = 0
    launches nothing and writes none. Where the times are taken in each kernel:
    docs/gemm_core.md, "Per-tile timeline". Without it, the kernels compile as if the mode
    did not exist.

    Everything decided by shapes, strides, dtypes, config and options is validated once and
    cached (a :class:`LaunchPlan`, :func:`last_plan`); per call only the hook specs' buffers and
    generations are checked.
    """
    options = DEFAULT_OPTIONS if options is None else options
    try:
        # Base-pointer alignment is part of the key: a view with the same shape and strides but
        # an odd offset cannot take a plan made for TMA (16-byte aligned bases).
        key = (a.shape, a.stride(), a.dtype, a.device, a.data_ptr() % 16 == 0,
               b.shape, b.stride(), b.dtype, b.device, b.data_ptr() % 16 == 0,
               None if out is None else (out.shape, out.stride(), out.dtype, out.device,
                                         out.data_ptr() % 16 == 0),
               config, tile_order, chunk_m, start_chunk, wait is not None and wait.chunk_m,
               epilogue is not None and (epilogue.chunk_m, epilogue.align_elems, len(epilogue.dests),
                                         stacked_dests(epilogue), epilogue.signalled),
               use_tma, num_sms, options, interpreting(), tile_records is not None, out_dtype,
               None if scale_a is None else (scale_a.shape, scale_a.stride(), scale_a.dtype, scale_a.device),
               None if scale_b is None else (scale_b.shape, scale_b.stride(), scale_b.dtype, scale_b.device))
        plan = _PLANS.get(key)
    except (AttributeError, TypeError):   # not tensors / unhashable: full validation says why
        key, plan = None, None
    if plan is None:
        plan = _make_plan(a, b, out, config, tile_order, chunk_m, start_chunk, wait, epilogue, use_tma, num_sms,
                          options, tile_records is not None, out_dtype, scale_a, scale_b)
        if key is not None:
            if len(_PLANS) >= _MAX_PLANS:
                _PLANS.clear()
            _PLANS[key] = plan
    _LAST_PLAN[0] = plan
    m, n, k = plan.m, plan.n, plan.k
    device = a.device
    if out is None and epilogue is None:
        out = torch.empty(m, n, dtype=plan.out_dtype, device=device)
    if m == 0 or n == 0:
        return out if epilogue is None else None
    if k == 0 and epilogue is None and wait is None:
        return out.zero_()
    if k == 0:
        raise ValueError("matmul: K=0 with hooks; nothing to compute, publish the chunks on the host instead")

    num_chunks = plan.num_chunks
    if tile_records is not None:
        _check_tile_records(tile_records, plan, device)
    if wait is not None:
        _check_generation(wait.generation, "wait.generation")
        s = wait.signal
        if s.dtype != torch.int32 or s.device != device or s.numel() < num_chunks:
            raise ValueError(f"matmul: wait.signal is {s.dtype} with {s.numel()} elements on {s.device}; "
                             f"need int32 with >= num_chunks={num_chunks} elements on {device}")
        if wait.error is not None and (wait.error.dtype != torch.int32 or wait.error.numel() < ERROR_WORDS):
            raise ValueError(f"matmul: wait.error must be int32 with {ERROR_WORDS} words; use new_error_word()")
    if epilogue is not None:
        if (epilogue.signal_ptrs is None) != (epilogue.counters is None):
            raise ValueError("matmul: epilogue has signal_ptrs without counters or counters without signal_ptrs; "
                             "give both (signalled) or neither (route only): EpilogueSpec.from_tensors builds either")
        if epilogue.signalled:
            _check_generation(epilogue.generation, "epilogue.generation")
        if epilogue.base.dtype != plan.out_dtype or epilogue.base.device != device:
            raise ValueError(f"matmul: epilogue.base is {epilogue.base.dtype} on {epilogue.base.device}; "
                             f"need {plan.out_dtype} on {device} (the destinations' dtype: the output's)")
        for nm, t, dt in (("dest_offsets", epilogue.dest_offsets, torch.int64),
                          ("signal_ptrs", epilogue.signal_ptrs, torch.int64),
                          ("counters", epilogue.counters, torch.int32)):
            if t is None:   # route only (checked above: both or neither)
                continue
            if t.dtype != dt or t.numel() < num_chunks or t.device != device:
                raise ValueError(f"matmul: epilogue.{nm} is {t.dtype} with {t.numel()} elements on {t.device}; "
                                 f"need {dt} with >= num_chunks={num_chunks} elements on {device}")

    cfg = plan.config
    err = None
    if wait is not None:
        err = wait.error if wait.error is not None else new_error_word(device)
    if plan.kernel in ("gemm_ws_kernel", "gemm_pp_kernel"):
        if epilogue is not None:
            _launch_ws(plan, a, b, dests=epilogue.dests, stacked=plan.epi_tma == abi.EPI_TMA_STACKED,
                       epi_mode=epilogue_mode(epilogue), counters=epilogue.counters, signal_ptrs=epilogue.signal_ptrs,
                       generation=epilogue.generation, epi_descs=_epilogue_descriptors(epilogue, plan),
                       tile_records=tile_records, scale_a=scale_a, scale_b=scale_b)
            return None
        if wait is None:   # a plain call whose config asked for a Gluon kernel (GemmConfig.gluon, .pingpong)
            _launch_ws(plan, a, b, out=out, tile_records=tile_records, scale_a=scale_a, scale_b=scale_b)
            return out
        _launch_ws(plan, a, b, out=out, wait_signal=wait.signal, wait_gen=wait.generation,
                   wait_timeout_ns=wait.timeout_ns, err=err, tile_records=tile_records, scale_a=scale_a,
                   scale_b=scale_b)
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

    values = dict(
        a=a_arg, b=b_arg, c=c_arg, M=m, N=n, K=k,
        stride_am=a.stride(0), stride_ak=a.stride(1), stride_bk=b.stride(0), stride_bn=b.stride(1),
        stride_cm=out.stride(0) if out is not None else 0, stride_cn=out.stride(1) if out is not None else 0,
        chunk_m=plan.chunk_m, num_chunks=num_chunks, start_chunk=plan.start_chunk,
        scale_a=scale_a, scale_b=scale_b, tile_records=tile_records)
    if wait is not None or epilogue is not None:
        values.update(
            wait_signal=wait.signal if wait else None, wait_gen=wait.generation if wait else 0,
            wait_timeout=(wait.timeout_ns if plan.use_asm else wait.max_spins) if wait else 0, err_ptr=err,
            dest_offs=epilogue.dest_offsets if epilogue else None, stride_dm=epilogue.dest_stride if epilogue else 0,
            signal_ptrs=epilogue.signal_ptrs if epilogue else None,
            counters=epilogue.counters if epilogue else None, epi_gen=epilogue.generation if epilogue else 0,
            **{f"epi_d{q}": d for q, d in enumerate(_epilogue_descriptor_args(epilogue, plan))})
    ws_buf, tile_counters = _stream_k_buffers(plan, device) if plan.sk_tiles else (None, None)
    values.update(ws=ws_buf, tile_counters=tile_counters, sk_tiles=plan.sk_tiles)
    _launch_gemm_kernel(plan, key, values, device)
    if wait is not None and check:
        check_error_word(err, rank=wait.rank, timeout_ns=wait.timeout_ns if plan.use_asm else None)
    return out if epilogue is None else None


# --------------------------------------------------------------------------------------------
# a call site's repeated call
# --------------------------------------------------------------------------------------------
def _signature(t: Optional[torch.Tensor]) -> Optional[tuple]:
    """What a plan and a compiled kernel depend on in a tensor: all but its address (of which
    only the 16-byte alignment)."""
    if t is None:
        return None
    return t.shape, t.stride(), t.dtype, t.get_device(), t.data_ptr() % 16 == 0


def _operand_descs(plan: LaunchPlan, a: torch.Tensor, b: torch.Tensor, out: Optional[torch.Tensor]) -> dict:
    """The Gluon kernel's descriptors of ``a``, ``b`` (and ``out`` if given) as :func:`launch_tma`
    takes them, ``{position: (address, shape, strides)}``: made per call, the rest of a launch kept."""
    m, n, k = plan.m, plan.n, plan.k
    descs = {0: (a.data_ptr(), (m, k), (a.stride(0), 1)),
             1: (b.data_ptr(), (n, k), (b.stride(1), 1)) if plan.b_kmajor else (b.data_ptr(), (k, n), (b.stride(0), 1))}
    if out is not None:
        descs[2] = (out.data_ptr(), (m, n), (out.stride(0), 1))
    return descs


def _cuda_index(t: torch.Tensor) -> int:
    """``t``'s CUDA device index, -1 off CUDA."""
    return t.get_device() if t.is_cuda else -1


class PreparedMatmul:
    """``matmul(a, b, out=out, scale_a=scale_a, scale_b=scale_b, **fixed)`` for a call site that
    makes one call again and again on new tensors of the same kind (the fused strategies' GEMM:
    a new gathered A and output every call, the same hook specs).

    Every call whose tensors differ from the kept call's in anything but their addresses --
    shape, strides, dtype, device, 16-byte alignment -- the first call, and the first call after
    :func:`clear_plans` go through :func:`matmul`, which validates and plans.  When that call
    launched the Gluon kernel by the direct path with expanded descriptors
    (``tpfuse/_direct.py``, ``launch_tma``), its argument list is kept, and later calls of the
    same kind put the new addresses (the descriptors of ``a``, ``b``, ``out``; the scales) into it
    and launch: no plan key, no per-call checks of the (frozen) hook specs, no argument lists
    built.  Why: on the one-GPU bed's host that per-call work was the largest host cost of a
    fused call after its native operations (cProfile of eager calls; issue 34).  Anything the
    short path cannot do (a launch hook set, Triton's path taken) falls back to :func:`matmul`
    for that call.

    ``fixed``: every other keyword of :func:`matmul` but ``tile_records``, the same objects on
    every call (hook specs are frozen dataclasses: their buffers and generations stay as given).
    A ``wait`` hook needs its own ``error`` word and ``check=False`` to be kept (otherwise every
    call is a plain :func:`matmul`: a new error word, a host check).
    """

    __slots__ = ("fixed", "_kept")

    def __init__(self, **fixed):
        if "tile_records" in fixed or "out" in fixed or "scale_a" in fixed or "scale_b" in fixed:
            raise TypeError("PreparedMatmul: out, scale_a and scale_b are per call; tile_records is not kept")
        self.fixed = fixed
        self._kept = None

    def __call__(self, a: torch.Tensor, b: torch.Tensor, out: Optional[torch.Tensor] = None,
                 scale_a: Optional[torch.Tensor] = None, scale_b: Optional[torch.Tensor] = None):
        kept = self._kept
        if kept is not None:
            sig = (_signature(a), _signature(b), _signature(out), _signature(scale_a), _signature(scale_b),
                   _PLANS_EPOCH[0])
            if sig == kept[0]:
                _, plan, direct, grid, args, descs, at_scales, index = kept
                args = list(args)
                args[at_scales] = scale_a
                args[at_scales + 1] = scale_b
                descs = {**descs, **_operand_descs(plan, a, b, out)}
                if launch_tma(direct, grid, torch._C._cuda_getCurrentRawStream(index), args, descs):
                    _LAST_PLAN[0] = plan
                    _LAUNCHES["direct"] += 1
                    _LAUNCHES["direct_tma"] += 1
                    return None if out is None else out
            self._kept = None
        _LAST_WS_LOCAL.parts = None
        result = matmul(a, b, out=out, scale_a=scale_a, scale_b=scale_b, **self.fixed)
        self._keep(a, b, out, scale_a, scale_b)
        return result

    def _keep(self, a, b, out, scale_a, scale_b) -> None:
        """Keep the call just made by :func:`matmul` if it was a direct Gluon launch that the
        short path repeats exactly."""
        last = getattr(_LAST_WS_LOCAL, "parts", None)   # this call's (cleared before it), or None
        fixed = self.fixed
        wait, epilogue = fixed.get("wait"), fixed.get("epilogue")
        index = _cuda_index(a)
        if last is None or index < 0:
            return
        if wait is not None and (wait.error is None or fixed.get("check", True)):
            return   # a new error word per call, or a host check: matmul's own path
        if (epilogue is None) == (out is None):
            return   # matmul allocates the output, or the epilogue ignores out
        plan, direct, grid, args, descs, hooked, at_scales = last
        descs = {q: v for q, v in descs.items() if q > 2 - hooked}   # per call: a, b (and out) are not kept
        if args[at_scales] is not scale_a or args[at_scales + 1] is not scale_b:
            return   # not where this module's argument list puts them
        sig = (_signature(a), _signature(b), _signature(out), _signature(scale_a), _signature(scale_b),
               _PLANS_EPOCH[0])
        args = list(args)
        args[at_scales] = args[at_scales + 1] = None   # per call: the first call's are not held
        self._kept = (sig, plan, direct, grid, tuple(args), descs, at_scales, index)
