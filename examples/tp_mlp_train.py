"""Train a tensor-parallel MLP block for a few steps and check it against an unsharded copy.

    python examples/tp_mlp_train.py --world-size 2            # CPU: spawns 2 gloo ranks
    torchrun --nproc-per-node 8 examples/tp_mlp_train.py      # GPUs: one NCCL rank per GPU

The block is ``y = x + fc2(gelu(fc1(x)))`` with ``fc1`` a :class:`tpfuse.nn.ColumnParallelLinear`
and ``fc2`` a :class:`tpfuse.nn.RowParallelLinear`; with sequence parallelism (the default) every
rank holds T/W of the T tokens, fc1 all-gathers them fused with its GEMM and fc2 reduce-scatters
its output fused with its GEMM (and the other way round in backward).

Every rank also builds the same unsharded model (two ``nn.Linear``) from the same seed, shards
its weights into the TP layers, and trains it on the same batches with the same optimizer.
Rank 0 prints both losses each step: they agree to rounding for any world size.

fp8 (``--fp8 rowwise`` or ``--fp8 tensorwise``): the TP layers run their forward and
input-gradient GEMMs in fp8 (``tpfuse.nn`` layers with ``fp8=...``) while the unsharded reference
stays in ``--dtype`` (use ``--dtype bfloat16`` for "the bf16 run").  The two loss curves are then
compared on windowed means rather than step by step (see :func:`check`):

    python examples/tp_mlp_train.py --world-size 2 --fp8 rowwise --dtype bfloat16 --steps 300
"""

from __future__ import annotations

import argparse
import os
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from tpfuse.nn import ColumnParallelLinear, RowParallelLinear
from tpfuse.spawn import run_ranks


@dataclass(frozen=True)
class Config:
    world_size: int = 2
    steps: int = 5
    tokens: int = 64  # per step, all ranks together
    hidden: int = 64
    ffn: int = 256
    dtype: str = "float32"
    strategy: str = "auto"
    sequence_parallel: bool = True
    save_gathered_input: bool = True
    compile: bool = False
    lr: float = 1e-2
    seed: int = 0
    fp8: str | None = None  # None, "tensorwise" or "rowwise" (the TP block only)


class TPMLPBlock(nn.Module):
    """``x + fc2(gelu(fc1(x)))``, tensor-parallel over ``group``."""

    def __init__(self, reference: "ReferenceMLPBlock", cfg: Config, group: dist.ProcessGroup | None = None):
        super().__init__()
        kwargs = dict(group=group, sequence_parallel=cfg.sequence_parallel, strategy=cfg.strategy, fp8=cfg.fp8)
        self.fc1 = ColumnParallelLinear.from_full(reference.fc1.weight.detach(), reference.fc1.bias.detach(),
                                                  save_gathered_input=cfg.save_gathered_input, **kwargs)
        self.fc2 = RowParallelLinear.from_full(reference.fc2.weight.detach(), reference.fc2.bias.detach(), **kwargs)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(F.gelu(self.fc1(x)))


