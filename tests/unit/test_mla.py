"""Multi-latent attention without transformers: the config's refusals, generation through the latent cache (absorbed
and plain), YaRN's frequencies and scales by hand, the DeepSeek-V3 config.json mapping and its refusals, and the
interleaved-RoPE row permutation."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

from megatron_lite.core.checkpoint.errors import UnsupportedHFModel
from megatron_lite.core.checkpoint.hf import deepseek
from megatron_lite.core.checkpoint.hf.config import gpt_config_from_hf, hf_config_from_gpt
from megatron_lite.core.inference.generate import generate
from megatron_lite.core.inference.kv_cache import InferenceStep, KVCache
from megatron_lite.core.inference.sampling import SamplingParams
from megatron_lite.core.models import GPTConfig
from megatron_lite.core.models.draft_head import EagleDraftHead
from megatron_lite.core.models.gpt import GPTModel
from megatron_lite.core.models.mla import set_absorption
from megatron_lite.core.models.mla_absorbed import absorbs
from megatron_lite.core.models.rope import RopeScaling, inverse_frequencies, yarn_mscale
from megatron_lite.core.peft import LoRAConfig, apply_lora

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "distributed"))
from mla_utils import DEEPSEEK_V3_TINY, TINY_MLA, TINY_YARN  # noqa: E402

MLA = TINY_MLA
MLA_VOCAB = GPTConfig(**MLA).vocab_size


@pytest.mark.parametrize(
    "fields, message",
    [
        (dict(multi_latent_attention=True), r"needs \['kv_lora_rank', 'qk_head_dim'"),
        (dict(kv_lora_rank=16), r"\['kv_lora_rank'\] only apply to multi-latent attention"),
        (dict(MLA, num_query_groups=2), "num_query_groups=2 with multi_latent_attention"),
        (dict(MLA, kv_channels=8), r"kv_channels=8 with multi_latent_attention: .* = 12 wide"),
        (dict(MLA, qk_pos_emb_head_dim=3), "RoPE needs an even width, got qk_pos_emb_head_dim=3"),
        (dict(MLA, position_embedding_type="learned_absolute"), "needs position_embedding_type='rope'"),
        (dict(MLA, qk_layernorm=True, add_bias_linear=True), r"does not support qk_layernorm=True .*; add_bias_linear"),
        (dict(MLA, q_lora_rank=0), "q_lora_rank must be a positive integer"),
        (
            dict(rope_scaling_type="yarn", rope_scaling_factor=4.0, rope_original_max_position_embeddings=32),
            "'yarn' is implemented for multi_latent_attention models",
        ),
        (
            dict(MLA, rope_scaling_type="yarn", rope_scaling_factor=4.0),
            "'yarn' needs rope_scaling_factor and rope_orig",
        ),
        (dict(rope_mscale=1.0), "rope_mscale=1.0 only applies to rope_scaling_type='yarn'"),
    ],
)
def test_bad_mla_configs_are_refused_naming_the_fix(fields, message):
    with pytest.raises(ValueError, match=message):
        GPTConfig(**fields)


def test_draft_heads_are_refused_by_name():
    config = GPTConfig(**MLA)
    assert (config.kv_channels, config.num_query_groups) == (12, 4)  # a query/key head; one key per head
    with pytest.raises(ValueError, match="an EAGLE draft head does not handle multi-latent attention yet"):
        EagleDraftHead(config)


@pytest.mark.parametrize("q_lora_rank", [None, 24])
def test_generation_through_the_latent_cache_equals_recomputing_every_token(q_lora_rank):
    """Left-padded prompts of different lengths, sampled: the cache holds each token's latent and RoPE key only
    (kv_lora_rank + qk_pos_emb_head_dim per layer), and the tokens and log-probs are those of recomputing the
    whole sequence at every step without a cache."""
    config = GPTConfig(
        **{**MLA, "q_lora_rank": q_lora_rank},
        rope_scaling_type="yarn",
        rope_scaling_factor=4.0,
        rope_original_max_position_embeddings=16,
        rope_mscale_all_dim=1.0,
    )
    model = GPTModel(config)
    prompts, sampling = [[5, 6, 7, 8, 9], [3, 4]], SamplingParams(temperature=1.0, top_k=20, seed=3)
    cached = generate(model, prompts, max_new_tokens=6, sampling=sampling, return_log_probs=True)
    recomputed = generate(model, prompts, 6, sampling, return_log_probs=True, use_cache=False)
    assert cached.tokens == recomputed.tokens and all(len(t) == 6 for t in cached.tokens)
    torch.testing.assert_close(torch.tensor(cached.log_probs), torch.tensor(recomputed.log_probs))
    # and the log-probs of greedy decoding are those of the training forward's logits, token by token
    greedy = generate(model, [[5, 6, 7, 8, 9]], max_new_tokens=4, return_log_probs=True)
    tokens = torch.tensor([[5, 6, 7, 8, 9, *greedy.tokens[0]]])
    with torch.no_grad():
        log_probs = torch.log_softmax(model.eval()(tokens)[0, 4:-1].float(), dim=-1)
    expected = log_probs.gather(1, tokens[0, 5:, None])[:, 0]
    torch.testing.assert_close(torch.tensor(greedy.log_probs[0]), expected, rtol=0, atol=1e-6)
    cache = KVCache.for_model(model, 2, 11)
    assert cache.nbytes == config.num_layers * 2 * 11 * (16 + 4) * 4  # layers x rows x slots x (latent + key) x fp32


def _step_logits(model: GPTModel, tokens: torch.Tensor, prefill: int, absorb) -> torch.Tensor:
    """Each step's last-position logits [steps, b, V]: a prefill of ``prefill`` tokens, then one decode step per
    further token, through a latent cache, every layer's attention absorbed or plain as ``absorb`` says."""
    set_absorption(model, absorb)
    b, length = tokens.shape
    cache, positions = KVCache.for_model(model, b, length), torch.arange(length).expand(b, length)
    steps = [(0, prefill)] + [(t, 1) for t in range(prefill, length)]
    return torch.stack(
        [
            model.inference_forward(tokens[:, t : t + s], InferenceStep(t, positions[:, t : t + s], None, cache))
            for t, s in steps
        ]
    )


