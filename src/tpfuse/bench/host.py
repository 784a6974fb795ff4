"""Host overhead of tpfuse's eager dispatch (issue 22.2): what one ``tpfuse.<op>`` call costs on
the host beyond calling its strategy directly.

    python -m tpfuse.bench.host [--device cuda] [--calls 2000] [--json out.json]
    python -m tpfuse.bench.host --bed 2 --strategies copy_engine fused --calls 200   # MPS first

(starts a one-rank process group when none is initialized; under ``torchrun`` it uses the
group it finds).  Or from code::

    from tpfuse.bench.host import measure_host_overhead
    row = measure_host_overhead("gemm_ar", strategy="unfused", m=128, n=256, k=256, device="cuda")
    row["overhead_us"]        # tpfuse.gemm_ar(...) minus strategies.unfused.gemm_ar(...) per call

Host time per call is the wall time of ``calls`` back-to-back calls divided by ``calls``, taken
before the device is synchronized: with tiny shapes the GPU runs ahead of nothing, so this is
the time the host spends issuing.  Each variant is timed ``rounds`` times, interleaved, and the
median kept.  Timed variants:

| key | what runs |
|---|---|
| ``tpfuse_us`` | ``tpfuse.<op>(a, b, strategy=s)``: validate (cached per shape), decide (cached per signature), dispatch |
| ``direct_us`` | ``tpfuse.strategies.<s>.<op>(a, b, ctx)``: the strategy's own launches and collectives |
| ``custom_op_us`` | ``torch.ops.tpfuse.<op>(a, b, group_name, s)``: the torch.library dispatcher path |
| ``bare_us`` | ``torch.matmul`` plus the plain collective in the input dtype (what users run today) |
| ``matmul_us`` | ``torch.matmul`` alone |

``overhead_us = tpfuse_us - direct_us`` is the number the 25 us budget is about.

With ``--bed W`` (copy_engine and fused by default, issue 34) every row also carries, measured
with the GPU kept busy ahead of the host (``torch.cuda._sleep`` queued first, so an eager call
that waited for the GPU would show it):

| key | what it is |
|---|---|
| ``host_ms_gpu_busy`` | host ms of ONE eager ``tpfuse.<op>`` call issued behind >= ``busy_ms`` (60) ms of queued GPU work |
| ``host_us`` | host us per call of ``busy_calls`` back-to-back calls, the GPU busy ahead throughout |
| ``gpu_stayed_busy`` | the queued GPU work had not finished when the host was done (else the figures include waiting for it) |
| ``round_host_us`` | ``host_us`` of each round |
| ``host_us_vs_asynctp`` | ag_gemm / gemm_rs: median over rounds of ``host_us`` / async-TP's ``host_us`` in the same round |
| ``asynctp_host_us`` | async-TP's ``host_us`` from those rounds |
| ``host_us_vs_gemm_rs`` | gemm_ar (M divisible by W): median over rounds of ``host_us`` / the same strategy's gemm_rs ``host_us`` on the same inputs in the same round |
| ``gemm_rs_host_us`` | that gemm_rs's ``host_us`` from those rounds |

``--profile N`` adds ``profile`` to every tpfuse row: the functions that take the most host
time in N eager ``tpfuse.<op>`` calls under ``cProfile`` (with ``--bed``, the GPU busy ahead), each
with its calls, own time and cumulative time per op call (cProfile's own cost inflates Python
frames, not native calls: read it for where time goes, and the figures above for how much).

and rows of ``strategy = "asynctp"`` give the same figures for PyTorch's async-TP ops
(``torch.ops.symm_mem.fused_all_gather_matmul`` / ``fused_matmul_reduce_scatter``).  The busy-ahead
figures of one op are taken interleaved (:func:`measure_busy_ahead_interleaved`): every round times
each strategy and async-TP once, in a rotating order, so the bed's drifting host load (W processes
and MPS share it; async-TP's own figure moved 2x between two runs on one day) hits all alike, and
the ratio is taken per round.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from typing import Callable

import torch
import torch.distributed as dist

from tpfuse import dtypes

__all__ = ["measure_host_overhead", "measure_busy_ahead", "measure_busy_ahead_interleaved", "profile_calls",
           "ratio_per_round", "gemm_rs_partners", "attach_gemm_rs_ratios", "main"]


def _per_call_us(fn: Callable[[], object], calls: int, sync: Callable[[], None]) -> float:
    sync()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    elapsed = time.perf_counter() - t0
    sync()
    return elapsed / calls * 1e6


def _sleep_cycles_per_ms() -> float:
    """``torch.cuda._sleep`` cycles per millisecond on the current device (timed once)."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda._sleep(1000)
    cycles = 20_000_000
    start.record()
    torch.cuda._sleep(cycles)
    end.record()
    end.synchronize()
    return cycles / max(start.elapsed_time(end), 1e-3)


