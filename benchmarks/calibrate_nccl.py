"""Fit the measured NCCL table (``HardwareProfile.nccl_measured``) from ``tpfuse bench`` results.

    python benchmarks/calibrate_nccl.py benchmarks/results/bench_h200x2_w2_2026-11-30.json
    python benchmarks/calibrate_nccl.py BENCH_W4.json BENCH_W8.json \\
        --update tpfuse/model/calibration/h200.json --source "measured DATE, 8x H200 ..., NVLS off"

No GPU needed: it reads the "comm alone" column of the bench rows (the bare NCCL collective of
each cell, in the op's dtype), fits ``time = alpha + bytes_per_rank / bus`` per world size by least
squares (``tpfuse.model.nccl_fit``) and prints the fit with every row's residual.  The alpha is
what one collective call costs as the bench times it (CUDA events after a barrier, launch and
host latency included), not a per-ring-step latency.

It also derives ``ring_step_host_us`` (host time a ring step costs beyond unfused: the median of
(ring host ms - unfused host ms) / steps over the rows' ``host_ms``); it is a property of the host
that issued the calls as much as of the GPU.

``--update CAL.json`` writes the fitted entries into that calibration file (the one
``hardware.get_profile`` loads), replacing only the world sizes fitted now and keeping every
other override (the GEMM curve from ``calibrate_gemm.py``), with ``--source`` as the recorded
source.  ``calibrate_gemm.py`` writes a fresh file without this table: rerun this script on it.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1] / "src"
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from tpfuse.model.hardware import load_calibration  # noqa: E402
from tpfuse.model.nccl_fit import NcclFitResult, comm_rows_from_bench, fit_nccl, ring_step_host_us  # noqa: E402


@dataclass(frozen=True)
class Config:
    bench: tuple[Path, ...]
    update: Path | None
    source: str | None


def _parse(argv: list[str] | None) -> Config:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("bench", nargs="+", type=Path, help="tpfuse bench JSON file(s) ({meta, rows})")
    parser.add_argument("--update", type=Path, metavar="CAL.json",
                        help="write the fitted world sizes into this calibration file")
    parser.add_argument("--source", help="where the numbers came from (date, GPUs, W, NCCL settings); "
                        "default: built from the bench files' meta")
    args = parser.parse_args(argv)
    return Config(tuple(args.bench), args.update, args.source)


def _default_source(metas: list[dict], w: int) -> str:
    parts = {f"measured {str(m.get('date', '?'))[:10]}, {m.get('num_gpus', '?')}x {m.get('device', '?')} "
             f"W={w} {m.get('backend', 'nccl').upper()}, tpfuse bench ({m.get('machine', '')})" for m in metas}
    return "; ".join(sorted(parts))


def _report(results: dict[int, NcclFitResult]) -> str:
    lines = []
    for w, res in results.items():
        lines.append(f"W={w}: bus {res.fit.bus_gbps:.1f} GB/s, alpha {res.fit.alpha_us:.1f} us "
                     f"({len(res.rows)} rows, least squares on ms)")
        lines.append(f"  {'row':<24} {'collective':<15} {'MB/rank':>9} {'measured':>9} {'fit':>9} {'err':>7}")
        for row, err in zip(res.rows, res.rel_errors()):
            lines.append(f"  {row.name:<24} {row.kind:<15} {row.bytes_per_rank / 1e6:>9.2f} "
                         f"{row.ms:>9.4f} {res.predicted_ms(row):>9.4f} {100 * err:>+6.1f}%")
    return "\n".join(lines)


def _update(path: Path, results: dict[int, NcclFitResult], sources: dict[int, str],
            bench: tuple[Path, ...], host_step: tuple[float, list] | None, host_source: str) -> None:
    cal = load_calibration(path)
    if host_step is not None:
        cal["overrides"]["ring_step_host_us"] = round(host_step[0], 1)
        cal.setdefault("sources", {})["ring_step_host_us"] = (
            f"{host_source}: median over {len(host_step[1])} cells of (ring - unfused host ms) / ring steps "
            "(benchmarks/calibrate_nccl.py)")
    table = dict(cal["overrides"].get("nccl_measured", {}))
    info = dict(cal.get("nccl", {}))
    for w, res in results.items():
        table[str(w)] = {"bus_gbps": round(res.fit.bus_gbps, 2), "alpha_us": round(res.fit.alpha_us, 2)}
        info[str(w)] = {
            "source": sources[w],
            "bench": [str(p) for p in bench],
            "method": "least squares of comm-alone ms = alpha + bytes_per_rank / bus over every row of this W "
                      "(benchmarks/calibrate_nccl.py)",
            "rows": [{"name": r.name, "collective": r.kind, "bytes_per_rank": r.bytes_per_rank,
                      "measured_ms": r.ms, "fit_ms": res.predicted_ms(r)} for r in res.rows],
        }
    cal["overrides"]["nccl_measured"] = dict(sorted(table.items(), key=lambda kv: int(kv[0])))
    cal["nccl"] = dict(sorted(info.items(), key=lambda kv: int(kv[0])))
    cal.setdefault("sources", {})["nccl_measured"] = "; ".join(
        f"W={w}: {entry['source']}" for w, entry in cal["nccl"].items())
    path.write_text(json.dumps(cal, indent=1) + "\n")


def main(argv: list[str] | None = None) -> int:
    cfg = _parse(argv)
    datas = [json.loads(p.read_text()) for p in cfg.bench]
    rows = [row for d in datas for row in comm_rows_from_bench(d)]
    if not rows:
        print("calibrate_nccl: no 'comm_alone' rows with world_size >= 2 in "
              f"{[str(p) for p in cfg.bench]}; run `tpfuse bench --world-size W` first", file=sys.stderr)
        return 2
    try:
        results = fit_nccl(rows)
    except ValueError as exc:
        print(f"calibrate_nccl: {exc}", file=sys.stderr)
        return 2
    print(_report(results))
    host_step = ring_step_host_us({"rows": [row for d in datas for row in d.get("rows", [])]})
    if host_step is not None:
        print(f"ring_step_host_us: {host_step[0]:.1f} (median of {len(host_step[1])} cells: "
              + ", ".join(f"{n} {v:.0f}" for n, v in host_step[1]) + ")")
    if cfg.update is not None:
        metas = [d.get("meta", {}) for d in datas]
        sources = {w: cfg.source or _default_source(metas, w) for w in results}
        _update(cfg.update, results, sources, cfg.bench, host_step,
                cfg.source or _default_source(metas, sorted(results)[0]))
        print(f"updated {cfg.update}: nccl_measured for W = {sorted(results)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
