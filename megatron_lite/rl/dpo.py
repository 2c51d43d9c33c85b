"""DPOModule: Direct Preference Optimization, a third objective on the training engine.

A pair's chosen and rejected sequences run as ONE microbatch ``{"tokens": [2b, s+1], "loss_mask": [2b, s]}``
(chosen rows first), so every schedule, layout and the context-parallel split drive it unchanged. The last
stage turns the vocab-parallel cross entropy the model already computes into per-sequence sums of
response-token log-probs (``−Σ loss·mask``); the loss is DESIGN §3's DPO (or IPO) on them
(:mod:`megatron_lite.rl.dpo_loss`), averaged over the global batch's pairs.

**The reference model** is a second model of the same layout (same TP shards, same pipeline stages), frozen,
held outside the module (so it is in no optimizer and no checkpoint) and run by its own forward-only engine
*before* the policy's step: its per-sequence log-probs arrive on every rank (broadcast from the last stage)
and travel with each microbatch as ``reference_logps``. This keeps the policy's pipeline untouched (no
concatenated activations, no second set of stage buffers) at the price of one extra forward-only pipeline
pass per step — which is what a frozen model costs anyway. With ``precompute_reference_log_probs`` that
pass runs once per pair before training (cached by the pair's ``index``) and the reference model is freed.
With LoRA adapters on the policy (the ``LoRA`` callback) and ``reference=None`` no second model is built: the
reference is the policy's frozen base, run through the same forward-only engine path with its adapters switched
off (:func:`~megatron_lite.rl.reference.run_as_base`).

**Packed rows** (``PreferenceDataModule(pack_sequences=True)``) hold several pairs per row, each sequence a
document of ``cu_seqlens``; the model runs them on the packed-attention path and the last stage sums each
predicting position's masked log-prob into its sequence's slot (:func:`sequence_slots`: ``[2n]`` for ``n`` pair
slots, chosen then rejected as above, empty slots ignored), so the loss is the same function of the same pairs;
its count is the number of real pairs, so packed and unpacked global batches of the same pairs agree.

Under context parallelism each rank holds a zigzag share of every sequence: its partial log-prob sums are
all-reduced over the CP group (differentiably, the backward summing too) before the nonlinearity; every CP
rank then computes the same pair losses, counted once per CP rank, which the engine's sum over dp x cp of
both the losses and the pair counts turns back into the per-pair mean.
"""

from __future__ import annotations

import contextlib
import os
from typing import Any, Optional

import torch
import torch.distributed as dist
import torch.distributed.nn.functional as dist_fn
from torch import nn
from torch.utils.data import default_collate

from megatron_lite.core.engine import TrainingEngine
from megatron_lite.core.estimator.objective_cost import ObjectiveCost
from megatron_lite.core.models import GPTConfig
from megatron_lite.core.optim import OptimizerConfig
from megatron_lite.core.parallel.loss_report import report_entry
from megatron_lite.core.parallel.run_spec import RunSpec
from megatron_lite.core.parallel.schedules import gpt_forward_step, split_microbatches
from megatron_lite.module import GPTModule
from megatron_lite.rl.dpo_loss import check_dpo_options, dpo_terms
from megatron_lite.rl.reference import base_is_reference, freeze_multi_token_prediction, frozen_reference, run_as_base

# GPTConfig fields that decide the weights' shapes: a reference must agree on all of them.
SHAPE_FIELDS = (
    "num_layers",
    "hidden_size",
    "num_attention_heads",
    "num_query_groups",
    "ffn_hidden_size",
    "kv_channels",
    "vocab_size",
    "normalization",
    "activation",
    "position_embedding_type",
    "share_embeddings_and_output_weights",
    "add_bias_linear",
    "add_qkv_bias",
    "qk_layernorm",
)


