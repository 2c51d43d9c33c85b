"""GRPOModule: Group Relative Policy Optimization on the training engine (DESIGN §3 "GRPO").

Each training step takes this data-parallel rank's prompts (an :class:`~megatron_lite.data.RLPromptDataModule`
batch), samples ``group_size`` responses per prompt from the CURRENT weights through our KV-cache generation
(no weight copy, seeded per rollout), scores them with plain Python reward functions, turns the rewards into
group-normalized advantages, recomputes the old log-probs with the trainer's forward, and runs
``updates_per_batch`` engine train steps (the one training step every objective uses) over the rollout.
A batch that already holds rollouts (``tokens``, ``loss_mask``, ``advantages``) skips the sampling: that is
how an update on fixed rollouts is tested against one process.

With ``beta > 0`` the KL term's frozen reference is a copy of the initial policy -- or, for a policy with LoRA
adapters (the ``LoRA`` callback), no copy: the policy's own frozen base with its adapters switched off, run through
the same forward-only engine path as the old log-probs.
"""

from __future__ import annotations

import dataclasses
import importlib
from typing import Any, Callable, Optional, Union

import torch
import torch.distributed as dist
from torch import nn
from torchmetrics.aggregation import MeanMetric

from megatron_lite.core.checkpoint.full.state import load_full_state
from megatron_lite.core.engine import TrainingEngine
from megatron_lite.core.estimator.objective_cost import ObjectiveCost
from megatron_lite.core.inference import SamplingParams
from megatron_lite.core.inference import generate as generate_tokens
from megatron_lite.core.models import GPTConfig
from megatron_lite.core.optim import OptimizerConfig
from megatron_lite.core.optim.optimizer import StepResult
from megatron_lite.core.parallel.cross_entropy import vocab_parallel_cross_entropy
from megatron_lite.core.parallel.layout import ParallelLayout
from megatron_lite.core.parallel.loss_report import add_reports, report_entry
from megatron_lite.core.parallel.run_spec import RunSpec
from megatron_lite.core.parallel.schedules import StepLoss, gpt_forward_step, split_microbatches
from megatron_lite.module import GPTModule
from megatron_lite.rl.grpo_config import GRPOConfig
from megatron_lite.rl.grpo_loss import (
    group_advantages,
    grpo_token_loss,
    nonzero_variance_groups,
    reduce_token_loss,
    truncated_is_weights,
    vocab_parallel_entropy,
)
from megatron_lite.rl.reference import base_is_reference, freeze_multi_token_prediction, frozen_reference, run_as_base
from megatron_lite.rl.rewards import RewardFn, WeightedRewards, exact_match
from megatron_lite.rl.rollout import group_rows, make_samples, pack_rows, rollout_seed, score_samples

ROLLOUT_STATE_KEY = "megatron_lite_grpo"
"""Checkpoint entry holding the rollout state (how many rollouts ran: the next one's seed)."""
REFERENCE = "reference_model."


def resolve_reward(reward: Union[str, RewardFn, dict, None]) -> RewardFn:
    """A reward function from a function, a dotted import path (``"megatron_lite.rl.rewards.exact_match"``, as a
    YAML config gives it) or ``{path or function: weight}`` (summed with weights); None is ``exact_match``."""
    if reward is None:
        return exact_match
    if isinstance(reward, dict):
        return WeightedRewards({resolve_reward(k): float(v) for k, v in reward.items()})
    if isinstance(reward, str):
        module_name, _, attr = reward.rpartition(".")
        try:
            fn = getattr(importlib.import_module(module_name), attr) if module_name else None
        except (ImportError, AttributeError):
            fn = None
        if fn is None:
            raise ValueError(
                f"reward function {reward!r} cannot be imported; give a dotted path such as "
                f"'megatron_lite.rl.rewards.exact_match' or 'my_package.rewards.my_reward'"
            )
        return fn
    if not callable(reward):
        raise TypeError(f"reward_fn must be a function of a Sample (or a dotted path to one), got {reward!r}")
    return reward


def _by_name(reward: Any) -> bool:
    """Whether ``reward`` names its functions by import path (a string, or a dict keyed by strings)."""
    return isinstance(reward, str) or (isinstance(reward, dict) and all(isinstance(k, str) for k in reward))


def _log_prob_step(part: Any, microbatch: dict, input_tensor: Optional[torch.Tensor]) -> torch.Tensor:
    """A stage forward that ends in the per-token log-probs [b, s] of the labels (activations elsewhere)."""
    out = gpt_forward_step(part, microbatch, input_tensor)
    return -out if getattr(part, "post_process", True) else out


