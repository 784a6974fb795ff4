"""``tpfuse bench [layer | comm]``: parse -> config -> run -> table, JSON, PNG.

    tpfuse bench --quick --json out.json --png out.png --timeline timeline.png
    tpfuse bench layer --quick
    tpfuse bench comm --quick --json comm.json
    tpfuse bench --bed 2 --quick                  # 2 processes sharing cuda:0 (start MPS first)
    torchrun --nproc-per-node 8 -m tpfuse bench   # one NCCL rank per GPU

Argument errors are one line on stderr and exit code 2.
"""

from __future__ import annotations

import argparse
import os
import sys
from dataclasses import replace
from pathlib import Path

__all__ = ["add_bench_parser"]


class _UsageError(ValueError):
    """A bad argument: printed as one line, exit code 2."""


def _speaks() -> bool:
    """Under torchrun only rank 0 prints and writes files."""
    from tpfuse.bench.common import under_torchrun

    return not under_torchrun() or os.environ.get("RANK") == "0"


def _positive(args: argparse.Namespace, *names: str, minimum: int = 1) -> None:
    for name in names:
        value = getattr(args, name)
        if value is not None and value < minimum:
            raise _UsageError(f"--{name.replace('_', '-')}: {value} must be >= {minimum}")


def _register_strategies(args: argparse.Namespace) -> None:
    from tpfuse import strategies

    for module in args.register_strategy or ():
        try:
            strategies.register_module(module)
        except (TypeError, ValueError) as exc:
            raise _UsageError(f"--register-strategy: {exc}") from None


def _check_strategies(args: argparse.Namespace) -> None:
    from tpfuse import strategies

    known = strategies.names()
    for name in args.strategies or ():
        if name != "auto" and name not in known:
            raise _UsageError(f"--strategies: unknown strategy {name!r}; choose from auto, {', '.join(known)}")


def _check_hardware(args: argparse.Namespace) -> None:
    """``--hardware``: "auto" or a known planner profile, before any cell runs."""
    if args.hardware == "auto":
        return
    from tpfuse.model.hardware import get_profile

    try:
        get_profile(args.hardware)
    except ValueError as exc:
        raise _UsageError(f"--hardware: {exc}") from None


def _check_outputs(args: argparse.Namespace) -> None:
    """Every output path writable (its folder a directory or creatable), before any work."""
    from tpfuse._paths import output_path_error

    pngs = [p for p in (getattr(args, "png", None), getattr(args, "timeline", None)) if p]
    checks = [("--png", getattr(args, "png", None), (".png",), False),
              ("--timeline", getattr(args, "timeline", None), (".png",), False),
              ("--json", getattr(args, "json", None), (".json",), True),
              ("--md", getattr(args, "md", None), (), False)]
    for flag, path, suffixes, directory in checks:
        why = path and output_path_error(flag, path, suffixes, directory_if_no_suffix=directory)
        if why:
            raise _UsageError(why)
    if pngs:
        from tpfuse.bench.report import require_matplotlib

        try:
            require_matplotlib()
        except RuntimeError as exc:
            raise _UsageError(str(exc)) from None
    timeline = getattr(args, "timeline", None)
    if timeline and args.json and Path(args.json).resolve() == Path(timeline).with_suffix(".json").resolve():
        raise _UsageError(f"--json {args.json} is where --timeline writes its Chrome trace; choose another path")


def _on_gpu(args: argparse.Namespace) -> bool:
    import torch

    return args.device != "cpu" and (torch.cuda.is_available() or bool(getattr(args, "bed", 0)))


def _mode_line(meta: dict) -> None:
    print(f"mode {meta['mode']}: {meta['mode_note']}")
    if meta.get("mps") is False:
        print("  no MPS daemon found (nvidia-cuda-mps-control -d): the bed's processes time-slice the GPU")


def _footnote(reasons: dict[str, str]) -> None:
    for field, why in reasons.items():
        print(f"  {field} null: {why}")


def _write_md(path: str | None, title: str, table: list[list[str]], meta: dict, notes: dict[str, str]) -> None:
    if not path:
        return
    from tpfuse.bench.report import to_markdown

    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(to_markdown(title, table, meta, notes))
    print(f"wrote {out}")


def _write_json(result: dict, path: str, quiet: bool = False) -> None:
    from tpfuse.bench.run import write_result

    written = write_result(result, path)
    if not quiet:
        print(f"wrote {written}")


# --------------------------------------------------------------------------------------------
# tpfuse bench
# --------------------------------------------------------------------------------------------


