"""Tuning: time every candidate config of one shape and keep the fastest in the cache
(:mod:`tpfuse.gemm.cache`), which later plans of that shape read.
"""
from __future__ import annotations

import statistics
from typing import Optional, Sequence

import torch

from ..kernels import _types
from . import cache, launch
from .config import GemmConfig, candidate_configs
from .device import device_index, device_info, interpreting, num_sms, triton_modules, warn_once

__all__ = ["tune", "rerank_leaders", "prefer_gluon", "GLUON_TIE"]

# How much slower (median of the finalists' re-timings) a Gluon config (``GemmConfig.gluon``)
# may be than a non-Gluon winner and still be kept in its place (:func:`prefer_gluon`).
GLUON_TIE = 0.02


def tune(a: torch.Tensor, b: torch.Tensor, *, configs: Optional[Sequence[GemmConfig]] = None,
         rep_ms: int = 20, save: bool = True, graphs: Optional[bool] = None,
         scale_a: Optional[torch.Tensor] = None, scale_b: Optional[torch.Tensor] = None,
         out_dtype: Optional[torch.dtype] = None,
         ) -> tuple[GemmConfig, list[tuple[GemmConfig, float]]]:
    """Time every candidate config on ``a @ b`` (median, ``triton.testing.do_bench``; fp8 on sm_90:
    with the Gluon kernel's, ``GemmConfig.gluon``, among them), store the
    fastest in the JSON cache and return ``(best, [(config, ms), ...])``, fastest first (the
    leaders re-timed, :func:`rerank_leaders`; their ms the median of their timings), except
    that a Gluon finalist within :data:`GLUON_TIE` of a non-Gluon winner is kept in its place
    (:func:`prefer_gluon`). A config
    that fails to compile or launch (out of shared memory or registers, a Triton limitation) is
    skipped with a warning; only an error that leaves the CUDA context unusable (an illegal
    address) ends the search, since nothing can run on that device afterwards.

    ``graphs`` (default: on CUDA) times CUDA-graph replays of one call: eager timings of a small
    GEMM measure the host's launch cost, and would pick a config by launch noise.

    fp8: ``scale_a`` / ``scale_b`` (and ``out_dtype``) as the calls to be tuned for pass them, so
    that row-wise scales, whose loads sit in every tile's epilogue, are timed (the candidates
    rank differently with them: the fp8 benchmark tunes each scaling apart). Without them fp8
    candidates run unscaled into the default output dtype. The cache keeps one config per
    shape, dtype and layout: the last tuning of a shape wins, whatever its scales."""
    triton, _, _ = triton_modules()
    m, k = a.shape
    n = b.shape[1]
    capability = device_info(device_index(a.device))["capability"] if a.device.type == "cuda" else (0, 0)
    configs = (list(configs) if configs is not None
               else candidate_configs(m, n, k, a.dtype, num_sms=num_sms(a.device), capability=capability))
    if out_dtype is None:
        out_dtype = _types.FP8_DEFAULT_OUT if _types.is_fp8(a.dtype) else a.dtype
    out = torch.empty(m, n, dtype=out_dtype, device=a.device)
    # what the tuned calls pass: their scales, and an output dtype other than the input's
    extra = {} if scale_a is None and scale_b is None else dict(scale_a=scale_a, scale_b=scale_b)
    if out_dtype != a.dtype:
        extra["out_dtype"] = out_dtype
    if graphs is None:
        graphs = a.device.type == "cuda" and not interpreting()

    def timed(cfg: GemmConfig) -> float:
        def call():
            launch.matmul(a, b, out=out, config=cfg, **extra)
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
            warn_once(f"tpfuse.gemm.tune: skipping config {cfg}: {type(e).__name__}: {e}"[:600])
            continue
        timings.append((cfg, ms))
    if not timings:
        raise RuntimeError(f"tpfuse.gemm.tune: no config ran for shape {m}x{n}x{k}")
    timings = [(cfg, ms) for cfg, ms, _ in prefer_gluon(rerank_leaders(timings, timed))]
    best = timings[0][0]
    if save and a.device.type == "cuda":
        cache.store(m, n, k, a.dtype, b.stride(0) == 1 and b.stride(1) != 1, a.device, best,
                    timings[0][1])   # the kept config's own time (prefer_gluon may keep a slower one)
        launch.clear_plans()   # plans made before hold the configs chosen before
    return best, timings


def rerank_leaders(timings: Sequence[tuple], timed, finalists: int = 6, rounds: int = 4) -> list[tuple]:
    """Rank tuning candidates more robustly than by one timing each: the ``finalists`` fastest
    of ``timings`` (``[(config, ms)]``) are timed ``rounds`` more times by ``timed(config)``, in
    interleaved rounds (each in a rotated order) so drift hits all alike, and ranked by the
    median of their timings. Returns ``[(config, ms, [timings])]``, fastest first: the leaders
    by that median, then the rest by their one timing. One timing is not enough: under the
    power cap the SM clock moves between ~1450 and ~1800 MHz from one timing to the next, and a
    config's single timing on 405B fc1 at M = 512 moved by +-4 % (H200, 2026-12-01,
    ``benchmarks/probe_drift.py``, since removed: see git history), as much as the configs differ. A leader whose re-timing
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
                warn_once(f"tpfuse.gemm.tune: dropping tuning finalist {entry[0]}: {type(e).__name__}: {e}"[:600])
                entry[1] = None
    out = sorted(((cfg, statistics.median(ts), ts) for cfg, ts in lead if ts is not None), key=lambda t: t[1])
    return out + [(cfg, ms, [ms]) for cfg, ms in ranked[len(lead):]]


def prefer_gluon(ranked: Sequence[tuple], margin: float = GLUON_TIE) -> list[tuple]:
    """``ranked`` (:func:`rerank_leaders`' ``[(config, ms, timings)]``, fastest first) with the
    fastest re-timed Gluon config (``config.gluon``; fp8 on sm_90) moved first when the winner is
    not one and the Gluon config's median is within ``margin`` of the winner's.

    Why: the cache keeps one config per shape for plain and hooked calls alike. A Gluon
    config's hooked calls run the kernel its plain calls were timed in (gemm_ws, or gemm_pp with
    ``pingpong``); a gemm_kernel winner's hooked fp8 calls run gemm_ws at its tile width, a
    kernel that was not timed for the shape (``launch.ws_choice``). In the fp8 benchmark at
    711a2e0 (H200, BENCHMARKS.md) 8B fc2 prefill row-wise (4096 x 4096 x 1792) kept gemm_kernel
    128x256 by 1.2 % over a gemm_pp finalist, and its hooked calls (gemm_ws) cost +6.0 % (wait)
    and +10.4 % (epilogue) over the plain call; the shapes whose plain calls ran gemm_pp paid
    -2.7 to +4.0 %. Two percent is within one config's timing spread under the power cap
    (:func:`rerank_leaders`). Only finalists (re-timed) are considered.

    Since then a gemm_kernel config chosen for the shape runs its fp8 wait hook and its hook
    without signals (all the strategies use) in gemm_kernel too (``launch.ws_choice``), so the
    reason above holds for the signalled epilogue hook only. The tie-break is kept: no run
    without it has been timed since (docs/gemm_core.md, Tuning)."""
    ranked = list(ranked)
    if not ranked or ranked[0][0].gluon:
        return ranked
    for i, (cfg, ms, timings) in enumerate(ranked):
        if cfg.gluon and len(timings) > 1 and ms <= ranked[0][1] * (1.0 + margin):
            return [ranked[i]] + ranked[:i] + ranked[i + 1:]
    return ranked
