"""TrainDraftHead: train a speculative-decoding draft head on a frozen GPT model with ``trainer.fit``.

The callback adds a :class:`~megatron_lite.post_training.speculative.DraftHeadExtension` to the module in
``setup``: once the model is built every base weight is frozen and the draft head becomes the module's only
trainable sub-module (``module.model.draft_head``), so the optimizer, the schedules, gradient reduction,
logging and checkpoints are the pretraining ones (``train/loss`` is the draft head's loss; the
``train/draft_*`` metrics are logged beside it). At the end of fit the head is written to ``save_path`` if
one is given (one safetensors file holding the base model's fingerprint, loaded with
:func:`~megatron_lite.post_training.load_draft_head`).
"""

from __future__ import annotations

import os
from typing import Optional

import lightning.pytorch as pl

from megatron_lite.core.checkpoint.remote_source import local_files
from megatron_lite.core.engine.extensions import add_extension
from megatron_lite.core.object_store import is_remote
from megatron_lite.post_training.speculative import (
    DraftHeadConfig,
    DraftHeadExtension,
    draft_head_of,
    save_draft_head,
)
from megatron_lite.utils.local_path import require_local_or_object_path


class TrainDraftHead(pl.Callback):
    """Train an EAGLE draft head on the module's frozen model.

    Args:
        kind: "eagle" (Medusa heads are not implemented).
        regression_weight: weight of the feature-regression loss (EAGLE: 1.0).
        classification_weight: weight of the base-greedy-token cross entropy (EAGLE: 0.1).
        seed: seed of the head's initial weights.
        save_path: write the trained head there at the end of fit (None: keep it in the module only); a path or
            an ``s3://`` URL.
        base: load the frozen base model's weights from this checkpoint or Hugging Face directory first (None:
            the module's own weights, e.g. from ``GPTModule.from_pretrained``); how the CLI names the base. At an
            ``s3://`` URL it is looked at here, before launch (an HF directory is copied to the local cache then, so
            the ranks read that copy).
    """

    def __init__(
        self,
        kind: str = "eagle",
        regression_weight: float = 1.0,
        classification_weight: float = 0.1,
        seed: int = 1234,
        save_path: Optional[str | os.PathLike] = None,
        base: Optional[str | os.PathLike] = None,
    ) -> None:
        self.config = DraftHeadConfig(
            kind=kind, regression_weight=regression_weight, classification_weight=classification_weight, seed=seed
        )
        require_local_or_object_path(save_path, "TrainDraftHead(save_path=...)")
        require_local_or_object_path(base, "TrainDraftHead(base=...)")
        if base is not None and is_remote(base):
            local_files(base)  # FileNotFoundError naming the URL when no model is there
        elif base is not None and not os.path.exists(base):
            raise FileNotFoundError(f"TrainDraftHead(base={str(base)!r}): no such checkpoint or Hugging Face directory")
        self.save_path = save_path
        self.extension = DraftHeadExtension(self.config, base=base)

    def setup(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", stage: str) -> None:
        add_extension(pl_module, self.extension, "TrainDraftHead")

    def on_fit_end(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        head = draft_head_of(pl_module.model)
        if self.save_path is not None and head is not None:
            save_draft_head(head, self.save_path)
