"""Tables of the planner's plans: ``tpfuse plan`` (a table, JSON or timelines for one cell or the
workload matrix) and the markdown tables of docs/model.md.  The planner itself (:mod:`tpfuse.plan`)
only decides.

    python -m tpfuse.report h200 gb200      # docs/model.md's tables
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from tpfuse import strategies
from tpfuse.bench.workloads import workload_matrix
from tpfuse.model.hardware import HardwareProfile, get_profile
from tpfuse.model.simulate import OPS, draw_timeline
from tpfuse.plan import Plan, canonical_dtype, plan

__all__ = ["tp_sizes", "add_plan_arguments", "run_plan_cli", "predicted_table_markdown"]


def tp_sizes(hw: HardwareProfile) -> tuple[int, ...]:
    """The TP degrees worth tabulating on a machine: 2/4/8, or 8..72 in an NVL72 domain."""
    if hw.max_domain >= 72:
        return (8, 16, 32, 72)
    return tuple(w for w in (2, 4, 8) if w <= hw.max_domain)


def add_plan_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of ``tpfuse plan``."""
    parser.add_argument("--op", choices=OPS, help="one cell: the op")
    parser.add_argument("--m", type=int, help="one cell: full M (tokens)")
    parser.add_argument("--n", type=int, help="one cell: local N")
    parser.add_argument("--k", type=int, help="one cell: local K")
    parser.add_argument("--world-size", type=int, help="TP degree W (with the matrix: only this W)")
    parser.add_argument("--dtype", default="bf16", help="bf16 (default), fp16, fp32, fp64")
    parser.add_argument("--hardware", default="h200", help="hardware profile (default h200)")
    parser.add_argument("--model", choices=("8b", "70b", "405b"), help="matrix: only this Llama-3 size")
    parser.add_argument("--phase", choices=("training", "prefill", "decode"), help="matrix: only this phase")
    parser.add_argument("--all", action="store_true", help="the whole workload matrix for the hardware")
    parser.add_argument("--timeline", metavar="OUT.png", help="draw the chosen strategy's simulated timeline")
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    parser.add_argument("--cuda-graph", action="store_true",
                        help="plan for CUDA-graph replay (no host costs) instead of eager calls")


def _check_cli_args(args) -> None:
    """Argument errors of ``tpfuse plan`` (one line each, before any work)."""
    if args.world_size is not None and args.world_size < 1:
        raise ValueError(f"--world-size: {args.world_size} must be >= 1 (the TP degree)")
    cell_args = {"--op": args.op, "--m": args.m, "--n": args.n, "--k": args.k}
    given = [name for name, value in cell_args.items() if value is not None]
    if args.all and given:
        raise ValueError(f"--all plans the whole workload matrix and ignores {', '.join(given)}; "
                         "drop --all for one cell, or drop the cell options")
    if given and (args.model is not None or args.phase is not None):
        raise ValueError("--model/--phase select rows of the workload matrix; they do not combine "
                         "with one cell (--op/--m/--n/--k)")
    if args.timeline:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            raise ValueError("--timeline needs matplotlib, which is not installed "
                             "(pip install matplotlib), or drop --timeline") from None
    get_profile(args.hardware)
    canonical_dtype(args.dtype)


def _cells(args) -> list[tuple[str, Plan]]:
    hw = get_profile(args.hardware)
    cell_args = [args.op, args.m, args.n, args.k]
    if any(a is not None for a in cell_args) and not args.all:
        if any(a is None for a in cell_args) or args.world_size is None:
            raise ValueError("one cell needs --op, --m, --n, --k and --world-size; "
                             "or give none of them for the workload matrix")
        p = plan(args.op, m=args.m, n=args.n, k=args.k, world_size=args.world_size,
                 dtype=args.dtype, hardware=hw, cuda_graph=args.cuda_graph)
        return [(f"{args.op} {args.m}x{args.n}x{args.k}", p)]
    sizes = (args.world_size,) if args.world_size else tp_sizes(hw)
    cells = workload_matrix(
        world_sizes=sizes, dtype=canonical_dtype(args.dtype),
        models=(args.model,) if args.model else ("8b", "70b", "405b"),
        phases=(args.phase,) if args.phase else ("training", "prefill", "decode"))
    return [(c.name, plan(c.op, m=c.m, n=c.n, k=c.k, world_size=c.world_size, dtype=c.dtype,
                          hardware=hw, cuda_graph=args.cuda_graph)) for c in cells]


