"""What the three benchmarks share: where the ranks come from, how a call is timed, the meta block.

Ranks (:func:`open_ranks`): under ``torchrun`` the processes already exist (one per GPU, NCCL);
otherwise the bench spawns them with :class:`tpfuse.spawn.RankPool` -- gloo ranks on CPU, one
NCCL rank per GPU, or (``bed=W``) W gloo ranks sharing ``cuda:0`` (the one-GPU bed).

Timing (DESIGN §7): a warm-up, then per timed call a barrier, a device synchronize, the call
between two CUDA events (GPU) or ``perf_counter`` stamps (CPU), and the host time until the call
returned; the variants of one cell take turns, one call each per round (:func:`timed_rounds`).
Per call the slowest rank's time; the median over calls.  A variant that raises on any
rank is not timed: every rank learns the first failing rank's reason (:func:`attempt`), and the
row says it instead of a number.
"""

from __future__ import annotations

import contextlib
import datetime
import os
import platform
import shlex
import statistics
import sys
import time
from dataclasses import dataclass, replace
from typing import Any, Callable, Iterator

import torch
import torch.distributed as dist

from tpfuse import dtypes

__all__ = ["MODES", "RankSetup", "open_ranks", "under_torchrun", "timed", "attempt", "graph_timed",
           "enable_symmetric_memory", "mps_running",
           "timed_rounds", "slowest_median", "spread_pct", "agreement_round", "checks_on", "bench_meta",
           "cpu_name", "short_reason"]

MODES = ("cpu-gloo", "single-gpu", "one-gpu-bed", "multi-gpu")
MODE_NOTES = {
    "cpu-gloo": "CPU processes on gloo: checks that everything runs; not GPU timings",
    "single-gpu": "one process on one GPU (world_size 1): no collective runs; GEMM and host costs only",
    "one-gpu-bed": "W processes sharing one GPU (MPS, symmetric memory, gloo group): "
                   "timings are NOT multi-GPU timings (same-device copies use SMs; ranks share the SMs)",
    "multi-gpu": "one process per GPU (NCCL): multi-GPU timings",
}
_RANK_ENV = {"TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NCCL_NVLS_ENABLE": "0",  # never NVLink multicast
             # Time what runs in production: no per-call agreement round (off by default on NCCL; on
             # by default for CPU tensors on gloo, where it would be inside every number).  Its cost
             # per call is measured on its own (agree_ms, :func:`agreement_round`).
             "TPFUSE_DEBUG": "0"}


def under_torchrun() -> bool:
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ and "LOCAL_RANK" in os.environ


@dataclass(frozen=True)
class RankSetup:
    """How the ranks of one bench run are placed (decided in the launching process)."""

    world_size: int
    device_type: str  # "cpu" | "cuda"
    backend: str  # "gloo" | "nccl"
    mode: str  # one of MODES
    num_gpus: int


# what the benches time: the dtypes of the policy's fast entries (float64 is for reference checks)
DTYPES = {dtypes.name(d): d for d in dtypes.inputs(dtypes.FAST)}
# the op bench also times fp8 cells (e4m3 inputs, tensor-wise scales, bf16 out) on the strategies
# whose policy entry takes fp8; the layer bench does not (its fp8 is a layer recipe)
OP_DTYPES = {**DTYPES, "fp8": dtypes.FP8.inputs[0]}


def setup_and_dtype(world_size: int, device: str, bed: int, dtype: str, ranks=None,
                    allowed: dict = DTYPES) -> tuple[RankSetup, str]:
    """:func:`plan_ranks` (the world size of ``ranks`` when an open set is reused) and the dtype
    name to time (one of ``allowed``): ``"auto"`` is bf16 on GPU, fp32 on CPU."""
    setup = plan_ranks(world_size, device, bed)
    if ranks is not None:
        setup = replace(setup, world_size=ranks.world_size)
    dtype = dtype if dtype != "auto" else dtypes.name(dtypes.default(setup.device_type))
    if dtype not in allowed:
        raise ValueError(f"dtype: {dtype!r} is not benchmarked here; use {', '.join(allowed)}")
    return setup, dtype


