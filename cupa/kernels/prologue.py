"""Launch of the fused prologue kernel (cuda_src/prologue.cu)."""

from __future__ import annotations

from .. import jit
from ..contract import Problem
from . import registry, types
from .types import f32, i32, ptr

PROLOGUE_THREADS = 128


def launch_prologue(problem: Problem, dev: dict, q_workspace) -> None:
    """Split/normalize/rotate the new tokens, write Q to ``q_workspace`` (N, H, D) and K/V to the caches.

    Runs on CuPy's current stream; ``dev`` maps input names to CuPy arrays or None.
    """
    p, a = problem, problem.attrs
    kernel = jit.get_kernel(registry.prologue_spec(p.dtype, p.cache_kind))
    shared = (PROLOGUE_THREADS // 32) * p.head_size * 4
    rows = p.num_heads + p.kv_num_heads * (1 if p.latent else 2)
    kernel(
        (p.token_count, -(-rows // (PROLOGUE_THREADS // 32))), (PROLOGUE_THREADS,),
        (dev["query"], ptr(dev["key"]), ptr(dev["value"]), dev["key_cache"], ptr(dev["value_cache"]),
         dev["cumulative_sequence_length"], dev["past_seqlens"], dev["block_table"],
         ptr(dev["cos_cache"]), ptr(dev["sin_cache"]), ptr(dev["slot_mapping"]),
         ptr(dev["q_norm_weight"]), ptr(dev["k_norm_weight"]), ptr(dev["k_scale"]), ptr(dev["v_scale"]),
         ptr(dev["query_positions"]), q_workspace,
         i32(p.num_heads), i32(p.kv_num_heads), i32(p.head_size), i32(p.batch_size), i32(p.num_blocks),
         i32(p.block_size), i32(p.max_blocks_per_seq), i32(p.packed_qkv), i32(not p.latent),
         i32(p.rotary_dim), i32(p.rotary_max_pos), i32(a.rotary_offset), i32(a.rotary_interleaved),
         f32(a.qk_norm_epsilon), i32(types.QUANT_CODE[p.k_quant]), i32(types.QUANT_CODE[p.v_quant])),
        shared_mem=shared,
    )
