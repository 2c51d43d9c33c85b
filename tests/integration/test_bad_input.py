"""Each invalid setting fails once, in the launching process, with a message that names the fix.

Every test here goes through ``trainer.fit`` with the fork launcher: if validation happened only
inside the ranks, the error would arrive as a ProcessRaisedException from a child instead. The
bad-input tests at the end also prove that no process was forked at all, that the refusal is one
line, and that it comes fast.
"""

import gzip
import json
import math
import os
import time
from pathlib import Path
from typing import Optional

import lightning as L
import pytest

import megatron_lite as ml
from megatron_lite.core.parallel.run_spec import RunSpec
from megatron_lite.data import MockGPTDataModule, SFTDataModule, TextCorpusDataModule
from megatron_lite.tokenizers import NullTokenizer


def _fit(config: ml.GPTConfig, tp: int, devices: int, gbs: int = 8, mbs: int = 2, sp: bool = False, **opt):
    trainer = L.Trainer(
        strategy=ml.MegatronStrategy(tensor_model_parallel_size=tp, sequence_parallel=sp, start_method="fork"),
        accelerator="cpu",
        devices=devices,
        max_steps=2,
        logger=False,
        enable_checkpointing=False,
    )
    data = MockGPTDataModule(
        seq_length=config.seq_length, micro_batch_size=mbs, global_batch_size=gbs, vocab_size=config.vocab_size
    )
    trainer.fit(ml.GPTModule(config, ml.OptimizerConfig(**opt)), data)


def _config(**kw):
    base = dict(num_layers=1, hidden_size=32, num_attention_heads=4, vocab_size=256, seq_length=16)
    base.update(kw)
    return ml.GPTConfig(**base)


def test_heads_not_divisible_by_tp():
    with pytest.raises(
        ValueError, match=r"num_attention_heads \(4\) must be divisible by tensor_model_parallel_size \(3\)"
    ):
        _fit(_config(), tp=3, devices=3)


def test_query_groups_not_divisible_by_tp():
    with pytest.raises(
        ValueError, match=r"num_query_groups \(2\) must be divisible by tensor_model_parallel_size \(4\)"
    ):
        _fit(_config(num_query_groups=2), tp=4, devices=4)


def test_world_size_not_divisible_by_model_parallel_size():
    with pytest.raises(ValueError, match=r"world size \(3 processes\) must be divisible by the model-parallel size"):
        _fit(_config(), tp=2, devices=3)


def test_global_batch_not_divisible_by_micro_batch_times_dp():
    with pytest.raises(
        ValueError,
        match=r"global_batch_size \(6\) must be divisible by micro_batch_size \(2\) "
        r"x data-parallel size \(2\) = 4",
    ):
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
    trainer = L.Trainer(
        strategy="megatron_fork", accelerator="cpu", devices=1, max_steps=1, logger=False, enable_checkpointing=False
    )
    data = MockGPTDataModule(seq_length=16, micro_batch_size=2, global_batch_size=2, vocab_size=512)
    with pytest.raises(
        ValueError,
        match=r"data's vocabulary \(512 tokens\) is larger than the model's vocab_size \(256\); "
        r"set model.config.vocab_size=512",
    ):
        trainer.fit(ml.GPTModule(_config()), data)


def _fit_two_ranks(strategy: str = "megatron_fork", **trainer_kwargs):
    trainer = L.Trainer(
        strategy=strategy,
        accelerator="cpu",
        devices=2,
        max_steps=1,
        logger=False,
        enable_checkpointing=False,
        **trainer_kwargs,
    )
    data = MockGPTDataModule(seq_length=16, micro_batch_size=2, global_batch_size=4, vocab_size=256)
    trainer.fit(ml.GPTModule(_config()), data)


def test_unsupported_precision():
    with pytest.raises(
        ValueError,
        match=r"DoublePrecision; pass Trainer\(precision=...\) with one of 32-true, "
        r"bf16-mixed, 16-mixed, bf16-true, 16-true",
    ):
        _fit_two_ranks(precision="64-true")


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(accumulate_grad_batches=2), "raise the datamodule's global_batch_size instead"),
        (dict(gradient_clip_val=1.0), r"set OptimizerConfig\(clip_grad=...\) instead"),
    ],
)
def test_lightning_options_that_the_step_does_itself(kwargs, message):
    with pytest.raises(ValueError, match=message):
        _fit_two_ranks(**kwargs)


