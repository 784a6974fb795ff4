"""fp8 on the symmetric-memory strategies (``copy_engine``, ``fused``): the strategies' own code on W
real processes under TRITON_INTERPRET=1, their workspaces in shared memory (one file in /dev/shm
per rank and workspace, mapped by every rank, as symmetric memory maps the peers' buffers), CUDA
streams faked (the side stream's work runs in issue order on the CPU), against float64 references
of the dequantized inputs (the problems and the derived bound of tests/cpu/test_fp8.py).

What this proves on CPU: the fp8 bytes and a row-wise ``scale_a`` travel through the workspace
layout (the scale rows after the shard's rows, ``_symm_steps.ag_scale_slot``) from one process to
another, the READY/DONE protocol across W processes and two calls in a row (generations), the
gathered A and scales returned bit-exact, the float32 partials of RS/AR through float32 inboxes
(one-shot and two-shot), and the fused GEMM's scales in its epilogue (wait hook and epilogue hook)
under the interpreter.  What it cannot: copy-engine copies, stream overlap and the GPU's fp8 MMAs
(tests/gpu/bed.py, case ``fp8``).
"""
from __future__ import annotations

import os
import sys
import tempfile
import types
from pathlib import Path

import pytest
import torch

from tpfuse import symm

pytest.importorskip("triton", reason="triton is not installed; the interpreter tests need it")

HERE = Path(__file__).parent
CAPACITY = 1 << 16          # bytes of every fake workspace's data region
# (op, workspace dtype): the workspaces the cases ask for (fp8 ag_gemm; float32 partials for RS/AR)
WORKSPACES = [("ag_gemm", torch.float8_e4m3fn), ("gemm_rs", torch.float32), ("gemm_ar", torch.float32),
              ("gemm_ar_one_shot", torch.float32)]


def _path(root: str, op: str, dtype: torch.dtype, rank: int) -> str:
    return os.path.join(root, f"{op}-{str(dtype).removeprefix('torch.')}-{rank}")


def symm_cases(rank, world_size, root, cases, iters=2):
    """On each rank: every (op, strategy, granularity, out, ar_mode) case ``iters`` times in a row
    through the strategy module's own function; returns [(case, worst error / bound, why)]."""
    sys.path.insert(0, str(HERE))
    from _symm_interp import fake_cuda_streams, interpreted
    from test_fp8 import OUT, UNIT, _bound, _problem

    from tpfuse import symm
    from tpfuse.strategies import copy_engine, fused

    report = []
    with interpreted(), pytest.MonkeyPatch.context() as mp:
        os.environ["TPFUSE_TIMEOUT_S"] = "120"   # real peers in other processes: generous bounds
        symm.timeout_s.cache_clear()
        fake_cuda_streams(mp)
        mp.setattr(fused, "_set_word", lambda words, i, stream: words.words.__setitem__(i, 1))   # the stream memory op
        made = {}

        def get_workspace(ctx, op, dtype, device, need):
            key = (op, dtype)
            assert key in [(o, d) for o, d in WORKSPACES], f"unexpected workspace {key}"
            assert need <= CAPACITY, f"{op}: need {need} B"
            if key not in made:
                size = symm.FLAG_BYTES + CAPACITY
                buffers = [torch.from_file(_path(root, op, dtype, r), shared=True, size=size, dtype=torch.uint8)
                           for r in range(world_size)]
                spec = symm.WorkspaceSpec("fp8interp", op, dtype, torch.device("cpu"), rank, world_size, CAPACITY)
                made[key] = symm.Workspace(spec, buffers)
            return made[key]

        mp.setattr(symm, "get_workspace", get_workspace)
        ctx = types.SimpleNamespace(rank=rank, world_size=world_size, group_name="fp8interp", group=None)
        knobs = fused.FusedKnobs(num_sms=2, chunks_per_rank=2)   # pieces straddle tiles and shards
        for index, (op, strategy, granularity, out_name, ar_mode) in enumerate(cases):
            out_dtype = OUT[out_name]
            p = _problem(op, rank, world_size, granularity, seed=40 + index, mixed=False)
            if ar_mode is not None:
                mp.setattr(copy_engine, "ar_mode", lambda *a, mode=ar_mode: mode)
            fn = getattr(copy_engine if strategy == "copy_engine" else fused, op)
            extra = {} if strategy == "copy_engine" else {"knobs": knobs}
            worst, why = 0.0, []
            for _ in range(iters):
                got = fn(p["a"], p["b"], ctx, p["scale_a"], p["scale_b"], out_dtype, **extra)
                if op == "ag_gemm":
                    c, a_full, scale_full = got
                    if not torch.equal(a_full.view(torch.uint8), p["a8_full"].view(torch.uint8)):
                        why.append("a_full differs")
                    if not torch.equal(scale_full, p["sa_full"]):
                        why.append("scale_a_full differs")
                else:
                    c = got
                if c.dtype != out_dtype or tuple(c.shape) != tuple(p["ref"].shape) or not torch.isfinite(c).all():
                    why.append(f"dtype {c.dtype} shape {tuple(c.shape)} finite {bool(torch.isfinite(c).all())}")
                    continue
                bound = _bound(p["mag"], p["ref"], p["k_total"], world_size, out_dtype)
                if strategy == "fused" and out_dtype == torch.bfloat16:
                    # the interpreter rounds the GEMM's float32 -> bfloat16 toward zero (the GPU to
                    # nearest): up to one unit of bfloat16 more than the bound's half unit
                    g = (p["k_total"] + world_size + 4) * 2.0 ** -24 * p["mag"]
                    bound = bound + UNIT[out_dtype] * (p["ref"].abs() + g)
                worst = max(worst, ((c.double() - p["ref"]).abs() / bound).max().item())
            errors = [ws.error[0].item() for ws in made.values()]
            if any(errors):
                why.append(f"a workspace's error word is set: {errors}")
            report.append((cases[index], worst, why))
    return report


