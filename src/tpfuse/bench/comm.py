"""``tpfuse bench comm``: copy bandwidth and latency against chunk bytes, by copy engine and by SMs.

One process, every visible GPU (no process group): from GPU 0 to each peer GPU ``j``

* ``copy_engine``: ``dst.copy_(src)`` between devices (``cudaMemcpyPeerAsync``: copy engines, no SMs);
* ``sm_copy``: a Triton copy kernel with a grid of ``num_sms`` programs (one CTA per SM),
  launched on GPU 0 and storing into GPU ``j``'s memory (a push over NVLink, as the fused
  kernels' epilogues do), for ``num_sms`` in 1, 2, 4, ... up to the SM count;
* ``sm_workers``: the ``sm_workers`` strategy's worker kernel (tpfuse/kernels/sm_workers.py)
  launched on GPU ``j`` and pulling GPU 0's memory, as its ag_gemm workers do: bandwidth over
  the grid (chunk bytes: ``chunk_bytes``, worker CTAs: ``num_sms``, bytes in flight per worker:
  ``inflight_bytes``) for the ``worker_sizes`` totals.

With one GPU the copies are local (GPU 0 to GPU 0), labelled ``local_copy`` ("same device: SM
copy, not copy engine"), ``sm_copy`` and ``sm_workers`` to ``cuda:0`` with "same-GPU peer" in
the label (the bed's "peer" is the same GPU): they tell the one-GPU bed's cost, not NVLink's.
The sm_workers grid's axes are ``--worker-sizes``, ``--worker-chunks``, ``--worker-ctas`` and
``--worker-inflight``.
On CPU only ``host_copy`` rows are measured (``torch.Tensor.copy_`` in host memory);
the GPU kinds are rows with null numbers and a reason.

Per row: ``latency_us`` is the median time of one copy of ``bytes`` (CUDA events on the
destination's current stream around the single copy; ``perf_counter`` on CPU), ``gb_per_s`` =
``bytes / latency`` (bytes moved counted once: a local copy reads and writes them, twice that in
HBM traffic).  The JSON schema is in docs/bench.md ("tpfuse.bench.comm/2": /1 plus
``chunk_bytes`` and ``inflight_bytes``, null except in ``sm_workers`` rows).
"""

from __future__ import annotations

import statistics
import time
from dataclasses import asdict, dataclass, replace

import torch

from tpfuse.bench import common

__all__ = ["CommConfig", "run_comm_bench", "sm_copy", "format_comm_rows", "COMM_ROW_FIELDS", "SCHEMA", "quick_comm_config"]

SCHEMA = "tpfuse.bench.comm/2"
COMM_ROW_FIELDS = ("kind", "label", "src", "dst", "num_sms", "chunk_bytes", "inflight_bytes", "bytes", "latency_us",
                   "gb_per_s", "reasons")
_LOCAL_LABEL = "local (same device: SM copy, not copy engine)"


@dataclass(frozen=True)
class CommConfig:
    sizes: tuple[int, ...] = tuple(4**i * 2**16 for i in range(7))  # 64 KiB .. 256 MiB
    sms: tuple[int, ...] | None = None  # None: 1, 2, 4, ... and the SM count
    iters: int = 20
    warmup: int = 3
    device: str = "auto"
    # the sm_workers grid: total bytes, chunk bytes, worker CTAs (None: 1, 4, 16, 32), bytes in flight per CTA
    worker_sizes: tuple[int, ...] = (2**20, 2**24)
    worker_chunks: tuple[int, ...] = (2**12, 2**16, 2**20)
    worker_ctas: tuple[int, ...] | None = None
    worker_inflight: tuple[int, ...] = (2**12, 2**14, 2**16)


def quick_comm_config(**overrides) -> CommConfig:
    """``--quick``: three sizes (64 KiB, 1 MiB, 16 MiB), a few SM counts, few copies."""
    return replace(CommConfig(sizes=(2**16, 2**20, 2**24), sms=(1, 4, 16), iters=5, warmup=1, worker_sizes=(2**20,),
                              worker_chunks=(2**12, 2**16), worker_ctas=(1, 16), worker_inflight=(2**14,)), **overrides)


