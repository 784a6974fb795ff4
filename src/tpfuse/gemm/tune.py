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
from .hooks import EpilogueSpec, WaitSpec, check_error_word, new_error_word

__all__ = ["tune", "rerank_leaders", "hook_winners", "HOOK_CHUNKS"]

# Chunks of the hooked calls :func:`tune` times when not told (the fused strategies' calls
# have one per rank: pass ``chunks=`` the group's size).
HOOK_CHUNKS = 8


def tune(a: torch.Tensor, b: torch.Tensor, *, configs: Optional[Sequence[GemmConfig]] = None,
         rep_ms: int = 20, save: bool = True, graphs: Optional[bool] = None,
         scale_a: Optional[torch.Tensor] = None, scale_b: Optional[torch.Tensor] = None,
         out_dtype: Optional[torch.dtype] = None, hooks: Sequence[str] = cache.HOOKS,
         chunks: int = HOOK_CHUNKS,
         ) -> tuple[GemmConfig, list[tuple[GemmConfig, float]]]:
    """Time every candidate config on ``a @ b`` (median, ``triton.testing.do_bench``; fp8 on sm_90:
    with the Gluon kernel's, ``GemmConfig.gluon``, among them), store the
    fastest in the JSON cache and return ``(best, [(config, ms), ...])``, fastest first (the
    leaders re-timed, :func:`rerank_leaders`; their ms the median of their timings). A config
    that fails to compile or launch (out of shared memory or registers, a Triton limitation) is
    skipped with a warning; only an error that leaves the CUDA context unusable (an illegal
    address) ends the search, since nothing can run on that device afterwards.

    ``hooks`` (default both, ``("wait", "epilogue")``; ``()``: none): the re-timed leaders are
    timed again with each hook, as the fused strategies call them -- the wait hook with its
    signals already set, in the round tile order; the epilogue hook without signals, into one
    destination per chunk, in the owner order; ``chunks`` chunks of ``ceil(M / chunks)`` rows
    (the strategies: one per rank) -- in interleaved rounds, and the fastest is stored for that
    hook's calls (``cache.lookup(..., hook=)``; a hooked call without such an entry takes the
    plain one: a tuning without a hook removes the entries an earlier one stored for it).
    Skipped with fewer than two leaders. Why: one config does not serve both hooks, whose cost
    depends on the kernel that carries them (on the H200 in fp8, 8B fc2 prefill row-wise: the
    wait hook within 3 % in ``gemm_kernel``'s 128x256 tile and over 4 % in ``gemm_pp``'s, the
    epilogue hook the other way round; docs/gemm_core.md, Tuning).

    ``graphs`` (default: on CUDA) times CUDA-graph replays of one call: eager timings of a small
    GEMM measure the host's launch cost, and would pick a config by launch noise.

    fp8: ``scale_a`` / ``scale_b`` (and ``out_dtype``) as the calls to be tuned for pass them, so
    that row-wise scales, whose loads sit in every tile's epilogue, are timed (the candidates
    rank differently with them: the fp8 benchmark tunes each scaling apart). Without them fp8
    candidates run unscaled into the default output dtype. The cache keeps one config per
    shape, dtype, layout and hook: the last tuning of a shape wins, whatever its scales."""
    triton, _, _ = triton_modules()
    m, k = a.shape
    n = b.shape[1]
    hooks = tuple(hooks)
    bad = [h for h in hooks if h not in cache.HOOKS]
    if bad:
        raise ValueError(f"tune: hooks={hooks!r}; choose among {cache.HOOKS}")
    if hooks and (isinstance(chunks, bool) or not isinstance(chunks, int) or chunks < 1):
        raise ValueError(f"tune: chunks={chunks!r}; need an int >= 1 (the strategies: the group's size)")
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

    def time_call(call) -> float:
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

    def timed(cfg: GemmConfig) -> float:
        return time_call(lambda: launch.matmul(a, b, out=out, config=cfg, **extra))

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
    ranked = rerank_leaders(timings, timed)
    timings = [(cfg, ms) for cfg, ms, _ in ranked]
    best = timings[0][0]
    b_kmajor = b.stride(0) == 1 and b.stride(1) != 1
    store = save and a.device.type == "cuda"
    if store:
        cache.store(m, n, k, a.dtype, b_kmajor, a.device, best, timings[0][1])
    leaders = [cfg for cfg, _, ts in ranked if len(ts) > 1]
    if len(leaders) > 1 and hooks:
        calls = {hook: _hooked_call(hook, a, out, chunks) for hook in hooks}

        def time_hooked(hook: str, cfg: GemmConfig) -> float:
            kwargs, check = calls[hook]
            ms = time_call(lambda: launch.matmul(a, b, config=cfg, **kwargs, **extra))
            check()
            return ms
        winners = hook_winners(leaders, hooks, time_hooked)
    else:
        winners = {}
    if store:
        for hook in cache.HOOKS:   # an entry of an earlier tuning would outlive this one's plain winner
            cache.store(m, n, k, a.dtype, b_kmajor, a.device, *winners.get(hook, (None, 0.0)), hook=hook,
                        **({"chunks": chunks} if hook in winners else {}))
        launch.clear_plans()   # plans made before hold the configs chosen before
    return best, timings


def hook_winners(leaders: Sequence[GemmConfig], hooks: Sequence[str], time_hooked) -> dict:
    """``{hook: (config, ms)}``: per hook, the fastest of ``leaders`` timed with it by
    ``time_hooked(hook, config)`` -- once each, then re-timed in interleaved rounds and ranked
    by the median (:func:`rerank_leaders`). A leader whose hooked call raises is left out, with
    a warning; a hook none of them runs with has no entry."""
    out = {}
    for hook in hooks:
        first = []
        for cfg in leaders:
            try:
                first.append((cfg, time_hooked(hook, cfg)))
            except Exception as e:  # noqa: BLE001 - it ran plain; say why it does not with the hook
                warn_once(f"tpfuse.gemm.tune: no {hook}-hook timing of {cfg}: {type(e).__name__}: {e}"[:600])
        if first:
            won, ms, _ = rerank_leaders(first, lambda cfg, hook=hook: time_hooked(hook, cfg), finalists=len(first))[0]
            out[hook] = (won, ms)
    return out


def _hooked_call(hook: str, a: torch.Tensor, out: torch.Tensor, chunks: int):
    """``(matmul keyword arguments, check)`` of a call with ``hook`` as the fused strategies
    make them, over ``chunks`` chunks of a's rows: the wait hook's signals already at their
    generation (no waiting: what is timed is what the hook costs a call whose data is there),
    ``check()`` raising from its error word; the epilogue hook without signals, one
    destination per chunk (peer buffers are separate allocations)."""
    m = a.shape[0]
    chunk_m = -(-m // chunks)
    num = -(-m // chunk_m)
    start = 1 if num > 1 else 0
    if hook == "wait":
        error = new_error_word(a.device)
        spec = WaitSpec(torch.ones(num, dtype=torch.int32, device=a.device), 1, chunk_m, error=error)
        return (dict(out=out, tile_order="round", start_chunk=start, wait=spec, check=False),
                lambda: check_error_word(error))
    dests = [torch.empty(min(chunk_m, m - c * chunk_m), out.shape[1], dtype=out.dtype, device=a.device)
             for c in range(num)]
    spec = EpilogueSpec.from_tensors(dests, None, 1, chunk_m)
    return dict(out=None, tile_order="owner", start_chunk=start, epilogue=spec), lambda: None


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
