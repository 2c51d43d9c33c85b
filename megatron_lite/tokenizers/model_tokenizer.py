"""The tokenizer that goes with a model: the one its checkpoint records, or a Hugging Face directory's own.

Reading a checkpoint's metadata imports torch (the checkpoint reader), so this is not imported by
``megatron_lite.tokenizers`` itself (preprocessing needs the tokenizers, not torch).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Optional

from megatron_lite.core.checkpoint.format.sharded import read_checkpoint_meta
from megatron_lite.core.checkpoint.full.reader import is_checkpoint_directory
from megatron_lite.core.checkpoint.hf.directory import CHECKPOINT_SIDE_DIR
from megatron_lite.core.models.config import GPTConfig
from megatron_lite.core.optim.config import OptimizerConfig
from megatron_lite.tokenizers.base import Tokenizer
from megatron_lite.tokenizers.build import TOKENIZER_KEY, build_recorded_tokenizer, build_tokenizer


def model_tokenizer(
    path: str | os.PathLike[str],
    tokenizer_type: Optional[str] = None,
    tokenizer_model: Optional[str] = None,
    vocab_file: Optional[str] = None,
    merge_file: Optional[str] = None,
) -> Tokenizer:
    """The tokenizer of the model at ``path``: ``build_tokenizer(tokenizer_type, ...)`` when a type is given, else
    the model's own -- the one our checkpoint records (the training data's, its files in the checkpoint's
    ``tokenizer/``), the one a converted Hugging Face model brought (``hf/`` inside the checkpoint), or the one in
    a Hugging Face directory. ValueError naming the options to pass when there is none."""
    path = Path(path)
    if tokenizer_type is not None:
        spec = {"tokenizer_model": tokenizer_model, "vocab_file": vocab_file, "merge_file": merge_file}
        return build_tokenizer(tokenizer_type, **{k: v for k, v in spec.items() if v is not None})
    ours = is_checkpoint_directory(path)
    hf_dir = path / CHECKPOINT_SIDE_DIR if ours else path
    spec = read_checkpoint_meta(path, [GPTConfig, OptimizerConfig]).get(TOKENIZER_KEY) if ours else None
    if spec:
        return build_recorded_tokenizer(spec, path)
    if (hf_dir / "tokenizer.json").is_file():
        return build_tokenizer("HuggingFaceTokenizer", tokenizer_model=str(hf_dir))
    if (hf_dir / "tokenizer.model").is_file():
        return build_tokenizer("SentencePieceTokenizer", tokenizer_model=str(hf_dir / "tokenizer.model"))
    where = (
        "no tokenizer.json or tokenizer.model in it"
        if not ours
        else "its training data had none, and it brought no Hugging Face tokenizer"
    )
    raise ValueError(
        f"{path} names no tokenizer ({where}); pass --tokenizer-type and its files "
        f"(--tokenizer-model, or --vocab-file and --merge-file)"
    )
