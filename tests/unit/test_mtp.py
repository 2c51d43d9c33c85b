"""Multi-token prediction: the loss and its gradient against a computation written out by hand, with 'full' recompute
(the depths' layers rerun in the backward, gradients unchanged), the packed-row mask, bad configurations refused
naming the fix, the estimator's count under context parallelism."""

import pytest
import torch
import torch.nn.functional as F

import megatron_lite as ml
from megatron_lite.core.estimator import EstimateLayout, estimate_memory
from megatron_lite.core.models.gpt import GPTModel
from megatron_lite.core.models.mtp import MTP_LOSS, depth_mask
from megatron_lite.core.models.run_checks import check_layout_mtp_layers
from megatron_lite.core.parallel.layout import ParallelConfig
from megatron_lite.core.parallel.pipeline_stages import (
    parse_pipeline_layout,
    pipeline_layout_counts,
    pipeline_layout_mtp_layers,
)

CONFIG = dict(num_layers=2, hidden_size=32, num_attention_heads=4, vocab_size=97, seq_length=12)


def _by_hand(model: GPTModel, tokens, labels, mask, depth, factor):
    """(masked sum of the main loss, the MTP loss term) from the model's weights: depth k runs on the row cut to its
    first s - k positions (causal attention: those positions' outputs are the whole row's), its tokens and labels
    taken k further on -- no shifting, no mask for the row's end."""
    eps = model.config.layernorm_epsilon
    s = tokens.shape[1]
    rope = model.rotary(torch.arange(s))
    x = model.embedding.weight[tokens.t()]
    for i in range(model.config.num_layers):
        x = model.layer(i)(x, rope, model.rng_tracker)
    hidden = F.rms_norm(x, (x.shape[-1],), model.final_layernorm.weight, eps)
    out = model.output_layer.weight[: model.config.vocab_size]  # without the vocabulary padding

    def ce(h, target, m):
        return (
            F.cross_entropy((h @ out.t()).flatten(0, 1), target.t().flatten(), reduction="none") * m.t().flatten()
        ).sum()

    main = ce(hidden, labels, mask)
    mtp = 0.0
    for k in range(1, depth + 1):
        layer = model.mtp.layers[str(model.config.num_layers + k - 1)]
        n = s - k
        rope = model.rotary(torch.arange(n))
        e = model.embedding.weight[tokens[:, k:].t()]
        cat = torch.cat(
            [F.rms_norm(e, (32,), layer.enorm.weight, eps), F.rms_norm(hidden[:n], (32,), layer.hnorm.weight, eps)], -1
        )
        h = layer.transformer_layer(cat @ layer.eh_proj.weight.t(), rope, model.rng_tracker)
        hidden = F.rms_norm(h, (32,), layer.final_layernorm.weight, eps)
        mtp = mtp + ce(hidden, labels[:, k:], mask[:, k:])
    return main, factor / depth * mtp


def test_mtp_loss_and_gradients_equal_the_computation_by_hand():
    torch.manual_seed(0)
    config = ml.GPTConfig(**CONFIG, mtp_num_layers=2, mtp_loss_scaling_factor=0.3)
    model = GPTModel(config, seed=5)
    row = torch.randint(0, 97, (2, 13))
    tokens, labels = row[:, :-1], row[:, 1:]
    mask = (torch.rand(2, 12) > 0.25).float()

    per_token = model(tokens, labels, loss_mask=mask)
    (per_token * mask).sum().backward()
    got = {name: p.grad.clone() for name, p in model.named_parameters()}
    reported = model.take_step_report()[MTP_LOSS]
    model.zero_grad()

    main, mtp = _by_hand(model, tokens, labels, mask, depth=2, factor=0.3)
    (main + mtp).backward()
    # the main loss's value is the next-token loss alone; the MTP term is reported over the main loss's tokens
    torch.testing.assert_close((per_token * mask).sum(), main)
    torch.testing.assert_close(reported.float(), torch.stack([mtp.detach(), mask.sum()]))
    # and the backward is that of main + MTP: every weight's gradient, the MTP block's and the shared ones
    assert any(name.startswith("mtp.") for name in got)
    for name, p in model.named_parameters():
        torch.testing.assert_close(got[name], p.grad, rtol=1e-5, atol=1e-6, msg=lambda m, n=name: f"{n}: {m}")


