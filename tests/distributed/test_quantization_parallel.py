"""Quantization under tensor and data parallelism on raw gloo process groups (fork, 2 ranks), against a
one-process reference quantized on the same data: INT8 SmoothQuant with an FP8 KV cache, calibrated at TP2
(sequence parallel on: a row-parallel layer's input is split, so its amax must be reduced over TP) and at DP2
(each rank calibrates on half the batches, so every amax must be reduced over DP), gives the TP1 model's amax,
pre-quant scales and logits. The TP2 model's full state (split quantizer tensors gathered) and the DCP
checkpoint its ranks write (split quantizer tensors as global tensors) load into one process as the same
quantized model."""

import pytest
import torch

pytest.importorskip("modelopt.torch.quantization")

from spawn_utils import run_ranks  # noqa: E402

from megatron_lite import GPTConfig, GPTModel, GPTModule, OptimizerConfig, ParallelConfig, ParallelLayout  # noqa: E402
from megatron_lite.core.checkpoint.format.sharded import save_sharded  # noqa: E402
from megatron_lite.core.checkpoint.full.state import gather_full_state, load_full_state  # noqa: E402
from megatron_lite.core.checkpoint.state import sharded_model_state  # noqa: E402
from megatron_lite.post_training.quantization import quantization_recipe, quantize, restore_from_state  # noqa: E402

CONFIG = dict(
    num_layers=2,
    hidden_size=64,
    num_attention_heads=4,
    num_query_groups=2,
    vocab_size=128,
    seq_length=16,
    activation="swiglu",
    ffn_hidden_size=96,
    normalization="RMSNorm",
    make_vocab_size_divisible_by=8,
)
RECIPE = dict(config="INT8_SMOOTHQUANT_CFG", kv_cache="FP8_KV_CFG")


def _batches() -> list[dict]:
    g = torch.Generator().manual_seed(0)
    return [{"tokens": torch.randint(0, 128, (4, 17), generator=g)} for _ in range(2)]


def _probe() -> torch.Tensor:
    return torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(1))


def _quantizer_tensors(state: dict) -> dict:
    return {k: v for k, v in state.items() if "_quantizer." in k}


def _save_checkpoint(model: GPTModel, layout: ParallelLayout, path: str) -> None:
    """The model as a GPTModule checkpoint holds it (``model.*``), written by every rank with DCP."""
    holder = torch.nn.Module()
    holder.model = model
    extra = {"hyper_parameters": {"config": model.config, "optimizer": OptimizerConfig(), "seed": 3}}
    save_sharded({"model": sharded_model_state(holder, layout)}, path, extra=extra)


def _on_layout(rank, world_size, parallel: dict, checkpoint: str):
    layout = ParallelLayout.build(ParallelConfig(**parallel))
    model = GPTModel(GPTConfig(**CONFIG), layout, seed=3)
    batches = _batches()
    if layout.dp_size > 1:  # each DP rank calibrates on its own half of the data
        batches = [{"tokens": b["tokens"].chunk(2)[layout.dp_rank]} for b in batches]
    quantize(model, calibration=batches, **RECIPE)
    state = gather_full_state(model, layout)
    _save_checkpoint(model, layout, checkpoint)
    return {"logits": model.full_logits(_probe()), "state": state}


@pytest.fixture(scope="module")
def reference():
    model = GPTModel(GPTConfig(**CONFIG), seed=3)
    quantize(model, calibration=_batches(), **RECIPE)
    return model


@pytest.mark.parametrize(
    "parallel",
    [dict(tensor_model_parallel_size=2, sequence_parallel=True), dict(tensor_model_parallel_size=1)],
    ids=["tp2_sp", "dp2"],
)
def test_quantized_parallel_model_equals_the_one_process_model(reference, parallel, tmp_path):
    results = run_ranks(_on_layout, 2, parallel, str(tmp_path / "ckpt"))
    expected = reference.full_logits(_probe())
    for result in results:  # every rank, every layout: the reference's logits
        torch.testing.assert_close(result["logits"], expected, rtol=1e-5, atol=1e-5)
    full = results[0]["state"]
    want = _quantizer_tensors(dict(reference.state_dict()))
    got = _quantizer_tensors(full)
    assert set(got) == set(want) and any(k.endswith("k_bmm_quantizer._amax") for k in got)
    for name, tensor in want.items():  # amax and SmoothQuant scales synchronised: the one-process values
        torch.testing.assert_close(got[name], tensor, rtol=1e-5, atol=1e-7, msg=name)
    if parallel["tensor_model_parallel_size"] == 2:
        # The TP2 model's gathered state is a TP1 quantized model: restored from its recipe, then loaded
        fresh = GPTModel(GPTConfig(**CONFIG), seed=99)
        assert restore_from_state(fresh, full)
        load_full_state(fresh, full, vocab_size=CONFIG["vocab_size"])
        torch.testing.assert_close(fresh.full_logits(_probe()), results[0]["logits"], rtol=1e-5, atol=1e-5)
    # The DCP checkpoint the ranks wrote (split quantizer tensors as global tensors) loads as one process
    loaded = GPTModule.from_pretrained(tmp_path / "ckpt")
    assert quantization_recipe(loaded.model)["kv_cache"] == "FP8_KV_CFG"
    torch.testing.assert_close(loaded.full_logits(_probe()), results[0]["logits"], rtol=1e-5, atol=1e-5)
