"""Pipeline settings that cannot run fail once, in the launching process, before any rank starts,
with a message that names the fix (through ``trainer.fit`` with the fork launcher)."""

import lightning as L
import pytest

import megatron_lite as ml
from megatron_lite.data import MockGPTDataModule


class Subclassed(ml.GPTModule):
    def loss_fn(self, model, microbatch):
        return super().loss_fn(model, microbatch)


def _fit(devices=2, layers=4, gbs=8, mbs=2, module_cls=ml.GPTModule, tied=False, optimizer=None, **strategy):
    config = ml.GPTConfig(
        num_layers=layers,
        hidden_size=32,
        num_attention_heads=4,
        vocab_size=256,
        seq_length=16,
        share_embeddings_and_output_weights=tied,
    )
    trainer = L.Trainer(
        strategy=ml.MegatronStrategy(start_method="fork", **strategy),
        accelerator="cpu",
        devices=devices,
        max_steps=2,
        logger=False,
        enable_checkpointing=False,
    )
    data = MockGPTDataModule(seq_length=16, micro_batch_size=mbs, global_batch_size=gbs, vocab_size=256)
    trainer.fit(module_cls(config, optimizer or ml.OptimizerConfig()), data)


@pytest.mark.parametrize(
    "kwargs, fix",
    [
        (
            dict(layers=3, pipeline_model_parallel_size=2),
            r"num_layers \(3\) must be divisible by pipeline_model_parallel_size \(2\)"
            r".*num_layers_in_first_pipeline_stage",
        ),
        (
            dict(layers=4, pipeline_model_parallel_size=2, virtual_pipeline_model_parallel_size=4),
            r"num_layers \(4\) must be divisible by "
            r"pipeline_model_parallel_size x virtual_pipeline_model_parallel_size",
        ),
        (
            dict(
                layers=5,
                pipeline_model_parallel_size=2,
                num_layers_in_first_pipeline_stage=4,
                num_layers_in_last_pipeline_stage=2,
            ),
            r"minus the first/last stage's layers \(6\)",
        ),
        (
            dict(gbs=6, pipeline_model_parallel_size=2, virtual_pipeline_model_parallel_size=2),
            r"multiple of pipeline_model_parallel_size \(2\), got 3 .*set global_batch_size to a multiple of 4",
        ),
        (dict(devices=1, virtual_pipeline_model_parallel_size=2), "needs pipeline_model_parallel_size > 1"),
        (
            dict(pipeline_model_parallel_size=2, pipeline_model_parallel_layout="Et|tL"),
            r"layout holds 2 transformer layers \('t'\), but num_layers is 4; make them equal",
        ),
        (
            dict(pipeline_model_parallel_size=2, pipeline_model_parallel_layout="E|tt|tt|L"),
            "set virtual_pipeline_model_parallel_size=2",
        ),
        (dict(pipeline_model_parallel_size=2, pipeline_schedule="1F1B"), "pipeline_schedule must be one of"),
        (
            dict(pipeline_model_parallel_size=2, pipeline_schedule="dualpipev"),
            "set virtual_pipeline_model_parallel_size=2",
        ),
        (
            dict(
                gbs=6,
                pipeline_model_parallel_size=2,
                virtual_pipeline_model_parallel_size=2,
                pipeline_schedule="dualpipev",
            ),
            r"at least 2 x pipeline_model_parallel_size \(4\) microbatches per step, got 3 .*at least 8",
        ),
        (dict(devices=3, pipeline_model_parallel_size=2), r"world size \(3 processes\) must be divisible"),
        (
            dict(devices=4, tensor_model_parallel_size=2, pipeline_model_parallel_size=4),
            r"world size \(4 processes\) must be divisible by the model-parallel size.* = 8",
        ),
        (dict(pipeline_model_parallel_size=2, use_torch_fsdp2=True), "FSDP2 .* not composed yet|not composed yet"),
        (dict(pipeline_model_parallel_size=2, module_cls=Subclassed), "overrides loss_fn.*override forward_step"),
        (
            dict(pipeline_model_parallel_size=2, tied=True, overlap_grad_reduce=True),
            "overlap_grad_reduce=True with tied",
        ),
    ],
)
def test_pipeline_bad_input_names_the_fix(kwargs, fix):
    with pytest.raises(ValueError, match=fix):
        _fit(**kwargs)