_SM_BLOCK = 4096  # int32 words per program per iteration (16 KiB)


def sm_copy(src: torch.Tensor, dst: torch.Tensor, num_sms: int) -> None:
    """Copy the int32 words of ``src`` into ``dst`` with a grid of ``num_sms`` programs."""
    from tpfuse.kernels.sm_copy import sm_copy_kernel  # decorated on first use (TRITON_INTERPRET is read then)

    if src.shape != dst.shape or src.dtype != torch.int32 or dst.dtype != torch.int32:
        raise ValueError(f"sm_copy: src and dst must be int32 vectors of one shape, got {src.dtype} {tuple(src.shape)} "
                         f"and {dst.dtype} {tuple(dst.shape)}")
    sm_copy_kernel[(num_sms,)](src, dst, src.numel(), BLOCK=_SM_BLOCK, num_warps=8)


def _triton_missing() -> str | None:
    try:
        import triton  # noqa: F401
    except ImportError:
        return "triton is not installed"
    return None


def _time_cuda(copy, device: torch.device, iters: int, warmup: int) -> float:
    """Median ms of one ``copy()``, events on ``device``'s current stream."""
    with torch.cuda.device(device):
        for _ in range(warmup):
            copy()
        torch.cuda.synchronize()
        times = []
        for _ in range(iters):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            copy()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
    return statistics.median(times)


def _time_host(copy, iters: int, warmup: int) -> float:
    for _ in range(warmup):
        copy()
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        copy()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def _row(kind: str, label: str, src: str, dst: str, num_sms: int | None, nbytes: int, ms: float | None,
         reason: str | None = None, chunk_bytes: int | None = None, inflight_bytes: int | None = None) -> dict:
    reasons = {} if reason is None else {"latency_us": reason, "gb_per_s": reason}
    return {"kind": kind, "label": label, "src": src, "dst": dst, "num_sms": num_sms, "chunk_bytes": chunk_bytes,
            "inflight_bytes": inflight_bytes, "bytes": nbytes,
            "latency_us": None if ms is None else ms * 1e3,
            "gb_per_s": None if not ms else nbytes / (ms / 1e3) / 1e9, "reasons": reasons}


def _sm_counts(cfg: CommConfig, num_sms: int) -> tuple[int, ...]:
    if cfg.sms is not None:
        return tuple(sorted({min(s, num_sms) for s in cfg.sms if s >= 1}))
    counts, s = [], 1
    while s < num_sms:
        counts.append(s)
        s *= 2
    return (*counts, num_sms)


def _cpu_rows(cfg: CommConfig) -> list[dict]:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # one memcpy thread, as the bench's ranks run (a shared box's pool thrashes)
    try:
        return _cpu_rows_one_thread(cfg)
    finally:
        torch.set_num_threads(threads)


