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


def _output_cases(tmp_path):
    """(argv, message) pairs: outputs that cannot be written, each refused before any work."""
    a_file = tmp_path / "a_file"
    a_file.write_text("not a directory\n")
    return [
        (["bench", "--quick", "--png", f"{a_file}/x.png"], f"{a_file} is a file, not a directory"),
        (["bench", "--quick", "--json", f"{a_file}/x.json"], f"{a_file} is a file, not a directory"),
        (["bench", "--quick", "--json", f"{a_file}/deeper/dir"], f"{a_file} is a file, not a directory"),
        (["bench", "--quick", "--timeline", f"{a_file}/t.png"], f"{a_file} is a file, not a directory"),
        (["bench", "--quick", "--png", str(tmp_path)], "give a path ending in .png"),
        (["bench", "--quick", "--md", f"{a_file}/t.md"], f"{a_file} is a file, not a directory"),
        (["bench", "layer", "--quick", "--json", f"{a_file}/l.json"], f"{a_file} is a file, not a directory"),
        (["plan", "--op", "ag_gemm", "--m", "1024", "--n", "512", "--k", "512", "--world-size", "2",
          "--timeline", f"{a_file}/t.png"], f"{a_file} is a file, not a directory"),
        (["plan", "--op", "ag_gemm", "--m", "1024", "--n", "512", "--k", "512", "--world-size", "2",
          "--timeline", str(tmp_path / "t.txt")], "give a path ending in .png"),
    ]


@pytest.mark.parametrize("case", range(9))
def test_output_paths_are_checked_before_the_work(tmp_path, capsys, monkeypatch, case):
    """Issue 31.3: an output that cannot be written is one line, exit 2, before the benchmark or plan runs."""
    import importlib

    import tpfuse.bench.layer
    import tpfuse.bench.run

    monkeypatch.setattr(tpfuse.bench.run, "run_bench", _no_work)
    monkeypatch.setattr(tpfuse.bench.layer, "run_layer_bench", _no_work)
    monkeypatch.setattr(importlib.import_module("tpfuse.report"), "run_plan_cli", _no_work)  # where `tpfuse plan` runs
    argv, message = _output_cases(tmp_path)[case]
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1, err


def test_plan_timeline_into_a_new_folder_still_works(tmp_path, capsys):
    """The check refuses only what cannot be written: a folder that does not exist yet is created."""
    out = tmp_path / "new" / "t.png"
    assert cli.main(["plan", "--op", "ag_gemm", "--m", "1024", "--n", "512", "--k", "512", "--world-size", "2",
                     "--timeline", str(out)]) == 0
    assert out.stat().st_size > 0


def test_plan_help_lists_the_hardware_profiles(capsys):
    from tpfuse.model.hardware import PROFILES

    with pytest.raises(SystemExit):
        cli.main(["plan", "--help"])
    out = capsys.readouterr().out
    assert "hardware profiles" in out
    assert all(name in out for name in PROFILES)
