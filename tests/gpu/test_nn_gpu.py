"""tpfuse.nn layers on CUDA: forward/backward against an fp64 reference, and CUDA-graph capture
of a whole forward + backward, replayed on new data and compared with eager.

W = 1 runs with an NCCL group on one GPU (the layers' whole code path, with no transfers);
W = 2 runs as two gloo ranks sharing GPU 0 when gloo can move CUDA tensors (skips otherwise);
with several GPUs, W = their number (up to 4) runs on NCCL, one rank per GPU, graphs included.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
import torch.nn.functional as F

from tpfuse import testing
from tpfuse.nn import ColumnParallelLinear, RowParallelLinear
from tpfuse.spawn import RankError, run_ranks

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

ENV = {"TPFUSE_POISON": "1", "NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1"}
# The unfused baseline's own error must stay under these; every strategy's within 3x it in the
# same dtype (tpfuse/testing.py).
BASELINE_LIMIT = {torch.bfloat16: 3e-2, torch.float32: 1e-4}
HIDDEN, FFN, TOKENS_PER_RANK = 256, 1024, 96


def _problem(world_size, seed=0):
    g = torch.Generator().manual_seed(seed)
    t = TOKENS_PER_RANK * world_size
    return {name: torch.randn(*shape, generator=g, dtype=torch.float64) / (shape[-1] ** 0.5 if name[0] == "w" else 1)
            for name, shape in (("w1", (FFN, HIDDEN)), ("b1", (FFN,)), ("w2", (HIDDEN, FFN)), ("b2", (HIDDEN,)),
                                ("x", (t, 2, HIDDEN)), ("gy", (t, 2, HIDDEN)))}


def _mlp(p, dtype, device, sequence_parallel, strategy, save_gathered_input=True):
    fc1 = ColumnParallelLinear.from_full(p["w1"].to(device, dtype), p["b1"].to(device, dtype),
                                         sequence_parallel=sequence_parallel, strategy=strategy,
                                         save_gathered_input=save_gathered_input)
    fc2 = RowParallelLinear.from_full(p["w2"].to(device, dtype), p["b2"].to(device, dtype),
                                      sequence_parallel=sequence_parallel, strategy=strategy)
    return fc1, fc2


def _block(t, rank, world_size):
    size = t.shape[0] // world_size
    return t[rank * size:(rank + 1) * size]


def layers_vs_reference(rank, world_size):
    """fwd + bwd of the MLP for each dtype x strategy x SP flag; returns failures (empty = good)."""
    torch.backends.cuda.matmul.allow_tf32 = False
    device = torch.device("cuda", torch.cuda.current_device())
    p = _problem(world_size)
    q = {k: v.clone().requires_grad_() for k, v in p.items() if k != "gy"}
    y = F.linear(F.gelu(F.linear(q["x"], q["w1"], q["b1"])), q["w2"], q["b2"])
    y.backward(p["gy"])
    f_local = FFN // world_size
    cols = slice(rank * f_local, (rank + 1) * f_local)
    failures = []
    baseline = {}   # (dtype, sp, name) -> the unfused strategy's error (it runs first)
    for dtype in (torch.bfloat16, torch.float32):
        for strategy in ("unfused", "ring", "auto"):
            for sp in (True, False):
                fc1, fc2 = _mlp(p, dtype, device, sp, strategy, save_gathered_input=strategy != "ring")
                x, gy = p["x"].to(device, dtype), p["gy"].to(device, dtype)
                if sp:
                    x, gy = _block(x, rank, world_size), _block(gy, rank, world_size)
                x.requires_grad_()
                out = fc2(F.gelu(fc1(x)))
                out.backward(gy)
                checks = {
                    "y": (out, _block(y.detach(), rank, world_size) if sp else y.detach()),
                    "x": (x.grad, _block(q["x"].grad, rank, world_size) if sp else q["x"].grad),
                    "fc1.weight": (fc1.weight.grad, q["w1"].grad[cols]),
                    "fc1.bias": (fc1.bias.grad, q["b1"].grad[cols]),
                    "fc2.weight": (fc2.weight.grad, q["w2"].grad[:, cols]),
                    "fc2.bias": (fc2.bias.grad, q["b2"].grad),
                }
                for name, (got, want) in checks.items():
                    what = f"{dtype} {strategy} sp={sp} {name}"
                    if strategy == "unfused":
                        baseline[(dtype, sp, name)] = err = testing.rel_err(got, want)
                        if not err < BASELINE_LIMIT[dtype]:
                            failures.append(f"{what}: the unfused baseline itself is off: {err:.2e}")
                    problem = testing.check_close(got.detach(), want, baseline=baseline[(dtype, sp, name)],
                                                  dtype=dtype, what=what)
                    if problem:
                        failures.append(problem)
    torch.cuda.synchronize()
    return failures


def cuda_graph_matches_eager(rank, world_size, sequence_parallel, strategy, save_gathered_input):
    """Capture fwd + bwd of the MLP in one CUDA graph, replay it on new inputs, compare with eager.

    Returns (max relative error over the output and all gradients, whether replay changed the
    output) -- the second guards against a graph that replays stale results.
    """
    torch.backends.cuda.matmul.allow_tf32 = False
    device = torch.device("cuda", torch.cuda.current_device())
    p = _problem(world_size, seed=1)
    fc1, fc2 = _mlp(p, torch.float32, device, sequence_parallel, strategy, save_gathered_input)
    params = [*fc1.parameters(), *fc2.parameters()]
    tokens = TOKENS_PER_RANK if sequence_parallel else TOKENS_PER_RANK * world_size
    static_x = torch.randn(tokens, 2, HIDDEN, device=device, requires_grad=True)
    static_gy = torch.randn(*fc2(F.gelu(fc1(static_x))).shape, device=device)

    def step():
        for t in (*params, static_x):
            t.grad = None
        out = fc2(F.gelu(fc1(static_x)))
        out.backward(static_gy)
        return out

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up on a side stream, as torch.cuda.graphs asks
        for _ in range(3):
            step()
    torch.cuda.current_stream().wait_stream(side)
    for t in (*params, static_x):
        t.grad = None  # let the graph's pool own the gradients
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = fc2(F.gelu(fc1(static_x)))
        static_out.backward(static_gy)

    errors, changed = [], []
    for seed in (2, 3):
        g = torch.Generator(device=device).manual_seed(seed + rank)
        before = static_out.clone()
        with torch.no_grad():
            static_x.copy_(torch.randn(static_x.shape, generator=g, device=device))
            static_gy.copy_(torch.randn(static_gy.shape, generator=g, device=device))
        graph.replay()
        torch.cuda.synchronize()
        replayed = [static_out.clone(), static_x.grad.clone(), *(t.grad.clone() for t in params)]
        changed.append(not torch.equal(before, replayed[0]))
        # eager on the same inputs, into fresh tensors
        x = static_x.detach().clone().requires_grad_()
        saved = [t.grad for t in params]
        for t in params:
            t.grad = None
        out = fc2(F.gelu(fc1(x)))
        out.backward(static_gy)
        eager = [out.detach(), x.grad, *(t.grad for t in params)]
        for t, grad in zip(params, saved):
            t.grad = grad  # the graph keeps writing into these
        errors.append(max(testing.rel_err(a, b.double().cpu()) for a, b in zip(replayed, eager)))
    return max(errors), all(changed)


def test_layers_w1_nccl():
    assert run_ranks(layers_vs_reference, 1, backend="nccl", env=ENV, timeout=300) == [[]]


@pytest.mark.parametrize("sequence_parallel, strategy, save_gathered_input", [
    (True, "unfused", True), (True, "ring", False), (True, "auto", True), (False, "ring", True),
])
def test_cuda_graph_capture_w1(sequence_parallel, strategy, save_gathered_input):
    [(err, changed)] = run_ranks(cuda_graph_matches_eager, 1, sequence_parallel, strategy, save_gathered_input,
                                 backend="nccl", env=ENV, timeout=300)
    assert changed, "replay did not change the output: the graph replays stale results"
    assert err < 1e-6, f"CUDA-graph replay differs from eager by {err:.2e}"


def gloo_cuda_collectives_work(rank, world_size):
    """The collectives the layers need, on CUDA tensors through gloo (not every gloo build can)."""
    name = dist.group.WORLD.group_name
    x = torch.full((world_size * 2, 3), float(rank + 1), device="cuda")
    ag = getattr(funcol, "all_gather_single", None) or funcol.all_gather_tensor
    rs = getattr(funcol, "reduce_scatter_single", None) or funcol.reduce_scatter_tensor
    funcol.wait_tensor(funcol.all_reduce(x, "sum", name))
    funcol.wait_tensor(ag(x, 0, name))
    funcol.wait_tensor(rs(x, "sum", 0, name))
    ops = [dist.P2POp(dist.isend, x, (rank + 1) % world_size), dist.P2POp(dist.irecv, torch.empty_like(x), (rank - 1) % world_size)]
    for work in dist.batch_isend_irecv(ops):
        work.wait()
    torch.cuda.synchronize()
    return True


def test_layers_two_gloo_ranks_one_gpu():
    env = {**ENV, "CUDA_VISIBLE_DEVICES": "0"}
    try:
        run_ranks(gloo_cuda_collectives_work, 2, env=env, timeout=120)
    except RankError as exc:
        pytest.skip(f"gloo cannot run the needed collectives on CUDA tensors here: {str(exc).splitlines()[-1]}")
    assert run_ranks(layers_vs_reference, 2, env=env, timeout=300) == [[], []]


MULTI_GPU = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 or more GPUs")


def _gpus():
    return min(4, torch.cuda.device_count())


@MULTI_GPU
def test_layers_nccl_one_rank_per_gpu():
    w = _gpus()
    assert run_ranks(layers_vs_reference, w, backend="nccl", env=ENV, timeout=300) == [[]] * w


@MULTI_GPU
@pytest.mark.parametrize("sequence_parallel, strategy, save_gathered_input", [
    (True, "unfused", True), (True, "ring", False), (False, "ring", True),
])
def test_cuda_graph_capture_nccl_one_rank_per_gpu(sequence_parallel, strategy, save_gathered_input):
    """Capture with real transfers (NCCL collectives / P2P inside the graph) on W GPUs."""
    results = run_ranks(cuda_graph_matches_eager, _gpus(), sequence_parallel, strategy, save_gathered_input,
                        backend="nccl", env=ENV, timeout=300)
    for rank, (err, changed) in enumerate(results):
        assert changed, f"rank {rank}: replay did not change the output: the graph replays stale results"
        assert err < 1e-6, f"rank {rank}: CUDA-graph replay differs from eager by {err:.2e}"
