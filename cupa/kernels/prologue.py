"""Launch of the fused prologue kernel (cuda_src/prologue.cu)."""

from __future__ import annotations

from .. import jit
from ..contract import Problem
from ..device import DeviceInfo
from ..options import Options
from . import launch, registry, types
from .launch import POINTER
from .types import f32, i32

PROLOGUE_THREADS = 128

#: The prologue's pointer parameters, in order: input names, then the Q workspace it writes.
POINTER_INPUTS = ("query", "key", "value", "key_cache", "value_cache", "cumulative_sequence_length",
                  "past_seqlens", "block_table", "cos_cache", "sin_cache", "slot_mapping", "q_norm_weight",
                  "k_norm_weight", "k_scale", "v_scale", "query_positions")


def q_passthrough(problem: Problem) -> bool:
    """True when the prologue would copy Q unchanged (unpacked, no QK-norm, no rotary): the attention
    kernels then read ``query`` itself (same (N, H, D) layout) and the prologue skips the Q rows."""
    p = problem
    return not p.packed_qkv and not p.has_qk_norm and p.rotary_dim == 0


# Row groups per token: one CTA per group of 4 rows while the grid is small (decode: latency), fewer
# and fuller CTAs once the token count alone fills the GPU many times over (prefill: the token lookup
# is amortized over more rows).
_ROW_GROUP_CTAS_PER_SM = 16
#: mirrors PROLOGUE_MAX_TPC in cuda_src/prologue.cu (at most one token per warp)
MAX_TOKENS_PER_CTA = 4
# Tokens are grouped into CTAs once they alone give this many CTAs per SM (a threshold tuned on the
# device; at 96 registers, 5 prologue CTAs fit an SM at a time).
_TOKENS_CTAS_PER_SM = 10


def prologue_launcher(problem: Problem, device: DeviceInfo, options: Options, counters_per_token: int = 0,
                      beside: bool = False) -> launch.Launcher:
    """The prologue launch of ``problem`` on ``device`` (the current device): pointers are :data:`POINTER_INPUTS`
    (0 for an absent input) followed by the Q workspace (N, H, D) of T (unused under
    :func:`q_passthrough`) and the decode kernel's split counters (``counters_per_token`` int32 per
    token, zeroed by the prologue; 0: none).

    ``beside``: for a prologue that only copies K/V rows (unpacked, no QK-norm, no rotary, a T cache),
    a few fat CTAs instead: ``options._tuning.prologue_beside_sms`` CTAs of 512 threads, each using a whole SM's registers,
    so the prefill attention kernel launched after it (programmatic) fills every other SM at once
    instead of waiting for the prologue's CTAs to drain; each warp copies every 16th token of its
    CTA's consecutive tokens. The same writes either way."""
    p, a = problem, problem.attrs
    kernel = jit.get_kernel(registry.prologue_spec(p.dtype, p.cache_kind, token_loop=beside,
                                                   v_cache_kind=p.v_cache_kind))
    if beside:
        threads, groups = BESIDE_THREADS, 1
        sms = options._tuning.prologue_beside_sms
        tpc = -(-p.token_count // min(sms, -(-p.token_count // (BESIDE_THREADS // 32))))
    else:
        threads = PROLOGUE_THREADS
        groups, tpc = prologue_grid(p, device.sm_count)
    shared = (threads // 32) * p.head_size * 4
    write_q = not q_passthrough(p)
    args = (POINTER,) * (len(POINTER_INPUTS) + 2) + (
        i32(counters_per_token), i32(write_q), i32(p.num_heads), i32(p.kv_num_heads), i32(p.head_size),
        i32(p.batch_size), i32(p.num_blocks), i32(p.block_size), i32(p.max_blocks_per_seq), i32(p.packed_qkv),
        i32(not p.latent), i32(p.rotary_dim), i32(p.rotary_max_pos), i32(a.rotary_offset),
        i32(a.rotary_interleaved), f32(a.qk_norm_epsilon), i32(types.QUANT_CODE[p.k_quant]),
        i32(types.QUANT_CODE[p.v_quant]), i32(p.token_count), i32(tpc))
    return launch.Launcher(kernel, (-(-p.token_count // tpc), groups), (threads,), args, shared_mem=shared)


#: Threads per CTA of the prologue beside the prefill kernel (prologue_launcher, beside=True; PROLOGUE_BESIDE_THREADS
#: in cuda_src/prologue.cu); ``Options._tuning.prologue_beside_sms`` such CTAs run, each taking an SM's registers.
BESIDE_THREADS = 512


def prologue_grid(problem: Problem, sm_count: int) -> tuple:
    """``(row groups per token, tokens per CTA)`` of the prologue launch, from static sizes only.

    Few tokens: up to one CTA per group of 4 rows of a token (latency). Many tokens: one CTA per
    token, then (once the tokens alone give ``_TOKENS_CTAS_PER_SM`` CTAs per SM) up to
    :data:`MAX_TOKENS_PER_CTA` tokens per CTA, so that each thread keeps more bytes in flight.
    """
    p = problem
    rows = (0 if q_passthrough(p) else p.num_heads) + p.kv_num_heads * (1 if p.latent else 2)
    groups = -(-rows // (PROLOGUE_THREADS // 32))
    groups = max(1, min(groups, -(-_ROW_GROUP_CTAS_PER_SM * sm_count // max(1, p.token_count))))
    tpc = 1
    if groups == 1:
        tpc = max(1, min(MAX_TOKENS_PER_CTA, p.token_count // (_TOKENS_CTAS_PER_SM * sm_count)))
    return groups, tpc

