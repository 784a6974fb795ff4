"""The strategy registry (tpfuse/strategies/__init__.py): every list of strategy names, the
planner's reasons, the dtype checks and the simulator's schedules come from what each strategy
module declares."""
import types

import pytest
import torch

from tpfuse import _checks, dtypes, strategies
from tpfuse._dist import GroupContext
from tpfuse.model import simulate
from tpfuse.model.hardware import get_profile


def _ctx(backend="gloo"):
    return GroupContext(group=None, group_name="test", rank=0, world_size=2, backend=backend)


def test_names_and_declarations_come_from_the_modules():
    assert strategies.names() == ("unfused", "ring", "copy_engine", "fused", "sm_workers")
    for name in strategies.names():
        entry = strategies.info(name)
        mod = strategies.get(name)
        assert mod.NAME == name and mod.__name__ == f"tpfuse.strategies.{name}"
        assert entry.schedule is mod.SCHEDULE and isinstance(entry.schedule, simulate.Schedule)
        # sm_workers' model (worker bandwidth leads) is not yet checked on GPUs: predicted, chosen only on a measurement
        assert entry.auto == (name != "sm_workers")
        assert entry.description == mod.DESCRIPTION and "\n" not in entry.description
        assert entry.dtypes == mod.DTYPES
    assert [strategies.info(s).symmetric_memory for s in strategies.names()] == [False, False, True, True, True]
    assert strategies.info("fused").knobs is strategies.get("fused").FusedKnobs
    assert not hasattr(_checks, "STRATEGY_NAMES") and not hasattr(strategies, "_MODEL_ONLY")


def test_strategies_say_why_they_cannot_run():
    cpu = torch.device("cpu")
    assert "needs CUDA symmetric memory" in strategies.why_unavailable("copy_engine", _ctx(), cpu, torch.bfloat16)
    assert "this group is gloo" in strategies.why_unavailable("fused", _ctx(), cpu, torch.bfloat16)
    cuda = torch.device("cuda", 0)
    assert "float64" in strategies.why_unavailable("fused", _ctx(), cuda, torch.float64)
    assert "TF32" in strategies.why_unavailable("fused", _ctx(), cuda, torch.float32)
    # a strategy whose own check says nothing about the dtype: the dtype policy names who takes it
    half = types.SimpleNamespace(NAME="half_only", DESCRIPTION="x", DTYPES=(dtypes.HALF,),
                                 why_unavailable=lambda *a: None, ag_gemm=print, gemm_rs=print, gemm_ar=print)
    strategies.register(half)
    try:
        why = strategies.why_unavailable("half_only", _ctx(), cpu, torch.float64)
        assert "half_only takes bfloat16/float16, not torch.float64" in why and "'unfused', 'ring'" in why
    finally:
        strategies.unregister("half_only")
    assert strategies.runnable(_ctx(), cpu, torch.float32) == ("unfused", "ring")
    with pytest.raises(ValueError, match="unknown strategy 'zigzag'"):
        strategies.why_unavailable("zigzag", _ctx(), cpu, torch.float32)


def test_the_dtype_policy_is_the_one_table():
    assert dtypes.name(torch.bfloat16) == dtypes.name("bfloat16") == "bf16"
    assert dtypes.torch_dtype("fp16") is torch.float16 and dtypes.itemsize("fp32") == 4
    assert dtypes.reduce_dtype(torch.bfloat16) is torch.float32 and dtypes.reduce_dtype("fp64") is torch.float64
    assert dtypes.out_dtype(torch.float16) is torch.float16
    fp8 = dtypes.Rule(inputs=(torch.float8_e4m3fn,), out_dtypes=(torch.bfloat16,), scales=("scale_a", "scale_b"))
    assert dtypes.out_dtype(torch.float8_e4m3fn, (fp8,)) is torch.bfloat16     # an fp8 entry is data
    assert dtypes.rule((fp8,), "fp8").scales == ("scale_a", "scale_b")
    assert dtypes.accepts(strategies.info("copy_engine").dtypes, torch.float32)
    assert not dtypes.accepts(strategies.info("fused").dtypes, torch.float32)
    with pytest.raises(ValueError, match="'int8' is not supported"):
        dtypes.name("int8")
    with pytest.raises(TypeError, match="Rule.inputs"):
        dtypes.Rule(inputs=())


def _module(**attrs):
    mod = types.ModuleType("example")
    mod.NAME, mod.DESCRIPTION, mod.DTYPES = "example", "an example", dtypes.EVERY
    for fn in ("why_unavailable", "ag_gemm", "gemm_rs", "gemm_ar"):
        setattr(mod, fn, lambda *a: None)
    for key, value in attrs.items():
        if value is None:
            delattr(mod, key)
        else:
            setattr(mod, key, value)
    return mod


