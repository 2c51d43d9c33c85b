"""A run whose estimated memory exceeds the machine's is refused before any process starts or any weight is
built, with the numbers and what to change; ``MegatronStrategy(check_memory=False)`` lets it through.

GPT-3 175B on 2 CPU processes of this host: about 2.8 TB per rank to train, which no test machine has. The
Trainer's fit raises in the launching process (nothing is forked, the module never built a weight), so the
test is fast and allocates nothing. On CPU the ranks of a host share its memory: the refusal counts both.
"""

import json

import lightning as L
import pytest

import megatron_lite as ml
from megatron_lite.core.estimator import ObjectiveCost, estimate_for_run
from megatron_lite.core.estimator.report import format_bytes
from megatron_lite.core.parallel import ParallelConfig
from megatron_lite.core.parallel.geometry import DataGeometry
from megatron_lite.core.parallel.run_spec import RunSpec
from megatron_lite.data import MockGPTDataModule, PreferenceDataModule
from megatron_lite.rl import DPOModule
from megatron_lite.strategies.memory_check import InsufficientMemoryError
from megatron_lite.strategies.pre_launch import check_run
from megatron_lite.tokenizers import NullTokenizer

SEQ = 2048
GPT3 = ml.GPTConfig(num_layers=96, hidden_size=12288, num_attention_heads=96, vocab_size=50257, seq_length=SEQ)


def _trainer(**strategy):
    return L.Trainer(
        strategy=ml.MegatronStrategy(start_method="fork", **strategy),
        accelerator="cpu",
        devices=2,
        max_steps=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )


def _pairs(tmp_path) -> str:
    path = tmp_path / "pairs.jsonl"
    path.write_text("".join(json.dumps({"prompt": f"{i} 1", "chosen": "5", "rejected": "9"}) + "\n" for i in range(4)))
    return str(path)


@pytest.mark.parametrize("objective", ["gpt", "dpo"])
def test_a_model_far_larger_than_the_host_is_refused_before_anything_is_built(tmp_path, objective):
    if objective == "gpt":
        module = ml.GPTModule(GPT3)
        data = MockGPTDataModule(seq_length=SEQ, micro_batch_size=1, global_batch_size=2, vocab_size=50257)
        cost = ObjectiveCost()
    else:  # a pair is two rows, and the frozen reference model's weights are held beside the policy's
        module = DPOModule(GPT3)
        data = PreferenceDataModule(
            _pairs(tmp_path),
            NullTokenizer(50257),
            seq_length=SEQ,
            micro_batch_size=1,
            global_batch_size=2,
            split="100,0",
        )
        cost = ObjectiveCost(sequences_per_sample=2, forward_only_passes=1, frozen_models=1)
    with pytest.raises(InsufficientMemoryError) as refused:
        _trainer().fit(module, data)
    assert module.model is None  # refused before configure_model built anything
    run = RunSpec(ParallelConfig(), world_size=2, data=DataGeometry(1, 2, SEQ))
    per_rank = estimate_for_run(GPT3, run, device_type="cpu", objective=cost)
    error = refused.value
    assert error.needed == 2 * per_rank.total_bytes  # the host's two ranks together
    assert 0 < error.available < error.needed
    message = str(error)
    for part in (
        f"about {format_bytes(error.needed)} of host memory to train",
        "2 rank(s) on this host",
        f"each up to {format_bytes(per_rank.total_bytes)}",
        f"only {format_bytes(error.available)}",
        "tensor_model_parallel_size",
        "use_torch_fsdp2=True",
        "smaller model",
        "check_memory=False",
    ):
        assert part in message, (part, message)
    if objective == "dpo":
        assert f"reference model {format_bytes(per_rank.frozen_bytes)}" in message and per_rank.frozen_bytes > 0
    assert "\n" not in message


def test_validate_needs_the_weights_and_check_memory_false_lets_the_run_through():
    module = ml.GPTModule(GPT3)
    data = MockGPTDataModule(seq_length=SEQ, micro_batch_size=1, global_batch_size=2, vocab_size=50257)
    with pytest.raises(InsufficientMemoryError, match="to hold the weights"):
        _trainer().validate(module, data)
    assert module.model is None
    trainer = _trainer(check_memory=False)
    run = check_run(trainer.strategy, module, data, trainer, world_size=2)  # every other check passes
    assert run.data_parallel_size == 2
