"""``megatron-lite convert``: Hugging Face Llama models to our checkpoints and back.

    megatron-lite convert --from hf --input HF_DIR --output CKPT [--seq-length 4096]
    megatron-lite convert --to hf --input CKPT --output HF_DIR [--dtype bfloat16] [--tokenizer DIR]
    megatron-lite convert --to hf --input QUANTIZED_CKPT --output HF_DIR     (ModelOpt unified, for TRT-LLM/vLLM)
    megatron-lite convert --to hf --merge-lora --input LORA_CKPT --output HF_DIR   (adapters folded in)
    megatron-lite convert --to hf-peft --input LORA_CKPT --output ADAPTER_DIR [--base-model NAME]

``--from hf`` reads a local HF directory (config.json + safetensors, sharded or not; Llama 2/3, SmolLM, Mistral
without sliding window, Qwen2, Qwen3, and the MoEs Mixtral, Qwen2-MoE, Qwen3-MoE) and writes one of our checkpoints
holding its weights and config, plus the HF tokenizer/generation files in ``CKPT/hf/``. Fine-tune from it with
``GPTModule.from_pretrained(CKPT)`` and ``trainer.fit(module, data)``; ``trainer.validate/test/predict(...,
ckpt_path=CKPT)`` load it directly.

``--to hf`` reads any of our checkpoints, whatever layout (TP/PP/DP, ZeRO-1/FSDP2) wrote it, and writes an HF
directory that ``transformers`` loads (``AutoModelForCausalLM.from_pretrained(HF_DIR)``), with the tokenizer from
``--tokenizer DIR`` or the one the checkpoint carries. A checkpoint of a ModelOpt-quantized model (its quantizer
amax and scales saved with the weights) is written in ModelOpt's unified quantized format instead -- quantized
weights with their scales and ``hf_quant_config.json``, for TensorRT-LLM and vLLM -- by
:mod:`megatron_lite.post_training.export` (default dtype of its unquantized tensors: bfloat16). The tokenizer a
checkpoint carries (``tokenizer/``: a SentencePiece ``tokenizer.model``, GPT-2's ``vocab.json``/``merges.txt`` or
an HF ``tokenizer.json``) is written where transformers' ``AutoTokenizer`` reads it.

A LoRA fine-tune's checkpoint (``GPTModule.from_pretrained`` gives the adapted model) is exported either merged
(``--to hf --merge-lora``: ``W + (alpha / dim) B A``, a plain HF model) or as a Hugging Face PEFT adapter (``--to
hf-peft``: ``adapter_config.json`` + ``adapter_model.safetensors`` for ``PeftModel.from_pretrained(base, DIR)``
on the base exported with ``--to hf``; :mod:`megatron_lite.core.checkpoint.hf.peft` maps the fused adapters);
``--to hf`` without ``--merge-lora`` refuses it rather than drop the adapters.

``--input`` and ``--output`` may be ``s3://`` URLs (docs/object-storage.md): our checkpoints are read and written
there natively (the object store's commit), an HF directory is read from a cached local copy, and an export is
written locally and uploaded, its ``config.json`` (a PEFT adapter's ``adapter_config.json``) last, so an export cut
short is never taken for a model.

The output is never an input, inside one or a directory holding one; ``--overwrite`` replaces only an earlier
output of megatron-lite with nothing else in it (:mod:`megatron_lite.core.checkpoint.format.output_dir`). Nothing is
downloaded from the Hub. Exit code 2 on bad input, with one line that says what to change.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import tempfile
from pathlib import Path
from typing import Optional, Sequence

from megatron_lite.cli.command import run_verb
from megatron_lite.core.checkpoint.format.output_dir import check_output, mark_output, output_directory
from megatron_lite.core.checkpoint.format.sharded import resolve_checkpoint
from megatron_lite.core.checkpoint.full.reader import read_checkpoint_hparams, read_model_tensors
from megatron_lite.core.checkpoint.full.state import gather_full_state
from megatron_lite.core.checkpoint.hf.directory import (
    CHECKPOINT_SIDE_DIR,
    CONFIG,
    DEFAULT_MAX_SHARD_BYTES,
    DTYPES,
    atomic_directory,
    copy_side_files,
    read_hf_config,
    save_hf,
)
from megatron_lite.core.checkpoint.hf.peft import ADAPTER_CONFIG, save_peft_adapter
from megatron_lite.core.checkpoint.remote_source import local_directory, local_files
from megatron_lite.core.object_staging import local_input
from megatron_lite.core.object_store import is_remote, join, location
from megatron_lite.core.parallel.layout import ParallelLayout
from megatron_lite.core.peft import LORA_RECIPE, has_adapters, is_adapter_parameter, lora_recipe, merge_lora
from megatron_lite.post_training.export import has_quantizer_state
from megatron_lite.tokenizers.build import TOKENIZER_FOLDER
from megatron_lite.utils.local_path import local_or_object_path_argument

_UNITS = {"": 1, "B": 1, "KB": 1000, "MB": 1000**2, "GB": 1000**3, "KIB": 1024, "MIB": 1024**2, "GIB": 1024**3}


def parse_size(text: str) -> int:
    """``"5GB"``, ``"500MiB"`` or a number of bytes -> bytes."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([A-Za-z]*)\s*", text)
    if match is None or match.group(2).upper() not in _UNITS:
        raise ValueError(f"--max-shard-size {text!r}: give a size such as 5GB, 500MB or 2GiB")
    size = int(float(match.group(1)) * _UNITS[match.group(2).upper()])
    if size <= 0:
        raise ValueError(f"--max-shard-size must be positive, got {text!r}")
    return size


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="megatron-lite convert",
        description="Convert Hugging Face Llama-architecture models to megatron-lite checkpoints and back.",
    )
    direction = parser.add_mutually_exclusive_group(required=True)
    direction.add_argument("--from", dest="source", choices=["hf"], help="read an HF model directory")
    direction.add_argument(
        "--to",
        dest="target",
        choices=["hf", "hf-peft"],
        help="write an HF model directory (hf) or a LoRA checkpoint's adapters as a PEFT adapter directory (hf-peft)",
    )
    parser.add_argument(
        "--input",
        type=local_or_object_path_argument,
        required=True,
        help="HF directory (--from hf) or our checkpoint (--to hf); a path or an s3:// URL",
    )
    parser.add_argument(
        "--output",
        type=local_or_object_path_argument,
        required=True,
        help="our checkpoint (--from hf) or an HF directory (--to hf); a path or an s3:// URL",
    )
    parser.add_argument("--overwrite", action="store_true", help="replace an earlier output of megatron-lite there")
    parser.add_argument(
        "--seq-length",
        type=int,
        default=None,
        help="--from hf: the model's training sequence length (default: max_position_embeddings)",
    )
    parser.add_argument(
        "--dtype",
        choices=sorted(DTYPES),
        default=None,
        help="--to hf: dtype of the written weights (default float32, lossless; a quantized model's "
        "unquantized tensors: bfloat16, as serving engines run them)",
    )
    parser.add_argument(
        "--tokenizer",
        type=local_or_object_path_argument,
        default=None,
        help="--to hf: copy the tokenizer files of this directory (default: the checkpoint's hf/)",
    )
    parser.add_argument(
        "--max-shard-size",
        default=None,
        help=f"--to hf: largest safetensors file; more files get an index (default "
        f"{DEFAULT_MAX_SHARD_BYTES // 1024**3}GiB)",
    )
    parser.add_argument(
        "--merge-lora",
        action="store_true",
        help="--to hf of a LoRA checkpoint: fold the adapters into the weights (W + alpha/dim * B A)",
    )
    parser.add_argument(
        "--base-model",
        default=None,
        help="--to hf-peft: the base_model_name_or_path adapter_config.json records (default: the name the "
        "imported model's config.json carries, if any)",
    )
    return parser


