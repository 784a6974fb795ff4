"""Costs of the pieces a fused op is made of: a GEMM (chunk) and a transfer (chunk), in milliseconds.

GEMM: a roofline on ``FLOPs / F_eff(shape)`` and ``bytes / (HBM * hbm_eff) + hbm_latency``,
blended by a p-norm (so a shape near the ridge is slower than either bound alone), plus a launch
overhead::

    F_eff = peak * gemm_eff_max * throttle(t0) * rel(tile) * k' / (k' + gemm_k_half) * util(tile, split)
    util  = m * n * split / (waves * num_sms * tile_m * tile_n),  waves = ceil(tiles * split / num_sms)

``throttle(t0) = 1 - gemm_throttle * t0 / (t0 + gemm_throttle_ms)`` (``t0``: the GEMM's
time at the burst rate) multiplies F_eff: long GEMMs run at power-limited clocks.
``util`` is wave quantization plus the padding of a partial tile; the library (cuBLAS or our
persistent kernel) is assumed to pick the best of a few tile shapes and split-K factors, the
smaller tiles paying ``rel``, or a stream-K kernel of a tile (``util`` = padding only, at
``gemm_streamk_rel``); ``k' = k / split`` makes small K lose efficiency (prologue and
epilogue of a tile are not amortised).

Transfer: ``alpha + bytes / B_eff`` where ``B_eff`` depends on who moves the bytes: NCCL (ring,
its SMs; ``p2p`` = NCCL send/recv issued step by step from Python), the copy engine (no SMs) or
``num_sms`` SMs doing peer stores (``sm_p2p_gbps``).  Where the profile has a measured NCCL entry
for the world size (``HardwareProfile.nccl_fit``), NCCL collectives cost ``alpha_W + bytes per
rank / bus_W`` and a ``p2p`` step (one host-issued NCCL call) costs ``alpha_W + bytes / bus_W``.

Precision: tpfuse's ``unfused`` and ``ring`` reduce bf16/fp16 partials in fp32 (fp64 for fp64;
``tpfuse.dtypes``), so their reductions move 4-byte partials and pay
an upcast and a downcast pass at HBM speed (``unfused_collective_parts``).  ``collective_ms`` is
the bare collective on the op's own dtype (what ``tpfuse bench`` times as "comm alone").
"""

from __future__ import annotations

import functools
import math
from typing import Literal

from tpfuse import dtypes
from tpfuse.model.hardware import HardwareProfile

__all__ = [
    "TILE_SHAPES",
    "SPLIT_K",
    "gemm_time_ms",
    "core_gemm_time_ms",
    "gemm_tflops",
    "gemm_memory_time_ms",
    "transfer_time_ms",
    "worker_gbps",
    "worker_transfer_time_ms",
    "link_gbps",
    "alpha_ms",
    "all_gather_ms",
    "reduce_scatter_ms",
    "all_reduce_ms",
    "collective_ms",
    "accumulation_dtype",
    "cast_time_ms",
    "nccl_bytes_per_rank",
    "unfused_collective_parts",
    "p2p_collective_ms",
    "reduce_time_ms",
    "copy_time_ms",
    "peer_reduce_time_ms",
    "two_stage_pipeline_ms",
]

# Hopper cuBLAS / Triton persistent kernels mostly run 128x256 (or 256x128), 128x128 and 64x128
# CTA tiles for bf16; the relative efficiency of the smaller two is a fitted profile field.
TILE_SHAPES: tuple[tuple[int, int], ...] = ((128, 256), (128, 128), (64, 128))
SPLIT_K: tuple[int, ...] = (1, 2, 4)
# Split-K below 256 K-elements per split costs more in partial-sum traffic than it gains in waves
# (a lead: cuBLAS' split-K kernels on H100/H200 use >= 256-deep slices for bf16).
_MIN_K_PER_SPLIT = 256

Path = Literal["nccl", "p2p", "ce", "sm"]


