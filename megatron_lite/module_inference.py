"""GPTModule's inference entry points: logits over the real vocabulary (:meth:`~GPTInference.full_logits`), text
generation with a KV cache (:meth:`~GPTInference.generate`) and the continuation of a prompt batch in
``trainer.predict`` (:meth:`~GPTInference.generate_batch`). Each runs the model in eval mode whatever mode it is in
and leaves that mode as it was; each works alone (no Trainer) and inside a Trainer at any layout."""

from __future__ import annotations

import contextlib
from typing import Any, Iterator, Optional

import torch
from torch import nn

from megatron_lite.core.engine import TrainingEngine
from megatron_lite.core.inference import GenerationResult, SamplingParams
from megatron_lite.core.inference import generate as generate_tokens
from megatron_lite.core.inference.expert_rounds import ExpertRounds, finish_generation
from megatron_lite.core.models import GPTConfig
from megatron_lite.core.parallel.layout import ParallelLayout
from megatron_lite.core.parallel.vocab_padding import gather_real_vocab


class GPTInference:
    """The inference methods of :class:`~megatron_lite.GPTModule` (a mixin). They use the module's ``model`` (built by
    ``configure_model()`` when there is none), its ``parallel_layout``, its ``engine`` (the pipeline's forward) and
    its ``config``."""

    model: Optional[nn.Module]
    config: GPTConfig
    parallel_layout: ParallelLayout
    engine: TrainingEngine

    @torch.no_grad()
    def full_logits(self, tokens: torch.Tensor) -> torch.Tensor:
        """Logits over the real vocabulary ``[b, s, vocab_size]`` for ``tokens`` [b, s], on every rank
        (through the pipeline's stages when there are several). In eval mode (no dropout), whatever mode the
        model is in; its mode is left as it was. With experts folded over the data-parallel replicas the forward is
        one round of the expert group's (see ``core/inference/expert_rounds.py``), so the replicas may make different
        numbers of calls, as ``trainer.predict`` makes them."""
        rounds = ExpertRounds(self.model, self.parallel_layout)
        with _eval_mode(self.model):
            rounds.before_forward()
            if self.parallel_layout.pp_size == 1:
                logits = self.model.full_logits(tokens)
            else:
                logits = self.engine.forward_outputs([{"tokens": tokens}], forward_step=_logits_step)[0]
                logits = gather_real_vocab(logits, self.parallel_layout.group("tp"), self.config.vocab_size)
            rounds.drain()
        return logits

    def generate(
        self,
        prompts: list[list[int]],
        max_new_tokens: int,
        temperature: float = 0.0,
        top_k: int = 0,
        top_p: float = 1.0,
        seed: Optional[int] = None,
        stop_ids: Optional[list[int]] = None,
        return_log_probs: bool = False,
    ) -> GenerationResult:
        """Continue each prompt (a list of token ids; any lengths) by up to ``max_new_tokens`` tokens with a KV
        cache: greedy at ``temperature=0``, else sampled (``top_k``/``top_p`` filtering, reproducible with
        ``seed``). A row ends after one of ``stop_ids``. Returns the new tokens of each prompt (and with
        ``return_log_probs`` their log-probs under the model: temperature 1, unfiltered).

        Works alone (the model is built for one process if needed) and inside a Trainer at any layout, where
        every rank of a model replica must call it with the same arguments (they all get the same result).
        """
        if self.model is None:
            self.configure_model()
        with _eval_mode(self.model):
            return generate_tokens(
                self.model,
                prompts,
                max_new_tokens,
                SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, seed=seed),
                stop_ids=stop_ids,
                return_log_probs=return_log_probs,
            )

    def generate_batch(self, batch: dict) -> torch.Tensor:
        """Continue a batch of a :class:`~megatron_lite.data.PromptDataModule`: ``prompt_tokens`` [b, L] (each
        row's first ``prompt_lengths`` entries), its ``generation`` options and ``index`` (the prompts' dataset
        indices, which seed their samples: the result does not depend on batching or data parallelism).
        Returns the new tokens [b, max_new_tokens] (int64, -1 after a row's end)."""
        options = dict(batch["generation"])
        lengths = batch["prompt_lengths"].tolist()
        prompts = [row[:n] for row, n in zip(batch["prompt_tokens"].tolist(), lengths)]
        max_new_tokens = int(options.pop("max_new_tokens"))
        sampling = SamplingParams(**{k: options.pop(k) for k in ("temperature", "top_k", "top_p", "seed")})
        with _eval_mode(self.model):
            result = generate_tokens(
                self.model,
                prompts,
                max_new_tokens,
                sampling,
                stop_ids=options.pop("stop_ids"),
                row_ids=batch["index"].tolist(),
            )
        out = torch.full((len(prompts), max_new_tokens), -1, dtype=torch.int64)
        for i, tokens in enumerate(result.tokens):
            out[i, : len(tokens)] = torch.tensor(tokens, dtype=torch.int64)
        return out

    def on_predict_epoch_end(self) -> None:
        """Lightning's predict sampler splits the batches over the data-parallel replicas without repeating any, so
        replicas may get different numbers of them; where they share folded experts, each ends by serving the
        others' remaining forwards (under the predict steps' precision context, so its experts compute in their
        dtype). No collective otherwise."""
        if self.model is None:
            return
        precision = self.trainer.precision_plugin
        with precision.predict_step_context(), _eval_mode(self.model):
            finish_generation(self.model, self.parallel_layout)


@contextlib.contextmanager
def _eval_mode(model: nn.Module) -> Iterator[None]:
    """``model`` in eval mode (no dropout) for an inference call, then every sub-module back in its own mode
    (a model handed back by a forked fit is in train mode, and a frozen part of it may be in eval mode)."""
    modes = [(m, m.training) for m in model.modules()]
    model.eval()
    try:
        yield
    finally:
        for m, training in modes:
            m.training = training


def _logits_step(part: Any, microbatch: dict, input_tensor: Optional[torch.Tensor]) -> torch.Tensor:
    """A stage forward that ends in this TP rank's logits (no labels: no loss)."""
    return part(microbatch["tokens"], hidden_states=input_tensor)