def from_hf(hf_dir: str, output: str, seq_length: Optional[int] = None, overwrite: bool = False) -> str:
    """HF directory -> our checkpoint; returns a one-line summary."""
    from megatron_lite.module import GPTModule  # imports Lightning: only for this direction
    from megatron_lite.pretrained import save_weights_checkpoint

    if seq_length is not None and seq_length < 1:
        raise ValueError(f"--seq-length must be >= 1, got {seq_length}")
    check_output(output, [hf_dir], overwrite)
    local = local_directory(hf_dir, CONFIG, "a Hugging Face model directory")  # a URL's: a cached local copy
    limit = read_hf_config(local).get("max_position_embeddings")
    if seq_length is not None and isinstance(limit, int) and seq_length > limit:
        raise ValueError(
            f"--seq-length {seq_length} is longer than the model's context, max_position_embeddings "
            f"{limit} in {join(location(hf_dir), CONFIG)} (positions past it were never trained); pass "
            f"--seq-length {limit} or less, or leave it out"
        )
    out = location(output)
    overrides = {"seq_length": seq_length} if seq_length is not None else {}
    module = GPTModule.from_pretrained(local, **overrides)
    save_weights_checkpoint(module, out, hf_source=local)
    c = module.config
    return (
        f"wrote {out}: {c.num_layers} layers, hidden {c.hidden_size}, vocab {c.vocab_size}, "
        f"{'tied' if c.share_embeddings_and_output_weights else 'untied'} embeddings"
    )