def test_gpt_module_under_another_multiprocess_strategy():
    # Raised inside the ranks (Lightning's DDP has no hook before launch), so it arrives wrapped.
    with pytest.raises(
        Exception, match=r"need MegatronStrategy for more than one process .* use Trainer\(strategy='megatron'\)"
    ):
        _fit_two_ranks(strategy="ddp_fork")


def test_ramp_up_with_an_iteration_based_schedule_is_refused_before_launch():
    trainer = L.Trainer(
        strategy=ml.MegatronStrategy(start_method="fork"),
        devices=2,
        accelerator="cpu",
        max_steps=4,
        logger=False,
        enable_checkpointing=False,
    )
    data = MockGPTDataModule(
        seq_length=16, micro_batch_size=2, global_batch_size=8, vocab_size=256, rampup_batch_size=[4, 4, 16]
    )
    with pytest.raises(ValueError, match="set the schedule in samples"):
        trainer.fit(ml.GPTModule(_config(), ml.OptimizerConfig(lr_warmup_iters=1)), data)


# --- bad input refused before any rank starts --------------------------------------------------------
# os.fork() runs this in every child it creates (Lightning's fork launcher forks each rank): while a
# test below runs, a child touching the marker file is proof that a rank was started.
_FORK_MARKER: Optional[Path] = None


def _mark_forked_child() -> None:
    if _FORK_MARKER is not None:
        _FORK_MARKER.touch()


os.register_at_fork(after_in_child=_mark_forked_child)

REFUSED_WITHIN_S = 3.0  # validation reads configs and at most one small file; a launch alone takes longer


@pytest.fixture
def fork_marker(tmp_path):
    global _FORK_MARKER
    _FORK_MARKER = tmp_path / "a-rank-was-forked"
    yield _FORK_MARKER
    _FORK_MARKER = None


