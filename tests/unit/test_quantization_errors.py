"""Bad quantization input fails at once with one error that names the fix: unknown config names (listing the
valid ones), CUDA-only formats on CPU (never ModelOpt's "amax must be a CUDA tensor"), a KV-cache preset given as
the model config, activation configs without calibration data, quantizing twice, bad callback arguments."""

import pytest
import torch

pytest.importorskip("modelopt.torch.quantization")

import megatron_lite as ml  # noqa: E402
from megatron_lite.callbacks import Quantize  # noqa: E402
from megatron_lite.post_training import quantization_recipe, quantize  # noqa: E402

CONFIG = dict(num_layers=1, hidden_size=32, num_attention_heads=4, vocab_size=64, seq_length=8)
BATCHES = [{"tokens": torch.randint(0, 64, (2, 9), generator=torch.Generator().manual_seed(0))}]


def _model() -> ml.GPTModel:
    return ml.GPTModel(ml.GPTConfig(**CONFIG))


def test_unknown_config_lists_the_valid_names():
    with pytest.raises(ValueError, match="unknown quantization config 'INT3_CFG'; valid names: .*INT8_SMOOTHQUANT_CFG"):
        quantize(_model(), "INT3_CFG", BATCHES)
    with pytest.raises(ValueError, match="unknown KV-cache config 'FP9_KV_CFG'; valid names: FP8_KV_CFG"):
        quantize(_model(), None, BATCHES, kv_cache="FP9_KV_CFG")
    with pytest.raises(ValueError, match="unknown quantization config"):
        Quantize("int8")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error on a machine without a GPU")
@pytest.mark.parametrize("config", ["NVFP4_DEFAULT_CFG", "MXFP8_DEFAULT_CFG", "W4A8_NVFP4_FP8_CFG"])
def test_cuda_only_formats_fail_clearly_on_cpu(config):
    with pytest.raises(ValueError, match="runs only in ModelOpt's CUDA kernels.*INT8_SMOOTHQUANT_CFG"):
        quantize(_model(), config, BATCHES)
    with pytest.raises(ValueError, match="only in CUDA kernels, and this machine has no GPU"):
        Quantize(config)


def test_misused_configs_and_arguments():
    with pytest.raises(ValueError, match="configures only the KV cache: pass kv_cache='FP8_KV_CFG'"):
        quantize(_model(), "FP8_KV_CFG", BATCHES)
    with pytest.raises(ValueError, match="calibrates activations: pass calibration batches"):
        quantize(_model(), "INT8_SMOOTHQUANT_CFG")
    with pytest.raises(ValueError, match="has no model yet"):
        quantize(ml.GPTModule(ml.GPTConfig(**CONFIG)), "INT8_WEIGHT_ONLY_CFG")
    model = quantize(_model(), "INT8_WEIGHT_ONLY_CFG")  # weight-only: no data needed
    assert quantization_recipe(model)["config"] == "INT8_WEIGHT_ONLY_CFG"
    with pytest.raises(ValueError, match="already quantized"):
        quantize(model, "INT8_WEIGHT_ONLY_CFG")
    with pytest.raises(ValueError, match=r"when='later'\) must be one of"):
        Quantize(when="later")
    with pytest.raises(ValueError, match="calib_batches=0"):
        Quantize(calib_batches=0)