def gather_side_files(checkpoint: str | Path, into: Path) -> Optional[Path]:
    """Collect in ``into`` the files an export writes beside the weights: an imported model's tokenizer and
    generation config (the checkpoint's ``hf/``), then the tokenizer the checkpoint carries (``tokenizer/``,
    which wins), and a ``tokenizer_config.json`` naming transformers' class for a SentencePiece or GPT-2
    tokenizer that brought none (it adds no BOS/EOS, as ours). ``into``, or None when there are none."""
    checkpoint = Path(checkpoint)
    copied = [
        name
        for folder in (checkpoint / CHECKPOINT_SIDE_DIR, checkpoint / TOKENIZER_FOLDER)
        if folder.is_dir()
        for name in copy_side_files(folder, into)
    ]
    if not copied:
        return None
    if not (into / "tokenizer_config.json").is_file() and not (into / "tokenizer.json").is_file():
        kind = (
            "LlamaTokenizer"
            if (into / "tokenizer.model").is_file()
            else "GPT2Tokenizer"
            if (into / "vocab.json").is_file() and (into / "merges.txt").is_file()
            else None
        )
        if kind is not None:
            (into / "tokenizer_config.json").write_text(
                json.dumps({"tokenizer_class": kind, "add_bos_token": False, "add_eos_token": False}, indent=2) + "\n"
            )
    return into