def _ops(args: argparse.Namespace) -> int:
    from tpfuse.bench.run import BenchConfig, format_rows, null_reasons, quick_config, run_bench

    _positive(args, "world_size", "iters", "scale")
    _positive(args, "warmup", minimum=0)
    _check_outputs(args)
    _register_strategies(args)
    _check_strategies(args)
    _check_hardware(args)
    given = {k: v for k, v in {
        "world_size": args.world_size, "models": tuple(args.models) if args.models else None,
        "phases": tuple(args.phases) if args.phases else None,
        "strategies": tuple(args.strategies) if args.strategies else None, "iters": args.iters,
        "warmup": args.warmup, "scale": args.scale,
        "strategy_modules": tuple(args.register_strategy) if args.register_strategy else None}.items() if v is not None}
    base = quick_config(_on_gpu(args)) if args.quick else BenchConfig()
    _setup(args, base.world_size)
    config = replace(base, **given, hardware=args.hardware, device=args.device, bed=args.bed or 0, dtype=args.dtype,
                     graph=not args.no_graph, timeline=bool(args.timeline))
    from tpfuse.console import Progress as _Progress, print_table as _print_table

    def partial(result: dict) -> None:   # a run cut short keeps the cells it finished
        if args.json and _speaks():
            _write_json(result, args.json, quiet=True)

    result = run_bench(config, progress=_Progress("bench") if _speaks() else None, on_cell=partial)
    if not _speaks():
        return 0
    meta = result["meta"]
    title = (f"tpfuse bench: {meta['device']}, {meta['processes']} processes ({meta['backend']}, {meta['mode']}), "
             f"{meta['dtype']}, median ms of {config.iters} calls (slowest rank)")
    _print_table(format_rows(result), title)
    _mode_line(meta)
    if meta.get("checks"):
        print(f"checks: {meta['checks']}")
    print("spread: interquartile range of the calls, % of the median; ratios within it are noise")
    _footnote(null_reasons(result))
    _write_md(args.md, title, format_rows(result), meta, null_reasons(result))
    if args.json:
        _write_json(result, args.json)
    if args.png:
        from tpfuse.bench.report import draw_speedups

        try:
            print(f"wrote {draw_speedups(result, args.png)}")
        except ValueError as exc:
            print(f"--png: not written: {exc}", file=sys.stderr)
    if args.timeline:
        _write_timeline(result, args.timeline)
    for cell, why in meta.get("cells_failed", {}).items():
        print(f"tpfuse bench: cell {cell} failed ({why}); its rows are null with that reason", file=sys.stderr)
    return 1 if meta.get("cells_failed") else 0


def _write_timeline(result: dict, path: str) -> None:
    import json

    from tpfuse import timeline

    tl = result["timeline"]
    events = [timeline.TimelineEvent.from_dict(e) for e in tl["events"]]
    if not events:
        print(f"--timeline: nothing was recorded for {tl['cell']} (no strategy ran)", file=sys.stderr)
        return
    meta = result["meta"]
    title = f"{tl['cell']}: {meta['device']}, {meta['processes']} processes, {meta['mode']}"
    png = timeline.draw(events, path, title=title)
    trace = Path(path).with_suffix(".json")
    trace.write_text(json.dumps(timeline.to_chrome_trace(events, meta={"cell": tl["cell"], **meta})))
    print(f"wrote {png} and {trace} (Chrome trace: open in https://ui.perfetto.dev)")


# --------------------------------------------------------------------------------------------
# tpfuse bench layer / comm
# --------------------------------------------------------------------------------------------


def _layer(args: argparse.Namespace) -> int:
    from tpfuse.bench.layer import LayerConfig, format_layer_rows, quick_layer_config, run_layer_bench

    _positive(args, "world_size", "iters", "scale", "tokens")
    _positive(args, "warmup", minimum=0)
    _check_outputs(args)
    _check_strategies(args)
    given = {k: v for k, v in {"world_size": args.world_size, "model": args.model, "tokens": args.tokens,
                                "scale": args.scale, "iters": args.iters, "warmup": args.warmup,
                                "strategies": tuple(args.strategies) if args.strategies else None}.items()
             if v is not None}
    base = quick_layer_config(_on_gpu(args)) if args.quick else LayerConfig()
    _setup(args, base.world_size)
    cfg = replace(base, **given, device=args.device, bed=args.bed or 0, dtype=args.dtype, asynctp=not args.no_asynctp)
    from tpfuse.console import Progress as _Progress, print_table as _print_table

    result = run_layer_bench(cfg, progress=_Progress("bench layer") if _speaks() else None)
    if not _speaks():
        return 0
    meta = result["meta"]
    title = (f"tpfuse bench layer: Llama-3 {cfg.model} MLP T={meta['tokens']} h={meta['hidden']} ffn={meta['ffn']}, "
             f"fwd+bwd, {meta['device']}, {meta['processes']} processes ({meta['mode']}), {meta['dtype']}")
    notes = {r["variant"]: r["reasons"]["ms"] for r in result["rows"] if "ms" in r["reasons"]}
    _print_table(format_layer_rows(result), title)
    _mode_line(meta)
    print(f"checks: {meta['checks']}")
    print("spread: interquartile range of the steps, % of the median; ratios within it are noise")
    _footnote(notes)
    _write_md(args.md, title, format_layer_rows(result), meta, notes)
    if args.json:
        _write_json(result, args.json)
    return 0


