"""Fit the GEMM efficiency curve of a hardware profile to cuBLAS, and check it on the workload shapes.

    PYTHONUNBUFFERED=1 python3 benchmarks/calibrate_gemm.py --out DIR          # on the GPU
    python benchmarks/calibrate_gemm.py --dry-run --out /tmp/x                 # CPU smoke test
    python benchmarks/calibrate_gemm.py --refit DIR/calibration_h200.json --out DIR
                                                # refit from saved grid timings, no GPU needed

(a) Times ``torch.matmul`` (bf16, random data, rotating input sets larger than L2,
``triton.testing.do_bench`` median) on a calibration grid of shapes and fits the ten GEMM
fields of ``tpfuse.model.hardware.HardwareProfile`` (Nelder-Mead on squared log error).
(b) Times the per-rank shapes of the workload matrix (W = 2, 4, 8; fc1 and fc2; full M and the
M/W chunk; decode) -- these are *not* used in the fit -- and compares them with the prediction
of the fitted profile loaded back through ``hardware.get_profile(..., calibration=path)``, exactly
as the library loads it.
Both are timed with ``b = weight.t()`` (``--layout tn``, the layout the layers and ``tpfuse
bench`` pass); the workload shapes are timed in the other layout too, for the record, and
``--sweep`` adds a small-M sweep over N in both layouts (cuBLAS's kernel choice there).

Writes ``calibration_<profile>.json`` (overrides + the raw grid timings) and
``gemm_calibration_<profile>.json`` ({meta, rows}) under ``--out``; prints a table last.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime as dt
import json
import math
import random
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1] / "src"
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from tpfuse.bench.workloads import workload_matrix  # noqa: E402
from tpfuse.model import hardware  # noqa: E402
from tpfuse.model.cost import gemm_time_ms  # noqa: E402

# The fitted fields, with bounds.  Order matters: it is the parameter vector of the fit.
FIT_FIELDS: tuple[tuple[str, float, float], ...] = (
    ("gemm_eff_max", 0.3, 1.0),
    ("gemm_k_half", 0.0, 2048.0),
    ("tile_rel_1", 0.3, 1.0),
    ("tile_rel_2", 0.2, 1.0),
    ("hbm_eff", 0.3, 1.0),
    ("gemm_blend_p", 1.0, 12.0),
    ("gemm_launch_us", 0.0, 20.0),
    ("gemm_throttle", 0.0, 0.3),
    ("gemm_throttle_ms", 0.01, 20.0),
    ("hbm_latency_us", 0.0, 20.0),
    ("gemm_streamk_rel", 0.3, 1.0),
)

# Calibration grid: M from decode to training sizes; (N, K) pairs that span the Llama-like range
# but are not the workload shapes themselves (those are the held-out check).
GRID_M = (16, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
GRID_NK = ((1024, 4096), (3072, 3072), (6144, 8192), (12288, 2048), (2048, 12288),
           (20480, 5120), (5120, 20480), (768, 1536))
# Small M against wide, deep weights (decode-like, where cuBLAS's kernel choice matters most);
# again not the workload shapes.
GRID_M_SMALL = (32, 96, 128, 192, 256, 384)
GRID_NK_WIDE = ((24576, 8192), (40960, 8192), (32768, 12288), (49152, 4096), (16384, 24576),
                (10240, 16384))
# Two regimes the grids above leave unsampled (2026-11-30 cross-check of seven runs): small-M
# GEMMs of a few MB with many N tiles and short K (cuBLAS runs them faster than the byte count
# suggests), and 1.6-1.8 waves of 128x256 tiles at medium K. Not workload shapes either.
GRID_EXTRA = ((64, 5120, 1536), (64, 6144, 2048), (16, 2560, 2560), (1024, 6656, 5120), (2048, 3328, 4608))
DRY_RUN_GRID = [(m, n, k) for m in (16, 64, 128) for (n, k) in ((128, 256), (256, 128))]


# --- measurement ----------------------------------------------------------------------------------
def _l2_bytes() -> int:
    try:
        return int(torch.cuda.get_device_properties(0).L2_cache_size)
    except Exception:  # noqa: BLE001 - older torch without the field
        return 50 * 2**20


_CONDITION = {"ms": 0.0, "work": None}


def condition_gpu() -> None:
    """Run ``_CONDITION["ms"]`` milliseconds of large bf16 GEMMs (8192^3) just before a
    measurement, so that every shape is timed from the same loaded, warm state of clocks and
    power (a GPU that idled for a moment boosts higher; one that just ran a big GEMM runs lower).
    The count of GEMMs for the duration is measured once."""
    if _CONDITION["ms"] <= 0:
        return
    if _CONDITION["work"] is None:
        x = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
        y = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
        z = torch.empty_like(x)
        for _ in range(3):
            torch.matmul(x, y, out=z)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(10):
            torch.matmul(x, y, out=z)
        end.record()
        torch.cuda.synchronize()
        per_ms = start.elapsed_time(end) / 10
        _CONDITION["work"] = (x, y, z, max(1, round(_CONDITION["ms"] / per_ms)))
    x, y, z, count = _CONDITION["work"]
    for _ in range(count):
        torch.matmul(x, y, out=z)


def measure_cuda(m: int, n: int, k: int, dtype: torch.dtype, layout: str = "tn") -> float:
    """Median ms of ``torch.matmul(a, b)`` on random data, rotating input sets so L2 never holds
    them. ``layout="tn"``: ``b = weight.t()`` of a contiguous ``[N, K]`` weight (what the layers
    and ``tpfuse bench`` pass); ``"nn"``: ``b`` a contiguous ``[K, N]`` matrix. cuBLAS picks its
    kernel per layout, so the two can differ by tens of percent on one shape."""
    import triton.testing

    elt = torch.finfo(dtype).bits // 8
    set_bytes = (m * k + k * n) * elt
    num_sets = max(1, min(16, math.ceil(3 * _l2_bytes() / max(set_bytes, 1))))
    gen = torch.Generator(device="cuda").manual_seed(m * 31 + n * 7 + k)
    if layout not in ("tn", "nn"):
        raise ValueError(f"layout={layout!r}; choose 'tn' (weight.t()) or 'nn' (row-major [K, N])")

    def weight():
        if layout == "tn":
            return torch.randn(n, k, device="cuda", dtype=dtype, generator=gen).t()
        return torch.randn(k, n, device="cuda", dtype=dtype, generator=gen)

    sets = [(torch.randn(m, k, device="cuda", dtype=dtype, generator=gen), weight())
            for _ in range(num_sets)]
    out = torch.empty(m, n, device="cuda", dtype=dtype)
    state = {"i": 0}

    def fn():
        a, b = sets[state["i"] % num_sets]
        state["i"] += 1
        torch.matmul(a, b, out=out)

    fn()   # allocations and cuBLAS heuristics before the conditioning, not after
    condition_gpu()
    ms = triton.testing.do_bench(fn, warmup=10, rep=40, return_mode="median")
    del sets, out
    return float(ms)


def timed_passes(shapes, measure, dtype, layout: str, passes: int, what: str) -> dict:
    """{(m, n, k): [ms of pass 1, ..., ms of pass `passes`]}, each pass a sweep over all shapes
    in its own shuffled order (fixed seeds): clocks depend on what ran just before (a large
    GEMM heats the GPU and lowers the clocks of the next seconds), so a fixed order would bias
    the same shapes in every pass."""
    out: dict[tuple[int, int, int], list[float]] = {s: [] for s in shapes}
    for p in range(passes):
        t0 = time.time()
        order = list(out)
        random.Random(1000 + p).shuffle(order)
        for (m, n, k) in order:
            out[(m, n, k)].append(measure(m, n, k, dtype, layout))
        print(f"{what} pass {p + 1}/{passes}: {len(out)} shapes ({layout}) in {time.time() - t0:.0f} s", flush=True)
    return out


def saved_measurements(cal: dict, rows: list[dict]) -> tuple[list[dict], list[tuple]]:
    """(grid, workload) measurements from a saved calibration JSON and its workload rows: where
    the passes were saved, their median is the measurement (files written before the median
    rule kept the fastest pass). Workload items are (name, m, n, k, ms)."""
    grid = [dict(r, measured_ms=statistics.median(r["passes_ms"])) if r.get("passes_ms") else r
            for r in cal["grid"]]
    passes = {(r["m"], r["n"], r["k"]): statistics.median(r["passes_ms"])
              for r in cal["meta"].get("passes", {}).get("workload_passes_ms", [])}
    work = [(r["name"], r["m"], r["n"], r["k"], passes.get((r["m"], r["n"], r["k"]), r["measured_ms"]))
            for r in rows]
    return grid, work


def measure_cpu(m: int, n: int, k: int, dtype: torch.dtype, layout: str = "tn") -> float:
    """Dry-run stand-in: median wall time of a CPU matmul (numbers mean nothing for a GPU)."""
    a, b = torch.randn(m, k, dtype=dtype), torch.randn(k, n, dtype=dtype)
    times = []
    for _ in range(5):
        t0 = time.perf_counter()
        torch.matmul(a, b)
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


# --- fit ------------------------------------------------------------------------------------------
def profile_from_params(base: hardware.HardwareProfile, x: np.ndarray) -> hardware.HardwareProfile:
    v = dict(zip([f[0] for f in FIT_FIELDS], (float(t) for t in x)))
    return dataclasses.replace(
        base, gemm_eff_max=v["gemm_eff_max"], gemm_k_half=v["gemm_k_half"],
        gemm_tile_rel=(1.0, v["tile_rel_1"], v["tile_rel_2"]), hbm_eff=v["hbm_eff"],
        gemm_blend_p=v["gemm_blend_p"], gemm_launch_us=v["gemm_launch_us"],
        gemm_throttle=v["gemm_throttle"], gemm_throttle_ms=v["gemm_throttle_ms"],
        hbm_latency_us=v["hbm_latency_us"], gemm_streamk_rel=v["gemm_streamk_rel"])


def overrides_from_params(x: np.ndarray) -> dict:
    v = dict(zip([f[0] for f in FIT_FIELDS], (round(float(t), 5) for t in x)))
    return {"gemm_eff_max": v["gemm_eff_max"], "gemm_k_half": v["gemm_k_half"],
            "gemm_tile_rel": [1.0, v["tile_rel_1"], v["tile_rel_2"]], "hbm_eff": v["hbm_eff"],
            "gemm_blend_p": v["gemm_blend_p"], "gemm_launch_us": v["gemm_launch_us"],
            "gemm_throttle": v["gemm_throttle"], "gemm_throttle_ms": v["gemm_throttle_ms"],
            "hbm_latency_us": v["hbm_latency_us"], "gemm_streamk_rel": v["gemm_streamk_rel"]}


def _loss(x, base, shapes, measured_log, dtype_name):
    lo = np.array([f[1] for f in FIT_FIELDS])
    hi = np.array([f[2] for f in FIT_FIELDS])
    penalty = float(np.sum(np.clip(lo - x, 0, None) ** 2 + np.clip(x - hi, 0, None) ** 2)) * 100
    xc = np.clip(x, lo, hi)
    if xc[3] > xc[2]:  # the smallest tile is never more efficient than the middle one
        penalty += (xc[3] - xc[2]) ** 2 * 100
    prof = profile_from_params(base, xc)
    pred = np.log([gemm_time_ms(m, n, k, dtype_name, prof) for (m, n, k) in shapes])
    err = pred - measured_log
    # mean squared log error plus a little of the worst case, so no shape class is sacrificed
    return float(np.mean(err ** 2) + 0.1 * np.max(np.abs(err)) ** 2) + penalty


def nelder_mead(f, x0: np.ndarray, step: np.ndarray, iters: int = 600, tol: float = 1e-9):
    """Plain Nelder-Mead (no SciPy needed); returns (x, f(x))."""
    n = len(x0)
    simplex = [x0] + [x0 + step * np.eye(n)[i] for i in range(n)]
    vals = [f(x) for x in simplex]
    for _ in range(iters):
        order = np.argsort(vals)
        simplex = [simplex[i] for i in order]
        vals = [vals[i] for i in order]
        if abs(vals[-1] - vals[0]) < tol:
            break
        centroid = np.mean(simplex[:-1], axis=0)
        xr = centroid + (centroid - simplex[-1])
        fr = f(xr)
        if fr < vals[0]:
            xe = centroid + 2 * (centroid - simplex[-1])
            fe = f(xe)
            simplex[-1], vals[-1] = (xe, fe) if fe < fr else (xr, fr)
        elif fr < vals[-2]:
            simplex[-1], vals[-1] = xr, fr
        else:
            xc = centroid + 0.5 * (simplex[-1] - centroid)
            fc = f(xc)
            if fc < vals[-1]:
                simplex[-1], vals[-1] = xc, fc
            else:
                simplex = [simplex[0] + 0.5 * (s - simplex[0]) for s in simplex]
                vals = [f(s) for s in simplex]
    i = int(np.argmin(vals))
    return simplex[i], vals[i]


def fit(base: hardware.HardwareProfile, grid: list[dict], dtype_name: str) -> tuple[np.ndarray, float]:
    shapes = [(r["m"], r["n"], r["k"]) for r in grid]
    measured_log = np.log([r["measured_ms"] for r in grid])
    f = lambda x: _loss(x, base, shapes, measured_log, dtype_name)  # noqa: E731
    starts = [np.array([0.8, 128, 0.85, 0.65, 0.8, 3.0, 6.0, 0.1, 1.0, 0.0, 0.8]),
              np.array([0.75, 512, 0.7, 0.5, 0.7, 2.0, 10.0, 0.0, 0.3, 5.0, 0.6]),
              np.array([0.9, 32, 0.95, 0.8, 0.9, 6.0, 3.0, 0.15, 3.0, 2.0, 0.9])]
    best_x, best_f = None, math.inf
    for x0 in starts:
        x, fx = nelder_mead(f, x0, step=np.abs(x0) * 0.2 + 0.05)
        x, fx = nelder_mead(f, x, step=np.abs(x) * 0.05 + 0.01)  # restart to escape a collapsed simplex
        if fx < best_f:
            best_x, best_f = x, fx
    lo = np.array([f_[1] for f_ in FIT_FIELDS])
    hi = np.array([f_[2] for f_ in FIT_FIELDS])
    return np.clip(best_x, lo, hi), best_f


# --- shapes ---------------------------------------------------------------------------------------
def workload_shapes(dry_run: bool) -> list[tuple[str, int, int, int]]:
    """(name, m, n, k) for every workload cell's full-M GEMM and its M/W chunk, W = 2, 4, 8."""
    out = []
    for w in workload_matrix(world_sizes=(2, 4, 8)):
        out.append((f"{w.name}-full", w.m, w.n, w.k))
        out.append((f"{w.name}-chunk", max(1, w.m // w.world_size), w.n, w.k))
    if dry_run:
        out = [(name, max(1, m // 64), max(1, n // 64), max(1, k // 64)) for name, m, n, k in out[:6]]
    return out


def _fmt_table(rows: list[dict]) -> str:
    lines = [f"{'shape':<34} {'m':>6} {'n':>6} {'k':>6} {'meas ms':>9} {'pred ms':>9} {'err %':>7}"]
    for r in rows:
        lines.append(f"{r['name']:<34} {r['m']:>6} {r['n']:>6} {r['k']:>6} {r['measured_ms']:>9.4f} "
                     f"{r['predicted_ms']:>9.4f} {100 * r['rel_err']:>+7.1f}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, help="directory for the two JSON files")
    ap.add_argument("--profile", default="h200", help="hardware profile to calibrate (default h200)")
    ap.add_argument("--dry-run", action="store_true", help="tiny shapes timed on CPU: a crash test only")
    ap.add_argument("--layout", choices=("tn", "nn"), default="tn",
                    help="b operand of the fit and the check: tn = weight.t() of an [N, K] weight, as the "
                         "layers and `tpfuse bench` pass it (default); nn = row-major [K, N]")
    ap.add_argument("--update", metavar="CAL_JSON",
                    help="also write the fitted GEMM fields, the grid and this run's meta into that "
                         "calibration file (e.g. tpfuse/model/calibration/h200.json), keeping its "
                         "other entries (the NCCL table)")
    ap.add_argument("--passes", type=int, default=3,
                    help="sweeps over the workload shapes; each keeps the median of its passes (default 3)")
    ap.add_argument("--grid-passes", type=int, default=2, help="the same for the fit grid (default 2)")
    ap.add_argument("--condition-ms", type=float, default=0.0,
                    help="before timing each shape, run this many ms of 8192^3 GEMMs so every shape "
                         "starts from the same loaded clock state (default 0: off)")
    ap.add_argument("--sweep", action="store_true",
                    help="also time M in (64, 128) x N in 8192..57344 (step 2048) x K in (8192, 16384) in both "
                         "layouts: a diagnostic of cuBLAS's small-M kernel choice, not used in the fit")
    ap.add_argument("--refit", metavar="CALIBRATION_JSON",
                    help="refit from the grid timings saved in a calibration JSON (no measuring), "
                         "then re-predict the workload rows of the gemm_calibration JSON beside it")
    args = ap.parse_args(argv)
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    t_start = time.time()
    dtype, dtype_name = torch.bfloat16, "bf16"
    base = hardware.get_profile(args.profile, calibration=False)

    if args.refit:
        old = json.loads(Path(args.refit).read_text())
        meta = dict(old["meta"])
        old_rows = json.loads((Path(args.refit).parent / f"gemm_calibration_{args.profile}.json")
                              .read_text())["rows"]
        grid, work = saved_measurements(old, old_rows)
        meta["refit"] = " ".join(["python3"] + sys.argv)
    else:
        use_cuda = torch.cuda.is_available() and not args.dry_run
        _CONDITION["ms"] = args.condition_ms if use_cuda else 0.0
        if not use_cuda and not args.dry_run:
            ap.error("no CUDA device: run on the GPU, or pass --dry-run for a CPU smoke test")
        measure = measure_cuda if use_cuda else measure_cpu
        import importlib.metadata as md
        try:
            triton_version = md.version("triton")
        except md.PackageNotFoundError:
            triton_version = "none"
        meta = {
            "date": dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
            "gpu": torch.cuda.get_device_name() if use_cuda else "cpu (dry run)",
            "sm_count": torch.cuda.get_device_properties(0).multi_processor_count if use_cuda else None,
            "torch": torch.__version__, "triton": triton_version,
            "command": " ".join(["python3"] + sys.argv), "dtype": dtype_name, "dry_run": args.dry_run,
            "layout": args.layout,
            # as the library runs: cuBLAS settings left at torch's defaults, recorded here (setting
            # allow_bf16_reduced_precision_reduction = True explicitly, as this script did before
            # 2026-11-30, measured some shapes 10-15 % slower)
            "cublas_settings": {
                "allow_bf16_reduced_precision_reduction":
                    str(torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction),
                "allow_tf32": torch.backends.cuda.matmul.allow_tf32},
            "timing": "triton.testing.do_bench median, warmup 10 ms, rep 40 ms, rotating inputs >= 3x L2; "
                      "the median of the passes' medians"
                      + (f"; each shape timed right after {args.condition_ms:g} ms of 8192^3 bf16 GEMMs "
                         "(--condition-ms)" if args.condition_ms > 0 else "")
            if use_cuda else "CPU perf_counter median of 5",
        }
        shapes = DRY_RUN_GRID if args.dry_run else (
            [(m, n, k) for m in GRID_M for (n, k) in GRID_NK]
            + [(m, n, k) for m in GRID_M_SMALL for (n, k) in GRID_NK_WIDE] + list(GRID_EXTRA))
        # Every shape is timed in `passes` sweeps over the whole list (clocks drift with power
        # and heat over seconds, so passes far apart in time see different clocks), keeping the
        # median of the passes' medians: neither a lucky boost nor a throttled moment. The
        # spread between passes is kept, per shape and as a summary.
        grid_t = timed_passes(shapes, measure, dtype, args.layout, args.grid_passes, "grid")
        grid = [{"m": m, "n": n, "k": k, "measured_ms": statistics.median(t), "passes_ms": t}
                for (m, n, k), t in grid_t.items()]
        work_shapes = workload_shapes(args.dry_run)
        uniq = list(dict.fromkeys((m, n, k) for _, m, n, k in work_shapes))
        work_t = timed_passes(uniq, measure, dtype, args.layout, args.passes, "workload")
        work = [(name, m, n, k, statistics.median(work_t[(m, n, k)])) for name, m, n, k in work_shapes]
        other = "nn" if args.layout == "tn" else "tn"
        other_t = timed_passes(uniq, measure, dtype, other, 1, f"workload ({other})")
        meta["other_layout"] = {"layout": other, "note": "the same workload shapes timed with the other "
                                "b layout in one pass, for the record (not used in the fit or the check)",
                                "rows": [{"m": m, "n": n, "k": k, "measured_ms": t[0]}
                                         for (m, n, k), t in other_t.items()]}
        meta["passes"] = {"grid": args.grid_passes, "workload": args.passes,
                          "workload_passes_ms": [{"m": m, "n": n, "k": k, "passes_ms": t}
                                                 for (m, n, k), t in work_t.items()]}
        spread = [max(t) / min(t) - 1 for t in list(grid_t.values()) + list(work_t.values()) if len(t) > 1]
        meta["pass_spread_max"] = max(spread) if spread else 0.0
        meta["pass_spread_median"] = statistics.median(spread) if spread else 0.0
        print(f"measured {len(grid)} grid + {len(uniq)} workload shapes in {time.time() - t_start:.0f} s; "
              f"slowest/fastest pass of one shape: median {100 * meta['pass_spread_median']:.1f}%, "
              f"max {100 * meta['pass_spread_max']:.1f}%", flush=True)

    if args.sweep and not args.refit:
        sweep = []
        ms_grid = (64, 128) if not args.dry_run else (16,)
        n_grid = range(8192, 57345, 2048) if not args.dry_run else (128, 256)
        k_grid = (8192, 16384) if not args.dry_run else (128,)
        for m in ms_grid:
            for k in k_grid:
                for n in n_grid:
                    row = {"m": m, "n": n, "k": k}
                    for lay in ("tn", "nn"):
                        row[f"{lay}_ms"] = measure(m, n, k, dtype, lay)
                    sweep.append(row)
            print(f"sweep M={m}: {len(sweep)} rows", flush=True)
        meta["small_m_sweep"] = sweep

    x, loss = fit(base, grid, dtype_name)
    meta["fit"] = {"loss": loss, "fields": [f[0] for f in FIT_FIELDS], "grid_shapes": len(grid),
                   "method": "Nelder-Mead on mean squared log error + 0.1 * max squared log error"}
    calibration = {"profile": args.profile, "meta": meta, "overrides": overrides_from_params(x),
                   "grid": grid}
    cal_path = out_dir / f"calibration_{args.profile}.json"
    cal_path.write_text(json.dumps(calibration, indent=1) + "\n")

    # Predict through the library's own loading path.
    fitted = hardware.get_profile(args.profile, calibration=cal_path)
    grid_err = [gemm_time_ms(r["m"], r["n"], r["k"], dtype_name, fitted) / r["measured_ms"] - 1
                for r in grid]
    rows = []
    for name, m, n, k, ms in work:
        pred = gemm_time_ms(m, n, k, dtype_name, fitted)
        rows.append({"name": name, "m": m, "n": n, "k": k, "measured_ms": ms,
                     "predicted_ms": pred, "rel_err": pred / ms - 1})
    summary = {
        "workload_max_abs_rel_err": max(abs(r["rel_err"]) for r in rows),
        "workload_median_abs_rel_err": statistics.median(abs(r["rel_err"]) for r in rows),
        "workload_within_15pct": sum(abs(r["rel_err"]) <= 0.15 for r in rows),
        "workload_rows": len(rows),
        "grid_max_abs_rel_err": max(abs(e) for e in grid_err),
        "grid_median_abs_rel_err": statistics.median(abs(e) for e in grid_err),
    }
    report = {"meta": meta, "summary": summary, "overrides": calibration["overrides"], "rows": rows}
    (out_dir / f"gemm_calibration_{args.profile}.json").write_text(json.dumps(report, indent=1) + "\n")

    if args.update:
        upd = Path(args.update)
        packaged = hardware.load_calibration(upd)
        packaged["overrides"].update(calibration["overrides"])
        packaged["meta"] = meta
        packaged["grid"] = grid
        when = f"{meta.get('date', '?')}, {meta.get('gpu', '?')}"
        packaged.setdefault("sources", {}).update(
            {key: f"fitted {when} by benchmarks/calibrate_gemm.py (cuBLAS, layout {meta.get('layout', 'nn')}; "
                  f"{len(grid)} grid shapes)" for key in calibration["overrides"]})
        upd.write_text(json.dumps(packaged, indent=1) + "\n")
        print(f"updated {upd}")

    print(f"\nfitted {args.profile}: {json.dumps(calibration['overrides'])}")
    print(f"grid: max |err| {100 * summary['grid_max_abs_rel_err']:.1f}%, "
          f"median {100 * summary['grid_median_abs_rel_err']:.1f}% over {len(grid)} shapes")
    print(_fmt_table(rows))
    print(f"workload shapes: max |err| {100 * summary['workload_max_abs_rel_err']:.1f}%, median "
          f"{100 * summary['workload_median_abs_rel_err']:.1f}%, {summary['workload_within_15pct']}/"
          f"{len(rows)} within 15%  [{meta['gpu']}, {meta['date']}, {time.time() - t_start:.0f} s]")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
