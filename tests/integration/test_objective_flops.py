"""FLOPs per objective: one sample of the data costs what its objective runs, counted by hand in forward passes of
one ``seq_length`` sequence (a backward costs two):

    GPT pre-training            1 sequence  x (3)                                         = 3
    DPO, live reference         2 sequences x (3 + 1 reference forward)                   = 8
    DPO, precomputed reference  2 sequences x (3)                                         = 6
    DPO, packed rows            1 row       x (3 + 1)                                     = 4
    reward model                2 sequences x (3)                                         = 6
    GRPO, beta > 0              group_size x (3 x updates_per_batch + old + reference)
    GRPO, beta = 0              group_size x (3 x updates_per_batch + old)

The metrics callback counts exactly that in a real fit of DPO and GRPO (its TFLOP/s and MFU), not one
sequence per sample.
"""

import json

import lightning as L
import pytest

import megatron_lite as ml
from megatron_lite.callbacks import MegatronMetrics
from megatron_lite.core.estimator import forward_flops_per_token, training_flops_per_step
from megatron_lite.data import MockGPTDataModule, PreferenceDataModule, RLPromptDataModule
from megatron_lite.rl import DPOModule, GRPOConfig, GRPOModule, RewardModelModule
from megatron_lite.rl.tasks import AdditionTask
from megatron_lite.tokenizers import NullTokenizer

SEQ, GBS = 16, 4
CONFIG = ml.GPTConfig(
    num_layers=2, hidden_size=32, num_attention_heads=4, vocab_size=64, seq_length=SEQ, make_vocab_size_divisible_by=8
)


def _per_sequence(config=CONFIG, seq_length=SEQ) -> float:
    return forward_flops_per_token(config, seq_length) * seq_length


def _pairs(tmp_path, n=8) -> str:
    path = tmp_path / "pairs.jsonl"
    path.write_text(
        "".join(json.dumps({"prompt": f"{10 + i} 1", "chosen": "5 5", "rejected": "9 9"}) + "\n" for i in range(n))
    )
    return str(path)


def _preference(tmp_path, packed=False):
    return PreferenceDataModule(
        _pairs(tmp_path),
        NullTokenizer(64),
        seq_length=SEQ,
        micro_batch_size=2,
        global_batch_size=GBS,
        split="100,0",
        pack_sequences=packed,
    )


def _prompts(seq_length=SEQ):
    task = AdditionTask(max_operand=3, seed=0)
    return task, RLPromptDataModule(
        task.tokenizer, rows=task.split(4)[0], seq_length=seq_length, micro_batch_size=2, global_batch_size=GBS
    )


@pytest.mark.parametrize(
    "objective, data, forwards",
    [
        ("gpt", "mock", 3),
        ("dpo", "pairs", 8),
        ("dpo_precomputed", "pairs", 6),
        ("dpo", "packed", 4),
        ("reward", "pairs", 6),
        ("grpo_kl", "prompts", 4 * (3 * 2 + 1 + 1)),
        ("grpo", "prompts", 4 * (3 * 2 + 1)),
        ("grpo_kl", "mock", 1 * (3 * 2 + 1 + 1)),  # fixed rollouts: a sample is one sequence
    ],
)
def test_the_flops_of_a_sample_are_the_hand_count(tmp_path, objective, data, forwards):
    modules = {
        "gpt": lambda: ml.GPTModule(CONFIG),
        "dpo": lambda: DPOModule(CONFIG),
        "dpo_precomputed": lambda: DPOModule(CONFIG, precompute_reference_log_probs=True),
        "reward": lambda: RewardModelModule(CONFIG),
        "grpo_kl": lambda: GRPOModule(CONFIG, grpo=GRPOConfig(group_size=4, updates_per_batch=2, beta=0.1)),
        "grpo": lambda: GRPOModule(CONFIG, grpo=GRPOConfig(group_size=4, updates_per_batch=2, beta=0.0)),
    }
    datamodules = {
        "mock": lambda: MockGPTDataModule(seq_length=SEQ, global_batch_size=GBS, vocab_size=64),
        "pairs": lambda: _preference(tmp_path),
        "packed": lambda: _preference(tmp_path, packed=True),
        "prompts": lambda: _prompts()[1],
    }
    cost = modules[objective]().objective_cost(datamodules[data]())
    assert training_flops_per_step(CONFIG, GBS, SEQ, cost=cost) == pytest.approx(
        forwards * _per_sequence() * GBS, rel=1e-12
    )


def _fit(module, data):
    metrics = MegatronMetrics(peak_tflops_per_device=1.0, console=False)
    trainer = L.Trainer(
        strategy=ml.MegatronStrategy(),
        accelerator="cpu",
        devices=1,
        max_steps=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=0,
        num_sanity_val_steps=0,
        callbacks=[metrics],
    )
    trainer.fit(module, data)
    return metrics.flops_per_sample


def test_the_metrics_of_a_dpo_fit_count_both_sequences_and_the_reference(tmp_path):
    flops = _fit(DPOModule(CONFIG, ml.OptimizerConfig(lr=1e-3)), _preference(tmp_path))
    assert flops == pytest.approx(8 * _per_sequence(), rel=1e-12)


def test_the_metrics_of_a_grpo_fit_count_the_group_its_updates_and_extra_forwards():
    task, data = _prompts(seq_length=8)
    config = ml.GPTConfig(
        num_layers=2,
        hidden_size=32,
        num_attention_heads=4,
        vocab_size=task.tokenizer.vocab_size,
        seq_length=8,
        make_vocab_size_divisible_by=8,
    )
    grpo = GRPOConfig(group_size=4, max_new_tokens=1, updates_per_batch=2, beta=0.1)
    flops = _fit(GRPOModule(config, ml.OptimizerConfig(lr=1e-3), grpo=grpo, reward_fn=task.reward), data)
    assert flops == pytest.approx(4 * (3 * 2 + 2) * _per_sequence(config, 8), rel=1e-12)