def _comm(args: argparse.Namespace) -> int:
    from tpfuse.bench.comm import CommConfig, format_comm_rows, quick_comm_config, run_comm_bench

    _positive(args, "iters")
    _positive(args, "warmup", minimum=0)
    _check_outputs(args)
    for name in ("sizes", "sms"):
        for v in getattr(args, name) or ():
            if v < 1 or (name == "sizes" and v % 4):
                raise _UsageError(f"--{name}: {v} must be >= 1" + (" and a multiple of 4 bytes" if name == "sizes" else ""))
    for name in ("worker_sizes", "worker_chunks", "worker_ctas", "worker_inflight"):
        for v in getattr(args, name) or ():
            flag = "--" + name.replace("_", "-")
            if name == "worker_inflight" and (v & (v - 1) or not 256 <= v <= 65536):
                raise _UsageError(f"{flag}: {v} must be a power of two from 256 to 65536 bytes")
            if v < 1 or (name in ("worker_sizes", "worker_chunks") and v % 4):
                raise _UsageError(f"{flag}: {v} must be >= 1" + (" and a multiple of 4 bytes" if name != "worker_ctas" else ""))
    given = {k: v for k, v in {"sizes": tuple(args.sizes) if args.sizes else None,
                                "sms": tuple(args.sms) if args.sms else None, "iters": args.iters,
                                "warmup": args.warmup,
                                **{name: tuple(getattr(args, name)) if getattr(args, name) else None
                                   for name in ("worker_sizes", "worker_chunks", "worker_ctas", "worker_inflight")},
                                }.items() if v is not None}
    cfg = replace(quick_comm_config() if args.quick else CommConfig(), **given, device=args.device)
    if args.device == "cuda" and not _on_gpu(args):
        raise _UsageError("--device cuda: no CUDA GPU is visible on this machine")
    from tpfuse.console import Progress as _Progress, print_table as _print_table

    result = run_comm_bench(cfg, progress=_Progress("bench comm"))
    meta = result["meta"]
    title = f"tpfuse bench comm: {meta['device']}, {meta['num_gpus']} GPU(s), median of {cfg.iters} copies"
    notes = {f"{r['kind']}": r["reasons"]["latency_us"] for r in result["rows"] if r["reasons"]}
    _print_table(format_comm_rows(result), title)
    _footnote(notes)
    _write_md(args.md, title, format_comm_rows(result), meta, notes)
    if args.json:
        _write_json(result, args.json)
    return 0


# --------------------------------------------------------------------------------------------
# Parser
# --------------------------------------------------------------------------------------------


def _run(func):
    def run(args: argparse.Namespace) -> int:
        try:
            return func(args)
        except _UsageError as exc:
            print(f"tpfuse bench: {exc}", file=sys.stderr)
            return 2
    return run


def _setup(args: argparse.Namespace, default_world_size: int):
    """Where the ranks go, checked before anything starts (a request this machine cannot run is a usage error)."""
    from tpfuse.bench.common import plan_ranks

    try:
        return plan_ranks(args.world_size or default_world_size, args.device, args.bed or 0)
    except ValueError as exc:
        raise _UsageError(str(exc)) from None


