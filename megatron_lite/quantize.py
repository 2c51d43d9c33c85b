"""``megatron-lite quantize --ckpt PATH --config NAME --data CORPUS --output DIR``: post-training quantization
of a trained checkpoint with nvidia-modelopt.

    megatron-lite quantize --ckpt runs/demo/checkpoints/last.ckpt --config INT8_SMOOTHQUANT_CFG \
        --data shakespeare --output runs/demo/int8
    megatron-lite quantize --ckpt CKPT --config FP8_DEFAULT_CFG --kv-cache FP8_KV_CFG --data corpus.jsonl.gz \
        --output out --json

``--ckpt`` is one of our checkpoints or a local Hugging Face Llama directory (``GPTModule.from_pretrained``).
``--data`` is a JSONL corpus (``.gz`` allowed) or a bundled corpus name, tokenized with the checkpoint's
tokenizer (as ``megatron-lite generate`` finds it; ``--tokenizer-*`` overrides): its documents, each followed
by the end-of-document token, are cut into windows of ``seq_length + 1`` tokens; the first
``--calib-batches`` batches calibrate, the next ``--eval-batches`` (disjoint) measure the perplexity before and
after. The quantized model is written to ``--output`` as one of our checkpoints, carrying the tokenizer (and
the HF files of a converted model): ``from_pretrained`` loads it quantized, ``megatron-lite generate --ckpt``
and ``convert --to hf`` read it, ``trainer.fit(..., ckpt_path=...)`` with ``Quantize(when="fit_start")``
fine-tunes it (QAT). ``--overwrite`` replaces an earlier output of megatron-lite, nothing else. Runs in this
process (one device). Exit code 2 on bad input, with one line that says what to change.
"""
from __future__ import annotations

import argparse
import json
import sys
import warnings
from pathlib import Path
from typing import Optional, Sequence

import torch

from megatron_lite.core.checkpoint.format.output_dir import check_output
from megatron_lite.utils.console import exits_quietly_on_broken_pipe
from megatron_lite.utils.optional import MissingDependencyError


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="megatron-lite quantize", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ckpt", required=True, help="one of our checkpoints, or a Hugging Face Llama directory")
    p.add_argument("--config", default="INT8_SMOOTHQUANT_CFG",
                   help="ModelOpt config name (default INT8_SMOOTHQUANT_CFG); 'none' quantizes only the KV cache")
    p.add_argument("--kv-cache", default=None, help="ModelOpt KV-cache preset, e.g. FP8_KV_CFG")
    p.add_argument("--data", required=True, help="JSONL corpus (.gz allowed) or a bundled corpus name")
    p.add_argument("--json-key", default="text", help="the corpus's text field (default text)")
    p.add_argument("--output", required=True, help="directory for the quantized checkpoint")
    p.add_argument("--overwrite", action="store_true", help="replace an earlier output of megatron-lite there")
    p.add_argument("--calib-batches", type=int, default=8, help="calibration batches (default 8)")
    p.add_argument("--eval-batches", type=int, default=8, help="perplexity batches before/after (default 8; 0: none)")
    p.add_argument("--batch-size", type=int, default=4, help="sequences per batch (default 4)")
    p.add_argument("--seq-length", type=int, default=None, help="tokens per sequence (default: the model's)")
    p.add_argument("--tokenizer-type", default=None, help="override the checkpoint's tokenizer (build_tokenizer type)")
    p.add_argument("--tokenizer-model", default=None)
    p.add_argument("--vocab-file", default=None)
    p.add_argument("--merge-file", default=None)
    p.add_argument("--json", action="store_true", help="print one JSON object instead of text")
    return p


