"""Generation on one GPU: the KV cache, left padding, sampling and log-probs on CUDA give what the CPU gives.

Skipped where there is no NVIDIA GPU (our CI machines); run with `pytest tests/gpu` on a GPU machine.
TF32 is switched off so greedy tokens compare with the fp32 CPU run.
"""

import pytest
import torch

from megatron_lite import GPTConfig, GPTModel
from megatron_lite.core.inference import SamplingParams, generate

NO_CUDA = "needs CUDA: no NVIDIA GPU visible on this machine"
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason=NO_CUDA)]
CONFIG = dict(
    num_layers=2,
    hidden_size=64,
    num_attention_heads=8,
    num_query_groups=2,
    vocab_size=300,
    seq_length=64,
    make_vocab_size_divisible_by=8,
)
PROMPTS = [[5, 17, 42, 8, 9], [7], [3, 4, 250]]


@pytest.fixture(autouse=True)
def no_tf32():
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False


def test_cuda_generation_equals_the_cpu():
    cpu = GPTModel(GPTConfig(**CONFIG), seed=3).eval()
    with torch.device("cuda"):
        gpu = GPTModel(GPTConfig(**CONFIG), seed=3).eval()
    expected = generate(cpu, PROMPTS, 12, return_log_probs=True)
    got = generate(gpu, PROMPTS, 12, return_log_probs=True)
    assert got.tokens == expected.tokens
    for a, b in zip(got.log_probs, expected.log_probs):
        torch.testing.assert_close(torch.tensor(a), torch.tensor(b), rtol=1e-4, atol=1e-4)
    assert generate(gpu, PROMPTS, 12, use_cache=False).tokens == expected.tokens
    sampling = SamplingParams(temperature=0.9, top_p=0.9, seed=2)
    assert generate(gpu, PROMPTS, 12, sampling).tokens == generate(gpu, PROMPTS, 12, sampling).tokens
