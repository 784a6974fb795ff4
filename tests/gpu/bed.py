"""The one-GPU multi-process bed for the symmetric-memory strategies (DESIGN §6).

W processes share cuda:0 under MPS with ``TORCH_SYMM_MEM_ALLOW_OVERLAPPING_DEVICES=1`` and a
gloo group that carries only the rendezvous (gloo cannot move CUDA tensors there; NCCL refuses
two ranks on one GPU).  Every case compares against a float64 reference computed on every rank
from shared seeds; outputs are poisoned (TPFUSE_POISON=1) so an unwritten element shows as NaN.
Timings here are NOT multi-GPU timings: the ``timing`` case records bed-only numbers (what
fusion costs the GEMM before any link is in the way), labelled so in its rows.

    nvidia-cuda-mps-control -d
    python tests/gpu/bed.py --world-sizes 2 4 --out symm_1gpu.json
    echo quit | nvidia-cuda-mps-control

Exit code 0 when every case passed; the JSON has one row per (case, op, strategy, W, dtype, shape).
"""
from __future__ import annotations

import argparse
import datetime
import hashlib
import json
import os
import random
import sys
import time
import traceback
import zlib

import torch
import torch.distributed as dist

STRATEGIES = ("copy_engine", "fused", "sm_workers")
TIMEOUT_S = 4.0                      # TPFUSE_TIMEOUT_S of the bed's ranks (the dead-peer case times it)
QUEUE_WRAP_BUSY_MS = 50.0            # GPU sleep ahead of a queue_wrap stats call (its docstring says why)
ENV = {"TPFUSE_POISON": "1", "TPFUSE_DEBUG": "1", "TORCH_SYMM_MEM_ALLOW_OVERLAPPING_DEVICES": "1",
       "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NCCL_NVLS_ENABLE": "0", "TPFUSE_TIMEOUT_S": str(TIMEOUT_S)}
# k x the error of the unfused computation in the same dtype, + atol relative to max |ref|
TOL_FACTOR, TOL_ATOL = 4.0, 1e-6
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def _dev() -> torch.device:
    return torch.device("cuda", 0)


def _rel(x: torch.Tensor, ref: torch.Tensor) -> float:
    if ref.numel() == 0:
        return 0.0
    if not torch.isfinite(x).all():
        return float("inf")
    return ((x.double() - ref).abs().max() / ref.abs().max().clamp_min(1e-30)).item()


def _digest(x: torch.Tensor) -> str:
    return hashlib.sha1(x.contiguous().view(torch.uint8).cpu().numpy().tobytes()).hexdigest()


class Problem:
    """Shared-seed data of one call: A [M, K_total] with per-rank K slices, weights [N, K]."""

    def __init__(self, seed: int, world_size: int, m: int, k: int, n: int, dtype: torch.dtype):
        dev = _dev()
        g = torch.Generator(device=dev).manual_seed(seed)
        self.world_size, self.m, self.k, self.n, self.dtype = world_size, m, k, n, dtype
        # inputs rounded to dtype first, so the reference is exact for the rounded data
        def randn(*shape):
            return torch.randn(*shape, generator=g, device=dev).to(dtype)

        self.a = randn(m, k)                                    # AG: rows sharded
        self.w = [randn(n, k) for _ in range(world_size)]       # [N, K] weights, one per rank
        self.a_rs = [randn(m, k) for _ in range(world_size)]    # RS/AR: rank r's K slice

    def a_shard(self, rank):
        rows = self.m // self.world_size
        return self.a[rank * rows:(rank + 1) * rows]

    def ag(self, rank):
        a_shard = self.a_shard(rank)
        ref = self.a.double() @ self.w[rank].double().t()
        base = (self.a @ self.w[rank].t()).double()
        return a_shard, self.w[rank].t(), ref, _rel(base, ref)

    def reduced(self):
        ref = sum(x.double() @ w.double().t() for x, w in zip(self.a_rs, self.w))
        base = sum((x @ w.t()).float() for x, w in zip(self.a_rs, self.w)).to(self.dtype).double()
        return ref, base


def _check(op, out, prob, rank, extra=None):
    """(rel_err, tolerance, ok) of one op's output against the float64 reference."""
    if op == "ag_gemm":
        _, _, ref, base_err = prob.ag(rank)
        c, gathered = out
        err = _rel(c, ref)
        ok = torch.equal(gathered, prob.a)
    else:
        ref, base = prob.reduced()
        if op == "gemm_rs":
            rows = prob.m // prob.world_size
            ref, base = ref[rank * rows:(rank + 1) * rows], base[rank * rows:(rank + 1) * rows]
        base_err = _rel(base, ref)
        err = _rel(out, ref)
        ok = True
    tol = TOL_FACTOR * base_err + TOL_ATOL
    return err, tol, ok and err <= tol


def _call(op, strategy, prob, rank):
    import tpfuse

    if op == "ag_gemm":
        return tpfuse.ag_gemm(prob.a_shard(rank), prob.w[rank].t(), strategy=strategy, return_gathered=True)
    fn = tpfuse.gemm_rs if op == "gemm_rs" else tpfuse.gemm_ar
    return fn(prob.a_rs[rank], prob.w[rank].t(), strategy=strategy)


# ------------------------------------------------------------------------------------------------
# cases (run on every rank; return rows)
# ------------------------------------------------------------------------------------------------

def case_shapes(rank, world_size, strategy, shapes, dtypes):
    """Every op on each shape x dtype; M = W * rows (fused: no fp32, which it refuses)."""
    rows_out = []
    for rows, k, n in shapes:
        for dname in dtypes:
            if strategy in ("fused", "sm_workers") and dname == "fp32":
                continue
            for op in ("ag_gemm", "gemm_rs", "gemm_ar"):
                m = world_size * rows
                prob = Problem(zlib.crc32(repr((rows, k, n, dname, op)).encode()), world_size, m, k, n, DTYPES[dname])
                out = _call(op, strategy, prob, rank)
                torch.cuda.synchronize()
                err, tol, ok = _check(op, out, prob, rank)
                row = dict(case="shapes", op=op, strategy=strategy, world_size=world_size, dtype=dname,
                           shape=[m, n, k], passed=bool(ok), max_rel_err=err, tolerance=tol, calls=1)
                if op == "gemm_ar":
                    row["digest"] = _digest(out)
                rows_out.append(row)
    return rows_out


