"""A Llama block tensor-parallelized with torch's stock styles and with tpfuse's, trained side by side.

    python examples/llama_block.py --world-size 2                   # CPU: spawns 2 gloo ranks
    python examples/llama_block.py --world-size 2 --compile aot_eager
    python examples/llama_block.py --bed 4 --strategy copy_engine   # one GPU, 4 ranks (under MPS)

The block is torchtitan's: ``h = x + wo(attention(attention_norm(x)))``,
``out = h + w2(silu(w1(n)) * w3(n))`` with ``n = ffn_norm(h)`` (RMSNorm, causal multi-head
attention, SwiGLU).  :func:`tp_plan` is torchtitan's sequence-parallel plan; it is applied once
with ``torch.distributed.tensor.parallel`` and once with ``tpfuse.parallel`` (the same plan,
another import), and both are trained next to the unsharded block on the same batches: the
losses agree to rounding.

CPU mode (default): W gloo ranks; reference, stock styles and tpfuse styles.  ``--compile``
wraps both parallel blocks in ``torch.compile`` (``aot_eager``, or ``inductor``, which needs a
C++ compiler and takes minutes on a small CPU).

Bed mode (``--bed W``): W processes on ``cuda:0`` with a gloo group (tests/gpu/bed.py's setup;
start the MPS daemon first).  gloo carries no CUDA tensors there, so no torch collective may
run: only the tpfuse block trains, against the unsharded reference computed on every rank, and
the block is chosen so that all its communication is tpfuse's -- the RMSNorms have no weight
(a replicated weight's gradient needs a torch all-reduce) and the linears no bias.  What runs:
SequenceParallel norms on the local shard, wq/wk/wv/w1/w3 through ``ag_gemm`` (backward
``gemm_rs``), wo/w2 through ``gemm_rs`` (backward ``ag_gemm``), SGD on the DTensor shards (local);
losses are summed over ranks on the CPU.  The stock-style comparison does not run there.
"""

from __future__ import annotations

import argparse
import os
import time
from dataclasses import dataclass, replace

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard

import tpfuse.parallel
from tpfuse.spawn import RankPool


@dataclass(frozen=True)
class Config:
    world_size: int = 2
    steps: int = 3
    batch: int = 2
    seq: int = 16  # over all ranks; sharded by W
    dim: int = 64
    n_heads: int = 4  # must divide by W
    ffn: int = 128
    dtype: str = "float32"
    strategy: str = "auto"
    compile: str = "none"  # none | aot_eager | inductor
    bias: bool = False
    norm_weight: bool = True
    lr: float = 1e-2
    seed: int = 0
    bed: bool = False  # the bed's configuration: only the tpfuse block, no torch collective on the data
    device: str = "cpu"  # "cuda" in the bed (every rank on the current GPU, cuda:0)


# --------------------------------------------------------------------------------------------
# The model (torchtitan's Llama block, small)
# --------------------------------------------------------------------------------------------


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6, weight: bool = True):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim)) if weight else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return y * self.weight if self.weight is not None else y


