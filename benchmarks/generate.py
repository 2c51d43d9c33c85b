#!/usr/bin/env python
"""Generation speed: the KV cache against recomputation, against ``transformers``' ``generate`` on the same
weights, prefill throughput, and TP2 against TP1.

The model is a random Llama of the demo's shape (4 layers, hidden 128, 4 heads in 2 query groups, MLP 352,
vocabulary 2048) with a 512-position context. With ``transformers`` installed it is a
``LlamaForCausalLM`` saved with ``save_pretrained`` and imported with ``GPTModule.from_pretrained``, so both
libraries run the same weights; without it, a ``GPTModel`` of the same shape. Rows:

* **cached**: ``GPTModule.generate`` (greedy; KV cache), one prompt of ``--prompt-length`` tokens,
  ``--new-tokens`` new ones; decode tokens/s = new tokens / wall time (the prefill included).
* **cached, sampled**: the same at temperature 0.8, top-p 0.9, top-k 50 (a seeded generator per prompt).
* **recompute**: ``generate(..., use_cache=False)``: every step runs the whole sequence again (only the last
  position's logits).
* **full-logits loop**: what generation was before the cache: ``argmax(model.full_logits(seq)[:, -1])`` per
  token, logits of every position every step.
* **transformers**: ``LlamaForCausalLM.generate(do_sample=False, min_new_tokens=max_new_tokens=N)`` on the same
  weights and prompt (its own KV cache), under ``torch.no_grad``.
* **prefill**: ``--prefill-batch`` prompts of ``--prefill-length`` tokens, one new token: prompt tokens/s
  (ours and transformers').
* **TP1 / TP2 / PP2**: ``--tp-new-tokens`` (200) cached greedy tokens on 1 and 2 forked ranks (gloo) of the
  same imported weights, and the full-logits loop at each (the "before" of the issue), plus the latency of
  one gloo all-reduce of a decode step's activation [1, 1, 128] measured in the same ranks (a greedy TP2
  decode step waits on 2 per layer and one all-gather that chooses the token).

* **TP decode** (``--tp-decode-only``, alone; ``--quick`` for 64 tokens and 3 repeats): TP1, TP2 and TP2 with every
  sum of a decode step a gloo all-reduce (the code before the one-round sums), greedy with log-probs at batch 1
  and 16, in rotation on two forked ranks (TP1 on rank 0 alone), and the latency of one tiny all-reduce,
  all-gather and broadcast: the floor a TP2 decode step's ``2 x layers + 1`` collectives put under it.

Every process and rank uses one torch thread (``OMP_NUM_THREADS=1``, ``torch.set_num_threads(1)``). Rows are
run ``--repeats`` times in rotation so slow drifts of a shared machine hit them all; medians are reported,
with the load average, and for the decode rows also the process CPU time per token (which other jobs on
the cores move much less than wall time). Nothing is asserted; targets are printed as met or missed: cached >= 5x
recompute at 256 new tokens, cached >= 1.0x transformers.

Run from the repository root: ``python benchmarks/generate.py [--repeats 5] [--skip-tp] [--skip-hf]`` or
``python benchmarks/generate.py --tp-decode-only [--quick]``. MLA's absorbed decode: ``benchmarks/mla_decode.py``.
"""

from __future__ import annotations

import os

os.environ["OMP_NUM_THREADS"] = "1"  # before torch is imported

import argparse  # noqa: E402
import json  # noqa: E402
import platform  # noqa: E402
import socket  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Callable, Optional  # noqa: E402

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

import megatron_lite as ml  # noqa: E402
from megatron_lite import ParallelConfig, ParallelLayout  # noqa: E402
from megatron_lite.core.checkpoint.full.state import carry_over_state  # noqa: E402
from megatron_lite.core.estimator import kv_cache_bytes, kv_cache_values_per_token_and_layer  # noqa: E402
from megatron_lite.core.inference import SamplingParams, generate  # noqa: E402
from megatron_lite.core.models import GPTModel  # noqa: E402

SHAPE = dict(
    num_layers=4, hidden_size=128, num_attention_heads=4, num_query_groups=2, ffn_hidden_size=352, vocab_size=2048
)
SAMPLED = SamplingParams(temperature=0.8, top_p=0.9, top_k=50, seed=1)