def _ranks_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--quick", action="store_true", help="a small subset: seconds on CPU")
    p.add_argument("--world-size", type=int, default=None,
                   help="ranks (CPU: processes to spawn; GPU: GPUs to use; ignored under torchrun)")
    p.add_argument("--bed", type=int, default=0, metavar="W",
                   help="the one-GPU bed: W processes share cuda:0 over a gloo group (start MPS first); "
                        "timings are not multi-GPU timings")
    p.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    p.add_argument("--dtype", choices=["auto", "bf16", "fp16", "fp32", "fp8"], default="auto",
                   help="auto: bf16 on GPU, fp32 on CPU; fp8 (op bench only): e4m3 inputs, tensor-wise scales, "
                        "bf16 out, on the strategies whose dtype policy takes fp8")
    p.add_argument("--iters", type=int, default=None, help="timed calls per variant (median reported)")
    p.add_argument("--warmup", type=int, default=None, help="untimed calls first")
    p.add_argument("--scale", type=int, default=None, help="divide the Llama sizes by this (CPU runs)")
    p.add_argument("--strategies", nargs="+", default=None,
                   help="tpfuse strategies to time (default: every runnable one, and auto)")
    p.add_argument("--json", default=None, metavar="PATH", help="write the result as JSON (file, or a directory)")
    p.add_argument("--md", default=None, metavar="PATH", help="write the table as markdown, with date, hardware, "
                                                              "mode and command (for BENCHMARKS.md)")


def add_bench_parser(sub) -> argparse.ArgumentParser:
    """``bench`` with its ``layer`` and ``comm`` subcommands, on the CLI's subparsers ``sub``."""
    from tpfuse.bench.workloads import MODELS, PHASES

    bench = sub.add_parser("bench", help="time every runnable strategy on the workload matrix, with the overlap "
                                         "breakdown (JSON, table, PNG)",
                           description="Time every runnable strategy per workload cell against collective + "
                                       "torch.matmul, PyTorch async-TP, the GEMM and the collective alone. "
                                       "Subcommands: layer (a TP MLP block), comm (copy bandwidth).")
    _ranks_arguments(bench)
    bench.add_argument("--models", nargs="+", choices=sorted(MODELS), default=None)
    bench.add_argument("--phases", nargs="+", choices=list(PHASES), default=None)
    bench.add_argument("--out", dest="json", default=None, help=argparse.SUPPRESS)  # old name of --json
    bench.add_argument("--hardware", default="auto", help="planner profile for predicted_ms (auto: detected)")
    bench.add_argument("--no-graph", action="store_true", help="skip the CUDA-graph replay timing")
    bench.add_argument("--register-strategy", action="append", default=None, metavar="MODULE",
                       help="a strategy of your own: import MODULE (its declaration, docs/strategies.md) and "
                            "register it in every process first; repeatable")
    bench.add_argument("--png", default=None, metavar="PATH", help="bar chart of the speedups (needs matplotlib)")
    bench.add_argument("--timeline", default=None, metavar="PATH",
                       help="record the first cell's calls: PATH (.png) and PATH with .json (Chrome trace)")
    bench.set_defaults(func=_run(_ops))
    inner = bench.add_subparsers(dest="bench_command", required=False)

    layer = inner.add_parser("layer", help="a TP Llama MLP block fwd+bwd: tokens/s per rank vs unfused and async-TP")
    _ranks_arguments(layer)
    layer.add_argument("--model", choices=sorted(MODELS), default=None)
    layer.add_argument("--tokens", type=int, default=None, help="tokens per step, all ranks together")
    layer.add_argument("--no-asynctp", action="store_true", help="skip the torch.compile async-TP variant")
    layer.set_defaults(func=_run(_layer))

    comm = inner.add_parser("comm", help="copy bandwidth and latency vs bytes: copy engine and SM copies, per peer")
    comm.add_argument("--quick", action="store_true", help="three sizes, few SM counts")
    comm.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    comm.add_argument("--sizes", nargs="+", type=int, default=None, metavar="BYTES")
    comm.add_argument("--sms", nargs="+", type=int, default=None, metavar="N", help="SM counts of the SM copy kernel")
    comm.add_argument("--worker-sizes", nargs="+", type=int, default=None, metavar="BYTES",
                      help="sm_workers grid: total bytes copied")
    comm.add_argument("--worker-chunks", nargs="+", type=int, default=None, metavar="BYTES",
                      help="sm_workers grid: chunk bytes (one task each)")
    comm.add_argument("--worker-ctas", nargs="+", type=int, default=None, metavar="N",
                      help="sm_workers grid: worker CTAs (default 1 4 16 32)")
    comm.add_argument("--worker-inflight", nargs="+", type=int, default=None, metavar="BYTES",
                      help="sm_workers grid: bytes in flight per worker CTA (power of two, 256-65536)")
    comm.add_argument("--iters", type=int, default=None)
    comm.add_argument("--warmup", type=int, default=None)
    comm.add_argument("--json", default=None, metavar="PATH")
    comm.add_argument("--md", default=None, metavar="PATH", help="the table as markdown, with date and hardware")
    comm.set_defaults(func=_run(_comm))
    return bench
