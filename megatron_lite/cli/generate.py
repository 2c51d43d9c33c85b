"""``megatron-lite generate --ckpt PATH --prompt TEXT [...]``: continue prompts with a trained checkpoint.

    megatron-lite generate --ckpt runs/demo/checkpoints/last.ckpt --prompt "ROMEO:" --max-new-tokens 48
    megatron-lite generate --ckpt CKPT --prompt "ROMEO:" --prompt "JULIET:" --temperature 0.8 --top-p 0.9 \
        --seed 1 --devices 2 --tensor-model-parallel-size 2

``--ckpt`` is one of our checkpoints (written by ``trainer.save_checkpoint``, ``ModelCheckpoint`` or
``megatron-lite convert``) or a Hugging Face Llama directory, local or at an ``s3://`` URL, loaded by
``GPTModule.from_pretrained``. The tokenizer is the one the checkpoint records (the training data's), a
converted model's own, or the Hugging Face directory's; ``--tokenizer-*`` overrides it. One device
generates in this process; more run ``trainer.predict`` with a
:class:`~megatron_lite.data.PromptDataModule` on forked ranks at the layout asked for. A row stops at
the tokenizer's end-of-document token unless ``--ignore-eod``.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import warnings
from typing import Optional, Sequence

from megatron_lite.cli.tokenizer_options import add_tokenizer_options, tokenizer_options
from megatron_lite.core.inference.sampling import SamplingParams
from megatron_lite.utils.local_path import local_or_object_path_argument

_QUIET_LOGGERS = ("lightning.pytorch", "lightning.fabric", "lightning")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="megatron-lite generate", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument(
        "--ckpt",
        type=local_or_object_path_argument,
        required=True,
        help="one of our checkpoints, or a Hugging Face Llama directory",
    )
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
    p.add_argument(
        "--expert-model-parallel-size",
        type=int,
        default=1,
        help="ranks that split an MoE model's experts, folded into the data-parallel replicas (default 1)",
    )
    p.add_argument("--accelerator", default="cpu", help="Lightning accelerator (default cpu)")
    p.add_argument("--batch-size", type=int, default=8, help="prompts generated together (default 8)")
    add_tokenizer_options(p)
    p.add_argument("--json", action="store_true", help="one JSON object per prompt instead of text")
    p.add_argument(
        "--draft",
        type=local_or_object_path_argument,
        default=None,
        help="speculative decoding with this draft head (a file or checkpoint "
        "of TrainDraftHead; greedy, one process): the same text, fewer base-model forwards",
    )
    p.add_argument("--num-draft-tokens", type=int, default=4, help="tokens the draft head proposes per base forward")
    return p


def _check_args(args: argparse.Namespace) -> SamplingParams:
    sampling = SamplingParams(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, seed=args.seed)
    for name in (
        "devices",
        "tensor_model_parallel_size",
        "pipeline_model_parallel_size",
        "expert_model_parallel_size",
        "batch_size",
    ):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.max_new_tokens < 0:
        raise ValueError(f"--max-new-tokens must be >= 0, got {args.max_new_tokens}")
    if any(not p for p in args.prompt):
        raise ValueError("--prompt is empty: give each prompt some text")
    if args.draft is not None and (
        not sampling.greedy
        or args.devices != 1
        or args.pipeline_model_parallel_size != 1
        or args.tensor_model_parallel_size != 1
        or args.expert_model_parallel_size != 1
    ):
        raise ValueError(
            "--draft (speculative decoding) is greedy and runs in one process: drop --temperature, "
            "--devices, --tensor-model-parallel-size, --pipeline-model-parallel-size and "
            "--expert-model-parallel-size"
        )
    return sampling


def run(args: argparse.Namespace) -> list[dict]:
    """Generate for every ``--prompt``; returns one record per prompt."""
    from megatron_lite.core.checkpoint.remote_source import local_files
    from megatron_lite.data.prompts import PromptDataModule
    from megatron_lite.module import GPTModule
    from megatron_lite.tokenizers.model_tokenizer import model_tokenizer

    sampling = _check_args(args)
    module = GPTModule.from_pretrained(args.ckpt)
    # the tokenizer's files (at a URL: a local copy of the checkpoint's small files; its weights are read there)
    tokenizer = model_tokenizer(local_files(args.ckpt), **tokenizer_options(args))
    stop = [] if args.ignore_eod or tokenizer.eod is None else [tokenizer.eod]
    prompts = [tokenizer.tokenize(p) for p in args.prompt]
    data = PromptDataModule(
        prompts,
        batch_size=args.batch_size,
        max_new_tokens=args.max_new_tokens,
        temperature=sampling.temperature,
        top_k=sampling.top_k,
        top_p=sampling.top_p,
        seed=sampling.seed,
        stop_ids=stop,
    )
    data.check_fits_model(module.config)
    if args.draft is not None:
        return _speculative(module, args, tokenizer, prompts, stop)
    sizes = (args.tensor_model_parallel_size, args.pipeline_model_parallel_size, args.expert_model_parallel_size)
    if args.devices == 1 and sizes == (1, 1, 1):
        new_tokens = [out for batch in data.predict_dataloader() for out in _rows(module.generate_batch(batch))]
    else:
        new_tokens = _predict(module, data, args)
    return [
        {"prompt": text, "completion": completion(tokenizer, ids, new), "prompt_tokens": ids, "new_tokens": new}
        for text, ids, new in zip(args.prompt, prompts, new_tokens)
    ]


def _speculative(module, args: argparse.Namespace, tokenizer, prompts: list[list[int]], stop: list[int]) -> list[dict]:
    from megatron_lite.post_training.speculative import load_draft_head, speculative_generate

    draft = load_draft_head(args.draft, module.model)
    records = []
    for text, ids in zip(args.prompt, prompts):
        result = speculative_generate(
            module, [ids], args.max_new_tokens, draft=draft, num_draft_tokens=args.num_draft_tokens, stop_ids=stop
        )
        new = result.tokens[0]
        records.append(
            {
                "prompt": text,
                "completion": completion(tokenizer, ids, new),
                "prompt_tokens": ids,
                "new_tokens": new,
                "acceptance_length": result.acceptance_length,
            }
        )
    return records


def _rows(batch) -> list[list[int]]:
    return [row[row >= 0].tolist() for row in batch]


def _predict(module, data, args: argparse.Namespace) -> list[list[int]]:
    """``trainer.predict`` on forked ranks: each cuts its shards out of the module's one-process model, and
    the predictions come back here."""
    import lightning as L

    from megatron_lite.strategies import MegatronStrategy

    strategy = MegatronStrategy(
        tensor_model_parallel_size=args.tensor_model_parallel_size,
        pipeline_model_parallel_size=args.pipeline_model_parallel_size,
        expert_model_parallel_size=args.expert_model_parallel_size,
        start_method="fork",
    )
    trainer = L.Trainer(
        strategy=strategy,
        accelerator=args.accelerator,
        devices=args.devices,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
    )
    return [row for batch in trainer.predict(module, datamodule=data) for row in _rows(batch)]


def completion(tokenizer, prompt: list[int], new: list[int]) -> str:
    """The text ``new`` adds after ``prompt``: detokenized together, so a word boundary at the seam keeps its
    space (SentencePiece drops a leading one when the new tokens are detokenized alone)."""
    before, whole = tokenizer.detokenize(prompt), tokenizer.detokenize(prompt + new)
    return whole[len(before) :] if whole.startswith(before) else tokenizer.detokenize(new)


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
