"""tpfuse.parallel: ParallelStyles for parallelize_module, on gloo ranks (W = 2, 4).

The Llama block of examples/llama_block.py with tpfuse's styles against the same block with
torch's stock styles and the unsharded block (forward, gradients, SGD steps, fp64); other input
and output layouts on a small MLP; DCP checkpoints moving between the two kinds of styles; FSDP2
over dp on a dp 2 x tp 2 mesh.  One job per pool runs many cases (a spawn costs seconds).
"""

from __future__ import annotations

import os
import sys
from dataclasses import replace

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.utils._python_dispatch import TorchDispatchMode

import tpfuse.parallel
from conftest import caught_then_probe

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "examples"))
import llama_block as lb  # noqa: E402  (examples/llama_block.py: the model, the plan, the training loop)

STOCK = torch.distributed.tensor.parallel
F64 = lb.Config(dtype="float64", bias=True, batch=2, seq=8, dim=32, n_heads=4, ffn=64, steps=2, lr=0.05,
                strategy="unfused")
TOL = 1e-10  # fp64: the parallel blocks differ from the reference by summation order only


class OpCounter(TorchDispatchMode):
    """Counts the ops that reach the dispatcher as plain tensors, by namespace.op."""

    def __init__(self):
        super().__init__()
        self.counts: dict[str, int] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = f"{func.namespace}.{func._opname}"
        self.counts[name] = self.counts.get(name, 0) + 1
        return func(*args, **(kwargs or {}))

    def total(self, namespace: str) -> int:
        return sum(v for k, v in self.counts.items() if k.startswith(namespace + "."))


def _mesh() -> DeviceMesh:
    return DeviceMesh.from_group(dist.group.WORLD, "cpu")


# --------------------------------------------------------------------------------------------
# Jobs (run on every rank)
# --------------------------------------------------------------------------------------------