def build_weights(
    directory: Path,
    context: int,
    use_hf: bool,
    shape: Optional[dict] = None,
    device: str = "cpu",
    dtype: torch.dtype = torch.float32,
):
    """(our GPTModule, the transformers model or None) holding the same random weights, of ``shape`` (default
    ``SHAPE``), on ``device`` in ``dtype`` (the transformers model is drawn there and saved in that dtype)."""
    shape = SHAPE if shape is None else shape
    if not use_hf:
        config = ml.GPTConfig(**shape, seq_length=context)
        module = ml.GPTModule(config, seed=1234)
        module.configure_model()
        module.model.to(device, dtype).eval()
        return module, None
    import transformers

    torch.manual_seed(1234)
    hf_config = transformers.LlamaConfig(
        vocab_size=shape["vocab_size"],
        hidden_size=shape["hidden_size"],
        intermediate_size=shape["ffn_hidden_size"],
        num_hidden_layers=shape["num_layers"],
        num_attention_heads=shape["num_attention_heads"],
        num_key_value_heads=shape["num_query_groups"],
        max_position_embeddings=context,
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
    )
    with torch.device(device):  # drawn where it runs: a 1B model's init on one CPU thread takes a while
        hf = transformers.LlamaForCausalLM(hf_config).to(dtype).eval()
    hf.save_pretrained(directory)
    module = ml.GPTModule.from_pretrained(directory)
    module.model.to(device, dtype)
    return module, hf


def hf_greedy(hf, input_ids: torch.Tensor, new: int) -> torch.Tensor:
    """``transformers``' greedy ``generate`` of exactly ``new`` tokens per row (no EOS stop), without gradients."""
    with torch.no_grad():
        return hf.generate(
            input_ids,
            attention_mask=torch.ones_like(input_ids),
            max_new_tokens=new,
            min_new_tokens=new,
            do_sample=False,
            pad_token_id=0,
            eos_token_id=None,
        )


def full_logits_loop(model, prompt: list[int], n: int) -> list[int]:
    """Greedy generation as it was before the KV cache: full logits of the whole sequence per token."""
    seq = torch.tensor([prompt])
    with torch.no_grad():
        for _ in range(n):
            seq = torch.cat([seq, model.full_logits(seq)[:, -1].argmax(-1, keepdim=True)], dim=1)
    return seq[0, len(prompt) :].tolist()


def timed(fn: Callable[[], object], cpu: Optional[list] = None) -> float:
    """Wall seconds of ``fn()``; its process CPU seconds (all threads) are appended to ``cpu``."""
    start, start_cpu = time.perf_counter(), time.process_time()
    fn()
    if cpu is not None:
        cpu.append(time.process_time() - start_cpu)
    return time.perf_counter() - start


def rotate(rows: dict[str, Callable[[], object]], repeats: int) -> tuple[dict[str, list[float]], dict[str, list]]:
    """(wall, CPU) seconds of every row, ``repeats`` rounds, the rows in rotation (after one warm-up call each).
    CPU time counts only this process's work, so it moves less than wall time when other jobs share the cores."""
    for fn in rows.values():
        fn()
    times: dict[str, list[float]] = {name: [] for name in rows}
    cpu: dict[str, list[float]] = {name: [] for name in rows}
    for _ in range(repeats):
        for name, fn in rows.items():
            times[name].append(timed(fn, cpu[name]))
    return times, cpu


