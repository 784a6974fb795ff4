"""Issue 31.1: a script run from the directory that contains a clone (a ``tpfuse/`` folder in the
working directory) imports the installed tpfuse, not the clone's folder.

With the old flat layout the editable install found ``tpfuse`` through a finder that Python asks
after its path finder, so the path finder's namespace package made of ``./tpfuse/`` (a folder with
no ``__init__.py``) won: ``module 'tpfuse' has no attribute 'ag_gemm'``.  With ``src/tpfuse`` the
installed package is a regular package on ``sys.path`` and a namespace portion cannot shadow it."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import tpfuse

PROBE = "import tpfuse; tpfuse.ag_gemm; print(tpfuse.__version__); print(tpfuse.__file__)"


def _clone_next_door(tmp_path: Path) -> Path:
    """``tmp_path/tpfuse``: a folder that looks like a clone of this repository (no __init__.py at its
    top; the package under src/); returns the directory that contains it."""
    clone = tmp_path / "tpfuse"
    (clone / "src" / "tpfuse").mkdir(parents=True)
    (clone / "src" / "tpfuse" / "__init__.py").write_text("raise ImportError('the clone was imported')\n")
    (clone / "tests").mkdir()
    (clone / "pyproject.toml").write_text("[project]\nname = 'tpfuse'\n")
    (clone / "README.md").write_text("# tpfuse\n")
    return tmp_path


def _python(cwd: Path, *args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *args], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=120)


def test_script_next_to_a_clone_imports_the_installed_package(tmp_path):
    here = _clone_next_door(tmp_path)
    out = _python(here, "-c", PROBE)
    assert out.returncode == 0, out.stderr
    version, file = out.stdout.split()
    assert version == tpfuse.__version__
    assert Path(file).resolve() == Path(tpfuse.__file__).resolve()
    assert here.resolve() not in Path(file).resolve().parents


def test_python_m_tpfuse_next_to_a_clone(tmp_path):
    """`python -m` puts the working directory first on sys.path: still the installed package."""
    here = _clone_next_door(tmp_path)
    out = _python(here, "-m", "tpfuse", "--help")
    assert out.returncode == 0, out.stderr
    assert "demo" in out.stdout and "plan" in out.stdout


def test_the_folder_does_shadow_when_the_package_is_not_on_sys_path(tmp_path):
    """The control: without site-packages and PYTHONPATH (-S, empty PYTHONPATH) the clone's folder
    is imported as a namespace package and the call fails as it did for the user, so the tests
    above pass because of where the installed package is found, not because the fixture is inert."""
    here = _clone_next_door(tmp_path)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    out = _python(here, "-S", "-c", PROBE, env=env)
    assert out.returncode != 0
    assert "has no attribute 'ag_gemm'" in out.stderr, out.stderr
