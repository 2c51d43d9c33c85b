"""RewardModelModule: a reward model, a second objective on the training engine.

A GPT trunk with a scalar head (``core/models/reward.py``) read at each sequence's last real token;
Bradley-Terry loss ``-log sigmoid(r_chosen - r_rejected)`` averaged over the global batch's pairs.
Chosen and rejected run as ONE microbatch (concatenated along the batch), so every engine schedule,
pipelined or not, drives it unchanged. Data: ``megatron_lite.data.PreferenceDataModule``."""

from __future__ import annotations

from typing import Any, Optional

import torch

from megatron_lite.core.estimator.objective_cost import ObjectiveCost
from megatron_lite.core.models import GPTConfig
from megatron_lite.core.models.reward import RewardModel, chunk_rewards
from megatron_lite.core.optim import OptimizerConfig
from megatron_lite.core.parallel.loss_report import report_entry
from megatron_lite.core.parallel.run_spec import RunSpec
from megatron_lite.module import GPTModule
from megatron_lite.rl.losses import bradley_terry_loss, preference_correct


class RewardModelModule(GPTModule):
    """Train a reward model on preference pairs under any layout (GPTModule's optimizer, scheduler and
    evaluation plumbing). Logs ``train/loss``, ``train/accuracy`` (share of the global batch's pairs
    with r_chosen > r_rejected), ``val/loss`` and ``val/accuracy`` (and ``test/...``)."""

    loss_is_token_nll = False  # no val/perplexity: the loss is not a next-token NLL
    progress_bar_metrics = ("accuracy",)

    def __init__(self, config: GPTConfig, optimizer: Optional[OptimizerConfig] = None, seed: int = 1234):
        super().__init__(config, optimizer, seed)

    def check_before_launch(self, run: RunSpec, trainer: Any, module: Any, datamodule: Any) -> None:
        super().check_before_launch(run, trainer, module, datamodule)
        if getattr(datamodule, "pack_sequences", False):
            raise ValueError(
                "RewardModelModule reads one pair per row pair: set the PreferenceDataModule's "
                "pack_sequences=False (packed rows of pairs are for DPOModule)"
            )
        parallel = run.parallel
        if parallel.context_parallel_size > 1:
            # The reward is read at each sequence's last real token, which lies on one CP rank only, and the
            # pairs' microbatches are not token sequences that the zigzag split knows how to cut.
            raise ValueError(
                f"RewardModelModule does not run under context parallelism (context_parallel_size="
                f"{parallel.context_parallel_size}): each reward is read at its sequence's last token, held by one "
                f"CP rank; set context_parallel_size=1 (preference pairs are short: use tensor or data parallelism)."
            )

    def objective_cost(self, datamodule: Any = None) -> ObjectiveCost:
        """A pair is two sequences, chosen and rejected, trained once."""
        return ObjectiveCost(sequences_per_sample=2)

    def build_model(self, layout) -> RewardModel:
        return RewardModel(self.config, layout, seed=self.seed)

    def forward_step(self, part: Any, microbatch: dict, input_tensor: Optional[torch.Tensor]) -> torch.Tensor:
        """Chosen then rejected as one ``[2b, s]`` batch: activations, or on the last stage rewards [2b]."""
        tokens = torch.cat([microbatch["chosen_tokens"], microbatch["rejected_tokens"]])[:, :-1]
        lengths = torch.cat([microbatch["chosen_length"], microbatch["rejected_length"]])
        return chunk_rewards(part, tokens, lengths, input_tensor)

    def loss(self, rewards: torch.Tensor, microbatch: dict) -> tuple:
        """(sum of the pairs' Bradley-Terry losses, number of pairs, ``accuracy``: the correct pairs)."""
        chosen, rejected = rewards.chunk(2)
        pairs = torch.full((), float(chosen.numel()), dtype=torch.float64, device=rewards.device)
        accuracy = report_entry(preference_correct(chosen, rejected).sum(), pairs)
        return bradley_terry_loss(chosen, rejected).sum(), pairs, {"accuracy": accuracy}

    def predict_step(self, batch: dict, batch_idx: int) -> torch.Tensor:
        """Rewards [b] of ``{"tokens": [b, s], "lengths": [b]}`` on every rank (through every stage)."""
        step = lambda part, mb, x: chunk_rewards(part, mb["tokens"], mb["lengths"], x)  # noqa: E731
        return self.engine.forward_outputs([batch], forward_step=step)[0]
