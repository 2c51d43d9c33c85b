"""An MoE checkpoint resumes exactly at its own layout and at other expert layouts (EP2 -> EP1, EP4, ETP1 with TP2).

The source trains TP2+SP x EP2 for 6 steps (aux loss and aux-loss-free expert bias both on) and saves after step 3:
expert weights as global [num_experts, ...] tensors, their Adam moments, the expert-bias buffer. Each target loads
it through a real Trainer and must give the fixed-batch loss before any step (rtol 1e-6), then the source's losses
of steps 4-6 and its final parameters (rtol 1e-5): a reset moment or bias would move them.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from parity_utils import assert_same_params, run, tiny_config
from reshard_utils import FixedBatchLoss

CONFIG = tiny_config(
    num_moe_experts=4,
    moe_router_topk=2,
    ffn_hidden_size=64,
    moe_router_score_function="sigmoid",
    moe_router_enable_expert_bias=True,
    moe_router_bias_update_rate=1e-2,
    moe_aux_loss_coeff=1e-2,
)
SAVE_AT, STEPS = 3, 6
SOURCE = dict(devices=4, tp=2, sp=True, strategy_kwargs=dict(expert_model_parallel_size=2))
TARGETS = {
    "same-layout": SOURCE,
    "ep1": dict(devices=1),
    "ep4": dict(devices=4, strategy_kwargs=dict(expert_model_parallel_size=4)),
    "tp2-sp-etp1-ep2": dict(
        devices=4, tp=2, sp=True, strategy_kwargs=dict(expert_model_parallel_size=2, expert_tensor_parallel_size=1)
    ),
}

pytestmark = pytest.mark.xdist_group("moe_resharding")


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    out = tmp_path_factory.mktemp("source")
    callbacks = [
        ModelCheckpoint(dirpath=out / "ckpts", every_n_train_steps=SAVE_AT, save_top_k=-1),
        FixedBatchLoss(out, at_step=SAVE_AT),
    ]
    result = run(out, config=CONFIG, steps=STEPS, callbacks=callbacks, **SOURCE)
    fixed = torch.load(out / "fixed_loss.pt", weights_only=True)
    return result, str(out / "ckpts" / f"epoch=0-step={SAVE_AT}.ckpt"), fixed["loss"]


@pytest.mark.parametrize("target", list(TARGETS))
def test_moe_checkpoint_resumes_at_another_expert_layout(saved, target, tmp_path: Path):
    reference, checkpoint, fixed_loss = saved
    resumed = run(
        tmp_path,
        config=CONFIG,
        steps=STEPS,
        ckpt_path=checkpoint,
        callbacks=[FixedBatchLoss(tmp_path)],
        **TARGETS[target],
    )
    loaded = torch.load(tmp_path / "fixed_loss.pt", weights_only=True)
    assert loaded["step"] == SAVE_AT
    torch.testing.assert_close(loaded["loss"], fixed_loss, rtol=1e-6, atol=0)
    torch.testing.assert_close(
        torch.tensor(resumed["losses"]), torch.tensor(reference["losses"][SAVE_AT:]), rtol=1e-5, atol=0
    )
    assert resumed["params"]["layers.0.mlp.experts.linear_fc1.weight"].shape == (4, 2 * 64, 64)
    assert_same_params(resumed, reference, rtol=1e-5)