def _check_args(args: argparse.Namespace) -> None:
    for name in ("calib_batches", "batch_size"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.eval_batches < 0:
        raise ValueError(f"--eval-batches must be >= 0, got {args.eval_batches}")
    if args.seq_length is not None and args.seq_length < 1:
        raise ValueError(f"--seq-length must be >= 1, got {args.seq_length}")
    if not Path(args.ckpt).exists():
        raise FileNotFoundError(f"--ckpt {args.ckpt} does not exist")
    check_output(args.output, [args.ckpt], args.overwrite)


def corpus_batches(path: str, json_key: str, tokenizer, seq_length: int, batch_size: int,
                   count: int) -> list[dict]:
    """The first ``count`` batches ``{"tokens": [batch_size, seq_length + 1]}`` of windows cut from the corpus's
    documents (each followed by the end-of-document token), reading only as many documents as they need."""
    from megatron_lite.data.bundled import resolve_corpus
    from megatron_lite.utils.jsonl import iter_jsonl_texts

    needed = count * batch_size * seq_length + 1
    tokens: list[int] = []
    eod = getattr(tokenizer, "eod", None)
    for text in iter_jsonl_texts(resolve_corpus(path), json_key, option="--json-key"):
        tokens += tokenizer.tokenize(text) + ([eod] if eod is not None else [])
        if len(tokens) >= needed:
            break
    if not tokens:
        raise ValueError(f"--data {path} holds no text (no non-empty {json_key!r} field); pass a JSONL corpus with "
                         f"text, or --json-key naming the field that holds it")
    windows = max(0, (len(tokens) - 1) // seq_length)
    if windows < count * batch_size:
        raise ValueError(f"--data {path} holds {len(tokens)} tokens: {windows} windows of {seq_length} + 1 tokens, "
                         f"fewer than the {count * batch_size} that --calib-batches + --eval-batches batches of "
                         f"--batch-size {batch_size} need; give more text, or lower --calib-batches, "
                         f"--eval-batches, --batch-size or --seq-length")
    flat = torch.tensor(tokens, dtype=torch.int64)
    rows = [flat[i * seq_length: i * seq_length + seq_length + 1] for i in range(count * batch_size)]
    return [{"tokens": torch.stack(rows[i:i + batch_size])} for i in range(0, len(rows), batch_size)]


def run(args: argparse.Namespace) -> dict:
    """Quantize ``args.ckpt`` and write ``args.output``; returns the figures printed."""
    from megatron_lite.generate import load_tokenizer
    from megatron_lite.module import GPTModule
    from megatron_lite.post_training.quantization import perplexity, quantize, resolve_config
    from megatron_lite.pretrained import hf_side_directory, save_weights_checkpoint

    _check_args(args)
    config = None if str(args.config).lower() == "none" else args.config
    resolve_config(config, args.kv_cache)  # an unknown name fails before anything is loaded
    path = Path(args.ckpt)
    tokenizer = load_tokenizer(path, args)
    module = GPTModule.from_pretrained(path)
    seq_length = args.seq_length or module.config.seq_length
    total = args.calib_batches + args.eval_batches
    batches = corpus_batches(args.data, args.json_key, tokenizer, seq_length, args.batch_size, total)
    calibration, evaluation = batches[:args.calib_batches], batches[args.calib_batches:]
    result: dict = {"config": config, "kv_cache": args.kv_cache, "output": str(args.output)}
    if evaluation:
        result["perplexity_before"] = perplexity(module, evaluation)
    quantize(module, config, calibration, kv_cache=args.kv_cache)
    if evaluation:
        result["perplexity_after"] = perplexity(module, evaluation)
        result["ratio"] = result["perplexity_after"] / result["perplexity_before"]
    save_weights_checkpoint(module, args.output, hf_source=hf_side_directory(path), tokenizer=tokenizer)
    return result


@exits_quietly_on_broken_pipe
def main(argv: Optional[Sequence[str]] = None) -> int:
    """``megatron-lite quantize ...``: prints the perplexity before and after; 2 on bad input (one line)."""
    args = build_parser().parse_args(list(sys.argv[1:] if argv is None else argv))
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", module="modelopt")  # its notes on transformers' version, skipped layers
            result = run(args)
    except (ValueError, TypeError, OSError, MissingDependencyError) as err:
        print(f"megatron-lite quantize: error: {' '.join(str(err).split())}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(result))
    else:
        name = result["config"] if result["kv_cache"] is None else f"{result['config']} + {result['kv_cache']}"
        figures = "" if "ratio" not in result else (
            f": perplexity {result['perplexity_before']:.3f} -> {result['perplexity_after']:.3f} "
            f"(x{result['ratio']:.4f})")
        print(f"quantized with {name}{figures}; wrote {result['output']}")
    return 0
