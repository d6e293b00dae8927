"""`python -m cupa info` and `python -m cupa demo` in a subprocess, as a user runs them."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from .conftest import gpu_available

REPO = Path(__file__).resolve().parents[1]


def run_cupa(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    # PYTHONPATH makes the checkout importable even where cupa is not installed.
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])))
    return subprocess.run([sys.executable, "-m", "cupa", *args], capture_output=True, text=True,
                          timeout=timeout, env=env, cwd=REPO)


def test_info_reports_versions_and_cache_dir():
    proc = run_cupa("info")
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    heads = [line.split()[0] for line in lines if line.strip()]
    for key in ("cupa", "numpy", "ml_dtypes", "cupy", "kernel"):
        assert key in heads, f"`cupa info` lacks a {key!r} line:\n{proc.stdout}"
    import cupa

    assert any(line.startswith("cupa") and cupa.__version__ in line for line in lines), proc.stdout
    assert any("kernel cache" in line for line in lines), proc.stdout


def test_info_honours_cupy_cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("CUPY_CACHE_DIR", str(tmp_path / "kcache"))
    proc = run_cupa("info")
    assert proc.returncode == 0, proc.stderr
    assert str(tmp_path / "kcache") in proc.stdout


def test_demo_numpy_backend_passes():
    proc = run_cupa("demo", "--backend", "numpy")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    out = proc.stdout
    assert "result: PASS" in out, out
    assert "prefill" in out and "decode 4" in out, out
    assert "reference" in out, out


def test_demo_auto_runs_and_says_where():
    proc = run_cupa("demo")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "result: PASS" in proc.stdout, proc.stdout
    if not gpu_available():
        assert "note" in proc.stdout and "NumPy" in proc.stdout, proc.stdout


def test_demo_cuda_without_device_exits_2():
    if gpu_available():
        pytest.skip("a GPU is present: --backend cuda runs there (see the gpu test)")
    proc = run_cupa("demo", "--backend", "cuda")
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "unavailable" in proc.stdout


@pytest.mark.gpu
def test_demo_cuda_backend_passes():
    proc = run_cupa("demo", "--backend", "cuda", timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "result: PASS" in proc.stdout and "CuPy arrays" in proc.stdout, proc.stdout


def test_unknown_subcommand_is_a_usage_error():
    proc = run_cupa("bogus")
    assert proc.returncode == 2
    assert "usage" in proc.stderr


def test_bare_command_prints_help():
    proc = run_cupa()
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("usage: python -m cupa") and "demo" in proc.stdout and "info" in proc.stdout


@pytest.mark.skipif(gpu_available(), reason="a device is usable here")
def test_info_does_not_offer_cuda_backends_without_a_device():
    proc = run_cupa("info")
    line = next(line for line in proc.stdout.splitlines() if line.startswith("CUDA backends"))
    assert "none usable here" in line and "decode" in line, line
    assert any(line.startswith("NVRTC") for line in proc.stdout.splitlines()), proc.stdout


_HIDE_CUPY = """
import importlib.abc, sys
class Hide(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split('.')[0] in ('cupy', 'cupy_backends'):
            raise ModuleNotFoundError(name)
sys.meta_path.insert(0, Hide())
import importlib.util
importlib.util.find_spec = (lambda f: (lambda name, *a: None if name.split('.')[0] in ('cupy', 'cupy_backends')
                                       else f(name, *a)))(importlib.util.find_spec)
from cupa import compile
sys.exit(compile.main(['--check']))
"""


def test_compile_check_without_cupy_says_what_to_install():
    env = dict(os.environ, PYTHONPATH=str(REPO))
    proc = subprocess.run([sys.executable, "-c", _HIDE_CUPY], capture_output=True, text=True, timeout=120, env=env,
                          cwd=REPO)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "pip install 'cupa[cuda13]'" in lines[0] and "Traceback" not in proc.stderr, lines
