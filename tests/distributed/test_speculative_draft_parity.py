"""Training an EAGLE draft head (TrainDraftHead) on a frozen base through MegatronStrategy: TP2 and DP2 give
the one-process run's per-step draft losses, first-step gradients and final head weights, and only the head's
parameters ever get a gradient (the base stays frozen)."""
import pytest

from megatron_lite.callbacks import TrainDraftHead
from parity_utils import assert_same_training, run, tiny_config

CONFIG = tiny_config()


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    return run(tmp_path_factory.mktemp("draft_ref"), steps=4, config=CONFIG, callbacks=[TrainDraftHead()])


@pytest.mark.parametrize("layout", [dict(devices=2, tp=2), dict(devices=2)], ids=["tp2", "dp2"])
def test_draft_head_training_matches_one_process(layout, reference, tmp_path):
    result = run(tmp_path, steps=4, config=CONFIG, callbacks=[TrainDraftHead()], **layout)
    assert set(reference["grads"]) == {n for n in reference["params"] if n.startswith("draft_head.")}
    assert_same_training(result, reference)