# --- TP1 / TP2 on forked ranks --------------------------------------------------------------------------
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _layout_worker(
    rank: int, world: int, port: int, out: str, parallel: dict, source, prompt, n: int, repeats: int
) -> None:
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    layout = ParallelLayout.build(ParallelConfig(**parallel))
    model = GPTModel(source.config, layout, seed=source.seed)
    carry_over_state(source.model, model, vocab_size=source.config.vocab_size)
    model.eval()
    rows = {"cached": lambda: generate(model, [prompt], n)}
    if layout.pp_size == 1:  # model.full_logits runs one stage only
        rows["full-logits loop"] = lambda: full_logits_loop(model, prompt, n)
    times = {name: [] for name in rows}
    for fn in rows.values():
        fn()
    for _ in range(repeats):
        for name, fn in rows.items():
            dist.barrier()
            times[name].append(timed(fn))
    # The latency of one all-reduce of a decode step's activation, in these ranks.
    x = torch.randn(1, 1, SHAPE["hidden_size"])
    latencies = []
    for _ in range(200):
        start = time.perf_counter()
        dist.all_reduce(x)
        latencies.append(time.perf_counter() - start)
    tokens = generate(model, [prompt], n).tokens[0]  # every rank generates: they all take part
    if rank == 0:
        torch.save({"times": times, "all_reduce_s": statistics.median(latencies[20:]), "tokens": tokens}, out)
    layout.destroy()
    dist.destroy_process_group()


def run_layout(world: int, parallel: dict, source, prompt: list[int], n: int, repeats: int) -> dict:
    """Rank 0's timings of ``world`` forked ranks at the layout ``parallel`` (ParallelConfig fields)."""
    with tempfile.TemporaryDirectory() as tmp:
        out = str(Path(tmp) / "result.pt")
        mp.start_processes(
            _layout_worker,
            args=(world, _free_port(), out, parallel, source, prompt, n, repeats),
            nprocs=world,
            start_method="fork",
        )
        return torch.load(out, weights_only=False)


# --- TP decode: TP2 against TP1, one-round sums against the ring all-reduce ----------------------------------
def _median_latency(fn: Callable[[], object], calls: int = 300) -> float:
    """Median wall seconds of ``fn()`` over ``calls`` calls (the first 30 dropped: warm-up)."""
    seconds = []
    for _ in range(calls):
        start = time.perf_counter()
        fn()
        seconds.append(time.perf_counter() - start)
    return statistics.median(seconds[30:])


def _tp_decode_worker(
    rank: int, world: int, port: int, out: str, source, prompt, n: int, repeats: int, batches: tuple[int, ...]
) -> None:
    """Rows in rotation on two forked ranks: TP1 (rank 0 alone, on the one-process model, while rank 1 waits in the
    next barrier), TP2, and TP2 "ring" (every sum of a decode step a gloo all-reduce, as before the one-round sums:
    ``ONE_ROUND_SUM_BYTES = 0``); then the latency of one tiny collective of each kind (the floor)."""
    from megatron_lite.core.parallel import mappings

    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    layout = ParallelLayout.build(ParallelConfig(tensor_model_parallel_size=2))
    model = GPTModel(source.config, layout, seed=source.seed)
    carry_over_state(source.model, model, vocab_size=source.config.vocab_size)
    model.eval()
    one_round = mappings.ONE_ROUND_SUM_BYTES

    def tp2(prompts: list, ring: bool):
        mappings.ONE_ROUND_SUM_BYTES = 0 if ring else one_round
        try:
            return generate(model, prompts, n, return_log_probs=True)
        finally:
            mappings.ONE_ROUND_SUM_BYTES = one_round

    rows: dict[tuple[str, int], Callable[[], object]] = {}
    for b in batches:
        prompts = [prompt] * b
        rows[("TP1", b)] = lambda p=prompts: generate(source.model, p, n, return_log_probs=True) if rank == 0 else None
        rows[("TP2", b)] = lambda p=prompts: tp2(p, ring=False)
        rows[("TP2 ring", b)] = lambda p=prompts: tp2(p, ring=True)
    outputs = {key: fn() for key, fn in rows.items()}  # warm-up, and the tokens compared
    times: dict[tuple[str, int], list[float]] = {key: [] for key in rows}
    cpu: dict[tuple[str, int], list[float]] = {key: [] for key in rows}
    for _ in range(repeats):
        for key, fn in rows.items():
            dist.barrier()
            times[key].append(timed(fn, cpu[key]))
    x = torch.randn(1, 1, SHAPE["hidden_size"])
    gathered = torch.empty(2, 1, SHAPE["hidden_size"])
    floor = {
        "all_reduce": _median_latency(lambda: dist.all_reduce(x)),
        "all_gather": _median_latency(lambda: mappings.all_gather_into_tensor(gathered, x)),
        "broadcast": _median_latency(lambda: dist.broadcast(x, 0)),
    }
    if rank == 0:
        same = {
            b: outputs[("TP2", b)] == outputs[("TP2 ring", b)]
            and outputs[("TP2", b)].tokens == outputs[("TP1", b)].tokens  # type: ignore[union-attr]
            for b in batches
        }
        torch.save({"times": times, "cpu": cpu, "floor_s": floor, "same_tokens": same}, out)
    layout.destroy()
    dist.destroy_process_group()


