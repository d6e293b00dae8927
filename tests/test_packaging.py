"""The wheel ships the CUDA sources: cuda_src/*.cu and *.cuh land in the package ``cupa.cuda_src``.

cupa compiles its kernels at run time from those files, so a wheel without them imports fine and fails
on the first GPU call. The wheel is built from a copy of the checkout (no stale ``build/`` can hide a
missing file) without build isolation (no network).
"""

import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
CUDA_SRC = REPO / "cuda_src"
JUNK = shutil.ignore_patterns(".git", "build", "dist", "*.egg-info", "__pycache__", ".pytest_cache",
                              ".ipynb_checkpoints", ".whl", ".bench", "*.so")


def cuda_sources() -> list:
    return sorted(p.name for p in CUDA_SRC.glob("*") if p.suffix in (".cu", ".cuh")) if CUDA_SRC.is_dir() else []


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    src = tmp_path_factory.mktemp("src") / "cupa"
    shutil.copytree(REPO, src, ignore=JUNK)
    dist = tmp_path_factory.mktemp("dist")
    proc = subprocess.run([sys.executable, "-m", "pip", "wheel", str(src), "--no-deps", "--no-build-isolation",
                           "--no-cache-dir", "-w", str(dist)], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, f"wheel build failed:\n{proc.stdout}\n{proc.stderr}"
    wheels = list(dist.glob("cupa-*.whl"))
    assert len(wheels) == 1, wheels
    return wheels[0]


@pytest.fixture(scope="module")
def members(wheel) -> set:
    with zipfile.ZipFile(wheel) as zf:
        return set(zf.namelist())


def test_repo_has_cuda_sources():
    names = cuda_sources()
    assert any(n.endswith(".cu") for n in names), f"no .cu file in {CUDA_SRC} (found {names})"


def test_every_cuda_source_is_in_the_wheel(members):
    missing = [n for n in cuda_sources() if f"cupa/cuda_src/{n}" not in members]
    assert not missing, f"missing from the wheel under cupa/cuda_src/: {missing}"
    assert any(m.startswith("cupa/cuda_src/") and m.endswith(".cu") for m in members), sorted(members)


def test_every_python_module_is_in_the_wheel(members):
    modules = sorted(p.relative_to(REPO).as_posix() for p in (REPO / "cupa").rglob("*.py")
                     if "__pycache__" not in p.parts)
    missing = [m for m in modules if m not in members]
    assert not missing, f"modules missing from the wheel (add their package to pyproject.toml): {missing}"


def test_wheel_metadata(wheel, members):
    with zipfile.ZipFile(wheel) as zf:
        info = next(m for m in members if m.endswith(".dist-info/METADATA"))
        meta = zf.read(info).decode()
        entry = zf.read(info.replace("METADATA", "entry_points.txt")).decode()
    assert "Requires-Dist: numpy" in meta and "Requires-Dist: ml_dtypes" in meta.replace("ml-dtypes", "ml_dtypes")
    assert "cupa = cupa.__main__:main" in entry


def test_installed_wheel_finds_its_cuda_sources(wheel, tmp_path):
    target = tmp_path / "site"
    proc = subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "--no-index", "--target",
                           str(target), str(wheel)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    probe = ("import importlib.resources as r, cupa, cupa.cuda_src; "
             "print(cupa.__file__); print(' '.join(sorted(p.name for p in r.files('cupa.cuda_src').iterdir())))")
    env = dict(os.environ, PYTHONPATH=str(target))
    proc = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, cwd=tmp_path,
                          env=env, timeout=120)
    assert proc.returncode == 0, proc.stderr
    where, names = proc.stdout.splitlines()
    assert Path(where).is_relative_to(target), f"imported cupa from {where}, not the installed wheel"
    missing = set(cuda_sources()) - set(names.split())
    assert not missing, f"the installed package lacks {sorted(missing)}"


def test_wheel_ships_the_license(wheel, members):
    licenses = [m for m in members if m.endswith("LICENSE")]
    assert licenses, sorted(members)
    with zipfile.ZipFile(wheel) as zf:
        meta = zf.read(next(m for m in members if m.endswith(".dist-info/METADATA"))).decode()
        assert "Apache License" in zf.read(licenses[0]).decode()
    assert "License-Expression: Apache-2.0" in meta, meta[:2000]


@pytest.fixture(scope="module")
def sdist(tmp_path_factory):
    src = tmp_path_factory.mktemp("sdist_src") / "cupa"
    shutil.copytree(REPO, src, ignore=JUNK)
    dist = tmp_path_factory.mktemp("sdist")
    proc = subprocess.run([sys.executable, "-m", "build", "--sdist", "--no-isolation", "-o", str(dist), str(src)],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, f"sdist build failed:\n{proc.stdout}\n{proc.stderr}"
    out = proc.stdout + proc.stderr
    assert "Deprecat" not in out, [line for line in out.splitlines() if "eprecat" in line]
    archives = list(dist.glob("cupa-*.tar.gz"))
    assert len(archives) == 1, archives
    import tarfile

    root = tmp_path_factory.mktemp("sdist_tree")
    with tarfile.open(archives[0]) as tf:
        tf.extractall(root, filter="data")
    return next(root.iterdir())


def test_sdist_holds_what_the_tests_import(sdist):
    wanted = ["LICENSE", "README.md", "pyproject.toml", "tests/conftest.py", "tests/util.py",
              "tests/gpu/__init__.py", "tests/oracles/ort_gqa.py", "tests/data/jit_smoke.cu"]
    wanted += [p.relative_to(REPO).as_posix() for p in (REPO / "notebooks").glob("*.ipynb")]
    wanted += [f"cuda_src/{n}" for n in cuda_sources()]
    missing = [w for w in wanted if not (sdist / w).is_file()]
    assert not missing, f"missing from the sdist: {missing}"


def test_tests_run_from_the_sdist(sdist):
    env = dict(os.environ, PYTHONPATH=str(sdist))
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                           "tests/test_contract_validation.py"],
                          capture_output=True, text=True, cwd=sdist, env=env, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert " passed" in proc.stdout
