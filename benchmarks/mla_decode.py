"""MLA decode: the key/value up-projection absorbed into the query and the output against the cached latents expanded
to keys and values at every step (docs/deepseek.md, Generation).

A random multi-latent-attention model (``MLA_SHAPE``: DeepSeek-V3's head widths halved, 16 heads) prefilled with 16,
256, 1024 and 4096 tokens, then decode steps of batch 1 at that context (one slot rewritten, so the context stays put)
with every layer's attention plain and absorbed (``megatron_lite.core.models.mla_absorbed``), in rotation: decode
tokens/s and CPU ms per step, absorbed/plain; the same for one prefill of 256 and 1024 tokens (which the default rule
keeps plain); and whether greedy ``generate`` gives the same tokens either way. One torch thread; medians of
``--repeats``, with the load average. Nothing is asserted.

Run from the repository root: ``python benchmarks/mla_decode.py [--quick] [--repeats 5]`` (``--quick``: contexts 16
and 1024, 3 repeats). Writes ``benchmarks/results/generate_mla_decode.json``.
"""

from __future__ import annotations

import os

os.environ["OMP_NUM_THREADS"] = "1"  # before torch is imported

import argparse  # noqa: E402
import json  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Callable, Optional  # noqa: E402

import torch  # noqa: E402

REPO_ROOT = Path(__file__).resolve().parents[1]
for path in (REPO_ROOT, Path(__file__).resolve().parent):
    if str(path) not in sys.path:
        sys.path.insert(0, str(path))

from generate import median_rate, rotate  # noqa: E402  (benchmarks/generate.py: the rotation and the rates)

import megatron_lite as ml  # noqa: E402
from megatron_lite.core.inference import generate  # noqa: E402
from megatron_lite.core.inference.kv_cache import InferenceStep, KVCache  # noqa: E402
from megatron_lite.core.models import GPTModel  # noqa: E402
from megatron_lite.core.models.mla import set_absorption  # noqa: E402

MLA_SHAPE = dict(
    num_layers=2, hidden_size=512, num_attention_heads=16, ffn_hidden_size=1024, vocab_size=2048,
    multi_latent_attention=True, num_query_groups=None, q_lora_rank=384, kv_lora_rank=256, qk_head_dim=64,
    qk_pos_emb_head_dim=32, v_head_dim=64,
)  # fmt: skip
"""The model: DeepSeek-V3's latent and head widths halved (512/128/64/128 there), 16 heads."""


def _mla_steps(model, context: int, steps: int, absorb: bool) -> Callable[[], object]:
    """``steps`` decode steps of one row after ``context`` cached tokens, every step writing slot ``context`` (the
    prefill is done here, once, untimed)."""
    cache = KVCache.for_model(model, 1, context + 1)
    tokens = torch.tensor([[(7 * i + 3) % MLA_SHAPE["vocab_size"] for i in range(context + 1)]])
    positions = torch.arange(context + 1).unsqueeze(0)
    set_absorption(model, False)
    model.inference_forward(tokens[:, :context], InferenceStep(0, positions[:, :context], None, cache))
    step = InferenceStep(context, positions[:, context:], None, cache)

    def run() -> None:
        set_absorption(model, absorb)
        for _ in range(steps):
            model.inference_forward(tokens[:, context:], step)

    return run


def _mla_prefill(model, length: int, absorb: bool) -> Callable[[], object]:
    """One prefill of ``length`` tokens into a cache, every layer absorbed or plain."""
    tokens = torch.tensor([[(11 * i + 1) % MLA_SHAPE["vocab_size"] for i in range(length)]])
    positions = torch.arange(length).unsqueeze(0)
    cache = KVCache.for_model(model, 1, length)

    def run() -> None:
        set_absorption(model, absorb)
        model.inference_forward(tokens, InferenceStep(0, positions, None, cache))

    return run


