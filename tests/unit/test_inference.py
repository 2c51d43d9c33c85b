"""Generation in one process: sampling, prompt batching, the KV cache and bad input (the layouts:
tests/distributed/test_generation_parallel.py)."""

import gc
import math

import pytest
import torch

import megatron_lite as ml
from megatron_lite import GPTConfig, GPTModel
from megatron_lite.core.inference import KVCache, SamplingParams, TokenSampler, generate
from megatron_lite.core.inference.prompts import attention_mask, check_prompts, left_pad
from megatron_lite.core.inference.sampling import filter_logits

CONFIG = dict(
    num_layers=2,
    hidden_size=64,
    num_attention_heads=8,
    num_query_groups=2,
    vocab_size=300,
    seq_length=32,
    make_vocab_size_divisible_by=8,
)


@pytest.fixture(scope="module")
def model():
    return GPTModel(GPTConfig(**CONFIG), seed=3).eval()


# --- sampling -------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(temperature=-0.5), "temperature must be a finite number >= 0"),
        (dict(temperature=float("nan")), "temperature must be a finite number >= 0"),
        (dict(top_k=-1), "top_k must be an integer >= 0"),
        (dict(top_p=0.0), r"top_p must be in \(0, 1\]"),
        (dict(top_p=1.5), r"top_p must be in \(0, 1\]"),
        (dict(seed=-3), "seed must be a non-negative integer"),
    ],
)
def test_sampling_params_refuse_bad_values(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)


def test_top_k_and_top_p_keep_the_right_tokens():
    logits = torch.log(torch.tensor([[0.5, 0.2, 0.15, 0.1, 0.05]]))

    def kept(**kw):
        return torch.isfinite(filter_logits(logits, SamplingParams(temperature=1.0, **kw)))[0].tolist()

    assert kept(top_k=2) == [True, True, False, False, False]
    assert kept(top_p=0.5) == [True, False, False, False, False]  # 0.5 alone reaches 0.5
    assert kept(top_p=0.8) == [True, True, True, False, False]  # 0.7 < 0.8, 0.85 reaches it
    assert kept(top_p=0.01) == [True, False, False, False, False]  # the most likely token always stays
    assert kept(top_k=3, top_p=0.6) == [True, True, False, False, False]
    assert kept() == [True] * 5


def test_sampled_frequencies_follow_the_tempered_distribution():
    """20000 draws per row (fixed seeds: the test is deterministic) land within 1.5% of softmax(logits / T)."""
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]]).repeat(2, 1)
    params = SamplingParams(temperature=0.7, seed=5)
    sampler = TokenSampler(params, row_ids=[0, 1], device=torch.device("cpu"))
    draws = torch.stack([sampler(logits) for _ in range(20000)])
    expected = torch.softmax(logits[0] / 0.7, -1)
    for row in range(2):
        freq = torch.bincount(draws[:, row], minlength=4).float() / len(draws)
        torch.testing.assert_close(freq, expected, atol=0.015, rtol=0)
    assert not torch.equal(draws[:, 0], draws[:, 1])  # rows draw from their own streams


def test_a_rows_samples_depend_on_its_id_not_on_the_batch():
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(0))
    params = SamplingParams(temperature=1.0, top_p=0.95, seed=9)
    batch = TokenSampler(params, [10, 11, 12], torch.device("cpu"))
    alone = TokenSampler(params, [11], torch.device("cpu"))
    together = torch.stack([batch(logits) for _ in range(20)])
    by_itself = torch.stack([alone(logits[1:2]) for _ in range(20)])
    assert torch.equal(together[:, 1], by_itself[:, 0])


