"""RewardModel: the GPT trunk with a scalar head instead of the vocabulary projection.

The last stage returns one value per token, ``[b, s]``, identical on every TP rank; a reward model
reads it at each sequence's last token (a critic would use every position). The head is a
replicated ``h -> 1`` projection applied where the final norm's output lives: under sequence
parallelism on this rank's slice of the sequence, and only the ``[s, b]`` values (not the
``[s, b, h]`` hidden states) are gathered across TP. Parameter names are GPTModel's plus
``value_head.weight``, so a GPT checkpoint's trunk matches by name.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from megatron_lite.core.models.config import GPTConfig
from megatron_lite.core.models.gpt import GPTModel
from megatron_lite.core.parallel.layout import ParallelLayout
from megatron_lite.core.parallel.mappings import gather_from_sequence_parallel_region
from megatron_lite.core.parallel.tensor_parallel import initialize_parameters, mark_parameter


class RewardModel(GPTModel):
    """A :class:`GPTModel` (``output_layer=False``) ending in a scalar head on its last stage.

    ``forward(tokens)`` on the last stage returns per-token values ``[b, s]``; other pipeline stages
    return their activations ``[s(/tp), b, h]`` as GPTModel's do.
    """

    def __init__(self, config: GPTConfig, layout: Optional[ParallelLayout] = None, seed: int = 1234):
        super().__init__(config, layout, seed, output_layer=False)
        self.value_head: Optional[nn.Linear] = None
        if self.post_process:
            # No bias: a pairwise (Bradley-Terry) loss only sees differences of rewards, so a bias
            # would never receive a gradient. Under SP each TP rank sees part of the sequence, so
            # the weight's gradient is partial and summed over TP like a norm weight's.
            self.value_head = nn.Linear(config.hidden_size, 1, bias=False)
            mark_parameter(self.value_head.weight, ("normal", config.init_method_std), sequence_parallel_grad=True)
            # Drawn from (seed, "value_head.weight"), like every other parameter: layout-independent.
            initialize_parameters(nn.ModuleDict({"value_head": self.value_head}), seed)

    def forward(
        self,
        tokens: torch.Tensor,
        labels: Optional[torch.Tensor] = None,
        position_ids: Optional[torch.Tensor] = None,
        cu_seqlens: Optional[torch.Tensor] = None,
        hidden_states: Optional[torch.Tensor] = None,
        chunk: int = 0,
        loss_mask: Optional[torch.Tensor] = None,
        with_mtp: bool = True,
    ) -> torch.Tensor:
        """``tokens`` [b, s] -> per-token values [b, s] on the last stage (activations elsewhere);
        the other arguments are GPTModel's (positions, packed-sequence ids, pipeline chunk; no MTP loss to mask or
        leave out)."""
        if labels is not None:
            raise ValueError("RewardModel has no vocabulary and takes no labels; call it with tokens only")
        x = super().forward(
            tokens, position_ids=position_ids, cu_seqlens=cu_seqlens, hidden_states=hidden_states, chunk=chunk
        )
        if not self.chunks[chunk].post_process:
            return x
        assert self.value_head is not None  # built on every last stage
        values = self.value_head(x).squeeze(-1)  # [s(/tp), b]
        if self.sequence_parallel:
            # The consumer (the loss) is replicated over TP: the backward keeps this rank's slice.
            values = gather_from_sequence_parallel_region(values, self.tp_group, grad_is_partial=False)
        return values.t().contiguous()


def last_token_values(values: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """``values`` [b, s] at each sequence's last real token (index ``lengths - 1``, ``1 <= lengths <= s``)
    -> [b]. Unchecked, so that no host sync interrupts the schedule: the datamodule guarantees the range."""
    return values.gather(1, (lengths.to(torch.long) - 1).unsqueeze(1)).squeeze(1)


def chunk_rewards(
    part, tokens: torch.Tensor, lengths: torch.Tensor, input_tensor: Optional[torch.Tensor] = None
) -> torch.Tensor:
    """One pipeline chunk of a :class:`RewardModel` on ``tokens`` [b, s]: its activations for the next
    stage, or on the last stage the rewards [b] at each sequence's last token (``lengths`` [b])."""
    out = part(tokens, hidden_states=input_tensor)
    return last_token_values(out, lengths) if part.post_process else out
