"""``megatron-lite quantize --ckpt PATH --config NAME --data CORPUS --output DIR``: post-training quantization
of a trained checkpoint with nvidia-modelopt.

    megatron-lite quantize --ckpt runs/demo/checkpoints/last.ckpt --config INT8_SMOOTHQUANT_CFG \
        --data shakespeare --output runs/demo/int8
    megatron-lite quantize --ckpt CKPT --config FP8_DEFAULT_CFG --kv-cache FP8_KV_CFG --data corpus.jsonl.gz \
        --output out --json

``--ckpt`` is one of our checkpoints or a Hugging Face Llama directory (``GPTModule.from_pretrained``), and
``--output`` a new checkpoint; either may be an ``s3://`` URL (docs/object-storage.md).
``--data`` is a JSONL corpus (``.gz`` allowed) or a bundled corpus name, tokenized with the checkpoint's
tokenizer (as ``megatron-lite generate`` finds it; ``--tokenizer-*`` overrides), or the prefix of a preprocessed
indexed dataset: its documents, each followed by the end-of-document token, are cut into windows of
``seq_length + 1`` tokens (:mod:`megatron_lite.data.calibration`); the first
``--calib-batches`` batches calibrate, the next ``--eval-batches`` (disjoint) measure the perplexity before and
after. The quantized model is written to ``--output`` as one of our checkpoints, carrying the tokenizer (and
the HF files of a converted model): ``from_pretrained`` loads it quantized, ``megatron-lite generate --ckpt``
and ``convert --to hf`` read it, ``trainer.fit(..., ckpt_path=...)`` with ``Quantize(when="fit_start")``
fine-tunes it (QAT). ``--overwrite`` replaces an earlier output of megatron-lite, nothing else. Runs in this
process (one device). Exit code 2 on bad input, with one line that says what to change.
"""

from __future__ import annotations

import argparse
import sys
import warnings
from pathlib import Path
from typing import Optional, Sequence

from megatron_lite.cli.command import print_result, run_verb
from megatron_lite.cli.tokenizer_options import add_tokenizer_options, tokenizer_options
from megatron_lite.core.checkpoint.format.output_dir import check_output
from megatron_lite.core.object_store import is_remote
from megatron_lite.utils.local_path import local_or_object_path_argument


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="megatron-lite quantize", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument(
        "--ckpt",
        type=local_or_object_path_argument,
        required=True,
        help="one of our checkpoints, or a Hugging Face Llama directory",
    )
    p.add_argument(
        "--config",
        default="INT8_SMOOTHQUANT_CFG",
        help="ModelOpt config name (default INT8_SMOOTHQUANT_CFG); 'none' quantizes only the KV cache",
    )
    p.add_argument("--kv-cache", default=None, help="ModelOpt KV-cache preset, e.g. FP8_KV_CFG")
    p.add_argument(
        "--data",
        type=local_or_object_path_argument,
        required=True,
        help="JSONL corpus (.gz allowed), a bundled corpus name, or an indexed dataset prefix (paths or s3:// URLs)",
    )
    p.add_argument("--json-key", default="text", help="the corpus's text field (default text)")
    p.add_argument(
        "--output", type=local_or_object_path_argument, required=True, help="directory for the quantized checkpoint"
    )
    p.add_argument("--overwrite", action="store_true", help="replace an earlier output of megatron-lite there")
    p.add_argument("--calib-batches", type=int, default=8, help="calibration batches (default 8)")
    p.add_argument("--eval-batches", type=int, default=8, help="perplexity batches before/after (default 8; 0: none)")
    p.add_argument("--batch-size", type=int, default=4, help="sequences per batch (default 4)")
    p.add_argument("--seq-length", type=int, default=None, help="tokens per sequence (default: the model's)")
    add_tokenizer_options(p)
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
    if not is_remote(args.ckpt) and not Path(args.ckpt).exists():  # a URL is checked by reading it
        raise FileNotFoundError(f"--ckpt {args.ckpt} does not exist")
    check_output(args.output, [args.ckpt], args.overwrite)


def run(args: argparse.Namespace) -> dict:
    """Quantize ``args.ckpt`` and write ``args.output``; returns the figures printed."""
    from megatron_lite.core.checkpoint.remote_source import local_files
    from megatron_lite.data.calibration import calibration_batches
    from megatron_lite.module import GPTModule
    from megatron_lite.post_training.quantization import perplexity, quantize, resolve_config
    from megatron_lite.pretrained import hf_side_directory, save_weights_checkpoint
    from megatron_lite.tokenizers.model_tokenizer import model_tokenizer

    _check_args(args)
    config = None if str(args.config).lower() == "none" else args.config
    resolve_config(config, args.kv_cache)  # an unknown name fails before anything is loaded
    files = local_files(args.ckpt)  # its tokenizer and HF files (at a URL: a local copy; the weights stay there)
    tokenizer = model_tokenizer(files, **tokenizer_options(args))
    module = GPTModule.from_pretrained(args.ckpt)
    seq_length = args.seq_length or module.config.seq_length
    total = args.calib_batches + args.eval_batches
    batches = calibration_batches(
        args.data,
        tokenizer,
        seq_length,
        args.batch_size,
        total,
        json_key=args.json_key,
        vocab_size=module.config.vocab_size,
    )
    calibration, evaluation = batches[: args.calib_batches], batches[args.calib_batches :]
    result: dict = {"config": config, "kv_cache": args.kv_cache, "output": str(args.output)}
    if evaluation:
        result["perplexity_before"] = perplexity(module, evaluation)
    quantize(module, config, calibration, kv_cache=args.kv_cache)
    if evaluation:
        result["perplexity_after"] = perplexity(module, evaluation)
        result["ratio"] = result["perplexity_after"] / result["perplexity_before"]
    save_weights_checkpoint(module, args.output, hf_source=hf_side_directory(files), tokenizer=tokenizer)
    return result


def main(argv: Optional[Sequence[str]] = None) -> int:
    """``megatron-lite quantize ...``: prints the perplexity before and after; 2 on bad input (one line)."""
    args = build_parser().parse_args(list(sys.argv[1:] if argv is None else argv))

    def work() -> dict:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", module="modelopt")  # its notes on transformers' version, skipped layers
            return run(args)

    return run_verb("megatron-lite quantize", work, lambda result: print_result(result, args.json, _text))


def _text(result: dict) -> str:
    name = result["config"] if result["kv_cache"] is None else f"{result['config']} + {result['kv_cache']}"
    figures = (
        ""
        if "ratio" not in result
        else (
            f": perplexity {result['perplexity_before']:.3f} -> {result['perplexity_after']:.3f} "
            f"(x{result['ratio']:.4f})"
        )
    )
    return f"quantized with {name}{figures}; wrote {result['output']}"