def test_full_recompute_reruns_the_mtp_layers_in_the_backward_with_the_same_gradients():
    # with dropout: the recomputation must replay the dropout streams to drop what the forward dropped
    fields = dict(CONFIG, mtp_num_layers=2, hidden_dropout=0.2, attention_dropout=0.2)
    recompute = dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)
    row = torch.randint(0, 97, (2, 13), generator=torch.Generator().manual_seed(1))
    grads, runs = [], []
    for config in (ml.GPTConfig(**fields), ml.GPTConfig(**fields, **recompute)):
        model = GPTModel(config, seed=5)
        calls = []
        for layer in model.mtp.depths():
            layer.eh_proj.register_forward_hook(lambda *_, calls=calls: calls.append(1))
        model(row[:, :-1], row[:, 1:]).sum().backward()
        grads.append({name: p.grad for name, p in model.named_parameters()})
        runs.append(len(calls))
    assert runs == [2, 4]  # each depth's layer once, then again in the backward pass
    for name, grad in grads[0].items():
        torch.testing.assert_close(grads[1][name], grad, rtol=0, atol=0, msg=lambda m, n=name: f"{n}: {m}")


def test_a_depth_scores_only_targets_in_the_same_packed_document():
    # two documents packed in a row of 6: positions restart at 0 at index 4
    positions = torch.tensor([[0, 1, 2, 3, 0, 1]])
    labels = torch.zeros(1, 6, dtype=torch.long)
    loss_mask = torch.tensor([[1.0, 1, 1, 0, 1, 1]])
    assert depth_mask(loss_mask, labels, positions, 1).tolist() == [[1, 1, 0, 0, 1, 0]]
    assert depth_mask(None, labels, positions, 2).tolist() == [[1, 1, 0, 0, 0, 0]]
    assert depth_mask(None, labels, None, 2).tolist() == [[1, 1, 1, 1, 0, 0]]


@pytest.mark.parametrize(
    "fields, message",
    [
        (dict(mtp_num_layers=-1), "mtp_num_layers must be None or a non-negative integer"),
        (dict(mtp_num_layers=1, mtp_loss_scaling_factor=-0.1), "mtp_loss_scaling_factor must be a non-negative"),
        (dict(mtp_num_layers=1, position_embedding_type="learned_absolute"), "use position_embedding_type='rope'"),
    ],
)
def test_bad_mtp_configs_are_refused_naming_the_fix(fields, message):
    with pytest.raises(ValueError, match=message):
        ml.GPTConfig(**CONFIG, **fields)


def test_megatron_layouts_placing_mtp_before_the_loss_are_read_and_others_refused_by_name():
    # Megatron's DeepSeek-V3 layouts end with 'mL': the MTP layers on the last stage, counted, not decoder layers
    assert parse_pipeline_layout("Et|tmL") == [["embedding", "decoder"], ["decoder", "mtp", "loss"]]
    assert pipeline_layout_counts("Et|tm*2L", pp=2, vpp=1) == (1, 1)
    assert pipeline_layout_mtp_layers("Et|tm*2L") == 2 and pipeline_layout_mtp_layers("Et|tL") == 0
    for misplaced in ("Etm|tL", "Et|mtL", "Et|tmLm"):
        with pytest.raises(ValueError, match="always sits on the last pipeline stage, right before the loss"):
            parse_pipeline_layout(misplaced)
    config = ml.GPTConfig(**CONFIG, mtp_num_layers=1)
    parallel = ParallelConfig(pipeline_model_parallel_size=2, pipeline_model_parallel_layout="Et|tmmL")
    with pytest.raises(ValueError, match=r"places 2 multi-token prediction layer\(s\) .* mtp_num_layers=1; put 1 'm'"):
        check_layout_mtp_layers(parallel, config)
    check_layout_mtp_layers(
        ParallelConfig(pipeline_model_parallel_size=2, pipeline_model_parallel_layout="Et|tL"), config
    )


