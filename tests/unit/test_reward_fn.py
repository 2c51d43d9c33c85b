"""GRPO's reward functions and bad input: the built-in rewards on hand-made samples, weights, reward functions
named by import path, and one clear error for a reward that raises or returns a non-number, for prompt rows
without a prompt, and for prompts that cannot fit the model (refused before any process starts)."""

import json
import math

import lightning as L
import pytest
import torch

import megatron_lite as ml
from megatron_lite.data import RLPromptDataModule
from megatron_lite.rl import GRPOConfig, GRPOModule
from megatron_lite.rl.grpo import resolve_reward
from megatron_lite.rl.rewards import RegexReward, Sample, WeightedRewards, call_reward, exact_match, numeric_answer
from megatron_lite.rl.tasks import AdditionTask, CharTokenizer


def s(completion, answer=None, prompt="q"):
    return Sample(prompt=prompt, completion=completion, answer=answer)


def test_builtin_rewards():
    assert exact_match(s(" 7 ", "7")) == 1.0 and exact_match(s("7.", "7")) == 0.0
    assert numeric_answer(s("so the total is 3/4", "0.75")) == 1.0
    assert numeric_answer(s("12 apples, then 14", "14")) == 1.0  # the last number counts
    assert numeric_answer(s("about 1e3", "1000")) == 1.0 and numeric_answer(s("-2.5", "-2.50")) == 1.0
    assert numeric_answer(s("no number here", "3")) == 0.0 and numeric_answer(s("13", "14")) == 0.0
    assert RegexReward(r"\d+")(s(" 42\n")) == 1.0 and RegexReward(r"\d+")(s("42!")) == 0.0
    assert RegexReward(r"<answer>", reward=0.5, full=False)(s("x <answer> y")) == 0.5
    combined = WeightedRewards({exact_match: 1.0, RegexReward(r"\d"): 0.2})
    assert combined(s("7", "7")) == pytest.approx(1.2) and combined(s("8", "7")) == pytest.approx(0.2)
    with pytest.raises(ValueError, match="needs an answer"):
        exact_match(s("7"))


def test_a_bad_reward_function_is_named_with_its_sample():
    def raises(sample):
        return {}["missing"]

    def not_a_number(sample):
        return "1.0"

    with pytest.raises(
        ValueError,
        match=r"reward function .*raises on sample \(prompt='q', completion='x'\) raised "
        r"KeyError",
    ):
        call_reward(raises, s("x"))
    for fn, value in ((not_a_number, "'1.0'"), (lambda sample: math.nan, "nan"), (lambda sample: True, "True")):
        with pytest.raises(ValueError, match=rf"returned {value}; a reward function must return a finite number"):
            call_reward(fn, s("x"))
    assert call_reward(lambda sample: torch.tensor(0.5), s("x")) == 0.5
    with pytest.raises(ValueError, match="exact_match on sample"):  # inside WeightedRewards too
        WeightedRewards({exact_match: 1.0})(s("x"))


def test_reward_functions_by_import_path():
    assert resolve_reward(None) is exact_match
    assert resolve_reward("megatron_lite.rl.rewards.numeric_answer") is numeric_answer
    combined = resolve_reward(
        {"megatron_lite.rl.rewards.exact_match": 1.0, "megatron_lite.rl.rewards.numeric_answer": 2}
    )
    assert combined(s("7", "7")) == 3.0
    with pytest.raises(ValueError, match="cannot be imported; give a dotted path"):
        resolve_reward("megatron_lite.rl.rewards.no_such_reward")
    with pytest.raises(TypeError, match="must be a function of a Sample"):
        resolve_reward(3)


def test_prompt_data_bad_input(tmp_path):
    tok = CharTokenizer()
    path = tmp_path / "p.jsonl"
    path.write_text(json.dumps({"prompt": "1+2=", "answer": 3}) + "\n" + json.dumps({"question": "2+2="}) + "\n")
    with pytest.raises(ValueError, match=r"p.jsonl:2 lacks a string field 'prompt'"):
        RLPromptDataModule(tok, path=str(path), global_batch_size=1).setup()
    with pytest.raises(FileNotFoundError, match="prompt data .* does not exist"):
        RLPromptDataModule(tok, path=str(tmp_path / "none.jsonl"))
    with pytest.raises(ValueError, match="exactly one of them"):
        RLPromptDataModule(tok)
    with pytest.raises(ValueError, match="is not in the alphabet"):
        RLPromptDataModule(tok, rows=[{"prompt": "a+b="}], global_batch_size=1).setup()


def test_prompts_longer_than_the_model_are_refused_before_launch():
    task = AdditionTask(max_operand=2)
    config = ml.GPTConfig(
        num_layers=1, hidden_size=32, num_attention_heads=4, vocab_size=16, seq_length=4, make_vocab_size_divisible_by=8
    )
    data = RLPromptDataModule(task.tokenizer, rows=task.rows, seq_length=4, global_batch_size=4)
    module = GRPOModule(config, grpo=GRPOConfig(group_size=2, max_new_tokens=2))
    trainer = L.Trainer(
        strategy=ml.MegatronStrategy(),
        accelerator="cpu",
        devices=1,
        max_steps=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    with pytest.raises(
        ValueError,
        match=r"longest prompt \(4 tokens\) plus max_new_tokens \(2\) is 6 tokens, more "
        r"than the model's seq_length \+ 1 \(5\)",
    ):
        trainer.fit(module, data)


def test_reward_model_reward_scores_with_a_trained_checkpoint(tmp_path):
    """RewardModelReward loads a RewardModelModule checkpoint and returns the reward the trained model gives the
    prompt + response tokens (read at the last token)."""
    from megatron_lite.core.models.reward import chunk_rewards
    from megatron_lite.data import PreferenceDataModule
    from megatron_lite.rl import RewardModelModule
    from megatron_lite.rl.rewards import RewardModelReward
    from megatron_lite.tokenizers import NullTokenizer

    with open(tmp_path / "pairs.jsonl", "w") as f:
        for i in range(8):
            f.write(json.dumps({"prompt": f"{i + 1} 2", "chosen": "5 5", "rejected": "9"}) + "\n")
    config = ml.GPTConfig(
        num_layers=1, hidden_size=32, num_attention_heads=4, vocab_size=16, seq_length=8, make_vocab_size_divisible_by=8
    )
    data = PreferenceDataModule(
        str(tmp_path / "pairs.jsonl"),
        NullTokenizer(16),
        seq_length=8,
        micro_batch_size=2,
        global_batch_size=4,
        split="100,0",
    )
    module = RewardModelModule(config, ml.OptimizerConfig(lr=1e-2, lr_decay_style="constant"))
    trainer = L.Trainer(
        strategy=ml.MegatronStrategy(),
        accelerator="cpu",
        devices=1,
        max_steps=2,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=0,
    )
    trainer.fit(module, data)
    trainer.save_checkpoint(tmp_path / "rm.ckpt")
    reward = RewardModelReward(str(tmp_path / "rm.ckpt"), scale=2.0)
    sample = Sample(prompt="3 2", completion="5 5", prompt_ids=[3, 2], completion_ids=[5, 5, 15], stopped=True)
    module.model.eval()
    with torch.no_grad():
        expected = chunk_rewards(module.model, torch.tensor([[3, 2, 5, 5, 15]]), torch.tensor([5]))[0]
    assert reward(sample) == pytest.approx(2.0 * float(expected), rel=1e-5)
