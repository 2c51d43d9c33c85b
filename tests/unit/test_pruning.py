"""Pruning slices the right weights: a target equal to the model keeps its function bit for bit; parts made dead
on purpose (a block whose branches write nothing, a query group whose values are zero, MLP neurons whose inputs
are zero) score lowest and their removal leaves the logits unchanged, under GQA + RoPE + SwiGLU and under
MHA + LayerNorm + GeLU + biases + tied embeddings; every axis at once gives a model that runs and generates;
impossible targets are refused with the fix."""

import pytest
import torch

import megatron_lite as ml
from megatron_lite.core.models import GPTModel
from megatron_lite.post_training.pruning import PruneTarget, estimate_importance, plan_pruning, prune

GQA = dict(
    num_layers=3,
    hidden_size=32,
    num_attention_heads=4,
    num_query_groups=2,
    ffn_hidden_size=48,
    vocab_size=96,
    seq_length=16,
)
MHA = dict(
    GQA,
    num_query_groups=None,
    normalization="LayerNorm",
    activation="gelu",
    add_bias_linear=True,
    share_embeddings_and_output_weights=True,
    position_embedding_type="learned_absolute",
)


def _module(**config) -> ml.GPTModule:
    torch.manual_seed(0)
    module = ml.GPTModule(ml.GPTConfig(**config), seed=7)
    module.model = GPTModel(module.config, seed=7).eval()
    with torch.no_grad():  # away from init: norms and biases that are not ones and zeros
        for param in module.model.parameters():
            param.add_(0.05 * torch.randn_like(param))
    return module


def _calibration(n: int = 2) -> list[dict]:
    g = torch.Generator().manual_seed(1)
    return [{"tokens": torch.randint(0, 96, (2, 17), generator=g)} for _ in range(n)]


@pytest.mark.parametrize(
    "config",
    [GQA, MHA, dict(MHA, qk_layernorm=True)],
    ids=["gqa-rope-swiglu", "mha-layernorm-gelu-tied", "mha-layernorm-qk-layernorm"],
)
def test_a_target_equal_to_the_model_keeps_its_function_exactly(config):
    module = _module(**config)
    c = module.config
    same = prune(
        module,
        PruneTarget(
            num_layers=c.num_layers,
            hidden_size=c.hidden_size,
            num_attention_heads=c.num_attention_heads,
            num_query_groups=c.num_query_groups,
            ffn_hidden_size=c.ffn_hidden_size,
        ),
        _calibration(),
    )
    tokens = _calibration(1)[0]["tokens"][:, :-1]
    assert same.config == c
    assert torch.equal(same.model(tokens), module.model(tokens))


