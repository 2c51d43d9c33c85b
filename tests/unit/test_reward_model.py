"""The reward model's pieces in one process: the Bradley-Terry loss and accuracy against a hand
computation, the module's (sum, count) and accuracy tally, and the scalar head read at each
sequence's own last token."""

import math

import pytest
import torch

import megatron_lite as ml
from megatron_lite.core.models.reward import RewardModel, last_token_values
from megatron_lite.rl import RewardModelModule, bradley_terry_loss, preference_correct

CONFIG = ml.GPTConfig(num_layers=2, hidden_size=32, num_attention_heads=4, vocab_size=64, seq_length=16)


def test_bradley_terry_loss_by_hand():
    chosen, rejected = torch.tensor([2.0, -1.0, 0.3]), torch.tensor([0.5, 0.0, 0.3])
    # -log sigmoid(m) = log(1 + e^-m) for margins 1.5, -1 and 0 (a tie)
    expected = [math.log1p(math.exp(-1.5)), math.log1p(math.exp(1.0)), math.log(2.0)]
    torch.testing.assert_close(bradley_terry_loss(chosen, rejected), torch.tensor(expected), rtol=1e-6, atol=0)
    assert preference_correct(chosen, rejected).tolist() == [1.0, 0.0, 0.0]  # a tie is not a win
    # fp32 and logsigmoid: a huge margin stays finite (and exact) in half precision inputs too
    far = bradley_terry_loss(torch.tensor([-100.0], dtype=torch.bfloat16), torch.tensor([100.0], dtype=torch.bfloat16))
    assert far.dtype == torch.float32 and far.item() == 200.0
    with pytest.raises(ValueError, match="must pair up"):
        bradley_terry_loss(torch.zeros(2), torch.zeros(3))


def test_module_loss_is_a_sum_over_pairs_and_reports_accuracy():
    module = RewardModelModule(CONFIG)
    # loss() sees chosen rewards then rejected rewards, as forward_step concatenates them
    rewards = torch.tensor([2.0, -1.0, 0.3, 0.5, 0.0, 0.3])
    total, pairs, report = module.loss(rewards, {})
    torch.testing.assert_close(total, bradley_terry_loss(rewards[:3], rewards[3:]).sum())
    assert pairs.item() == 3
    assert report["accuracy"].tolist() == [1.0, 3.0]  # [correct pairs, pairs]: a tie counts as wrong
    _, _, report = module.loss(torch.tensor([1.0, 0.0]), {})  # a microbatch of one pair, correct
    assert report["accuracy"].tolist() == [1.0, 1.0]


def test_reward_is_read_at_each_sequences_last_token():
    model = RewardModel(CONFIG, seed=3).eval()
    tokens = torch.randint(0, CONFIG.vocab_size, (2, 16))
    lengths = torch.tensor([5, 11])
    with torch.no_grad():
        values = model(tokens)
        rewards = last_token_values(values, lengths)
        assert values.shape == (2, 16)
        torch.testing.assert_close(rewards, torch.stack([values[0, 4], values[1, 10]]))
        changed = tokens.clone()
        changed[0, 5:] = 0  # after the first sequence's end: its reward is unchanged (causal)
        changed[1, 3] = (tokens[1, 3] + 1) % CONFIG.vocab_size  # inside the second: its reward moves
        again = last_token_values(model(changed), lengths)
    assert again[0] == rewards[0] and again[1] != rewards[1]


def test_trunk_is_gpt_by_name_and_value_head_is_seeded():
    reward, gpt = RewardModel(CONFIG, seed=3), ml.GPTModel(CONFIG, seed=3)
    trunk = dict(gpt.named_parameters())
    names = [n for n, _ in reward.named_parameters()]
    assert set(names) == (set(trunk) - {"output_layer.weight"}) | {"value_head.weight"}
    for name, param in reward.named_parameters():
        if name in trunk:
            assert torch.equal(param, trunk[name]), name  # a GPT checkpoint's trunk loads by name
    assert torch.equal(RewardModel(CONFIG, seed=3).value_head.weight, reward.value_head.weight)
    assert not torch.equal(RewardModel(CONFIG, seed=4).value_head.weight, reward.value_head.weight)
    with pytest.raises(ValueError, match="takes no labels"):
        reward(torch.zeros(1, 4, dtype=torch.long), torch.zeros(1, 4, dtype=torch.long))


def test_predict_gives_each_sequences_reward():
    module = RewardModelModule(CONFIG, seed=5)
    module.configure_model()
    tokens, lengths = torch.randint(0, CONFIG.vocab_size, (3, 16)), torch.tensor([16, 1, 7])
    with torch.no_grad():
        expected = last_token_values(module.model(tokens), lengths)
    torch.testing.assert_close(module.predict_step({"tokens": tokens, "lengths": lengths}, 0), expected, rtol=0, atol=0)
