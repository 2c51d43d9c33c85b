"""Generation under TP, PP (with virtual stages), TP x PP, SP and CP on raw gloo process groups, against
a one-process reference that never touches the inference code: an argmax loop over the training
forward's full logits (``GPTModel.full_logits``) and a teacher-forced forward for the log-probs."""

from collections import Counter

import pytest
import torch
from mla_utils import TINY_MLA
from spawn_utils import run_ranks

from megatron_lite import GPTConfig, GPTModel, ParallelConfig, ParallelLayout
from megatron_lite.core.inference import SamplingParams, generate

# GQA (8 query heads, 4 groups) so TP splits whole groups; 4 layers for PP2 x VPP2. The vocabulary pads
# to 304 at TP1 and TP2 alike, so every layout holds the same model whether or not padding is masked.
CONFIG = dict(
    num_layers=4,
    hidden_size=64,
    num_attention_heads=8,
    num_query_groups=4,
    vocab_size=300,
    seq_length=64,
    make_vocab_size_divisible_by=8,
)
PROMPTS = [[5, 17, 42, 8], [7, 7, 7, 1]]
VARIED = [[5, 17, 42, 8, 9, 10, 11], [7], [3, 4, 250]]
NEW = 12
SAMPLING = SamplingParams(temperature=0.9, top_k=40, top_p=0.9, seed=11)


def _config(**overrides) -> GPTConfig:
    return GPTConfig(**{**CONFIG, **overrides})


def _greedy_reference(model: GPTModel, prompt: list[list[int]], n: int) -> list[list[int]]:
    """Greedy tokens by recomputing the training forward over the whole sequence for every token."""
    seq = torch.tensor(prompt)
    for _ in range(n):
        seq = torch.cat([seq, model.full_logits(seq)[:, -1].argmax(-1, keepdim=True)], dim=1)
    return seq[:, len(prompt[0]) :].tolist()


def _teacher_forced_log_probs(model: GPTModel, prompt: list[int], new: list[int]) -> torch.Tensor:
    seq = torch.tensor([prompt + new])
    logits = model.full_logits(seq)[0, len(prompt) - 1 : -1].float()
    return torch.log_softmax(logits, -1).gather(-1, torch.tensor(new)[:, None])[:, 0].double()


def _run_all(model: GPTModel) -> dict:
    """Everything a layout is checked on (every rank of the replica calls this with the same arguments)."""
    greedy = generate(model, PROMPTS, NEW, return_log_probs=True)
    return {
        "greedy": greedy.tokens,
        "log_probs": greedy.log_probs,
        "recompute": generate(model, PROMPTS, NEW, use_cache=False).tokens,
        "varied": generate(model, VARIED, NEW).tokens,
        "varied_recompute": generate(model, VARIED, NEW, use_cache=False).tokens,
        "sampled": generate(model, VARIED, NEW, SAMPLING).tokens,
        "sampled_again": generate(model, VARIED, NEW, SAMPLING).tokens,
        "stopped": generate(model, PROMPTS, NEW, stop_ids=[greedy.tokens[0][3]]).tokens,
    }


def _on_layout(rank, world_size, parallel: dict, overrides: dict):
    layout = ParallelLayout.build(ParallelConfig(**parallel))
    torch.manual_seed(100 + rank)  # generation must not depend on a rank's global RNG
    model = GPTModel(_config(**overrides), layout, seed=3)
    model.train()  # generation switches to eval (and SP off) and restores both
    out = _run_all(model)
    out["restored"] = (model.training, model.sequence_parallel)
    layout.destroy()
    return out


def _expected(model: GPTModel) -> dict:
    """What ``_check`` compares a layout with, from the one-process ``model``."""
    greedy = _greedy_reference(model, PROMPTS, NEW)
    return {
        "model": model,
        "greedy": greedy,
        "varied": [_greedy_reference(model, [p], NEW)[0] for p in VARIED],
        "sampled": generate(model, VARIED, NEW, SAMPLING).tokens,
        "log_probs": [_teacher_forced_log_probs(model, p, g) for p, g in zip(PROMPTS, greedy)],
    }


@pytest.fixture(scope="module")
def reference():
    return _expected(GPTModel(_config(), seed=3).eval())


def _check(results: list[dict], reference: dict, sequence_parallel: bool = False):
    for rank, out in enumerate(results):
        assert out == {**results[0], "restored": out["restored"]}, f"rank {rank} differs from rank 0"
        assert out["restored"] == (True, sequence_parallel)
    out = results[0]
    assert out["greedy"] == reference["greedy"]  # the cache equals the training forward's argmax loop
    assert out["recompute"] == reference["greedy"]  # and so does recomputing without the cache
    assert out["varied"] == reference["varied"]  # prompts of different lengths: as if one by one
    assert out["varied_recompute"] == reference["varied"]
    assert out["sampled"] == out["sampled_again"] == reference["sampled"]  # reproducible from the seed
    assert out["sampled"] != out["varied"]
    for got, want in zip(out["log_probs"], reference["log_probs"]):
        torch.testing.assert_close(torch.tensor(got, dtype=torch.float64), want, rtol=1e-5, atol=1e-5)
    stop = reference["greedy"][0][3]
    assert out["stopped"][0] == reference["greedy"][0][:4]  # ends with the stop id, included
    row = reference["greedy"][1]
    assert out["stopped"][1] == (row[: row.index(stop) + 1] if stop in row else row)


