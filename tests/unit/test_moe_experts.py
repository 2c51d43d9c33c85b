"""GroupedExperts in one process: parameter names and shapes, the grouped GEMM against the loop, both against a
hand-written per-expert MLP, the ETP split summing back to the whole experts, and initialisation giving the same
experts at any EP/ETP size. Other layouts' ranks are layouts built by hand: building the module and initialising
it are local (no collective), so one process can play every rank."""

from __future__ import annotations

import warnings

import pytest
import torch

from megatron_lite.core.models.config import GPTConfig
from megatron_lite.core.models.moe.experts import GroupedExperts, grouped_mm_refusal
from megatron_lite.core.parallel.layout import ParallelConfig, ParallelLayout
from megatron_lite.core.parallel.tensor_parallel import full_shape, initialize_parameters, local_shard

EXPERTS, HIDDEN, FFN = 4, 16, 8
NAMES = ["linear_fc1.weight", "linear_fc1.bias", "linear_fc2.weight", "linear_fc2.bias"]


def _config(activation: str = "swiglu", bias: bool = True, grouped: bool = False, hidden: int = HIDDEN, ffn=FFN):
    return GPTConfig(
        num_layers=1,
        hidden_size=hidden,
        num_attention_heads=1,
        ffn_hidden_size=32,
        activation=activation,
        add_bias_linear=bias,
        num_moe_experts=EXPERTS,
        moe_ffn_hidden_size=ffn,
        moe_grouped_gemm=grouped,
    )


def _rank_layout(ep: int = 1, etp: int = 1, ep_rank: int = 0, etp_rank: int = 0) -> ParallelLayout:
    """The layout a rank of EP x ETP (x nothing else) sees, without process groups."""
    if ep == etp == 1:
        return ParallelLayout.single()
    # ETP = TP (the default), as expert output biases need
    config = ParallelConfig(expert_model_parallel_size=ep, tensor_model_parallel_size=etp, sequence_parallel=etp > 1)
    world = ep * etp
    return ParallelLayout(config, world, ep_rank * etp + etp_rank, coords={"ep": ep_rank, "etp": etp_rank})


def _experts(config: GPTConfig, layout=None, seed: int = 5) -> GroupedExperts:
    module = GroupedExperts(config, layout or ParallelLayout.single(), output_init_std=0.01)
    initialize_parameters(module, seed)
    with torch.no_grad():  # biases start at zero: make them visible in every comparison
        for name, param in module.named_parameters():
            if name.endswith("bias"):
                whole = torch.randn(full_shape(param), generator=torch.Generator().manual_seed(len(name)))
                param.copy_(local_shard(param, whole))
    return module


def _tokens(n: int = 12, hidden: int = HIDDEN) -> torch.Tensor:
    return torch.randn(n, hidden, generator=torch.Generator().manual_seed(0))


COUNTS = [3, 0, 5, 4]  # an expert without tokens included


