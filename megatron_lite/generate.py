"""``megatron-lite generate --ckpt PATH --prompt TEXT [...]``: continue prompts with a trained checkpoint.

    megatron-lite generate --ckpt runs/demo/checkpoints/last.ckpt --prompt "ROMEO:" --max-new-tokens 48
    megatron-lite generate --ckpt CKPT --prompt "ROMEO:" --prompt "JULIET:" --temperature 0.8 --top-p 0.9 \
        --seed 1 --devices 2 --tensor-model-parallel-size 2

The checkpoint (a directory written by ``trainer.save_checkpoint`` or ``ModelCheckpoint`` under
MegatronStrategy) gives the model config and the weights, and names the tokenizer the data used
(``--tokenizer-*`` overrides it, or supplies one when the checkpoint names none). Generation runs
through ``trainer.predict`` with a :class:`~megatron_lite.data.PromptDataModule`, so any layout that
fits the model works (``--devices``, ``--tensor-model-parallel-size``, ``--pipeline-model-parallel-size``;
the checkpoint loads into any of them). A row stops at the tokenizer's end-of-document token unless
``--ignore-eod``.
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import warnings
from pathlib import Path
from typing import Any, Optional, Sequence

from megatron_lite.core.inference.sampling import SamplingParams

_QUIET_LOGGERS = ("lightning.pytorch", "lightning.fabric", "lightning")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="megatron-lite generate", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ckpt", required=True, help="checkpoint directory written under MegatronStrategy")
    p.add_argument("--prompt", action="append", required=True, help="prompt text (repeat for a batch)")
    p.add_argument("--max-new-tokens", type=int, default=64, help="new tokens per prompt at most (default 64)")
    p.add_argument("--temperature", type=float, default=0.0, help="0 is greedy (default); > 0 samples")
    p.add_argument("--top-k", type=int, default=0, help="sample among the k most likely tokens (0: all)")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass in (0, 1] (1: all)")
    p.add_argument("--seed", type=int, default=None, help="sampling seed (same seed, same text)")
    p.add_argument("--ignore-eod", action="store_true", help="do not stop at the end-of-document token")
    p.add_argument("--devices", type=int, default=1, help="processes (default 1)")
    p.add_argument("--tensor-model-parallel-size", type=int, default=1)
    p.add_argument("--pipeline-model-parallel-size", type=int, default=1)
    p.add_argument("--accelerator", default="cpu", help="Lightning accelerator (default cpu)")
    p.add_argument("--batch-size", type=int, default=8, help="prompts generated together (default 8)")
    p.add_argument("--tokenizer-type", default=None, help="override the checkpoint's tokenizer (build_tokenizer type)")
    p.add_argument("--tokenizer-model", default=None)
    p.add_argument("--vocab-file", default=None)
    p.add_argument("--merge-file", default=None)
    p.add_argument("--json", action="store_true", help="one JSON object per prompt instead of text")
    return p


def load_checkpoint_module(path: str | os.PathLike) -> tuple[Any, dict]:
    """A GPTModule built from a checkpoint's saved config (weights are loaded by ``trainer.predict(ckpt_path=...)``)
    and the checkpoint's metadata.

    TO BE REPLACED by ``GPTModule.from_pretrained(path)`` once it exists (the hf-interop work): it builds the
    module and loads the weights in one call, for our checkpoints and Hugging Face models alike.
    """
    from megatron_lite.core.checkpoint.sharded import read_checkpoint_meta
    from megatron_lite.core.models import GPTConfig
    from megatron_lite.core.optim import OptimizerConfig
    from megatron_lite.module import GPTModule

    path = Path(path)
    if not (path / ".metadata").is_file():
        state = "does not exist" if not path.exists() else "is not a megatron-lite checkpoint directory (no .metadata)"
        raise FileNotFoundError(f"--ckpt {path} {state}; pass the directory that trainer.save_checkpoint() or "
                                f"ModelCheckpoint wrote under MegatronStrategy")
    meta = read_checkpoint_meta(path, allowed=[GPTConfig, OptimizerConfig])
    hparams = meta.get("hyper_parameters") or {}
    config = hparams.get("config")
    if not isinstance(config, GPTConfig):
        raise ValueError(f"{path} holds no GPTModule config (hyper_parameters.config); megatron-lite generate needs "
                         f"a checkpoint of a GPTModule")
    optimizer = hparams.get("optimizer") if isinstance(hparams.get("optimizer"), OptimizerConfig) else None
    return GPTModule(config, optimizer, seed=int(hparams.get("seed", 1234))), meta


def load_tokenizer(meta: dict, args: argparse.Namespace):
    """The tokenizer named on the command line, else the one the checkpoint records."""
    from megatron_lite.module import TOKENIZER_KEY
    from megatron_lite.tokenizers import build_tokenizer

    if args.tokenizer_type is not None:
        spec = {"tokenizer_type": args.tokenizer_type, "tokenizer_model": args.tokenizer_model,
                "vocab_file": args.vocab_file, "merge_file": args.merge_file}
        return build_tokenizer(**{k: v for k, v in spec.items() if v is not None})
    spec = meta.get(TOKENIZER_KEY)
    if not spec:
        raise ValueError(f"the checkpoint names no tokenizer (it was trained on data without one); pass "
                         f"--tokenizer-type and its files (--tokenizer-model, or --vocab-file and --merge-file)")
    spec = dict(spec)
    missing = [spec[k] for k in ("tokenizer_model", "vocab_file", "merge_file") if k in spec and not os.path.exists(spec[k])]
    if missing:
        raise FileNotFoundError(f"the checkpoint's tokenizer file {missing[0]} no longer exists; pass the tokenizer "
                                f"with --tokenizer-type {spec['tokenizer_type']} and its files (--tokenizer-model ...)")
    return build_tokenizer(**spec)


def _check_args(args: argparse.Namespace) -> SamplingParams:
    sampling = SamplingParams(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, seed=args.seed)
    for name in ("devices", "tensor_model_parallel_size", "pipeline_model_parallel_size", "batch_size"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.max_new_tokens < 0:
        raise ValueError(f"--max-new-tokens must be >= 0, got {args.max_new_tokens}")
    if any(not p for p in args.prompt):
        raise ValueError("--prompt is empty: give each prompt some text")
    return sampling


def run(args: argparse.Namespace) -> list[dict]:
    """Generate for every ``--prompt``; returns one record per prompt."""
    import lightning as L

    from megatron_lite.data.prompts import PromptDataModule
    from megatron_lite.strategies import MegatronStrategy

    sampling = _check_args(args)
    module, meta = load_checkpoint_module(args.ckpt)
    tokenizer = load_tokenizer(meta, args)
    stop = [] if args.ignore_eod or tokenizer.eod is None else [tokenizer.eod]
    prompts = [tokenizer.tokenize(p) for p in args.prompt]
    data = PromptDataModule(prompts, batch_size=args.batch_size, max_new_tokens=args.max_new_tokens,
                            temperature=sampling.temperature, top_k=sampling.top_k, top_p=sampling.top_p,
                            seed=sampling.seed, stop_ids=stop)
    data.check_fits_model(module.config)
    # Several ranks are forked from this process (their predictions come back here); one runs in it.
    strategy = MegatronStrategy(tensor_model_parallel_size=args.tensor_model_parallel_size,
                                pipeline_model_parallel_size=args.pipeline_model_parallel_size,
                                start_method="fork" if args.devices > 1 else "popen")
    trainer = L.Trainer(strategy=strategy, accelerator=args.accelerator, devices=args.devices, logger=False,
                        enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False)
    batches = trainer.predict(module, datamodule=data, ckpt_path=str(args.ckpt))
    new_tokens = [row[row >= 0].tolist() for batch in batches for row in batch]
    return [{"prompt": text, "completion": completion(tokenizer, ids, new), "prompt_tokens": ids, "new_tokens": new}
            for text, ids, new in zip(args.prompt, prompts, new_tokens)]


def completion(tokenizer, prompt: list[int], new: list[int]) -> str:
    """The text ``new`` adds after ``prompt``: detokenized together, so a word boundary at the seam keeps its
    space (SentencePiece drops a leading one when the new tokens are detokenized alone)."""
    before, whole = tokenizer.detokenize(prompt), tokenizer.detokenize(prompt + new)
    return whole[len(before):] if whole.startswith(before) else tokenizer.detokenize(new)


def main(argv: Optional[Sequence[str]] = None) -> int:
    """``megatron-lite generate ...``: prints each prompt with its continuation; 2 on bad input."""
    args = build_parser().parse_args(list(sys.argv[1:] if argv is None else argv))
    levels = {name: logging.getLogger(name).level for name in _QUIET_LOGGERS}
    for name in _QUIET_LOGGERS:  # Lightning's "GPU available: ..." lines are noise around the text
        logging.getLogger(name).setLevel(logging.WARNING)
    try:
        with warnings.catch_warnings():
            # Lightning's advice about callbacks that wrote the checkpoint (none are needed to read weights)
            # and its own deprecation noise would bury the text.
            warnings.filterwarnings("ignore", message="Be aware that when using `ckpt_path`")
            warnings.filterwarnings("ignore", message=".*LeafSpec.*")
            records = run(args)
    finally:
        for name, level in levels.items():
            logging.getLogger(name).setLevel(level)
    for i, record in enumerate(records):
        if args.json:
            print(json.dumps(record, ensure_ascii=False))
        else:
            print(("\n" if i else "") + record["prompt"] + record["completion"])
    return 0