@functools.lru_cache(maxsize=1 << 16)
def gemm_time_ms(m: int, n: int, k: int, dtype: str, hw: HardwareProfile, *,
                 num_sms: int | None = None, hbm_share: float = 1.0, launch: bool = True) -> float:
    """Predicted time of one ``[m, k] @ [k, n]`` GEMM (pure, hence cached).

    ``num_sms`` < ``hw.sm_count`` models SMs taken by communication workers (contention);
    ``hbm_share`` < 1 models HBM bandwidth taken by concurrent copies; ``launch=False`` drops
    the launch overhead (a chunk inside a persistent kernel).
    """
    if m <= 0 or n <= 0:
        return hw.gemm_launch_us * 1e-3 if launch else 0.0
    sms = hw.sm_count if num_sms is None else num_sms
    if sms <= 0:
        raise ValueError(f"num_sms: {sms} leaves no SMs for the GEMM; use fewer communication SMs")
    if sms < hw.sm_count:
        # Fewer SMs are never faster: the wave-quantization model alone could say so by luck.
        return max(_gemm_time_ms(m, n, k, dtype, hw, sms, hbm_share, launch),
                   _gemm_time_ms(m, n, k, dtype, hw, hw.sm_count, hbm_share, launch))
    return _gemm_time_ms(m, n, k, dtype, hw, sms, hbm_share, launch)