_STOCK_NOTE = ("† stock: the NCCL collective on the op's dtype + one GEMM (what `tpfuse bench` calls unfused_ms); "
               "speedup = stock / pred.  tpfuse unfused: tpfuse's own unfused strategy, one candidate like any other.")


def _print_table(rows: list[tuple[str, Plan]], title: str) -> None:
    header = ["cell", "op", "W", "strategy", "chunks", "pred ms", "stock ms†", "speedup†", "tpfuse unfused ms",
              "exposed comm ms", "bound"]
    body = [[name, p.op, str(p.world_size), p.strategy, str(p.num_chunks),
             f"{p.predicted_ms[p.strategy]:.4f}", f"{p.breakdown['baseline_ms']:.4f}",
             f"{p.speedup:.2f}x", f"{p.predicted_ms['unfused']:.4f}" if "unfused" in p.predicted_ms else "-",
             f"{p.breakdown['exposed_comm_ms']:.4f}", p.bound]
            for name, p in rows]
    try:
        from rich.console import Console
        from rich.table import Table
    except ImportError:
        widths = [max(len(r[i]) for r in [header] + body) for i in range(len(header))]
        print(title)
        for r in [header] + body:
            print("  ".join(c.ljust(wd) for c, wd in zip(r, widths)))
        print(_STOCK_NOTE)
        return
    table = Table(title=title, caption=_STOCK_NOTE)
    for i, h in enumerate(header):
        table.add_column(h, justify="left" if i in (0, 1, 3, 10) else "right")
    for r in body:
        table.add_row(*r)
    Console(file=sys.stdout, width=max(160, sum(len(h) for h in header) + 60)).print(table)


def run_plan_cli(args: argparse.Namespace) -> int:
    """``tpfuse plan``: a table (or JSON) of predictions for one cell or the workload matrix."""
    try:
        _check_cli_args(args)
        rows = _cells(args)
    except (ValueError, TypeError) as exc:
        print(f"tpfuse plan: {exc}", file=sys.stderr)
        return 2
    hw = get_profile(args.hardware)
    if args.json:
        print(json.dumps([dict(p.to_dict(), cell=name) for name, p in rows], indent=1))
    else:
        cal = f"calibrated: {hw.calibrated}" if hw.calibrated else "uncalibrated datasheet/lead numbers"
        _print_table(rows, f"tpfuse plan -- PREDICTED on {hw.name} ({cal})")
        if len(rows) == 1:
            print(rows[0][1].explain())
    if args.timeline:
        out = Path(args.timeline)
        for i, (name, p) in enumerate(rows):
            path = out if len(rows) == 1 else out.with_name(f"{out.stem}-{name}{out.suffix or '.png'}")
            res = strategies.simulate(p.op, p.strategy, m=p.m, n=p.n, k=p.k, world_size=p.world_size,
                                      dtype=p.dtype, hw=hw, num_chunks=p.num_chunks, cuda_graph=p.cuda_graph)
            draw_timeline(res, path, title=f"{name}: {p.strategy}, {p.num_chunks} chunks, "
                          f"{p.predicted_ms[p.strategy]:.3f} ms predicted on {hw.name} "
                          f"(unfused {p.predicted_ms['unfused']:.3f} ms)")
            if not args.json:
                print(f"timeline: {path}")
    return 0


def predicted_table_markdown(hardware: str, world_sizes: tuple[int, ...] | None = None) -> str:
    """One row per workload cell: chosen strategy, chunks, predicted ms, the stock baseline (NCCL
    collective on the op's dtype + one GEMM), GEMM and comm alone, the speedup over the stock
    baseline (docs/model.md's tables)."""
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
        "| speedup |",
        "|---|---|---:|---:|---:|---|---:|---:|---:|---:|---:|---:|",
    ]
    for c in workload_matrix(world_sizes=sizes):
        p = plan(c.op, m=c.m, n=c.n, k=c.k, world_size=c.world_size, dtype=c.dtype, hardware=hw)
        lines.append(
            f"| {c.name} | {c.op} | {c.m} | {c.n} | {c.k} | {p.strategy} | {p.num_chunks} | "
            f"{p.predicted_ms[p.strategy]:.3f} | {p.breakdown['baseline_ms']:.3f} | "
            f"{p.breakdown['gemm_ms']:.3f} | {p.breakdown['comm_ms']:.3f} | {p.speedup:.2f}x |")
    return "\n".join(lines)


if __name__ == "__main__":
    for name in sys.argv[1:] or ["h200"]:
        print(predicted_table_markdown(name))
        print()
