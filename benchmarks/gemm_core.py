"""GEMM core vs cuBLAS on the per-rank Llama-3 shapes at TP W=8, plus hook overhead.

    PYTHONUNBUFFERED=1 python benchmarks/gemm_core.py --out benchmarks/results

For each shape: tune the candidate configs of ``tpfuse.gemm.candidate_configs`` (each
checked against cuBLAS first), pick per hook the re-timed leader fastest with it (as
``tpfuse.gemm.tune`` does: ``hook_winners``; ``wait_config`` / ``epilogue_config`` in the
row), then time the best config, ``torch.matmul`` (cuBLAS), and the hooks' configs with hooks
on (signals pre-set) in one run: ``triton.testing.do_bench`` median,
random data, inputs rotated over enough copies to exceed L2 (do_bench also flushes L2).
Writes ``gemm_core_h200.json`` (``--name`` changes it) and prints a short table last. Each row
names the kernel that ran the plain call and each hook (``plain_kernel``, ``wait_kernel``,
``epilogue_kernel``: "gemm_kernel", "gemm_ws" or, plain fp8 calls only, "gemm_pp"); the plain
call runs gemm_ws where the tuner kept a ``GemmConfig(gluon=True)`` (fp8 on sm_90; "ws" in the
table's config column) and gemm_pp where it kept one with ``pingpong=True`` ("pp").

Hooks: ``wait`` is the wait hook as fused ``ag_gemm`` runs it (round order, signals pre-set);
``epilogue`` the epilogue hook as fused ``gemm_rs`` / ``gemm_ar`` run it (owner order, each
chunk's rows to a destination of its own, no signals: READY follows the launch);
``epilogue_signalled`` the same with per-chunk signals (each tile counted, each chunk
published), which no strategy uses now (it runs the epilogue hook's config). ``*_overhead``:
against the plain call of the best config (what a hooked call costs over the plain GEMM);
``*_hook_*`` columns: against the hook's config in the same tile order without the hook
(``round_order`` / ``owner_order``), timed back to back (TIMING_PAIRS): the hook alone.

``--dtype fp8``: e4m3 operands (``b = weight.t()``), bf16 output, scales tensor-wise and
row-wise (``--scaling``; one row per shape and scaling, named ``<shape>-tensorwise`` /
``-rowwise``), against ``torch._scaled_mm(..., use_fast_accum=True)`` (cuBLASLt; the core
accumulates fp8 products the same way) in the "cublas" columns: ``graph_ratio`` =
``torch._scaled_mm`` time / ours. Writes ``gemm_core_fp8_h200.json`` unless ``--name`` says.
"""
from __future__ import annotations

import argparse
import datetime
import json
import math
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
from tpfuse import gemm as gc  # noqa: E402
from tpfuse.kernels import abi  # noqa: E402