def test_one_process_equals_reference(reference):
    _check(run_ranks(_on_layout, 1, {}, {}), reference)


@pytest.mark.parametrize(
    "parallel",
    [
        pytest.param(dict(tensor_model_parallel_size=2), id="tp2"),
        pytest.param(dict(tensor_model_parallel_size=2, sequence_parallel=True), id="tp2-sp"),
        pytest.param(dict(pipeline_model_parallel_size=2), id="pp2"),
        pytest.param(dict(pipeline_model_parallel_size=2, virtual_pipeline_model_parallel_size=2), id="pp2-vpp2"),
        pytest.param(
            dict(pipeline_model_parallel_size=2, virtual_pipeline_model_parallel_size=2, pipeline_schedule="zbv"),
            id="pp2-v-placement",  # the first and last stage on rank 0, the turn on rank 1
        ),
        pytest.param(dict(pipeline_model_parallel_size=2, num_layers_in_first_pipeline_stage=0), id="pp2-empty-first"),
        pytest.param(dict(context_parallel_size=2), id="cp2"),
    ],
)
def test_two_ranks_equal_reference(reference, parallel):
    _check(run_ranks(_on_layout, 2, parallel, {}), reference, parallel.get("sequence_parallel", False))


def test_tp2_pp2_equals_reference(reference):
    _check(run_ranks(_on_layout, 4, dict(tensor_model_parallel_size=2, pipeline_model_parallel_size=2), {}), reference)


def _collectives_per_decode_step(model: GPTModel, **kwargs) -> dict[str, float]:
    """gloo collectives this rank issues per decode step (as torch's profiler records them): a generation of
    3 tokens less one of 1 (the same prefill), over the 2 extra steps."""
    from torch.profiler import profile

    def count(n: int) -> Counter:
        with profile() as prof:
            generate(model, PROMPTS, n, **kwargs)
        return Counter(e.name for e in prof.events() if e.name.startswith("gloo:"))

    one, three = count(1), count(3)
    return {name: (three[name] - one[name]) / 2 for name in three}


def _decode_collectives(rank, world_size):
    layout = ParallelLayout.build(ParallelConfig(tensor_model_parallel_size=2))
    model = GPTModel(_config(), layout, seed=3)
    out = {
        "greedy": _collectives_per_decode_step(model, return_log_probs=True),
        "sampled": _collectives_per_decode_step(model, sampling=SAMPLING),
    }
    layout.destroy()
    return out


def test_tp2_decode_step_collectives():
    """A greedy TP2 decode step waits on Megatron's two sums per layer and one all-gather that chooses the token
    (2 x 4 + 1), a sampled one on the two sums, the embedding's sum, the logits' gather to the sampler and its
    broadcast; every sum of a decode step's few rows is one all-gather round, never gloo's two-round all-reduce."""
    layers = CONFIG["num_layers"]
    for counts in run_ranks(_decode_collectives, 2):
        assert counts["greedy"] == {"gloo:all_gather": 2 * layers + 1}
        assert counts["sampled"] == {"gloo:all_gather": 2 * layers + 1, "gloo:gather": 1, "gloo:broadcast": 1}


def _tied(rank, world_size):
    layout = ParallelLayout.build(ParallelConfig(tensor_model_parallel_size=2, pipeline_model_parallel_size=2))
    model = GPTModel(
        _config(share_embeddings_and_output_weights=True, position_embedding_type="learned_absolute"), layout, seed=3
    )
    out = generate(model, VARIED, NEW).tokens
    layout.destroy()
    return out


def test_tied_embeddings_and_learned_positions_under_tp2_pp2():
    model = GPTModel(
        _config(share_embeddings_and_output_weights=True, position_embedding_type="learned_absolute"), seed=3
    ).eval()
    expected = [_greedy_reference(model, [p], NEW)[0] for p in VARIED]
    assert all(r == expected for r in run_ranks(_tied, 4))


def _data_parallel(rank, world_size):
    """Two data-parallel replicas, each given its own prompt."""
    layout = ParallelLayout.build(ParallelConfig())
    model = GPTModel(_config(), layout, seed=3)
    prompts = [VARIED[layout.dp_rank]]
    out = generate(model, prompts, NEW, SAMPLING, row_ids=[layout.dp_rank]).tokens
    layout.destroy()
    return out


def test_data_parallel_replicas_generate_independently(reference):
    """Each replica samples its prompt as the batch did (a prompt's generator follows its row id)."""
    results = run_ranks(_data_parallel, 2)
    assert [r[0] for r in results] == reference["sampled"][:2]