class GRPOModule(GPTModule):
    """Train a policy with GRPO under any TP/PP/DP layout of MegatronStrategy (or alone).

    ``reward_fn`` scores one :class:`~megatron_lite.rl.rewards.Sample` (default: exact match with the prompt's
    answer); see :func:`resolve_reward` for what it may be. Logs per rollout ``train/reward_mean``,
    ``train/reward_std``, ``train/nonzero_groups_ratio``, ``train/response_length``, ``train/kl``,
    ``train/entropy``, ``train/clip_fraction_low``/``_high`` (averaged over the updates) and what every
    GPTModule step logs (``train/loss``, ``train/lr``, ``train/grad_norm``, ...); on the validation prompts
    ``val/pass_at_k`` and ``val/reward_mean``.
    """

    loss_is_token_nll = False  # no val/perplexity: the loss is a policy-gradient loss

    def __init__(
        self,
        config: GPTConfig,
        optimizer: Optional[OptimizerConfig] = None,
        seed: int = 1234,
        grpo: Optional[GRPOConfig] = None,
        reward_fn: Union[str, Callable, dict, None] = None,
    ):
        super().__init__(config, optimizer if optimizer is not None else OptimizerConfig(), seed)
        grpo = GRPOConfig() if grpo is None else grpo
        if not isinstance(grpo, GRPOConfig):
            raise TypeError(f"grpo must be a megatron_lite.rl.GRPOConfig, got {type(grpo).__name__}")
        self.grpo = dataclasses.replace(grpo)
        self.reward_fn = resolve_reward(reward_fn)
        hparams = {"config": self.config, "optimizer": self.optimizer_config, "seed": seed, "grpo": self.grpo}
        if _by_name(reward_fn):  # a function object cannot go into a checkpoint's JSON metadata; its name can
            hparams["reward_fn"] = reward_fn
        self.save_hyperparameters(hparams)
        self.reference_model: Optional[nn.Module] = None
        """The frozen reference policy for the KL term (built only when ``grpo.beta > 0`` and the policy has no LoRA
        adapters: then its base with the adapters off is the reference)."""
        self.rollout_step = 0
        """Rollouts run so far in this run (checkpointed): rollout n samples with ``rollout_seed(seed, n)``."""
        self._reference_engine: Optional[TrainingEngine] = None
        self.eval_metrics = nn.ModuleDict({"pass_at_k": MeanMetric(), "reward_mean": MeanMetric()})

    @classmethod
    def from_pretrained(
        cls,
        path: str,
        *,
        optimizer: Optional[OptimizerConfig] = None,
        seed: Optional[int] = None,
        grpo: Optional[GRPOConfig] = None,
        reward_fn: Union[str, Callable, dict, None] = None,
        **config_overrides: Any,
    ) -> "GRPOModule":
        """A GRPOModule starting from the weights of ``path`` (an HF Llama directory or one of our checkpoints);
        ``config_overrides`` replace GPTConfig fields that do not change a weight's shape."""
        module = GPTModule.from_pretrained(path, optimizer=optimizer, seed=seed, **config_overrides)
        policy = cls(module.config, module.optimizer_config, module.seed, grpo=grpo, reward_fn=reward_fn)
        policy.model = module.model
        return policy

    # --- model, reference and checks ---------------------------------------------------------
    def configure_model(self) -> None:
        super().configure_model()  # the LoRA callback's adapters are attached here
        freeze_multi_token_prediction(self.model)  # the log-probs come from the main head's logits
        if self.grpo.beta == 0.0:
            return
        if base_is_reference(self.model):
            self.reference_model = None  # the base with the adapters off is the reference (see _reference_log_probs)
            self._reference_engine = None
            return
        previous = self.reference_model
        reference = frozen_reference(self, previous)  # a resumed run then loads the saved reference over it
        if reference is previous:
            return
        self.reference_model = reference
        self._reference_engine = None

    def load_full_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        """The policy's weights (``model.…``) and, with β > 0, the reference's (``reference_model.…``)."""
        policy = {k: v for k, v in state.items() if not k.startswith(REFERENCE)}
        super().load_full_state_dict(policy)
        reference = {k[len(REFERENCE) :]: v for k, v in state.items() if k.startswith(REFERENCE)}
        if reference:
            if self.reference_model is None:
                self.reference_model = self.build_model(ParallelLayout.single()).requires_grad_(False).eval()
            load_full_state(self.reference_model, reference, vocab_size=self.config.vocab_size)

    def check_before_launch(self, run: RunSpec, trainer: Any, module: Any, datamodule: Any) -> None:
        super().check_before_launch(run, trainer, module, datamodule)
        if run.parallel.context_parallel_size > 1:
            raise ValueError(
                f"GRPOModule does not run under context parallelism (context_parallel_size="
                f"{run.parallel.context_parallel_size}): rollouts are generated and scored per whole sequence; set "
                f"context_parallel_size=1 and use tensor, pipeline or data parallelism."
            )
        if self.grpo.beta > 0:
            run.check_frozen_copy("GRPOModule with beta > 0", ", or beta=0")
        if trainer.state.fn == "fit" and run.data is not None and run.data.rampup_batch_size:
            raise ValueError("GRPOModule takes a fixed number of prompts per rollout; remove rampup_batch_size")
        longest = getattr(datamodule, "longest_prompt", None)
        if callable(longest):
            need = longest() + self.grpo.max_new_tokens
            if need > self.config.seq_length + 1:
                raise ValueError(
                    f"the longest prompt ({longest()} tokens) plus max_new_tokens ({self.grpo.max_new_tokens}) is "
                    f"{need} tokens, more than the model's seq_length + 1 ({self.config.seq_length + 1}); raise "
                    f"model.config.seq_length or lower grpo.max_new_tokens"
                )
        self._tell_datamodule(datamodule)

    def objective_cost(self, datamodule: Any = None) -> ObjectiveCost:
        """A prompt becomes ``group_size`` sequences (a batch of fixed rollouts, from a datamodule without
        prompts: one per sample), each run forward for the old log-probs and, with ``beta > 0``, through the
        frozen reference, then trained ``updates_per_batch`` times. Rollout generation is not counted."""
        g = self.grpo
        prompts = datamodule is None or callable(getattr(datamodule, "longest_prompt", None))
        return ObjectiveCost(
            sequences_per_sample=g.group_size if prompts else 1,
            training_passes=g.updates_per_batch,
            forward_only_passes=1 + int(g.beta > 0),
            frozen_models=int(g.beta > 0 and not base_is_reference(self.model)),
        )

    def setup(self, stage: str) -> None:
        self._tell_datamodule(getattr(self._attached_trainer(), "datamodule", None))

    def _tell_datamodule(self, datamodule: Any) -> None:
        # The prompt position is counted in rollouts; Lightning counts optimizer steps (mu per rollout).
        if datamodule is not None and hasattr(datamodule, "updates_per_batch"):
            datamodule.updates_per_batch = self.grpo.updates_per_batch

    def _tokenizer(self) -> Any:
        tokenizer = getattr(getattr(self._attached_trainer(), "datamodule", None), "tokenizer", None)
        if tokenizer is None:
            raise ValueError(
                "GRPOModule decodes responses for the reward functions with the datamodule's tokenizer; "
                "train with an RLPromptDataModule(tokenizer=...)"
            )
        return tokenizer

    def _stop_ids(self) -> list[int]:
        return list(self.grpo.stop_ids) if self.grpo.stop_ids is not None else [self._tokenizer().eod]

    # --- rollouts ----------------------------------------------------------------------------
    def _prompts(self, batch: dict) -> list[list[int]]:
        lengths = batch["prompt_lengths"].tolist()
        return [row[:n] for row, n in zip(batch["prompt_tokens"].tolist(), lengths)]

    def _sample(self, batch: dict, samples_per_prompt: int, seed: int):
        """Every prompt ``samples_per_prompt`` times through the current weights: (rows, generation result)."""
        g = self.grpo
        rows, row_ids = group_rows(self._prompts(batch), batch["index"].tolist(), samples_per_prompt)
        sampling = SamplingParams(temperature=g.temperature, top_k=g.top_k, top_p=g.top_p, seed=seed)
        result = generate_tokens(
            self.model,
            rows,
            g.max_new_tokens,
            sampling,
            stop_ids=self._stop_ids(),
            return_log_probs=True,
            row_ids=row_ids,
        )
        return rows, result

    def _score(self, batch: dict, rows, result, samples_per_prompt: int) -> torch.Tensor:
        answers = [a if a != "" else None for a in batch.get("answer", [""] * len(batch["index"]))]
        answers = [a for a in answers for _ in range(samples_per_prompt)]
        samples = make_samples(
            rows, result.tokens, result.stopped, answers, self._tokenizer().detokenize, self._stop_ids()
        )
        return score_samples(samples, self.reward_fn)

    def rollout(self, batch: dict) -> tuple[dict, dict[str, torch.Tensor]]:
        """Sample, score and pack one rollout of ``batch``'s prompts: (rows for :meth:`update`, rollout metrics
        over the global batch)."""
        g = self.grpo
        rows, result = self._sample(batch, g.group_size, rollout_seed(g.rollout_seed, self.rollout_step))
        rewards = self._score(batch, rows, result, g.group_size)
        pad = self._stop_ids()[0]
        packed = pack_rows(rows, result.tokens, self.config.seq_length, pad, result.log_probs)
        packed["advantages"] = group_advantages(rewards, g.group_size, scale=g.scale_advantages)
        nonzero = nonzero_variance_groups(rewards, g.group_size)
        packed["response_mask"] = packed["loss_mask"].clone()  # the metrics cover every response token
        if g.filter_zero_variance:  # dynamic sampling: these groups carry no signal, leave them out entirely
            packed["loss_mask"] *= nonzero.repeat_interleave(g.group_size).to(packed["loss_mask"].dtype).unsqueeze(1)
        lengths = torch.tensor([len(t) for t in result.tokens], dtype=torch.float64)
        totals = torch.stack(
            [
                rewards.sum(),
                (rewards**2).sum(),
                torch.tensor(float(rewards.numel()), dtype=torch.float64),
                nonzero.sum().double(),
                torch.tensor(float(nonzero.numel()), dtype=torch.float64),
                lengths.sum(),
            ]
        ).to(self.device)
        self._sum_over(totals, ("dp",))
        mean = totals[0] / totals[2]
        metrics = {
            "train/reward_mean": mean,
            "train/reward_std": (totals[1] / totals[2] - mean**2).clamp(min=0).sqrt(),
            "train/nonzero_groups_ratio": totals[3] / totals[4],
            "train/response_length": totals[5] / totals[2],
        }
        return packed, {k: v.float() for k, v in metrics.items()}

    def _sum_over(self, x: torch.Tensor, names: tuple[str, ...]) -> torch.Tensor:
        for name in names:
            group = self.parallel_layout.group(name)
            if group is not None and dist.get_world_size(group) > 1:
                dist.all_reduce(x, group=group)
        return x

    # --- the update --------------------------------------------------------------------------
    def _reference(self) -> TrainingEngine:
        if self._reference_engine is None or self._reference_engine.model is not self.reference_model:
            self._reference_engine = TrainingEngine(self.reference_model, self.parallel_layout, self)
        return self._reference_engine

    def _reference_log_probs(self, microbatches: list[dict]) -> list[torch.Tensor]:
        """The reference's per-token log-probs: the reference model's, or (LoRA) the policy's with adapters off."""
        if self.reference_model is None and base_is_reference(self.model):
            with run_as_base(self.model):
                return self._log_probs(self.engine, self.model, microbatches)
        return self._log_probs(self._reference(), self.reference_model, microbatches)

    @torch.no_grad()
    def _log_probs(self, engine: TrainingEngine, model: nn.Module, microbatches: list[dict]) -> list[torch.Tensor]:
        was_training = model.training
        model.eval()
        try:
            return engine.forward_outputs(microbatches, forward_step=_log_prob_step)
        finally:
            model.train(was_training)

    def update(self, rollout: dict, samples_per_microbatch: int) -> tuple[StepLoss, StepResult, float]:
        """``updates_per_batch`` optimizer steps over ``rollout`` (this rank's rows): old log-probs (and the
        reference's, and the truncated IS weights) first, then the module's engine train steps. Returns the last
        step's StepLoss (its report summed over every update), StepResult and learning rate."""
        g = self.grpo
        microbatches = split_microbatches(rollout, samples_per_microbatch)
        old = self._log_probs(self.engine, self.model, microbatches)
        reference = self._reference_log_probs(microbatches) if g.beta > 0 else [None] * len(microbatches)
        for mb, old_lp, ref_lp in zip(microbatches, old, reference):
            mb["old_log_probs"] = old_lp
            if ref_lp is not None:
                mb["ref_log_probs"] = ref_lp
            if g.is_correction_cap is not None and "sampler_log_probs" in mb:
                mb["is_weights"] = truncated_is_weights(old_lp, mb["sampler_log_probs"], g.is_correction_cap)
        samples = self._global_batch_samples(rollout)
        report: dict[str, torch.Tensor] = {}
        for _ in range(g.updates_per_batch):
            step, result, lr = self.engine_train_step(microbatches, samples)
            report = add_reports(report, step.report)
        return dataclasses.replace(step, report=report), result, lr

    def forward_step(self, part: Any, microbatch: dict, input_tensor: Optional[torch.Tensor]) -> Any:
        """This TP rank's logits [b, s, V/tp] on the last stage (padding at -inf), activations elsewhere."""
        kwargs = {} if input_tensor is None else {"hidden_states": input_tensor}
        return part(microbatch["tokens"][:, :-1], None, **kwargs)

    def loss(self, logits: torch.Tensor, microbatch: dict) -> tuple:
        """(sum of the GRPO loss units, their number, KL, entropy and clipping summed over response tokens)."""
        g = self.grpo
        group = self.parallel_layout.group("tp")
        labels = microbatch["tokens"][:, 1:]
        log_probs = -vocab_parallel_cross_entropy(logits, labels, group, self.model.vocab_start, self.config.vocab_size)
        entropy = vocab_parallel_entropy(logits, group)  # always reported; a gradient only with entropy_coef
        old = microbatch.get("old_log_probs", log_probs.detach())
        terms = grpo_token_loss(
            log_probs,
            old,
            microbatch["advantages"],
            clip_eps_low=g.clip_eps_low,
            clip_eps_high=g.clip_eps_high,
            ref_log_probs=microbatch.get("ref_log_probs"),
            beta=g.beta,
            entropy=entropy,
            entropy_coef=g.entropy_coef,
            is_weights=microbatch.get("is_weights"),
        )
        mask = microbatch["loss_mask"].to(terms.loss.dtype)
        with torch.no_grad():  # metrics per response token, those of filtered groups included
            shown = microbatch.get("response_mask", mask).to(mask.dtype)
            per_token = {
                "kl": terms.kl,
                "entropy": entropy.detach(),
                "clip_fraction_low": terms.clipped_low,
                "clip_fraction_high": terms.clipped_high,
            }
            report = {name: report_entry((value * shown).sum(), shown.sum()) for name, value in per_token.items()}
        return (*reduce_token_loss(terms.loss, mask, per_sequence=g.per_sequence_loss), report)

    def training_step(self, batch: dict, batch_idx: int) -> torch.Tensor:
        g = self.grpo
        if "prompt_tokens" in batch:
            rows, metrics = self.rollout(batch)
            per_microbatch = self.micro_batch_size(batch) * g.group_size
            self.rollout_step += 1
        else:  # fixed rollouts (tokens, loss_mask, advantages[, sampler_log_probs])
            rows, metrics = batch, {}
            per_microbatch = self.micro_batch_size(batch)
        step, result, lr = self.update(rows, per_microbatch)
        self.log_training_step(step, result, lr)  # KL, entropy and clipping: over every update of the rollout
        for name, value in metrics.items():
            self.log(name, value, prog_bar=name == "train/reward_mean")
        return step.loss

    # --- evaluation: pass@k on held-out prompts ---------------------------------------------------
    def validation_step(self, batch: dict, batch_idx: int) -> torch.Tensor:
        if "prompt_tokens" not in batch:
            return super().validation_step(batch, batch_idx)
        k = self.grpo.eval_samples
        rows, result = self._sample(batch, k, rollout_seed(self.grpo.rollout_seed + 1, 2**31))
        rewards = self._score(batch, rows, result, k).view(-1, k)
        solved = (rewards >= self.grpo.success_threshold).any(dim=1).float()
        prompts = float(rewards.shape[0])
        self.eval_metrics["pass_at_k"].update(solved.mean().to(self.device), weight=prompts)
        self.eval_metrics["reward_mean"].update(rewards.mean().float().to(self.device), weight=prompts)
        self.log("val/pass_at_k", self.eval_metrics["pass_at_k"], on_step=False, on_epoch=True, prog_bar=True)
        self.log("val/reward_mean", self.eval_metrics["reward_mean"], on_step=False, on_epoch=True)
        return solved.mean()

    # --- checkpoint: rollout state ------------------------------------------------------------------
    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        super().on_save_checkpoint(checkpoint)
        checkpoint[ROLLOUT_STATE_KEY] = {"rollout_step": int(self.rollout_step)}

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        state = checkpoint.get(ROLLOUT_STATE_KEY)
        if state is not None:
            self.rollout_step = int(state["rollout_step"])
