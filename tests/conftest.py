"""Shared test configuration: the `gpu` marker skips cleanly where no CUDA device is usable."""

import functools
import os
import secrets

import pytest


@functools.lru_cache(maxsize=None)
def gpu_available() -> bool:
    try:
        import cupy

        return cupy.cuda.is_available() and cupy.cuda.runtime.getDeviceCount() > 0
    except Exception:  # no cupy, no driver, no device
        return False


_GPU_SKIPPED = []


def pytest_collection_modifyitems(config, items):
    if gpu_available():
        return
    skip = pytest.mark.skip(reason="needs a usable CUDA device (cupy with a driver and a GPU)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
            _GPU_SKIPPED.append(item.nodeid)


def pytest_terminal_summary(terminalreporter):
    """One line for the GPU tests skipped without a device (instead of one per location)."""
    if _GPU_SKIPPED:
        files = len({n.split("::")[0] for n in _GPU_SKIPPED})
        terminalreporter.write_line(f"{len(_GPU_SKIPPED)} GPU tests in {files} files skipped: no usable CUDA "
                                    "device here (run them with: python -m pytest -m gpu)")


@pytest.fixture
def rng(request):
    """A fresh random generator per test (fresh data every run, never zeros).

    The seed is reported with a failure; set CUPA_TEST_SEED to replay it.
    """
    import numpy as np

    seed = int(os.environ.get("CUPA_TEST_SEED", "0")) or secrets.randbits(31)
    request.node.cupa_seed = seed
    return np.random.default_rng(seed)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    seed = getattr(item, "cupa_seed", None)
    if seed is not None and report.failed:
        report.sections.append(("cupa seed", f"replay with CUPA_TEST_SEED={seed}"))


@pytest.fixture(scope="module")
def cp():
    """CuPy (GPU tests only: the gpu marker has skipped the test where no device is usable)."""
    import cupy

    return cupy


@pytest.fixture
def torch_cuda():
    """torch with a CUDA device, or a skip."""
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("torch has no CUDA device")
    return torch