def _cpu_rows_one_thread(cfg: CommConfig) -> list[dict]:
    rows = []
    for nbytes in cfg.sizes:
        src = torch.randint(-2**31, 2**31 - 1, (nbytes // 4,), dtype=torch.int32)
        dst = torch.empty_like(src)
        rows.append(_row("host_copy", "host memcpy (no GPU: not a copy-engine or NVLink number)", "cpu", "cpu", None,
                         nbytes, _time_host(lambda: dst.copy_(src), cfg.iters, cfg.warmup)))
        rows.append(_row("copy_engine", "copy engine", None, None, None, nbytes, None,
                         "no CUDA (copy-engine copies need GPUs)"))
        rows.append(_row("sm_copy", "SM copy", None, None, None, nbytes, None,
                         "no CUDA (the SM copy is a Triton kernel on a GPU)"))
    rows += [_row("sm_workers", "SM workers", None, None, None, nbytes, None,
                  "no CUDA (the sm_workers copy is a Triton kernel on a GPU)") for nbytes in cfg.worker_sizes]
    return rows


def _worker_ctas(cfg: CommConfig, num_sms: int) -> tuple[int, ...]:
    counts = cfg.worker_ctas if cfg.worker_ctas is not None else (1, 4, 16, 32)
    return tuple(sorted({min(c, num_sms) for c in counts if c >= 1}))


def _worker_rows(cfg: CommConfig, src_dev: torch.device, dst_dev: torch.device, num_sms: int) -> list[dict]:
    """The sm_workers grid from ``src_dev`` to ``dst_dev`` (launched on ``dst_dev``: a pull)."""
    from tpfuse.strategies.sm_workers import SmWorkersKnobs, make_copy

    local = src_dev == dst_dev
    where = " (same-GPU peer: the one-GPU bed, not a link)" if local else " (pull over the GPU link)"
    rows = []
    for nbytes in cfg.worker_sizes:
        words = max(1, nbytes // 4)
        src = torch.randint(-2**31, 2**31 - 1, (words,), dtype=torch.int32, device=src_dev)
        dst = torch.empty(words, dtype=torch.int32, device=dst_dev)
        for chunk in cfg.worker_chunks:
            for ctas in _worker_ctas(cfg, num_sms):
                for inflight in cfg.worker_inflight:
                    label = f"SM workers, {ctas} CTA(s), {inflight} B in flight each, chunks of {chunk} B{where}"
                    reason = _triton_missing()
                    ms = None
                    if reason is None:
                        try:
                            dst.fill_(0)
                            copy = make_copy(src, dst, chunk, SmWorkersKnobs(comm_sms=ctas, block_bytes=inflight))
                            ms = _time_cuda(copy, dst_dev, cfg.iters, cfg.warmup)
                            same = torch.equal(dst.to(src_dev), src)
                            reason = None if same else "the sm_workers copy wrote wrong data"
                        except Exception as exc:  # noqa: BLE001 - e.g. no peer access for the kernel
                            reason = common.short_reason(exc)
                    rows.append(_row("sm_workers", label, str(src_dev), str(dst_dev), ctas, words * 4,
                                     ms if reason is None else None, reason, chunk_bytes=chunk,
                                     inflight_bytes=inflight))
        del src, dst
    return rows


def _gpu_rows(cfg: CommConfig, progress=None) -> list[dict]:
    count = torch.cuda.device_count()
    src_dev = torch.device("cuda", 0)
    peers = [torch.device("cuda", j) for j in range(1, count)] or [src_dev]
    num_sms = torch.cuda.get_device_properties(0).multi_processor_count
    sm_counts = _sm_counts(cfg, num_sms)
    rows = []
    total, done = len(peers) * len(cfg.sizes), 0
    for dst_dev in peers:
        local = dst_dev == src_dev
        if not local:
            try:  # a copy each way turns peer access on for both contexts (the SM kernel needs it)
                torch.ones(1, device=dst_dev).copy_(torch.ones(1, device=src_dev))
                torch.ones(1, device=src_dev).copy_(torch.ones(1, device=dst_dev))
            except RuntimeError as exc:
                why = common.short_reason(exc)
                rows += [_row("copy_engine", "copy engine", str(src_dev), str(dst_dev), None, b, None, why)
                         for b in cfg.sizes]
                continue
        for nbytes in cfg.sizes:
            if progress is not None:
                progress(done, total, f"{src_dev} -> {dst_dev} {nbytes} B")
            done += 1
            words = max(1, nbytes // 4)
            src = torch.randint(-2**31, 2**31 - 1, (words,), dtype=torch.int32, device=src_dev)
            dst = torch.empty(words, dtype=torch.int32, device=dst_dev)
            kind, label = ("local_copy", _LOCAL_LABEL) if local else ("copy_engine", "copy engine (cudaMemcpyPeer)")
            ms = _time_cuda(lambda: dst.copy_(src), dst_dev, cfg.iters, cfg.warmup)
            rows.append(_row(kind, label, str(src_dev), str(dst_dev), None, words * 4, ms))
            for n in sm_counts:
                label = f"SM copy, {n} SM(s)" + (" (same-GPU peer: local)" if local else " (push over the GPU link)")
                if _triton_missing():
                    rows.append(_row("sm_copy", label, str(src_dev), str(dst_dev), n, words * 4, None,
                                     _triton_missing()))
                    continue
                try:
                    ms = _time_cuda(lambda n=n: sm_copy(src, dst, n), src_dev, cfg.iters, cfg.warmup)
                    reason = None if torch.equal(dst.to(src_dev), src) else "the SM copy wrote wrong data"
                except Exception as exc:  # noqa: BLE001 - e.g. no peer access for the kernel
                    ms, reason = None, common.short_reason(exc)
                rows.append(_row("sm_copy", label, str(src_dev), str(dst_dev), n, words * 4,
                                 ms if reason is None else None, reason))
            del src, dst
        rows += _worker_rows(cfg, src_dev, dst_dev, num_sms)
    return rows


def run_comm_bench(cfg: CommConfig, progress=None) -> dict:
    """Every copy kind at every size (and SM count); returns ``{"schema", "meta", "rows"}``."""
    if any(b < 4 or b % 4 for b in cfg.sizes):
        raise ValueError(f"sizes: every size must be a positive multiple of 4 bytes, got {list(cfg.sizes)}")
    if any(b < 4 or b % 4 for b in cfg.worker_sizes) or any(c < 4 or c % 4 for c in cfg.worker_chunks):
        raise ValueError(f"worker_sizes / worker_chunks: positive multiples of 4 bytes, got {list(cfg.worker_sizes)} "
                         f"and {list(cfg.worker_chunks)}")
    for b in cfg.worker_inflight:   # SmWorkersKnobs.block_bytes
        if b & (b - 1) or not 256 <= b <= 65536:
            raise ValueError(f"worker_inflight: {b} must be a power of two from 256 to 65536 bytes")
    cuda = cfg.device != "cpu" and torch.cuda.is_available()
    if cfg.device == "cuda" and not cuda:
        raise ValueError("--device cuda: no CUDA GPU is visible on this machine")
    num_gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    mode = "cpu-gloo" if not cuda else ("multi-gpu" if num_gpus > 1 else "single-gpu")
    setup = common.RankSetup(1, "cuda" if cuda else "cpu", "none", mode, num_gpus)
    meta = common.bench_meta(setup, config=asdict(cfg), timing="one copy between CUDA events on the timing "
                             "device's current stream (perf_counter on CPU); median over iters; gb_per_s counts "
                             "the bytes once", sm_count=(torch.cuda.get_device_properties(0).multi_processor_count
                                                        if cuda else None))
    meta["backend"] = None  # one process, no process group
    meta["mode_note"] = {"cpu-gloo": "one process, no GPU: host memcpy only (not a GPU number)",
                         "single-gpu": "one GPU: local (same-device) copies, not NVLink",
                         "multi-gpu": "GPU 0 to each peer GPU over the GPU links"}[mode]
    rows = _gpu_rows(cfg, progress) if cuda else _cpu_rows(cfg)
    if progress is not None:
        progress(1, 1, "done")
    return {"schema": SCHEMA, "meta": meta, "rows": [{k: r[k] for k in COMM_ROW_FIELDS} for r in rows]}


def format_comm_rows(result: dict) -> list[list[str]]:
    table = [["kind", "src -> dst", "SMs", "chunk B", "in flight B", "bytes", "latency us", "GB/s"]]
    for r in result["rows"]:
        table.append([r["kind"], f"{r['src']} -> {r['dst']}" if r["src"] else "-", "-" if r["num_sms"] is None else str(r["num_sms"]),
                      "-" if r.get("chunk_bytes") is None else str(r["chunk_bytes"]),
                      "-" if r.get("inflight_bytes") is None else str(r["inflight_bytes"]),
                      str(r["bytes"]), "-" if r["latency_us"] is None else f"{r['latency_us']:.1f}",
                      "-" if r["gb_per_s"] is None else f"{r['gb_per_s']:.1f}"])
    return table
