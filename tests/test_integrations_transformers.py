"""cupa as a transformers attention implementation (cupa.integrations.transformers).

Tiny randomly initialised models built from configs (no downloads): Llama (GQA), Qwen3 (QK-norm) and
GPT-OSS (attention sinks, sliding-window layers alternating with full ones), and Gemma 2 for logit
softcapping and a scale other than 1/sqrt(head_dim). Each generates 20 greedy
tokens with cupa and with transformers' own attention (sdpa; eager for GPT-OSS, which refuses sdpa):
single prompts, left-padded batches (``generate`` with a CupaCache) and continuous batching
(``generate_batch``). The tokens must be identical; in float16/bfloat16 a row may part at a step where
the reference's two best logits tie within rounding (the logits up to that step are compared too).
Negative controls (a wrong scale, a dropped sink) must change the tokens. GPU-marked versions run the
same tests on CUDA tensors.

Models are initialised from the ``rng`` fixture's seed with ``initializer_range=0.1`` (attention sharp
enough that its scale matters) and every expert of GPT-OSS's router active (a top-k with no tie to
break differently).
"""

import math

import pytest

torch = pytest.importorskip("torch")
_transformers = pytest.importorskip("transformers")

from transformers import (AttentionInterface, AutoModelForCausalLM, ContinuousBatchingConfig,  # noqa: E402
                          DynamicCache, Gemma2Config, GenerationConfig, GptOssConfig, LlamaConfig, Qwen3Config)

import cupa  # noqa: E402
from cupa.integrations import transformers as cupa_tf  # noqa: E402

if tuple(int(x) for x in _transformers.__version__.split(".")[:2]) not in cupa_tf.CONTINUOUS_BATCHING_RELEASES:
    pytest.skip(f"transformers {_transformers.__version__}: the integration is tested with "
                f"{cupa_tf.CONTINUOUS_BATCHING_RELEASES} (pip install 'cupa[transformers]')", allow_module_level=True)

NAME = cupa_tf.register()
KINDS = ("llama", "qwen3", "gpt_oss")
#: transformers' own attention each model is compared with
REFERENCE = {"llama": "sdpa", "qwen3": "sdpa", "gpt_oss": "eager", "gemma2": "eager"}
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
#: mantissa bits of each dtype, and the logit tolerance in units in the last place of the largest logit
MANTISSA = {torch.float32: 23, torch.bfloat16: 7, torch.float16: 10}
LOGIT_ULPS = {torch.float32: 64, torch.bfloat16: 8, torch.float16: 8}
NEW_TOKENS = 20
VOCAB = 128


def tiny_model(kind: str, seed: int, dtype=torch.float32, device="cpu", attn=None):
    torch.manual_seed(seed)
    common = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=16, initializer_range=0.1,
                  pad_token_id=0, eos_token_id=None, bos_token_id=None)
    if kind == "llama":
        config = LlamaConfig(**common, max_position_embeddings=256)
    elif kind == "qwen3":
        config = Qwen3Config(**common, max_position_embeddings=256)
    elif kind == "gemma2":     # logit softcapping, a scale that is not 1/sqrt(head_dim), sliding layers
        config = Gemma2Config(**common, sliding_window=4, attn_logit_softcapping=0.5, query_pre_attn_scalar=1)
    else:
        config = GptOssConfig(**common, num_local_experts=2, num_experts_per_tok=2, sliding_window=4,
                              layer_types=["sliding_attention", "full_attention"])
    model = AutoModelForCausalLM.from_config(config, attn_implementation=attn or REFERENCE[kind], dtype=dtype)
    if kind == "gpt_oss":
        with torch.no_grad():
            for layer in model.model.layers:
                layer.self_attn.sinks.normal_(0.0, 1.0)     # sinks that take a real share of the softmax
    return model.eval().to(device)


def prompts(seed: int, lengths) -> list:
    g = torch.Generator().manual_seed(seed + 1)
    return [torch.randint(1, VOCAB, (n,), generator=g).tolist() for n in lengths]