@pytest.mark.parametrize("q_lora_rank, lora", [(None, False), (24, False), (None, True)])
def test_absorbed_attention_equals_expanding_the_latents(q_lora_rank, lora):
    """Attention over the cached latents, linear_kv_up_proj absorbed into the queries and the output (a LoRA adapter
    on it too, in factored form), gives the plain path's logits at every step (a causal prefill and decode steps),
    with YaRN's softmax scale; by default decode steps run absorbed and a prefill plain, and greedy generation of
    left-padded prompts gives the same tokens and log-probs either way."""
    model = GPTModel(GPTConfig(**{**MLA, "q_lora_rank": q_lora_rank}, **TINY_YARN), seed=1).eval()
    if lora:
        apply_lora(model, LoRAConfig(dim=4, target_modules=["linear_kv_up_proj"]), model.layout, seed=2)
        with torch.no_grad():  # B starts at zero: make the adapters count
            for name, param in model.named_parameters():
                if "adapter.linear_out" in name:
                    param.normal_(0, 0.3)
    attention = model.layer(0).self_attention
    assert absorbs(attention, 1, 2) and absorbs(attention, 1, 1000) and not absorbs(attention, 5, 5)
    tokens = torch.randint(0, MLA_VOCAB, (2, 12), generator=torch.Generator().manual_seed(0))
    plain = _step_logits(model, tokens, 4, absorb=False)
    torch.testing.assert_close(_step_logits(model, tokens, 4, absorb=True), plain)
    torch.testing.assert_close(_step_logits(model, tokens, 4, absorb=None), plain)
    prompts = [[5, 6, 7, 8, 9], [3, 4]]
    absorbed = generate(model, prompts, max_new_tokens=6, return_log_probs=True)
    set_absorption(model, False)
    expanded = generate(model, prompts, max_new_tokens=6, return_log_probs=True)
    assert absorbed.tokens == expanded.tokens
    torch.testing.assert_close(torch.tensor(absorbed.log_probs), torch.tensor(expanded.log_probs))


