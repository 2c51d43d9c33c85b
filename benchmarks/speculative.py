#!/usr/bin/env python
"""Speculative decoding against plain greedy decoding: tokens/s side by side, acceptance, ratios, and what one
base-model forward costs for 1..k+1 tokens (the break-even of verifying k drafts in one pass).

A GPT of the example's shape (``examples/speculative_decoding.py``: 4 layers, hidden 128, 4 heads in 2 query
groups, SentencePiece vocabulary 1024, 128-token context; ``--layers``/``--hidden`` change it) is trained on the
bundled Shakespeare corpus (``--base-steps``), then an EAGLE draft head on it, frozen (``--draft-steps``, the
``TrainDraftHead`` callback). Both are cached under ``build/speculative_bench/`` (keyed by shape and steps), so
only the first run trains. Then, on held-out prompts (``--prompts`` of 32 tokens, ``--new-tokens`` each, batch
size 1 for both, as speculative decoding runs):

* **forward cost**: the median wall time of one base forward over n = 1..max(k)+1 new tokens after a 40-token
  cache (what a verify pass costs against a decode step) and of one draft-head step;
* **side by side**: ``--repeats`` rounds, each timing plain ``generate`` then speculative decoding at every
  ``--k`` in turn (A B A B ...: the machine's load hits both), reporting median tokens/s, acceptance length
  (generated tokens per base forward), the per-round ratio's median, and whether the tokens equal greedy's;
* **break-even**: the acceptance length at which a round (a verify forward over k+1 tokens and k draft steps,
  from the forward costs) costs what its tokens cost as plain decode steps, and the one for 1.3x.

Every process uses one torch thread. Nothing is asserted: the table reports.
Run from the repository root: ``python benchmarks/speculative.py [--quick]``.
"""

from __future__ import annotations

import os

os.environ["OMP_NUM_THREADS"] = "1"  # before torch is imported

import argparse  # noqa: E402
import json  # noqa: E402
import platform  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Optional  # noqa: E402

import torch  # noqa: E402

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

import megatron_lite as ml  # noqa: E402
from megatron_lite.core.inference import generate  # noqa: E402
from megatron_lite.core.inference.generate import generation_mode  # noqa: E402
from megatron_lite.core.inference.speculative import _Speculator, speculative_generate  # noqa: E402
from megatron_lite.data import TextCorpusDataModule  # noqa: E402


def _trainer(steps: int, callbacks=()):
    import lightning as L

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