MODELS = {"8B": (4096, 14336), "70B": (8192, 28672), "405B": (16384, 53248)}
WORLD_SIZE = 8
M_VALUES = (("train", 16384), ("prefill", 4096), ("train_chunk", 16384 // WORLD_SIZE),
            ("prefill_chunk", 4096 // WORLD_SIZE), ("decode", 128))
L2_BYTES = 60 * 2**20   # H200: 60 MB L2 read off torch.cuda.get_device_properties (KINDS.md, 2026-10-28)


@dataclass(frozen=True)
class Shape:
    name: str
    phase: str
    m: int
    n: int
    k: int


def shapes(quick: bool) -> list[Shape]:
    out = []
    for model, (h, ffn) in MODELS.items():
        for phase, m in M_VALUES:
            out.append(Shape(f"{model}-fc1-{phase}", phase, m, 2 * ffn // WORLD_SIZE, h))
            out.append(Shape(f"{model}-fc2-{phase}", phase, m, h, ffn // WORLD_SIZE))
    if quick:
        out = [s for s in out if s.name.startswith("70B")]
    return out


FP8 = torch.float8_e4m3fn
FP8_OUT = torch.bfloat16


def make_inputs(s: Shape, dtype, scaling=None):
    """Input sets ``(a, b, c, *scales)``: ``b = weight.t()``; fp8: e4m3 operands of N(0, 1)
    values, a bf16 ``c`` and fp32 scales (``scaling`` "tensor": 0-d; "row": ``[M, 1]``, ``[1, N]``)
    that carry the weight's 1/sqrt(K)."""
    fp8 = dtype == FP8
    out_dtype = FP8_OUT if fp8 else dtype
    el, out_el = torch.empty((), dtype=dtype).element_size(), torch.empty((), dtype=out_dtype).element_size()
    per_set = (s.m * s.k + s.n * s.k) * el + s.m * s.n * out_el
    n_sets = max(1, min(8, math.ceil(3 * L2_BYTES / per_set)))
    sets = []
    for _ in range(n_sets):
        c = torch.empty(s.m, s.n, device="cuda", dtype=out_dtype)
        if not fp8:
            a = torch.randn(s.m, s.k, device="cuda", dtype=dtype)
            w = torch.randn(s.n, s.k, device="cuda", dtype=dtype) / math.sqrt(s.k)
            sets.append((a, w.t(), c))
            continue
        a = torch.randn(s.m, s.k, device="cuda").to(dtype)
        w = torch.randn(s.n, s.k, device="cuda").to(dtype)
        if scaling == "tensor":
            sa, sb = torch.tensor(1.0, device="cuda"), torch.tensor(1 / math.sqrt(s.k), device="cuda")
        else:
            sa = torch.rand(s.m, 1, device="cuda") + 0.5
            sb = (torch.rand(1, s.n, device="cuda") + 0.5) / math.sqrt(s.k)
        sets.append((a, w.t(), c, sa, sb))
    return sets


def _scales(sc) -> dict:
    """matmul's scale arguments of an input set's tail (nothing for 16-bit sets)."""
    return dict(scale_a=sc[0], scale_b=sc[1]) if sc else {}


def baseline(a, b, c, *sc):
    """cuBLAS: ``torch.matmul``, or for fp8 ``torch._scaled_mm`` (cuBLASLt) into ``c``."""
    if not sc:
        return torch.matmul(a, b, out=c)
    # use_fast_accum: the core's fp8 dot accumulates as cuBLASLt's fast mode does (Triton's
    # sm_90 default max_num_imprecise_acc), so the baseline does too (docs/gemm_core.md)
    return torch._scaled_mm(a, b, scale_a=sc[0], scale_b=sc[1], out_dtype=c.dtype, out=c, use_fast_accum=True)


def bench(fn_of_set, sets, rep):
    import triton
    i = [0]

    def step():
        fn_of_set(*sets[i[0] % len(sets)])
        i[0] += 1
    return triton.testing.do_bench(step, warmup=10, rep=rep, return_mode="median")


def capture_graphs(fn, sets):
    """One CUDA graph per input set of one call ``fn(*set)``; returns a step that replays
    them in turn (no host launch cost in the timing) and the graphs (keep them alive)."""
    graphs = []
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for st in sets:
            fn(*st)
    torch.cuda.current_stream().wait_stream(stream)
    for st in sets:
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            fn(*st)
        graphs.append(g)
    i = [0]

    def step():
        graphs[i[0] % len(graphs)].replay()
        i[0] += 1
    return step, graphs


def graph_bench(fn, sets, rep):
    """Median time of one call replayed from a CUDA graph (no host launch cost)."""
    import triton
    step, graphs = capture_graphs(fn, sets)
    t = triton.testing.do_bench(step, warmup=10, rep=rep, return_mode="median")
    del graphs
    return t


def host_overhead_us(n=300):
    """Host time per call of a tiny GEMM (GPU never the bottleneck), ours vs torch.matmul."""
    a = torch.randn(64, 64, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(64, 64, device="cuda", dtype=torch.bfloat16)
    out = torch.empty(64, 64, device="cuda", dtype=torch.bfloat16)
    res = {}
    jit = gc.GemmOptions(direct_launch=False)
    for name, fn in (("ours", lambda: gc.matmul(a, w.t(), out=out)),
                     ("ours_triton_jit_launch", lambda: gc.matmul(a, w.t(), out=out, options=jit)),
                     ("cublas", lambda: torch.matmul(a, w.t(), out=out))):
        for _ in range(20):
            fn()
        torch.cuda.synchronize()
        t = time.perf_counter()
        for _ in range(n):
            fn()
        res[name] = (time.perf_counter() - t) / n * 1e6
        torch.cuda.synchronize()
    return res


def rel_err(x, ref):
    return ((x.float() - ref.float()).norm() / ref.float().norm()).item()


def hook_specs(s: Shape, out, num_chunks=WORLD_SIZE):
    """(chunk_m, wait, epilogue without signals, epilogue with signals, its signals): the
    hooks with signals pre-set (wait) and one destination per chunk (epilogue)."""
    chunk_m = -(-s.m // num_chunks)
    sig = torch.full((num_chunks,), 7, dtype=torch.int32, device="cuda")
    wait = gc.WaitSpec(sig, 7, chunk_m, timeout_ns=5_000_000_000, error=gc.new_error_word("cuda"))
    # one allocation per chunk, as peer buffers are in the fused GEMM+RS (slices of one tensor
    # would take the one-descriptor path of stacked destinations: probe_epilogue.py epi_stacked)
    dests = [torch.empty(min(chunk_m, s.m - c * chunk_m), s.n, dtype=out.dtype, device=out.device)
             for c in range(num_chunks)]
    esig = torch.zeros(num_chunks, dtype=torch.int32, device="cuda")
    epi = gc.EpilogueSpec.from_tensors(dests, None, 1, chunk_m)   # as fused gemm_rs / gemm_ar
    epi_signalled = gc.EpilogueSpec.from_tensors(dests, esig, 7, chunk_m)
    return chunk_m, wait, epi, epi_signalled, esig


def kernel_name(plan) -> str:
    """The kernel a call's plan ran: "gemm_ws" (the Gluon kernel), "gemm_pp" (its ping-pong
    variant) or "gemm_kernel" (the Triton family)."""
    return {"gemm_ws_kernel": "gemm_ws", "gemm_pp_kernel": "gemm_pp"}.get(plan.kernel, "gemm_kernel")


def config_label(cfg: dict) -> str:
    """A config (``GemmConfig.to_dict()``) in a few characters: ``128x256x128 w8s3`` and its
    switches (``g4`` GROUP_M other than 8, ``sub2``, ``flat``, ``streamK1``, ``ptr`` pointer
    stores, ``ws``: plain calls run the Gluon kernel, GemmConfig.gluon; ``pp``: its ping-pong
    variant, GemmConfig.pingpong)."""
    label = f"{cfg['BLOCK_M']}x{cfg['BLOCK_N']}x{cfg['BLOCK_K']} w{cfg['num_warps']}s{cfg['num_stages']}"
    switches = [f"g{cfg['GROUP_M']}" if cfg.get("GROUP_M", 8) != 8 else "",
                "sub2" if cfg.get("EPI_SUBTILE") == 2 else "", "flat" if cfg.get("flatten") else "",
                f"streamK{cfg['stream_k']}" if cfg.get("stream_k") else "",
                "ptr" if cfg.get("tma_store") is False else "",
                "pp" if cfg.get("pingpong") else "ws" if cfg.get("gluon") else ""]
    return " ".join([label] + [x for x in switches if x])


# The variants whose ratios the rows report, timed back to back in each round: graph_ratio
# (cublas / ours) and the hooks alone (wait / round_order, epilogue and epilogue_signalled /
# owner_order: a group of three)
TIMING_PAIRS = (("cublas", "ours"), ("round_order", "wait"), ("owner_order", "epilogue", "epilogue_signalled"))


def round_schedule(keys, r):
    """The order in which round ``r`` times the variants ``keys``: each of TIMING_PAIRS (those
    of its variants in ``keys``; a variant in none alone) kept together, the pairs rotated by
    ``r``, and within a pair the first timed first in even rounds, second in odd ones (a pair's
    second timing is not always the later one). Over six rounds every pair takes every place
    in both orders."""
    paired = {k for pair in TIMING_PAIRS for k in pair}
    groups = [[k for k in pair if k in keys] for pair in TIMING_PAIRS] + [[k] for k in keys if k not in paired]
    groups = [g for g in groups if g]
    groups = groups[r % len(groups):] + groups[:r % len(groups)]
    return [k for g in groups for k in (g if r % 2 == 0 else g[::-1])]


def run_shape(s: Shape, dtype, args, log, scaling=None):
    sets = make_inputs(s, dtype, scaling)
    a0, b0, c0, *sc0 = sets[0]
    ref = baseline(a0, b0, torch.empty_like(c0), *sc0)
    tol = 2e-2 if c0.dtype == torch.bfloat16 else 5e-3
    s_name = s.name + (f"-{scaling}wise" if scaling else "")
    timings = []
    num_sms = torch.cuda.get_device_properties(a0.device).multi_processor_count
    cands = gc.candidate_configs(s.m, s.n, s.k, dtype, num_sms=num_sms,
                                 capability=torch.cuda.get_device_capability(a0.device))
    if args.no_tune:
        cands = [gc.default_config(s.m, s.n, s.k, dtype, num_sms=num_sms)]
    for cfg in cands:
        try:
            gc.matmul(a0, b0, out=c0, config=cfg, **_scales(sc0))   # compiles; the next call launches directly
            c0.fill_(float("nan"))
            gc.matmul(a0, b0, out=c0, config=cfg, **_scales(sc0))
            err = rel_err(c0, ref)
            if not math.isfinite(err) or err > tol:
                log.append({"shape": s_name, "config": cfg.to_dict(), "error": f"rel_err {err}"})
                continue
            fn = lambda a, b, c, *sc: gc.matmul(a, b, out=c, config=cfg, **_scales(sc))  # noqa: E731
            # CUDA-graph replays by default: eager timings of small shapes measure the host's
            # launch cost, not the kernel, and would pick configs by launch noise
            ms = graph_bench(fn, sets, args.tune_rep) if args.tune_graphs else bench(fn, sets, args.tune_rep)
        except Exception as e:  # noqa: BLE001 - record and skip configs that do not compile
            log.append({"shape": s_name, "config": cfg.to_dict(), "error": f"{type(e).__name__}: {e}"[:300]})
            continue
        timings.append((ms, cfg))
        log.append({"shape": s_name, "config": cfg.to_dict(), "ms": ms})
    timings.sort(key=lambda t: t[0])
    if args.finalists > 1 and not args.no_tune:
        # One timing per candidate is exposed to drift: the leaders are timed again in
        # interleaved rounds and ranked by the median of their timings (tpfuse.gemm.rerank_leaders)
        def timed(cfg, sets=sets):   # sets: bound now (deleted at the end of run_shape)
            fn = lambda a, b, c, *sc: gc.matmul(a, b, out=c, config=cfg, **_scales(sc))  # noqa: E731
            return graph_bench(fn, sets, args.tune_rep) if args.tune_graphs else bench(fn, sets, args.tune_rep)
        ranked = gc.rerank_leaders([(cfg, ms) for ms, cfg in timings], timed, args.finalists, args.finalist_rounds)
        for cfg, _, ts in ranked[:args.finalists]:
            log.append({"shape": s_name, "config": cfg.to_dict(), "finalist_ms": ts})
        timings = [(ms, cfg) for cfg, ms, _ in ranked]
        leaders = [cfg for cfg, _, ts in ranked if len(ts) > 1]
    else:
        leaders = []
    best = timings[0][1]
    flops = 2.0 * s.m * s.n * s.k
    chunk_m, wait, epi, epi_signalled, esig = hook_specs(s, c0)
    hook_kw = {"wait": dict(tile_order="round", start_chunk=1, wait=wait, check=False),
               "epilogue": dict(tile_order="owner", start_chunk=1, epilogue=epi)}
    # per hook, the leader fastest with it, as tpfuse.gemm.tune keeps one (hook_winners)
    hooked = {"wait": best, "epilogue": best}
    if len(leaders) > 1:
        def time_hooked(hook, cfg, sets=sets):
            kw = hook_kw[hook]
            fn = lambda a, b, c, *sc: gc.matmul(  # noqa: E731
                a, b, out=None if hook == "epilogue" else c, config=cfg, **kw, **_scales(sc))
            ms = graph_bench(fn, sets, args.tune_rep) if args.tune_graphs else bench(fn, sets, args.tune_rep)
            if hook == "wait":
                gc.check_error_word(wait.error)
            return ms
        for hook, (cfg, ms) in gc.hook_winners(leaders, tuple(hooked), time_hooked).items():
            hooked[hook] = cfg
            log.append({"shape": s_name, "hook": hook, "config": cfg.to_dict(), "ms": ms})
    # round_order / owner_order run the wait / epilogue hook's config: *_hook_overhead is the hook alone
    config_of = {"ours": best, "round_order": hooked["wait"], "owner_order": hooked["epilogue"],
                 "wait": hooked["wait"], "epilogue": hooked["epilogue"], "epilogue_signalled": hooked["epilogue"]}
    variants = {
        "ours": dict(),
        "round_order": dict(tile_order="round", start_chunk=1, chunk_m=chunk_m),
        "owner_order": dict(tile_order="owner", start_chunk=1, chunk_m=chunk_m),
        "wait": dict(tile_order="round", start_chunk=1, wait=wait, check=False),
        "epilogue": dict(tile_order="owner", start_chunk=1, epilogue=epi),
        "epilogue_signalled": dict(tile_order="owner", start_chunk=1, epilogue=epi_signalled),
    }
    row = {"name": s_name, "phase": s.phase, "m": s.m, "n": s.n, "k": s.k, "config": best.to_dict(),
           "runner_up": [dict(ms=t, **c.to_dict()) for t, c in timings[1:4]],
           "wait_config": hooked["wait"].to_dict(), "epilogue_config": hooked["epilogue"].to_dict()}
    if scaling:
        row.update(dtype="float8_e4m3fn", out_dtype="bfloat16", scaling=f"{scaling}wise")
    fns = {"cublas": baseline}
    for key, kw in variants.items():
        try:
            for _ in range(2):
                c0.fill_(float("nan"))
                for d in epi.dests:
                    d.fill_(float("nan"))
                esig.zero_()
                gc.matmul(a0, b0, out=None if "epilogue" in kw else c0, config=config_of[key], **kw, **_scales(sc0))
            torch.cuda.synchronize()
            err = rel_err(torch.cat(epi.dests) if "epilogue" in kw else c0, ref)
            if "wait" in kw:
                gc.check_error_word(wait.error)
            if kw.get("epilogue") is epi_signalled and not bool((esig == 7).all()):
                raise RuntimeError(f"signals after epilogue: {esig.tolist()}")
            plan = gc.last_plan()   # which kernel ran the call (a hook, or the plain call), and why
            if key == "ours":
                row["plain_kernel"] = kernel_name(plan)
            if "wait" in kw:
                row["wait_kernel"] = kernel_name(plan)
            if key == "epilogue":
                row["epilogue_kernel"] = kernel_name(plan)
                row["epilogue_stores"] = {0: "pointers", abi.EPI_TMA_STACKED: "tma_stacked"}.get(
                    plan.epi_tma, "tma_per_chunk")

            if not math.isfinite(err) or err > tol:
                raise RuntimeError(f"rel_err {err}")
            fns[key] = (lambda kw, cfg: lambda a, b, c, *sc: gc.matmul(
                a, b, out=None if "epilogue" in kw else c, config=cfg, **kw, **_scales(sc)))(kw, config_of[key])
        except Exception as e:  # noqa: BLE001
            row[f"{key}_error"] = f"{type(e).__name__}: {e}"[:300]
    # Rounds interleave the variants so that clock and thermal drift hits all alike. eager:
    # min of the rounds' medians; graph: median of the rounds', and ratios/overheads as
    # medians of the per-round pairs. The variants a ratio compares are timed back to back
    # (TIMING_PAIRS: the pair's two timings moments apart, in the same thermal state), the
    # pairs in a rotated order and each pair's two in turn first (round_schedule).
    import triton
    steps = {k: capture_graphs(fn, sets) for k, fn in fns.items()} if args.graphs else {}
    eager = {k: [] for k in fns}
    graph = {k: [] for k in steps}
    for r in range(args.rounds):
        order = round_schedule(list(fns), r)
        for k in order:
            eager[k].append(bench(fns[k], sets, args.rep))
        for k in order:
            if k in steps:
                graph[k].append(triton.testing.do_bench(steps[k][0], warmup=10, rep=args.rep,
                                                        return_mode="median"))
    del steps
    for k in fns:
        row[f"{k}_ms"] = min(eager[k])
        if k in graph:
            row[f"{k}_graph_ms"] = statistics.median(graph[k])
            row[f"{k}_graph_rounds_ms"] = graph[k]

    def paired(num, den):   # median over rounds of graph[num] / graph[den]
        return statistics.median(x / y for x, y in zip(graph[num], graph[den]))
    row["ours_tflops"] = flops / row["ours_ms"] / 1e9
    row["cublas_tflops"] = flops / row["cublas_ms"] / 1e9
    row["ratio"] = row["cublas_ms"] / row["ours_ms"]
    if graph:
        row["ours_graph_tflops"] = flops / row["ours_graph_ms"] / 1e9
        row["cublas_graph_tflops"] = flops / row["cublas_graph_ms"] / 1e9
        row["graph_ratio"] = paired("cublas", "ours")
    # *_overhead: against hooks off in the grouped order (what a fused call costs over the plain
    # GEMM); *_hook_overhead: against the same tile order without the hook (the hook alone)
    for k, order in (("round_order", None), ("owner_order", None), ("wait", "round_order"),
                     ("epilogue", "owner_order"), ("epilogue_signalled", "owner_order")):
        if k in fns:
            row[f"{k}_overhead"] = row[f"{k}_ms"] / row["ours_ms"] - 1.0
            if graph:
                row[f"{k}_graph_overhead"] = paired(k, "ours") - 1.0
            if order in fns:
                row[f"{k}_hook_overhead"] = row[f"{k}_ms"] / row[f"{order}_ms"] - 1.0
                if graph:
                    row[f"{k}_hook_graph_overhead"] = paired(k, order) - 1.0
    del sets
    torch.cuda.empty_cache()
    return row


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default="benchmarks/results", help="directory for the JSON")
    p.add_argument("--name", default=None, help="JSON file name (default: gemm_core_h200.json, "
                                                "gemm_core_fp8_h200.json for --dtype fp8)")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "fp8"])
    p.add_argument("--scaling", default="tensor,row",
                   help="with --dtype fp8: comma-separated scalings, tensor (0-d scales) and/or row ([M, 1], [1, N])")
    p.add_argument("--rep", type=int, default=40, help="do_bench rep (ms) for the final timings")
    p.add_argument("--tune-rep", type=int, default=15, help="do_bench rep (ms) per tuning candidate")
    p.add_argument("--quick", action="store_true", help="70B shapes only")
    p.add_argument("--no-tune", action="store_true", help="default_config only")
    p.add_argument("--finalists", type=int, default=6,
                   help="tuning leaders timed again in --finalist-rounds interleaved rounds (<= 1: off)")
    p.add_argument("--finalist-rounds", type=int, default=4,
                   help="more timings of each tuning leader; ranked by the median of all")
    p.add_argument("--rounds", type=int, default=3, help="interleaved timing rounds (eager and graph)")
    p.add_argument("--no-graphs", dest="graphs", action="store_false", help="skip CUDA-graph timings")
    p.add_argument("--only", default="",
                   help="comma-separated substrings of shape names; one ending in $ must end the name "
                        "(8B-fc1-train$: not 8B-fc1-train_chunk)")
    p.add_argument("--eager-tuning", dest="tune_graphs", action="store_false",
                   help="time tuning candidates with eager launches (default: CUDA-graph replays)")
    p.add_argument("--merge", nargs="+", metavar="JSON", default=None,
                   help="no timing: combine result files of partial runs (e.g. --only in two device calls) "
                        "into one in --out/--name (default: the dtype's name), summary recomputed; no GPU needed")
    args = p.parse_args(argv)
    if args.merge:
        merged = merge(args.merge)
        fp8 = merged["meta"]["dtype"] == "fp8"
        name = args.name or ("gemm_core_fp8_h200.json" if fp8 else "gemm_core_h200.json")
        out_dir = Path(args.out)
        out_dir.mkdir(parents=True, exist_ok=True)
        (out_dir / name).write_text(json.dumps(merged, indent=1))
        print_table(merged["rows"], merged["summary"])
        missing = merged["meta"]["missing"]
        print(f"wrote {out_dir / name}: {len(merged['rows'])} rows from {len(args.merge)} runs"
              + (f"; missing {len(missing)}: {', '.join(missing)}" if missing else "; complete"))
        return
    if not torch.cuda.is_available():
        raise SystemExit("benchmarks/gemm_core.py needs a CUDA GPU")
    import triton
    fp8 = args.dtype == "fp8"
    dtype = FP8 if fp8 else getattr(torch, args.dtype)
    scalings = [x for x in args.scaling.split(",") if x] if fp8 else [None]
    if fp8 and (not scalings or any(x not in ("tensor", "row") for x in scalings)):
        raise SystemExit(f"--scaling {args.scaling!r}: choose tensor and/or row")
    args.name = args.name or ("gemm_core_fp8_h200.json" if fp8 else "gemm_core_h200.json")
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    meta = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "gpu": torch.cuda.get_device_name(), "num_gpus": torch.cuda.device_count(),
            "torch": torch.__version__, "triton": triton.__version__, "dtype": args.dtype,
            "world_size": WORLD_SIZE, "command": "python " + " ".join(sys.argv),
            "timing": "triton.testing.do_bench median (L2 flushed before each call), inputs rotated; "
                      "--rounds interleaved rounds of the groups (cublas, ours), (round_order, wait), (owner_order, epilogue, epilogue_signalled), "
                      "each group timed back to back, the groups in a rotated order, each group's order reversed every other round; eager: min of the rounds' medians; graph (one CUDA-graph "
                      "replay per call): median of the rounds' medians, graph_ratio and *_graph_overhead are "
                      "medians of per-round pairs; cublas = torch.matmul(a, w.t()) (fp8: torch._scaled_mm(a, w.t(), use_fast_accum=True, "
                      "scale_a, scale_b, out_dtype=bfloat16), cuBLASLt); "
                      "ours = best tuned config (tuning timed from CUDA-graph replays unless --eager-tuning); hooks: the leader fastest with the hook (tpfuse.gemm.hook_winners: each re-timed leader timed with it, then 4 interleaved rounds; what tune() keeps per hook), signals pre-set; round_order/owner_order run the wait/epilogue hook's config"}
    todo = shapes(args.quick)
    if args.only:
        keys = args.only.split(",")
        todo = [s for s in todo if any(s.name.endswith(k[:-1]) if k.endswith("$") else k in s.name for k in keys)]
    rows, log = [], []
    meta["host_us_per_call"] = host_overhead_us()
    print("host time per call (us):", meta["host_us_per_call"], flush=True)
    t0 = time.time()
    for s, scaling in [(s, x) for s in todo for x in scalings]:
        row = run_shape(s, dtype, args, log, scaling)
        rows.append(row)
        print(f"[{time.time() - t0:6.1f}s] {row['name']:24s} {s.m:6d}x{s.n:6d}x{s.k:6d} ours {row['ours_tflops']:6.1f} "
              f"cublas {row['cublas_tflops']:6.1f} ratio {row['ratio']:.3f} graph {row.get('graph_ratio', float('nan')):.3f} "
              f"wait {row.get('wait_overhead', float('nan')):+.3f} epi {row.get('epilogue_overhead', float('nan')):+.3f} "
              f"{config_label(row['config'])} ({row.get('plain_kernel', '?')})", flush=True)
        summary = summarize(rows)
        (out_dir / args.name).write_text(json.dumps({"meta": meta, "summary": summary, "rows": rows}, indent=1))
        (out_dir / args.name.replace(".json", "_tuning_log.json")).write_text(json.dumps(log, indent=0))
    print_table(rows, summarize(rows))


def expected_rows(dtype: str, scaling: str = "tensor,row") -> list[str]:
    """Row names a complete run of ``dtype`` (a ``--dtype`` value) writes, in its order."""
    suffixes = [f"-{x}wise" for x in scaling.split(",") if x] if dtype == "fp8" else [""]
    return [s.name + x for s in shapes(False) for x in suffixes]


def merge(paths: list[str]) -> dict:
    """One result file from the files of partial runs (``--only`` shares of the shapes, e.g. in
    two device calls): their rows in the benchmark's order, the summary recomputed, ``meta.runs``
    each input's date, command and commit (where its meta has one), ``meta.complete`` and
    ``meta.missing`` against a full run of the dtype.  Refuses (``ValueError``) inputs of
    another dtype, GPU, torch or Triton than the first, and a row present in two inputs."""
    if not paths:
        raise ValueError("merge: no files given")
    loaded = []
    for path in paths:
        try:
            data = json.loads(Path(path).read_text())
            meta, rows = data["meta"], data["rows"]
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise ValueError(f"merge: {path} is not a result file of this benchmark ({type(e).__name__}: {e})") from None
        loaded.append((path, meta, rows))
    first = loaded[0][1]
    for path, meta, _ in loaded[1:]:
        for key in ("dtype", "gpu", "torch", "triton", "world_size"):
            if meta.get(key) != first.get(key):
                raise ValueError(f"merge: {path} has {key}={meta.get(key)!r}, {loaded[0][0]} has "
                                 f"{first.get(key)!r}: only runs of one setup combine")
    by_name: dict[str, dict] = {}
    origin: dict[str, str] = {}
    for path, _, rows in loaded:
        for row in rows:
            if row["name"] in by_name:
                raise ValueError(f"merge: row {row['name']!r} is in both {origin[row['name']]} and {path}; "
                                 f"drop it from one (each shape is timed once)")
            by_name[row["name"]] = row
            origin[row["name"]] = path
    expected = expected_rows(first["dtype"])
    order = {name: i for i, name in enumerate(expected)}
    rows = sorted(by_name.values(), key=lambda r: (order.get(r["name"], len(order)), r["name"]))
    meta = {key: first[key] for key in ("gpu", "num_gpus", "torch", "triton", "dtype", "world_size", "timing")
            if key in first}
    meta.update(date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                command="python " + " ".join(["benchmarks/gemm_core.py", "--merge", *paths]),
                runs=[{key: meta_i[key] for key in ("date", "command", "commit", "host_us_per_call") if key in meta_i}
                      | {"rows": len(rows_i)} for _, meta_i, rows_i in loaded],
                missing=[name for name in expected if name not in by_name])
    meta["complete"] = not meta["missing"]
    return {"meta": meta, "summary": summarize(rows), "rows": rows}


def summarize(rows):
    ratios = [r["ratio"] for r in rows]
    big = [r for r in rows if r["phase"] in ("train", "prefill")]
    out = {}
    if all("graph_ratio" in r for r in rows):   # first: the targets are judged on kernel time
        g = [r["graph_ratio"] for r in rows]
        out["graph_geomean_ratio"] = math.exp(sum(map(math.log, g)) / len(g))
        out["graph_min_ratio"] = min(g)
        out["graph_min_ratio_shape"] = min(rows, key=lambda r: r["graph_ratio"])["name"]
    out.update({"geomean_ratio": math.exp(sum(map(math.log, ratios)) / len(ratios)),
                "min_ratio": min(ratios), "min_ratio_shape": min(rows, key=lambda r: r["ratio"])["name"]})
    for key in ("wait", "epilogue", "wait_graph", "epilogue_graph", "wait_hook", "epilogue_hook",
                "wait_hook_graph", "epilogue_hook_graph", "epilogue_signalled_hook_graph", "round_order_graph",
                "owner_order_graph"):
        vals = [r[f"{key}_overhead"] for r in big if f"{key}_overhead" in r]
        if vals:
            out[f"{key}_overhead_train_prefill_max"] = max(vals)
            out[f"{key}_overhead_train_prefill_mean"] = sum(vals) / len(vals)
    return out


def print_table(rows, summary):
    print()
    nan = float("nan")
    print(f"{'shape':24s} {'M':>6s} {'N':>6s} {'K':>6s} {'ours':>7s} {'cuBLAS':>7s} {'ratio':>6s} {'wait%':>6s} "
          f"{'epi%':>6s} | {'graph:ours':>10s} {'cuBLAS':>7s} {'ratio':>6s} {'wait%':>6s} {'epi%':>6s} "
          f"{'hookW%':>6s} {'hookE%':>6s} {'hookES%':>7s}  {'config (plain kernel)'}")
    for r in rows:
        print(f"{r['name']:24s} {r['m']:6d} {r['n']:6d} {r['k']:6d} {r['ours_tflops']:7.1f} {r['cublas_tflops']:7.1f} "
              f"{r['ratio']:6.3f} {100 * r.get('wait_overhead', nan):6.1f} {100 * r.get('epilogue_overhead', nan):6.1f} | "
              f"{r.get('ours_graph_tflops', nan):10.1f} {r.get('cublas_graph_tflops', nan):7.1f} "
              f"{r.get('graph_ratio', nan):6.3f} {100 * r.get('wait_graph_overhead', nan):6.1f} "
              f"{100 * r.get('epilogue_graph_overhead', nan):6.1f} {100 * r.get('wait_hook_graph_overhead', nan):6.1f} "
              f"{100 * r.get('epilogue_hook_graph_overhead', nan):6.1f} "
              f"{100 * r.get('epilogue_signalled_hook_graph_overhead', nan):7.1f}  "
              + (f"{config_label(r['config'])} ({r.get('plain_kernel', '?')})" if "config" in r else "-"))
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
