"""Fit the measured NCCL table of a hardware profile from ``tpfuse bench`` results.

Each bench row times the bare NCCL collective of its op ("comm alone": all-gather of the
``[M/W, K]`` shard for ag_gemm, reduce-scatter of the ``[M, N]`` partial for gemm_rs, all-reduce
of ``[M, N]`` for gemm_ar, in the op's dtype).  Per world size, least squares (absolute ms) of

    time = alpha + bytes_per_rank / bus        (cost.nccl_bytes_per_rank: nccl-tests' convention)

over every row of that W gives ``hardware.NcclFit(world_size, bus_gbps, alpha_us)``; the
per-row residuals come with it.  ``benchmarks/calibrate_nccl.py`` is the CLI.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from typing import Any, Iterable, Mapping

from tpfuse import dtypes
from tpfuse.model.cost import nccl_bytes_per_rank
from tpfuse.model.hardware import NcclFit

__all__ = ["CommRow", "NcclFitResult", "comm_rows_from_bench", "fit_nccl", "ring_step_host_us"]

# op -> (collective it runs alone, the tensor whose size it moves)
_COLLECTIVE = {"ag_gemm": "all_gather", "gemm_rs": "reduce_scatter", "gemm_ar": "all_reduce"}


@dataclass(frozen=True)
class CommRow:
    """One measured collective: ``bytes_per_rank`` sent by each rank, ``ms`` it took."""

    name: str
    kind: str  # all_gather | reduce_scatter | all_reduce
    world_size: int
    bytes_per_rank: float
    ms: float


@dataclass(frozen=True)
class NcclFitResult:
    fit: NcclFit
    rows: tuple[CommRow, ...]

    def predicted_ms(self, row: CommRow) -> float:
        return self.fit.alpha_us * 1e-3 + row.bytes_per_rank / (self.fit.bus_gbps * 1e9) * 1e3

    def rel_errors(self) -> list[float]:
        """(predicted - measured) / measured per row, in row order."""
        return [(self.predicted_ms(r) - r.ms) / r.ms for r in self.rows]


def comm_rows_from_bench(data: Mapping[str, Any]) -> list[CommRow]:
    """The "comm alone" rows of a ``tpfuse bench`` JSON ({meta, rows}); rows without it are skipped.

    Reads both row formats: today's (one row per cell and strategy, ``comm_ms``; one measurement
    per ``cell`` taken) and the one before 2026-12-01 (``ms: {"comm_alone": ...}``)."""
    out = []
    seen_cells = set()
    for row in data.get("rows", []):
        timings = row.get("ms")
        ms = timings.get("comm_alone") if isinstance(timings, Mapping) else row.get("comm_ms")
        if "cell" in row:
            if row["cell"] in seen_cells:
                continue
            if ms is not None:
                seen_cells.add(row["cell"])
        w = int(row.get("world_size", 1))
        if ms is None or w < 2 or row.get("op") not in _COLLECTIVE:
            continue
        m, n, k = int(row["m"]), int(row["n"]), int(row["k"])
        elt = dtypes.itemsize(row.get("dtype", "bf16"))
        kind = _COLLECTIVE[row["op"]]
        total = m * k * elt if kind == "all_gather" else m * n * elt
        name = row.get("cell", row.get("name", row["op"]))
        out.append(CommRow(name, kind, w, nccl_bytes_per_rank(kind, total, w), float(ms)))
    return out


def fit_nccl(rows: Iterable[CommRow]) -> dict[int, NcclFitResult]:
    """Per world size, the least-squares ``alpha + bytes / bus`` through its rows.

    Raises ``ValueError`` for a world size whose rows do not pin both parameters (fewer than two
    distinct sizes) or whose fit is not physical (bus <= 0 or alpha < 0)."""
    by_w: dict[int, list[CommRow]] = {}
    for r in rows:
        by_w.setdefault(r.world_size, []).append(r)
    results = {}
    for w, group in sorted(by_w.items()):
        xs = [r.bytes_per_rank for r in group]
        ys = [r.ms for r in group]
        n = len(group)
        mean_x, mean_y = sum(xs) / n, sum(ys) / n
        sxx = sum((x - mean_x) ** 2 for x in xs)
        if len(set(xs)) < 2 or sxx <= 0:
            raise ValueError(f"rows: world_size {w} has {n} row(s) of {len(set(xs))} distinct size(s); "
                             "the fit needs at least two sizes (run the bench on more cells)")
        slope = sum((x - mean_x) * (y - mean_y) for x, y in zip(xs, ys)) / sxx  # ms per byte
        alpha_ms = mean_y - slope * mean_x
        if slope <= 0 or alpha_ms < 0:
            raise ValueError(f"rows: world_size {w}: least squares gives {slope:.3g} ms/byte and alpha "
                             f"{alpha_ms * 1e3:.1f} us, not a physical link; check the bench rows")
        fit = NcclFit(world_size=w, bus_gbps=1e-6 / slope, alpha_us=alpha_ms * 1e3)  # 1e3/slope B/s
        results[w] = NcclFitResult(fit, tuple(group))
    return results


def ring_step_host_us(data: Mapping[str, Any]) -> tuple[float, list[tuple[str, float]]] | None:
    """Host time a ``ring`` step costs beyond ``unfused``, from a bench JSON's ``host_ms``.

    Per row: (ring host ms - unfused host ms) / ring steps (W for ag_gemm/gemm_rs, 2W - 1 for
    gemm_ar: reduce-scatter then all-gather).  Returns (median in us, [(row, us)]), or None when
    no row has both host times."""
    per_row = []
    for row in data.get("rows", []):
        host = row.get("host_ms", {})
        w = int(row.get("world_size", 1))
        if w < 2 or "ring" not in host or "unfused" not in host:
            continue
        steps = 2 * w - 1 if row.get("op") == "gemm_ar" else w
        per_row.append((row.get("name", row.get("op", "?")), (host["ring"] - host["unfused"]) / steps * 1e3))
    if not per_row:
        return None
    return max(0.0, statistics.median(v for _, v in per_row)), per_row
