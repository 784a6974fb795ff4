"""Markdown tables of the model's predictions for the workload matrix (used to write docs/model.md).

    python -m tpfuse.model.report h200 gb200      # prints the tables
"""

from __future__ import annotations

import sys

__all__ = ["predicted_table_markdown"]


def predicted_table_markdown(hardware: str, world_sizes: tuple[int, ...] | None = None) -> str:
    """One row per workload cell: chosen strategy (among the built ones), chunks, predicted ms,
    the stock baseline (NCCL collective on the op's dtype + one GEMM) and the speedup over it, and the fastest modelled-only strategy (not in this build), marked *."""
    from tpfuse.bench.workloads import workload_matrix
    from tpfuse.model.hardware import get_profile
    from tpfuse.plan import plan, tp_sizes

    hw = get_profile(hardware)
    sizes = world_sizes or tp_sizes(hw)
    cal = f"calibrated GEMM curve ({hw.calibrated.split(' (')[-1].rstrip(')')})" if hw.calibrated \
        else "uncalibrated: datasheet numbers and leads"
    if hw.nccl_measured:
        cal += "; NCCL measured at W = " + ", ".join(str(f.world_size) for f in hw.nccl_measured) + \
            " (leads elsewhere)"
    lines = [
        f"PREDICTED on `{hw.name}` ({hw.description}; {cal}), bf16, TP {', '.join(map(str, sizes))}, "
        "eager calls (host model included).",
        "",
        "| cell | op | m | n | k | strategy | chunks | pred ms | stock ms | GEMM alone ms | comm alone ms "
        "| speedup | modelled only* (ms, speedup) |",
        "|---|---|---:|---:|---:|---|---:|---:|---:|---:|---:|---:|---|",
    ]
    for c in workload_matrix(world_sizes=sizes):
        p = plan(c.op, m=c.m, n=c.n, k=c.k, world_size=c.world_size, dtype=c.dtype, hardware=hw, modelled=True)
        other = "-"
        if p.modelled_ms:
            s, ms = min(p.modelled_ms.items(), key=lambda kv: kv[1])
            other = f"{s} {ms:.3f}, {p.breakdown['baseline_ms'] / ms:.2f}x"
        lines.append(
            f"| {c.name} | {c.op} | {c.m} | {c.n} | {c.k} | {p.strategy} | {p.num_chunks} | "
            f"{p.predicted_ms[p.strategy]:.3f} | {p.breakdown['baseline_ms']:.3f} | "
            f"{p.breakdown['gemm_ms']:.3f} | {p.breakdown['comm_ms']:.3f} | {p.speedup:.2f}x | {other} |")
    lines += ["", "\\* not in this build: predicted for comparison, never chosen by `tpfuse.plan`."]
    return "\n".join(lines)


if __name__ == "__main__":
    for name in sys.argv[1:] or ["h200"]:
        print(predicted_table_markdown(name))
        print()
