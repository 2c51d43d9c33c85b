"""Activation recomputation: the same loss, gradients and dropout streams as no recompute, with
less saved memory, only in training, and Megatron's config rules.

Dropout is on everywhere, so a recomputed region that drew different masks than its forward
(e.g. without replaying the model's RNG streams) would change the gradients.
"""

from contextlib import contextmanager

import pytest
import torch

import megatron_lite as ml
from megatron_lite.core.models.recompute import full_recompute_groups

NONE = {}
UNIFORM_1 = dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)
UNIFORM_2 = dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=2)
BLOCK_1 = dict(recompute_granularity="full", recompute_method="block", recompute_num_layers=1)
BLOCK_3 = dict(recompute_granularity="full", recompute_method="block", recompute_num_layers=3)
SELECTIVE = dict(recompute_granularity="selective")
RECOMPUTES = {
    "uniform1": UNIFORM_1,
    "uniform2": UNIFORM_2,
    "block1": BLOCK_1,
    "block3": BLOCK_3,
    "selective": SELECTIVE,
}


def tiny_config(**recompute) -> ml.GPTConfig:
    return ml.GPTConfig(
        num_layers=4,
        hidden_size=32,
        num_attention_heads=4,
        num_query_groups=2,
        vocab_size=64,
        seq_length=16,
        make_vocab_size_divisible_by=8,
        hidden_dropout=0.2,
        attention_dropout=0.2,
        **recompute,
    )


def batch(packed: bool) -> dict:
    tokens = torch.randint(0, 64, (2, 17), generator=torch.Generator().manual_seed(0))
    inputs = dict(tokens=tokens[:, :-1], labels=tokens[:, 1:])
    if packed:  # two sequences per sample: attention goes through the per-document (packed) path
        inputs["cu_seqlens"] = torch.tensor([[0, 5, 16], [0, 9, 16]])
        inputs["position_ids"] = torch.stack(
            [torch.cat([torch.arange(5), torch.arange(11)]), torch.cat([torch.arange(9), torch.arange(7)])]
        )
    return inputs


def train_steps(recompute: dict, packed: bool = False, steps: int = 2):
    """Losses and gradients of ``steps`` SGD steps; the later steps only match if every recompute
    left the dropout streams where the no-recompute run has them."""
    model = ml.GPTModel(tiny_config(**recompute), seed=0)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    inputs = batch(packed)
    losses, grads = [], []
    for _ in range(steps):
        optimizer.zero_grad()
        loss = model(**inputs).mean()
        loss.backward()
        losses.append(loss.detach())
        grads.append({name: p.grad.clone() for name, p in model.named_parameters()})
        optimizer.step()
    return torch.stack(losses), grads, model.rng_tracker.get_states()


@pytest.mark.parametrize("packed", [False, True], ids=["causal", "packed"])
@pytest.mark.parametrize("name", list(RECOMPUTES))
def test_recompute_matches_no_recompute_with_dropout(name, packed):
    ref_losses, ref_grads, ref_rng = train_steps(NONE, packed)
    losses, grads, rng = train_steps(RECOMPUTES[name], packed)
    for step, (got, want) in enumerate(zip(grads, ref_grads)):
        assert got.keys() == want.keys()
        for param, grad in want.items():
            torch.testing.assert_close(
                got[param],
                grad,
                rtol=1e-6,
                atol=1e-6 * grad.abs().max().item(),
                msg=lambda m, p=param, s=step: f"step {s} gradient of {p}: {m}",
            )
    torch.testing.assert_close(losses, ref_losses, rtol=1e-6, atol=0)
    assert rng.keys() == ref_rng.keys()
    for stream, state in ref_rng.items():
        assert torch.equal(rng[stream], state), f"dropout stream {stream} ends elsewhere than without recompute"


def test_dropout_is_really_on():
    """Otherwise the test above would not exercise the RNG replay: different seeds, different losses."""
    model = ml.GPTModel(tiny_config(**UNIFORM_1), seed=0)
    first, second = model(**batch(False)).mean(), model(**batch(False)).mean()
    assert not torch.equal(first, second)


@contextmanager
def count_calls(modules: dict):
    """Count forward entries per module (pre-hooks fire in the recompute too; torch may stop a
    recompute before the module returns, so forward hooks would not)."""
    counts = {name: 0 for name in modules}
    handles = [
        m.register_forward_pre_hook(lambda *_, n=name: counts.__setitem__(n, counts[n] + 1))
        for name, m in modules.items()
    ]
    try:
        yield counts
    finally:
        for handle in handles:
            handle.remove()


def forward_entries(recompute: dict, *, train: bool = True, grad: bool = True) -> dict:
    model = ml.GPTModel(tiny_config(**recompute), seed=0)
    model.train(train)
    modules = {f"layer{i}": layer for i, layer in model.layers.items()}
    modules.update({f"core{i}": layer.self_attention.core_attention for i, layer in model.layers.items()})
    with count_calls(modules) as counts, torch.set_grad_enabled(grad):
        loss = model(**batch(False)).mean()
        if grad:
            loss.backward()
    return counts


