"""tpfuse.gemm.PreparedMatmul (issue 34): a call site's repeated GEMM launched from the kept
argument list of its first call.  No GPU: the plan, the compiled Gluon kernel, Triton's
descriptor fill and the C launcher are faked, so what matmul's own direct path hands the
launcher can be compared with what the prepared call hands it, call by call."""
from __future__ import annotations

import threading
import types

import pytest
import torch

from tpfuse import _direct
from tpfuse.gemm import EpilogueSpec, PreparedMatmul, WaitSpec, last_plan, launch_counts
from tpfuse.gemm import launch as L
from tpfuse.gemm.config import GemmConfig

M, N, K, W = 256, 96, 64, 2


class Env:
    """The faked launch path: every C launch's arguments in ``launches``; ``plans`` counts the
    plans made (a call that went through matmul's planning)."""

    def __init__(self, monkeypatch, epilogue=False, kernel="gemm_ws_kernel"):
        self.launches, self.plans, self.jit = [], 0, 0
        plan = L.LaunchPlan(m=M, n=N, k=K, config=GemmConfig(BLOCK_M=128, BLOCK_N=64, BLOCK_K=64),
                            kernel=kernel, b_kmajor=True, grid=(4, 1, 1),
                            tile_order="owner" if epilogue else "round", chunk_m=M // W, num_chunks=W,
                            start_chunk=1, ws_block=(128, 64, 64), ws_stages=3, out_dtype=torch.bfloat16,
                            epi_tma=L.abi.EPI_TMA_STACKED if epilogue else 0)

        def make_plan(*args, **kwargs):
            self.plans += 1
            return plan

        descs = (0, 1, 2) + ((16,) if epilogue else ())   # the epilogue's first descriptor after the head
        meta = (128, 2, 8, (128, 64))
        direct = types.SimpleNamespace(
            knobs=types.SimpleNamespace(launch_enter_hook=None, launch_exit_hook=None), function="fn",
            head=(False,) * 8, tma=(lambda *args: self.launches.append(args), descs, (meta,) * len(descs)))
        self.direct = direct

        class Compiled(dict):
            def get(self, key, default=None):
                return direct

        monkeypatch.setattr(L, "_make_plan", make_plan)
        monkeypatch.setattr(L, "_PLANS", {})
        monkeypatch.setattr(L, "_COMPILED", Compiled())
        monkeypatch.setattr(L, "_cuda_index", lambda t: 0)
        monkeypatch.setattr(L, "_epilogue_descriptors", lambda spec, plan: (
            types.SimpleNamespace(base=spec.dests[0], shape=[M, N], strides=[N, 1]),))
        monkeypatch.setattr(L, "_launch_cached", lambda *a, **kw: setattr(self, "jit", self.jit + 1))
        monkeypatch.setattr(L, "_gluon_descriptor", lambda t, shape, strides, block: ("desc", t.data_ptr()))
        monkeypatch.setattr(_direct, "_tma_expansion", lambda: (lambda ptr, *rest: ("map", ptr) + tuple(
            tuple(x) if isinstance(x, list) else x for x in rest), {8: 8}))
        monkeypatch.setattr(_direct, "_MAPS", {})
        monkeypatch.setattr(_direct, "_TMA_BROKEN", [False])
        monkeypatch.setattr(torch._C, "_cuda_getCurrentRawStream", lambda index: 77, raising=False)


def _tensors(seed=0, m=M):
    g = torch.Generator().manual_seed(seed)
    a = torch.randn(m, K, generator=g).to(torch.bfloat16)
    b = torch.randn(N, K, generator=g).to(torch.bfloat16).t()        # weight.t(): K-major
    out = torch.empty(m, N, dtype=torch.bfloat16)
    return a, b, out


def _wait():
    return WaitSpec(signal=torch.zeros(W, dtype=torch.int32), generation=1, chunk_m=M // W,
                    error=torch.zeros(L.ERROR_WORDS, dtype=torch.int32), rank=0)