def to_hf(
    checkpoint: str,
    output: str,
    dtype: Optional[str] = None,
    tokenizer: Optional[str] = None,
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
    overwrite: bool = False,
    merge_lora: bool = False,
) -> str:
    """Our checkpoint -> HF directory (ModelOpt's unified quantized format for a quantized model), with the
    tokenizer of ``tokenizer`` (a directory) or the one the checkpoint carries; returns a one-line summary. A LoRA
    checkpoint is refused unless ``merge_lora``, which folds its adapters into the weights."""
    config = read_checkpoint_hparams(checkpoint)["config"]
    source = resolve_checkpoint(checkpoint)
    if tokenizer is not None and is_remote(tokenizer):
        check_output(output, [checkpoint, source, tokenizer], overwrite)  # before downloading the tokenizer
        tokenizer = local_input(tokenizer)  # a local copy of the directory's objects (cached by their ETags)
    if tokenizer is not None and not Path(tokenizer).is_dir():
        raise FileNotFoundError(
            f"--tokenizer {tokenizer} is not a directory; pass the folder holding tokenizer.json (or tokenizer.model)"
        )
    check_output(output, [checkpoint, source, tokenizer], overwrite)  # before reading any weights
    files = local_files(source)  # the checkpoint's HF and tokenizer files (at a URL: a local copy of its small files)
    side = files / CHECKPOINT_SIDE_DIR
    source_config = read_hf_config(side) if (side / CONFIG).is_file() else None
    state = read_model_tensors(source)
    if is_lora_state(state) and not merge_lora:
        raise ValueError(
            f"{checkpoint} holds LoRA adapters: pass --merge-lora to fold them into the exported weights, or "
            f"export them as a PEFT adapter with --to hf-peft (and the base with --to hf of the base checkpoint)"
        )
    if merge_lora:
        if not is_lora_state(state):
            raise ValueError(f"--merge-lora: {checkpoint} holds no LoRA adapters; leave --merge-lora out")
        if has_quantizer_state(state):
            raise ValueError(
                f"--merge-lora: {checkpoint} is quantized; merging adapters into quantized weights is not supported"
            )
        state = _merged_state(source)
    with (
        output_directory(output, overwrite, last=(CONFIG,)) as target,
        tempfile.TemporaryDirectory(prefix="megatron-lite-side-") as gathered,
    ):
        side_files = tokenizer if tokenizer is not None else gather_side_files(files, Path(gathered))
        if has_quantizer_state(state):
            summary = _to_quantized_hf(source, target, dtype or "bfloat16", source_config, side_files, max_shard_bytes)
        else:
            save_hf(
                target,
                config,
                state,
                dtype=dtype or "float32",
                source_config=source_config,
                side_files_from=side_files,
                max_shard_bytes=max_shard_bytes,
                overwrite=True,
            )
            written = sorted(p.name for p in target.iterdir())
            summary = (
                f"wrote {output}: {config.num_layers} layers, vocab {config.vocab_size}, {dtype or 'float32'}, "
                f"files {written}"
            )
        mark_output(target, "megatron-lite convert --to hf")
    return summary


def is_lora_state(state: dict) -> bool:
    """Whether a checkpoint's model tensors hold LoRA adapters (their recipe or their weights)."""
    return any(name == LORA_RECIPE or is_adapter_parameter(name) for name in state)


def _merged_state(checkpoint: str | Path) -> dict:
    """The full state of a LoRA checkpoint's model with its adapters folded into the weights (one process)."""
    from megatron_lite.module import GPTModule  # imports Lightning: only for this path

    model = GPTModule.from_pretrained(checkpoint).model
    merge_lora(model)
    state = gather_full_state(model, ParallelLayout.single())
    assert state is not None  # one process holds the whole model
    return state


def to_hf_peft(
    checkpoint: str,
    output: str,
    dtype: Optional[str] = None,
    base_model: Optional[str] = None,
    overwrite: bool = False,
) -> str:
    """A LoRA checkpoint's adapters -> a Hugging Face PEFT adapter directory; returns a one-line summary."""
    from megatron_lite.module import GPTModule  # imports Lightning: only for this direction

    source = resolve_checkpoint(checkpoint)
    check_output(output, [checkpoint, source], overwrite)  # before reading any weights
    module = GPTModule.from_pretrained(source)
    if not has_adapters(module.model):
        raise ValueError(
            f"{checkpoint} holds no LoRA adapters; export the model with --to hf (a LoRA run's checkpoints "
            f"hold adapters)"
        )
    if base_model is None:
        side = local_files(source) / CHECKPOINT_SIDE_DIR
        named = read_hf_config(side).get("_name_or_path") if (side / CONFIG).is_file() else None
        base_model = named if isinstance(named, str) and named else None
    # at a URL, adapter_config.json is uploaded last: an upload cut short is no adapter directory
    with output_directory(output, overwrite, last=(ADAPTER_CONFIG,)) as target:
        with atomic_directory(target, overwrite=True) as tmp:
            modules = save_peft_adapter(
                tmp, module.model, module.config, dtype=DTYPES[dtype or "float32"], base_model_name_or_path=base_model
            )
        mark_output(target, "megatron-lite convert --to hf-peft")
    recipe = lora_recipe(module.model)
    assert recipe is not None  # has_adapters
    return (
        f"wrote {output}: {len(modules)} PEFT LoRA adapters (r={recipe[0].dim}, lora_alpha={recipe[0].alpha:g}), "
        f"{dtype or 'float32'}"
    )