def _llama_block_job(rank: int, world_size: int, strategies: list[str], count_ops: bool) -> dict:
    out = {}
    for strategy in strategies:  # reference, stock styles and tpfuse styles trained side by side
        out[strategy] = lb.train(rank, world_size, replace(F64, strategy=strategy))
    if not count_ops:
        return out
    # which ops the tpfuse block runs, forward and backward (one step, batch 2, no bias)
    cfg = replace(F64, bias=False)
    mesh = _mesh()
    rows = slice(rank * cfg.seq // world_size, (rank + 1) * cfg.seq // world_size)
    x, target = lb.batch(cfg, 0, torch.device("cpu"))
    for name, styles, kw in (("tpfuse", tpfuse.parallel, {"strategy": "unfused"}), ("stock", STOCK, {})):
        block = lb.parallelize(lb.build(cfg, torch.device("cpu")), mesh, styles, **kw)
        x_shard = x[:, rows].clone().requires_grad_()
        with OpCounter() as fwd:
            y = block(x_shard)
        with OpCounter() as bwd:
            y.pow(2).sum().backward()
        out[name + "_ops"] = (fwd.counts, bwd.counts)
    # the bed's configuration (no stock block, no norm weight, no bias, no broadcast of the
    # weights) on the CPU: the collectives it issues, whole training loop included
    with OpCounter() as bed:
        out["bed"] = lb.train(rank, world_size, replace(cfg, bed=True, norm_weight=False, steps=2, strategy="ring"))
    out["bed_ops"] = {k: v for k, v in bed.counts.items() if "c10d" in k}
    return out


def _mlp_layouts_job(rank: int, world_size: int) -> dict:
    """Colwise -> gelu -> Rowwise on other layouts, against the unsharded MLP (fp64)."""
    mesh = _mesh()
    w = world_size
    cases = {
        # Megatron's [seq, batch, hidden]: sequence dim 0, no permutation
        "shard0": dict(col=dict(input_layouts=Shard(0)), row=dict(output_layouts=Shard(0)), shape=(4 * w, 3, 8),
                       x_dim=0, y_dim=0),
        # no sequence parallelism: replicated input (plain tensor), gemm_ar output
        "replicate": dict(col=dict(), row=dict(), shape=(2, 5, 8), x_dim=None, y_dim=None),
        # torchtitan's layout, DTensor output, 4-D input (batch 2 x 3 before the sequence dim)
        "shard1_dtensor": dict(col=dict(input_layouts=Shard(2)), row=dict(output_layouts=Shard(2), use_local_output=False),
                               shape=(2, 3, 2 * w, 8), x_dim=2, y_dim=2),
    }
    out = {}
    for name, case in cases.items():
        torch.manual_seed(1)
        ref = nn.Sequential(nn.Linear(8, 4 * w), nn.GELU(), nn.Linear(4 * w, 8)).double()
        nn.init.normal_(ref[2].bias)
        mlp = nn.Sequential(nn.Linear(8, 4 * w), nn.GELU(), nn.Linear(4 * w, 8)).double()
        mlp.load_state_dict(ref.state_dict())
        tpfuse.parallel.parallelize_module(mlp, mesh, {
            "0": tpfuse.parallel.ColwiseParallel(strategy="ring", **case["col"]),
            "2": tpfuse.parallel.RowwiseParallel(strategy="ring", **case["row"])})
        x = torch.randn(case["shape"], generator=torch.Generator().manual_seed(2), dtype=torch.float64)
        x_ref = x.clone().requires_grad_()
        y_ref = ref(x_ref)
        y_ref.pow(3).sum().backward()
        x_in = (x.chunk(w, case["x_dim"])[rank] if case["x_dim"] is not None else x).clone().requires_grad_()
        y = mlp(x_in)
        is_dtensor = isinstance(y, DTensor)
        y_local = y.to_local() if is_dtensor else y
        y_local.pow(3).sum().backward()
        want_y = y_ref.chunk(w, case["y_dim"])[rank] if case["y_dim"] is not None else y_ref
        want_x = x_ref.grad.chunk(w, case["x_dim"])[rank] if case["x_dim"] is not None else x_ref.grad
        errs = {"y": lb.max_rel_diff(y_local, want_y), "grad_x": lb.max_rel_diff(x_in.grad, want_x)}
        for (pname, p), (_, p_ref) in zip(mlp.named_parameters(), ref.named_parameters()):
            errs[pname] = lb.max_rel_diff(p.grad.full_tensor(), p_ref.grad)
        out[name] = (errs, is_dtensor, [tuple(p.placements) for p in mlp.parameters()])
    return out


def _fp8_job(rank: int, world_size: int) -> dict:
    """Colwise(fp8) -> gelu -> Rowwise(fp8) on a sequence-sharded [S, B, H] input against the
    tpfuse.nn fp8 layers built from the same weights (the same fused ops and casts): outputs and
    every gradient; and a Replicate input on an fp8 colwise layer refuses with the reason."""
    from tpfuse.nn import ColumnParallelLinear, RowParallelLinear

    mesh, w, h, f = _mesh(), world_size, 32, 16 * world_size
    out = {}
    for recipe in ("tensorwise", "rowwise"):
        torch.manual_seed(3)
        full = nn.Sequential(nn.Linear(h, f, bias=False), nn.GELU(), nn.Linear(f, h, bias=False))
        mlp = nn.Sequential(nn.Linear(h, f, bias=False), nn.GELU(), nn.Linear(f, h, bias=False))
        mlp.load_state_dict(full.state_dict())
        tpfuse.parallel.parallelize_module(mlp, mesh, {
            "0": tpfuse.parallel.ColwiseParallel(input_layouts=Shard(0), strategy="ring", fp8=recipe),
            "2": tpfuse.parallel.RowwiseParallel(output_layouts=Shard(0), strategy="ring", fp8=recipe)})
        col = ColumnParallelLinear(h, f, bias=False, strategy="ring", fp8=recipe)
        row = RowParallelLinear(f, h, bias=False, strategy="ring", fp8=recipe)
        col.load_full_weight(full[0].weight.detach())
        row.load_full_weight(full[2].weight.detach())
        x = torch.randn(4 * w, 3, h, generator=torch.Generator().manual_seed(4))
        x_a = x.chunk(w, 0)[rank].clone().requires_grad_()
        x_b = x_a.detach().clone().requires_grad_()
        y_a = mlp(x_a)
        y_b = row(torch.nn.functional.gelu(col(x_b)))
        y_a.pow(2).sum().backward()
        y_b.pow(2).sum().backward()
        out[recipe] = {"y": lb.max_rel_diff(y_a, y_b), "grad_x": lb.max_rel_diff(x_a.grad, x_b.grad),
                       "w1": lb.max_rel_diff(mlp[0].weight.grad.to_local(), col.weight.grad),
                       "w2": lb.max_rel_diff(mlp[2].weight.grad.to_local(), row.weight.grad)}
    rep = nn.Sequential(nn.Linear(h, f, bias=False))
    tpfuse.parallel.parallelize_module(rep, mesh, {"0": tpfuse.parallel.ColwiseParallel(strategy="ring",
                                                                                        fp8="rowwise")})
    try:
        rep(torch.randn(3, h))
        out["replicate"] = None
    except NotImplementedError as exc:
        out["replicate"] = str(exc)
    return out


def _dcp_job(rank: int, world_size: int, folder: str) -> dict:
    """tpfuse-style checkpoint -> stock-style model -> checkpoint -> tpfuse-style model."""
    import torch.distributed.checkpoint as dcp

    cfg = replace(F64, steps=1)
    mesh = _mesh()
    device = torch.device("cpu")
    rows = slice(rank * cfg.seq // world_size, (rank + 1) * cfg.seq // world_size)
    x, target = lb.batch(cfg, 0, device)

    def trained(styles, seed, **kw):
        block = lb.parallelize(lb.build(replace(cfg, seed=seed), device), mesh, styles, **kw)
        lb.tp_step(block, x, target, rows, torch.optim.SGD(block.parameters(), lr=0.1))
        return block

    out = {}
    src = trained(tpfuse.parallel, 0, strategy="ring")
    dcp.save({"model": src.state_dict()}, checkpoint_id=os.path.join(folder, "from_tpfuse"))
    dst = trained(STOCK, 7)  # other weights, then overwritten by the checkpoint
    state = {"model": dst.state_dict()}
    dcp.load(state, checkpoint_id=os.path.join(folder, "from_tpfuse"))
    dst.load_state_dict(state["model"])
    out["keys_equal"] = list(src.state_dict()) == list(dst.state_dict())
    out["placements_equal"] = all(a.placements == b.placements for a, b in zip(src.parameters(), dst.parameters()))
    out["tpfuse_to_stock"] = all(torch.equal(a.to_local(), b.to_local()) for a, b in zip(src.parameters(), dst.parameters()))
    with torch.no_grad():
        out["outputs_after_load"] = lb.max_rel_diff(dst(x[:, rows]), src(x[:, rows]))
    lb.tp_step(dst, x, target, rows, torch.optim.SGD(dst.parameters(), lr=0.1))  # move on, then back
    dcp.save({"model": dst.state_dict()}, checkpoint_id=os.path.join(folder, "from_stock"))
    back = trained(tpfuse.parallel, 3, strategy="unfused")
    state = {"model": back.state_dict()}
    dcp.load(state, checkpoint_id=os.path.join(folder, "from_stock"))
    back.load_state_dict(state["model"])
    out["stock_to_tpfuse"] = all(torch.equal(a.to_local(), b.to_local()) for a, b in zip(dst.parameters(), back.parameters()))
    return out


def _fsdp_job(rank: int, world_size: int) -> dict:
    """FSDP2 over dp (batch split) x tpfuse styles over tp (sequence split), against the reference."""
    from torch.distributed.fsdp import fully_shard

    cfg = replace(F64, batch=4, steps=3)
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    dp_rank, tp_rank = mesh["dp"].get_local_rank(), mesh["tp"].get_local_rank()
    device = torch.device("cpu")
    ref = lb.build(cfg, device)
    model = lb.parallelize(lb.build(cfg, device), mesh["tp"], tpfuse.parallel, strategy="unfused")
    fully_shard(model, mesh=mesh["dp"])
    opts = [torch.optim.SGD(m.parameters(), lr=cfg.lr) for m in (model, ref)]
    batch_rows = slice(dp_rank * cfg.batch // 2, (dp_rank + 1) * cfg.batch // 2)
    seq_rows = slice(tp_rank * cfg.seq // 2, (tp_rank + 1) * cfg.seq // 2)
    losses, placements = [], [tuple(p.placements) for p in model.parameters()]
    for step in range(cfg.steps):
        x, target = lb.batch(cfg, step, device)
        y = model(x[batch_rows, seq_rows])
        # FSDP averages gradients over dp: each replica's loss is its share's sum over N / dp
        loss_local = (y - target[batch_rows, seq_rows]).pow(2).sum() / (target.numel() / 2)
        opts[0].zero_grad()
        loss_local.backward()
        opts[0].step()
        loss = loss_local.detach() / 2
        dist.all_reduce(loss)
        ref_loss, _ = lb.ref_step(ref, x, target, opts[1])
        losses.append((loss.item(), ref_loss))
    params = {name: lb.max_rel_diff(p.full_tensor(), dict(ref.named_parameters())[name])
              for name, p in model.named_parameters()}
    return {"losses": losses, "params": params, "placements": placements}


def _bad_input_job(rank: int, world_size: int) -> list:
    mesh = _mesh()
    torch.manual_seed(0)
    mlp = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8)).double()
    tpfuse.parallel.parallelize_module(mlp, mesh, {"0": tpfuse.parallel.ColwiseParallel(),
                                                   "1": tpfuse.parallel.RowwiseParallel(output_layouts=Shard(0))})
    odd = DTensor.from_local(torch.randn(2, 8, dtype=torch.float64), mesh, [Replicate()], run_check=False)
    results = [caught_then_probe(rank, lambda: mlp[0](odd.redistribute(placements=[Shard(0)])))]  # 2 rows, W = 4
    results.append(caught_then_probe(rank, lambda: mlp[1](torch.randn(6, 2, dtype=torch.float64))))  # 6 % 4
    results.append(caught_then_probe(rank, lambda: mlp[0](torch.randn(4, 3, dtype=torch.float64))))  # features
    return results


# --------------------------------------------------------------------------------------------
# Tests
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("world_size", [2, 4])
def test_llama_block_matches_stock_and_reference(rank_pool, world_size):
    """Forward, gradients and 2 SGD steps of the tpfuse-style block match the unsharded block
    (fp64, bias on, batch 2 with sequence sharding: the permuted path); the forward runs only
    tpfuse ops and no DTensor collective, the stock block gathers and scatters through DTensor;
    the bed's configuration of the example issues no torch collective but the CPU loss sums."""
    strategies = ["ring"] if world_size == 2 else ["unfused"]
    count_ops = world_size == 2  # the op counts and the bed's configuration: once
    res = rank_pool(world_size).run(_llama_block_job, strategies, count_ops, timeout=300)
    for rank_res in res:
        for strategy in strategies:
            r = rank_res[strategy]
            assert set(r["history"][0]) == {"reference", "stock", "tpfuse"}
            for h in r["history"]:
                assert abs(h["tpfuse"] - h["reference"]) <= TOL * abs(h["reference"]), (strategy, h)
                assert abs(h["stock"] - h["reference"]) <= TOL * abs(h["reference"]), (strategy, h)
            assert r["worst"]["output"] < TOL and r["worst"]["grad"] < TOL, (strategy, r["worst"])
            assert r["history"][0]["reference"] != r["history"][-1]["reference"]  # the steps moved
    if not count_ops:
        return
    fwd, bwd = res[0]["tpfuse_ops"]
    assert fwd.get("tpfuse.ag_gemm") == 5 and fwd.get("tpfuse.gemm_rs") == 2, fwd  # wq wk wv w1 w3 | wo w2
    assert bwd.get("tpfuse.gemm_rs") == 5 and bwd.get("tpfuse.ag_gemm") == 2, bwd  # their dgrads
    assert not any(k.startswith("_c10d_functional.") for k in fwd), fwd  # no DTensor collective in forward
    assert not any(k.startswith("_c10d_functional.") for k in bwd), bwd  # (norm weight grads stay Partial until read)
    for rank_res in res:  # the bed's configuration: the only torch collectives are the CPU loss sums
        assert rank_res["bed_ops"] == {"c10d.allreduce_": 2}, rank_res["bed_ops"]
        bed = rank_res["bed"]
        assert set(bed["history"][0]) == {"reference", "tpfuse"}
        assert all(abs(h["tpfuse"] - h["reference"]) <= TOL * abs(h["reference"]) for h in bed["history"])
        assert bed["worst"]["output"] < TOL and bed["worst"]["grad"] < TOL, bed["worst"]
    stock_fwd, _ = res[0]["stock_ops"]
    assert any(k.startswith("_c10d_functional.") for k in stock_fwd) and "tpfuse.ag_gemm" not in stock_fwd


@pytest.mark.parametrize("world_size", [2, 4])
def test_layouts_checkpoints_and_errors(rank_pool, world_size, tmp_path):
    """Shard(0), Replicate and 4-D Shard(2)/DTensor-output layouts match the unsharded MLP; a DCP
    checkpoint moves from tpfuse styles to stock styles and back bit for bit; bad inputs raise
    ValueError on every rank before any communication."""
    pool = rank_pool(world_size)
    for rank_res in pool.run(_mlp_layouts_job, timeout=120):
        for name, (errs, is_dtensor, placements) in rank_res.items():
            assert all(e < TOL for e in errs.values()), (name, errs)
            assert is_dtensor == (name == "shard1_dtensor")
            assert placements == [(Shard(0),), (Shard(0),), (Shard(1),), (Replicate(),)], placements
    for rank_res in pool.run(_dcp_job, str(tmp_path), timeout=120):
        assert rank_res["keys_equal"] and rank_res["placements_equal"], rank_res
        assert rank_res["tpfuse_to_stock"] and rank_res["stock_to_tpfuse"], rank_res
        assert rank_res["outputs_after_load"] < TOL, rank_res
    if world_size == 4:
        for rank_res in pool.run(_bad_input_job, timeout=60):
            (c0, p0), (c1, p1), (c2, p2) = rank_res
            assert p0 == p1 == p2 == 6.0  # the group still works afterwards
            assert c0[0] == "ValueError" and "dim 0" in c0[1] and "divisible by the TP world size 4" in c0[1], c0
            assert c1[0] == "ValueError" and "divisible by the TP world size 4" in c1[1], c1
            assert c2[0] == "ValueError" and "3 features" in c2[1], c2


def test_fp8_styles_match_the_fp8_layers(rank_pool):
    """fp8= on the styles runs the tpfuse.nn fp8 recipes on the fused paths: the same outputs and
    gradients as ColumnParallelLinear/RowParallelLinear(fp8=...) from the same weights (W = 2)."""
    for rank_res in rank_pool(2).run(_fp8_job, timeout=120):
        for recipe in ("tensorwise", "rowwise"):
            assert all(e < 1e-6 for e in rank_res[recipe].values()), (recipe, rank_res[recipe])
        assert rank_res["replicate"] is not None and "fused paths" in rank_res["replicate"]


def test_fsdp2_over_dp_with_tpfuse_tp(rank_pool):
    """dp 2 x tp 2 on 4 ranks: fully_shard over dp on top of the tpfuse styles trains like the
    unsharded block (losses and parameters after 3 SGD steps, fp64)."""
    for rank_res in rank_pool(4).run(_fsdp_job, timeout=180):
        for loss, ref in rank_res["losses"]:
            assert abs(loss - ref) <= TOL * abs(ref), rank_res["losses"]
        assert all(e < TOL for e in rank_res["params"].values()), rank_res["params"]
        assert all(len(p) == 2 for p in rank_res["placements"])  # (dp, tp) DTensors after fully_shard


def test_style_arguments_are_checked():
    with pytest.raises(ValueError, match="unknown strategy 'nope'"):
        tpfuse.parallel.ColwiseParallel(strategy="nope")
    with pytest.raises(TypeError, match="strategy must be a string"):
        tpfuse.parallel.RowwiseParallel(strategy=3)
    with pytest.raises(ValueError, match="fp8='e4m3' is not a recipe"):
        tpfuse.parallel.RowwiseParallel(fp8="e4m3")
    with pytest.raises(TypeError, match="output_layouts must be a Placement"):
        tpfuse.parallel.ColwiseParallel(output_layouts="shard")
    with pytest.raises(ValueError, match="use_local_output=False"):
        tpfuse.parallel.PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),),
                                           use_local_output=True)
    style = tpfuse.parallel.PrepareModuleInput(input_layouts=(Shard(1), None), desired_input_layouts=(Replicate(), None))
    assert style.desired_input_layouts == (Shard(1), None)
    assert "strategy='ring'" in repr(tpfuse.parallel.ColwiseParallel(strategy="ring"))
