"""Issue 31.5: README's python snippets run as written (on CPU: gloo ranks instead of NCCL)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

README = Path(__file__).resolve().parents[2] / "README.md"


def python_blocks() -> list[str]:
    return re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)


def run_usage_block(rank: int, world_size: int, code: str) -> str:
    """On a rank of an initialized gloo group: the usage block with inputs of the shapes its
    comments give (W = 2, M = 8, K = 6, N = 4); returns what it printed."""
    import contextlib
    import io

    import torch

    torch.manual_seed(rank)
    inputs = {"x_shard": torch.randn(4, 6), "w1": torch.randn(2, 6),   # x_shard [M/W, K], w1 [N/W, K]
              "h": torch.randn(8, 3), "w2": torch.randn(4, 3)}          # h [M, K/W], w2 [N, K/W]
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        exec(compile(code, "README.md", "exec"), dict(inputs))
    return printed.getvalue()


def test_readme_has_the_blocks_this_test_runs():
    blocks = python_blocks()
    assert len(blocks) == 2, "README has a new python block: run it in tests/cpu/test_readme.py"
    assert 'dist.init_process_group("nccl")' in blocks[0] and "RankPool" in blocks[1]


def test_usage_block_runs_on_two_cpu_ranks(rank_pool):
    code = python_blocks()[0]
    # The ranks' gloo group is already initialized (the block's first call, for NCCL, is the only change).
    code = code.replace('dist.init_process_group("nccl")', "pass")
    printed = rank_pool(2).run(run_usage_block, code, timeout=120)
    for out in printed:
        strategy, ms, _ = out.split(" ", 2)
        assert strategy in ("copy_engine", "fused", "ring", "unfused")
        assert float(ms) > 0 and "ms predicted" in out


def test_rankpool_script_runs_as_written(tmp_path):
    script = tmp_path / "ranks.py"
    script.write_text(python_blocks()[1])
    out = subprocess.run([sys.executable, str(script)], cwd=tmp_path, capture_output=True, text=True, timeout=180)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[(64, 16), (64, 16)]"