def run_tp_decode(source, prompt: list[int], n: int, repeats: int, batches: tuple[int, ...]) -> dict:
    """Rank 0's TP decode timings (see :func:`_tp_decode_worker`)."""
    with tempfile.TemporaryDirectory() as tmp:
        out = str(Path(tmp) / "result.pt")
        mp.start_processes(
            _tp_decode_worker,
            args=(2, _free_port(), out, source, prompt, n, repeats, batches),
            nprocs=2,
            start_method="fork",
        )
        return torch.load(out, weights_only=False)


def report_tp_decode(result: dict, n: int, repeats: int) -> dict:
    """Print the TP decode table and the floor; returns the JSON section."""
    times, floor = result["times"], result["floor_s"]
    batches = sorted({b for _, b in times})
    rate = {key: b * n / statistics.median(t) for key, t in times.items() for b in [key[1]]}
    print(
        f"\nTP decode, {n} new tokens per row, greedy with log-probs (2 forked gloo ranks, median of {repeats}; "
        "tokens/s of all rows)"
    )
    print(
        f"{'batch':<7}{'TP1':>9}{'TP2':>9}{'TP2 ring':>10}{'TP2/TP1':>9}{'ring/TP1':>10}{'TP2/ring':>10}  same tokens"
    )
    ratios = {}
    for b in batches:
        tp1, tp2, ring = rate[("TP1", b)], rate[("TP2", b)], rate[("TP2 ring", b)]
        print(
            f"{b:<7}{tp1:>9.0f}{tp2:>9.0f}{ring:>10.0f}{tp2 / tp1:>9.2f}{ring / tp1:>10.2f}{tp2 / ring:>10.2f}"
            f"  {result['same_tokens'][b]}"
        )
        ratios[f"tp2_vs_tp1_batch{b}"] = tp2 / tp1
        ratios[f"tp2_ring_vs_tp1_batch{b}"] = ring / tp1
        ratios[f"tp2_vs_tp2_ring_batch{b}"] = tp2 / ring
    cpu_ms = {key: 1e3 * statistics.median(t) / n for key, t in result["cpu"].items()}
    print(
        "rank 0's CPU ms per decode step (its own work; the rest of the wall time it waits): "
        + ", ".join(f"{name} b{b} {ms:.2f}" for (name, b), ms in cpu_ms.items())
    )
    collectives = 2 * SHAPE["num_layers"] + 1
    tp1_step = 1 / rate[("TP1", 1)]
    wait = collectives * floor["all_gather"]
    print(
        "one collective of [1, 1, 128] between the 2 ranks, tight loop: "
        + ", ".join(f"{name} {seconds * 1e6:.0f} us" for name, seconds in floor.items())
    )
    print(
        f"floor: a greedy TP2 decode step waits on {collectives} one-round collectives = {wait * 1e3:.2f} ms, against "
        f"TP1's whole step of {tp1_step * 1e3:.2f} ms: even with no compute TP2/TP1 <= {tp1_step / wait:.2f} at batch 1"
    )
    ratios["floor_tp2_vs_tp1_batch1"] = tp1_step / wait
    return {
        "times_s": {f"{name} b{b}": t for (name, b), t in times.items()},
        "cpu_ms_per_step": {f"{name} b{b}": ms for (name, b), ms in cpu_ms.items()},
        "floor_s": floor,
        "same_tokens": result["same_tokens"],
        "ratios": ratios,
    }