def test_the_estimator_counts_mtp_under_context_parallelism():
    # every CP rank holds the whole model, the MTP block included (its parity: tests/distributed/test_mtp_parity.py)
    config = ml.GPTConfig(**CONFIG, mtp_num_layers=1)
    estimate = estimate_memory(config, EstimateLayout(micro_batch_size=1, seq_length=12, context_parallel_size=2))
    assert estimate.params == config.num_parameters()


def test_deepseek_v3_export_keeps_the_mtp_layer_and_reimports_it(tmp_path):
    from megatron_lite.core.checkpoint.hf.directory import read_hf_shapes, save_hf

    config = ml.GPTConfig(
        **CONFIG,
        **dict(multi_latent_attention=True, kv_lora_rank=8, qk_head_dim=8),
        **dict(qk_pos_emb_head_dim=4, v_head_dim=8, layernorm_epsilon=1e-6, num_moe_experts=4, moe_ffn_hidden_size=16),
        **dict(moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True, moe_layer_freq=[0, 1]),
        mtp_num_layers=1,
    )
    model = GPTModel(config, seed=3)
    save_hf(tmp_path / "hf", config, model.state_dict())
    written = read_hf_shapes(tmp_path / "hf")
    # DeepSeek-V3's numbering: the MTP layer after the decoder's, an MoE layer as the last one is
    assert written["model.layers.2.eh_proj.weight"] == (32, 64)
    assert (
        "model.layers.2.mlp.experts.3.down_proj.weight" in written
        and "model.layers.2.shared_head.norm.weight" in written
    )
    again = ml.GPTModule.from_pretrained(tmp_path / "hf").model  # the real import path
    assert again.config.mtp_num_layers == 1
    mine = dict(again.named_parameters())
    assert mine.keys() == dict(model.named_parameters()).keys()
    for name, p in model.named_parameters():
        torch.testing.assert_close(mine[name], p, rtol=0, atol=0, msg=name)
    tokens = torch.randint(0, 97, (2, 13))
    for m in (model, again):
        m(tokens[:, :-1], tokens[:, 1:])
    assert again.take_step_report()[MTP_LOSS].tolist() == model.take_step_report()[MTP_LOSS].tolist()


@pytest.mark.parametrize("mla", [False, True])
def test_the_mtp_depth_drafts_for_speculative_decoding_with_greedy_tokens(mla):
    from megatron_lite.core.inference.generate import generate
    from megatron_lite.core.inference.speculative import speculative_generate
    from megatron_lite.core.models.mtp import mtp_draft

    attention = dict(multi_latent_attention=True, kv_lora_rank=8, qk_head_dim=8, qk_pos_emb_head_dim=4, v_head_dim=8)
    config = ml.GPTConfig(**{**CONFIG, "seq_length": 32}, mtp_num_layers=1, **(attention if mla else {}))
    model = GPTModel(config, seed=11).eval()
    prompts = [[5, 17, 3, 44, 9], [60, 2]]
    expected = generate(model, prompts, max_new_tokens=10).tokens
    result = speculative_generate(model, mtp_draft(model), prompts, max_new_tokens=10, num_draft_tokens=1)
    assert result.tokens == expected  # the base verifies every draft: greedy decoding's tokens
    assert sum(result.draft_steps) > 0 and result.acceptance_length >= 1.0
    # the post-training entry point drafts with the model's MTP depth when no EAGLE head is attached
    from megatron_lite.post_training import speculative_generate as module_speculative_generate

    assert module_speculative_generate(model, prompts, 10, num_draft_tokens=2).tokens == expected
    with pytest.raises(ValueError, match="no multi-token prediction block"):
        mtp_draft(GPTModel(ml.GPTConfig(**CONFIG)))


def test_an_eagle_head_stays_bound_when_only_the_mtp_loss_weight_changes():
    import dataclasses

    from megatron_lite.core.models.draft_head import config_digest

    config = ml.GPTConfig(**CONFIG, mtp_num_layers=1)
    assert config_digest(dataclasses.replace(config, mtp_loss_scaling_factor=0.3)) == config_digest(config)
    assert config_digest(dataclasses.replace(config, mtp_num_layers=2)) != config_digest(config)