def plan_ranks(world_size: int, device: str, bed: int) -> RankSetup:
    """The placement for a requested world size, device ("auto" | "cpu" | "cuda") and bed size.

    Raises ``ValueError`` (one line, for the CLI) when the request cannot run here.
    """
    num_gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if bed:
        if bed < 2:
            raise ValueError(f"--bed: {bed} must be >= 2 (ranks sharing one GPU)")
        if num_gpus == 0:
            raise ValueError("--bed needs a CUDA GPU (W processes share cuda:0); this machine has none")
        if device == "cpu":
            raise ValueError("--bed runs on cuda:0; drop --device cpu")
        if under_torchrun():
            raise ValueError("--bed spawns its own processes on cuda:0; run it without torchrun")
        return RankSetup(bed, "cuda", "gloo", "one-gpu-bed", num_gpus)
    if under_torchrun():
        w = int(os.environ["WORLD_SIZE"])
        cuda = num_gpus > 0 and device != "cpu"
        return RankSetup(w, "cuda" if cuda else "cpu", "nccl" if cuda else "gloo",
                         ("multi-gpu" if w > 1 else "single-gpu") if cuda else "cpu-gloo", num_gpus)
    if device == "cuda" and num_gpus == 0:
        raise ValueError("--device cuda: no CUDA GPU is visible on this machine")
    if world_size < 1:
        raise ValueError(f"--world-size: {world_size} must be >= 1")
    if device != "cpu" and num_gpus > 0:
        w = min(world_size, num_gpus)
        return RankSetup(w, "cuda", "nccl", "multi-gpu" if w > 1 else "single-gpu", num_gpus)
    return RankSetup(world_size, "cpu", "gloo", "cpu-gloo", num_gpus)


class _TorchrunRanks:
    """The processes torchrun started: each runs the job itself, results are gathered to all."""

    def __init__(self, setup: RankSetup):
        self.world_size = setup.world_size
        self.rank = int(os.environ["RANK"])

    def run(self, fn: Callable[..., Any], *args: Any, timeout: float = 600.0) -> list[Any]:
        mine = fn(self.rank, self.world_size, *args)
        out: list[Any] = [None] * self.world_size
        dist.all_gather_object(out, mine)
        return out


class _PoolRanks:
    def __init__(self, pool):
        self.pool = pool
        self.world_size = pool.world_size
        self.rank = 0  # the launching process speaks for the pool

    def run(self, fn: Callable[..., Any], *args: Any, timeout: float = 600.0) -> list[Any]:
        return self.pool.run(fn, *args, timeout=timeout)


@contextlib.contextmanager
def open_ranks(setup: RankSetup) -> Iterator[Any]:
    """Ranks with ``.world_size``, ``.rank`` (0 speaks: prints and writes) and ``.run(fn, *args)``."""
    if under_torchrun():
        created = not dist.is_initialized()
        if created:
            os.environ.update({k: os.environ.get(k, v) for k, v in _RANK_ENV.items()})
            if setup.device_type == "cuda":
                torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
            dist.init_process_group(setup.backend)
        try:
            yield _TorchrunRanks(setup)
        finally:
            if created:
                dist.destroy_process_group()
        return
    from tpfuse.spawn import RankPool

    device = "cuda:0" if setup.mode == "one-gpu-bed" else None
    with RankPool(setup.world_size, backend=setup.backend, device=device, env=dict(_RANK_ENV)) as pool:
        yield _PoolRanks(pool)


# --------------------------------------------------------------------------------------------
# Timing
# --------------------------------------------------------------------------------------------


def short_reason(exc: BaseException) -> str:
    """``Type: first line`` of an exception, capped, for a row's ``reasons``."""
    first = (str(exc).strip().splitlines() or [""])[0]
    return f"{type(exc).__name__}: {first}"[:300]


