"""cupa.distributed with NCCL on two GPUs: context parallel and tensor parallel by heads, each rank on
its own GPU, against the single-process NumPy reference (the CUDA backends must serve return_lse).

Processes are spawned (CUDA does not survive a fork); the checks are those of test_distributed.py
with the inputs copied to each rank's GPU.
"""

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from tests import test_distributed as cpu  # noqa: E402

pytestmark = pytest.mark.gpu

WORLD = 2


def served(features: dict) -> bool:
    """The CPU checks' features the CUDA backends serve (LATENT and attention_bias have backends of their own)."""
    return not (features.get("latent") or features.get("bias"))


def _checks(rank, seed):
    device = torch.device("cuda", rank)
    for i, features in enumerate(filter(served, cpu.CP_FEATURES)):
        cpu.check_context_parallel(rank, WORLD, None, np.random.default_rng([seed, i]), features, device)
    cpu.check_context_parallel_shifted(rank, WORLD, None, np.random.default_rng([seed, 99]), device)
    for i, features in enumerate(filter(served, cpu.TP_CASES)):
        cpu.check_tensor_parallel(rank, WORLD, None, np.random.default_rng([seed, 50 + i]), features, device)


def test_context_and_tensor_parallel_on_nccl(rng, tmp_path):
    if not torch.cuda.is_available() or torch.cuda.device_count() < WORLD:
        pytest.skip(f"needs {WORLD} CUDA devices")
    cpu.run_ranks(_checks, WORLD, "nccl", tmp_path, int(rng.integers(1 << 31)), "spawn")
