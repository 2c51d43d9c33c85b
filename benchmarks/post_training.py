#!/usr/bin/env python
"""Post-training quantization: held-out perplexity, decode speed and size of each quantized format against the
unquantized model.

A small GPT (4 layers, hidden 128, 4 heads in 2 query groups, MLP 384, SentencePiece vocabulary 1024, 128-token
context) is trained on the bundled Shakespeare corpus (``--steps``, one process) and saved as one of our
checkpoints (or ``--checkpoint`` names one). Then, per format, the checkpoint is loaded afresh
(``GPTModule.from_pretrained``), quantized with ``megatron_lite.post_training.quantization.quantize`` calibrated on
``--calib-batches`` training batches, and measured:

* **perplexity** on ``--eval-batches`` batches of the held-out split (``perplexity()``: through the module's
  engine), and its change against the unquantized model;
* **decode tokens/s**: ``module.generate`` (greedy, KV cache) of ``--new-tokens`` tokens after a 16-token prompt,
  median of ``--repeats`` runs after a warm-up. ModelOpt's quantization on CPU is *fake* quantization: every linear
  rounds its weight and input to the format and back in float32 at every call, so quantized decoding is slower
  than unquantized here. The speed of FP8/INT4 kernels is a GPU property this CPU cannot show;
* **HF export size**: the model written by ``save_quantized_hf`` (ModelOpt's unified format, unquantized tensors
  bf16) against the unquantized bf16 HF export (``save_hf``): what a serving engine loads;
* **FP8, real-quant** (``mtq.compress``): the FP8 model's linear weights stored as float8_e4m3fn (a quarter of
  fp32's bytes) -- the parameter memory ratio against fp32, and that it still decodes the same tokens.

Every process uses one torch thread. Nothing is asserted: the table reports.
Run from the repository root: ``python benchmarks/post_training.py [--steps 400] [--repeats 3]``.
"""

from __future__ import annotations

import os

os.environ["OMP_NUM_THREADS"] = "1"  # before torch is imported

import argparse  # noqa: E402
import json  # noqa: E402
import platform  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
import warnings  # noqa: E402
from itertools import islice  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Optional  # noqa: E402

import torch  # noqa: E402

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

import megatron_lite as ml  # noqa: E402
from megatron_lite.core.checkpoint.hf.directory import save_hf  # noqa: E402
from megatron_lite.data import TextCorpusDataModule  # noqa: E402

SHAPE = dict(num_layers=4, hidden_size=128, num_attention_heads=4, num_query_groups=2, ffn_hidden_size=384)
FORMATS = ("INT8_SMOOTHQUANT_CFG", "INT8_DEFAULT_CFG", "FP8_DEFAULT_CFG", "INT4_AWQ_CFG", "W4A8_AWQ_BETA_CFG")
EXPORTABLE = ("INT8_SMOOTHQUANT_CFG", "INT8_DEFAULT_CFG", "FP8_DEFAULT_CFG", "INT4_AWQ_CFG", "W4A8_AWQ_BETA_CFG")


def train(args, data: TextCorpusDataModule, out: Path) -> Path:
    """Train the small GPT on the corpus and save it as a weights checkpoint; returns its path."""
    import lightning as L

    from megatron_lite.pretrained import save_weights_checkpoint

    config = ml.GPTConfig(**SHAPE, vocab_size=args.vocab_size, seq_length=args.seq_length)
    optimizer = ml.OptimizerConfig(
        lr=3e-3,
        min_lr=3e-4,
        lr_warmup_iters=args.steps // 10,
        lr_decay_style="cosine",
        lr_decay_iters=args.steps,
        weight_decay=0.01,
    )
    module = ml.GPTModule(config, optimizer, seed=1234)
    trainer = L.Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=args.steps,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=0,
    )
    start = time.perf_counter()
    trainer.fit(module, data)
    print(f"trained {args.steps} steps in {time.perf_counter() - start:.0f} s")
    return save_weights_checkpoint(module, out)


def decode_rate(module, prompt: list[int], new_tokens: int, repeats: int) -> tuple[float, list[int]]:
    """(median new tokens/s of greedy cached generation, the tokens)."""
    tokens = module.generate([prompt], new_tokens).tokens[0]  # warm-up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        module.generate([prompt], new_tokens)
        times.append(time.perf_counter() - start)
    return new_tokens / statistics.median(times), tokens


def directory_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file() and p.suffix == ".safetensors")


def linear_weight_bytes(model) -> tuple[int, int]:
    """(bytes of the transformer layers' linear weights, bytes of all parameters)."""
    linear = sum(
        p.numel() * p.element_size()
        for n, p in model.named_parameters()
        if n.startswith("layers.") and n.endswith(".weight") and "layernorm" not in n
    )
    return linear, sum(p.numel() * p.element_size() for p in model.parameters())