def test_absorbed_attention_in_bf16_is_as_close_to_fp32_as_the_plain_one():
    config = GPTConfig(**{**MLA, "q_lora_rank": 24}, **TINY_YARN)
    tokens = torch.randint(0, MLA_VOCAB, (2, 10), generator=torch.Generator().manual_seed(1))
    exact = _step_logits(GPTModel(config, seed=1).eval(), tokens, 4, absorb=False)
    half = GPTModel(config, seed=1).eval().to(torch.bfloat16)
    plain, absorbed = (_step_logits(half, tokens, 4, absorb) for absorb in (False, True))
    assert plain.dtype == absorbed.dtype == torch.bfloat16
    plain_error, absorbed_error = ((x.float() - exact).abs().max().item() for x in (plain, absorbed))
    assert 0 < absorbed_error <= 2 * plain_error


class _NotLoRA(nn.Module):
    """An adapter of no known factored form (it adds nothing): only its output is known, as of any adapter."""

    def __init__(self, width: int):
        super().__init__()
        self.width = width

    def forward(self, x: torch.Tensor, sequence_parallel: bool) -> torch.Tensor:
        return x.new_zeros(*x.shape[:-1], self.width)


def test_an_up_projection_that_cannot_be_absorbed_runs_plain_and_forcing_it_is_refused():
    model = GPTModel(GPTConfig(**MLA), seed=1).eval()
    reference = generate(model, [[5, 6, 7]], max_new_tokens=3).tokens
    for index in range(model.config.num_layers):
        up = model.layer(index).self_attention.linear_kv_up_proj
        up.adapter = _NotLoRA(up.output_size_per_partition)
    assert generate(model, [[5, 6, 7]], max_new_tokens=3).tokens == reference  # chosen per step: plain here
    message = "absorb=True, but _NotLoRA on linear_kv_up_proj is not a LoRA adapter"
    with pytest.raises(ValueError, match=message):
        set_absorption(model, True)
    model.layer(0).self_attention.absorb = True  # set before the adapter came: refused at the step
    with pytest.raises(ValueError, match=message):
        generate(model, [[5, 6, 7]], max_new_tokens=3)