# --- report ---------------------------------------------------------------------------------------------
def kv_cache_sizes(max_len: int = 4096) -> dict:
    """Cache bytes per token and layer, and per sequence of ``max_len`` tokens over all layers, for DeepSeek-V3's
    multi-latent attention and for attentions of the same size that cache full keys and values (its 128 heads as
    MHA; GQA with 8 key/value heads of 128, Llama-3-70B's grouping), bf16 (2 bytes), one rank (no TP):
    ``megatron_lite.core.estimator.kv_cache_bytes``, exact against the allocated cache (tests/unit/test_estimator)."""
    common = dict(num_layers=61, hidden_size=7168, num_attention_heads=128, vocab_size=129280, seq_length=max_len)
    mla = dict(
        multi_latent_attention=True, num_query_groups=None, q_lora_rank=1536, kv_lora_rank=512, qk_head_dim=128,
        qk_pos_emb_head_dim=64, v_head_dim=128,
    )  # fmt: skip
    configs = {
        "MLA (DeepSeek-V3)": ml.GPTConfig(**common, **mla),
        "MHA, 128 heads x 128": ml.GPTConfig(**common, kv_channels=128),
        "GQA, 8 groups x 128": ml.GPTConfig(**common, kv_channels=128, num_query_groups=8),
    }
    rows = {}
    for name, config in configs.items():
        values = kv_cache_values_per_token_and_layer(config)
        rows[name] = {
            "values_per_token_and_layer": values,
            "bytes_per_token_and_layer": 2 * values,
            f"gib_per_{max_len}_token_sequence": kv_cache_bytes(config, 1, max_len) / 2**30,
        }
    return rows


def report_kv_cache_sizes(rows: dict, max_len: int = 4096) -> None:
    base = rows["MLA (DeepSeek-V3)"]["values_per_token_and_layer"]
    print(f"\nKV cache, bf16, one rank: per token and layer, and one {max_len}-token sequence over 61 layers")
    for name, row in rows.items():
        values, gib = row["values_per_token_and_layer"], row[f"gib_per_{max_len}_token_sequence"]
        print(
            f"  {name:24s} {values:>7,} values  {row['bytes_per_token_and_layer']:>7,} B  {gib:7.2f} GiB  "
            f"({values / base:.1f}x MLA)"
        )