# --- prompts --------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "prompts, new, error, message",
    [
        ([], 4, ValueError, "prompts is empty"),
        ([[1, 2], []], 4, ValueError, "prompt 1 is empty"),
        ([[1, 300]], 4, ValueError, r"prompt 0, token 1 is 300, outside the model's vocabulary \[0, 300\)"),
        ([[-1]], 4, ValueError, r"prompt 0, token 0 is -1, outside"),
        ([[1, 2.5]], 4, TypeError, "prompt 0, token 1 is 2.5, not an integer token id"),
        ("hello", 4, TypeError, "prompts must be a list of token-id lists"),
        (["hello"], 4, TypeError, r"prompt 0 must be a list of token ids, got str; tokenize text first"),
        ([list(range(33))], 0, ValueError, "prompt 0 has 33 tokens, longer than the model's context of 32"),
        ([[1] * 30], 4, ValueError, "lower max_new_tokens to 2 or shorten the prompt"),
        ([[1]], -1, ValueError, "max_new_tokens must be an integer >= 0"),
    ],
)
def test_bad_prompts_get_one_clear_error(model, prompts, new, error, message):
    with pytest.raises(error, match=message):
        generate(model, prompts, new)


def test_bad_stop_ids_and_sampling_through_the_module():
    module = ml.GPTModule(GPTConfig(**CONFIG))
    with pytest.raises(ValueError, match=r"stop id is 999, outside the model's vocabulary"):
        module.generate([[1, 2]], 4, stop_ids=[999])
    with pytest.raises(ValueError, match=r"top_p must be in \(0, 1\]"):
        module.generate([[1, 2]], 4, temperature=1.0, top_p=2.0)


def test_left_padding_positions_and_mask():
    batch = left_pad([[7, 8, 9], [5]], torch.device("cpu"), width_after=2)
    assert batch.tokens.tolist() == [[7, 8, 9], [0, 0, 5]]
    assert batch.positions(0, 3).tolist() == [[0, 1, 2], [0, 0, 0]]
    assert batch.positions(3, 1).tolist() == [[3], [1]]
    assert left_pad([[1, 2], [3, 4]], torch.device("cpu")).positions(0, 2).tolist() == [[0, 1]]  # shared by rows
    mask = attention_mask(batch.pad, 0, 3)[:, 0]
    assert mask[0].tolist() == [[True, False, False], [True, True, False], [True, True, True]]
    # row 1: its padding queries see only themselves, its real token only itself (not the padding)
    assert mask[1].tolist() == [[True, False, False], [False, True, False], [False, False, True]]
    assert batch.key_mask.tolist() == [[True] * 5, [False, False, True, True, True]]


def test_check_prompts_normalises_ids():
    assert check_prompts(torch.tensor([[1, 2]]), 1, 10, 8) == [[1, 2]]
    assert check_prompts([(torch.tensor(3), 4)], 1, 10, 8) == [[3, 4]]


# --- the cache ------------------------------------------------------------------------------------
def test_cache_holds_only_the_key_value_heads(model):
    cache = KVCache.for_model(model, batch_size=3, max_len=20)
    keys, values = cache.layers[0]
    assert keys.shape == values.shape == (3, 2, 20, 8)  # 2 query groups, not 8 heads; head_dim 64/8
    assert cache.nbytes == 2 * 2 * 3 * 2 * 20 * 8 * 4  # layers x (k, v) x b x groups x len x d x fp32
    cache.free()
    assert cache.nbytes == 0 and cache.layers == {}


def test_generation_frees_its_cache(model):
    """Nothing of the cache outlives the call: no KVCache, no tensor of its storage's shape."""
    generate(model, [[1, 2, 3]], 5)
    gc.collect()
    storage_shape = (2, 2, 1, 2, 8, 8)  # layers, (k, v), batch, groups, 3 + 5 slots, head_dim
    assert not [o for o in gc.get_objects() if type(o) is KVCache]
    assert not [o for o in gc.get_objects() if type(o) is torch.Tensor and tuple(o.shape) == storage_shape]


