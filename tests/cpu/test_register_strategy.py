"""A strategy defined outside tpfuse/ -- tests/cpu/toy_strategy.py -- and registered with
``tpfuse.register_strategy``: the three ops run it on gloo ranks, ``tpfuse.plan`` predicts it
from its own schedule, and ``tpfuse bench`` times it.  No file inside tpfuse/ names it.
docs/strategies.md walks through this same toy."""

from __future__ import annotations

import types
from dataclasses import dataclass

import pytest
import torch

import toy_strategy as toy
import tpfuse
from tpfuse import dtypes, strategies, testing
from tpfuse.model import cost


def _declaration(mod) -> dict:
    """The contract's attributes of a strategy module (to build variants of it)."""
    names = ("NAME", "DESCRIPTION", "DTYPES", "SCHEDULE", "why_unavailable", "ag_gemm", "gemm_rs", "gemm_ar")
    return {name: getattr(mod, name) for name in names}


@pytest.fixture
def registered():
    tpfuse.register_strategy(toy)
    yield toy
    strategies.unregister("toy")


# --- the planner and the registry, in this process ---------------------------------------------
def test_the_planner_predicts_a_registered_strategy_from_its_schedule(registered):
    assert "register_strategy" in tpfuse.__all__ and strategies.names()[-1] == "toy"
    p = tpfuse.plan("ag_gemm", m=16384, n=7168, k=8192, world_size=8, dtype="bf16", hardware="h200")
    assert p.predicted_ms["toy"] > 0 and p.chunks["toy"] == 1
    # its own schedule: gather then GEMM, nothing overlapped, on the same cost model as unfused
    gemm, comm = p.breakdown["gemm_ms"], cost.collective_ms("ag_gemm", 16384, 7168, 8192, 8, "bf16",
                                                             tpfuse.model.hardware.get_profile("h200"))
    assert p.predicted_ms["toy"] == pytest.approx(gemm + comm, rel=1e-6)
    assert p.strategy != "toy"   # the overlapped strategies beat a collective-then-GEMM here
    with pytest.raises(ValueError, match="the name 'toy' is taken"):
        tpfuse.register_strategy(toy)


def test_auto_never_picks_a_strategy_without_a_schedule():
    unmodelled = types.SimpleNamespace(**{**_declaration(toy), "NAME": "toy_unmodelled", "SCHEDULE": None,
                                          "ORDER": -1})
    tpfuse.register_strategy(unmodelled)
    try:
        p = tpfuse.plan("gemm_rs", m=4096, n=4096, k=1024, world_size=4)
        assert "toy_unmodelled" not in p.predicted_ms and p.strategy in strategies.names()
    finally:
        strategies.unregister("toy_unmodelled")


def test_a_strategy_missing_part_of_the_contract_is_refused():
    half = types.SimpleNamespace(NAME="half", DESCRIPTION="x", DTYPES=dtypes.EVERY, ag_gemm=toy.ag_gemm)
    with pytest.raises(TypeError, match="does not define why_unavailable, gemm_rs, gemm_ar"):
        tpfuse.register_strategy(half)
    assert "half" not in strategies.names()


# --- the three ops on gloo ranks --------------------------------------------------------------
def run_the_toy(rank, world_size):
    tpfuse.register_strategy(toy)
    try:
        g = torch.Generator().manual_seed(7)
        m, k, n = world_size * 37, 40, 31          # odd sizes
        a_full = torch.randn(m, k, generator=g, dtype=torch.float64)
        b = [torch.randn(k, n, generator=g, dtype=torch.float64) for _ in range(world_size)]
        rows = slice(rank * 37, (rank + 1) * 37)
        out = {}
        for dtype in (torch.float32, torch.float64):
            a, bb = a_full.to(dtype), b[rank].to(dtype)
            c, gathered = tpfuse.ag_gemm(a[rows], bb, strategy="toy", return_gathered=True)
            want = sum(a_full.to(dtype).double() @ b[r].to(dtype).double() for r in range(world_size))
            out[dtype] = dict(
                gathered=torch.equal(gathered, a),
                ag=testing.rel_err(c, a.double() @ bb.double()),
                rs=testing.rel_err(tpfuse.gemm_rs(a, bb, strategy="toy"), want[rows]),
                ar=testing.rel_err(tpfuse.gemm_ar(a, bb, strategy="toy"), want))
        return out
    finally:
        strategies.unregister("toy")