def pair_microbatch(microbatch: dict) -> dict:
    """A PreferenceDataModule microbatch as one token batch: chosen rows then rejected rows; packed rows
    (``cu_seqlens``) as they are, with each predicting position's ``sequence_slot`` (see :func:`sequence_slots`)."""
    if "cu_seqlens" in microbatch:
        out = {k: microbatch[k] for k in ("tokens", "loss_mask", "position_ids", "cu_seqlens", "index")}
        out["sequence_slot"] = sequence_slots(
            microbatch["cu_seqlens"], microbatch["index"], microbatch["loss_mask"].shape[1]
        )
        return out
    out = {
        "tokens": torch.cat([microbatch["chosen_tokens"], microbatch["rejected_tokens"]]),
        "loss_mask": torch.cat([microbatch["chosen_loss_mask"], microbatch["rejected_loss_mask"]]),
    }
    if "index" in microbatch:
        out["index"] = microbatch["index"]
    return out


def sequence_slots(cu_seqlens: torch.Tensor, index: torch.Tensor, seq_length: int) -> torch.Tensor:
    """For packed rows ``[b, s+1]`` of ``P`` pair slots (``index`` [b, P], -1 where empty): the slot ``[b, s]``
    of the sequence each predicting position's label belongs to, in the unpacked layout's order (``n = b·P``
    chosen slots ``r·P + p`` first, then the rejected ones ``n + r·P + p``) and ``2n`` for padding. Document
    ``2p`` of a row is its pair ``p``'s chosen sequence, ``2p + 1`` the rejected (the data's layout)."""
    b, pairs = index.shape
    n = b * pairs
    starts = cu_seqlens.long()
    starts = torch.where(starts >= 0, starts, torch.full_like(starts, torch.iinfo(torch.int64).max))
    labels = torch.arange(1, seq_length + 1, device=cu_seqlens.device).expand(b, -1).contiguous()
    document = torch.searchsorted(starts.contiguous(), labels, right=True) - 1  # [b, s]; the row length starts none
    pair, rejected = document // 2, document % 2
    in_pair = pair < pairs
    real = in_pair & (index.gather(1, pair.clamp(max=pairs - 1)) >= 0)
    row = torch.arange(b, device=cu_seqlens.device)[:, None]
    slot = rejected * n + row * pairs + pair
    return torch.where(real, slot, torch.full_like(slot, 2 * n))


def sequence_log_probs_step(
    part: Any, microbatch: dict, input_tensor: Optional[torch.Tensor], cp_group: Any = None
) -> torch.Tensor:
    """One chunk's forward of a :func:`pair_microbatch`: activations for the next stage, or on the last stage
    each sequence's sum of response-token log-probs ``[2b]`` (summed over the CP group, differentiably); for
    packed rows ``[2n]``, ``n = b·P`` pair slots, summed per sequence by ``sequence_slot`` (empty slots 0)."""
    # a policy's multi-token prediction loss would be summed over tokens and divided by DPO's pair count: it is
    # left out, and the MTP depths stay as they were (frozen: configure_model)
    out = gpt_forward_step(part, microbatch, input_tensor, with_mtp=False)
    if not getattr(part, "post_process", True):
        return out
    token_logps = -(out.float() * microbatch["loss_mask"].to(torch.float32))
    if "sequence_slot" in microbatch:
        n = microbatch["index"].numel()
        logps = token_logps.new_zeros(2 * n + 1).index_add(
            0, microbatch["sequence_slot"].reshape(-1), token_logps.reshape(-1)
        )[: 2 * n]
    else:
        logps = token_logps.sum(dim=1)
    if cp_group is not None and dist.get_world_size(cp_group) > 1:
        # all_reduce whose backward is an all-reduce too: see the module docstring for why the sum is right.
        logps = dist_fn.all_reduce(logps, group=cp_group)
    return logps