def trained_pair(args, data: TextCorpusDataModule, config: ml.GPTConfig):
    """(base GPTModule, its draft head, seconds spent training here: 0 when both came from the cache)."""
    from megatron_lite.callbacks import TrainDraftHead
    from megatron_lite.post_training import load_draft_head
    from megatron_lite.pretrained import save_weights_checkpoint

    key = f"l{args.layers}_h{args.hidden}_v{args.vocab_size}_b{args.base_steps}_d{args.draft_steps}"
    cache = REPO_ROOT / "build" / "speculative_bench" / key
    base_path, head_path = cache / "base", cache / "draft_head.safetensors"
    spent = 0.0
    if not (base_path.exists() and head_path.exists()):
        optimizer = ml.OptimizerConfig(
            lr=2e-3, lr_warmup_iters=max(1, args.base_steps // 10), lr_decay_style="cosine", min_lr=2e-4
        )
        start = time.perf_counter()
        base = ml.GPTModule(config, optimizer, seed=1234)
        _trainer(args.base_steps).fit(base, data)
        print(f"base model: {args.base_steps} steps in {time.perf_counter() - start:.0f} s", flush=True)
        module = ml.GPTModule(config, optimizer, seed=1234)
        module.configure_model()
        module.model.load_state_dict(base.model.state_dict())  # the same base, frozen by the callback
        middle = time.perf_counter()
        _trainer(args.draft_steps, [TrainDraftHead(save_path=head_path)]).fit(module, data)
        print(f"draft head: {args.draft_steps} steps in {time.perf_counter() - middle:.0f} s", flush=True)
        save_weights_checkpoint(base, base_path)
        spent = time.perf_counter() - start
    module = ml.GPTModule.from_pretrained(str(base_path))
    module.model.eval()
    return module, load_draft_head(head_path, module.model), spent


@torch.no_grad()
def forward_costs(model, draft, prompt: list[int], max_tokens: int, repeats: int) -> dict:
    """Median ms of one base forward over n new tokens (n = 1..max_tokens) after the prompt's cache, each with
    its greedy tokens read back on the host as a verify pass does, and of one draft step (one token); the
    measurements alternate (n = 1, 2, ..., draft, 1, 2, ...) so that the machine's load hits them alike."""
    speculator = _Speculator(model, draft, len(prompt) + max_tokens + 1)
    ids = torch.tensor(prompt)
    try:
        features, _ = speculator._base(ids, 0)
        runs = {n: (lambda n=n: speculator._base(ids[:n], len(prompt))[1].tolist()) for n in range(1, max_tokens + 1)}
        runs["draft"] = lambda: speculator._propose(features[-1:], ids[-1:], len(prompt) - 1, 1).tolist()
        times: dict = {name: [] for name in runs}
        for repeat in range(repeats + 1):
            for name, run in runs.items():
                start = time.perf_counter()
                run()
                if repeat:  # the first round warms up
                    times[name].append((time.perf_counter() - start) * 1e3)
    finally:
        speculator.cache.free()
        speculator.draft_cache.free()
    draft_ms = statistics.median(times.pop("draft"))
    return {"base_forward_ms": {n: statistics.median(t) for n, t in times.items()}, "draft_step_ms": draft_ms}


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="fewer training steps, prompts and repeats (~2 min)")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--vocab-size", type=int, default=1024)
    parser.add_argument("--base-steps", type=int, default=None, help="default 600 (--quick: 300)")
    parser.add_argument("--draft-steps", type=int, default=None, help="default 400 (--quick: 200)")
    parser.add_argument("--prompts", type=int, default=None, help="held-out prompts (default 8, --quick: 4)")
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--k", type=int, nargs="*", default=[1, 2, 3, 4], help="draft lengths to measure")
    parser.add_argument("--repeats", type=int, default=None, help="side-by-side rounds (default 5, --quick: 3)")
    parser.add_argument("--out", default=str(REPO_ROOT / "benchmarks" / "results" / "speculative.json"))
    args = parser.parse_args(argv)
    for name, full, quick in (
        ("base_steps", 600, 300),
        ("draft_steps", 400, 200),
        ("prompts", 8, 4),
        ("repeats", 5, 3),
    ):
        if getattr(args, name) is None:
            setattr(args, name, quick if args.quick else full)
    torch.set_num_threads(1)
    load_before = os.getloadavg()
    data = TextCorpusDataModule(
        "shakespeare",
        seq_length=128,
        micro_batch_size=8,
        global_batch_size=8,
        vocab_size=args.vocab_size,
        cache_dir=str(REPO_ROOT / "build" / "speculative_bench" / "data"),
    )
    config = ml.GPTConfig(
        num_layers=args.layers,
        hidden_size=args.hidden,
        num_attention_heads=4,
        num_query_groups=2,
        vocab_size=args.vocab_size,
        seq_length=128,
    )
    module, draft, trained_s = trained_pair(args, data, config)
    model = module.model
    data.prepare_data()
    data.setup("validate")  # held-out text: the validation split, never trained on
    prompts = [data.val_dataset[1 + i * 37]["tokens"][:32].tolist() for i in range(args.prompts)]

    with generation_mode(model):
        costs = forward_costs(model, draft, prompts[0], max(args.k) + 1, 50 if args.quick else 200)
    base_ms = costs["base_forward_ms"]
    print(f"\none base forward over n new tokens (after a {len(prompts[0])}-token cache), median ms:")
    print("   n " + "".join(f"{n:>8d}" for n in base_ms))
    print("  ms " + "".join(f"{base_ms[n]:>8.3f}" for n in base_ms))
    print("  /1 " + "".join(f"{base_ms[n] / base_ms[1]:>7.2f}x" for n in base_ms))
    print(
        f"one draft-head step: {costs['draft_step_ms']:.3f} ms "
        f"({costs['draft_step_ms'] / base_ms[1]:.2f}x a 1-token base forward)"
    )

    def plain() -> list[list[int]]:
        return [generate(model, [p], args.new_tokens).tokens[0] for p in prompts]

    def speculative(k: int):
        return speculative_generate(model, draft, prompts, args.new_tokens, num_draft_tokens=k, check_base=False)

    greedy = plain()  # warm-up, and the reference tokens
    speculative_generate(model, draft, prompts[:1], 8, num_draft_tokens=1)  # warm-up; checks the base once
    total = sum(map(len, greedy))
    times: dict[str, list[float]] = {"plain": [], **{f"k{k}": [] for k in args.k}}
    rows: dict[int, dict] = {}
    for _ in range(args.repeats):
        for name in times:
            start = time.perf_counter()
            if name == "plain":
                plain()
            else:
                k = int(name[1:])
                result = speculative(k)
                rows[k] = {
                    "equal_to_greedy": result.tokens == greedy,
                    "acceptance_length": result.acceptance_length,
                    "base_forwards": sum(result.base_forwards),
                    "draft_steps": sum(result.draft_steps),
                }
            times[name].append(time.perf_counter() - start)
    plain_s = statistics.median(times["plain"])
    print(
        f"\nplain greedy: {total} tokens, {total / plain_s:.0f} tokens/s (median of {args.repeats}); "
        f"load average {os.getloadavg()[0]:.2f}"
    )
    plain_token_ms = plain_s / total * 1e3
    print(
        f"{'k':>3}{'equal':>7}{'acceptance':>12}{'tokens/s':>10}{'vs plain':>10}{'per-round':>11}"
        f"{'break-even':>12}{'a for 1.3x':>12}"
    )
    for k, row in rows.items():
        # A round costs about one verify forward over k+1 tokens and k draft steps; it pays once its accepted
        # tokens would have cost more as plain decode steps.
        round_ms = base_ms[k + 1] + k * costs["draft_step_ms"]
        row["break_even_acceptance"] = round_ms / plain_token_ms

        seconds = statistics.median(times[f"k{k}"])
        row["tokens_per_s"] = total / seconds
        row["speedup"] = plain_s / seconds
        row["speedup_per_round_median"] = statistics.median(p / s for p, s in zip(times["plain"], times[f"k{k}"]))
        row["seconds"] = times[f"k{k}"]
        print(
            f"{k:>3}{str(row['equal_to_greedy']):>7}{row['acceptance_length']:>12.2f}{row['tokens_per_s']:>10.0f}"
            f"{row['speedup']:>9.2f}x{row['speedup_per_round_median']:>10.2f}x"
            f"{row['break_even_acceptance']:>12.2f}{1.3 * row['break_even_acceptance']:>12.2f}"
        )
    result = {
        "config": {**vars(args), "model": {"layers": args.layers, "hidden": args.hidden, "vocab": args.vocab_size}},
        "trained_here_s": trained_s,
        "machine": {
            "torch": torch.__version__,
            "python": platform.python_version(),
            "cpus": os.cpu_count(),
            "load_before": load_before,
            "load_after": os.getloadavg(),
        },
        "forward_costs": costs,
        "plain": {
            "tokens": total,
            "tokens_per_s": total / plain_s,
            "ms_per_token": plain_token_ms,
            "seconds": times["plain"],
        },
        "speculative": rows,
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