def measure_busy_ahead(fn: Callable[[], object], *, calls: int = 20, rounds: int = 5, busy_ms: float = 60.0,
                       barrier: Callable[[], None] = lambda: None) -> dict:
    """Host time of ``fn()`` (an eager call) with the GPU busy ahead: ``host_ms_gpu_busy`` (one
    call behind ``busy_ms`` of queued GPU work) and ``host_us`` (per call, ``calls`` calls
    behind ``busy_ms`` + 2 ms per call), medians over ``rounds``; ``gpu_stayed_busy``: the
    queued work was still running when the host was done, in every round.  ``barrier`` lines
    the ranks up before each round (every rank of a collective ``fn`` must call this)."""
    return measure_busy_ahead_interleaved({"fn": fn}, calls=calls, rounds=rounds, busy_ms=busy_ms,
                                          barrier=barrier)["fn"]


def measure_busy_ahead_interleaved(fns: dict[str, Callable[[], object]], *, calls: int = 20, rounds: int = 5,
                                   busy_ms: float = 60.0, barrier: Callable[[], None] = lambda: None,
                                   reference: str | None = None) -> dict[str, dict]:
    """:func:`measure_busy_ahead` of several eager calls, interleaved: every round times each of
    ``fns`` once (one call, then ``calls`` calls, each behind its own queued GPU work), in an
    order that rotates from round to round, so that drift of the host's load (the one-GPU bed's
    host is shared by W processes and MPS) hits every variant alike.  Returns per key the
    figures of :func:`measure_busy_ahead` plus ``round_host_us`` (each round's value) and, for
    every key but ``reference``, ``host_us_ratio``: the median over rounds of its ``host_us``
    divided by the reference's in the same round (``reference_host_us``: the reference's median).
    Every rank of a collective ``fn`` must call this with the same keys in the same order."""
    if calls < 1 or rounds < 1:
        raise ValueError(f"calls, rounds: {calls}, {rounds} must be >= 1")
    if reference is not None and reference not in fns:
        raise ValueError(f"reference: {reference!r} is not one of {list(fns)}")
    per_ms = _sleep_cycles_per_ms()
    keys = list(fns)
    one: dict[str, list[float]] = {key: [] for key in keys}
    each: dict[str, list[float]] = {key: [] for key in keys}
    busy = {key: True for key in keys}
    for r in range(rounds):
        for key in keys[r % len(keys):] + keys[:r % len(keys)]:
            for n, ahead, out in ((1, busy_ms, one[key]), (calls, busy_ms + 2.0 * calls, each[key])):
                torch.cuda.synchronize()
                barrier()
                torch.cuda._sleep(int(ahead * per_ms))
                queued = torch.cuda.Event()
                queued.record()
                t0 = time.perf_counter()
                for _ in range(n):
                    fns[key]()
                elapsed = time.perf_counter() - t0
                busy[key] = busy[key] and not queued.query()
                out.append(elapsed / n)
    torch.cuda.synchronize()
    rows = {key: {"host_ms_gpu_busy": statistics.median(one[key]) * 1e3, "host_us": statistics.median(each[key]) * 1e6,
                  "round_host_us": [round(v * 1e6, 2) for v in each[key]], "gpu_stayed_busy": busy[key],
                  "busy_ms": busy_ms, "busy_calls": calls} for key in keys}
    if reference is not None:
        for key in keys:
            if key != reference:
                rows[key]["host_us_ratio"] = ratio_per_round(each[key], each[reference])
                rows[key]["reference_host_us"] = rows[reference]["host_us"]
    return rows