@pytest.mark.parametrize(
    "overrides",
    [
        dict(),
        dict(rotary_percent=0.5),
        dict(position_embedding_type="learned_absolute"),
        dict(num_query_groups=8, share_embeddings_and_output_weights=True),
        dict(num_query_groups=1),
        dict(normalization="LayerNorm", activation="gelu", add_bias_linear=True),
        dict(qk_layernorm=True, kv_channels=12),
        dict(qk_layernorm=True, normalization="LayerNorm", rotary_percent=0.5),
        dict(num_moe_experts=4, moe_router_topk=2, ffn_hidden_size=32, moe_aux_loss_coeff=1e-2),
        dict(
            num_moe_experts=4,
            moe_router_topk=2,
            moe_router_score_function="sigmoid",
            moe_shared_expert_intermediate_size=32,
            moe_shared_expert_gate=True,
            moe_layer_freq=[0, 1],
        ),
    ],
    ids=[
        "gqa",
        "partial-rope",
        "learned-positions",
        "mha-tied",
        "mqa",
        "gpt2-style",
        "qk-norm",
        "qk-layernorm",
        "moe",
        "moe-shared-expert",
    ],
)
def test_cache_equals_an_argmax_loop_over_the_training_forward(overrides):
    model = GPTModel(GPTConfig(**{**CONFIG, **overrides}), seed=5).eval()
    prompts = [[5, 17, 42, 8, 9], [7]]
    expected = []
    for prompt in prompts:
        seq = torch.tensor([prompt])
        for _ in range(12):
            seq = torch.cat([seq, model.full_logits(seq)[:, -1].argmax(-1, keepdim=True)], dim=1)
        expected.append(seq[0, len(prompt) :].tolist())
    assert generate(model, prompts, 12).tokens == expected


def test_cache_equals_recompute_and_batch_equals_one_by_one(model):
    prompts = [[5, 17, 42, 8, 9], [7], [3, 4, 250]]
    batch = generate(model, prompts, 10, return_log_probs=True)
    assert batch.tokens == generate(model, prompts, 10, use_cache=False).tokens
    for i, prompt in enumerate(prompts):
        alone = generate(model, [prompt], 10, return_log_probs=True)
        assert alone.tokens[0] == batch.tokens[i]
        torch.testing.assert_close(
            torch.tensor(alone.log_probs[0]), torch.tensor(batch.log_probs[i]), rtol=1e-5, atol=1e-5
        )


def test_log_probs_are_the_models_at_any_temperature(model):
    """Sampled at temperature 1.7 with top-k: the log-probs are still log_softmax of the raw logits."""
    prompt = [5, 17, 42]
    out = generate(model, [prompt], 8, SamplingParams(temperature=1.7, top_k=20, seed=1), return_log_probs=True)
    seq = torch.tensor([prompt + out.tokens[0]])
    logits = model.full_logits(seq)[0, len(prompt) - 1 : -1]
    expected = torch.log_softmax(logits, -1).gather(-1, seq[0, len(prompt) :, None])[:, 0]
    torch.testing.assert_close(torch.tensor(out.log_probs[0], dtype=torch.float32), expected, rtol=1e-5, atol=1e-5)
    assert all(math.isfinite(x) and x <= 0 for x in out.log_probs[0])


def test_stop_ids_end_each_row_on_its_own(model):
    prompts = [[5, 17, 42], [7, 7, 1]]
    free = generate(model, prompts, 10).tokens
    stop = free[0][2]
    out = generate(model, prompts, 10, stop_ids=[stop])
    assert out.tokens[0] == free[0][:3] and out.stopped[0]
    expected = free[1][: free[1].index(stop) + 1] if stop in free[1] else free[1]
    assert out.tokens[1] == expected and out.stopped[1] == (stop in free[1])
    assert generate(model, prompts, 0).tokens == [[], []]


def test_module_generates_alone_without_a_trainer():
    module = ml.GPTModule(GPTConfig(**CONFIG), seed=3)
    out = module.generate([[5, 17, 42], [9]], 6, temperature=0.8, top_p=0.9, seed=4, return_log_probs=True)
    again = module.generate([[5, 17, 42], [9]], 6, temperature=0.8, top_p=0.9, seed=4)
    assert out.tokens == again.tokens and [len(t) for t in out.tokens] == [6, 6]
    assert module.model.training  # generation restores the training mode