def test_the_three_ops_run_a_registered_strategy_on_gloo_ranks(rank_pool):
    for per_rank in rank_pool(2).run(run_the_toy, timeout=120):
        for dtype, got in per_rank.items():
            assert got["gathered"], dtype
            bound = 1e-12 if dtype == torch.float64 else 1e-5
            assert max(got["ag"], got["rs"], got["ar"]) < bound, (dtype, got)


# --- knobs: a per-group setting that the agreement round checks --------------------------------
@dataclass(frozen=True)
class ToyKnobs:
    tag: str = "default"


SEEN: list = []   # the knobs the knobbed toy's ag_gemm received, in this process


def _ag_gemm_knobbed(a_shard, b, ctx, knobs=None):
    SEEN.append(knobs)
    return toy.ag_gemm(a_shard, b, ctx)


knobbed = types.SimpleNamespace(**{**_declaration(toy), "NAME": "toy_knobbed", "KNOBS": ToyKnobs,
                                   "ag_gemm": _ag_gemm_knobbed})


def pin_and_call(rank, world_size):
    tpfuse.register_strategy(knobbed)
    try:
        a, b = torch.randn(8, 4), torch.randn(4, 3)
        SEEN.clear()
        tpfuse.ag_gemm(a, b, strategy="toy_knobbed")                  # nothing pinned: no knobs passed
        strategies.pin_knobs("toy_knobbed", ToyKnobs("same"))
        tpfuse.ag_gemm(a, b, strategy="toy_knobbed")
        seen = list(SEEN)
        strategies.pin_knobs("toy_knobbed", ToyKnobs(f"rank {rank}"))   # the ranks disagree
        try:
            tpfuse.ag_gemm(a, b, strategy="toy_knobbed")
            mismatch = None
        except ValueError as exc:
            mismatch = str(exc)
        return seen, mismatch
    finally:
        strategies.unregister("toy_knobbed")


def test_pinned_knobs_reach_the_strategy_and_ranks_must_agree_on_them(rank_pool):
    with pytest.raises(TypeError, match="knobs for 'fused' must be a FusedKnobs"):
        strategies.pin_knobs("fused", ToyKnobs())
    with pytest.raises(ValueError, match="'ring' declares no KNOBS"):
        strategies.pin_knobs("ring", ToyKnobs())
    for seen, mismatch in rank_pool(2).run(pin_and_call, timeout=120):
        assert seen == [None, ToyKnobs("same")]
        assert mismatch and "pinned knobs" in mismatch, mismatch


# --- tpfuse bench times it ----------------------------------------------------------------------
def _unregister_on_rank(rank, world_size):
    strategies.unregister("toy")


def test_bench_times_a_registered_strategy(rank_pool):
    """``tpfuse bench --register-strategy toy_strategy``: the module is registered in this process
    and on every rank before the cells run."""
    from tpfuse.bench.run import quick_config, run_bench

    pool = rank_pool(2)
    try:
        result = run_bench(quick_config(phases=("decode",), models=("8b",), strategies=("toy", "unfused"),
                                        strategy_modules=("toy_strategy",), iters=2, warmup=1), ranks=pool)
    finally:
        pool.run(_unregister_on_rank)
        strategies.unregister("toy")
    toy_rows = [r for r in result["rows"] if r["strategy"] == "toy"]
    assert len(toy_rows) == 2 and all(r["ms"] > 0 and r["predicted_ms"] > 0 for r in toy_rows), toy_rows


def test_the_bench_command_line_takes_a_strategy_module(capsys):
    from tpfuse.cli import main

    # a module that is no strategy: one line, exit 2, before any rank starts
    assert main(["bench", "--quick", "--register-strategy", "json"]) == 2
    assert "--register-strategy: json does not declare a strategy" in capsys.readouterr().err
    assert main(["bench", "--quick", "--register-strategy", "no_such_module_here"]) == 2
    assert "--register-strategy: cannot import no_such_module_here" in capsys.readouterr().err