def profile_calls(fn: Callable[[], object], calls: int, *, top: int = 12) -> list[dict]:
    """``cProfile`` of ``calls`` calls of ``fn``: the ``top`` functions by own time, each as
    ``{"function", "calls", "self_us", "cum_us"}`` per call of ``fn`` (``function``: the file from
    its package on, line, name; or the built-in's name)."""
    import cProfile
    import pstats

    if calls < 1:
        raise ValueError(f"calls: {calls} must be >= 1")
    prof = cProfile.Profile()
    prof.enable()
    try:
        for _ in range(calls):
            fn()
    finally:
        prof.disable()
    stats = pstats.Stats(prof).stats   # (file, line, name) -> (primitive calls, calls, own s, cumulative s, callers)
    ranked = sorted(stats.items(), key=lambda item: item[1][2], reverse=True)[:top]
    out = []
    for (path, line, name), (_, ncalls, own, cum, _) in ranked:
        where = name if path == "~" else f"{_short_path(path)}:{line}({name})"
        out.append({"function": where, "calls": ncalls / calls, "self_us": own / calls * 1e6,
                    "cum_us": cum / calls * 1e6})
    return out


def _short_path(path: str) -> str:
    """``path`` from its package on (``tpfuse/symm.py``, ``torch/cuda/streams.py``)."""
    parts = path.replace(os.sep, "/").split("/")
    for i in range(len(parts) - 1, -1, -1):
        if parts[i] in ("site-packages", "dist-packages", "src"):
            return "/".join(parts[i + 1:])
    return "/".join(parts[-2:])


def ratio_per_round(values: list[float], reference: list[float]) -> float:
    """Median over rounds of ``values[i] / reference[i]``: two variants timed in the same rounds,
    so that the host's drift between rounds cancels in each ratio."""
    if not values or len(values) != len(reference):
        raise ValueError(f"ratio_per_round: {len(values)} values for {len(reference)} reference rounds")
    return statistics.median(x / y for x, y in zip(values, reference))


def gemm_rs_partners(op: str, m: int, world_size: int, strategies: list[str],
                     gemm_rs: Callable[[str], object]) -> dict[str, Callable[[], object]]:
    """For gemm_ar with M divisible by W: each strategy's gemm_rs on the same inputs
    (``gemm_rs(strategy)`` makes the call), keyed ``"<strategy> gemm_rs"``, to be timed in the same
    rounds as the gemm_ar calls (:func:`attach_gemm_rs_ratios`); else none."""
    if op != "gemm_ar" or m % world_size:
        return {}
    return {f"{s} gemm_rs": (lambda s=s: gemm_rs(s)) for s in strategies}


def attach_gemm_rs_ratios(op_rows: dict[str, dict], busy: dict[str, dict]) -> None:
    """Each gemm_ar row's ``host_us_vs_gemm_rs`` and ``gemm_rs_host_us`` from its partner's
    rounds in ``busy`` (:func:`measure_busy_ahead_interleaved`'s result), the partners dropped."""
    for key in [k for k in busy if k.endswith(" gemm_rs")]:
        partner = busy.pop(key)
        strategy = key[:-len(" gemm_rs")]
        if strategy in busy and strategy in op_rows:
            op_rows[strategy]["host_us_vs_gemm_rs"] = ratio_per_round(busy[strategy]["round_host_us"],
                                                                      partner["round_host_us"])
            op_rows[strategy]["gemm_rs_host_us"] = partner["host_us"]