class Attention(nn.Module):
    def __init__(self, dim: int, n_heads: int, bias: bool):
        super().__init__()
        self.head_dim = dim // n_heads
        self.wq = nn.Linear(dim, dim, bias=bias)
        self.wk = nn.Linear(dim, dim, bias=bias)
        self.wv = nn.Linear(dim, dim, bias=bias)
        self.wo = nn.Linear(dim, dim, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bs, seqlen, _ = x.shape  # the global shape, also for a DTensor input
        q, k, v = (w(x).view(bs, seqlen, -1, self.head_dim).transpose(1, 2) for w in (self.wq, self.wk, self.wv))
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # this rank's heads
        return self.wo(out.transpose(1, 2).reshape(bs, seqlen, -1))


class FeedForward(nn.Module):
    def __init__(self, dim: int, ffn: int, bias: bool):
        super().__init__()
        self.w1 = nn.Linear(dim, ffn, bias=bias)
        self.w2 = nn.Linear(ffn, dim, bias=bias)
        self.w3 = nn.Linear(dim, ffn, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Block(nn.Module):
    def __init__(self, cfg: Config):
        super().__init__()
        self.attention_norm = RMSNorm(cfg.dim, weight=cfg.norm_weight)
        self.attention = Attention(cfg.dim, cfg.n_heads, cfg.bias)
        self.ffn_norm = RMSNorm(cfg.dim, weight=cfg.norm_weight)
        self.feed_forward = FeedForward(cfg.dim, cfg.ffn, cfg.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x))
        return h + self.feed_forward(self.ffn_norm(h))


def build(cfg: Config, device: torch.device) -> Block:
    """The block with the seed's weights (the same on every rank), norm weights perturbed off 1."""
    torch.manual_seed(cfg.seed)
    block = Block(cfg)
    with torch.no_grad():
        for name, p in block.named_parameters():
            if name.endswith("norm.weight"):
                p.add_(0.1 * torch.randn_like(p))
    return block.to(device, getattr(torch, cfg.dtype))


def tp_plan(styles, **style_kwargs) -> dict:
    """torchtitan's sequence-parallel plan for one block, with the styles of ``styles``
    (``torch.distributed.tensor.parallel`` or ``tpfuse.parallel``); ``style_kwargs`` go to the
    Colwise/Rowwise styles (e.g. ``strategy=`` for tpfuse's)."""
    col = lambda **kw: styles.ColwiseParallel(**kw, **style_kwargs)  # noqa: E731
    row = lambda **kw: styles.RowwiseParallel(**kw, **style_kwargs)  # noqa: E731
    gather = lambda: styles.PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),))  # noqa: E731
    return {
        "attention_norm": styles.SequenceParallel(),
        "attention": gather(),
        "attention.wq": col(), "attention.wk": col(), "attention.wv": col(),
        "attention.wo": row(output_layouts=Shard(1)),
        "ffn_norm": styles.SequenceParallel(),
        "feed_forward": gather(),
        "feed_forward.w1": col(), "feed_forward.w3": col(),
        "feed_forward.w2": row(output_layouts=Shard(1)),
    }


def parallelize(block: Block, mesh: DeviceMesh, styles, src_data_rank: int | None = 0, **style_kwargs) -> Block:
    """``parallelize_module`` with :func:`tp_plan`.  ``src_data_rank=None``: every rank keeps its own
    shard of its (identical) weights instead of receiving rank 0's (no collective: the bed)."""
    return styles.parallelize_module(block, mesh, tp_plan(styles, **style_kwargs), src_data_rank=src_data_rank)


