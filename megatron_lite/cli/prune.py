"""``megatron-lite prune``: Minitron-style pruning of a trained checkpoint into a smaller one.

    megatron-lite prune --ckpt runs/demo/checkpoints/last.ckpt --data shakespeare --num-layers 3 \
        --ffn-hidden-size 256 --output pruned.ckpt
    megatron-lite prune --ckpt CKPT --data corpus.jsonl --hidden-size 96 --num-query-groups 1 \
        --layer-metric loss --calib-batches 16 --output pruned.ckpt

``--ckpt`` is one of our checkpoints (or a Hugging Face Llama directory), loaded for one process: the
statistics are taken there, so the layout the checkpoint was trained with does not matter. ``--data`` is a
JSONL corpus (``.gz`` allowed), the name of a bundled corpus (``shakespeare``) or the prefix of a preprocessed
indexed dataset (``PREFIX.bin``/``PREFIX.idx``); text is tokenized with the checkpoint's tokenizer (or
``--tokenizer-*``) and cut into windows of the model's ``seq_length``. The first ``--calib-batches`` batches rank
layers, heads, neurons and channels; the next ``--eval-batches`` measure the loss before and after. The output is
an ordinary checkpoint (weights, the smaller config, the source's tokenizer): ``GPTModule.from_pretrained``,
``megatron-lite generate --ckpt`` and ``trainer.validate/test/predict(ckpt_path=...)`` read it; distil it from the
original with ``megatron_lite.callbacks.Distill``. ``--overwrite`` replaces an earlier output of megatron-lite,
nothing else. ``--ckpt`` and ``--output`` may be ``s3://`` URLs (docs/object-storage.md). Exit code 2 on bad input,
with one line that says what to change.
"""

from __future__ import annotations

import argparse
import sys
from typing import Optional, Sequence

from megatron_lite.cli.command import print_result, run_verb
from megatron_lite.cli.tokenizer_options import add_tokenizer_options, tokenizer_options
from megatron_lite.utils.local_path import local_or_object_path_argument

_SHAPE_FLAGS = ("num_layers", "hidden_size", "num_attention_heads", "num_query_groups", "ffn_hidden_size")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="megatron-lite prune", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument(
        "--ckpt",
        type=local_or_object_path_argument,
        required=True,
        help="one of our checkpoints, or a Hugging Face Llama directory",
    )
    p.add_argument(
        "--data",
        type=local_or_object_path_argument,
        required=True,
        help="calibration text: a .jsonl[.gz] file, a bundled corpus name, or an indexed dataset prefix (paths or "
        "s3:// URLs)",
    )
    p.add_argument("--output", type=local_or_object_path_argument, required=True, help="the pruned checkpoint to write")
    for name in _SHAPE_FLAGS:
        p.add_argument(f"--{name.replace('_', '-')}", type=int, default=None, help=f"pruned {name} (default: keep)")
    p.add_argument(
        "--layer-metric",
        choices=["cosine", "loss"],
        default="cosine",
        help="layer importance: 1 - cos(block in, block out) (default) or the LM-loss increase when skipped",
    )
    p.add_argument("--calib-batches", type=int, default=8, help="calibration batches (default 8)")
    p.add_argument("--eval-batches", type=int, default=2, help="further batches for the loss before/after (default 2)")
    p.add_argument("--batch-size", type=int, default=4, help="rows per batch (default 4)")
    p.add_argument("--seq-length", type=int, default=None, help="tokens per row (default: the model's seq_length)")
    p.add_argument("--json-key", default="text", help="JSONL field holding the text (default 'text')")
    p.add_argument("--overwrite", action="store_true", help="replace an earlier output of megatron-lite there")
    p.add_argument("--json", action="store_true", help="print the summary as one JSON object")
    add_tokenizer_options(p)
    return p


