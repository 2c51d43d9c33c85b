"""Tensor, sequence and data parallelism through a real Trainer equal the single-process run.

Same seed, same mock data, same global batch: the 10 per-step losses and the first step's full
gradients must match to fp32 tolerance (rtol 1e-5), the way Megatron checks itself.
"""

import dataclasses
import os

import pytest
import torch
from parity_utils import assert_same_training, run, tiny_config

from megatron_lite.strategies.ports import ephemeral_range_start

LAYOUTS = {
    "tp2": dict(devices=2, tp=2),
    "tp4": dict(devices=4, tp=4),
    "dp2": dict(devices=2, tp=1),
    "dp4": dict(devices=4, tp=1, mbs=1),
    "tp2_sp": dict(devices=2, tp=2, sp=True),
    "tp2_dp2": dict(devices=4, tp=2),
}


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    return run(tmp_path_factory.mktemp("single"), devices=1)


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_layout_matches_single_process(name, reference, tmp_path):
    kwargs = dict(LAYOUTS[name])
    chosen_by_us = "MASTER_PORT" not in os.environ and ephemeral_range_start() is not None
    result = run(tmp_path, **kwargs)
    if chosen_by_us:  # the fork launcher's rendezvous port, below the ephemeral range (strategies/ports.py)
        assert result["master_port"] < ephemeral_range_start()
    assert len(result["losses"]) == 10
    assert result["global_step"] == 10
    assert_same_training(result, reference)
    # Before clipping: clipping and Adam would hide a wrong overall gradient scale (e.g. an SP gradient
    # summed twice) from the losses and parameters.
    torch.testing.assert_close(
        torch.tensor(result["grad_norms"]), torch.tensor(reference["grad_norms"]), rtol=1e-5, atol=0
    )


def test_gpt2_style_model_with_tp_sp_matches(tmp_path):
    """LayerNorm, GeLU, learned positions, biases and tied embeddings under TP2 + SP."""
    config = tiny_config(
        normalization="LayerNorm",
        activation="gelu",
        position_embedding_type="learned_absolute",
        add_bias_linear=True,
        share_embeddings_and_output_weights=True,
        num_query_groups=8,
    )
    reference = run(tmp_path / "single", devices=1, config=config, steps=4)
    result = run(tmp_path / "tp2sp", devices=2, tp=2, sp=True, config=config, steps=4)
    # Not the final parameters: the key bias has a zero gradient in exact arithmetic (softmax ignores a
    # per-key constant), so Adam turns its rounding noise into +-lr updates in any summation order.
    assert_same_training(result, reference, params=False)


def test_qk_layernorm_under_tp2_with_and_without_sp_matches(tmp_path):
    """Qwen3's per-head query/key norms: one weight shared by every head, while each TP rank computes only its
    own heads, so a rank's gradient of it is partial and is summed over TP, without SP as with it (where the
    attention's input is gathered, so it is not a per-token partial sum), and under FSDP2, which reduces its own
    gradients. Selective recompute under SP."""
    config = tiny_config(qk_layernorm=True)
    reference = run(tmp_path / "single", devices=1, config=config, steps=3)
    for name, kwargs in {
        "tp2": dict(devices=2, config=config),
        "tp2_sp": dict(devices=2, sp=True, config=dataclasses.replace(config, recompute_granularity="selective")),
        "tp2_dp2_fsdp2": dict(devices=4, config=config, strategy_kwargs=dict(use_torch_fsdp2=True)),
    }.items():
        result = run(tmp_path / name, tp=2, steps=3, **kwargs)
        assert result["grads"]["layers.0.self_attention.q_layernorm.weight"].abs().sum() > 0
        assert_same_training(result, reference)
        torch.testing.assert_close(
            torch.tensor(result["grad_norms"]), torch.tensor(reference["grad_norms"]), rtol=1e-5, atol=0
        )


def test_bf16_mixed_under_tp2_trains_close_to_fp32(reference, tmp_path):
    """bf16 autocast is not bit-exact, so this checks it runs under TP2 and tracks fp32 to bf16 tolerance."""
    result = run(tmp_path, devices=2, tp=2, precision="bf16-mixed")
    losses, ref = torch.tensor(result["losses"]), torch.tensor(reference["losses"])
    assert torch.isfinite(losses).all()
    torch.testing.assert_close(losses, ref, rtol=2e-2, atol=0)
    assert losses[-1] < losses[0]