def attempt(fn: Callable[[], object]) -> str | None:
    """Run ``fn`` once on every rank; None if it worked everywhere, else the first failing
    rank's reason (the same string on every rank, so every rank skips the variant together)."""
    try:
        fn()
        error = None
    except Exception as exc:  # noqa: BLE001 - any failure becomes the row's reason
        error = short_reason(exc)
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return error
    errors: list[str | None] = [None] * dist.get_world_size()
    dist.all_gather_object(errors, error)
    return next(((f"rank {r}: {e}") for r, e in enumerate(errors) if e is not None), None)


def enable_symmetric_memory(group_name: str) -> None:
    """Register the group with torch's symmetric memory: what PyTorch async-TP (the
    ``symm_mem`` ops, inductor's micro-pipeline TP pass) looks up for the group."""
    import warnings

    from torch.distributed import _symmetric_memory as symm_mem

    with warnings.catch_warnings():  # deprecated in torch >= 2.11, but still what that lookup reads
        warnings.simplefilter("ignore")
        symm_mem.enable_symm_mem_for_group(group_name)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _barrier(device: torch.device) -> None:
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()
    _sync(device)


def _one_call(fn: Callable[[int], object], i: int, device: torch.device) -> tuple[float, float]:
    """(ms, host ms until return) of ``fn(i)``, after a barrier."""
    _barrier(device)
    if device.type == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        t0 = time.perf_counter()
        fn(i)
        host = (time.perf_counter() - t0) * 1e3
        end.record()
        end.synchronize()
        return start.elapsed_time(end), host
    t0 = time.perf_counter()
    fn(i)
    ms = (time.perf_counter() - t0) * 1e3
    return ms, ms


def timed_rounds(fns: dict[str, Callable[[int], object]], iters: int, warmup: int,
                 device: torch.device) -> dict[str, tuple[list[float], list[float]]]:
    """This rank's per-call ms and host ms (until the call returned) of every ``fns[name](c)``,
    ``c`` the call's number (which input copy it takes).

    Interleaved: round i calls every variant once, so a slow spell of the machine (a shared
    CPU, a GPU's power cap) lands on all of them instead of on whichever was timed then; the
    ratios between variants are what the bench reports.  Round i starts at variant i (mod the
    number of variants), so no variant is always the one right after the same neighbour.
    """
    # ``fn(c)`` with c counting every call of the round robin: consecutive calls -- of different
    # variants -- take different input copies, so none finds the previous call's inputs in L2.
    for fn in fns.values():
        for i in range(warmup):
            fn(i)
    out: dict[str, tuple[list[float], list[float]]] = {name: ([], []) for name in fns}
    items = list(fns.items())
    for i in range(iters):
        start = i % len(items) if items else 0
        for j, (name, fn) in enumerate(items[start:] + items[:start]):
            ms, host = _one_call(fn, i * len(fns) + j, device)
            out[name][0].append(ms)
            out[name][1].append(host)
    return out


def timed(fn: Callable[[int], object], iters: int, warmup: int, device: torch.device) -> tuple[list[float], list[float]]:
    """:func:`timed_rounds` of one variant."""
    return timed_rounds({"fn": fn}, iters, warmup, device)["fn"]


def graph_timed(fn: Callable[[int], object], iters: int, device: torch.device) -> tuple[list[float] | None, str | None]:
    """Per-replay ms of ``fn(0)`` captured in a CUDA graph, or (None, reason).  Every rank
    captures (collectives inside are captured on every rank) and agrees on failure."""
    if device.type != "cuda":
        return None, "no CUDA (graphs need a GPU)"
    graph = torch.cuda.CUDAGraph()

    def capture() -> None:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # warm-up off the default stream, as torch.cuda.graphs asks
            fn(0)
        torch.cuda.current_stream().wait_stream(side)
        torch.cuda.synchronize(device)
        with torch.cuda.graph(graph):
            fn(0)
        graph.replay()
        torch.cuda.synchronize(device)

    reason = attempt(capture)
    if reason is not None:
        return None, f"CUDA graph capture failed: {reason}"
    out = []
    for _ in range(iters):
        _barrier(device)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        out.append(start.elapsed_time(end))
    del graph
    return out, None


