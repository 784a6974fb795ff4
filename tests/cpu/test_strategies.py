"""The strategy registry (tpfuse/strategies/__init__.py): every list of strategy names, the
planner's reasons and the simulator's schedules come from the strategy modules."""
import types

import pytest
import torch

from tpfuse import _checks, strategies
from tpfuse._dist import GroupContext
from tpfuse.model import simulate
from tpfuse.model.hardware import get_profile


def _ctx(backend="gloo"):
    return GroupContext(group=None, group_name="test", rank=0, world_size=2, backend=backend)


def test_names_derive_from_the_registry():
    assert strategies.STRATEGY_NAMES == ("unfused", "ring", "copy_engine", "fused", "sm_workers")
    assert _checks.STRATEGY_NAMES is strategies.STRATEGY_NAMES
    assert simulate.STRATEGIES == strategies.STRATEGY_NAMES
    assert strategies.IMPLEMENTED_NAMES == ("unfused", "ring", "copy_engine", "fused", "sm_workers")
    assert strategies.get("ring").NAME == "ring" and strategies.get("unfused").MODEL == simulate.COLLECTIVE_THEN_GEMM
    for name in strategies.STRATEGY_NAMES:
        assert isinstance(strategies.model(name), simulate.Schedule) and strategies.description(name)


def test_strategies_say_why_they_cannot_run():
    cpu = torch.device("cpu")
    assert "needs CUDA symmetric memory" in strategies.why_unavailable("copy_engine", _ctx(), cpu, torch.bfloat16)
    assert "this group is gloo" in strategies.why_unavailable("fused", _ctx(), cpu, torch.bfloat16)
    cuda = torch.device("cuda", 0)
    assert "float64 runs with 'unfused' or 'ring'" in strategies.why_unavailable("fused", _ctx(), cuda, torch.float64)
    assert "TF32" in strategies.why_unavailable("fused", _ctx(), cuda, torch.float32)
    assert strategies.runnable(_ctx(), cpu, torch.float32) == ("unfused", "ring")
    # a model-only entry (a strategy the planner models before it is built) says so
    assert "not part of this tpfuse build yet" in strategies._symmetric_memory_not_built("x")(_ctx("nccl"), cuda,
                                                                                            torch.bfloat16)
    with pytest.raises(ValueError, match="unknown strategy 'zigzag'"):
        strategies.why_unavailable("zigzag", _ctx(), cpu, torch.float32)


def _module(**attrs):
    mod = types.ModuleType("tpfuse.strategies.example")
    for fn in ("why_unavailable", "ag_gemm", "gemm_rs", "gemm_ar"):
        setattr(mod, fn, lambda *a: None)
    for key, value in attrs.items():
        setattr(mod, key, value)
    return mod


def test_a_module_replaces_its_model_only_entry_and_keeps_what_it_does_not_declare():
    # what copy_engine.py needs to slot in: NAME, why_unavailable and the three functions
    (entry,) = [e for e in strategies._MODEL_ONLY if e.name == "copy_engine"]
    got = strategies._from_module(_module(NAME="copy_engine"), entry)
    assert got.implemented and got.module == "tpfuse.strategies.example"
    assert (got.model, got.order, got.description) == (entry.model, entry.order, entry.description)
    own = simulate.Schedule("pipeline", comm_path="sm", separate_kernels=True)
    assert strategies._from_module(_module(NAME="copy_engine", MODEL=own), entry).model == own


def test_a_new_strategy_module_must_declare_its_model():
    with pytest.raises(ImportError, match="does not define MODEL, DESCRIPTION"):
        strategies._from_module(_module(NAME="new_one"), None)
    with pytest.raises(ImportError, match="MODEL must be a tpfuse.model.simulate.Schedule"):
        strategies._from_module(_module(NAME="new_one", MODEL="ring", DESCRIPTION="x"), None)
    got = strategies._from_module(_module(NAME="new_one", MODEL=simulate.P2P_RING, DESCRIPTION="x"), None)
    assert got.order > max(e.order for e in strategies._REGISTRY.values())   # after the others by default


def test_schedules_drive_the_planner_and_the_simulator():
    hw = get_profile("h200")
    shape = dict(m=4096, n=1024, k=1024, world_size=4, dtype="bf16", hw=hw)
    assert simulate.built_num_chunks("ag_gemm", "ring", **shape) == 4
    assert simulate.built_num_chunks("ag_gemm", "unfused", **shape) == 1
    # copy_engine moves one chunk per rank; fused ag_gemm cuts each shard into the knob's pieces
    assert simulate.built_num_chunks("gemm_rs", "copy_engine", **shape) == 4
    assert simulate.built_num_chunks("ag_gemm", "fused", **shape) % 4 == 0
    assert strategies.model("fused").comm_path == "ce" and not strategies.model("fused").separate_kernels
    with pytest.raises(ValueError, match="Schedule.kind='tree'"):
        simulate.Schedule("tree")
    with pytest.raises(ValueError, match="unknown strategy 'zigzag'"):
        simulate.simulate("ag_gemm", "zigzag", m=256, n=256, k=256, world_size=2, dtype="bf16", hw=hw)
