"""``tpfuse demo | plan | bench | check``: parse arguments, build a config, call the library."""

from __future__ import annotations

import argparse
import sys

from tpfuse.console import Progress as _Progress, print_table as _print_table

__all__ = ["main"]



def _demo(args: argparse.Namespace) -> int:
    from tpfuse.demo import DemoConfig, format_table, run_demo

    for name in ("world_size", "scale", "repeats"):
        if getattr(args, name) < 1:
            return _usage_error(f"--{name.replace('_', '-')}: {getattr(args, name)} must be >= 1")
    if args.device == "cuda" and not _cuda():
        return _usage_error("--device cuda: no CUDA GPU is visible on this machine; use --device cpu "
                            "(or auto, which picks CPU ranks here)")

    config = DemoConfig(world_size=args.world_size, model=args.model, scale=args.scale, repeats=args.repeats,
                        device=args.device)
    rows = run_demo(config, progress=_Progress())
    where = "CUDA/NCCL" if rows and config.device != "cpu" and _cuda() else "CPU/gloo (timings are CPU timings)"
    _print_table(format_table(rows), f"tpfuse demo: Llama-3 {config.model} cells scaled 1/{config.scale}, "
                                     f"W={rows[0].world_size if rows else config.world_size}, {where}")
    print("timed as in production: per-call agreement round off (TPFUSE_DEBUG=0, as on NCCL); spread = "
          "interquartile range of the repeats, % of the median: ratios within it are noise")
    bad = [r for r in rows if not (r.max_rel_err < 1e-2)]
    if bad:
        print(f"FAILED: {len(bad)} row(s) off the float64 reference", file=sys.stderr)
        return 1
    print("all outputs match the float64 reference")
    return 0


def _usage_error(message: str) -> int:
    """One line on stderr and exit code 2, like argparse's own errors."""
    print(f"tpfuse: {message}", file=sys.stderr)
    return 2


def _cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def _check(args: argparse.Namespace) -> int:
    """Report the environment: versions, devices, and which strategies can run."""
    import platform

    import torch

    import tpfuse

    rows = [["item", "value"], ["tpfuse", tpfuse.__version__], ["python", platform.python_version()],
            ["torch", torch.__version__]]
    try:
        import triton

        rows.append(["triton", triton.__version__])
    except ImportError:
        rows.append(["triton", "not installed (fused strategies unavailable)"])
    from tpfuse import strategies

    rows.append(["strategies in this build", ", ".join(strategies.names())])
    if torch.cuda.is_available():
        rows.append(["gpus", f"{torch.cuda.device_count()} x {torch.cuda.get_device_name(0)}"])
    else:
        cpu = [s for s in strategies.names() if not strategies.info(s).symmetric_memory]
        rows.append(["gpus", f"none: CPU/gloo strategies only ({', '.join(cpu)})"])
    _print_table(rows, "tpfuse check")
    return 0


def _profiles_epilog() -> str:
    """``plan --help``'s list of the hardware profiles that ``--hardware`` takes."""
    from tpfuse.model.hardware import PROFILES

    width = max(len(name) for name in PROFILES)
    return "hardware profiles (--hardware):\n" + "\n".join(
        f"  {name.ljust(width)}  {p.description}" for name, p in PROFILES.items())


def _plan(run_plan_cli):
    """``tpfuse plan``, with ``--timeline``'s path checked before any planning or drawing."""
    def run(args: argparse.Namespace) -> int:
        from tpfuse._paths import output_path_error

        why = args.timeline and output_path_error("--timeline", args.timeline, (".png",))
        if why:
            print(f"tpfuse plan: {why}", file=sys.stderr)
            return 2
        return run_plan_cli(args)
    return run


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tpfuse", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    demo = sub.add_parser("demo", help="run the three ops on a scaled-down Llama workload, check and time them")
    demo.add_argument("--world-size", type=int, default=4, help="ranks to spawn (CPU) or GPUs to use (default 4)")
    demo.add_argument("--model", choices=["8b", "70b", "405b"], default="8b")
    demo.add_argument("--scale", type=int, default=8, help="divide M, N and K of the Llama cell by this (default 8)")
    demo.add_argument("--repeats", type=int, default=5, help="timed calls per strategy (median reported)")
    demo.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    demo.set_defaults(func=_demo)

    from tpfuse.report import add_plan_arguments, run_plan_cli

    plan = sub.add_parser("plan", help="predict and explain the strategy choice for a shape or the workload matrix",
                          epilog=_profiles_epilog(), formatter_class=argparse.RawDescriptionHelpFormatter)
    add_plan_arguments(plan)
    plan.set_defaults(func=_plan(run_plan_cli))

    from tpfuse.bench.cli import add_bench_parser

    add_bench_parser(sub)

    check = sub.add_parser("check", help="report versions, devices and runnable strategies")
    check.set_defaults(func=_check)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