def left_padded(rows: list, device="cpu"):
    width = max(map(len, rows))
    ids = torch.zeros((len(rows), width), dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, r in enumerate(rows):
        ids[i, width - len(r):] = torch.tensor(r)
        mask[i, width - len(r):] = 1
    return ids.to(device), mask.to(device)


def greedy(model, ids, mask, **kw):
    config = GenerationConfig(max_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0,
                              return_dict_in_generate=True, output_logits=True)
    with torch.no_grad():
        return model.generate(ids, attention_mask=mask, generation_config=config, **kw)


def generate_both(kind, seed, rows, dtype=torch.float32, device="cpu", block_size=4, **cache_kw):
    """(reference output, cupa output) of greedy generation over the left-padded ``rows``."""
    model = tiny_model(kind, seed, dtype, device)
    ids, mask = left_padded(rows, device)
    ref = greedy(model, ids, mask)
    model.set_attn_implementation(NAME)
    cache = cupa_tf.CupaCache(model.config, block_size=block_size, **cache_kw)
    got = greedy(model, ids, mask, cache=cache)
    return model, ids, mask, ref, got


def assert_same_greedy(ref, got, prompt_length: int, dtype):
    """Tokens identical; a row may part only where the reference's logits tie within rounding.

    The logits of both runs agree within LOGIT_ULPS[dtype] ulps of the largest logit up to the step
    where a row parts (or to the end), so the comparison can fail on any attention error.
    """
    ref_logits, got_logits = torch.stack(ref.logits, 1).float().cpu(), torch.stack(got.logits, 1).float().cpu()
    ref_tokens, got_tokens = ref.sequences[:, prompt_length:].cpu(), got.sequences[:, prompt_length:].cpu()
    assert ref_tokens.shape == got_tokens.shape == (ref_logits.shape[0], NEW_TOKENS)
    for row in range(ref_tokens.shape[0]):
        differ = (ref_tokens[row] != got_tokens[row]).nonzero()
        stop = int(differ[0]) if len(differ) else NEW_TOKENS - 1
        top = float(ref_logits[row].abs().max())
        tol = LOGIT_ULPS[dtype] * 2.0 ** (math.floor(math.log2(top)) - MANTISSA[dtype])
        err = float((ref_logits[row, :stop + 1] - got_logits[row, :stop + 1]).abs().max())
        assert err <= tol, f"row {row}: logits differ by {err:.3g} (tolerance {tol:.3g}) before step {stop}"
        if len(differ):
            assert dtype != torch.float32, f"row {row}: tokens part at step {stop}: {ref_tokens[row]} vs {got_tokens[row]}"
            r, g = int(ref_tokens[row, stop]), int(got_tokens[row, stop])
            gap = float(ref_logits[row, stop, r] - ref_logits[row, stop, g])
            assert gap <= tol, f"row {row}: token {g} instead of {r} at step {stop}, logit gap {gap:.3g} > {tol:.3g}"


def seed_of(rng) -> int:
    return int(rng.integers(1, 2 ** 31))


#: the generation tests run on the CPU (the NumPy reference) and, GPU-marked, on CUDA (cupa's kernels)
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]
#: tokens per block of the CupaCache on each device
BLOCK_SIZE = {"cpu": 4, "cuda": 16}


@pytest.fixture
def device(request):
    name = request.param
    if name == "cuda" and not torch.cuda.is_available():
        pytest.skip("torch has no CUDA device")
    return name


# -- generate with a CupaCache ------------------------------------------------------------------------

@pytest.mark.parametrize("device", DEVICES, indirect=True)
@pytest.mark.parametrize("kind", KINDS)
def test_single_prompt(rng, kind, device):
    seed = seed_of(rng)
    _, ids, _, ref, got = generate_both(kind, seed, prompts(seed, [7]), device=device,
                                        block_size=BLOCK_SIZE[device], max_cache_len=40)
    assert got.sequences.device.type == device
    assert_same_greedy(ref, got, ids.shape[1], torch.float32)


@pytest.mark.parametrize("device", DEVICES, indirect=True)
@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("kind", KINDS)
def test_left_padded_batch(rng, kind, dtype, device):
    seed = seed_of(rng)
    rows = prompts(seed, [9, 4, 6] if dtype == "float32" or device == "cuda" else [8, 3])
    _, ids, _, ref, got = generate_both(kind, seed, rows, DTYPES[dtype], device=device,
                                        block_size=BLOCK_SIZE[device], max_cache_len=32)
    assert_same_greedy(ref, got, ids.shape[1], DTYPES[dtype])