def _ag_call() -> PreparedMatmul:
    """fused ag_gemm's kind of call: the wait hook with its own error word, no host check."""
    return PreparedMatmul(tile_order="round", start_chunk=1, wait=_wait(), check=False, num_sms=4)


# the Gluon kernels' hooked launches share one argument list and launch code (gemm_pp takes
# gemm_ws's arguments), so a prepared call keeps either
GLUON_KERNELS = ["gemm_ws_kernel", "gemm_pp_kernel"]


@pytest.mark.parametrize("kernel", GLUON_KERNELS)
def test_repeats_launch_what_matmul_launches_for_the_same_tensors(monkeypatch, kernel):
    env = Env(monkeypatch, kernel=kernel)
    wait = _wait()
    fixed = dict(tile_order="round", start_chunk=1, wait=wait, check=False, num_sms=4)
    call = PreparedMatmul(**fixed)
    call(*_tensors(0)[:2], out=_tensors(0)[2])              # first call: planned by matmul, then kept
    assert env.plans == 1 and call._kept is not None
    for seed in (1, 2, 3):                                  # new tensors, same kind, new addresses
        a, b, out = _tensors(seed)
        before = launch_counts()["direct_tma"]
        assert call(a, b, out=out) is out
        L.matmul(a, b, out=out, **fixed)                    # matmul's own direct launch of the same call
        ours, theirs = env.launches[-2:]
        assert ours == theirs
        # (grid, stream, function, 8 head values), then a's descriptor map: this call's address
        assert ours[13] == ("map", a.data_ptr(), 128, 2, 8, (128, 64), (M, K), (K, 1), 0)
        assert ("map", b.data_ptr()) == ours[18][:2] and ("map", out.data_ptr()) == ours[23][:2]
        assert launch_counts()["direct_tma"] == before + 2 and last_plan().m == M
    assert env.plans == 1 and env.jit == 0 and last_plan().kernel == kernel


def _called_once_with_unit_scales(monkeypatch):
    """The arrange step of the scale tests: a fake environment, fused ag's kind of call, its
    tensors, and a first call with unit row/column scales (planned by matmul, then kept)."""
    env = Env(monkeypatch)
    call = _ag_call()
    a, b, out = _tensors(0)
    scale_a, scale_b = torch.ones(M, 1), torch.ones(1, N)
    call(a, b, out=out, scale_a=scale_a, scale_b=scale_b)
    return env, call, (a, b, out), (scale_a, scale_b)


def test_scales_are_taken_per_call(monkeypatch):
    env, call, (a, b, out), (s1, t1) = _called_once_with_unit_scales(monkeypatch)
    s2, t2 = torch.full((M, 1), 2.0), torch.full((1, N), 3.0)
    call(a, b, out=out, scale_a=s2, scale_b=t2)
    assert env.plans == 1
    assert sum(x is s2 for x in env.launches[-1]) == 1 and sum(x is t2 for x in env.launches[-1]) == 1
    assert not any(x is s1 for x in env.launches[-1])


@pytest.mark.parametrize("change", ["rows", "b strides", "dtype", "alignment", "scale added"])
def test_a_call_of_another_kind_goes_through_matmul_again(monkeypatch, change):
    env = Env(monkeypatch)
    call = _ag_call()
    a, b, out = _tensors(0)
    call(a, b, out=out)
    scale = {}
    if change == "rows":
        a, _, out = _tensors(1, m=M - 2)
    elif change == "b strides":
        b = b.contiguous()
    elif change == "dtype":
        out = out.half()
    elif change == "alignment":
        a = torch.empty(M * K + 1, dtype=torch.bfloat16)[1:].view(M, K)
    else:
        scale = dict(scale_a=torch.ones(()), scale_b=torch.ones(()))
    calls = len(L._PLANS) + env.plans
    call(a, b, out=out, **scale)
    assert len(L._PLANS) + env.plans > calls      # a new matmul key (and plan) for it