def batch(cfg: Config, step: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """The full batch of ``step`` ([batch, seq, dim] inputs and targets), the same on every rank."""
    g = torch.Generator().manual_seed(cfg.seed + 1000 + step)
    x = torch.randn(cfg.batch, cfg.seq, cfg.dim, generator=g)
    target = torch.randn(cfg.batch, cfg.seq, cfg.dim, generator=g)
    dtype = getattr(torch, cfg.dtype)
    return x.to(device, dtype), target.to(device, dtype)


def local_part(full: torch.Tensor, placement, rank: int, world_size: int) -> torch.Tensor:
    """This rank's part of ``full`` under ``placement`` (no communication)."""
    return full.chunk(world_size, dim=placement.dim)[rank] if isinstance(placement, Shard) else full


def grads_and_params(module: nn.Module, rank: int, world_size: int) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """name -> (this rank's parameter, its gradient) as plain tensors."""
    out = {}
    for name, p in module.named_parameters():
        g = p.grad
        if isinstance(p, DTensor):
            p = p.to_local()
        if isinstance(g, DTensor):
            g = g.full_tensor() if any(not isinstance(q, (Shard, Replicate)) for q in g.placements) else g.to_local()
        out[name] = (p.detach(), g)
    return out


def max_rel_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |a - b| / max |b|; the denominator is at least 1e-3 (a gradient that is zero up to
    rounding, such as wk's bias -- softmax ignores a shift of the keys -- has no relative error)."""
    return ((a.double() - b.double()).abs().max() / b.double().abs().max().clamp_min(1e-3)).item()


# --------------------------------------------------------------------------------------------
# Training side by side
# --------------------------------------------------------------------------------------------


def _acc(t: torch.Tensor) -> torch.Tensor:
    """``t`` in the loss's dtype: float32, or float64 for a float64 model."""
    return t if t.dtype == torch.float64 else t.float()


def tp_step(model, x, target, rows: slice, optimizer) -> tuple[float, torch.Tensor]:
    """One step on this rank's tokens: the loss is a sum over ranks of local sums."""
    y = model(x[:, rows])
    loss_local = (_acc(y) - _acc(target[:, rows])).pow(2).sum() / target.numel()
    optimizer.zero_grad(set_to_none=True)
    loss_local.backward()
    optimizer.step()
    loss = loss_local.detach().cpu()  # summed on the CPU: the bed's gloo group carries no CUDA tensors
    dist.all_reduce(loss)
    return loss.item(), y.detach()


def ref_step(model, x, target, optimizer) -> tuple[float, torch.Tensor]:
    y = model(x)
    loss = (_acc(y) - _acc(target)).pow(2).mean()
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    optimizer.step()
    return loss.item(), y.detach()


def train(rank: int, world_size: int, cfg: Config) -> dict:
    """Train the unsharded block, the stock-style block (CPU mode) and the tpfuse-style block."""
    device = torch.device("cuda", torch.cuda.current_device()) if cfg.device == "cuda" else torch.device(cfg.device)
    if cfg.seq % world_size or cfg.n_heads % world_size:
        raise ValueError(f"--seq {cfg.seq} and --n-heads {cfg.n_heads} must divide by the world size {world_size}")
    mesh = DeviceMesh.from_group(dist.group.WORLD, device.type)
    models = {"reference": build(cfg, device)}
    if not cfg.bed:
        models["stock"] = parallelize(build(cfg, device), mesh, torch.distributed.tensor.parallel)
    models["tpfuse"] = parallelize(build(cfg, device), mesh, tpfuse.parallel, src_data_rank=None if cfg.bed else 0,
                                   strategy=cfg.strategy)
    step_fns = {name: (torch.compile(m, backend=cfg.compile) if cfg.compile != "none" and name != "reference" else m)
                for name, m in models.items()}
    # plain per-parameter SGD: no torch collective on the DTensor shards (the bed cannot run one)
    optimizers = {name: torch.optim.SGD(m.parameters(), lr=cfg.lr, foreach=False) for name, m in models.items()}
    rows = slice(rank * cfg.seq // world_size, (rank + 1) * cfg.seq // world_size)
    history, worst = [], {"output": 0.0, "grad": 0.0}
    for step in range(cfg.steps):
        start = time.perf_counter()
        x, target = batch(cfg, step, device)
        losses = {"reference": None}
        losses["reference"], y_ref = ref_step(models["reference"], x, target, optimizers["reference"])
        ref = grads_and_params(models["reference"], rank, world_size)
        for name in [n for n in models if n != "reference"]:  # the same order on every rank
            losses[name], y = tp_step(step_fns[name], x, target, rows, optimizers[name])
            worst["output"] = max(worst["output"], max_rel_diff(y, y_ref[:, rows]))
            placements = {n: p.placements[0] for n, p in models[name].named_parameters() if isinstance(p, DTensor)}
            for pname, (_, g) in grads_and_params(models[name], rank, world_size).items():
                want = local_part(ref[pname][1], placements.get(pname, Replicate()), rank, world_size)
                worst["grad"] = max(worst["grad"], max_rel_diff(g, want))
        history.append(losses)
        if rank == 0:
            shown = "   ".join(f"{k} {v:.6f}" for k, v in losses.items())
            print(f"step {step}: {shown}   ({(time.perf_counter() - start) * 1e3:.0f} ms)", flush=True)
    return {"history": history, "worst": worst}


def check(result: dict, cfg: Config) -> None:
    """Raise if any parallel block drifts from the reference by more than rounding explains."""
    tol = {"float64": 1e-9, "float32": 1e-4}.get(cfg.dtype, 3e-2)
    if cfg.bed and cfg.dtype == "float32":
        tol = 1e-2  # the symmetric-memory strategies' Triton GEMMs take float32 as tf32
    worst_loss = max(abs(v - h["reference"]) / abs(h["reference"]) for h in result["history"]
                     for k, v in h.items() if k != "reference")
    worst = {"loss": worst_loss, **result["worst"]}
    bad = {k: v for k, v in worst.items() if v > tol}
    if bad:
        raise SystemExit(f"parallel block differs from the unsharded reference: {bad} (relative) > {tol:g}")
    print("losses, outputs and gradients match the unsharded reference (max relative difference "
          + ", ".join(f"{k} {v:.1e}" for k, v in worst.items()) + ")", flush=True)


def parse_args(argv: list[str] | None = None) -> Config:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    d = Config()
    parser.add_argument("--world-size", type=int, default=d.world_size, help="CPU ranks to spawn")
    parser.add_argument("--bed", type=int, metavar="W", default=0,
                        help="one-GPU bed: W ranks on cuda:0 with a gloo group (tpfuse block only)")
    parser.add_argument("--steps", type=int, default=d.steps)
    parser.add_argument("--batch", type=int, default=d.batch)
    parser.add_argument("--seq", type=int, default=d.seq, help="tokens per sequence over all ranks")
    parser.add_argument("--dim", type=int, default=d.dim)
    parser.add_argument("--n-heads", type=int, default=d.n_heads)
    parser.add_argument("--ffn", type=int, default=d.ffn)
    parser.add_argument("--dtype", choices=["float32", "float64", "bfloat16"], default=None,
                        help="default: float32 on the CPU, bfloat16 in the bed ('fused' refuses float32)")
    parser.add_argument("--strategy", default=d.strategy, help="auto, unfused, ring, copy_engine, fused, ...")
    parser.add_argument("--compile", choices=["none", "aot_eager", "inductor"], default=d.compile)
    parser.add_argument("--bias", action="store_true", help="linears with bias (CPU mode only)")
    parser.add_argument("--lr", type=float, default=d.lr)
    args = vars(parser.parse_args(argv))
    bed = args.pop("bed")
    if args["dtype"] is None:
        args["dtype"] = "bfloat16" if bed else d.dtype
    cfg = Config(**args)
    if bed:
        if cfg.bias:
            parser.error("--bias does not run in the bed (a replicated bias's gradient needs a torch all-reduce)")
        if cfg.dtype == "float64":
            parser.error("--dtype float64 does not run in the bed (the symmetric-memory strategies take bf16/fp16/fp32)")
        cfg = replace(cfg, world_size=bed, bed=True, norm_weight=False, device="cuda")
    return cfg


def main(argv: list[str] | None = None) -> None:
    cfg = parse_args(argv)
    where = f"{cfg.world_size} ranks on cuda:0 (gloo group)" if cfg.device == "cuda" else f"{cfg.world_size} gloo ranks (CPU)"
    print(f"spawning {where}; strategy {cfg.strategy!r}, compile {cfg.compile}", flush=True)
    with RankPool(cfg.world_size, device="cuda:0" if cfg.device == "cuda" else None) as pool:
        result = pool.run(train, cfg, timeout=900)[0]
    check(result, cfg)


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
