"""Mixture-of-Experts through a real Trainer equals the single-process run, per step (losses, the first step's full
gradients, the final parameters, the gradient norm), aux loss on, under every expert layout the issue names."""

import pytest
import torch
from parity_utils import assert_same_training, run, tiny_config

MOE = dict(num_moe_experts=4, moe_router_topk=2, moe_aux_loss_coeff=1e-2, moe_z_loss_coeff=1e-3, ffn_hidden_size=64)


def _config(**overrides):
    return tiny_config(**{**MOE, **overrides})


LAYOUTS = {
    "ep2": dict(devices=2, strategy_kwargs=dict(expert_model_parallel_size=2)),
    "ep2-alltoall": dict(
        devices=2, strategy_kwargs=dict(expert_model_parallel_size=2), moe_token_dispatcher_type="alltoall"
    ),
    "ep4-alltoall": dict(
        devices=4, mbs=1, strategy_kwargs=dict(expert_model_parallel_size=4), moe_token_dispatcher_type="alltoall"
    ),
    "tp2-sp-ep2": dict(devices=4, tp=2, sp=True, strategy_kwargs=dict(expert_model_parallel_size=2)),
    "tp2-sp-etp1": dict(devices=2, tp=2, sp=True, strategy_kwargs=dict(expert_tensor_parallel_size=1)),
    "ep2-pp2": dict(devices=4, pp=2, strategy_kwargs=dict(expert_model_parallel_size=2)),
}


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    return run(tmp_path_factory.mktemp("single"), devices=1, config=_config(), steps=4)


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_moe_layout_matches_single_process(name, reference, tmp_path):
    kwargs = dict(LAYOUTS[name])
    dispatcher = kwargs.pop("moe_token_dispatcher_type", "allgather")
    result = run(tmp_path, config=_config(moe_token_dispatcher_type=dispatcher), steps=4, **kwargs)
    assert_same_training(result, reference)
    torch.testing.assert_close(
        torch.tensor(result["grad_norms"]), torch.tensor(reference["grad_norms"]), rtol=1e-5, atol=0
    )