def measure_host_overhead(op: str = "gemm_ar", *, strategy: str = "unfused", m: int = 128, n: int = 256,
                          k: int = 256, dtype: torch.dtype = dtypes.default("cuda"), device: str = "cuda",
                          group: dist.ProcessGroup | None = None, calls: int = 2000, rounds: int = 5,
                          warmup: int = 100) -> dict:
    """Per-call host time (us) of ``tpfuse.<op>`` against calling its strategy directly.

    ``m`` is the full M (``ag_gemm``'s shard is ``m / W`` rows); ``n``, ``k`` local.  Needs an
    initialized process group (``group``, default WORLD); every rank of it must call this.
    Returns a dict with the keys of the module docstring plus the call's description.
    """
    import tpfuse
    from tpfuse import strategies
    from tpfuse._dist import all_gather_rows, group_context, reduce_scatter_rows

    if op not in ("ag_gemm", "gemm_rs", "gemm_ar"):
        raise ValueError(f"op: unknown op {op!r}; use ag_gemm, gemm_rs or gemm_ar")
    if calls < 1 or rounds < 1:
        raise ValueError(f"calls, rounds: {calls}, {rounds} must be >= 1")
    dev = torch.device(device)
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError("device: 'cuda' but no CUDA GPU is visible; pass device='cpu'")
        sync = torch.cuda.synchronize
    else:
        def sync() -> None:
            return None
    ctx = group_context(group)
    w = ctx.world_size
    if op != "gemm_ar" and m % w:
        raise ValueError(f"m: {m} must be divisible by the world size {w} for {op}")
    rows = m // w if op == "ag_gemm" else m
    a = torch.randn(rows, k, device=dev, dtype=dtype)
    b = torch.randn(n, k, device=dev, dtype=dtype).t()  # a weight.t() view, as layers pass it
    public = getattr(tpfuse, op)
    module = strategies.get(strategy)
    direct = getattr(module, op)
    custom = getattr(torch.ops.tpfuse, op)

    def bare() -> object:
        if op == "ag_gemm":
            full = torch.empty(m, k, device=dev, dtype=dtype)
            if w > 1:
                all_gather_rows(full, a, ctx.group)
            return torch.matmul(full, b)
        c = torch.matmul(a, b)
        if w == 1:
            return c
        if op == "gemm_rs":
            out = torch.empty(m // w, n, device=dev, dtype=dtype)
            reduce_scatter_rows(out, c, ctx.group)
            return out
        dist.all_reduce(c, group=ctx.group)
        return c

    variants = {
        "tpfuse_us": lambda: public(a, b, group, strategy=strategy),
        "direct_us": lambda: direct(a, b, ctx),
        "custom_op_us": lambda: custom(a, b, ctx.group_name, strategy),
        "bare_us": bare,
        "matmul_us": lambda: torch.matmul(a, b),
    }
    reasons = {}
    if w > 1 and dev.type == "cuda" and ctx.backend == "gloo":   # the one-GPU bed
        del variants["bare_us"]
        reasons["bare_us"] = "a gloo group cannot carry CUDA tensors (the one-GPU bed)"
    with torch.no_grad():
        for fn in variants.values():
            for _ in range(warmup):
                fn()
        samples: dict[str, list[float]] = {key: [] for key in variants}
        for _ in range(rounds):  # interleaved, so that clock and load drift hit every variant alike
            for key, fn in variants.items():
                samples[key].append(_per_call_us(fn, calls, sync))
    row = {key: statistics.median(v) for key, v in samples.items()}
    row.update({key: None for key in reasons}, reasons=reasons)
    row["overhead_us"] = row["tpfuse_us"] - row["direct_us"]
    row["dispatcher_us"] = row["custom_op_us"] - row["direct_us"]
    row.update(op=op, strategy=strategy, m=m, n=n, k=k, dtype=str(dtype).removeprefix("torch."),
               device=str(dev), world_size=w, backend=ctx.backend, calls=calls, rounds=rounds,
               torch=torch.__version__,
               device_name=torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu")
    return row


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tpfuse.bench.host", description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--ops", nargs="+", default=["ag_gemm", "gemm_rs", "gemm_ar"])
    parser.add_argument("--strategies", nargs="+", default=["unfused", "ring"])
    parser.add_argument("--m", type=int, default=128)
    parser.add_argument("--n", type=int, default=256)
    parser.add_argument("--k", type=int, default=256)
    parser.add_argument("--calls", type=int, default=2000)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--bed", type=int, default=0, metavar="W",
                        help="W processes on cuda:0 with a gloo group (the one-GPU bed, for copy_engine/fused; "
                             "start MPS first): host times only, not multi-GPU timings")
    parser.add_argument("--busy-calls", type=int, default=20,
                        help="--bed: calls timed back to back behind queued GPU work (host_us)")
    parser.add_argument("--profile", type=int, default=0, metavar="N",
                        help="add each tpfuse row's cProfile of N eager calls (the functions with the most own time)")
    parser.add_argument("--json", help="write the rows here")
    args = parser.parse_args(argv)
    if args.profile < 0:
        parser.error(f"--profile: {args.profile} must be >= 0")
    if args.bed and args.strategies == ["unfused", "ring"]:   # the bed is for the symmetric-memory strategies
        args.strategies = ["copy_engine", "fused"]
    args.command = " ".join(["python -m tpfuse.bench.host", *(sys.argv[1:] if argv is None else argv)])
    if args.bed:
        try:
            return _main_bed(args)
        except ValueError as exc:   # a request this machine cannot run: one line, not a traceback
            print(f"python -m tpfuse.bench.host: {exc}", file=sys.stderr)
            return 2
    if not dist.is_initialized():
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", "29517")
        dist.init_process_group("nccl" if args.device.startswith("cuda") else "gloo", rank=0, world_size=1)
    dtype = dtypes.default("cuda" if args.device.startswith("cuda") else "cpu")
    rows = [measure_host_overhead(op, strategy=s, m=args.m, n=args.n, k=args.k, dtype=dtype,
                                  device=args.device, calls=args.calls, rounds=args.rounds)
            for op in args.ops for s in args.strategies]
    if args.profile:
        import tpfuse

        for row in rows:
            w = row["world_size"]
            a = torch.randn(row["m"] // w if row["op"] == "ag_gemm" else row["m"], row["k"], device=args.device,
                            dtype=dtype)
            b = torch.randn(row["n"], row["k"], device=args.device, dtype=dtype).t()
            fn = getattr(tpfuse, row["op"])
            with torch.no_grad():
                row["profile"] = profile_calls(lambda: fn(a, b, strategy=row["strategy"]), args.profile)
    if dist.get_rank() == 0:
        _report(rows, args.json, {"command": args.command, "mode": "one rank", "backend": dist.get_backend()})
    return 0