def case_chunks(rank, world_size, strategy, shapes):
    """More chunks than ranks (fused ag_gemm): each shard cut into 3 pieces, so chunks straddle
    shards (37 rows -> chunks of 13) and tiles straddle chunks; then 1 piece again (the plan
    and the arrival words must follow the knob)."""
    from tpfuse._dist import group_context
    from tpfuse.strategies import fused

    rows_out = []
    ctx = group_context(None)
    for pieces in (3, 4, 1):
        knobs = fused.FusedKnobs(chunks_per_rank=pieces)   # per call: the strategy's own knobs
        for rows, k, n in shapes:
            m = world_size * rows
            prob = Problem(zlib.crc32(repr((rows, k, n, pieces)).encode()), world_size, m, k, n, torch.bfloat16)
            out = fused.ag_gemm(prob.a_shard(rank), prob.w[rank].t(), ctx, knobs=knobs)
            torch.cuda.synchronize()
            err, tol, ok = _check("ag_gemm", out, prob, rank)
            rows_out.append(dict(case=f"chunks_{pieces}_per_rank", op="ag_gemm", strategy=strategy,
                                 world_size=world_size, dtype="bf16", shape=[m, n, k], passed=bool(ok),
                                 max_rel_err=err, tolerance=tol, calls=1))
    return rows_out