def _to_quantized_hf(
    checkpoint: str | Path,
    output: Path,
    dtype: str,
    source_config: Optional[dict],
    side_files: Optional[str | Path],
    max_shard_bytes: int,
) -> str:
    """A quantized checkpoint -> ModelOpt's unified HF format, through a one-process model restored with its
    quantizers (whatever layout wrote the checkpoint)."""
    from megatron_lite.module import GPTModule  # imports Lightning and modelopt: only for this path
    from megatron_lite.post_training.export import read_quant_config, save_quantized_hf

    module = GPTModule.from_pretrained(checkpoint)
    save_quantized_hf(
        output,
        module.model,
        dtype=dtype,
        source_config=source_config,
        side_files_from=side_files,
        max_shard_bytes=max_shard_bytes,
        overwrite=True,
    )
    algo = (read_quant_config(output) or {}).get("quantization", {})
    files = sorted(p.name for p in output.iterdir())
    return (
        f"wrote {output}: {module.config.num_layers} layers, quantized {algo.get('quant_algo')} "
        f"(KV cache {algo.get('kv_cache_quant_algo')}), other tensors {dtype}, files {files}"
    )


def main(argv: Optional[Sequence[str]] = None) -> int:
    """``megatron-lite convert ...``: 0 on success, 2 on bad input (one line on stderr)."""
    args = build_parser().parse_args(list(sys.argv[1:] if argv is None else argv))
    return run_verb(
        "megatron-lite convert", lambda: _convert(args), lambda summary: print(f"megatron-lite convert: {summary}")
    )


def _convert(args: argparse.Namespace) -> str:
    """The conversion ``args`` ask for; its one-line summary."""
    if args.source == "hf":
        for flag, value in (
            ("--dtype", args.dtype is not None),
            ("--tokenizer", args.tokenizer),
            ("--max-shard-size", args.max_shard_size),
            ("--merge-lora", args.merge_lora),
            ("--base-model", args.base_model),
        ):
            if value:
                raise ValueError(f"{flag} applies to --to hf; our checkpoints hold fp32 weights")
        return from_hf(args.input, args.output, seq_length=args.seq_length, overwrite=args.overwrite)
    if args.seq_length is not None:
        raise ValueError("--seq-length applies to --from hf (an export keeps the checkpoint's config)")
    if args.target == "hf-peft":
        for flag, value in (
            ("--merge-lora", args.merge_lora),
            ("--tokenizer", args.tokenizer),
            ("--max-shard-size", args.max_shard_size),
        ):
            if value:
                raise ValueError(f"{flag} applies to --to hf; --to hf-peft writes the adapters alone")
        return to_hf_peft(
            args.input, args.output, dtype=args.dtype, base_model=args.base_model, overwrite=args.overwrite
        )
    if args.base_model is not None:
        raise ValueError("--base-model applies to --to hf-peft")
    shard = parse_size(args.max_shard_size) if args.max_shard_size else DEFAULT_MAX_SHARD_BYTES
    return to_hf(
        args.input,
        args.output,
        dtype=args.dtype,
        tokenizer=args.tokenizer,
        max_shard_bytes=shard,
        overwrite=args.overwrite,
        merge_lora=args.merge_lora,
    )