CASES = [(op, strategy, granularity, out_name, None)
         for op in ("ag_gemm", "gemm_rs")
         for strategy in ("copy_engine", "fused")
         for granularity in ("tensor", "rows")
         for out_name in ("bf16", "fp32")]
CASES += [("gemm_ar", "copy_engine", granularity, out_name, "one_shot")
          for granularity in ("tensor", "rows") for out_name in ("bf16", "fp32")]
CASES += [("gemm_ar", strategy, granularity, "bf16", "two_shot")
          for strategy in ("copy_engine", "fused") for granularity in ("tensor", "rows")]


@pytest.mark.parametrize("world_size", [2, 3])
def test_fp8_copy_engine_and_fused_match_float64_reference(rank_pool, world_size):
    # W = 3: row-wise (the general path) and copy_engine's tensor-wise lean path, whose partials
    # are staged in a separate buffer there (not in the output, as at W = 2)
    cases = CASES if world_size == 2 else [c for c in CASES if c[3] == "bf16" and (
        c[2] == "rows" or (c[1] == "copy_engine" and c[0] in ("ag_gemm", "gemm_rs")))]
    with tempfile.TemporaryDirectory(dir="/dev/shm" if os.path.isdir("/dev/shm") else None) as root:
        for op, dtype in WORKSPACES:   # zeroed flags before any rank maps them
            for r in range(world_size):
                torch.from_file(_path(root, op, dtype, r), shared=True, size=symm.FLAG_BYTES + CAPACITY,
                                dtype=torch.uint8)
        reports = rank_pool(world_size).run(symm_cases, root, cases, timeout=600)
    for rank, report in enumerate(reports):
        assert len(report) == len(cases)
        for case, ratio, why in report:
            assert not why, f"rank {rank} {case}: {why}"
            assert ratio <= 1.0, f"rank {rank} {case}: error {ratio:.2f} x the derived bound"
    worst_bf16 = max(ratio for report in reports for case, ratio, _ in report if case[3] == "bf16")
    assert worst_bf16 > 0.05   # the bound is not vacuous
