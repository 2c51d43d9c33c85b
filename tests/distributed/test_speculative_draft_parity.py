"""Training an EAGLE draft head (TrainDraftHead) on a frozen base through MegatronStrategy: TP2 and DP2 give
the one-process run's per-step draft losses, first-step gradients and final head weights, and only the head's
parameters ever get a gradient (the base stays frozen)."""

import pytest
import torch
from parity_utils import assert_same_training, run, tiny_config

from megatron_lite.callbacks import TrainDraftHead

CONFIG = tiny_config()


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    return run(tmp_path_factory.mktemp("draft_ref"), steps=4, config=CONFIG, callbacks=[TrainDraftHead()])


@pytest.mark.parametrize("layout", [dict(devices=2, tp=2), dict(devices=2)], ids=["tp2", "dp2"])
def test_draft_head_training_matches_one_process(layout, reference, tmp_path):
    result = run(tmp_path, steps=4, config=CONFIG, callbacks=[TrainDraftHead()], **layout)
    assert set(reference["grads"]) == {n for n in reference["params"] if n.startswith("draft_head.")}
    assert_same_training(result, reference)


def test_a_forked_fit_hands_the_trained_head_back(tmp_path):
    """An extension added to the module before a forked TP2 fit comes back with the trained weights: the
    launching process decodes speculatively with the ranks' head (the base unchanged)."""
    import lightning as L

    import megatron_lite as ml
    from megatron_lite.data import MockGPTDataModule
    from megatron_lite.post_training import speculative_generate
    from megatron_lite.post_training.speculative import DraftHeadExtension, draft_head_of

    config = tiny_config(vocab_size=128, hidden_size=32, num_attention_heads=4, num_query_groups=2)
    module = ml.GPTModule(config)
    module.add_objective_extension(DraftHeadExtension())
    L.Trainer(
        strategy=ml.MegatronStrategy(tensor_model_parallel_size=2, start_method="fork"),
        accelerator="cpu",
        devices=2,
        max_steps=2,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        limit_val_batches=0,
    ).fit(module, MockGPTDataModule(seq_length=32, micro_batch_size=2, global_batch_size=4, vocab_size=128, seed=3))
    untrained = ml.GPTModule(config)
    untrained.add_objective_extension(DraftHeadExtension())
    untrained.configure_model()
    assert not torch.equal(draft_head_of(module.model).fc.weight, draft_head_of(untrained.model).fc.weight)
    assert draft_head_of(module.model).base == draft_head_of(untrained.model).base  # the same frozen base
    prompts = [[1, 2, 3], [50, 60]]
    assert speculative_generate(module, prompts, 8).tokens == module.generate(prompts, 8).tokens