@pytest.mark.parametrize("device", DEVICES, indirect=True)
def test_softcap_and_scale_gemma2(rng, device):
    """Gemma 2: softcapped scores at scale 1 (query_pre_attn_scalar=1); dropping the softcap moves the logits."""
    seed = seed_of(rng)
    model, ids, mask, ref, got = generate_both("gemma2", seed, prompts(seed, [9, 4, 6]), device=device,
                                               block_size=BLOCK_SIZE[device], max_cache_len=32)
    assert model.model.layers[0].self_attn.scaling == 1.0
    assert_same_greedy(ref, got, ids.shape[1], torch.float32)

    def without_softcap(module, *args, softcap=None, **kwargs):
        return cupa_tf.attention_forward(module, *args, **kwargs)

    with torch.no_grad():
        capped = model(ids, attention_mask=mask, use_cache=False).logits
        AttentionInterface.register(NAME, without_softcap)
        try:
            uncapped = model(ids, attention_mask=mask, use_cache=False).logits
        finally:
            AttentionInterface.register(NAME, cupa_tf.attention_forward)
    real = mask.bool()
    assert (capped[real] - uncapped[real]).abs().max() > 1e-3 * capped[real].abs().max()


def test_pool_grows_without_a_size(rng):
    """No max_cache_len nor num_blocks: the pool doubles as rows grow; the tokens do not change."""
    seed = seed_of(rng)
    rows = prompts(seed, [5, 2])
    _, ids, _, ref, got = generate_both("llama", seed, rows, block_size=2)
    assert_same_greedy(ref, got, ids.shape[1], torch.float32)


def test_reset_returns_every_block(rng):
    """reset() frees every block; the cache then serves another batch as a new one would."""
    seed = seed_of(rng)
    model = tiny_model("llama", seed, attn=NAME)
    cache = cupa_tf.CupaCache(model.config, block_size=4, max_cache_len=32)
    first, second = (left_padded(prompts(seed + i, [7, 3])) for i in (0, 1))
    greedy(model, *first, cache=cache)
    assert cache.pool.free.size < cache.pool.num_blocks
    cache.reset()
    assert cache.pool.free.size == cache.pool.num_blocks and cache.get_seq_length() == 0
    again = greedy(model, *second, cache=cache)
    fresh = greedy(model, *second, cache=cupa_tf.CupaCache(model.config, block_size=4, max_cache_len=32))
    assert torch.equal(again.sequences, fresh.sequences)