@pytest.mark.parametrize("signalled", [True, False], ids=["signalled", "route_only"])
@pytest.mark.parametrize("kernel", GLUON_KERNELS)
def test_the_epilogue_hooks_descriptors_are_kept(monkeypatch, kernel, signalled):
    # with signals or without (fused gemm_rs / gemm_ar's spec): the destinations' descriptors
    # kept, a and b's taken per call
    env = Env(monkeypatch, epilogue=True, kernel=kernel)
    dests = torch.empty(M, N, dtype=torch.bfloat16)
    spec = EpilogueSpec.from_tensors([dests[:M // W], dests[M // W:]],
                                     torch.zeros(W, dtype=torch.int32) if signalled else None,
                                     generation=1, chunk_m=M // W)
    fixed = dict(tile_order="owner", start_chunk=1, epilogue=spec, num_sms=4)
    call = PreparedMatmul(**fixed)
    a, b, _ = _tensors(0)
    assert call(a, b) is None and call._kept is not None
    assert sorted(call._kept[5]) == [2, 16]   # the destinations' (c_desc and epi_d0), not a's or b's
    a, b, _ = _tensors(1)
    call(a, b)
    L.matmul(a, b, **fixed)
    assert env.launches[-2] == env.launches[-1] and env.plans == 1 and last_plan().kernel == kernel


@pytest.mark.parametrize("why", ["no error word", "host check"])
def test_a_wait_hook_matmul_makes_per_call_state_for_is_never_kept(monkeypatch, why):
    env = Env(monkeypatch)
    wait = _wait() if why == "host check" else WaitSpec(signal=torch.zeros(W, dtype=torch.int32), generation=1,
                                                         chunk_m=M // W)
    monkeypatch.setattr(L, "check_error_word", lambda *a, **kw: None)
    call = PreparedMatmul(tile_order="round", start_chunk=1, wait=wait, check=why == "host check", num_sms=4)
    call(*_tensors(0)[:2], out=_tensors(0)[2])
    assert call._kept is None and env.launches


def test_a_launch_hook_set_later_sends_the_call_through_matmul(monkeypatch):
    env = Env(monkeypatch)
    call = _ag_call()
    a, b, out = _tensors(0)
    call(a, b, out=out)
    env.direct.knobs.launch_enter_hook = lambda *a: None   # a profiler's hook: Triton's own path now
    call(a, b, out=out)
    assert env.jit == 1 and call._kept is None


def test_another_threads_launch_is_never_kept_for_this_one(monkeypatch):
    env = Env(monkeypatch)
    fixed = dict(tile_order="round", start_chunk=1, wait=_wait(), check=False, num_sms=4)
    L._LAST_WS_LOCAL.parts = None
    seen = []

    def other():
        L.matmul(*_tensors(1)[:2], out=_tensors(1)[2], **fixed)
        seen.append(L._LAST_WS_LOCAL.parts)

    thread = threading.Thread(target=other)
    thread.start()
    thread.join()
    assert len(env.launches) == 1 and seen[0] is not None       # the other thread launched and kept its parts
    assert L._LAST_WS_LOCAL.parts is None                       # this thread sees none of them
    with pytest.raises(TypeError, match="per call"):
        PreparedMatmul(out=torch.empty(1), **fixed)


def test_clear_plans_drops_the_kept_launch_and_no_call_holds_its_scales(monkeypatch):
    env, call, (a, b, out), (scale_a, scale_b) = _called_once_with_unit_scales(monkeypatch)
    assert not any(x is scale_a or x is scale_b for x in call._kept[4])   # kept arguments: not this call's scales
    L.clear_plans()                                                        # e.g. after tuning: plan again
    call(a, b, out=out, scale_a=scale_a, scale_b=scale_b)
    assert env.plans == 2 and call._kept is not None
    call(a, b, out=out, scale_a=scale_a, scale_b=scale_b)
    assert env.plans == 2