def test_yarn_frequencies_and_scales_by_hand():
    """Below the ramp every frequency is kept, above it divided by the factor, linear in the channel between; cos/sin
    scale by mscale(f, mscale) / mscale(f, mscale_all_dim), the softmax by mscale(f, mscale_all_dim)^2."""
    dim, base, factor, context = 32, 10000.0, 4.0, 64
    scaling = RopeScaling("yarn", factor, original_max_position_embeddings=context, mscale=0.8, mscale_all_dim=1.0)
    plain, scaled = inverse_frequencies(dim, base), inverse_frequencies(dim, base, scaling)

    def channel(rotations):  # the channel pair whose frequency turns ``rotations`` times over the original context
        return dim * math.log(context / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = max(math.floor(channel(32)), 0), min(math.ceil(channel(1)), dim - 1)
    regimes = set()
    for i, (f, g) in enumerate(zip(plain.tolist(), scaled.tolist())):
        ramp = min(max((i - low) / (high - low), 0.0), 1.0)
        regimes.add("kept" if ramp == 0 else "slowed" if ramp == 1 else "blended")
        assert g == pytest.approx(f * (1 - ramp) + f / factor * ramp, rel=1e-6)
    assert regimes == {"kept", "slowed", "blended"}
    assert yarn_mscale(factor, 1.0) == pytest.approx(0.1 * math.log(4.0) + 1)
    assert scaling.rotary_scale() == pytest.approx(yarn_mscale(4.0, 0.8) / yarn_mscale(4.0, 1.0))
    assert scaling.softmax_scale_factor() == pytest.approx(yarn_mscale(4.0, 1.0) ** 2)
    assert RopeScaling("llama3", 8.0).softmax_scale_factor() == RopeScaling("llama3", 8.0).rotary_scale() == 1.0


DEEPSEEK = dict(
    DEEPSEEK_V3_TINY,
    model_type="deepseek_v3",
    architectures=["DeepseekV3ForCausalLM"],
    q_lora_rank=None,
    rope_parameters={
        "rope_type": "yarn",
        "rope_theta": 5000.0,
        "factor": 4.0,
        "original_max_position_embeddings": 32,
        "mscale": 1.0,
        "mscale_all_dim": 1.0,
    },
)


def test_deepseek_config_maps_to_mla_and_deepseek_moe_and_back():
    config = gpt_config_from_hf(DEEPSEEK)
    expected = dict(
        multi_latent_attention=True,
        q_lora_rank=None,  # null: no query compression (not transformers' default 1536)
        kv_lora_rank=16,
        qk_head_dim=16,
        qk_pos_emb_head_dim=8,
        v_head_dim=12,
        rotary_base=5000.0,
        rope_scaling_type="yarn",
        rope_scaling_factor=4.0,
        rope_original_max_position_embeddings=32,
        rope_mscale_all_dim=1.0,
        num_moe_experts=8,
        moe_layer_freq=[0, 1, 1],
        moe_router_score_function="sigmoid",
        moe_router_enable_expert_bias=True,
        moe_router_topk=4,
        moe_router_num_groups=4,
        moe_router_group_topk=2,
        moe_router_topk_scaling_factor=2.5,
        moe_shared_expert_intermediate_size=64,
        moe_shared_expert_gate=False,
    )
    assert {name: getattr(config, name) for name in expected} == expected
    written = hf_config_from_gpt(config, "float32")
    again = gpt_config_from_hf(written)
    assert again == config
    assert written["rope_interleave"] is True and written["first_k_dense_replace"] == 1


@pytest.mark.parametrize(
    "change, message",
    [
        (dict(norm_topk_prob=False), "norm_topk_prob=False"),
        (dict(topk_group=1), r"num_experts_per_tok=4 with topk_group=1 .* best two"),
        (dict(rms_norm_eps=1e-5), "rms_norm_eps=1e-05"),
        (dict(num_key_value_heads=2), "num_key_value_heads=2 with 4 heads"),
        (dict(attention_bias=True), "attention_bias=True"),
        (dict(rope_parameters={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32,
                               "mscale_all_dim": 1.0, "mscale": 0}), "mscale_all_dim=1.0 without mscale"),
    ],
)  # fmt: skip
def test_deepseek_configs_transformers_computes_otherwise_are_refused(change, message):
    with pytest.raises(UnsupportedHFModel, match=message):
        gpt_config_from_hf({**DEEPSEEK, **change})


def test_an_mla_model_deepseek_cannot_express_is_refused_on_export():
    config = GPTConfig(**MLA, num_moe_experts=4, moe_layer_freq=[1, 0], layernorm_epsilon=1e-6)
    with pytest.raises(UnsupportedHFModel, match="cannot be written as an HF DeepSeek-V3: moe_router_score_function"):
        hf_config_from_gpt(config, "float32")


@pytest.mark.parametrize("q_lora_rank", [None, 24])
def test_interleaved_rope_rows_are_permuted_on_import_and_back_on_export(q_lora_rank):
    """The rows producing rotated channels (each head's last qk_pos_emb_head_dim query rows, the RoPE key's rows of
    the KV down-projection) move evens-then-odds on import, and back exactly; every other row stays."""
    config = GPTConfig(**{**MLA, "q_lora_rank": q_lora_rank})
    shapes = deepseek.attention_shapes("a.", config)
    hf = {name: torch.randn(shape) for name, shape in shapes.items()}
    ours = deepseek.attention_to_state(hf, "a.", "o.", config, interleaved=True)
    q_name = "a.q_proj.weight" if q_lora_rank is None else "a.q_b_proj.weight"
    q_ours = ours["o.linear_q_proj.weight" if q_lora_rank is None else "o.linear_q_up_proj.weight"]
    head = 8 + 4  # qk_head_dim + qk_pos_emb_head_dim
    for h in range(4):  # per head: positionless rows kept, rotated rows (x0, x1, x2, x3) -> (x0, x2, x1, x3)
        rows = hf[q_name][h * head : (h + 1) * head]
        assert torch.equal(q_ours[h * head : (h + 1) * head], rows[[0, 1, 2, 3, 4, 5, 6, 7, 8, 10, 9, 11]])
    kv = hf["a.kv_a_proj_with_mqa.weight"]
    assert torch.equal(ours["o.linear_kv_down_proj.weight"], kv[[*range(16), 16, 18, 17, 19]])
    back = deepseek.attention_to_hf(ours, "a.", "o.", config)
    assert back.keys() == hf.keys() and all(torch.equal(back[n], hf[n]) for n in hf)
    plain = deepseek.attention_to_state(hf, "a.", "o.", config, interleaved=False)
    assert torch.equal(plain["o.linear_kv_down_proj.weight"], kv)