def _bed_rows(rank: int, world_size: int, args: argparse.Namespace) -> list[dict]:
    import tpfuse

    dev = torch.device("cuda", torch.cuda.current_device())
    rows = []
    for op in args.ops:
        m = args.m
        a = torch.randn(m // world_size if op == "ag_gemm" else m, args.k, device=dev, dtype=dtypes.default("cuda"))
        b = torch.randn(args.n, args.k, device=dev, dtype=dtypes.default("cuda")).t()
        fn = getattr(tpfuse, op)
        busy_fns, op_rows = {}, {}
        for s in args.strategies:
            op_rows[s] = measure_host_overhead(op, strategy=s, m=m, n=args.n, k=args.k, dtype=dtypes.default("cuda"),
                                               device="cuda", calls=args.calls, rounds=args.rounds, warmup=10)
            busy_fns[s] = lambda s=s: fn(a, b, strategy=s)
        if op in ("ag_gemm", "gemm_rs"):
            op_rows["asynctp"], theirs = _asynctp_row(op, a, b, world_size, args)
            if theirs is not None:
                busy_fns["asynctp"] = theirs
        # gemm_ar against gemm_rs in the same rounds too (issue 34: within 1.5x of it)
        busy_fns.update(gemm_rs_partners(op, m, world_size, args.strategies,
                                          lambda s: tpfuse.gemm_rs(a, b, strategy=s)))
        # every variant in the same rounds, rotated (the bed's host load drifts: async-TP's own
        # figure moved 2x between runs), and each tpfuse variant's ratio to async-TP per round
        with torch.no_grad():
            busy = measure_busy_ahead_interleaved(busy_fns, calls=args.busy_calls, rounds=args.rounds,
                                                  barrier=dist.barrier,
                                                  reference="asynctp" if "asynctp" in busy_fns else None)
        attach_gemm_rs_ratios(op_rows, busy)
        if args.profile:   # every rank the same calls, each behind queued GPU work
            with torch.no_grad():
                for key, call in busy_fns.items():
                    if key in op_rows and key != "asynctp":
                        op_rows[key]["profile"] = _profile_busy(call, args.profile)
        for key, row in op_rows.items():
            got = busy.get(key, {})
            if "host_us_ratio" in got:
                got["host_us_vs_asynctp"] = got.pop("host_us_ratio")
                got["asynctp_host_us"] = got.pop("reference_host_us")
            row.update(got)
            rows.append(row)
    return rows


def _profile_busy(fn: Callable[[], object], calls: int) -> list[dict]:
    """:func:`profile_calls` of ``fn`` with the GPU busy ahead (60 ms + 2 ms per call queued
    first), every rank lined up first (``fn`` is collective)."""
    torch.cuda.synchronize()
    dist.barrier()
    torch.cuda._sleep(int((60.0 + 2.0 * calls) * _sleep_cycles_per_ms()))
    out = profile_calls(fn, calls)
    torch.cuda.synchronize()
    return out


def _asynctp_row(op: str, a: torch.Tensor, b: torch.Tensor, world_size: int, args: argparse.Namespace):
    """PyTorch's async-TP op for ``op``: its row (the busy-ahead figures are filled by the
    caller, which times it interleaved with ours) and the call, or None where it fails."""
    group_name = dist.group.WORLD.group_name
    if op == "ag_gemm":
        def fn():
            return torch.ops.symm_mem.fused_all_gather_matmul(a, [b], 0, group_name)
    else:
        def fn():
            return torch.ops.symm_mem.fused_matmul_reduce_scatter(a, b, "sum", 0, group_name)
    row = dict(op=op, strategy="asynctp", m=args.m, n=args.n, k=args.k,
               dtype=str(dtypes.default("cuda")).removeprefix("torch."), world_size=world_size,
               device="cuda", device_name=torch.cuda.get_device_name(), backend="gloo",
               **{key: None for key in ("tpfuse_us", "direct_us", "custom_op_us", "bare_us", "matmul_us",
                                         "overhead_us", "dispatcher_us")})
    ok = True
    try:
        with torch.no_grad():
            for _ in range(3):
                fn()
            torch.cuda.synchronize()
    except Exception as exc:   # noqa: BLE001 - a torch build without it: say so in the row
        row["reasons"] = {"host_us": f"async-TP failed: {type(exc).__name__}: {str(exc)[:200]}"}
        ok = False
    # the ranks agree on whether it runs (every rank must time the same variants)
    flag = torch.tensor([1 if ok else 0])
    dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    if not flag.item() and ok:
        row["reasons"] = {"host_us": "async-TP failed on another rank"}
    return row, (fn if flag.item() else None)


def _main_bed(args: argparse.Namespace) -> int:
    """Every rank measures; the row kept per (op, strategy) is the slowest rank's (by tpfuse_us)."""
    from tpfuse.bench import common

    setup = common.plan_ranks(args.bed, "cuda", args.bed)
    with common.open_ranks(setup) as ranks:
        per_rank = ranks.run(_bed_rows, args, timeout=1800)
    rows = [max(cands, key=lambda r: r.get("host_us") or r.get("tpfuse_us") or 0.0) for cands in zip(*per_rank)]
    _report(rows, args.json, {"command": args.command, "mode": "one-gpu-bed", "backend": "gloo",
                              "mps": common.mps_running(),
                              "note": "W processes share cuda:0: host times per eager call, not multi-GPU timings"})
    return 0


def _report(rows: list[dict], path: str | None, meta: dict) -> None:
    def us(v: float | None) -> str:
        return "      -" if v is None else f"{v:7.2f}"

    for r in rows:
        busy = ""
        if "host_us" in r:
            busy = (f"  | GPU busy ahead: one call {r['host_ms_gpu_busy']:.2f} ms, {r['host_us']:.1f} us/call"
                    f"{'' if r.get('gpu_stayed_busy') else ' (the GPU went idle: includes waiting)'}"
                    + (f", {r['host_us_vs_asynctp']:.2f}x async-TP's in the same rounds"
                       if r.get("host_us_vs_asynctp") is not None else "")
                    + (f", {r['host_us_vs_gemm_rs']:.2f}x its gemm_rs's in the same rounds"
                       if r.get("host_us_vs_gemm_rs") is not None else ""))
        print(f"{r['op']:8s} {r['strategy']:11s} W={r['world_size']} tpfuse {us(r['tpfuse_us'])} us  direct "
              f"{us(r['direct_us'])}  overhead {us(r['overhead_us'])}  custom op {us(r['custom_op_us'])}  "
              f"bare {us(r['bare_us'])}  matmul {us(r['matmul_us'])}{busy}", flush=True)
        for f in r.get("profile", [])[:6]:
            print(f"    {f['self_us']:8.1f} us own {f['cum_us']:8.1f} us cum {f['calls']:5.1f}x  {f['function']}",
                  flush=True)
    if path:
        import datetime

        meta = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                "device": rows[0]["device_name"] if rows else None, "torch": torch.__version__, **meta}
        with open(path, "w") as f:
            json.dump({"meta": meta, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    sys.exit(main())