@pytest.mark.parametrize("config", [GQA, MHA], ids=["gqa-rope-swiglu", "mha-layernorm-gelu-tied"])
@pytest.mark.parametrize("layer_metric", ["cosine", "loss"])
def test_dead_layers_groups_and_neurons_are_the_ones_removed_and_the_function_stays(config, layer_metric):
    module = _module(**config)
    c, model = module.config, module.model
    d, per_group = c.kv_channels, c.num_attention_heads // c.num_query_groups
    dead_layer, dead_group, dead_neurons = 1, 0, [3, 10, 40]
    with torch.no_grad():
        block = model.layers[str(dead_layer)]
        for linear in (block.self_attention.linear_proj, block.mlp.linear_fc2):  # the block writes nothing
            linear.weight.zero_()
            if linear.bias is not None:
                linear.bias.zero_()
        for layer in model.layers.values():
            qkv = layer.self_attention.linear_qkv
            value_rows = slice(
                (dead_group * (per_group + 2) + per_group + 1) * d, (dead_group * (per_group + 2) + per_group + 2) * d
            )
            qkv.weight[value_rows] = 0  # the group's heads output zero
            fc1 = layer.mlp.linear_fc1
            rows = dead_neurons + ([n + c.ffn_hidden_size for n in dead_neurons] if c.activation == "swiglu" else [])
            fc1.weight[rows] = 0
            if fc1.bias is not None:
                if c.activation == "gelu":
                    fc1.bias[rows] = 0
                qkv.bias[value_rows] = 0
    calibration = _calibration()
    importance = estimate_importance(module, calibration, layer_metric)
    # Skipping a block of an untrained model may lower its loss: by the loss metric the dead block (skipping it
    # changes nothing: a score of exactly 0) need not be the least important, so only depth by cosine is checked.
    drop_layer = layer_metric == "cosine"
    if not drop_layer:
        assert float(importance.layers[dead_layer]) == 0.0
    layers = c.num_layers - 1 if drop_layer else None
    target = PruneTarget(
        num_layers=layers,
        num_query_groups=c.num_query_groups - 1,
        ffn_hidden_size=c.ffn_hidden_size - len(dead_neurons),
    )
    if c.num_query_groups == c.num_attention_heads:  # MHA: a group is a head
        target = PruneTarget(
            num_layers=layers, num_attention_heads=c.num_attention_heads - 1, ffn_hidden_size=target.ffn_hidden_size
        )
    plan = plan_pruning(c, importance, target)
    assert (dead_layer not in plan.layers) == drop_layer
    assert all(dead_group not in groups for groups in plan.groups)
    assert all(not set(dead_neurons) & set(kept) for kept in plan.neurons)
    pruned = prune(module, target, calibration, layer_metric)
    assert (pruned.config.num_layers, pruned.config.ffn_hidden_size) == (layers or c.num_layers, c.ffn_hidden_size - 3)
    assert pruned.config.kv_channels == c.kv_channels
    tokens = _calibration(1)[0]["tokens"][:, :-1]
    torch.testing.assert_close(pruned.model(tokens), module.model(tokens), rtol=1e-5, atol=1e-5)


def test_every_axis_at_once_runs_trains_and_generates():
    module = _module(**GQA)
    pruned = prune(
        module,
        PruneTarget(num_layers=2, hidden_size=24, num_attention_heads=2, num_query_groups=2, ffn_hidden_size=20),
        _calibration(),
    )
    c = pruned.config
    assert (
        c.num_layers,
        c.hidden_size,
        c.num_attention_heads,
        c.num_query_groups,
        c.ffn_hidden_size,
        c.kv_channels,
    ) == (2, 24, 2, 2, 20, 8)
    assert c.num_parameters() == sum(p.numel() for p in pruned.model.parameters())
    tokens = _calibration(1)[0]["tokens"]
    loss = pruned.model(tokens[:, :-1], tokens[:, 1:]).mean()
    loss.backward()  # the sliced weights are ordinary trainable parameters
    assert torch.isfinite(loss) and all(p.grad is not None for p in pruned.model.parameters())
    out = pruned.generate([[1, 2, 3], [4]], max_new_tokens=4)
    assert [len(t) for t in out.tokens] == [4, 4]


@pytest.mark.parametrize(
    "target, message",
    [
        (dict(num_layers=0), "positive integer"),
        (dict(), "prunes nothing"),
        (dict(num_layers=4), "larger than the model's num_layers"),
        (dict(ffn_hidden_size=64), "choose ffn_hidden_size <= 48"),
        (dict(num_attention_heads=3), "must be a multiple of num_query_groups"),
        (dict(num_attention_heads=4, num_query_groups=1), "more than the model's 2"),
    ],
)
def test_impossible_targets_are_refused_with_the_fix(target, message):
    module = _module(**GQA)
    with pytest.raises(ValueError, match=message):
        prune(module, PruneTarget(**target), _calibration())


def test_bad_calibration_and_metric_are_refused():
    module = _module(**GQA)
    with pytest.raises(ValueError, match="at least one calibration batch"):
        prune(module, PruneTarget(num_layers=2), [])
    with pytest.raises(ValueError, match=r"LongTensor\[b, s\+1\]"):
        prune(module, PruneTarget(num_layers=2), [torch.zeros(5, dtype=torch.long)])
    with pytest.raises(ValueError, match="layer_metric must be one of"):
        prune(module, PruneTarget(num_layers=2), _calibration(), layer_metric="random")
    with pytest.raises(ValueError, match="from_pretrained"):
        prune(ml.GPTModule(ml.GPTConfig(**GQA)), PruneTarget(num_layers=2), _calibration())