def _mean_loss(module, batches) -> float:
    import torch

    with torch.no_grad():
        losses = [module.model(b["tokens"][:, :-1], b["tokens"][:, 1:]) for b in batches]
    return float(torch.cat([loss.reshape(-1) for loss in losses]).mean())


def run(args: argparse.Namespace) -> dict:
    """Prune ``--ckpt`` and write ``--output``; returns the summary."""
    from megatron_lite.core.checkpoint.format.output_dir import check_output
    from megatron_lite.core.checkpoint.remote_source import local_files
    from megatron_lite.core.object_store import location
    from megatron_lite.data.calibration import calibration_batches
    from megatron_lite.module import GPTModule
    from megatron_lite.post_training.pruning import PruneTarget, apply_plan, estimate_importance, plan_pruning
    from megatron_lite.pretrained import hf_side_directory, save_weights_checkpoint
    from megatron_lite.tokenizers.model_tokenizer import model_tokenizer

    for name in ("calib_batches", "eval_batches", "batch_size", "seq_length"):
        value = getattr(args, name)
        if value is not None and value < (0 if name == "eval_batches" else 1):
            raise ValueError(f"--{name.replace('_', '-')} must be >= {0 if name == 'eval_batches' else 1}, got {value}")
    target = PruneTarget(**{name: getattr(args, name) for name in _SHAPE_FLAGS})
    source, output = location(args.ckpt), location(args.output)
    check_output(output, [source], args.overwrite)
    module = GPTModule.from_pretrained(source)
    target.pruned_config(module.config)  # an impossible target is named before any data is read
    files = local_files(source)  # its tokenizer and HF files (at a URL: a local copy; the weights stay there)
    tokenizer = model_tokenizer(files, **tokenizer_options(args))
    seq_length = args.seq_length or module.config.seq_length
    batches = calibration_batches(
        args.data,
        tokenizer,
        seq_length,
        args.batch_size,
        args.calib_batches + args.eval_batches,
        json_key=args.json_key,
        vocab_size=module.config.vocab_size,
    )
    calib, held_out = batches[: args.calib_batches], batches[args.calib_batches :]
    importance = estimate_importance(module, calib, args.layer_metric)
    plan = plan_pruning(module.config, importance, target)
    pruned = apply_plan(module, plan)
    metadata = {
        "megatron_lite_pruned_from": {
            "checkpoint": str(source),
            "layers": plan.layers,
            "layer_metric": args.layer_metric,
        }
    }
    # the tokenizer and an HF model's files travel with the weights (of hf/config.json an export keeps only the
    # token ids and model type, never the shapes)
    save_weights_checkpoint(pruned, output, hf_source=hf_side_directory(files), metadata=metadata, tokenizer=tokenizer)
    summary = {
        "output": str(output),
        "kept_layers": plan.layers,
        "parameters": [module.config.num_parameters(), pruned.config.num_parameters()],
        "shape": {name: [getattr(module.config, name), getattr(pruned.config, name)] for name in _SHAPE_FLAGS},
    }
    if held_out:
        summary["held_out_loss"] = [_mean_loss(module, held_out), _mean_loss(pruned, held_out)]
    return summary


def main(argv: Optional[Sequence[str]] = None) -> int:
    """``megatron-lite prune ...``: 0 on success, 2 on bad input (one line on stderr)."""
    args = build_parser().parse_args(list(sys.argv[1:] if argv is None else argv))
    return run_verb("megatron-lite prune", lambda: run(args), lambda summary: print_result(summary, args.json, _text))


def _text(summary: dict) -> str:
    shape = ", ".join(f"{name} {a}->{b}" for name, (a, b) in summary["shape"].items() if a != b)
    before, after = summary["parameters"]
    line = f"megatron-lite prune: wrote {summary['output']}: {shape}; parameters {before:,} -> {after:,}"
    if "held_out_loss" in summary:
        line += f"; held-out loss {summary['held_out_loss'][0]:.4f} -> {summary['held_out_loss'][1]:.4f}"
    return line