@pytest.mark.parametrize(
    "name, layers_run_twice, cores_run_twice",
    [
        ("none", [], []),
        ("uniform1", [0, 1, 2, 3], [0, 1, 2, 3]),
        ("uniform2", [0, 1, 2, 3], [0, 1, 2, 3]),
        ("block1", [0], [0]),
        ("block3", [0, 1, 2], [0, 1, 2]),
        ("selective", [], [0, 1, 2, 3]),
    ],
)
def test_checkpointed_regions_run_again_in_backward(name, layers_run_twice, cores_run_twice):
    counts = forward_entries(RECOMPUTES.get(name, NONE))
    for i in range(4):
        assert counts[f"layer{i}"] == (2 if i in layers_run_twice else 1), (name, i, counts)
        assert counts[f"core{i}"] == (2 if i in cores_run_twice else 1), (name, i, counts)


@pytest.mark.parametrize("name", list(RECOMPUTES))
def test_no_recompute_in_eval_or_no_grad(name):
    for train, grad in ((False, True), (True, False), (False, False)):
        counts = forward_entries(RECOMPUTES[name], train=train, grad=grad)
        assert set(counts.values()) == {1}, (name, train, grad, counts)
    # Eval output equals the plain model's (same weights, dropout off).
    reference, model = ml.GPTModel(tiny_config(), seed=0).eval(), ml.GPTModel(tiny_config(**RECOMPUTES[name]), seed=0)
    model.eval()
    with torch.no_grad():
        assert torch.equal(model(**batch(True)), reference(**batch(True)))


def saved_bytes(recompute: dict) -> int:
    """Bytes autograd keeps for the backward outside checkpointed regions (torch's checkpoint
    stores its own placeholders inside them through inner hooks)."""
    model = ml.GPTModel(tiny_config(**recompute), seed=0)
    total = 0

    def pack(t: torch.Tensor):
        nonlocal total
        total += t.numel() * t.element_size()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = model(**batch(False)).mean()
    loss.backward()
    return total


def test_recompute_saves_activation_memory():
    sizes = {
        name: saved_bytes(RECOMPUTES.get(name, NONE))
        for name in ("none", "selective", "block1", "block3", "uniform2", "uniform1")
    }
    # Each layer's attention keeps at least its [b, heads, s, s] probabilities and dropout mask
    # without recompute; selective recompute drops them for every layer.
    probs = 2 * 4 * 16 * 16 * 4
    assert sizes["none"] - sizes["selective"] >= 4 * probs, sizes
    # Full recompute keeps less the more layers it checkpoints; uniform groups keep one input per group.
    assert sizes["none"] > sizes["block1"] > sizes["block3"] > sizes["uniform1"], sizes
    assert sizes["uniform2"] < sizes["uniform1"], sizes


def test_layer_groups():
    groups = lambda **kw: [(list(r), c) for r, c in full_recompute_groups(tiny_config(**kw))]  # noqa: E731
    assert groups() == [([0, 1, 2, 3], False)]
    assert groups(**SELECTIVE) == [([0, 1, 2, 3], False)]
    assert groups(**UNIFORM_1) == [([0], True), ([1], True), ([2], True), ([3], True)]
    assert groups(**UNIFORM_2) == [([0, 1], True), ([2, 3], True)]
    assert groups(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=3) == [
        ([0, 1, 2], True),
        ([3], True),
    ]
    assert groups(**BLOCK_1) == [([0], True), ([1, 2, 3], False)]
    assert groups(**BLOCK_3) == [([0], True), ([1], True), ([2], True), ([3], False)]
    assert groups(recompute_granularity="full", recompute_method="block", recompute_num_layers=4) == [
        ([0], True),
        ([1], True),
        ([2], True),
        ([3], True),
    ]


@pytest.mark.parametrize(
    "kwargs, fix",
    [
        (dict(recompute_granularity="fully"), "recompute_granularity must be None or one of"),
        (
            dict(recompute_granularity="full", recompute_method="blocks", recompute_num_layers=1),
            "recompute_method must be None or one of",
        ),
        (dict(recompute_granularity="full", recompute_num_layers=1), "needs recompute_method: set it to 'uniform'"),
        (dict(recompute_granularity="full", recompute_method="uniform"), "needs recompute_num_layers: set it"),
        (
            dict(recompute_granularity="full", recompute_method="block", recompute_num_layers=5),
            r"recompute_num_layers \(5\) must be <= num_layers \(4\)",
        ),
        (
            dict(recompute_granularity="full", recompute_method="block", recompute_num_layers=0),
            "recompute_num_layers must be a positive integer",
        ),
        (
            dict(recompute_granularity="selective", recompute_method="uniform"),
            "recompute_method='uniform' only applies to recompute_granularity='full'",
        ),
        (
            dict(recompute_granularity="selective", recompute_num_layers=2),
            "recompute_num_layers=2 only applies to recompute_granularity='full'",
        ),
        (dict(recompute_method="block", recompute_num_layers=2), "set recompute_granularity='full' or leave"),
    ],
)
def test_config_errors_name_the_fix(kwargs, fix):
    with pytest.raises(ValueError, match=fix):
        tiny_config(**kwargs)


def test_validate_parallelism_with_recompute():
    config = tiny_config(**UNIFORM_2)
    config.validate_parallelism(tensor_model_parallel_size=2, pipeline_model_parallel_size=2, sequence_parallel=True)
    with pytest.raises(ValueError, match="num_attention_heads"):
        config.validate_parallelism(tensor_model_parallel_size=8)