def test_parameter_names_and_shapes_at_ep2_etp2():
    layout = _rank_layout(ep=2, etp=2, ep_rank=1, etp_rank=1)
    module = GroupedExperts(_config(), layout, output_init_std=0.01)
    params = dict(module.named_parameters())
    assert list(params) == NAMES
    local = EXPERTS // 2
    assert params["linear_fc1.weight"].shape == (local, 2 * FFN // 2, HIDDEN)
    assert params["linear_fc1.bias"].shape == (local, 2 * FFN // 2)
    assert params["linear_fc2.weight"].shape == (local, HIDDEN, FFN // 2)
    assert params["linear_fc2.bias"].shape == (local, HIDDEN)
    assert full_shape(params["linear_fc1.weight"]) == (EXPERTS, 2 * FFN, HIDDEN)
    assert full_shape(params["linear_fc2.weight"]) == (EXPERTS, HIDDEN, FFN)
    assert full_shape(params["linear_fc2.bias"]) == (EXPERTS, HIDDEN)
    for name in ("linear_fc1.weight", "linear_fc1.bias", "linear_fc2.weight"):
        assert params[name].tp_shard.group == "etp" and params[name].tp_shard.size == 2
    assert params["linear_fc2.bias"].tp_shard is None  # whole on every ETP rank
    assert all(p.expert_shard.rank == 1 and p.expert_shard.size == 2 for p in params.values())
    gelu = GroupedExperts(_config("gelu", bias=False), layout, output_init_std=0.01)
    assert [n for n, _ in gelu.named_parameters()] == ["linear_fc1.weight", "linear_fc2.weight"]
    assert gelu.linear_fc1.weight.shape == (local, FFN // 2, HIDDEN)


def _reference(module: GroupedExperts, tokens: torch.Tensor, counts: list[int], swiglu: bool) -> torch.Tensor:
    """Each expert's MLP written out by hand, token block by token block."""
    w1, b1 = module.linear_fc1.weight, module.linear_fc1.bias
    w2, b2 = module.linear_fc2.weight, module.linear_fc2.bias
    outs, start = [], 0
    for e, n in enumerate(counts):
        x = tokens[start : start + n]
        start += n
        h = x @ w1[e].T + b1[e]
        if swiglu:
            gate, up = h[:, :FFN], h[:, FFN:]
            h = gate * torch.sigmoid(gate) * up
        else:
            h = 0.5 * h * (1.0 + torch.erf(h / 2**0.5))
        outs.append(h @ w2[e].T + b2[e])
    return torch.cat(outs)


@pytest.mark.parametrize("activation", ["swiglu", "gelu"])
@pytest.mark.parametrize("grouped", [False, True], ids=["loop", "grouped"])
def test_experts_equal_a_hand_written_mlp_per_expert(activation, grouped):
    module = _experts(_config(activation, grouped=grouped))
    tokens = _tokens()
    torch.testing.assert_close(module(tokens, COUNTS), _reference(module, tokens, COUNTS, activation == "swiglu"))


def test_grouped_gemm_equals_the_loop_forward_and_backward():
    assert grouped_mm_refusal(torch.device("cpu"), torch.float32, [(2 * FFN, HIDDEN), (HIDDEN, FFN)]) is None
    results = []
    for grouped in (False, True):
        module = _experts(_config(grouped=grouped))
        tokens = _tokens().requires_grad_()
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # the grouped GEMM runs here: no fallback
            out = module(tokens, COUNTS)
        out.sum().backward()  # an expanded gradient, which torch's grouped GEMM takes only once made dense
        results.append([out, tokens.grad, *(p.grad for p in module.parameters())])
    for loop, grouped in zip(*results):
        torch.testing.assert_close(grouped, loop)


@pytest.mark.parametrize(
    "dtype,hidden", [(torch.float32, 6), (torch.float64, HIDDEN)], ids=["unaligned_width", "float64"]
)
def test_grouped_gemm_falls_back_to_the_loop_and_says_so(dtype, hidden):
    config = _config(grouped=True, hidden=hidden)
    module = _experts(config).to(dtype)
    loop = _experts(_config(hidden=hidden)).to(dtype)
    tokens = _tokens(hidden=hidden).to(dtype)
    with pytest.warns(UserWarning, match="the experts run one GEMM each instead"):
        out = module(tokens, COUNTS)
    torch.testing.assert_close(out, loop(tokens, COUNTS))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # probed once: no second warning from this module
        module(tokens, COUNTS)


def test_bad_token_counts_are_refused():
    module = _experts(_config())
    with pytest.raises(ValueError, match="one count per local expert"):
        module(_tokens(), [3, 9])
    with pytest.raises(ValueError, match="summing to the 12 tokens"):
        module(_tokens(), [3, 0, 5, 5])


@pytest.mark.parametrize("ep,etp", [(2, 1), (1, 2), (2, 2), (4, 1)])
def test_initialisation_gives_the_same_experts_at_any_ep_and_etp(ep, etp):
    config = _config(bias=False)
    whole = dict(_experts(config).named_parameters())
    for ep_rank in range(ep):
        for etp_rank in range(etp):
            rank = dict(_experts(config, _rank_layout(ep, etp, ep_rank, etp_rank)).named_parameters())
            for name, param in rank.items():
                assert torch.equal(param, local_shard(param, whole[name])), (name, ep_rank, etp_rank)


@pytest.mark.parametrize("activation", ["swiglu", "gelu"])
def test_etp_partial_outputs_sum_to_the_whole_experts(activation):
    """Each EP rank's experts, split over ETP2: the ETP ranks' partial outputs (fc2's bias added once) sum to the
    one-process experts' output on the tokens of those experts."""
    config = _config(activation)
    whole = _experts(config)
    tokens = _tokens()
    expected = whole(tokens, COUNTS).detach()
    starts = [sum(COUNTS[:e]) for e in range(EXPERTS)]
    for ep_rank in range(2):
        experts = range(2 * ep_rank, 2 * ep_rank + 2)
        rows = torch.cat([torch.arange(starts[e], starts[e] + COUNTS[e]) for e in experts])
        counts = [COUNTS[e] for e in experts]
        partial = [_experts(config, _rank_layout(2, 2, ep_rank, r))(tokens[rows], counts) for r in range(2)]
        torch.testing.assert_close(partial[0] + partial[1], expected[rows])


def test_a_one_process_models_experts_carry_over_into_an_ep_rank_and_back_is_refused():
    """carry_over_state (a notebook's one-process model into the ranks' models): each EP x ETP rank cuts its
    experts out of the whole ones; an EP rank's few experts cannot become a whole model in place."""
    from megatron_lite.core.checkpoint.full.state import carry_over_state

    config = _config()
    whole = _experts(config)
    rank = GroupedExperts(config, _rank_layout(2, 2, ep_rank=1, etp_rank=0), output_init_std=0.01)
    carry_over_state(whole, rank)
    for (name, param), source in zip(rank.named_parameters(), whole.parameters()):
        assert torch.equal(param, local_shard(param, source)), name
    with pytest.raises(ValueError, match="from expert-parallel size 2 .rank 1. to 1 .rank 0."):
        carry_over_state(rank, GroupedExperts(config, ParallelLayout.single(), output_init_std=0.01))