def test_cache_pages_hold_the_history(rng):
    """After generate, each row's pages hold exactly its real tokens' keys (what the model's projections give)."""
    seed = seed_of(rng)
    rows = prompts(seed, [6, 3])
    model = tiny_model("llama", seed, attn=NAME)
    ids, mask = left_padded(rows)
    cache = cupa_tf.CupaCache(model.config, block_size=4, max_cache_len=16)
    with torch.no_grad():
        model(ids, attention_mask=mask, cache=cache)
    dense = DynamicCache(config=model.config)
    model.set_attn_implementation("sdpa")
    with torch.no_grad():
        model(ids, attention_mask=mask, cache=dense)
    block_size = cache.block_size
    for layer_idx, layer in enumerate(cache.layers):
        keys = dense.layers[layer_idx].keys            # (B, Hk, S, D), left padded
        for row, tokens in enumerate(rows):
            blocks = torch.from_numpy(cache.table[row])
            pos = torch.arange(len(tokens))
            stored = layer.key_cache[blocks[pos // block_size], pos % block_size]      # (n, Hk, D)
            expected = keys[row, :, ids.shape[1] - len(tokens):].transpose(0, 1)
            torch.testing.assert_close(stored, expected, rtol=1e-6, atol=1e-6)


def padded_reference(kind: str, seed: int, device="cpu"):
    """A model, a left-padded batch of three prompts, and transformers' own greedy output for it."""
    model = tiny_model(kind, seed, device=device)
    ids, mask = left_padded(prompts(seed, [9, 4, 6]), device)
    return model, ids, mask, greedy(model, ids, mask)


@pytest.mark.parametrize("device", DEVICES, indirect=True)
def test_wrong_scale_changes_the_tokens(rng, device):
    model, ids, mask, ref = padded_reference("llama", seed_of(rng), device)
    model.set_attn_implementation(NAME)
    for layer in model.model.layers:
        layer.self_attn.scaling *= 1.5
    got = greedy(model, ids, mask, cache=cupa_tf.CupaCache(model.config, block_size=BLOCK_SIZE[device],
                                                           max_cache_len=32))
    assert not torch.equal(ref.sequences, got.sequences), "a wrong scale left every token unchanged"


@pytest.mark.parametrize("device", DEVICES, indirect=True)
def test_dropped_sink_changes_the_tokens(rng, device):
    model, ids, mask, ref = padded_reference("gpt_oss", seed_of(rng), device)

    def without_sink(module, *args, s_aux=None, **kwargs):
        return cupa_tf.attention_forward(module, *args, **kwargs)

    model.set_attn_implementation(NAME)
    AttentionInterface.register(NAME, without_sink)
    try:
        got = greedy(model, ids, mask, cache=cupa_tf.CupaCache(model.config, block_size=BLOCK_SIZE[device],
                                                               max_cache_len=32))
    finally:
        AttentionInterface.register(NAME, cupa_tf.attention_forward)
    assert not torch.equal(ref.sequences, got.sequences), "dropping the sinks left every token unchanged"


@pytest.mark.parametrize("kind", KINDS)
def test_forward_without_cache_matches_logits(rng, kind):
    """A plain forward (no cache): dense keys, cupa's one-token blocks; logits as transformers' own attention."""
    seed = seed_of(rng)
    rows = prompts(seed, [9, 5])
    model = tiny_model(kind, seed)
    ids, mask = left_padded(rows)
    with torch.no_grad():
        ref = model(ids, attention_mask=mask, use_cache=False).logits
        model.set_attn_implementation(NAME)
        with cupa_tf.trace() as calls:
            got = model(ids, attention_mask=mask, use_cache=False).logits
    assert {c.path for c in calls} == {"dense keys"}
    real = mask.bool()
    torch.testing.assert_close(got[real], ref[real], rtol=1e-5, atol=1e-5)


def test_trace_and_explain(rng):
    seed = seed_of(rng)
    model = tiny_model("gpt_oss", seed, attn=NAME)
    ids, mask = left_padded(prompts(seed, [5, 3]))
    with cupa_tf.trace() as calls:
        greedy(model, ids, mask, cache=cupa_tf.CupaCache(model.config, max_cache_len=32))
    assert len(calls) == NEW_TOKENS * 2 and {c.path for c in calls} == {"cupa cache"}
    first = calls[0]
    assert first.layer_idx == 0 and first.op.attributes.local_window_size == 4 and first.inputs["head_sink"] is not None
    assert calls[1].op.attributes.local_window_size == -1           # the full-attention layer
    text = first.explain()
    assert "reference: chosen" in text


# -- what the integration refuses ----------------------------------------------------------------------

def test_right_padding_is_refused(rng):
    model = tiny_model("llama", seed_of(rng), attn=NAME)
    ids = torch.tensor([[5, 6, 7, 0], [5, 6, 7, 8]])
    mask = (ids != 0).long()
    with pytest.raises(cupa.PagedAttentionError, match="attention_mask: got padding after a real token"):
        greedy(model, ids, mask, cache=cupa_tf.CupaCache(model.config, max_cache_len=32))


def test_padded_dynamic_cache_of_sliding_layers_is_refused(rng):
    """A DynamicCache keeps a sliding layer's last keys only, which a padded batch's mask does not describe."""
    model = tiny_model("gpt_oss", seed_of(rng), attn=NAME)
    ids, mask = left_padded(prompts(1, [6, 3]))
    with pytest.raises(cupa.PagedAttentionError, match="CupaCache"):
        greedy(model, ids, mask)                         # generate's default: a DynamicCache


@pytest.mark.parametrize("kind, lengths", [("qwen3", [6, 4]), ("gpt_oss", [6, 6])])
def test_dynamic_cache_is_served(rng, kind, lengths):
    """A DynamicCache's dense history (copied each step into one-token blocks) gives the same tokens:
    full layers with a padded batch, and sliding layers (the window's keys only) without padding."""
    seed = seed_of(rng)
    model = tiny_model(kind, seed)
    ids, mask = left_padded(prompts(seed, lengths))
    ref = greedy(model, ids, mask)
    model.set_attn_implementation(NAME)
    with cupa_tf.trace() as calls:
        got = greedy(model, ids, mask)
    assert {c.path for c in calls} == {"dense keys"}
    assert_same_greedy(ref, got, ids.shape[1], torch.float32)


def test_training_mode_is_refused(rng):
    model = tiny_model("llama", seed_of(rng), attn=NAME)
    model.config.attention_dropout = 0.1
    for layer in model.model.layers:
        layer.self_attn.attention_dropout = 0.1
    model.train()
    with pytest.raises(cupa.PagedAttentionError, match="dropout"):
        model(torch.tensor([[1, 2, 3]]))


def test_a_full_fixed_pool_is_an_error(rng):
    model = tiny_model("llama", seed_of(rng), attn=NAME)
    ids, mask = left_padded(prompts(2, [6, 6]))
    with pytest.raises(cupa.PagedAttentionError, match="num_blocks=4"):
        greedy(model, ids, mask, cache=cupa_tf.CupaCache(model.config, block_size=4, num_blocks=4))


def test_cache_arguments_are_checked():
    config = LlamaConfig(num_hidden_layers=1)
    for kwargs in (dict(block_size=0), dict(max_cache_len=-3), dict(num_blocks=True)):
        with pytest.raises(cupa.PagedAttentionError):
            cupa_tf.CupaCache(config, **kwargs)
    with pytest.raises(cupa.PagedAttentionError, match="name"):
        cupa_tf.register("my_flash_cupa")


def test_registered_options_reach_the_calls(rng):
    """Options given to register() are those of every call made under that name."""
    name = cupa_tf.register("cupa_decode_backend", options=cupa.Options(backend="decode"))
    model = tiny_model("llama", seed_of(rng), attn=name)
    with pytest.raises(cupa.PagedAttentionError, match="options.backend: got 'decode'"):
        model(torch.tensor([[1, 2, 3]]), use_cache=False)   # a CUDA backend named for CPU tensors


# -- continuous batching --------------------------------------------------------------------------------

def continuous_both(kind, seed, lengths, device="cpu"):
    model = tiny_model(kind, seed, device=device)
    rows = prompts(seed, lengths)
    config = GenerationConfig(max_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0)
    with torch.no_grad():
        ref = [model.generate(torch.tensor([r], device=device), generation_config=config)[0, len(r):].tolist()
               for r in rows]
    model.set_attn_implementation(NAME)
    # a small token budget: the longest prompt is prefilled in chunks beside other requests' decodes
    cb = ContinuousBatchingConfig(page_size=8, num_blocks=64, max_batch_tokens=16, max_requests_per_batch=4)
    with cupa_tf.trace() as calls:
        out = model.generate_batch(rows, generation_config=config, continuous_batching_config=cb)
    got = [out[f"req_{i}"].generated_tokens for i in range(len(rows))]
    return ref, got, calls


@pytest.mark.parametrize("device", DEVICES, indirect=True)
@pytest.mark.parametrize("kind", KINDS)
def test_continuous_batching(rng, kind, device):
    ref, got, calls = continuous_both(kind, seed_of(rng), [5, 2, 23, 9], device)
    assert got == ref
    paths = {c.path for c in calls}
    # decode batches take transformers' decode fast path (its block table into its paged cache) unless a
    # layer's allocator has no block table (sliding windows: GPT-OSS)
    want = {"continuous batching"} | ({"continuous batching: decode"} if kind != "gpt_oss" else set())
    assert paths == want, paths
    assert all(c.op.options.kv_pages_interleaved == (c.path == "continuous batching: decode") for c in calls)
    assert all(c.inputs["query"].device.type == device for c in calls)
    assert any(c.inputs["query"].shape[0] > 1 and int(c.inputs["past_seqlens"].max()) > 0 for c in calls), \
        "no batch mixed a chunk of prefill with cached tokens"


def test_continuous_batching_leaves_other_names_alone():
    """The allow-list adaptation admits registered cupa names only: another custom name is refused as before."""
    AttentionInterface.register("not_cupa", cupa_tf.attention_forward)
    model = tiny_model("llama", 3, attn="not_cupa")
    with pytest.raises(ValueError, match="not supported for continuous batching"):
        model.generate_batch([[1, 2, 3]], generation_config=GenerationConfig(max_new_tokens=2, do_sample=False),
                             continuous_batching_config=ContinuousBatchingConfig(page_size=8, num_blocks=8))


def test_continuous_batching_release_check(monkeypatch):
    assert cupa_tf._release() in cupa_tf.CONTINUOUS_BATCHING_RELEASES
    monkeypatch.setattr(cupa_tf.transformers, "__version__", "9.1.0")
    assert cupa_tf._release() == (9, 1)
