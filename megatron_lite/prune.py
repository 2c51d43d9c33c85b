"""``megatron-lite prune``: Minitron-style pruning of a trained checkpoint into a smaller one.

    megatron-lite prune --ckpt runs/demo/checkpoints/last.ckpt --data shakespeare --num-layers 3 \
        --ffn-hidden-size 256 --output pruned.ckpt
    megatron-lite prune --ckpt CKPT --data corpus.jsonl --hidden-size 96 --num-query-groups 1 \
        --layer-metric loss --calib-batches 16 --output pruned.ckpt

``--ckpt`` is one of our checkpoints (or a local Hugging Face Llama directory), loaded for one process: the
statistics are taken there, so the layout the checkpoint was trained with does not matter. ``--data`` is a
JSONL corpus (``.gz`` allowed), the name of a bundled corpus (``shakespeare``) or the prefix of a preprocessed
indexed dataset (``PREFIX.bin``/``PREFIX.idx``); text is tokenized with the checkpoint's tokenizer (or
``--tokenizer-*``) and cut into windows of the model's ``seq_length``. The first ``--calib-batches`` batches rank
layers, heads, neurons and channels; the next ``--eval-batches`` measure the loss before and after. The output is
an ordinary checkpoint (weights, the smaller config, the source's tokenizer): ``GPTModule.from_pretrained``,
``megatron-lite generate --ckpt`` and ``trainer.validate/test/predict(ckpt_path=...)`` read it; distil it from the
original with ``megatron_lite.callbacks.Distill``. ``--overwrite`` replaces an earlier output of megatron-lite,
nothing else. Exit code 2 on bad input, with one line that says what to change.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Optional, Sequence

from megatron_lite.utils.console import exits_quietly_on_broken_pipe

_SHAPE_FLAGS = ("num_layers", "hidden_size", "num_attention_heads", "num_query_groups", "ffn_hidden_size")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="megatron-lite prune", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ckpt", required=True, help="one of our checkpoints, or a Hugging Face Llama directory")
    p.add_argument("--data", required=True,
                   help="calibration text: a .jsonl[.gz] file, a bundled corpus name, or an indexed dataset prefix")
    p.add_argument("--output", required=True, help="the pruned checkpoint to write")
    for name in _SHAPE_FLAGS:
        p.add_argument(f"--{name.replace('_', '-')}", type=int, default=None, help=f"pruned {name} (default: keep)")
    p.add_argument("--layer-metric", choices=["cosine", "loss"], default="cosine",
                   help="layer importance: 1 - cos(block in, block out) (default) or the LM-loss increase when skipped")
    p.add_argument("--calib-batches", type=int, default=8, help="calibration batches (default 8)")
    p.add_argument("--eval-batches", type=int, default=2, help="further batches for the loss before/after (default 2)")
    p.add_argument("--batch-size", type=int, default=4, help="rows per batch (default 4)")
    p.add_argument("--seq-length", type=int, default=None, help="tokens per row (default: the model's seq_length)")
    p.add_argument("--json-key", default="text", help="JSONL field holding the text (default 'text')")
    p.add_argument("--overwrite", action="store_true", help="replace an earlier output of megatron-lite there")
    p.add_argument("--json", action="store_true", help="print the summary as one JSON object")
    p.add_argument("--tokenizer-type", default=None, help="override the checkpoint's tokenizer (build_tokenizer type)")
    p.add_argument("--tokenizer-model", default=None)
    p.add_argument("--vocab-file", default=None)
    p.add_argument("--merge-file", default=None)
    return p


def _token_stream(args: argparse.Namespace, tokenizer, needed: int) -> list[int]:
    """At least ``needed`` tokens of ``--data`` (documents in order, each followed by the end-of-document token)
    when it has them; fewer otherwise."""
    from megatron_lite.data.indexed_dataset import IndexedDataset

    tokens: list[int] = []
    if IndexedDataset.exists(args.data):
        dataset = IndexedDataset(args.data)
        for i in range(len(dataset)):
            tokens.extend(int(t) for t in dataset[i])
            if len(tokens) >= needed:
                break
        return tokens
    from megatron_lite.data.bundled import resolve_corpus
    from megatron_lite.utils.jsonl import iter_jsonl_texts

    try:
        path = resolve_corpus(args.data)
    except FileNotFoundError as err:
        raise FileNotFoundError(f"--data {args.data}: not an indexed dataset prefix (PREFIX.bin/.idx) either; "
                                f"{err}") from None
    for text in iter_jsonl_texts(path, args.json_key, what="--data", option="--json-key"):
        tokens.extend(tokenizer.tokenize(text))
        if tokenizer.eod is not None:
            tokens.append(tokenizer.eod)
        if len(tokens) >= needed:
            break
    return tokens


def _batches(tokens: list[int], count: int, rows: int, seq_length: int, vocab_size: int):
    import torch

    window = seq_length + 1
    flat = torch.tensor(tokens[: count * rows * seq_length + 1], dtype=torch.long)
    if int(flat.max()) >= vocab_size:
        raise ValueError(f"--data holds token id {int(flat.max())}, outside the model's vocabulary ({vocab_size}); "
                         f"tokenize it with the model's tokenizer")
    return [{"tokens": torch.stack([flat[(b * rows + r) * seq_length:][:window] for r in range(rows)])}
            for b in range(count)]


def _mean_loss(module, batches) -> float:
    import torch

    with torch.no_grad():
        losses = [module.model(b["tokens"][:, :-1], b["tokens"][:, 1:]) for b in batches]
    return float(torch.cat([loss.reshape(-1) for loss in losses]).mean())


def run(args: argparse.Namespace) -> dict:
    """Prune ``--ckpt`` and write ``--output``; returns the summary."""
    from megatron_lite.core.checkpoint.format.output_dir import check_output
    from megatron_lite.generate import load_tokenizer
    from megatron_lite.module import GPTModule
    from megatron_lite.post_training.pruning import PruneTarget, apply_plan, estimate_importance, plan_pruning
    from megatron_lite.pretrained import hf_side_directory, save_weights_checkpoint

    for name in ("calib_batches", "eval_batches", "batch_size", "seq_length"):
        value = getattr(args, name)
        if value is not None and value < (0 if name == "eval_batches" else 1):
            raise ValueError(f"--{name.replace('_', '-')} must be >= {0 if name == 'eval_batches' else 1}, got {value}")
    target = PruneTarget(**{name: getattr(args, name) for name in _SHAPE_FLAGS})
    source, output = Path(args.ckpt), Path(args.output)
    check_output(output, [source], args.overwrite)
    module = GPTModule.from_pretrained(source)
    target.pruned_config(module.config)  # an impossible target is named before any data is read
    tokenizer = load_tokenizer(source, args)
    seq_length = args.seq_length or module.config.seq_length
    needed = (args.calib_batches + args.eval_batches) * args.batch_size * seq_length + 1
    tokens = _token_stream(args, tokenizer, needed)
    if len(tokens) < needed:
        raise ValueError(f"--data has {len(tokens)} tokens, fewer than the {needed} that {args.calib_batches} + "
                         f"{args.eval_batches} batches of {args.batch_size} x {seq_length} need; lower --calib-batches, "
                         f"--batch-size or --seq-length, or give more text")
    batches = _batches(tokens, args.calib_batches + args.eval_batches, args.batch_size, seq_length,
                       module.config.vocab_size)
    calib, held_out = batches[: args.calib_batches], batches[args.calib_batches:]
    importance = estimate_importance(module, calib, args.layer_metric)
    plan = plan_pruning(module.config, importance, target)
    pruned = apply_plan(module, plan)
    metadata = {"megatron_lite_pruned_from": {"checkpoint": str(source), "layers": plan.layers,
                                              "layer_metric": args.layer_metric}}
    # the tokenizer and an HF model's files travel with the weights (of hf/config.json an export keeps only the
    # token ids and model type, never the shapes)
    save_weights_checkpoint(pruned, output, hf_source=hf_side_directory(source), metadata=metadata,
                            tokenizer=tokenizer)
    summary = {"output": str(output), "kept_layers": plan.layers,
               "parameters": [module.config.num_parameters(), pruned.config.num_parameters()],
               "shape": {name: [getattr(module.config, name), getattr(pruned.config, name)] for name in _SHAPE_FLAGS}}
    if held_out:
        summary["held_out_loss"] = [_mean_loss(module, held_out), _mean_loss(pruned, held_out)]
    return summary


@exits_quietly_on_broken_pipe
def main(argv: Optional[Sequence[str]] = None) -> int:
    """``megatron-lite prune ...``: 0 on success, 2 on bad input (one line on stderr)."""
    args = build_parser().parse_args(list(sys.argv[1:] if argv is None else argv))
    try:
        summary = run(args)
    except (ValueError, TypeError, OSError) as err:
        print(f"megatron-lite prune: error: {' '.join(str(err).split())}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(summary))
        return 0
    shape = ", ".join(f"{name} {a}->{b}" for name, (a, b) in summary["shape"].items() if a != b)
    before, after = summary["parameters"]
    line = f"megatron-lite prune: wrote {summary['output']}: {shape}; parameters {before:,} -> {after:,}"
    if "held_out_loss" in summary:
        line += f"; held-out loss {summary['held_out_loss'][0]:.4f} -> {summary['held_out_loss'][1]:.4f}"
    print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
