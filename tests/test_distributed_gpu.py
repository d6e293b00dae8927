"""cupa.distributed with NCCL on two GPUs: context parallel and tensor parallel by heads, each rank on
its own GPU, against the single-process NumPy reference (the CUDA backends must serve return_lse).

Processes are spawned (CUDA does not survive a fork); the checks are those of test_distributed.py
with the inputs copied to each rank's GPU.
"""

from pathlib import Path

import numpy as np
import pytest

from tests import test_distributed as cpu

pytestmark = pytest.mark.gpu

WORLD = 2


def SERVED(features: dict) -> bool:
    """The CPU checks' features the CUDA backends serve (LATENT and attention_bias have backends of their own)."""
    return not (features.get("latent") or features.get("bias"))


def _worker(rank, world, rendezvous, seed):
    import traceback

    import torch
    import torch.distributed as dist

    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=f"file://{rendezvous}", rank=rank, world_size=world)
    try:
        device = torch.device("cuda", rank)
        for i, features in enumerate(filter(SERVED, cpu.CP_FEATURES)):
            cpu.check_context_parallel(rank, world, None, np.random.default_rng([seed, i]), features, device)
        cpu.check_context_parallel_shifted(rank, world, None, np.random.default_rng([seed, 99]), device)
        for i, features in enumerate(filter(SERVED, cpu.TP_CASES)):
            cpu.check_tensor_parallel(rank, world, None, np.random.default_rng([seed, 50 + i]), features, device)
        torch.cuda.synchronize()
        dist.barrier()
    except BaseException:
        Path(f"{rendezvous}.rank{rank}").write_text(traceback.format_exc())
        raise
    finally:
        dist.destroy_process_group()


def test_context_and_tensor_parallel_on_nccl(rng, tmp_path):
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available() or torch.cuda.device_count() < WORLD:
        pytest.skip(f"needs {WORLD} CUDA devices")
    import torch.multiprocessing as mp

    seed = int(rng.integers(1 << 31))
    rendezvous = tmp_path / "rendezvous"
    try:
        mp.spawn(_worker, args=(WORLD, str(rendezvous), seed), nprocs=WORLD, join=True)
    except mp.ProcessRaisedException:
        causes = [p.read_text() for p in sorted(tmp_path.glob("rendezvous.rank*"))]
        pytest.fail("a rank failed:\n" + (causes[0] if causes else "(no traceback written)"))
