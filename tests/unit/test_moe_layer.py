"""The MoE layer in one process: selective recompute of 'moe' reruns the experts in the backward pass and changes
nothing else (gradients, reported metrics); the metrics a training forward records."""

import torch

import megatron_lite as ml

BASE = dict(
    num_layers=2,
    hidden_size=32,
    num_attention_heads=4,
    vocab_size=64,
    seq_length=16,
    make_vocab_size_divisible_by=8,
    num_moe_experts=4,
    moe_router_topk=2,
    ffn_hidden_size=32,
    moe_aux_loss_coeff=1e-2,
    moe_z_loss_coeff=1e-3,
)


def _step(**overrides):
    model = ml.GPTModel(ml.GPTConfig(**{**BASE, **overrides}), seed=3)
    model.train()
    calls = []
    model.layer(1).mlp.experts.register_forward_hook(lambda *args: calls.append(1))
    tokens = torch.randint(0, 64, (2, 17), generator=torch.Generator().manual_seed(0))
    model(tokens[:, :-1], tokens[:, 1:]).sum().backward()
    grads = {name: p.grad.clone() for name, p in model.named_parameters()}
    return len(calls), grads, model.take_step_report()


def test_recomputing_moe_reruns_the_experts_and_changes_nothing_else():
    plain_calls, plain_grads, plain_report = _step()
    calls, grads, report = _step(recompute_granularity="selective", recompute_modules=["moe"])
    assert (plain_calls, calls) == (1, 2)
    for name, grad in plain_grads.items():
        torch.testing.assert_close(grads[name], grad, rtol=1e-6, atol=1e-7, msg=name)
    assert report.keys() == plain_report.keys()
    for name, entry in plain_report.items():
        torch.testing.assert_close(report[name], entry, msg=name)  # recorded once, not again by the recomputation


def test_a_training_forward_reports_router_losses_and_expert_loads():
    _, _, report = _step(moe_layer_freq=[0, 1])
    assert set(report) == {
        "load_balancing_loss",
        "z_loss",
        "moe/layer_1/load_max_over_mean",
        "moe/layer_1/load_cv",
        "moe/dropped_token_fraction",
    }
    assert report["moe/dropped_token_fraction"][0] == 0  # dropless: nothing dropped, out of 2 x 16 x top-2 pairs
    assert report["moe/dropped_token_fraction"][1] == 2 * 16 * 2
    assert report["moe/layer_1/load_max_over_mean"][0] >= 1.0
