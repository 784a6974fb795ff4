"""Cross-check GEMM calibrations: fit each run's grid, predict every run's workload shapes.

    python benchmarks/calibration_crosscheck.py RUN_DIR_OR_FILES... [--out cross.json]

Rows: each run's own fit, the profile as shipped (its calibration JSON), and each run's
measured times used as the prediction (the spread between runs, which bounds any model).

Each run is a pair ``calibration_h200*.json`` (grid, with per-pass timings) +
``gemm_calibration_h200*.json`` (workload rows) written by ``benchmarks/calibrate_gemm.py``;
pass the calibration files (the workload file is found by name beside it). A shape's
measurement is the median of its passes. The fit is the one of ``calibrate_gemm.py`` (grid
only), so the diagonal of the table is each run's own held-out check and the off-diagonal
says how well one run's fit predicts another run's measurements (clocks, thermal state, host).
No GPU needed.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
for p in (ROOT, ROOT / "benchmarks"):
    if str(p) not in sys.path:
        sys.path.insert(0, str(p))

import calibrate_gemm as cg  # noqa: E402
from tpfuse.model import hardware  # noqa: E402
from tpfuse.model.cost import gemm_time_ms  # noqa: E402


def load_run(cal_path: Path) -> dict:
    cal = json.loads(cal_path.read_text())
    work_path = cal_path.with_name(cal_path.name.replace("calibration_", "gemm_calibration_", 1))
    grid, work = cg.saved_measurements(cal, json.loads(work_path.read_text())["rows"])
    return {"name": cal_path.stem, "meta": cal["meta"], "grid": grid, "work": work}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("calibrations", nargs="+", type=Path)
    ap.add_argument("--profile", default="h200")
    ap.add_argument("--out", type=Path, help="write the table (and each fit) as JSON here")
    args = ap.parse_args(argv)
    runs = [load_run(p) for p in args.calibrations]
    base = hardware.get_profile(args.profile, calibration=False)
    lo = np.array([f[1] for f in cg.FIT_FIELDS])
    hi = np.array([f[2] for f in cg.FIT_FIELDS])
    fits, table = {}, []

    def cells(fit_name, predict):
        for ev in runs:
            errs = [predict(name, m, n, k) / ms - 1 for name, m, n, k, ms in ev["work"]]
            worst = max(range(len(errs)), key=lambda i: abs(errs[i]))
            table.append({"fit": fit_name, "measured": ev["name"], "rows": len(errs),
                          "within_15pct": sum(abs(e) <= 0.15 for e in errs),
                          "max_abs_rel_err": abs(errs[worst]), "worst_shape": ev["work"][worst][0],
                          "median_abs_rel_err": statistics.median(abs(e) for e in errs)})

    for fr in runs:
        x, loss = cg.fit(base, fr["grid"], "bf16")
        prof = cg.profile_from_params(base, np.clip(x, lo, hi))
        fits[fr["name"]] = {"loss": loss, "overrides": cg.overrides_from_params(x)}
        cells(fr["name"], lambda name, m, n, k, prof=prof: gemm_time_ms(m, n, k, "bf16", prof))
    # the profile as shipped (its calibration JSON applied): the prediction users get
    shipped = hardware.get_profile(args.profile)
    cells("shipped", lambda name, m, n, k: gemm_time_ms(m, n, k, "bf16", shipped))
    # no model at all: one run's measured times as the prediction of another's -- how far
    # the runs themselves are apart, i.e. what no model can do better than
    for fr in runs:
        seen = {w[0]: w[4] for w in fr["work"]}
        cells("measured:" + fr["name"], lambda name, m, n, k, seen=seen: seen[name])
    names = [r["name"] for r in runs]
    print("within +-15% (max |err|): rows = fitted on that run's grid ('shipped': the profile's own "
          "calibration; 'measured:': that run's timings as the prediction), columns = that run's workload timings")
    print("fit / measured".ljust(44) + "".join(f"{n.rsplit('_', 1)[-1]:>16}" for n in names))
    for fn in dict.fromkeys(t["fit"] for t in table):
        row = [t for t in table if t["fit"] == fn]
        print(f"{fn:<44}" + "".join(f"{t['within_15pct']:>5}/{t['rows']} ({100 * t['max_abs_rel_err']:4.1f}%)"
                                      for t in row))
    if args.out:
        args.out.write_text(json.dumps({
            "runs": [{"name": r["name"], "date": r["meta"].get("date"), "gpu": r["meta"].get("gpu"),
                      "command": r["meta"].get("command"), "pass_spread_max": r["meta"].get("pass_spread_max"),
                      "pass_spread_median": r["meta"].get("pass_spread_median")} for r in runs],
            "fits": fits, "table": table,
            "command": " ".join(["python"] + sys.argv)}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