def median_rate(times: list[float], units: int) -> float:
    return units / statistics.median(times)


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--new-tokens", type=int, default=256)
    parser.add_argument("--prompt-length", type=int, default=16)
    parser.add_argument("--prefill-batch", type=int, default=8)
    parser.add_argument("--prefill-length", type=int, default=256)
    parser.add_argument("--tp-new-tokens", type=int, default=200)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--skip-hf", action="store_true", help="no transformers rows (and a GPTModel's weights)")
    parser.add_argument("--skip-tp", action="store_true")
    parser.add_argument(
        "--tp-decode-only",
        action="store_true",
        help="only the TP decode rows (TP2 against TP1 at batch 1 and 16, one-round sums against the ring), the floor",
    )
    parser.add_argument(
        "--quick",
        action="store_true",
        help="with --tp-decode-only: 64 new tokens, 3 repeats",
    )
    parser.add_argument("--out", default=str(REPO_ROOT / "benchmarks" / "results" / "generate.json"))
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    if args.tp_decode_only:
        return tp_decode_main(args)
    use_hf = not args.skip_hf
    if use_hf:
        try:
            import transformers  # noqa: F401
        except ImportError:
            print("transformers is not installed: no transformers rows")
            use_hf = False
    context = max(args.prompt_length + args.new_tokens, args.prefill_length + 1, 512)
    n, prompt = args.new_tokens, [(7 * i + 3) % SHAPE["vocab_size"] for i in range(args.prompt_length)]
    prefill = [
        [(11 * i + 5 * b + 1) % SHAPE["vocab_size"] for i in range(args.prefill_length)]
        for b in range(args.prefill_batch)
    ]
    load_before = os.getloadavg()
    with tempfile.TemporaryDirectory() as tmp:
        module, hf = build_weights(Path(tmp) / "llama", context, use_hf)
    model = module.model

    decode_rows: dict[str, Callable[[], object]] = {
        "cached": lambda: generate(model, [prompt], n),
        "cached, sampled": lambda: generate(model, [prompt], n, SAMPLED),
        "recompute": lambda: generate(model, [prompt], n, use_cache=False),
        "full-logits loop": lambda: full_logits_loop(model, prompt, n),
    }
    prefill_rows: dict[str, Callable[[], object]] = {"prefill": lambda: generate(model, prefill, 1)}
    if hf is not None:
        ids = torch.tensor([prompt])

        def hf_generate(input_ids: torch.Tensor, new: int):
            return hf_greedy(hf, input_ids, new)

        decode_rows["transformers"] = lambda: hf_generate(ids, n)
        prefill_rows["transformers prefill"] = lambda: hf_generate(torch.tensor(prefill), 1)
        same = generate(model, [prompt], n).tokens[0] == hf_generate(ids, n)[0, len(prompt) :].tolist()
    prefill_times, prefill_cpu = rotate(prefill_rows, args.repeats)
    decode, decode_cpu = rotate(decode_rows, args.repeats)
    rates = {name: median_rate(t, n) for name, t in decode.items()}
    cpu_rates = {name: median_rate(t, n) for name, t in decode_cpu.items()}
    prefill_tokens = args.prefill_batch * args.prefill_length
    prefill_rates = {name: median_rate(t, prefill_tokens) for name, t in prefill_times.items()}
    prefill_cpu_rates = {name: median_rate(t, prefill_tokens) for name, t in prefill_cpu.items()}

    tp: dict = {}
    if not args.skip_tp:
        layouts = {
            "TP1": (1, {}),
            "TP2": (2, dict(tensor_model_parallel_size=2)),
            "PP2": (2, dict(pipeline_model_parallel_size=2)),
        }
        for name, (world, parallel) in layouts.items():
            tp[name] = run_layout(world, parallel, module, prompt, args.tp_new_tokens, args.repeats)
    load_after = os.getloadavg()

    print(
        f"generate benchmark: {SHAPE}, context {context}, one thread per process; load average "
        f"{load_before[0]:.1f} before, {load_after[0]:.1f} after (2 cores: above 2 means contention)"
    )
    print(f"\ndecode, 1 prompt of {args.prompt_length} tokens, {n} new tokens (median of {args.repeats})")
    print(f"{'row':<22}{'tokens/s':>10}{'ms/token':>10}{'CPU ms/token':>14}")
    for name, rate in rates.items():
        print(f"{name:<22}{rate:>10.0f}{1000 / rate:>10.2f}{1000 / cpu_rates[name]:>14.2f}")
    print(f"\nprefill, {args.prefill_batch} prompts x {args.prefill_length} tokens, 1 new token")
    for name, rate in prefill_rates.items():
        print(f"{name:<22}{rate:>10.0f} prompt tokens/s, {prefill_cpu_rates[name]:.0f} per CPU second")
    ratios = {
        "cached_vs_recompute": rates["cached"] / rates["recompute"],
        "cached_vs_recompute_cpu": cpu_rates["cached"] / cpu_rates["recompute"],
        "cached_vs_full_logits_loop": rates["cached"] / rates["full-logits loop"],
    }
    if hf is not None:
        ratios["cached_vs_transformers"] = rates["cached"] / rates["transformers"]
        ratios["cached_vs_transformers_cpu"] = cpu_rates["cached"] / cpu_rates["transformers"]
        ratios["prefill_vs_transformers"] = prefill_rates["prefill"] / prefill_rates["transformers prefill"]
        ratios["prefill_vs_transformers_cpu"] = prefill_cpu_rates["prefill"] / prefill_cpu_rates["transformers prefill"]
        print(f"\nsame greedy tokens as transformers: {same}")
    if tp:
        m = args.tp_new_tokens
        tp_rates = {name: {row: median_rate(t, m) for row, t in r["times"].items()} for name, r in tp.items()}
        print(f"\nlayouts, {m} new tokens (forked gloo ranks, median of {args.repeats}; tokens/s)")
        print(f"{'row':<22}" + "".join(f"{name:>9}" for name in tp) + f"{'TP2/TP1':>9}{'PP2/TP1':>9}")

        def cell(name: str, row: str, over: Optional[str] = None) -> str:
            rate = tp_rates[name].get(row)
            if rate is None:
                return f"{'-':>9}"
            return f"{rate / tp_rates[over][row]:>9.2f}" if over else f"{rate:>9.0f}"

        for row in tp_rates["TP1"]:
            print(
                f"{row:<22}"
                + "".join(cell(name, row) for name in tp)
                + cell("TP2", row, "TP1")
                + cell("PP2", row, "TP1")
            )
        latency = tp["TP2"]["all_reduce_s"]
        collectives = 2 * SHAPE["num_layers"] + 1
        print(
            f"one gloo all-reduce of [1, 1, 128] between 2 ranks: {latency * 1e6:.0f} us; a greedy TP2 decode step "
            f"waits on {collectives} collectives = {collectives * latency * 1e3:.2f} ms of its "
            f"{1000 / tp_rates['TP2']['cached']:.2f} ms"
        )
        print(f"TP2 and PP2 tokens equal TP1's: {tp['TP1']['tokens'] == tp['TP2']['tokens'] == tp['PP2']['tokens']}")
        ratios["tp2_vs_tp1_cached"] = tp_rates["TP2"]["cached"] / tp_rates["TP1"]["cached"]
        ratios["tp2_vs_tp1_full_logits_loop"] = (
            tp_rates["TP2"]["full-logits loop"] / tp_rates["TP1"]["full-logits loop"]
        )
        ratios["pp2_vs_tp1_cached"] = tp_rates["PP2"]["cached"] / tp_rates["TP1"]["cached"]
    print("\ntargets:")
    print(
        f"  cached >= 5x recompute at {n} new tokens: {ratios['cached_vs_recompute']:.1f}x wall "
        f"({'met' if ratios['cached_vs_recompute'] >= 5 else 'missed'}), {ratios['cached_vs_recompute_cpu']:.1f}x "
        f"CPU time; {ratios['cached_vs_full_logits_loop']:.1f}x the full-logits loop"
    )
    if hf is not None:
        print(
            f"  cached >= 1.0x transformers: {ratios['cached_vs_transformers']:.2f}x wall "
            f"({'met' if ratios['cached_vs_transformers'] >= 1.0 else 'missed'}), "
            f"{ratios['cached_vs_transformers_cpu']:.2f}x CPU time"
        )
    kv_sizes = kv_cache_sizes()
    report_kv_cache_sizes(kv_sizes)
    result = {
        "kv_cache_sizes": kv_sizes,
        "config": {**vars(args), "shape": SHAPE, "context": context},
        "machine": {
            "torch": torch.__version__,
            "python": platform.python_version(),
            "cpus": os.cpu_count(),
            "load_before": load_before,
            "load_after": load_after,
        },
        "decode_s": decode,
        "decode_cpu_s": decode_cpu,
        "decode_tokens_per_s": rates,
        "decode_tokens_per_cpu_s": cpu_rates,
        "prefill_s": prefill_times,
        "prefill_cpu_s": prefill_cpu,
        "prefill_tokens_per_s": prefill_rates,
        "ratios": ratios,
        "layouts": {name: {"times_s": r["times"], "all_reduce_s": r["all_reduce_s"]} for name, r in tp.items()},
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2))
    print(f"\nwrote {args.out}")
    return 0


def tp_decode_main(args: argparse.Namespace) -> int:
    """``--tp-decode-only``: the TP decode rows alone (about a minute with ``--quick``)."""
    n, repeats = (64, 3) if args.quick else (args.tp_new_tokens, args.repeats)
    context = max(args.prompt_length + n, 512)
    prompt = [(7 * i + 3) % SHAPE["vocab_size"] for i in range(args.prompt_length)]
    load_before = os.getloadavg()
    module, _ = build_weights(Path(), context, use_hf=False)
    section = report_tp_decode(run_tp_decode(module, prompt, n, repeats, (1, 16)), n, repeats)
    load_after = os.getloadavg()
    print(f"load average {load_before[0]:.1f} before, {load_after[0]:.1f} after (2 cores: above 2 means contention)")
    out = Path(args.out).with_name("generate_tp_decode.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    machine = {"torch": torch.__version__, "cpus": os.cpu_count(), "load_before": load_before, "load_after": load_after}
    out.write_text(
        json.dumps(
            {
                "config": {**vars(args), "new_tokens": n, "repeats": repeats, "shape": SHAPE},
                "machine": machine,
                "tp_decode": section,
            },
            indent=2,
            default=str,
        )
    )
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