class _ReferenceObjective:
    """The reference model's objective: forward only (its engine never trains)."""

    def __init__(self, cp_group: Any):
        self.cp_group = cp_group

    def forward_step(self, part: Any, microbatch: dict, input_tensor: Optional[torch.Tensor]) -> torch.Tensor:
        return sequence_log_probs_step(part, microbatch, input_tensor, self.cp_group)

    def loss(self, output: torch.Tensor, microbatch: dict) -> tuple[torch.Tensor, torch.Tensor]:
        raise RuntimeError("the DPO reference model is frozen: it is only run forward")


def reference_config(path: str) -> GPTConfig:
    """The GPTConfig of a reference given as one of our checkpoints or an HF model directory."""
    from megatron_lite.core.checkpoint.full.reader import is_checkpoint_directory, read_checkpoint_hparams
    from megatron_lite.core.checkpoint.hf.directory import is_hf_directory, read_hf_model_config

    if is_checkpoint_directory(path):
        return read_checkpoint_hparams(path)["config"]
    if is_hf_directory(path):
        return read_hf_model_config(path)  # tied or not as the weights load (the tie rule may read the two heads)
    if not os.path.exists(path):
        raise FileNotFoundError(
            f"DPO reference {path} does not exist; pass reference=<one of our checkpoints or a "
            f"local Hugging Face model directory>, or reference=None for the initial weights"
        )
    raise FileNotFoundError(
        f"DPO reference {path} is neither a megatron-lite checkpoint nor a Hugging Face model "
        f"directory (config.json + safetensors)"
    )


def _shape(config: GPTConfig) -> dict[str, Any]:
    return {f: getattr(config, f) for f in SHAPE_FIELDS}