# --- mixture of experts ------------------------------------------------------------------------------------------
MOE = dict(num_moe_experts=4, moe_router_topk=2, ffn_hidden_size=64)
# Per data-parallel rank, its generation calls (prompts, max_new_tokens, sampled): different numbers of calls,
# batch sizes, prompt lengths and steps, so the replicas sharing experts finish each call at different steps.
CALLS = [
    [(VARIED, 12, False), ([[9, 9]], 0, False)],
    [([PROMPTS[0]], 5, False), (PROMPTS, 3, True), ([[250, 3, 1, 2], [6]], 7, False)],
]


@pytest.fixture(scope="module")
def moe_reference():
    model = GPTModel(_config(**MOE), seed=3).eval()
    calls = []
    for rank_calls in CALLS:
        expected = []
        for prompts, new, sampled in rank_calls:
            if sampled:
                expected.append((generate(model, prompts, new, SAMPLING).tokens, None))
                continue
            tokens = [_greedy_reference(model, [p], new)[0] for p in prompts]
            log_probs = [
                _teacher_forced_log_probs(model, p, t) if t else torch.zeros(0, dtype=torch.float64)
                for p, t in zip(prompts, tokens)
            ]
            expected.append((tokens, log_probs))
        calls.append(expected)
    return {**_expected(model), "calls": calls}


def test_moe_tp2_sp_equals_reference(moe_reference):
    """Experts split over TP (ETP = TP): decode steps of one token per row split the rows over TP."""
    _check(
        run_ranks(_on_layout, 2, dict(tensor_model_parallel_size=2, sequence_parallel=True), MOE), moe_reference, True
    )


MLA = dict(TINY_MLA, q_lora_rank=24)


def test_mla_tp2_sp_equals_reference():
    """Multi-latent attention: each TP rank caches every token's latent and RoPE key; a prefill expands them to its
    own heads' keys and values, a decode step attends them with its shard of linear_kv_up_proj absorbed
    (mla_absorbed.py; the per-step rule picks it at these widths, test_mla.py checks that)."""
    reference = _expected(GPTModel(_config(**MLA), seed=3).eval())
    _check(run_ranks(_on_layout, 2, dict(tensor_model_parallel_size=2, sequence_parallel=True), MLA), reference, True)


def _moe_replicas(rank, world_size, parallel: dict):
    """Each data-parallel replica makes its own calls (CALLS), then waits for the others' (finish_generation)."""
    from megatron_lite.core.inference.expert_rounds import finish_generation

    layout = ParallelLayout.build(ParallelConfig(**parallel))
    model = GPTModel(_config(**MOE), layout, seed=3)
    out = []
    for prompts, new, sampled in CALLS[layout.dp_rank]:
        result = generate(model, prompts, new, SAMPLING if sampled else None, return_log_probs=not sampled)
        out.append((result.tokens, result.log_probs))
    finish_generation(model)
    layout.destroy()
    return layout.dp_rank, out


@pytest.mark.parametrize(
    "world_size, parallel, replicas",
    [
        pytest.param(2, dict(expert_model_parallel_size=2), 2, id="ep2"),
        pytest.param(4, dict(expert_model_parallel_size=2, pipeline_model_parallel_size=2), 2, id="pp2-ep2"),
        pytest.param(4, dict(expert_model_parallel_size=2, tensor_model_parallel_size=2), 2, id="tp2-ep2"),
        # one replica whose two CP ranks hold the two halves of the experts: CP rank 1 must run the model too
        pytest.param(2, dict(expert_model_parallel_size=2, context_parallel_size=2), 1, id="cp2-ep2"),
    ],
)
def test_moe_replicas_sharing_experts_equal_reference(moe_reference, world_size, parallel, replicas):
    """Experts folded over the data-parallel replicas (and CP ranks): each replica generates its own prompts with
    its own number of calls and steps, and gets one process's tokens and log-probs."""
    results = run_ranks(_moe_replicas, world_size, parallel)
    assert sorted({dp for dp, _ in results}) == list(range(replicas))
    for dp, calls in results:
        assert len(calls) == len(CALLS[dp])
        for (tokens, log_probs), (want_tokens, want_log_probs) in zip(calls, moe_reference["calls"][dp]):
            assert tokens == want_tokens
            for got, want in zip(log_probs or [], want_log_probs or []):
                torch.testing.assert_close(torch.tensor(got, dtype=torch.float64), want, rtol=1e-5, atol=1e-5)


def _speculative_with_folded_experts(rank, world_size):
    from megatron_lite.core.inference.speculative import speculative_generate
    from megatron_lite.core.models.draft_head import EagleDraftHead

    layout = ParallelLayout.build(ParallelConfig(expert_model_parallel_size=2))
    config = _config(**MOE)
    try:
        speculative_generate(GPTModel(config, layout, seed=3), EagleDraftHead(config), [[1, 2]], 2, check_base=False)
    except ValueError as error:
        return str(error)
    finally:
        layout.destroy()
    return None


def test_speculative_decoding_refuses_experts_folded_over_replicas():
    """It steps each replica on its own: refused up front rather than a hang in the first expert exchange."""
    for message in run_ranks(_speculative_with_folded_experts, 2):
        assert message is not None and "expert_model_parallel_size=2" in message and "use generate()" in message