def test_registration_validates_the_declaration():
    with pytest.raises(TypeError, match="does not define DTYPES, gemm_ar"):
        strategies.register(_module(DTYPES=None, gemm_ar=None))
    with pytest.raises(ValueError, match="the name 'ring' is taken"):
        strategies.register(_module(NAME="ring"))
    with pytest.raises(ValueError, match="NAME='auto'"):
        strategies.register(_module(NAME="auto"))
    with pytest.raises(ValueError, match="DESCRIPTION"):
        strategies.register(_module(DESCRIPTION="two\nlines"))
    with pytest.raises(TypeError, match="DTYPES must be a non-empty tuple of tpfuse.dtypes.Rule"):
        strategies.register(_module(DTYPES=(torch.float32,)))
    with pytest.raises(TypeError, match="SCHEDULE must be a tpfuse.model.simulate.Schedule"):
        strategies.register(_module(SCHEDULE="ring"))
    with pytest.raises(TypeError, match="AUTO must be a bool"):
        strategies.register(_module(AUTO="no"))
    with pytest.raises(TypeError, match="KNOBS must be a frozen dataclass"):
        strategies.register(_module(KNOBS=dict))
    with pytest.raises(TypeError, match="gemm_rs must be a function"):
        strategies.register(_module(gemm_rs=3))
    entry = strategies.register(_module())
    try:
        assert strategies.names()[-1] == "example" and entry.order == 1000   # after ours by default
        assert entry.schedule is None and not entry.symmetric_memory and entry.knobs is None and entry.auto
        with pytest.raises(ValueError, match="declares no SCHEDULE"):
            strategies.simulate("ag_gemm", "example", m=256, n=256, k=256, world_size=2, dtype="bf16",
                                hw=get_profile("h200"))
    finally:
        strategies.unregister("example")
    assert "example" not in strategies.names()


def test_schedules_drive_the_planner_and_the_simulator():
    hw = get_profile("h200")
    shape = dict(m=4096, n=1024, k=1024, world_size=4, dtype="bf16", hw=hw)
    assert strategies.built_num_chunks("ag_gemm", "ring", **shape) == 4
    assert strategies.built_num_chunks("ag_gemm", "unfused", **shape) == 1
    # copy_engine moves one chunk per rank; fused ag_gemm cuts each shard into the knob's pieces
    assert strategies.built_num_chunks("gemm_rs", "copy_engine", **shape) == 4
    assert strategies.built_num_chunks("ag_gemm", "fused", **shape) % 4 == 0
    assert strategies.schedule("fused").chunk_knob_ops == ("ag_gemm",)
    assert strategies.schedule("fused").sm_budget(hw, 8) == hw.sm_count - 1
    assert strategies.schedule("copy_engine").sm_budget is None
    with pytest.raises(ValueError, match="Schedule.kind='tree'"):
        simulate.Schedule(lambda g, c: None, kind="tree")
    with pytest.raises(TypeError, match="to replay a strategy by name use tpfuse.strategies.simulate"):
        simulate.simulate("ag_gemm", "ring", m=256, n=256, k=256, world_size=2, dtype="bf16", hw=hw)
    with pytest.raises(ValueError, match="unknown strategy 'zigzag'"):
        strategies.simulate("ag_gemm", "zigzag", m=256, n=256, k=256, world_size=2, dtype="bf16", hw=hw)


def test_the_simulator_engine_imports_no_strategy():
    import ast
    import inspect

    for mod in (simulate, __import__("tpfuse.model.steps", fromlist=["x"])):
        tree = ast.parse(inspect.getsource(mod))
        imported = [n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)]
        imported += [a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names]
        assert not [m for m in imported if m and "strateg" in m], (mod.__name__, imported)


def test_a_schedule_that_deadlocks_is_an_error_naming_the_stuck_task():
    def cyclic(g, c):
        for r in g.ranks:   # the GEMM waits for the copy queued after it on the same engine
            g.add(r, "gemm", "gemm", 1.0, deps=(len(g.tasks) + 1,), label="GEMM")
            g.add(r, "gemm", "copy", 1.0, label="copy")

    with pytest.raises(ValueError, match="deadlocked at rank 0's gemm task 'GEMM'"):
        simulate.simulate("ag_gemm", simulate.Schedule(cyclic), m=256, n=256, k=256, world_size=2,
                          dtype="bf16", hw=get_profile("h200"))
