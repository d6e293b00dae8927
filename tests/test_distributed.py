"""cupa.distributed on the CPU: gloo process groups of 2, 3 and 4 ranks against one process.

One start of 4 processes (torch.multiprocessing, forked: the children inherit the imported modules,
so the whole check takes about 2 s) runs every multi-process check, on the default group (4 ranks)
and on subgroups of 2 and 3 ranks; each rank builds the same random case from a shared
seed, computes its share, and compares the collective result with the single-process call it also
computes. The in-process tests check the head sharding and the errors without a process group.
"""

import os
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import cupa  # noqa: E402
from tests.util import (assert_cache_close, assert_lse_close, assert_rel, make_case,  # noqa: E402
                        shard_block_tables)

WORLD = 4


def _torch_inputs(inputs: dict, device=None) -> dict:
    """Tensors of the NumPy inputs (fp8 caches as their bytes' view): CPU tensors sharing their memory,
    or copies on ``device``."""
    out = {}
    for name, v in inputs.items():
        if v is None or name == "attention_metadata":
            out[name] = v
            continue
        if v.dtype.name == "bfloat16":
            t = torch.from_numpy(v.view(np.int16)).view(torch.bfloat16)
        elif v.dtype.name == "float8_e4m3fn":
            t = torch.from_numpy(v.view(np.uint8)).view(torch.float8_e4m3fn)
        else:
            t = torch.from_numpy(v)
        out[name] = t if device is None else t.to(device)
    return out


def _numpy(t) -> np.ndarray:
    t = t.cpu()
    if t.dtype == torch.float8_e4m3fn:
        t = t.view(torch.uint8)
    if t.dtype == torch.bfloat16:
        import ml_dtypes

        return t.view(torch.int16).numpy().view(ml_dtypes.bfloat16)
    return t.numpy()


def _lse_tol(device) -> float:
    """The lse tolerance: float32 rounding on the CPU reference, a CUDA backend's fp32 arithmetic on a GPU."""
    return 1e-6 if device is None else 1e-4


def _cache_steps(device) -> int:
    """Cache bytes equal to the reference's on the CPU; on a GPU, within one code or ulp (fp32 prologue)."""
    return 0 if device is None else 1


def _local_pages(inputs: dict, table: np.ndarray, rng) -> tuple:
    """A rank's own caches: the blocks its table maps (renumbered, in shuffled order) plus a garbage block."""
    blocks = np.unique(table[table >= 0])
    order = rng.permutation(blocks.size)
    local = dict(inputs)
    renumber = np.full(inputs["key_cache"].shape[0], -1, np.int64)
    renumber[blocks[order]] = np.arange(blocks.size)
    local["block_table"] = np.where(table >= 0, renumber[np.maximum(table, 0)], -1).astype(np.int32)
    for name in ("key_cache", "value_cache"):
        c = inputs[name]
        if c is not None:
            garbage = c[rng.integers(0, c.shape[0], size=1)]
            local[name] = np.ascontiguousarray(np.concatenate([c[blocks[order]], garbage]))
    return local, blocks[order]


# ------------------------------------------------------------------------------------------------
# the checks every rank runs (identical data from the seed on every rank)

CP_FEATURES = [
    dict(),
    dict(sink=True, window=6, softcap=2.0),
    dict(cache="int8", k_quant="PER_CHANNEL", v_quant="PER_TENSOR", sink=True, rotary="half"),
    dict(latent=True, v_head_size=24, scale=0.125, dtype="bfloat16"),
    dict(bias=(False, False), dtype="float32", qk_norm=True),
]


def check_context_parallel(rank, world, group, rng, features, device=None):
    import torch.distributed as dist

    from cupa import distributed

    case = make_case(rng, block_size=2, q_lens=(1, 3, 1, 0, 2), past=(9, 14, 0, 5, 21), unused_cols="neg", **features)
    ref = case.copy()
    want_out, want_lse = ref.run(return_lse=True)
    tables = shard_block_tables(rng, case.inputs["block_table"], world, how=rng.choice(["ranges", "scatter"]))
    page_rng = np.random.default_rng(rng.integers(1 << 31))
    local, blocks = _local_pages(case.inputs, tables[rank], page_rng)
    t = _torch_inputs(local, device)
    op = distributed.ContextParallelAttention(group=group, return_lse=True, **case.attrs)
    out, lse = op(**{k: v for k, v in t.items() if v is not None})
    assert isinstance(out, torch.Tensor) and dist.get_world_size(group) == world
    assert_rel(_numpy(out), want_out, case.dtype, what=f"rank {rank}/{world} output")
    assert_lse_close(_numpy(lse), want_lse, what=f"rank {rank}/{world} lse", tol=_lse_tol(device))
    for name in ("key_cache", "value_cache"):
        if local[name] is not None and blocks.size:
            assert_cache_close(_numpy(t[name])[:blocks.size], ref.inputs[name][blocks], steps=_cache_steps(device),
                               what=f"rank {rank}: {name} pages")