def run(args: argparse.Namespace) -> int:
    """Decode tokens/s of the absorbed and the plain MLA form at several contexts."""
    contexts, repeats, steps = ((16, 1024), 3, 8) if args.quick else ((16, 256, 1024, 4096), args.repeats, 16)
    prefills = (256, 1024)
    load_before = os.getloadavg()
    model = GPTModel(ml.GPTConfig(**MLA_SHAPE, seq_length=max(contexts) + 1), seed=1234).eval()
    with torch.no_grad():
        rows: dict[str, Callable[[], object]] = {}
        for context in contexts:
            for form in ("plain", "absorbed"):
                rows[f"decode {context} {form}"] = _mla_steps(model, context, steps, form == "absorbed")
        for length in prefills:
            for form in ("plain", "absorbed"):
                rows[f"prefill {length} {form}"] = _mla_prefill(model, length, form == "absorbed")
        times, cpu = rotate(rows, repeats)
        prompt = [(5 * i + 2) % MLA_SHAPE["vocab_size"] for i in range(64)]
        set_absorption(model, True)
        absorbed = generate(model, [prompt], 32, return_log_probs=True)
        set_absorption(model, False)
        plain = generate(model, [prompt], 32, return_log_probs=True)
        set_absorption(model, None)
    load_after = os.getloadavg()
    same = absorbed.tokens == plain.tokens
    assert absorbed.log_probs is not None and plain.log_probs is not None
    log_prob_gap = max(abs(a - b) for a, b in zip(absorbed.log_probs[0], plain.log_probs[0]))
    print(
        f"MLA decode: {MLA_SHAPE}, batch 1, {steps} decode steps per timing, one thread; median of {repeats}; load "
        f"average {load_before[0]:.1f} before, {load_after[0]:.1f} after (2 cores: above 2 means contention)"
    )
    print(
        f"{'cached tokens':<15}{'plain tok/s':>13}{'absorbed tok/s':>16}{'absorbed/plain':>16}"
        f"{'plain CPU ms':>14}{'absorbed CPU ms':>17}"
    )
    section: dict = {"decode_tokens_per_s": {}, "decode_cpu_ms_per_step": {}, "prefill_tokens_per_s": {}, "ratios": {}}
    for context in contexts:
        rate = {f: median_rate(times[f"decode {context} {f}"], steps) for f in ("plain", "absorbed")}
        ms = {f: 1e3 * statistics.median(cpu[f"decode {context} {f}"]) / steps for f in ("plain", "absorbed")}
        print(
            f"{context:<15}{rate['plain']:>13.1f}{rate['absorbed']:>16.1f}{rate['absorbed'] / rate['plain']:>16.2f}"
            f"{ms['plain']:>14.2f}{ms['absorbed']:>17.2f}"
        )
        section["decode_tokens_per_s"][context] = rate
        section["decode_cpu_ms_per_step"][context] = ms
        section["ratios"][f"absorbed_vs_plain_decode_{context}"] = rate["absorbed"] / rate["plain"]
    print(f"\n{'prefill tokens':<15}{'plain tok/s':>13}{'absorbed tok/s':>16}{'absorbed/plain':>16}")
    for length in prefills:
        rate = {f: median_rate(times[f"prefill {length} {f}"], length) for f in ("plain", "absorbed")}
        print(f"{length:<15}{rate['plain']:>13.0f}{rate['absorbed']:>16.0f}{rate['absorbed'] / rate['plain']:>16.2f}")
        section["prefill_tokens_per_s"][length] = rate
        section["ratios"][f"absorbed_vs_plain_prefill_{length}"] = rate["absorbed"] / rate["plain"]
    print(f"\ngreedy generate, 64-token prompt, 32 new: same tokens {same}; largest log-prob gap {log_prob_gap:.1e}")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    machine = {"torch": torch.__version__, "cpus": os.cpu_count(), "load_before": load_before, "load_after": load_after}
    section.update(times_s=times, cpu_s=cpu, same_tokens=same, log_prob_gap=log_prob_gap)
    config = {**vars(args), "contexts": contexts, "steps": steps, "repeats": repeats, "shape": MLA_SHAPE}
    out.write_text(json.dumps({"config": config, "machine": machine, "mla_decode": section}, indent=2, default=str))
    print(f"wrote {out}")
    return 0


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--quick", action="store_true", help="contexts 16 and 1024, 3 repeats")
    parser.add_argument("--out", default=str(REPO_ROOT / "benchmarks" / "results" / "generate_mla_decode.json"))
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