class DPOModule(GPTModule):
    """Fine-tune a GPT on preference pairs (:class:`~megatron_lite.data.PreferenceDataModule`) with DPO or IPO.

    Args:
        config, optimizer, seed: as for :class:`GPTModule` (start from pretrained weights with
            ``DPOModule.from_pretrained(path, beta=...)``).
        beta: β, the strength of the implicit KL to the reference (0.1 is usual).
        label_smoothing: ε of conservative DPO, the assumed share of flipped labels (sigmoid loss only).
        loss_type: ``"sigmoid"`` (DPO) or ``"ipo"``.
        reference: None: a frozen copy of the policy's weights when its model is built (its initial weights) --
            with LoRA adapters on the policy, its own base with the adapters off (no copy); or a path to one of our
            checkpoints or a local HF model directory of the same shape (a second model, LoRA or not).
        precompute_reference_log_probs: run the reference once over every pair of the datamodule's splits
            before training, keep the log-probs in memory (keyed by pair index) and free the reference model.

    Logs ``train/loss`` and ``train/{rewards_chosen, rewards_rejected, reward_margin, reward_accuracy}``
    (global-batch means, equal on every rank), the same under ``val/`` and ``test/``.
    """

    loss_is_token_nll = False  # no val/perplexity: the loss is not a next-token NLL
    progress_bar_metrics = ("reward_accuracy",)

    def __init__(
        self,
        config: GPTConfig,
        optimizer: Optional[OptimizerConfig] = None,
        seed: int = 1234,
        beta: float = 0.1,
        label_smoothing: float = 0.0,
        loss_type: str = "sigmoid",
        reference: Optional[str] = None,
        precompute_reference_log_probs: bool = False,
    ):
        super().__init__(config, optimizer, seed)
        check_dpo_options(beta, label_smoothing, loss_type)
        if reference is not None and not isinstance(reference, (str, os.PathLike)):
            raise TypeError(f"reference must be None or a path (str), got {type(reference).__name__}")
        self.beta, self.label_smoothing, self.loss_type = float(beta), float(label_smoothing), loss_type
        self.reference = None if reference is None else os.fspath(reference)
        self.precompute_reference_log_probs = bool(precompute_reference_log_probs)
        # One call holds every argument: a second save_hyperparameters would replace GPTModule's.
        self.save_hyperparameters(
            {
                "config": self.config,
                "optimizer": self.optimizer_config,
                "seed": seed,
                "beta": beta,
                "label_smoothing": label_smoothing,
                "loss_type": loss_type,
                "reference": self.reference,
                "precompute_reference_log_probs": self.precompute_reference_log_probs,
            }
        )
        # Not a sub-module (set through __dict__): never in the optimizer, the state dict or a checkpoint.
        self.__dict__["_reference_model"] = None
        self._reference_engine: Optional[TrainingEngine] = None
        self._reference_cache: dict[int, torch.Tensor] = {}  # pair index -> (chosen, rejected) log-probs
        self._reference_done = False  # the reference's log-probs are all cached and its model freed

    @classmethod
    def from_pretrained(
        cls, path: str, *, optimizer: Optional[OptimizerConfig] = None, seed: Optional[int] = None, **kwargs: Any
    ) -> "DPOModule":
        """A DPOModule holding the weights of ``path``; DPO options (``beta``, ``label_smoothing``, ``loss_type``,
        ``reference``, ``precompute_reference_log_probs``) are set on it, the rest override GPTConfig fields.
        With ``reference=None`` the reference is these pretrained weights."""
        options = {
            k: kwargs.pop(k)
            for k in ("beta", "label_smoothing", "loss_type", "reference", "precompute_reference_log_probs")
            if k in kwargs
        }
        module = super().from_pretrained(path, optimizer=optimizer, seed=seed, **kwargs)
        dpo = cls(module.config, module.optimizer_config, module.seed, **options)
        dpo.model = module.model
        return dpo

    # --- checks before launch ------------------------------------------------------------
    def check_before_launch(self, run: RunSpec, trainer: Any, module: Any, datamodule: Any) -> None:
        super().check_before_launch(run, trainer, module, datamodule)
        run.check_frozen_copy("DPOModule", " instead")
        if self.reference is not None:
            self._check_reference_shape(reference_config(self.reference))

    def _check_reference_shape(self, config: GPTConfig) -> None:
        ours, theirs = _shape(self.config), _shape(config)
        if ours != theirs:
            differ = [f for f in SHAPE_FIELDS if ours[f] != theirs[f]]
            raise ValueError(
                f"the DPO reference {self.reference} has another shape than the policy: reference "
                f"{ {f: theirs[f] for f in differ} } vs policy { {f: ours[f] for f in differ} } (full shapes: "
                f"reference {theirs}, policy {ours}); pass a reference of the policy's shape, or reference=None"
            )

    def objective_cost(self, datamodule: Any = None) -> ObjectiveCost:
        """A pair is two sequences (a packed row of pairs, one row), trained once; the frozen reference runs a
        forward over each every step and is held while training -- unless its log-probs were precomputed
        (once, before training; the reference is freed then)."""
        live_reference = int(not self.precompute_reference_log_probs)
        return ObjectiveCost(
            sequences_per_sample=1 if getattr(datamodule, "pack_sequences", False) else 2,
            forward_only_passes=live_reference,
            frozen_models=live_reference if not self._base_is_reference() else 0,
        )

    # --- the reference model -------------------------------------------------------------
    @property
    def reference_model(self) -> Optional[nn.Module]:
        """The frozen reference of this rank (its TP shards and pipeline stages), None once freed or when the
        policy's own base is the reference (LoRA)."""
        return self.__dict__["_reference_model"]

    def _base_is_reference(self) -> bool:
        """The reference is the policy's base with its LoRA adapters off (no reference model is built)."""
        return self.reference is None and base_is_reference(self.model)

    def configure_model(self) -> None:
        super().configure_model()  # the LoRA callback's adapters are attached here
        freeze_multi_token_prediction(self.model)
        if self._reference_done:
            return
        if self._base_is_reference():
            self.__dict__["_reference_model"] = None  # a copy of a previous fit's, if any, is not needed
            self._reference_engine = None
            return
        previous = self.reference_model
        reference = frozen_reference(self, previous, self._load_reference if self.reference is not None else None)
        if reference is previous:
            return
        param = next(self.model.parameters(), None)
        reference.to(param.device if param is not None else "cpu")  # and again at first use (see _reference_log_probs)
        self.__dict__["_reference_model"] = reference
        self._reference_engine = None

    def _load_reference(self) -> nn.Module:
        """The reference checkpoint's one-process model, checked against the policy's shape."""
        loaded = GPTModule.from_pretrained(self.reference, seq_length=self.config.seq_length)
        self._check_reference_shape(loaded.config)
        return loaded.model

    def _reference_log_probs(self, microbatches: list[dict]) -> list[torch.Tensor]:
        """Each microbatch's reference log-probs ``[2b]``, from the cache or the reference model."""
        if self.precompute_reference_log_probs and all("index" in mb for mb in microbatches):
            cached = [self._cached(mb["index"]) for mb in microbatches]
            if all(c is not None for c in cached):
                return cached
        base = self._base_is_reference()
        reference = self.model if base else self.reference_model
        if reference is None:
            raise RuntimeError(
                "a batch holds pairs whose reference log-probs were not precomputed and the reference "
                "model was freed; precompute covers the datamodule's splits at the start of fit: give "
                "this data to that fit, or set precompute_reference_log_probs=False"
            )
        param = next(reference.parameters(), None)
        if not base and param is not None and param.device != self.device:
            # Lightning moves the module to its device after configure_model; the reference is not a sub-module.
            reference.to(self.device)
        engine = self._reference_engine
        if engine is None or engine.model is not reference:
            engine = TrainingEngine(
                reference, self.parallel_layout, _ReferenceObjective(self.parallel_layout.group("cp"))
            )
            self._reference_engine = engine
        with torch.no_grad(), run_as_base(reference) if base else contextlib.nullcontext():
            return [out.detach().float() for out in engine.forward_outputs(microbatches)]

    def _cached(self, index: torch.Tensor) -> Optional[torch.Tensor]:
        """``[2n]`` (chosen slots, then rejected) for ``index`` [b] or packed [b, P] (-1: an empty slot, 0)."""
        empty = torch.zeros(2)
        rows = [self._reference_cache.get(i) if i >= 0 else empty for i in index.reshape(-1).tolist()]
        if any(r is None for r in rows):
            return None
        pairs = torch.stack(rows)  # [n, 2]
        return torch.cat([pairs[:, 0], pairs[:, 1]]).to(self.device)

    def on_fit_start(self) -> None:
        if self.precompute_reference_log_probs and not self._reference_done:
            self.precompute_reference(getattr(self.trainer, "datamodule", None))

    @torch.no_grad()
    def precompute_reference(self, datamodule: Any) -> None:
        """Run the reference over every pair of ``datamodule``'s splits once (each DP rank a share, then summed
        over DP), cache the log-probs by pair index and free the reference model."""
        datasets = list(getattr(datamodule, "datasets", {}).values())
        samples = [s for d in datasets for s in (d[i] for i in range(len(d)))]  # pairs, or packed rows of pairs
        if not samples or "index" not in samples[0]:
            raise ValueError(
                "precompute_reference_log_probs needs a PreferenceDataModule (its splits and each "
                "pair's index); set precompute_reference_log_probs=False for other data"
            )
        layout = self.parallel_layout
        dp_rank, dp_size = layout.dp_rank, layout.dp_size
        indices = sorted(i for s in samples for i in s["index"].reshape(-1).tolist() if i >= 0)
        mine = samples[dp_rank::dp_size]
        mbs = self.micro_batch_size({"x": torch.zeros(len(mine) or 1)})
        table = torch.zeros(max(indices) + 1, 2, dtype=torch.float32, device=self.device)
        for start in range(0, len(samples[0::dp_size]), mbs):  # every DP rank runs as many chunks
            chunk = mine[start : start + mbs] or mine[-1:]
            chunk = chunk + [chunk[-1]] * (mbs - len(chunk))  # equal shapes: pad with a repeat
            raw = default_collate(chunk)
            microbatch = self.context_parallel_share(pair_microbatch(raw))
            logps = self._reference_log_probs_live([microbatch])[0]
            index = raw["index"].reshape(-1).to(self.device)
            n, real = index.numel(), index >= 0
            table[index[real]] = torch.stack([logps[:n][real], logps[n:][real]], dim=1)
        group = layout.group("dp")
        if group is not None and dist.get_world_size(group) > 1:
            dist.all_reduce(table, group=group)
        self._reference_cache = {i: table[i].cpu() for i in indices}
        self.__dict__["_reference_model"] = None
        self._reference_engine = None
        self._reference_done = True

    def _reference_log_probs_live(self, microbatches: list[dict]) -> list[torch.Tensor]:
        precompute, self.precompute_reference_log_probs = self.precompute_reference_log_probs, False
        try:
            return self._reference_log_probs(microbatches)
        finally:
            self.precompute_reference_log_probs = precompute

    # --- the objective -------------------------------------------------------------------
    def step_microbatches(self, batch: dict) -> list[dict]:
        """Pairs as token microbatches (this CP rank's share), each with its ``reference_logps`` [2b]."""
        if "chosen_tokens" not in batch and not {"cu_seqlens", "index"} <= set(batch):
            raise ValueError(
                f"DPOModule trains on preference pairs (chosen_tokens, rejected_tokens, ... or packed "
                f"rows of pairs: megatron_lite.data.PreferenceDataModule), got a batch of {sorted(batch)}"
            )
        microbatches = [
            self.context_parallel_share(pair_microbatch(mb))
            for mb in split_microbatches(batch, self.micro_batch_size(batch))
        ]
        for mb, ref in zip(microbatches, self._reference_log_probs(microbatches)):
            mb["reference_logps"] = ref
        return microbatches

    def forward_step(self, part: Any, microbatch: dict, input_tensor: Optional[torch.Tensor]) -> torch.Tensor:
        """Activations for the next stage, or on the last stage the sequences' response log-probs [2b]."""
        return sequence_log_probs_step(part, microbatch, input_tensor, self.parallel_layout.group("cp"))

    def loss(self, logps: torch.Tensor, microbatch: dict) -> tuple:
        """(sum of the pairs' DPO losses, number of pairs, the rewards, margin and accuracy summed over the
        pairs). Packed rows' empty pair slots (``index`` -1) count for nothing."""
        chosen, rejected = logps.chunk(2)
        ref_chosen, ref_rejected = microbatch["reference_logps"].to(logps.device).chunk(2)
        terms = dpo_terms(
            chosen,
            rejected,
            ref_chosen,
            ref_rejected,
            beta=self.beta,
            label_smoothing=self.label_smoothing,
            loss_type=self.loss_type,
        )
        if "sequence_slot" in microbatch:
            real = (microbatch["index"].reshape(-1) >= 0).to(logps.device)
            # where, not a product: an empty slot's loss (log 2) must add nothing, not even 0 x something
            loss = torch.where(real, terms.loss, torch.zeros_like(terms.loss)).sum()
            keep = real.double()
        else:
            loss, keep = terms.loss.sum(), torch.ones_like(chosen, dtype=torch.float64)
        pairs = keep.sum()
        per_pair = {
            "rewards_chosen": terms.rewards_chosen,
            "rewards_rejected": terms.rewards_rejected,
            "reward_margin": terms.margin,
            "reward_accuracy": terms.correct,
        }
        return (
            loss,
            pairs,
            {name: report_entry((value.detach().double() * keep).sum(), pairs) for name, value in per_pair.items()},
        )