def slowest_median(per_rank: list[list[float]]) -> float:
    """Median over calls of the slowest rank's time of each call."""
    return statistics.median(max(times[j] for times in per_rank) for j in range(len(per_rank[0])))


def spread_pct(per_rank: list[list[float]]) -> float | None:
    """The noise band of :func:`slowest_median`: the interquartile range of the slowest rank's
    per-call times, in percent of their median (None with fewer than 4 calls).  Two variants
    whose medians differ by less than their spreads are not told apart by this run."""
    calls = sorted(max(times[j] for times in per_rank) for j in range(len(per_rank[0])))
    if len(calls) < 4:
        return None
    q1, _, q3 = statistics.quantiles(calls, n=4, method="inclusive")
    median = statistics.median(calls)
    return 100.0 * (q3 - q1) / median if median > 0 else None


def agreement_round(op: str, a: torch.Tensor, b: torch.Tensor, **scaled) -> Callable[[int], None]:
    """One per-call agreement round of ``op`` on ``(a, b)`` (every rank, default group): what
    ``TPFUSE_DEBUG=1`` -- the default for CPU tensors on gloo -- adds to every call.  ``scaled``:
    ``scale_a``, ``scale_b``, ``out_dtype`` of an fp8 call."""
    from tpfuse import _checks
    from tpfuse._dist import group_context

    ctx = group_context(None)
    sig = _checks.call_signature(op, "auto", a, b, **scaled)
    return lambda i: _checks.agree(ctx, op, None, sig)


def checks_on(device: torch.device) -> str:
    """What this rank's tpfuse calls check per call, in words (for the meta block)."""
    from tpfuse import _checks
    from tpfuse._dist import group_context

    setting = os.environ.get("TPFUSE_DEBUG")
    source = f"TPFUSE_DEBUG={setting}" if setting is not None else "TPFUSE_DEBUG unset: the default"
    if _checks.agreement_enabled(group_context(None), device.type):
        return f"per-call agreement round ON ({source}): inside every tpfuse time (agree_ms is its cost)"
    return (f"per-call agreement round off ({source}), as on NCCL; validation of each new call shape and "
            "one agreement round per new signature (warm-up) stay on; agree_ms is what the round would add")


# --------------------------------------------------------------------------------------------
# Meta
# --------------------------------------------------------------------------------------------


def cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _command_line() -> str:
    """The command as typed: ``python -m tpfuse ...`` / ``tpfuse ...`` / ``script.py ...``."""
    prog = sys.argv[0] if sys.argv else ""
    if prog.endswith(os.path.join("tpfuse", "__main__.py")):
        head = ["python", "-m", "tpfuse"]
    else:
        head = [os.path.basename(prog) or "python"]
    return shlex.join([*head, *sys.argv[1:]])


def mps_running() -> bool:
    """Whether an MPS control daemon's pipe is there (``$CUDA_MPS_PIPE_DIRECTORY``, default
    /tmp/nvidia-mps): a hint for the bed, whose processes time-slice the GPU without MPS."""
    pipe_dir = os.environ.get("CUDA_MPS_PIPE_DIRECTORY", "/tmp/nvidia-mps")
    return os.path.exists(os.path.join(pipe_dir, "control"))


def bench_meta(setup: RankSetup, **extra: Any) -> dict:
    """What machine and software a result came from, and what kind of number it is."""
    import tpfuse

    gpu = torch.cuda.get_device_name(0) if setup.device_type == "cuda" else None
    meta = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "host": platform.node(),
        "device": gpu or f"CPU: {cpu_name()}",
        "gpu": gpu,
        "num_gpus": setup.num_gpus,
        "cpu_count": os.cpu_count(),
        "processes": setup.world_size,
        "world_size": setup.world_size,
        "backend": setup.backend,
        "mode": setup.mode,
        "mode_note": MODE_NOTES[setup.mode],
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "triton": None,
        "tpfuse": tpfuse.__version__,
        "command": _command_line(),
    }
    try:
        import triton

        meta["triton"] = triton.__version__
    except ImportError:
        pass
    if setup.mode == "one-gpu-bed":
        meta["mps"] = mps_running()
    meta.update(extra)
    return meta
