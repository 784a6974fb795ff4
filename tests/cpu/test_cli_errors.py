"""Issue 21.6: argument errors of `tpfuse demo | bench` are one line on stderr and exit code 2,
before any work starts (the `plan` ones are in test_plan.py)."""

from __future__ import annotations

import pytest
import torch

from tpfuse import cli


def _no_work(*args, **kwargs):
    raise AssertionError("the command started working before rejecting its arguments")


@pytest.mark.parametrize("argv, message", [
    (["demo", "--scale", "0"], "--scale: 0 must be >= 1"),
    (["demo", "--repeats", "0"], "--repeats: 0 must be >= 1"),
    (["demo", "--world-size", "0"], "--world-size: 0 must be >= 1"),
    (["bench", "--hardware", "foo"], "unknown profile 'foo'"),
])
def test_argument_errors_are_one_line_exit_2(capsys, monkeypatch, argv, message):
    import tpfuse.bench.run
    import tpfuse.demo

    monkeypatch.setattr(tpfuse.demo, "run_demo", _no_work)
    monkeypatch.setattr(tpfuse.bench.run, "run_bench", _no_work)
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1, err


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without a CUDA GPU")
def test_demo_on_cuda_without_a_gpu(capsys, monkeypatch):
    import tpfuse.demo

    monkeypatch.setattr(tpfuse.demo, "run_demo", _no_work)
    assert cli.main(["demo", "--device", "cuda"]) == 2
    err = capsys.readouterr().err
    assert "--device cuda: no CUDA GPU is visible" in err and err.count("\n") == 1, err