def _time_ms(fn, reps, sync_ranks=True):
    """Median ms per call of ``fn()`` over ``reps`` calls, each after a gloo barrier (every rank
    calls, so the ranks' calls overlap as in a real step)."""
    times = []
    for _ in range(reps):
        if sync_ranks:
            torch.cuda.synchronize()
            dist.barrier()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    times.sort()
    return times[len(times) // 2]


def case_timing(rank, world_size, strategy, cells, reps):
    """Bed-only numbers (NOT multi-GPU timings): per Llama cell scaled to fit, the fused call
    (every rank calling), and on rank 0 alone (the others wait in a barrier) the same GEMM with
    its hooks on and signals pre-set at the same SM budget, the core without hooks at that
    budget, the per-chunk cuBLAS GEMMs copy_engine issues, one cuBLAS GEMM; and the copy_engine
    call.  Plus the spans of one recorded fused call (GEMM, waits, reduce)."""
    import tpfuse
    from tpfuse import timeline
    from tpfuse.gemm import EpilogueSpec, WaitSpec, matmul
    from tpfuse.strategies import fused

    if strategy != "fused":
        return []
    rows_out = []
    budget = fused.sm_budget(_dev(), world_size)
    for rows, k, n in cells:
        m = world_size * rows
        for op in ("ag_gemm", "gemm_rs"):
            prob = Problem(zlib.crc32(repr(("timing", rows, k, n, op)).encode()), world_size, m, k, n, torch.bfloat16)
            row = dict(case="timing", op=op, strategy="fused", world_size=world_size, dtype="bf16", shape=[m, n, k],
                       sm_budget=budget, reps=reps)
            for s in ("fused", "copy_engine"):
                _call(op, s, prob, rank)                     # warm-up: workspace, JIT
                row[f"{s}_ms"] = _time_ms(lambda s=s: _call(op, s, prob, rank), reps)
            events = []
            for s in ("fused", "copy_engine"):   # one recorded call each (a panel each in the picture)
                for _warm_up_then_kept in range(2):  # the first recorded call compiles the record variants
                    torch.cuda.synchronize()
                    dist.barrier()
                    with timeline.recording(rank) as rec:
                        with rec.span("call", f"{s} {op}", device=_dev()):
                            _call(op, s, prob, rank)
                got = rec.events()
                events += [ev.to_dict() for ev in got]
                if s == "fused":
                    spans, tiles, waited = {}, 0.0, 0.0
                    for ev in got:
                        ms = (ev.end_ns - ev.start_ns) / 1e6
                        if ev.lane.startswith("tiles"):
                            tiles += ms
                        elif ev.lane == "tile waits":
                            waited += ms
                        else:
                            spans[ev.lane] = spans.get(ev.lane, 0.0) + ms
                    row["fused_spans_ms"] = {lane: round(v, 4) for lane, v in sorted(spans.items())}
                    row["fused_tiles"] = sum(ev.lane.startswith("tiles") for ev in got)
                    row["fused_tile_wait_share"] = round(waited / tiles, 4) if tiles else None
            if (rows, k, n) == tuple(cells[0]):
                row["_events"] = events
            dist.barrier()
            if rank == 0:   # alone on the GPU
                if op == "ag_gemm":
                    a = prob.a
                    b = prob.w[rank].t()
                    arrived = torch.ones(world_size, dtype=torch.int32, device=_dev())
                    out = torch.empty(m, n, dtype=a.dtype, device=_dev())
                    wait = WaitSpec(signal=arrived, generation=1, chunk_m=rows)
                    hooked = lambda: matmul(a, b, out=out, tile_order="round", start_chunk=rank, wait=wait,  # noqa: E731
                                            check=False, num_sms=budget)
                    chunks = [a[i * rows:(i + 1) * rows] for i in range(world_size)]
                else:
                    a = prob.a_rs[rank]
                    b = prob.w[rank].t()
                    dest = torch.empty(m, n, dtype=a.dtype, device=_dev())
                    sent = torch.zeros(world_size, dtype=torch.int32, device=_dev())
                    spec = EpilogueSpec.from_tensors([dest[i * rows:(i + 1) * rows] for i in range(world_size)],
                                                     sent, generation=1, chunk_m=rows)
                    hooked = lambda: matmul(a, b, tile_order="owner", start_chunk=(rank + 1) % world_size,  # noqa: E731
                                            epilogue=spec, num_sms=budget)
                    chunks = [a[i * rows:(i + 1) * rows] for i in range(world_size)]
                plain_out = torch.empty(m, n, dtype=a.dtype, device=_dev())
                variants = {
                    "gemm_hooked_alone_ms": hooked,
                    "gemm_core_alone_ms": lambda: matmul(a, b, out=plain_out, num_sms=budget),
                    "per_chunk_cublas_alone_ms": lambda: [torch.matmul(x, b) for x in chunks],
                    "cublas_alone_ms": lambda: torch.matmul(a, b, out=plain_out),
                }
                for name, fn in variants.items():
                    for _ in range(3):
                        fn()
                    row[name] = _time_ms(fn, reps, sync_ranks=False)
                    if name == "gemm_hooked_alone_ms" and op == "gemm_rs":
                        sent.zero_()
            dist.barrier()
            row["passed"] = True
            rows_out.append(row)
    return rows_out


def case_stress(rank, world_size, strategy, calls):
    """``calls`` calls in a row alternating the ops, new data every call (one workspace per op)."""
    ops = ("ag_gemm", "gemm_rs", "gemm_ar")
    worst, failed = {op: 0.0 for op in ops}, {op: 0 for op in ops}
    counts = {op: 0 for op in ops}
    for i in range(calls):
        op = ops[i % 3]
        prob = Problem(1000 + i, world_size, world_size * 48, 200, 72, torch.bfloat16)
        out = _call(op, strategy, prob, rank)
        err, tol, ok = _check(op, out, prob, rank)
        worst[op] = max(worst[op], err)
        failed[op] += not ok
        counts[op] += 1
    return [dict(case="stress", op=op, strategy=strategy, world_size=world_size, dtype="bf16",
                 shape=[world_size * 48, 72, 200], passed=failed[op] == 0, max_rel_err=worst[op],
                 calls=counts[op], failures=failed[op]) for op in ops]


def case_mixed(rank, world_size, calls):
    """One workspace per op shared by calls of both strategies and of changing shapes: gemm_ar
    alternating one-shot and two-shot sizes (copy_engine) and the fused two-shot path, ag_gemm
    and gemm_rs alternating strategies and shapes -- consecutive calls on one buffer must never
    wait for a credit the previous call did not raise, nor write where a peer still reads."""
    plan = [("copy_engine", 48, 72, 200), ("fused", 512, 1024, 256), ("copy_engine", 512, 1024, 256),
            ("fused", 64, 96, 128), ("copy_engine", 40, 96, 128), ("fused", 256, 2048, 64)]
    rows_out = []
    for op in ("gemm_ar", "ag_gemm", "gemm_rs"):
        failed, worst = 0, 0.0
        for i in range(calls):
            strategy, rows, n, k = plan[i % len(plan)]
            prob = Problem(7000 + i, world_size, world_size * rows, k, n, torch.bfloat16)
            out = _call(op, strategy, prob, rank)
            err, tol, ok = _check(op, out, prob, rank)
            failed += not ok
            worst = max(worst, err)
        rows_out.append(dict(case="mixed", op=op, strategy="copy_engine+fused", world_size=world_size, dtype="bf16",
                             shape=None, passed=failed == 0, max_rel_err=worst, calls=calls, failures=failed))
    return rows_out


def case_mixed_workers(rank, world_size, calls):
    """case_mixed with sm_workers in the rotation (its workspaces are the same as the others'):
    one workspace per op shared by calls of the three strategies and of changing shapes."""
    plan = [("sm_workers", 48, 72, 200), ("copy_engine", 512, 1024, 256), ("sm_workers", 512, 1024, 256),
            ("fused", 64, 96, 128), ("sm_workers", 40, 96, 128), ("fused", 256, 2048, 64), ("sm_workers", 256, 2048, 64)]
    rows_out = []
    for op in ("gemm_ar", "ag_gemm", "gemm_rs"):
        failed, worst = 0, 0.0
        for i in range(calls):
            strategy, rows, n, k = plan[i % len(plan)]
            prob = Problem(7500 + i, world_size, world_size * rows, k, n, torch.bfloat16)
            out = _call(op, strategy, prob, rank)
            err, tol, ok = _check(op, out, prob, rank)
            failed += not ok
            worst = max(worst, err)
        rows_out.append(dict(case="mixed_workers", op=op, strategy="copy_engine+fused+sm_workers",
                             world_size=world_size, dtype="bf16", shape=None, passed=failed == 0, max_rel_err=worst,
                             calls=calls, failures=failed))
    return rows_out


def case_queue_wrap(rank, world_size, calls):
    """sm_workers' staging ring wrapping around, with backpressure the bed can see.

    ``calls`` calls in a row alternating gemm_rs, gemm_ar (two-shot: > 1 MiB output) and
    ag_gemm (chunks of 16 rows), new data every call, a moving host straggler (0-5 ms before
    each call), every output checked.  Knobs: 1 or 2 slots (alternating every 3 calls), each
    owner's 64 rows cut into 4 pieces of 16 rows x 4608 columns (147 KiB of bf16 each: W - 1
    owners x 4 pieces = 4 or 12 pieces per call through 1-2 slots), ONE worker CTA copying
    256-byte blocks (the slowest consumer the knobs allow).

    Why a credit stall must happen.  In push_partials the producer (compute stream) issues, per
    piece j: the credit wait ``free[j % slots] >= j // slots`` (j >= slots only), the piece's
    GEMM into the slot, ``ready[slot] = use + 1``; the single worker launch (side stream) takes
    the pieces in order: wait ``ready``, copy the piece, then ``free[slot] = use + 1``.  So
    piece ``slots`` (the first one that reuses a slot) can only start once the worker has
    copied piece 0 entirely, and piece 0's copy starts only after piece 0's READY.  With one
    CTA and 256-byte blocks that copy is 576 dependent load -> store round trips (each at least
    an L2 hit, ~0.2-1 us on an H200): >= ~100 us.  Between piece 0's READY and piece
    ``slots``'s credit wait the producer only runs, back to back, what is already queued on its
    stream: nothing (slots = 1) or piece 1's READY, GEMM (16 x 96 x 4608: a few us) and READY
    (slots = 2) -- *provided the host has issued them before the GPU gets there*.  That is what
    the GPU sleep does: a call that fills ``stats=`` is issued behind ``BUSY_MS`` of
    ``torch.cuda._sleep`` on the compute stream (the side stream waits for it too), far longer
    than the host needs to issue the whole call (~1-3 ms, straggler and agreement round
    included), so its kernels run back to back and the credit wait of piece ``slots`` finds
    its slot not yet FREE: ``producer_stalls >= 1`` (and, in steady state, one per piece from
    ``slots`` on: the worker, not the GEMMs, sets the pace).  Without the sleep the host issues
    each piece ~20-50 us after the last one and the copy may win the race: the first H200 run
    (stats on 4 calls of 30, no sleep) saw no stall at all.

    Pass: every call correct; on every rank every stats call of gemm_rs/gemm_ar after the first
    six (the first of each op x slots, which also builds workspaces and rings and synchronizes)
    counted at least one producer stall with a positive stall time.  Stats are filled on every
    other pair of calls (i % 4 < 2, both slot settings of both ring ops); the other calls are
    issued without a sync, so the host runs calls ahead of the GPU (generations across calls).
    An owner that is late does not make producers wait on ring credits here: the ring and its
    FREE words are the producer's own (the workers push into the owner's inbox, whose credit is
    the previous call's DONE, waited at ``ws.begin``), so a late owner shows as a late begin,
    not as a credit stall.  One call per op keeps its stats in the rows."""
    from tpfuse._dist import group_context
    from tpfuse.bench.host import _sleep_cycles_per_ms
    from tpfuse.strategies import sm_workers

    ctx = group_context(None)
    rnd = random.Random(rank * 104729 + 3)
    rows, k, n = 64, 96, 4608
    ops = ("gemm_rs", "gemm_ar", "ag_gemm")
    busy_cycles = int(QUEUE_WRAP_BUSY_MS * _sleep_cycles_per_ms())
    worst, failed, counts = {op: 0.0 for op in ops}, {op: 0 for op in ops}, {op: 0 for op in ops}
    kept, seen = {}, {op: [] for op in ops[:2]}   # seen: (stalls, stall ns) of each warm stats call
    for i in range(calls):
        op = ops[i % 3]
        slots = 1 if (i // 3) % 2 == 0 else 2
        knobs = sm_workers.SmWorkersKnobs(comm_sms=1, slots=slots, block_bytes=256, chunk_rows=16)
        prob = Problem(9100 + i, world_size, world_size * rows, k, n, torch.bfloat16)
        stats = {} if i % 4 < 2 else None
        time.sleep(rnd.uniform(0, 0.005))
        if stats is not None and i >= 6:
            torch.cuda._sleep(busy_cycles)   # the host issues the whole call before the GPU runs it
        if op == "ag_gemm":
            out = sm_workers.ag_gemm(prob.a_shard(rank), prob.w[rank].t(), ctx, knobs=knobs, stats=stats)
        else:
            fn = sm_workers.gemm_rs if op == "gemm_rs" else sm_workers.gemm_ar
            out = fn(prob.a_rs[rank], prob.w[rank].t(), ctx, knobs=knobs, stats=stats)
        err, tol, ok = _check(op, out, prob, rank)
        worst[op] = max(worst[op], err)
        failed[op] += not ok
        counts[op] += 1
        if stats is not None:
            if op in seen and i >= 6:
                seen[op].append((stats["producer_stalls"], stats["producer_stall_ns"], slots))
            if op not in kept and i >= 6:
                chunks = stats.pop("chunks")
                stats["max_chunk_latency_us"] = max(c["latency_ns"] for c in chunks) / 1e3
                stats["chunks"] = len(chunks)
                kept[op] = stats
    rows_out = []
    for op in ops:
        row = dict(case="queue_wrap", op=op, strategy="sm_workers", world_size=world_size, dtype="bf16",
                   shape=[world_size * rows, n, k], max_rel_err=worst[op], calls=counts[op], failures=failed[op],
                   stats=kept.get(op))
        ok = failed[op] == 0
        if op in seen:
            row["stats_calls"] = len(seen[op])
            row["producer_stalls_per_stats_call"] = [s for s, _, _ in seen[op]]
            row["min_producer_stall_us"] = min((ns / 1e3 for _, ns, _ in seen[op]), default=None)
            ok = ok and bool(seen[op]) and all(s >= 1 and ns > 0 for s, ns, _ in seen[op])
        row["passed"] = ok
        rows_out.append(row)
    return rows_out


def case_straggler(rank, world_size, strategy, calls):
    """A moving straggler: every call each rank sleeps a random 0-20 ms first (seeded per rank)."""
    rnd = random.Random(rank * 7919 + 1)
    ops = ("ag_gemm", "gemm_rs", "gemm_ar")
    failed, worst = 0, 0.0
    for i in range(calls):
        op = ops[i % 3]
        prob = Problem(5000 + i, world_size, world_size * 40, 120, 56, torch.float16)
        time.sleep(rnd.uniform(0, 0.02))
        out = _call(op, strategy, prob, rank)
        err, tol, ok = _check(op, out, prob, rank)
        failed += not ok
        worst = max(worst, err)
    return [dict(case="straggler", op="all", strategy=strategy, world_size=world_size, dtype="fp16",
                 shape=[world_size * 40, 56, 120], passed=failed == 0, max_rel_err=worst, calls=calls,
                 failures=failed)]


def case_graph(rank, world_size, strategy, replays):
    """Warm-up call, capture each op in a CUDA graph, replay with new data each time."""
    import tpfuse

    rows_out = []
    for op in ("ag_gemm", "gemm_rs", "gemm_ar"):
        prob = Problem(77, world_size, world_size * 64, 256, 96, torch.bfloat16)
        static = Problem(78, world_size, world_size * 64, 256, 96, torch.bfloat16)
        _call(op, strategy, static, rank)           # warm-up: builds the workspace, compiles the kernels
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = _call(op, strategy, static, rank)
        failed, worst = 0, 0.0
        for i in range(replays):
            fresh = Problem(900 + i, world_size, world_size * 64, 256, 96, torch.bfloat16)
            static.a.copy_(fresh.a)
            for dst, src in zip(static.a_rs + static.w, fresh.a_rs + fresh.w):
                dst.copy_(src)
            graph.replay()
            torch.cuda.synchronize()
            err, tol, ok = _check(op, out, fresh, rank)
            failed += not ok
            worst = max(worst, err)
        tpfuse.check_workspaces()
        rows_out.append(dict(case="graph", op=op, strategy=strategy, world_size=world_size, dtype="bf16",
                             shape=[world_size * 64, 96, 256], passed=failed == 0, max_rel_err=worst,
                             calls=replays, failures=failed))
        del graph
    return rows_out


def _all_nan(out) -> bool:
    outs = out if isinstance(out, tuple) else (out,)
    return all(bool(torch.isnan(x).all()) for x in outs if x.numel())


class _LogLines:
    """The ``tpfuse`` logger's records with their monotonic times (the watchdog's line)."""

    def __init__(self):
        import logging

        self.lines: list[tuple[float, str]] = []
        outer = self

        class Handler(logging.Handler):
            def emit(self, record):
                outer.lines.append((time.monotonic(), record.getMessage()))

        self._handler = Handler()
        self._logger = logging.getLogger("tpfuse")

    def __enter__(self):
        self._logger.addHandler(self._handler)
        return self

    def __exit__(self, *exc):
        self._logger.removeHandler(self._handler)

    def first(self, text: str) -> tuple[float, str] | None:
        return next(((t, line) for t, line in self.lines if line.startswith("tpfuse watchdog:") and text in line), None)


def _dead_problem(seed, world_size, strategy):
    """The dead-peer cases' problem: small, except for sm_workers, whose gemm_ar needs an output
    over the one-shot limit to take its own two-shot path (the workers' pulls; below it is
    copy_engine's one-shot)."""
    m, k, n = (world_size * 256, 64, 1536) if strategy == "sm_workers" else (world_size * 32, 64, 48)
    return Problem(seed, world_size, m, k, n, torch.bfloat16), [m, n, k]


def case_dead_peer(rank, world_size, strategy):
    """The last rank skips a call: the call returns on the other ranks without waiting (its
    outputs NaN), ``tpfuse.synchronize()`` raises TimeoutError naming the last rank within the
    bound + 2 s, and the next call is refused; then every rank releases its workspaces and a
    fresh call works again."""
    import tpfuse

    rows_out = []
    for op in ("ag_gemm", "gemm_rs", "gemm_ar"):
        prob, shape = _dead_problem(31, world_size, strategy)
        _call(op, strategy, prob, rank)
        torch.cuda.synchronize()
        dist.barrier()
        outcome, seconds, message, nan, host_ms = "skipped", 0.0, "", True, 0.0
        if rank != world_size - 1:
            t0 = time.monotonic()
            out = _call(op, strategy, prob, rank)
            host_ms = (time.monotonic() - t0) * 1e3
            try:
                tpfuse.synchronize()
                outcome = "returned"
            except TimeoutError as exc:
                outcome, message = "TimeoutError", str(exc)
            seconds = time.monotonic() - t0
            nan = _all_nan(out)
            try:   # the broken workspace must refuse the next call
                _call(op, strategy, prob, rank)
                broken_refused = False
            except RuntimeError as exc:
                broken_refused = "broken" in str(exc)
        else:
            broken_refused = True
        dist.barrier()
        tpfuse.release_workspaces()
        dist.barrier()
        out = _call(op, strategy, prob, rank)
        torch.cuda.synchronize()
        err, tol, ok_after = _check(op, out, prob, rank)
        ok = (rank == world_size - 1 or (outcome == "TimeoutError" and seconds < TIMEOUT_S + 2.0 and nan
                                         and host_ms < 0.5 * TIMEOUT_S * 1e3
                                         and f"rank {world_size - 1}" in message)) and broken_refused and ok_after
        rows_out.append(dict(case="dead_peer", op=op, strategy=strategy, world_size=world_size, dtype="bf16",
                             shape=shape, passed=bool(ok), max_rel_err=err, calls=3,
                             outcome=outcome, seconds=round(seconds, 2), host_ms=round(host_ms, 2), nan=nan,
                             message=message[:300]))
    return rows_out


def case_queued_after_timeout(rank, world_size, strategy):
    """A dead peer with calls queued behind the failing one (issue 34): the last rank skips
    three calls; the others issue the failing call and two more before the error is known (the
    host never waits).  All three outputs must be NaN, the next tpfuse call must raise
    TimeoutError naming the last rank within TPFUSE_TIMEOUT_S + 2 s of the first call, the
    watchdog must log its line within TPFUSE_TIMEOUT_S + 1 s, and ``tpfuse.synchronize()`` must
    raise too.  Then every rank releases its workspaces and calls work again; and the same for
    CUDA graph replays (:func:`_graph_after_timeout`)."""
    import tpfuse

    rows_out = []
    for op in ("ag_gemm", "gemm_rs", "gemm_ar"):
        prob, shape = _dead_problem(32, world_size, strategy)
        _call(op, strategy, prob, rank)
        torch.cuda.synchronize()
        dist.barrier()
        row = dict(case="queued_after_timeout", op=op, strategy=strategy, world_size=world_size, dtype="bf16",
                   shape=shape, calls=3)
        ok = True
        if rank != world_size - 1:
            with _LogLines() as log:
                t0 = time.monotonic()
                outs = [_call(op, strategy, prob, rank) for _ in range(3)]
                row["host_ms_three_calls"] = round((time.monotonic() - t0) * 1e3, 2)
                raised, message = None, ""
                while time.monotonic() - t0 < TIMEOUT_S + 2.0:   # the next call, until it raises
                    time.sleep(0.25)
                    try:
                        outs.append(_call(op, strategy, prob, rank))
                    except TimeoutError as exc:
                        raised, message = time.monotonic() - t0, str(exc)
                        break
                try:
                    tpfuse.synchronize()
                    sync_raised = False
                except TimeoutError:
                    sync_raised = True
                nan = [_all_nan(out) for out in outs]

                def watchdog_line():
                    return log.first(f"for rank {world_size - 1}") or log.first(f"rank {world_size - 1}, whose rows")

                # the next call can see the record before the watchdog's next poll: wait for the
                # line within its bound instead of leaving the log capture at once (the H200 bed
                # missed every line that way)
                while watchdog_line() is None and time.monotonic() - t0 < TIMEOUT_S + 1.5:
                    time.sleep(0.02)
                seen = watchdog_line()
            row.update(raised_after_s=raised and round(raised, 2), message=message[:300], nan=nan,
                       synchronize_raised=sync_raised,
                       watchdog_after_s=seen and round(seen[0] - t0, 2), watchdog_line=seen and seen[1][:300])
            ok = (raised is not None and raised < TIMEOUT_S + 2.0 and f"rank {world_size - 1}" in message
                  and all(nan) and len(nan) >= 3 and sync_raised and seen is not None
                  and seen[0] - t0 < TIMEOUT_S + 1.0 + 0.5)   # + the host's scheduling slack
        dist.barrier()
        tpfuse.release_workspaces()
        dist.barrier()
        out = _call(op, strategy, prob, rank)
        torch.cuda.synchronize()
        err, tol, ok_after = _check(op, out, prob, rank)
        ok = ok and ok_after and _graph_after_timeout(op, strategy, prob, rank, world_size, row)
        row.update(passed=bool(ok), max_rel_err=err)
        rows_out.append(row)
    return rows_out


def _graph_after_timeout(op, strategy, prob, rank, world_size, row) -> bool:
    """The same with CUDA graph replays: every rank replays a captured call once (correct), then
    the last rank skips while the others replay twice: both replays' outputs NaN and
    ``tpfuse.synchronize()`` raises TimeoutError.  Released after (the workspace was warm)."""
    import tpfuse

    dist.barrier()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = _call(op, strategy, prob, rank)
    graph.replay()
    torch.cuda.synchronize()
    _, _, ok_first = _check(op, out, prob, rank)
    dist.barrier()
    ok = ok_first
    if rank != world_size - 1:
        for _ in range(2):   # the static output: NaN after the last replay (each fills it)
            graph.replay()
        try:
            tpfuse.synchronize()
            raised = False
        except TimeoutError:
            raised = True
        all_nan = _all_nan(out)
        row.update(graph_replays_nan=all_nan, graph_synchronize_raised=raised)
        ok = ok and all_nan and raised
    dist.barrier()
    del graph
    tpfuse.release_workspaces()
    dist.barrier()
    row["graph_first_replay_ok"] = bool(ok_first)
    return bool(ok)


def case_asynctp(rank, world_size, strategy):
    """The same inputs through PyTorch's async-TP ops; ours and theirs must agree."""
    group_name = dist.group.WORLD.group_name
    rows_out = []
    prob = Problem(4242, world_size, world_size * 256, 512, 384, torch.bfloat16)
    a_shard, b, ref, base_err = prob.ag(rank)
    ours_c, ours_full = _call("ag_gemm", strategy, prob, rank)
    theirs_full, theirs = torch.ops.symm_mem.fused_all_gather_matmul(a_shard.contiguous(), [b], 0, group_name)
    torch.cuda.synchronize()
    diff = _rel(ours_c, theirs[0].double())
    tol = TOL_FACTOR * 2 * base_err + TOL_ATOL
    rows_out.append(dict(case="asynctp", op="ag_gemm", strategy=strategy, world_size=world_size, dtype="bf16",
                         shape=[prob.m, prob.n, prob.k], passed=bool(diff <= tol and torch.equal(theirs_full, ours_full)),
                         max_rel_err=diff, tolerance=tol, calls=1))
    ours = _call("gemm_rs", strategy, prob, rank)
    theirs = torch.ops.symm_mem.fused_matmul_reduce_scatter(prob.a_rs[rank], prob.w[rank].t(), "sum", 0, group_name)
    torch.cuda.synchronize()
    ref_full, base = prob.reduced()
    rows = prob.m // world_size
    base_err = _rel(base[rank * rows:(rank + 1) * rows], ref_full[rank * rows:(rank + 1) * rows])
    diff = _rel(ours, theirs.double())
    tol = TOL_FACTOR * 4 * base_err + TOL_ATOL     # theirs sums in bf16
    rows_out.append(dict(case="asynctp", op="gemm_rs", strategy=strategy, world_size=world_size, dtype="bf16",
                         shape=[prob.m, prob.n, prob.k], passed=bool(diff <= tol), max_rel_err=diff,
                         tolerance=tol, calls=1))
    return rows_out


# fp8: M/W = 37 (odd), K = 1008, N = 784.  The issue asked for N = 776, but fp8 needs K and N
# multiples of 16 (the fp8 MMAs / cuBLASLt; tpfuse._fp8.ALIGN): 784 is the next one.  N = 776 is
# recorded as its own rows: every rank must raise ValueError before communicating.
FP8_SHAPE = (37, 1008, 784)
FP8_BAD_N = 776


def _fp8_problem(seed, world_size, op, scaling):
    """Shared-seed fp8 operands of one call on every rank: (per-rank inputs, float64 reference of
    the dequantized inputs, the cuBLASLt baseline's relative error).  ``scaling``: "tensorwise"
    or "rowwise" (scale_a per row of A, scale_b per output channel)."""
    from tpfuse import _fp8

    rows, k, n = FP8_SHAPE
    m = world_size * rows
    dev = _dev()
    g = torch.Generator(device=dev).manual_seed(seed)
    gran = "tensor" if scaling == "tensorwise" else "rows"

    def deq(x8, s):
        return x8.double() * s.double()

    def weight():
        w8, sw = _fp8.quantize(torch.randn(n, k, generator=g, device=dev), _fp8.E4M3, gran)
        return w8.t(), (sw.reshape(()) if gran == "tensor" else sw.reshape(1, n))   # b = weight.t()

    if op == "ag_gemm":
        a8, sa = _fp8.quantize(torch.randn(m, k, generator=g, device=dev) * 3, _fp8.E4M3, gran)
        bs = [weight() for _ in range(world_size)]
        refs = [deq(a8, sa) @ deq(b8, sb) for b8, sb in bs]
        bases = [torch._scaled_mm(a8, b8, scale_a=sa, scale_b=sb, out_dtype=torch.bfloat16).double() for b8, sb in bs]
        return dict(a8=a8, sa=sa, bs=bs, refs=refs, base_errs=[_rel(x, r) for x, r in zip(bases, refs)], m=m)
    a8s, sas, bs = [], [], []
    for r in range(world_size):
        a8, sa = _fp8.quantize(torch.randn(m, k, generator=g, device=dev) * (1 + r), _fp8.E4M3, gran)
        a8s.append(a8)
        sas.append(sa)
        bs.append(weight())
    ref = sum(deq(a8, sa) @ deq(b8, sb) for a8, sa, (b8, sb) in zip(a8s, sas, bs))
    base = sum(torch._scaled_mm(a8, b8, scale_a=sa, scale_b=sb, out_dtype=torch.float32)
               for a8, sa, (b8, sb) in zip(a8s, sas, bs)).to(torch.bfloat16).double()
    return dict(a8s=a8s, sas=sas, bs=bs, ref=ref, base=base, m=m)


def case_fp8(rank, world_size, strategy, iters=2):
    """Every op in fp8 (e4m3, bf16 out) x {tensor-wise, row-wise}: against the float64 reference of
    the dequantized inputs (tolerance: TOL_FACTOR x the error of cuBLASLt's torch._scaled_mm on the
    same inputs, bf16 out, RS/AR partials summed in float32), the gathered A and scales bit-exact,
    gemm_ar bitwise equal on every rank, two calls in a row; and against PyTorch's scaled async-TP
    ops on the same inputs (fused_all_gather_scaled_matmul, fused_scaled_matmul_reduce_scatter)
    where this torch build has them.  Then N = 776 (not a multiple of 16): every rank must raise
    ValueError before communicating, and the group must still work."""
    import tpfuse

    group_name = dist.group.WORLD.group_name
    rows_k_n = FP8_SHAPE
    out_rows = []
    symm_ops = getattr(torch.ops, "symm_mem", None)
    for scaling in ("tensorwise", "rowwise"):
        for op in ("ag_gemm", "gemm_rs", "gemm_ar"):
            p = _fp8_problem(zlib.crc32(repr(("fp8", op, scaling)).encode()), world_size, op, scaling)
            m, n, k = p["m"], rows_k_n[2], rows_k_n[1]
            row = dict(case="fp8", op=op, strategy=strategy, world_size=world_size, dtype="fp8", scaling=scaling,
                       shape=[m, n, k], out_dtype="bf16", calls=iters,
                       note=f"N = {n}, not the issue's 776: fp8 needs K and N multiples of 16")
            ok, err = True, 0.0
            if op == "ag_gemm":
                shard = slice(rank * rows_k_n[0], (rank + 1) * rows_k_n[0])
                a_shard = p["a8"][shard].contiguous()
                sa = p["sa"][shard].contiguous() if scaling == "rowwise" else p["sa"]
                b8, sb = p["bs"][rank]
                for _ in range(iters):
                    c, a_full, s_full = tpfuse.ag_gemm(a_shard, b8, scale_a=sa, scale_b=sb, out_dtype=torch.bfloat16,
                                                       strategy=strategy, return_gathered=True)
                    torch.cuda.synchronize()
                    err = max(err, _rel(c, p["refs"][rank]))
                    ok = ok and torch.equal(a_full.view(torch.uint8), p["a8"].view(torch.uint8))
                    ok = ok and torch.equal(s_full.reshape(p["sa"].shape), p["sa"])
                tol = TOL_FACTOR * p["base_errs"][rank] + TOL_ATOL
                fn = getattr(symm_ops, "fused_all_gather_scaled_matmul", None) if symm_ops is not None else None
                if fn is not None:
                    try:
                        _, theirs = fn(a_shard, [b8], sa, [sb], 0, group_name, [None], [None], [torch.bfloat16],
                                       [False])
                        torch.cuda.synchronize()
                        row["asynctp_rel_diff"] = _rel(c, theirs[0].double())
                        ok = ok and row["asynctp_rel_diff"] <= 2 * tol
                    except Exception as exc:  # noqa: BLE001 - theirs is the comparison, not the subject
                        row["asynctp"] = f"torch's op raised: {type(exc).__name__}: {str(exc)[:300]}"
            else:
                a8, sa, (b8, sb) = p["a8s"][rank], p["sas"][rank], p["bs"][rank]
                ref, base = p["ref"], p["base"]
                if op == "gemm_rs":
                    rows = slice(rank * rows_k_n[0], (rank + 1) * rows_k_n[0])
                    ref, base = ref[rows], base[rows]
                fn = tpfuse.gemm_rs if op == "gemm_rs" else tpfuse.gemm_ar
                for _ in range(iters):
                    c = fn(a8, b8, scale_a=sa, scale_b=sb, out_dtype=torch.bfloat16, strategy=strategy)
                    torch.cuda.synchronize()
                    err = max(err, _rel(c, ref))
                tol = TOL_FACTOR * _rel(base, ref) + TOL_ATOL
                if op == "gemm_ar":   # bitwise the same on every rank
                    digests = [None] * world_size
                    dist.all_gather_object(digests, _digest(c))
                    row["ar_bitwise"] = len(set(digests)) == 1
                    ok = ok and row["ar_bitwise"]
                rs = getattr(symm_ops, "fused_scaled_matmul_reduce_scatter", None) if symm_ops is not None else None
                if op == "gemm_rs" and rs is not None:
                    try:
                        theirs = rs(a8, b8, sa, sb, "sum", 0, 0, group_name, [m, n], None, None, torch.bfloat16, False)
                        torch.cuda.synchronize()
                        row["asynctp_rel_diff"] = _rel(c, theirs.double())
                        ok = ok and row["asynctp_rel_diff"] <= 4 * tol   # theirs may sum bf16 partials
                    except Exception as exc:  # noqa: BLE001
                        row["asynctp"] = f"torch's op raised: {type(exc).__name__}: {str(exc)[:300]}"
            row.update(passed=bool(ok and err <= tol), max_rel_err=err, tolerance=tol)
            out_rows.append(row)
    # N = 776: refused on every rank before any communication; the group still works after
    dev = _dev()
    rows, k = rows_k_n[0], rows_k_n[1]
    one = torch.ones((), device=dev)
    b_bad = torch.zeros(FP8_BAD_N, k, device=dev).to(torch.float8_e4m3fn).t()
    for op in ("ag_gemm", "gemm_rs", "gemm_ar"):
        a = torch.zeros(rows if op == "ag_gemm" else world_size * rows, k, device=dev).to(torch.float8_e4m3fn)
        try:
            getattr(tpfuse, op)(a, b_bad, scale_a=one, scale_b=one, strategy=strategy)
            outcome = "ran"
        except (ValueError, TypeError) as exc:
            outcome = f"{type(exc).__name__}: {exc}"
        probe = torch.full((1,), float(rank))
        dist.all_reduce(probe)   # gloo: the group still works
        refused = outcome.startswith("ValueError") and "multiples of 16" in outcome
        out_rows.append(dict(case="fp8", op=op, strategy=strategy, world_size=world_size, dtype="fp8",
                             scaling="tensorwise", shape=[rows * world_size, FP8_BAD_N, k],
                             passed=bool(refused and probe.item() == sum(range(world_size))), calls=1,
                             note=f"N = {FP8_BAD_N} (not a multiple of 16): {outcome[:300]}"))
    return out_rows


def _short(text: str) -> str:
    """The start (the first exception) and the end (the last) of a long traceback."""
    return text if len(text) < 2400 else text[:1200] + "\n...\n" + text[-1200:]


def run_all(rank, world_size, strategy, quick, dead_peer=False, cases=None):
    """Every case on this rank; a case that raises becomes a failed row (the others still run)."""
    torch.cuda.set_device(0)
    torch.backends.cuda.matmul.allow_tf32 = False
    shapes = [(37, 1000, 771), (4091, 1000, 771)]
    # Llama cells scaled to fit W processes on one GPU: 8B fc1/fc2 at prefill M = 4096 / W rows each
    llama = [(4096 // world_size, 4096, 2 * 14336 // world_size // 4), (4096 // world_size, 14336 // world_size, 4096)]
    plan = [
        ("shapes", lambda: case_shapes(rank, world_size, strategy, shapes, ("bf16", "fp16", "fp32"))),
        ("llama", lambda: case_shapes(rank, world_size, strategy, llama, ("bf16",))),
        ("stress", lambda: case_stress(rank, world_size, strategy, 30 if quick else 200)),
        ("straggler", lambda: case_straggler(rank, world_size, strategy, 12 if quick else 30)),
        ("graph", lambda: case_graph(rank, world_size, strategy, 5 if quick else 8)),
        ("asynctp", lambda: case_asynctp(rank, world_size, strategy)),
        ("fp8", lambda: case_fp8(rank, world_size, strategy) if strategy in ("copy_engine", "fused") else []),
        ("mixed", lambda: case_mixed(rank, world_size, 12 if quick else 36) if strategy == "fused" else []),
        ("mixed_workers", lambda: case_mixed_workers(rank, world_size, 14 if quick else 42)
         if strategy == "sm_workers" else []),
        ("queue_wrap", lambda: case_queue_wrap(rank, world_size, 30 if quick else 200) if strategy == "sm_workers" else []),
        ("chunks", lambda: case_chunks(rank, world_size, strategy, shapes + llama[:1]) if strategy == "fused" else []),
        ("timing", lambda: case_timing(rank, world_size, strategy, llama, 10 if quick else 30)),
    ]
    if dead_peer:   # its own pool: with the agreement check off (the NCCL default), see main()
        plan = [("dead_peer", lambda: case_dead_peer(rank, world_size, strategy)),
                ("queued_after_timeout", lambda: case_queued_after_timeout(rank, world_size, strategy))]
    rows = []
    for name, fn in plan:
        if cases and name not in cases:
            continue
        t0 = time.monotonic()
        try:
            got = fn()
        except Exception:   # noqa: BLE001 - reported as a failed row
            got = [dict(case=name, op="?", strategy=strategy, world_size=world_size, passed=False,
                        error=_short(traceback.format_exc()))]
        for row in got:
            row["rank"] = rank
            row["seconds"] = row.get("seconds", round(time.monotonic() - t0, 2))
        rows.extend(got)
        if name == "llama":
            dist.barrier()
    return rows


_DEAD_CASES = ("dead_peer", "queued_after_timeout")   # run in the pool without the agreement check


def aggregate(rows: list[dict]) -> list[dict]:
    """One row per (case, op, strategy, W, dtype, shape) over the ranks: passed on every rank,
    the worst error, the calls of one rank, the failures and errors of all."""
    merged: dict[tuple, dict] = {}
    for row in rows:
        key = (row.get("case"), row.get("op"), row.get("strategy"), row.get("world_size"), row.get("dtype"),
               tuple(row.get("shape") or ()), row.get("scaling"))
        out = merged.get(key)
        if out is None:
            out = merged[key] = {k: v for k, v in row.items() if k not in ("rank", "seconds", "message", "tolerance",
                                                                            "watchdog_line", "nan")}
            out["ranks"] = 0
            out["passed"] = True
        out["ranks"] += 1
        out["passed"] = out["passed"] and bool(row.get("passed"))
        if row.get("max_rel_err") is not None:
            out["max_rel_err"] = max(out.get("max_rel_err") or 0.0, row["max_rel_err"])
        if row.get("tolerance") is not None:
            out["min_tolerance"] = min(out.get("min_tolerance", float("inf")), row["tolerance"])
        if row.get("failures"):
            out["failures"] = out.get("failures", 0) + row["failures"]
        if row.get("case") == "timing":   # every rank's call: the slowest rank's time
            for key in ("fused_ms", "copy_engine_ms"):
                out[key] = max(out.get(key) or 0.0, row.get(key) or 0.0)
        if row.get("case") == "dead_peer":
            out.setdefault("outcomes", {})[str(row.get("rank"))] = f"{row.get('outcome')} after {row.get('seconds')} s"
            out.pop("outcome", None)
        if row.get("case") == "queued_after_timeout":
            out.setdefault("outcomes", {})[str(row.get("rank"))] = (
                f"next call raised after {row.get('raised_after_s')} s, watchdog after {row.get('watchdog_after_s')} s, "
                f"all NaN {row.get('nan')}, synchronize raised {row.get('synchronize_raised')}")
            for key in ("raised_after_s", "watchdog_after_s", "synchronize_raised", "host_ms_three_calls"):
                out.pop(key, None)
    return list(merged.values())


def _write_timeline(events: list[dict], out: str, world_size: int) -> None:
    """The timing case's recorded calls (first Llama cell, every rank): Chrome-trace JSON and,
    with matplotlib, a PNG next to ``out`` (bed_timeline_w<W>.json / .png)."""
    from tpfuse import timeline

    evs = [timeline.TimelineEvent.from_dict(e) for e in events]
    base = os.path.join(os.path.dirname(os.path.abspath(out)), f"bed_timeline_w{world_size}")
    with open(base + ".json", "w") as f:
        json.dump(timeline.to_chrome_trace(evs, meta={"note": "one-GPU bed (MPS): not multi-GPU timings",
                                                     "world_size": world_size}), f)
    try:
        timeline.draw(evs, base + ".png", title=f"one-GPU bed, W = {world_size} processes on one H200 "
                                                 "(not multi-GPU timings)")
    except RuntimeError as exc:   # no matplotlib
        print(f"timeline PNG not drawn: {exc}", flush=True)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world-sizes", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--strategies", nargs="+", default=list(STRATEGIES))
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--cases", nargs="+", default=None,
                        help="run only these cases (shapes llama stress straggler graph asynctp fp8 mixed mixed_workers "
                             "queue_wrap chunks timing dead_peer queued_after_timeout)")
    parser.add_argument("--timeout", type=float, default=500)
    parser.add_argument("--out", default="symm_1gpu.json")
    args = parser.parse_args(argv)
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "src"))
    from tpfuse.spawn import RankPool

    all_rows = []

    def write(complete: bool) -> None:   # after every (W, strategy): a run cut short keeps its rows
        meta = dict(date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                    gpu=torch.cuda.get_device_name(0), num_gpus=1, processes=args.world_sizes,
                    torch=torch.__version__, triton=__import__("triton").__version__,
                    command="python tests/gpu/bed.py " + " ".join(argv if argv is not None else sys.argv[1:]),
                    note="one-GPU multi-process bed (MPS): correctness; the timing rows are bed-only numbers, "
                         "not multi-GPU timings", complete=complete)
        tmp = args.out + ".tmp"
        with open(tmp, "w") as f:
            json.dump({"meta": meta, "rows": aggregate(all_rows)}, f, indent=1)
        os.replace(tmp, args.out)

    for world_size in args.world_sizes:
        for strategy in args.strategies:
            t0 = time.monotonic()
            per_rank = []
            # The dead-peer case runs with the agreement check off: with it on, the live ranks
            # would wait for the missing rank in the check's host collective, not on the GPU.
            for env, dead in ((ENV, False), ({**ENV, "TPFUSE_DEBUG": "0"}, True)):
                if args.cases and not any((case in _DEAD_CASES) == dead for case in args.cases):
                    continue
                try:
                    with RankPool(world_size, env=env) as pool:
                        per_rank += pool.run(run_all, strategy, args.quick, dead, args.cases, timeout=args.timeout)
                except Exception as exc:  # noqa: BLE001
                    per_rank.append([dict(case="pool", op="?", strategy=strategy, world_size=world_size,
                                          passed=False, error=_short(str(exc)))])
            rows = [row for ranks in per_rank for row in ranks]
            # gemm_ar: every rank must hold bitwise the same output
            digests = {}
            for row in rows:
                if "digest" in row:
                    digests.setdefault((row["case"], tuple(row["shape"]), row["dtype"]), set()).add(row.pop("digest"))
            for key, ds in digests.items():
                if len(ds) != 1:
                    rows.append(dict(case="ar_bitwise", op="gemm_ar", strategy=strategy, world_size=world_size,
                                     dtype=key[2], shape=list(key[1]), passed=False, calls=1))
            events = [ev for row in rows for ev in row.pop("_events", [])]
            if events:
                _write_timeline(events, args.out, world_size)
            all_rows.extend(rows)
            bad = [r for r in rows if not r.get("passed")]
            print(f"W={world_size} {strategy}: {len(rows) - len(bad)}/{len(rows)} rows passed "
                  f"({time.monotonic() - t0:.0f} s)", flush=True)
            for r in bad[:20]:
                print("  FAILED", json.dumps(r)[:1500], flush=True)
            write(complete=False)
    write(complete=True)
    for r in aggregate(all_rows):
        if r.get("case") == "timing":
            print("timing (bed only) " + json.dumps({k: (round(v, 4) if isinstance(v, float) else v) for k, v in r.items()
                                                     if k not in ("case", "strategy", "dtype", "passed", "ranks")}))
    failed = sum(not r.get("passed") for r in all_rows)
    print(f"{len(all_rows) - failed} passed, {failed} failed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
