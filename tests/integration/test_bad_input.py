"""Each invalid setting fails once, in the launching process, with a message that names the fix.

Every test here goes through ``trainer.fit`` with the fork launcher: if validation happened only
inside the ranks, the error would arrive as a ProcessRaisedException from a child instead.
"""
import gzip
import json

import lightning as L
import pytest

import megatron_lite as ml
from megatron_lite.data import MockGPTDataModule, TextCorpusDataModule


def _fit(config: ml.GPTConfig, tp: int, devices: int, gbs: int = 8, mbs: int = 2, sp: bool = False, **opt):
    trainer = L.Trainer(strategy=ml.MegatronStrategy(tensor_model_parallel_size=tp, sequence_parallel=sp,
                                                     start_method="fork"),
                        accelerator="cpu", devices=devices, max_steps=2, logger=False, enable_checkpointing=False)
    data = MockGPTDataModule(seq_length=config.seq_length, micro_batch_size=mbs, global_batch_size=gbs,
                             vocab_size=config.vocab_size)
    trainer.fit(ml.GPTModule(config, ml.OptimizerConfig(**opt)), data)


def _config(**kw):
    base = dict(num_layers=1, hidden_size=32, num_attention_heads=4, vocab_size=256, seq_length=16)
    base.update(kw)
    return ml.GPTConfig(**base)


def test_heads_not_divisible_by_tp():
    with pytest.raises(ValueError, match=r"num_attention_heads \(4\) must be divisible by tensor_model_parallel_size \(3\)"):
        _fit(_config(), tp=3, devices=3)


def test_query_groups_not_divisible_by_tp():
    with pytest.raises(ValueError, match=r"num_query_groups \(2\) must be divisible by tensor_model_parallel_size \(4\)"):
        _fit(_config(num_query_groups=2), tp=4, devices=4)


def test_world_size_not_divisible_by_model_parallel_size():
    with pytest.raises(ValueError, match=r"world size \(3 processes\) must be divisible by the model-parallel size"):
        _fit(_config(), tp=2, devices=3)


def test_global_batch_not_divisible_by_micro_batch_times_dp():
    with pytest.raises(ValueError, match=r"global_batch_size \(6\) must be divisible by micro_batch_size \(2\) "
                                         r"x data-parallel size \(2\) = 4"):
        _fit(_config(), tp=1, devices=2, gbs=6)


def test_sequence_parallel_without_tp():
    with pytest.raises(ValueError, match="sequence_parallel=True needs tensor_model_parallel_size > 1"):
        ml.MegatronStrategy(sequence_parallel=True)


def test_sequence_parallel_needs_seq_divisible_by_tp():
    with pytest.raises(ValueError, match=r"seq_length \(15\) must be divisible by tensor_model_parallel_size \(2\)"):
        _fit(_config(seq_length=15), tp=2, devices=2, sp=True)


def test_unknown_strategy_option():
    with pytest.raises(TypeError, match="unexpected keyword argument 'tensor_parallel_size'"):
        ml.MegatronStrategy(tensor_parallel_size=2)


def test_warmup_longer_than_the_run():
    with pytest.raises(ValueError, match=r"lr_warmup_iters \(5\) must be smaller than lr_decay_iters \(2\)"):
        _fit(_config(), tp=1, devices=2, lr_warmup_iters=5)


def test_corpus_path_that_does_not_exist(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist; pass data.path="):
        TextCorpusDataModule(str(tmp_path / "missing.jsonl.gz"))


def test_empty_corpus(tmp_path):
    path = tmp_path / "empty.jsonl.gz"
    with gzip.open(path, "wt") as f:
        f.write(json.dumps({"text": ""}) + "\n")
    with pytest.raises(ValueError, match="holds no non-empty text"):
        TextCorpusDataModule(str(path))


def test_data_vocabulary_larger_than_the_model():
    """Mock data with 512 token ids cannot train a model with vocab_size 256."""
    trainer = L.Trainer(strategy="megatron_fork", accelerator="cpu", devices=1, max_steps=1, logger=False,
                        enable_checkpointing=False)
    data = MockGPTDataModule(seq_length=16, micro_batch_size=2, global_batch_size=2, vocab_size=512)
    with pytest.raises(ValueError, match=r"data's vocabulary \(512 tokens\) is larger than the model's vocab_size \(256\); set model.config.vocab_size=512"):
        trainer.fit(ml.GPTModule(_config()), data)


def _fit_two_ranks(strategy: str = "megatron_fork", **trainer_kwargs):
    trainer = L.Trainer(strategy=strategy, accelerator="cpu", devices=2, max_steps=1, logger=False,
                        enable_checkpointing=False, **trainer_kwargs)
    data = MockGPTDataModule(seq_length=16, micro_batch_size=2, global_batch_size=4, vocab_size=256)
    trainer.fit(ml.GPTModule(_config()), data)


def test_unsupported_precision():
    with pytest.raises(ValueError, match=r"DoublePrecision; pass Trainer\(precision=...\) with one of 32-true, "
                                         r"bf16-mixed, 16-mixed, bf16-true, 16-true"):
        _fit_two_ranks(precision="64-true")


@pytest.mark.parametrize("kwargs, message", [
    (dict(accumulate_grad_batches=2), "raise the datamodule's global_batch_size instead"),
    (dict(gradient_clip_val=1.0), r"set OptimizerConfig\(clip_grad=...\) instead"),
])
def test_lightning_options_that_the_step_does_itself(kwargs, message):
    with pytest.raises(ValueError, match=message):
        _fit_two_ranks(**kwargs)


def test_gpt_module_under_another_multiprocess_strategy():
    # Raised inside the ranks (Lightning's DDP has no hook before launch), so it arrives wrapped.
    with pytest.raises(Exception, match=r"need MegatronStrategy for more than one process .* use Trainer\(strategy='megatron'\)"):
        _fit_two_ranks(strategy="ddp_fork")


def test_ramp_up_with_an_iteration_based_schedule_is_refused_before_launch():
    trainer = L.Trainer(strategy=ml.MegatronStrategy(start_method="fork"), devices=2, accelerator="cpu", max_steps=4,
                        logger=False, enable_checkpointing=False)
    data = MockGPTDataModule(seq_length=16, micro_batch_size=2, global_batch_size=8, vocab_size=256,
                             rampup_batch_size=[4, 4, 16])
    with pytest.raises(ValueError, match="set the schedule in samples"):
        trainer.fit(ml.GPTModule(_config(), ml.OptimizerConfig(lr_warmup_iters=1)), data)