def _refused_before_launch(module, data, match: str, marker: Path) -> ValueError:
    """``trainer.fit`` at devices=2 (fork) raises ValueError matching ``match`` in this process: one line,
    within REFUSED_WITHIN_S, and no rank forked."""
    trainer = L.Trainer(
        strategy=ml.MegatronStrategy(start_method="fork"),
        accelerator="cpu",
        devices=2,
        max_steps=2,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    start = time.perf_counter()
    with pytest.raises(ValueError, match=match) as info:
        trainer.fit(module, data)
    elapsed = time.perf_counter() - start
    assert not marker.exists(), "a rank was started before the input was refused"
    assert "\n" not in str(info.value), f"the message is not one line: {info.value}"
    assert elapsed < REFUSED_WITHIN_S, f"refused after {elapsed:.1f} s"
    return info.value


def test_the_fork_probe_sees_a_launch(fork_marker):
    """The probe the tests below rely on: a good run at devices=2 does fork its ranks."""
    trainer = L.Trainer(
        strategy=ml.MegatronStrategy(start_method="fork"),
        accelerator="cpu",
        devices=2,
        max_steps=1,
        limit_val_batches=0,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(ml.GPTModule(_config()), _mock_data())
    assert fork_marker.exists()


def _mock_data(seq_length: int = 16) -> MockGPTDataModule:
    return MockGPTDataModule(seq_length=seq_length, micro_batch_size=2, global_batch_size=4, vocab_size=256)


NON_FINITE_OR_OUT_OF_RANGE = [
    ("lr", math.nan, r"OptimizerConfig\(lr=nan\): lr must be a finite number; pass a finite lr"),
    ("lr", math.inf, r"OptimizerConfig\(lr=inf\): lr must be a finite number"),
    ("min_lr", math.nan, r"OptimizerConfig\(min_lr=nan\): min_lr must be a finite number"),
    ("min_lr", math.inf, r"OptimizerConfig\(min_lr=inf\): min_lr must be a finite number"),
    ("lr_warmup_init", math.nan, r"lr_warmup_init must be a finite number"),
    ("weight_decay", math.nan, r"weight_decay must be a finite number"),
    ("end_weight_decay", math.inf, r"end_weight_decay must be a finite number"),
    ("clip_grad", math.nan, r"clip_grad must be a finite number"),
    ("clip_grad", math.inf, r"clip_grad must be a finite number"),
    ("adam_beta1", math.nan, r"adam_beta1 must be a finite number"),
    ("adam_beta2", 1.0, r"adam_beta2 must be in \[0, 1\), got 1.0"),
    ("adam_eps", math.nan, r"adam_eps must be a finite number"),
    ("adam_eps", 0.0, r"adam_eps must be positive, got 0.0; e.g. adam_eps=1e-8"),
    ("sgd_momentum", -math.inf, r"sgd_momentum must be a finite number"),
    ("loss_scale", math.nan, r"loss_scale must be a finite number"),
    ("initial_loss_scale", math.inf, r"initial_loss_scale must be a finite number"),
    ("min_loss_scale", math.nan, r"min_loss_scale must be a finite number"),
    ("lr_mult", math.nan, r"lr_mult must be a finite number"),
]


@pytest.mark.parametrize(
    "field, value, message", NON_FINITE_OR_OUT_OF_RANGE, ids=[f"{f}={v}" for f, v, _ in NON_FINITE_OR_OUT_OF_RANGE]
)
def test_optimizer_config_refuses_non_finite_numbers(field, value, message):
    with pytest.raises(ValueError, match=message):
        ml.OptimizerConfig(**{field: value})


@pytest.mark.parametrize(
    "field, value, message",
    [
        (
            "lr",
            math.nan,
            r"OptimizerConfig\(lr=nan\): lr must be a finite number; pass a finite lr \(the default is 0.0003\)",
        ),
        ("min_lr", math.nan, r"OptimizerConfig\(min_lr=nan\): min_lr must be a finite number"),
        ("min_lr", math.inf, r"OptimizerConfig\(min_lr=inf\): min_lr must be a finite number"),
        ("adam_beta2", 1.0, r"adam_beta2 must be in \[0, 1\)"),
    ],
)
def test_optimizer_value_set_after_construction_is_refused_before_launch(fork_marker, field, value, message):
    """A notebook changes a field of the module's config after building it: fit re-checks the config
    in the launching process (before, lr=nan started both ranks and ended in a 101-line torch traceback)."""
    module = ml.GPTModule(_config(), ml.OptimizerConfig())
    setattr(module.optimizer_config, field, value)
    _refused_before_launch(module, _mock_data(), message, fork_marker)


def test_data_longer_than_a_rope_model_is_refused_before_launch(fork_marker):
    # RoPE would run at any length, so this used to train silently at a length the model was not set up for.
    error = _refused_before_launch(
        ml.GPTModule(_config(seq_length=16)),
        _mock_data(seq_length=32),
        r"the data's seq_length \(32\) is longer than the model's GPTConfig.seq_length "
        r"\(16\) and GPTConfig.max_position_embeddings \(16\)",
        fork_marker,
    )
    assert "set GPTConfig(seq_length=32) or the datamodule's seq_length to at most 16" in str(error)


def test_data_longer_than_a_learned_position_table_is_refused_before_launch(fork_marker):
    config = _config(seq_length=16, position_embedding_type="learned_absolute")
    _refused_before_launch(
        ml.GPTModule(config),
        _mock_data(seq_length=32),
        r"the data's seq_length \(32\) is longer than the model's learned position table "
        r"\(GPTConfig.max_position_embeddings=16, GPTConfig.seq_length=16\)",
        fork_marker,
    )


def test_rope_model_with_a_larger_max_position_embeddings_takes_longer_data():
    from megatron_lite.core.models.run_checks import check_seq_length

    check_seq_length(32, _config(seq_length=16, max_position_embeddings=32))  # asked for on the model: fine
    check_seq_length(8, _config(seq_length=16))  # shorter data: fine


def _write_jsonl(path: Path, records: list) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return str(path)


CHAT = {"messages": [{"role": "user", "content": "Say hi."}, {"role": "assistant", "content": "Good morrow!"}]}


def _sft_data(path: str) -> SFTDataModule:
    return SFTDataModule(path, NullTokenizer(256), seq_length=16, micro_batch_size=2, global_batch_size=4)


def test_empty_sft_file_is_refused_before_launch(fork_marker, tmp_path):
    path = tmp_path / "empty.jsonl"
    path.write_text("\n")
    _refused_before_launch(
        ml.GPTModule(_config()),
        _sft_data(str(path)),
        r"empty.jsonl holds no conversations; each line must be "
        r"\{\"messages\": \[\{\"role\": \.\.\., \"content\": \.\.\.\}, \.\.\.\]\}",
        fork_marker,
    )


@pytest.mark.parametrize("bad_line", [1, 3])
def test_sft_file_without_messages_is_refused_before_launch(fork_marker, tmp_path, bad_line):
    records = [CHAT] * 4
    records[bad_line - 1] = {"conversation": CHAT["messages"]}
    path = _write_jsonl(tmp_path / "chats.jsonl", records)
    _refused_before_launch(
        ml.GPTModule(_config()),
        _sft_data(path),
        rf"chats.jsonl:{bad_line} has no non-empty list under 'messages' \(found \['conversation'\]\); "
        r"each line must be .* \(or pass messages_key=<the key that holds them>\)",
        fork_marker,
    )


def test_sft_file_is_read_once_per_version():
    """The data's pre-launch check remembers the file version it read (a second fit, and every forked rank, skip
    it)."""
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        path = _write_jsonl(Path(tmp) / "chats.jsonl", [CHAT] * 2)
        data = _sft_data(path)
        run = RunSpec(ml.ParallelConfig(), world_size=1, data=data.geometry)
        data.check_before_launch(run)
        assert data._validated_inputs is not None
        _write_jsonl(Path(path), [{"conversation": []}])  # the file changes: read again, and refused
        os.utime(path, ns=(time.time_ns(), time.time_ns() + 10**9))
        with pytest.raises(ValueError, match="chats.jsonl:1 has no non-empty list under 'messages'"):
            data.check_before_launch(run)


def _text_corpus(tmp_path: Path, records: list) -> TextCorpusDataModule:
    path = tmp_path / "corpus.jsonl"
    _write_jsonl(path, records)
    return TextCorpusDataModule(
        str(path),
        seq_length=16,
        micro_batch_size=2,
        global_batch_size=4,
        vocab_size=300,
        cache_dir=str(tmp_path / "cache"),
    )


def test_text_corpus_line_without_its_key_is_refused_before_launch(fork_marker, tmp_path):
    # The constructor reads up to the first text only; line 3 used to fail in rank 0's prepare_data while
    # rank 1 waited, ending in gloo's "Connection closed by peer".
    data = _text_corpus(
        tmp_path, [{"text": "to be or not to be"}, {"text": "that is the question"}, {"body": "whether tis nobler"}]
    )
    _refused_before_launch(
        ml.GPTModule(_config(vocab_size=data.vocab_size)),
        data,
        r"corpus.jsonl:3 has no key 'text' \(its keys: \['body'\]\); every line needs it: "
        r"fix or remove this line",
        fork_marker,
    )


def test_text_corpus_that_is_not_utf8_names_the_line_before_launch(fork_marker, tmp_path):
    # A Latin-1 line used to fail in rank 0's prepare_data with "'utf-8' codec can't decode byte 0xe9 in
    # position 27", naming neither the file nor the line.
    data = _text_corpus(tmp_path, [{"text": "to be or not to be"}, {"text": "that is the question"}])
    with open(data.path, "ab") as f:
        f.write('{"text": "whether tis nobler in the caf\xe9"}\n'.encode("latin-1"))
    _refused_before_launch(
        ml.GPTModule(_config(vocab_size=data.vocab_size)),
        data,
        r"corpus.jsonl:3: byte 40 of the line \(0xe9\) is not UTF-8 .*the input must be UTF-8 "
        r"text: convert the file \(e\.g\. `iconv -f latin1 -t utf-8 .*corpus.jsonl",
        fork_marker,
    )


def test_text_corpus_with_the_wrong_key_names_the_option():
    import tempfile

    with (
        tempfile.TemporaryDirectory() as tmp,
        pytest.raises(
            ValueError,
            match=r"corpus.jsonl:1 has no key 'text' \(its keys: \['body'\]\); pass data.json_key=<one of them>",
        ),
    ):
        _text_corpus(Path(tmp), [{"body": "whether tis nobler"}])


@pytest.mark.parametrize(
    "field, value", [("init_method_std", math.nan), ("layernorm_epsilon", math.inf), ("hidden_dropout", math.nan)]
)
def test_model_config_refuses_non_finite_numbers(field, value):
    # init_method_std=nan used to pass (nan <= 0 is False) and give NaN weights after launch.
    with pytest.raises(ValueError, match=rf"GPTConfig\({field}={value}\): {field} must be a finite number"):
        _config(**{field: value})