def _gemm_time_ms(m, n, k, dtype, hw, sms, hbm_share, launch) -> float:
    elt = dtypes.itemsize(dtype)
    flops = 2.0 * m * n * k
    peak = hw.tflops(dtype) * 1e12 * hw.gemm_eff_max
    if hw.gemm_throttle > 0:
        # Sustained tensor-core load lowers clocks (power limit): a kernel of t0 ms runs at
        # 1 - throttle * t0 / (t0 + tau) of its short-burst rate.  Monotone: more work, never faster.
        t0 = flops / (hw.tflops(dtype) * 1e12 * hw.gemm_eff_max) * 1e3
        peak *= 1.0 - hw.gemm_throttle * t0 / (t0 + hw.gemm_throttle_ms)
    peak *= sms / hw.sm_count  # the SMs this GEMM gets (others may be moving bytes)
    t_mem = (elt * (m * k + k * n + m * n) / (hw.hbm_gbps * 1e9 * hw.hbm_eff * hbm_share)
             + hw.hbm_latency_us * 1e-6)
    p = hw.gemm_blend_p
    best = math.inf
    for (tile_m, tile_n), rel in zip(TILE_SHAPES, hw.gemm_tile_rel):
        tiles = math.ceil(m / tile_m) * math.ceil(n / tile_n)
        for split in SPLIT_K:
            if split > 1 and (k // split < _MIN_K_PER_SPLIT or tiles >= sms):
                continue
            k_split = max(k / split, 1.0)
            waves = math.ceil(tiles * split / sms)
            util = m * n * split / (waves * sms * tile_m * tile_n)
            k_eff = k_split / (k_split + hw.gemm_k_half)
            t_comp = flops / (peak * rel * k_eff * util) if k > 0 else 0.0
            t = (t_comp ** p + t_mem ** p) ** (1.0 / p)
            best = min(best, t)
        if hw.gemm_streamk_rel > 0 and k > 0:
            # stream-K: K-steps shared out evenly over the SMs, so no wave quantization (only the
            # padding of partial tiles), at a fitted cost for the fix-up of split tiles
            util = m * n / (tiles * tile_m * tile_n)
            t_comp = flops / (peak * rel * hw.gemm_streamk_rel * (k / (k + hw.gemm_k_half)) * util)
            best = min(best, (t_comp ** p + t_mem ** p) ** (1.0 / p))
    return best * 1e3 + (hw.gemm_launch_us * 1e-3 if launch else 0.0)


def core_gemm_time_ms(m: int, n: int, k: int, dtype: str, hw: HardwareProfile, *,
                      hook: str | None = None, num_sms: int | None = None) -> float:
    """One launch of tpfuse's persistent Triton GEMM core (``tpfuse.gemm.matmul``) on
    ``[m, k] @ [k, n]``, device time, launch included: the cuBLAS model of the same shape over
    the core's measured efficiency ``hw.core_gemm_rel``, times ``1 + rel`` plus ``us`` of its
    hook (``"wait"``: fused ag_gemm's per-chunk waits in round order; ``"epilogue"``: fused
    gemm_rs' per-chunk stores in owner order; None: plain).  ``num_sms``: the persistent grid."""
    if hook not in (None, "wait", "epilogue"):
        raise ValueError(f"hook: {hook!r}; use None, 'wait' or 'epilogue'")
    rel, us = {None: (0.0, 0.0), "wait": (hw.core_wait_rel, hw.core_wait_us),
               "epilogue": (hw.core_epilogue_rel, hw.core_epilogue_us)}[hook]
    t = gemm_time_ms(m, n, k, dtype, hw, num_sms=num_sms)
    return t / hw.core_gemm_rel * (1.0 + rel) + (us * 1e-3 if m > 0 and n > 0 else 0.0)


def gemm_memory_time_ms(m: int, n: int, k: int, dtype: str, hw: HardwareProfile) -> float:
    """The HBM floor of a GEMM: A, B and C each moved once at the achievable bandwidth."""
    return dtypes.itemsize(dtype) * (m * k + k * n + m * n) / (hw.hbm_gbps * 1e9 * hw.hbm_eff) * 1e3


def gemm_tflops(m: int, n: int, k: int, dtype: str, hw: HardwareProfile, **kw) -> float:
    """The achieved TFLOP/s the model predicts for a GEMM shape."""
    return 2.0 * m * n * k / (gemm_time_ms(m, n, k, dtype, hw, **kw) * 1e-3) / 1e12


def link_gbps(path: Path, hw: HardwareProfile, num_sms: int | None = None,
              world_size: int | None = None) -> float:
    """Achieved per-direction bandwidth of a transport (NCCL's measured one at ``world_size``
    where the profile has it)."""
    if path in ("nccl", "p2p"):
        if world_size is not None and world_size > hw.max_domain:
            return min(hw.link_nccl_gbps, hw.link_internode_gbps)  # the group spans hosts
        fit = hw.nccl_fit(world_size) if world_size is not None else None
        return fit.bus_gbps if fit is not None else hw.link_nccl_gbps
    if path == "ce":
        return hw.link_ce_gbps
    if path == "sm":
        return hw.sm_p2p_gbps(hw.sm_count if num_sms is None else num_sms)
    raise ValueError(f"path: unknown transport {path!r}; use 'nccl', 'ce' or 'sm'")


def alpha_ms(path: Path, hw: HardwareProfile, world_size: int | None = None) -> float:
    """Fixed cost of one transfer.  A ``p2p`` step is one NCCL call issued from the host, so at a
    world size with a measured NCCL entry it pays that entry's per-call alpha (which is the
    host-inclusive cost of one collective call), not the lead per-ring-step ``alpha_nccl_us``."""
    if path == "p2p" and world_size is not None:
        fit = hw.nccl_fit(world_size)
        if fit is not None:
            return fit.alpha_us * 1e-3
    return {"nccl": hw.alpha_nccl_us, "p2p": hw.alpha_p2p_us, "ce": hw.alpha_ce_us,
            "sm": hw.alpha_sm_us}[path] * 1e-3


def transfer_time_ms(num_bytes: float, path: Path, hw: HardwareProfile, *,
                     num_sms: int | None = None, world_size: int | None = None) -> float:
    """``alpha + bytes / B_eff`` for one chunk moved by ``path`` (0 for an empty chunk);
    ``world_size`` selects the measured NCCL entry (bandwidth for ``nccl``/``p2p``, alpha for
    ``p2p``) where the profile has one."""
    if num_bytes <= 0:
        return 0.0
    bw = link_gbps(path, hw, num_sms, world_size)
    if bw <= 0:
        raise ValueError(f"num_sms: {num_sms} SMs cannot move bytes; give communication at least one SM")
    return alpha_ms(path, hw, world_size) + num_bytes / (bw * 1e9) * 1e3


# One worker CTA keeps ``in_flight_bytes`` of loads outstanding and waits for them before it stores
# (tpfuse/kernels/sm_workers.py: load a block, store it, next block), so by Little's law it moves
# at most in_flight / round trip.  Lead, not measured: ~1 us for a load over NVLink4 from an SM
# (published pointer-chasing microbenchmarks put a remote HBM load at 0.7-1.5 us); `tpfuse bench
# comm`'s sm_workers grid (bandwidth vs chunk bytes x workers x in flight) is what calibrates it.
WORKER_ROUND_TRIP_US = 1.0


def worker_gbps(hw: HardwareProfile, workers: int, in_flight_bytes: int) -> float:
    """Achieved bandwidth of ``workers`` worker CTAs (one SM each) with ``in_flight_bytes`` of
    loads in flight per CTA: each CTA the smaller of an SM's peer rate
    (``link_sm_gbps_per_sm``) and ``in_flight_bytes`` per :data:`WORKER_ROUND_TRIP_US`, all of
    them at most the SM-driven ceiling (``link_sm_max_gbps``)."""
    if workers < 1 or in_flight_bytes < 1:
        raise ValueError(f"workers={workers}, in_flight_bytes={in_flight_bytes}: both must be >= 1")
    per_cta = min(hw.link_sm_gbps_per_sm, in_flight_bytes / (WORKER_ROUND_TRIP_US * 1e-6) / 1e9)
    return min(hw.link_sm_max_gbps, workers * per_cta)


def worker_transfer_time_ms(num_bytes: float, hw: HardwareProfile, *, workers: int, in_flight_bytes: int) -> float:
    """One chunk moved by worker CTAs (sm_workers): ``alpha_sm + bytes / worker_gbps`` (the
    chunk's flag wait and publish are the SM-driven alpha), 0 for an empty chunk.  Small chunks
    pay the alpha, few workers or little in flight the bandwidth: bandwidth(chunk, workers,
    in flight) = bytes / this."""
    if num_bytes <= 0:
        return 0.0
    return hw.alpha_sm_us * 1e-3 + num_bytes / (worker_gbps(hw, workers, in_flight_bytes) * 1e9) * 1e3


def reduce_time_ms(num_bytes_moved: float, hw: HardwareProfile, *, launch: bool = True) -> float:
    """A memory-bound elementwise reduction that reads and writes ``num_bytes_moved`` in total
    (``launch=False``: done inside an already running kernel)."""
    if num_bytes_moved <= 0:
        return 0.0
    t = num_bytes_moved / (hw.hbm_gbps * 1e9 * hw.hbm_eff) * 1e3
    return t + (hw.gemm_launch_us * 1e-3 if launch else 0.0)


def copy_time_ms(num_bytes: float, hw: HardwareProfile) -> float:
    """A copy of ``num_bytes`` within one GPU's memory (read and write at HBM speed, one launch)."""
    return reduce_time_ms(2 * num_bytes, hw)


def peer_reduce_time_ms(num_bytes_moved: float, peer_bytes: float, hw: HardwareProfile) -> float:
    """A reduction kernel that moves ``num_bytes_moved`` in all, ``peer_bytes`` of them read from
    peers' memory in place (SM loads over the link, every SM): the slower of HBM and the link,
    plus one launch (copy_engine's one-shot gemm_ar)."""
    if num_bytes_moved <= 0:
        return 0.0
    hbm = reduce_time_ms(num_bytes_moved, hw, launch=False)
    link = transfer_time_ms(peer_bytes, "sm", hw, num_sms=hw.sm_count)
    return max(hbm, link) + hw.gemm_launch_us * 1e-3


def nccl_bytes_per_rank(kind: str, total_bytes: float, world_size: int) -> float:
    """Bytes each rank sends in an NCCL ``kind`` collective over ``total_bytes`` (the full gathered
    output / the full input of a reduction), nccl-tests' bus-bandwidth convention:
    ``(W-1)/W * total`` for ``all_gather``/``reduce_scatter``, twice that for ``all_reduce``."""
    if kind not in ("all_gather", "reduce_scatter", "all_reduce"):
        raise ValueError(f"kind: unknown collective {kind!r}; use all_gather, reduce_scatter or all_reduce")
    if world_size <= 1:
        return 0.0
    per_rank = total_bytes * (world_size - 1) / world_size
    return 2 * per_rank if kind == "all_reduce" else per_rank


def _measured_ms(kind: str, total_bytes: float, world_size: int, hw: HardwareProfile) -> float | None:
    fit = hw.nccl_fit(world_size)
    if fit is None:
        return None
    return fit.alpha_us * 1e-3 + nccl_bytes_per_rank(kind, total_bytes, world_size) / (fit.bus_gbps * 1e9) * 1e3


def _nccl_ms(kind: str, total_bytes: float, world_size: int, hw: HardwareProfile) -> float:
    """An NCCL all-gather / reduce-scatter over ``total_bytes``: the measured table at this W,
    else the lead ring ``(W-1) * (alpha + shard / B)``."""
    if world_size <= 1 or total_bytes <= 0:
        return 0.0
    measured = _measured_ms(kind, total_bytes, world_size, hw)
    if measured is not None:
        return measured
    return (world_size - 1) * transfer_time_ms(total_bytes / world_size, "nccl", hw, world_size=world_size)


def all_gather_ms(total_bytes: float, world_size: int, hw: HardwareProfile) -> float:
    """NCCL all-gather producing ``total_bytes`` on every rank."""
    return _nccl_ms("all_gather", total_bytes, world_size, hw)


def reduce_scatter_ms(total_bytes: float, world_size: int, hw: HardwareProfile) -> float:
    """NCCL reduce-scatter of a ``total_bytes`` input (reduction fused in NCCL's kernels)."""
    return _nccl_ms("reduce_scatter", total_bytes, world_size, hw)


def all_reduce_ms(total_bytes: float, world_size: int, hw: HardwareProfile) -> float:
    """NCCL all-reduce: measured table at this W, else the better of ring (RS + AG) and a
    one-step algorithm for small messages."""
    if world_size <= 1 or total_bytes <= 0:
        return 0.0
    measured = _measured_ms("all_reduce", total_bytes, world_size, hw)
    if measured is not None:
        return measured
    ring = 2 * all_gather_ms(total_bytes, world_size, hw)
    one_step = (alpha_ms("nccl", hw) * 2
                + (world_size - 1) * total_bytes / (link_gbps("nccl", hw, world_size=world_size) * 1e9) * 1e3)
    return min(ring, one_step)


def collective_ms(op: str, m: int, n: int, k: int, world_size: int, dtype: str,
                  hw: HardwareProfile) -> float:
    """The NCCL collective of ``op`` alone, on ``dtype`` data (what ``tpfuse bench`` times as
    "comm alone"; tpfuse's own unfused reduction pays ``unfused_collective_parts`` instead)."""
    elt = dtypes.itemsize(dtype)
    if op == "ag_gemm":
        return all_gather_ms(m * k * elt, world_size, hw)
    if op == "gemm_rs":
        return reduce_scatter_ms(m * n * elt, world_size, hw)
    if op == "gemm_ar":
        return all_reduce_ms(m * n * elt, world_size, hw)
    raise ValueError(f"op: unknown op {op!r}; use 'ag_gemm', 'gemm_rs' or 'gemm_ar'")


def accumulation_dtype(dtype: str) -> str:
    """Dtype (name) in which partials of ``dtype`` products are reduced across ranks: the dtype
    policy's default (``tpfuse.dtypes.reduce_dtype``: fp64 stays fp64, all else fp32)."""
    return dtypes.name(dtypes.reduce_dtype(dtype))


def cast_time_ms(num_elements: float, src: str, dst: str, hw: HardwareProfile) -> float:
    """One ``tensor.to(dst)`` pass over ``num_elements``: read ``src``, write ``dst`` at HBM speed
    plus a launch; 0 when the dtypes match (``.to`` returns the tensor itself)."""
    if src == dst or num_elements <= 0:
        return 0.0
    return reduce_time_ms(num_elements * (dtypes.itemsize(src) + dtypes.itemsize(dst)), hw)


def unfused_collective_parts(op: str, m: int, n: int, k: int, world_size: int, dtype: str,
                             hw: HardwareProfile) -> tuple[float, float, float]:
    """(upcast, collective, downcast) ms that tpfuse's ``unfused`` strategy pays besides the GEMM.

    ag_gemm: (0, all-gather of ``dtype``, 0).  gemm_rs: upcast of the ``[m, n]`` partial to the
    accumulation dtype, reduce-scatter of it, downcast of the ``[m/W, n]`` shard.  gemm_ar: upcast,
    all-reduce of the ``[m, n]`` accumulation-dtype partial, downcast of all of it.
    """
    if world_size <= 1 or m <= 0:
        return 0.0, 0.0, 0.0
    if op == "ag_gemm":
        return 0.0, collective_ms(op, m, n, k, world_size, dtype, hw), 0.0
    acc = accumulation_dtype(dtype)
    up = cast_time_ms(m * n, dtype, acc, hw)
    comm = collective_ms(op, m, n, k, world_size, acc, hw)
    out_rows = m // world_size if op == "gemm_rs" else m
    return up, comm, cast_time_ms(out_rows * n, acc, dtype, hw)


def p2p_collective_ms(op: str, m: int, n: int, k: int, world_size: int, dtype: str,
                      hw: HardwareProfile, path: Path, *, num_sms: int | None = None) -> float:
    """The collective of ``op`` done alone over peer-to-peer ``path`` (symmetric memory), the way
    copy_engine and fused move it, without the GEMMs: AG pulls the W-1 peer shards; RS sends
    W-1 partial shards, then the owner's reduce kernel reads its W inbox slots; AR the better of
    one-shot (every rank reads every partial in place while it reduces) and two-shot (RS, then
    the reduced shards gathered).  A floor for both strategies (they pay every piece of it on
    their critical path, plus flags and host time)."""
    w = world_size
    if w <= 1 or m <= 0:
        return 0.0
    elt = dtypes.itemsize(dtype)
    shard = m // w
    if op == "ag_gemm":
        return (w - 1) * transfer_time_ms(shard * k * elt, path, hw, num_sms=num_sms)
    rs = ((w - 1) * transfer_time_ms(shard * n * elt, path, hw, num_sms=num_sms)
          + reduce_time_ms((w + 1) * shard * n * elt, hw))
    if op == "gemm_rs":
        return rs
    if op == "gemm_ar":
        nbytes = m * n * elt
        one_shot = peer_reduce_time_ms((w + 1) * nbytes, (w - 1) * nbytes, hw)
        two_shot = rs + (w - 1) * transfer_time_ms(shard * n * elt, path, hw, num_sms=num_sms)
        return min(one_shot, two_shot)
    raise ValueError(f"op: unknown op {op!r}; use 'ag_gemm', 'gemm_rs' or 'gemm_ar'")


def two_stage_pipeline_ms(t_first: float, t_second: float, num_chunks: int) -> float:
    """Closed form of a uniform two-stage pipeline: ``T = t1 + t2 + (n - 1) * max(t1, t2)``.

    The seed analysis ``T_fill + max(T_gemm, T_comm) + T_drain`` with per-chunk stage times;
    the simulator must agree with it on uniform pipelines (tests pin this).
    """
    if num_chunks <= 0:
        return 0.0
    return t_first + t_second + (num_chunks - 1) * max(t_first, t_second)