def check_context_parallel_shifted(rank, world, group, rng, device=None):
    """Position ranges [r*C, (r+1)*C) per rank as shifted shards (decode, RoPE through cos_cache[start:])."""
    from cupa import distributed

    bs, C = 4, 8
    case = make_case(rng, block_size=bs, q_lens=(1,) * 4, past=(3, 12, 20, 30), rotary="interleaved", sink=True,
                     max_position=64)
    want_out, want_lse = case.copy().run(return_lse=True)
    start = rank * C
    x = dict(case.inputs)
    bt = case.inputs["block_table"]
    table = np.ascontiguousarray(bt[:, start // bs:])
    if rank < world - 1:
        table[:, C // bs:] = -1          # the positions past this rank's range belong to the next ranks
    past = case.inputs["past_seqlens"]
    x.update(block_table=table, past_seqlens=np.where(past >= start, past - start, -1).astype(np.int32),
             cos_cache=np.ascontiguousarray(case.inputs["cos_cache"][start:]),
             sin_cache=np.ascontiguousarray(case.inputs["sin_cache"][start:]))
    t = _torch_inputs(x, device)
    out, lse = distributed.context_parallel_attention(**{k: v for k, v in t.items() if v is not None},
                                                           group=group, return_lse=True, **case.attrs)
    assert_rel(_numpy(out), want_out, case.dtype, what=f"rank {rank}/{world} shifted output")
    assert_lse_close(_numpy(lse), want_lse, what=f"rank {rank}/{world} shifted lse", tol=_lse_tol(device))


TP_CASES = [
    dict(num_heads=8, kv_num_heads=4),
    dict(num_heads=8, kv_num_heads=2, sink=True, cache="int8", k_quant="PER_CHANNEL", v_quant="PER_CHANNEL"),
    dict(num_heads=8, kv_num_heads=8, packed=True, bias=(False, False), rotary="half"),
    dict(num_heads=8, latent=True, v_head_size=24, scale=0.125),
]


def check_tensor_parallel(rank, world, group, rng, features, device=None):
    from cupa import distributed

    case = make_case(rng, block_size=4, q_lens=(2, 1, 3), past=(5, 11, 0), **features)
    ref = case.copy()
    want_out, want_lse = ref.run(return_lse=True)
    inputs, attrs = distributed.shard_heads(_torch_inputs(case.copy().inputs, device), case.attrs, rank, world)
    out, lse = cupa.paged_attention(**{k: v for k, v in inputs.items() if v is not None}, **attrs, return_lse=True)
    full, full_lse = distributed.gather_heads(out, group), distributed.gather_heads(lse, group)
    assert_rel(_numpy(full), want_out, case.dtype, what=f"rank {rank}/{world} heads output")
    assert_lse_close(_numpy(full_lse), want_lse, what=f"rank {rank}/{world} heads lse", tol=_lse_tol(device))
    _, _, kv0, kv1 = distributed.head_range(rank, world, case.attrs["num_heads"], case.attrs["kv_num_heads"])
    if not features.get("latent"):
        for name in ("key_cache", "value_cache"):
            assert_cache_close(_numpy(inputs[name]), np.ascontiguousarray(ref.inputs[name][:, :, kv0:kv1]),
                               steps=_cache_steps(device), what=name)


def _checks(rank, seed):
    """Every multi-process check on the CPU, on the default group (WORLD ranks) and subgroups of 2 and 3."""
    import torch.distributed as dist

    groups = {n: dist.new_group(list(range(n))) for n in (2, 3)}   # every rank creates every group
    groups[WORLD] = None
    for n, group in sorted(groups.items()):
        if rank >= n:
            continue
        for i, features in enumerate(CP_FEATURES):
            check_context_parallel(rank, n, group, np.random.default_rng([seed, n, i]), features)
        check_context_parallel_shifted(rank, n, group, np.random.default_rng([seed, n, 99]))
        for i, features in enumerate(TP_CASES):
            hk = 1 if features.get("latent") else features["kv_num_heads"]
            if n != 3 and (hk % n == 0 or n % hk == 0):
                check_tensor_parallel(rank, n, group, np.random.default_rng([seed, n, 50 + i]), features)


def _rank_main(rank, world, rendezvous, seed, backend, checks):
    """One rank: join the group, run ``checks(rank, seed)``; a failure's traceback is written beside the
    rendezvous file (the first rank to fail says why; the others then fail in a collective)."""
    import traceback

    import torch.distributed as dist

    if backend == "nccl":
        torch.cuda.set_device(rank)
    else:
        torch.set_num_threads(1)   # a forked child never enters the parent's intra-op thread pool
    dist.init_process_group(backend, init_method=f"file://{rendezvous}", rank=rank, world_size=world)
    try:
        checks(rank, seed)
        if backend == "nccl":
            torch.cuda.synchronize()
        dist.barrier()
    except BaseException:
        Path(f"{rendezvous}.rank{rank}").write_text(traceback.format_exc())
        raise
    finally:
        dist.destroy_process_group()


def run_ranks(checks, world: int, backend: str, tmp_path, seed: int, start_method: str) -> None:
    """Run ``checks(rank, seed)`` on ``world`` processes joined in one ``backend`` group; fail with the
    traceback of the first rank that failed for a reason of its own."""
    import torch.multiprocessing as mp

    rendezvous = tmp_path / "rendezvous"
    try:
        mp.start_processes(_rank_main, args=(world, str(rendezvous), seed, backend, checks), nprocs=world,
                           join=True, start_method=start_method)
    except mp.ProcessRaisedException:
        causes = [p.read_text() for p in sorted(tmp_path.glob("rendezvous.rank*"))]
        first = next((c for c in causes if "Connection closed by peer" not in c), causes[0] if causes else "")
        pytest.fail(f"a rank failed:\n{first}")


def test_context_and_tensor_parallel_on_gloo(rng, tmp_path):
    run_ranks(_checks, WORLD, "gloo", tmp_path, int(rng.integers(1 << 31)), "fork")


# ------------------------------------------------------------------------------------------------
# in-process checks (no process group)

@pytest.mark.parametrize("heads, world", [((8, 4), 2), ((8, 2), 4), ((8, 8), 4), ((6, 3), 6), ((8, 1), 8)])
def test_head_shards_run_alone_reproduce_the_call(rng, heads, world):
    from cupa import distributed

    H, Hk = heads
    case = make_case(rng, num_heads=H, kv_num_heads=Hk, head_size=16, block_size=4, q_lens=(2, 1, 3),
                     past=(5, 11, 0), sink=True, cache="int8", k_quant="PER_CHANNEL", v_quant="PER_TENSOR")
    want = case.copy().run()
    parts = []
    for r in range(world):
        inputs, attrs = distributed.shard_heads(case.copy().inputs, case.attrs, r, world)
        parts.append(cupa.paged_attention(**{k: v for k, v in inputs.items() if v is not None}, **attrs))
    got = np.concatenate(parts, axis=1)
    assert_rel(got, want, case.dtype)


def test_head_range_and_errors():
    from cupa import distributed

    assert distributed.head_range(1, 2, 8, 4) == (4, 8, 2, 4)
    assert distributed.head_range(3, 4, 8, 2) == (6, 8, 1, 2)      # KV head 1 on ranks 2 and 3
    for args, name in [((0, 3, 8, 4), "num_heads"), ((0, 2, 8, 3), "kv_num_heads"), ((0, 4, 8, 3), "kv_num_heads"),
                       ((2, 2, 8, 4), "rank")]:
        with pytest.raises(cupa.PagedAttentionError, match=f"^{name}: "):
            distributed.head_range(*args)


def test_context_parallel_wants_torch_tensors(rng):
    from cupa import distributed

    case = make_case(rng)
    with pytest.raises(cupa.PagedAttentionError, match="^query: got a numpy.ndarray; expected a torch tensor"):
        distributed.ContextParallelAttention(**case.attrs)(**{k: v for k, v in case.inputs.items() if v is not None})
    with pytest.raises(cupa.PagedAttentionError, match="^qk_output: "):
        distributed.ContextParallelAttention(qk_output=1, **case.attrs)


def test_import_cupa_does_not_import_torch():
    import subprocess
    import sys

    code = "import sys, cupa; cupa.merge_states; cupa.CascadeAttention; print('torch' in sys.modules)"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          env=dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[1])))
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "False"