def measure(
    name: Optional[str], checkpoint: Path, calib: list, evaluation: list, prompt: list[int], args, tmp: Path
) -> dict:
    """One row: load, quantize (``name`` None: not), perplexity, decode speed, export size."""
    from megatron_lite.post_training.export import save_quantized_hf
    from megatron_lite.post_training.quantization import perplexity, quantize

    module = ml.GPTModule.from_pretrained(str(checkpoint))
    row: dict = {"format": name or "unquantized"}
    if name is not None:
        start = time.perf_counter()
        quantize(module, name, calib)
        row["calibration_s"] = time.perf_counter() - start
    row["perplexity"] = perplexity(module, evaluation)
    row["decode_tokens_per_s"], row["tokens"] = decode_rate(module, prompt, args.new_tokens, args.repeats)
    export = tmp / (name or "unquantized")
    if name is None:
        save_hf(export, module.config, dict(module.model.state_dict()), dtype="bfloat16")
    elif name in EXPORTABLE:
        save_quantized_hf(export, module.model)
    row["hf_export_bytes"] = directory_bytes(export) if export.exists() else None
    if name == "FP8_DEFAULT_CFG":  # real quantization: the weights become float8 tensors
        import modelopt.torch.quantization as mtq

        before = linear_weight_bytes(module.model)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            mtq.compress(module.model)
        after = linear_weight_bytes(module.model)
        real = {
            "linear_weight_bytes_fp32": before[0],
            "linear_weight_bytes_fp8": after[0],
            "parameter_bytes_fp32": before[1],
            "parameter_bytes_real_quant": after[1],
            "perplexity": perplexity(module, evaluation),
        }
        real["decode_tokens_per_s"], real["tokens"] = decode_rate(module, prompt, args.new_tokens, args.repeats)
        row["real_quant"] = real
    return row


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=400, help="training steps (ignored with --checkpoint)")
    parser.add_argument("--checkpoint", default=None, help="a trained checkpoint of ours to quantize instead")
    parser.add_argument("--vocab-size", type=int, default=1024)
    parser.add_argument("--seq-length", type=int, default=128)
    parser.add_argument("--calib-batches", type=int, default=8)
    parser.add_argument("--eval-batches", type=int, default=16)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--formats", nargs="*", default=list(FORMATS))
    parser.add_argument("--out", default=str(REPO_ROOT / "benchmarks" / "results" / "post_training.json"))
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    try:
        import modelopt  # noqa: F401  (present, or say which extra installs it)
    except ImportError:  # pragma: no cover
        print('nvidia-modelopt is not installed: pip install "megatron-lite[modelopt]"')
        return 1
    load_before = os.getloadavg()
    cache = REPO_ROOT / "build" / "post_training_bench"
    data = TextCorpusDataModule(
        "shakespeare",
        seq_length=args.seq_length,
        micro_batch_size=8,
        global_batch_size=16,
        vocab_size=args.vocab_size,
        cache_dir=str(cache / "data"),
    )
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        checkpoint = Path(args.checkpoint) if args.checkpoint else train(args, data, tmp / "trained")
        data.prepare_data()
        data.setup("fit")
        calib = list(islice(iter(data.train_dataloader()), args.calib_batches))
        evaluation = list(islice(iter(data.val_dataloader()), args.eval_batches))
        prompt = evaluation[0]["tokens"][0, :16].tolist()
        rows = [measure(None, checkpoint, calib, evaluation, prompt, args, tmp)]
        for name in args.formats:
            print(f"measuring {name} ...", flush=True)
            rows.append(measure(name, checkpoint, calib, evaluation, prompt, args, tmp))
    base = rows[0]
    print(
        f"\n{'format':<22}{'perplexity':>11}{'change':>9}{'decode tok/s':>14}{'vs fp32':>9}{'HF export':>11}"
        f"{'vs bf16':>9}{'same tokens':>13}"
    )
    for row in rows:
        row["perplexity_change"] = row["perplexity"] / base["perplexity"] - 1
        row["decode_vs_unquantized"] = row["decode_tokens_per_s"] / base["decode_tokens_per_s"]
        row["same_greedy_tokens"] = sum(a == b for a, b in zip(row["tokens"], base["tokens"])) / len(base["tokens"])
        size = row["hf_export_bytes"]
        row["export_vs_bf16"] = size / base["hf_export_bytes"] if size else None
        size_text = f"{size / 2**20:.2f} MiB" if size else "-"
        ratio_text = f"{row['export_vs_bf16']:.2f}x" if size else "-"
        print(
            f"{row['format']:<22}{row['perplexity']:>11.3f}{row['perplexity_change']:>+9.2%}"
            f"{row['decode_tokens_per_s']:>14.1f}{row['decode_vs_unquantized']:>8.2f}x"
            f"{size_text:>11}{ratio_text:>9}{row['same_greedy_tokens']:>12.0%}"
        )
    fp8 = next((r for r in rows if r["format"] == "FP8_DEFAULT_CFG"), None)
    if fp8 is not None:
        real = fp8["real_quant"]
        real["same_tokens_as_fake_quant"] = real["tokens"] == fp8["tokens"]
        print(
            f"\nFP8 real-quant (mtq.compress): linear weights "
            f"{real['linear_weight_bytes_fp32'] / 2**20:.2f} MiB fp32 -> "
            f"{real['linear_weight_bytes_fp8'] / 2**20:.2f} MiB fp8 "
            f"({real['linear_weight_bytes_fp8'] / real['linear_weight_bytes_fp32']:.2f}x); all parameters "
            f"{real['parameter_bytes_real_quant'] / real['parameter_bytes_fp32']:.2f}x; perplexity "
            f"{real['perplexity']:.3f}; decode {real['decode_tokens_per_s']:.1f} tok/s; greedy tokens "
            f"{'equal to' if real['same_tokens_as_fake_quant'] else 'differ from'} the fake-quantized model's"
        )
    print(
        "\nFake quantization on CPU rounds every weight and activation at every call: it measures accuracy, not the "
        "speed of quantized kernels (a GPU property)."
    )
    result = {
        "config": {**vars(args), "shape": SHAPE},
        "checkpoint_trained_here": args.checkpoint is None,
        "machine": {
            "torch": torch.__version__,
            "python": platform.python_version(),
            "cpus": os.cpu_count(),
            "load_before": load_before,
            "load_after": os.getloadavg(),
        },
        "rows": rows,
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