class ReferenceMLPBlock(nn.Module):
    """The same block, unsharded."""

    def __init__(self, hidden: int, ffn: int):
        super().__init__()
        self.fc1 = nn.Linear(hidden, ffn)
        self.fc2 = nn.Linear(ffn, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(F.gelu(self.fc1(x)))


def batch(cfg: Config, step: int, device: torch.device, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """The full batch of step ``step`` (identical on every rank): inputs and regression targets."""
    g = torch.Generator().manual_seed(cfg.seed + 1000 + step)
    x = torch.randn(cfg.tokens, cfg.hidden, generator=g)
    target = torch.sin(x @ torch.randn(cfg.hidden, cfg.hidden, generator=g) / cfg.hidden ** 0.5)
    return x.to(device, dtype), target.to(device, dtype)


def train(rank: int, world_size: int, cfg: Config) -> list[tuple[float, float]]:
    """Train the TP block and the unsharded reference side by side; returns (tp, reference) losses."""
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")
    dtype = getattr(torch, cfg.dtype)
    if cfg.tokens % world_size:
        raise ValueError(f"--tokens {cfg.tokens} must be divisible by the world size {world_size}")
    torch.manual_seed(cfg.seed)  # the same reference weights on every rank
    reference = ReferenceMLPBlock(cfg.hidden, cfg.ffn).to(device, dtype)
    block = TPMLPBlock(reference, cfg)
    step_fn = torch.compile(block, fullgraph=True) if cfg.compile else block
    optimizers = [torch.optim.AdamW(m.parameters(), lr=cfg.lr) for m in (block, reference)]
    rows = slice(rank * cfg.tokens // world_size, (rank + 1) * cfg.tokens // world_size)
    history = []
    for step in range(cfg.steps):
        start = time.perf_counter()
        x, target = batch(cfg, step, device, dtype)
        if cfg.sequence_parallel:  # this rank's tokens; the loss is a sum over ranks of local sums
            y = step_fn(x[rows])
            loss_local = F.mse_loss(y.float(), target[rows].float(), reduction="sum") / target.numel()
            loss = loss_local.detach().clone()
            dist.all_reduce(loss)
        else:  # every rank computes the same full output and loss (Megatron TP without SP)
            loss_local = F.mse_loss(step_fn(x).float(), target.float())
            loss = loss_local.detach()
        optimizers[0].zero_grad(set_to_none=True)
        loss_local.backward()
        optimizers[0].step()

        ref_loss = F.mse_loss(reference(x).float(), target.float())
        optimizers[1].zero_grad(set_to_none=True)
        ref_loss.backward()
        optimizers[1].step()
        history.append((loss.item(), ref_loss.item()))
        if rank == 0:
            print(f"step {step}: loss {history[-1][0]:.6f}   unsharded reference {history[-1][1]:.6f}   "
                  f"({(time.perf_counter() - start) * 1e3:.0f} ms)", flush=True)
    return history


# fp8 against the high-precision run: windows of this many steps, and the largest relative
# difference of their mean losses.  e4m3 keeps 3 mantissa bits: each quantized operand is off by
# up to 2**-4 = 6.25 % relative (about 3.6 % RMS, unbiased); a GEMM output sums K such products,
# so its error is a few % / sqrt(K) of its magnitude, and the MSE loss over 64 x 64 outputs
# averages it further: step-by-step losses differ by noise of about 0.1-0.5 %, and the optimizer's
# path drifts slowly.  Measured (defaults, --dtype bfloat16, W = 2, 300 steps, docs/nn.md "fp8"):
# at most 0.3 % (rowwise and tensorwise alike) on 25-step means.  2 % leaves several times that, while a real fault
# moves the curve by more: a scale off by a factor 2, an amax not reduced over the ranks (a rank
# quantizing with the wrong range), or a gradient left unscaled.
FP8_WINDOW = 25
FP8_TOLERANCE = 0.02


def check(history: list[tuple[float, float]], cfg: Config) -> None:
    """Raise if the TP losses drift from the reference by more than rounding explains (fp8: by more
    than :data:`FP8_TOLERANCE` on :data:`FP8_WINDOW`-step means)."""
    if cfg.fp8 is not None:
        window = min(FP8_WINDOW, len(history))
        worst = 0.0
        for start in range(0, len(history) - window + 1, window):
            tp = sum(h[0] for h in history[start:start + window]) / window
            ref = sum(h[1] for h in history[start:start + window]) / window
            worst = max(worst, abs(tp - ref) / max(abs(ref), 1e-12))
        first, last = history[0][1], sum(h[1] for h in history[-window:]) / window
        if worst > FP8_TOLERANCE:
            raise SystemExit(f"fp8 ({cfg.fp8}) TP loss differs from the {cfg.dtype} reference by {worst:.2e} "
                             f"(relative, {window}-step means) > {FP8_TOLERANCE:g}")
        print(f"fp8 ({cfg.fp8}) TP losses follow the {cfg.dtype} reference: max relative difference of "
              f"{window}-step means {worst:.1e} (tolerance {FP8_TOLERANCE:g}); reference loss {first:.4f} -> "
              f"{last:.4f}", flush=True)
        return
    tol = 1e-4 if cfg.dtype == "float32" else 3e-2
    worst = max(abs(tp - ref) / max(abs(ref), 1e-12) for tp, ref in history)
    if worst > tol:
        raise SystemExit(f"TP loss differs from the unsharded reference by {worst:.2e} (relative) > {tol:g}")
    print(f"TP losses match the unsharded reference (max relative difference {worst:.1e})", flush=True)


def parse_args(argv: list[str] | None = None) -> Config:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    d = Config()
    parser.add_argument("--world-size", type=int, default=d.world_size, help="CPU ranks to spawn (ignored under torchrun)")
    parser.add_argument("--steps", type=int, default=d.steps)
    parser.add_argument("--tokens", type=int, default=d.tokens, help="tokens per step over all ranks")
    parser.add_argument("--hidden", type=int, default=d.hidden)
    parser.add_argument("--ffn", type=int, default=d.ffn, help="must divide by the world size")
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default=d.dtype)
    parser.add_argument("--strategy", default=d.strategy, help="auto, unfused, ring, ...")
    parser.add_argument("--no-sequence-parallel", dest="sequence_parallel", action="store_false")
    parser.add_argument("--regather", dest="save_gathered_input", action="store_false",
                        help="fc1 keeps only its input shard and gathers it again in backward")
    parser.add_argument("--compile", action="store_true", help="torch.compile(fullgraph=True) the TP block")
    parser.add_argument("--lr", type=float, default=d.lr)
    parser.add_argument("--fp8", choices=["tensorwise", "rowwise"], default=None,
                        help="run the TP block's forward and input-gradient GEMMs in fp8 (torchao's recipes)")
    return Config(**vars(parser.parse_args(argv)))


def main(argv: list[str] | None = None) -> None:
    cfg = parse_args(argv)
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:  # torchrun
        backend = "nccl" if torch.cuda.is_available() else "gloo"
        if backend == "nccl":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        dist.init_process_group(backend)
        try:
            history = train(dist.get_rank(), dist.get_world_size(), cfg)
            if dist.get_rank() == 0:
                check(history, cfg)
        finally:
            dist.destroy_process_group()
        return
    print(f"spawning {cfg.world_size} gloo ranks (CPU)", flush=True)
    check(run_ranks(train, cfg.world_size, cfg, timeout=600)[0], cfg)


if __name__ == "__main__":
    main()
