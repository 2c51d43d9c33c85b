"""Speculative decoding on the bundled corpus: train a GPT, train an EAGLE draft head on it (frozen), and
compare speculative greedy decoding with plain greedy decoding on held-out text.

Prints, for several draft lengths k: whether the tokens equal plain greedy decoding (they must), the
acceptance length (generated tokens per base-model forward pass) and the wall-clock speedup over
``GPTModule.generate`` (one process, batch size 1 per prompt for both, so the comparison is like for like).

    python examples/speculative_decoding.py [--base-steps 300] [--draft-steps 200] [--layers 4] [--hidden 128]
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import lightning as L
import torch

import megatron_lite as ml
from megatron_lite.callbacks import TrainDraftHead
from megatron_lite.data import TextCorpusDataModule
from megatron_lite.post_training import speculative_generate


def _trainer(steps: int, callbacks=()) -> L.Trainer:
    return L.Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=steps,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=0,
        callbacks=list(callbacks),
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base-steps", type=int, default=300)
    parser.add_argument("--draft-steps", type=int, default=200)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--out", default="runs/speculative")
    args = parser.parse_args()
    torch.set_num_threads(1)
    out = Path(args.out)

    data = TextCorpusDataModule(
        "shakespeare",
        seq_length=128,
        micro_batch_size=8,
        global_batch_size=8,
        vocab_size=1024,
        cache_dir=str(out / "cache"),
    )
    config = ml.GPTConfig(
        num_layers=args.layers,
        hidden_size=args.hidden,
        num_attention_heads=4,
        num_query_groups=2,
        vocab_size=data.vocab_size,
        seq_length=128,
    )
    optimizer = ml.OptimizerConfig(
        lr=2e-3, lr_warmup_iters=min(50, args.draft_steps // 4), lr_decay_style="cosine", min_lr=2e-4
    )

    start = time.perf_counter()
    base = ml.GPTModule(config, optimizer)
    _trainer(args.base_steps).fit(base, data)
    print(f"base model: {args.base_steps} steps in {time.perf_counter() - start:.0f} s")

    start = time.perf_counter()
    module = ml.GPTModule(config, optimizer)
    module.configure_model()
    module.model.load_state_dict(base.model.state_dict())  # the same base, frozen by the callback
    _trainer(args.draft_steps, [TrainDraftHead(save_path=out / "draft_head.safetensors")]).fit(module, data)
    print(
        f"draft head: {args.draft_steps} steps in {time.perf_counter() - start:.0f} s "
        f"(written to {out / 'draft_head.safetensors'})"
    )

    # held-out text: the validation split, never trained on
    data.setup("validate")
    prompts = [data.val_dataset[1 + i * 37]["tokens"][:32].tolist() for i in range(args.prompts)]
    module.model.eval()

    def plain() -> list[list[int]]:
        return [module.generate([p], args.new_tokens).tokens[0] for p in prompts]

    def timed(fn, repeats: int = 3):
        """(result, best wall time of ``repeats`` runs): the machine may be shared, the minimum is the least
        disturbed run."""
        best, result = float("inf"), None
        for _ in range(repeats):
            start = time.perf_counter()
            result = fn()
            best = min(best, time.perf_counter() - start)
        return result, best

    greedy, plain_s = timed(plain)
    print(f"plain greedy: {sum(map(len, greedy))} tokens in {plain_s:.2f} s (best of 3)")
    print("   k  equal  acceptance length  speedup")
    for k in (1, 2, 3, 4, 6):
        result, seconds = timed(lambda k=k: speculative_generate(module, prompts, args.new_tokens, num_draft_tokens=k))
        _, plain_again = timed(plain)  # interleaved: both measured under the same load
        plain_s = min(plain_s, plain_again)
        print(f"{k:4d}  {str(result.tokens == greedy):5s}  {result.acceptance_length:17.2f}  {plain_s / seconds:6.2f}x")
    print("sample:", data.tokenizer.detokenize(prompts[0]) + " |>> " + data.tokenizer.detokenize(greedy[0]))


if __name__ == "__main__":
    main()
