"""`megatron-lite fit --config` with a GPTModule subclass as the model (``model.class_path``) and a preference
datamodule: a real 2-step fit through the CLI, with the data's seq_length and vocab_size linked into the
chosen class's config, exactly as for GPTModule configs without a class_path."""

import csv
import json

import pytest

from megatron_lite.cli import main

MODEL = {"num_layers": 1, "hidden_size": 32, "num_attention_heads": 4, "ffn_hidden_size": 64}


def _pairs(path):
    with open(path, "w") as f:
        for i in range(24):
            f.write(json.dumps({"prompt": f"{i % 7 + 1} 3 4", "chosen": "5 6", "rejected": "7 8 9"}) + "\n")


def _yaml(tmp_path, class_path, extra_init_args=""):
    _pairs(tmp_path / "pairs.jsonl")
    text = f"""
trainer:
  accelerator: cpu
  devices: 1
  max_steps: 2
  log_every_n_steps: 1
  enable_progress_bar: false
  enable_model_summary: false
  enable_checkpointing: false
  num_sanity_val_steps: 0
  limit_val_batches: 0
  logger:
    class_path: lightning.pytorch.loggers.CSVLogger
    init_args: {{save_dir: {tmp_path / "logs"}, name: run}}
model:
  class_path: {class_path}
  init_args:
    config: {json.dumps(MODEL)}
    optimizer: {{lr: 1.0e-3}}{extra_init_args}
data:
  class_path: megatron_lite.data.PreferenceDataModule
  init_args:
    path: {tmp_path / "pairs.jsonl"}
    tokenizer: {{class_path: megatron_lite.tokenizers.NullTokenizer, init_args: {{vocab_size: 40}}}}
    seq_length: 12
    micro_batch_size: 2
    global_batch_size: 4
    split: "100,0"
"""
    (tmp_path / "run.yaml").write_text(text)
    return str(tmp_path / "run.yaml")


def _logged(tmp_path):
    rows = list(csv.DictReader(open(next((tmp_path / "logs").rglob("metrics.csv")))))
    config = next((tmp_path / "logs").rglob("config.yaml")).read_text()
    return rows, config


@pytest.mark.parametrize(
    "class_path,metric,init_args",
    [
        ("megatron_lite.rl.RewardModelModule", "train/accuracy", ""),
        ("megatron_lite.rl.DPOModule", "train/reward_accuracy", "\n    beta: 0.2\n    loss_type: ipo"),
    ],
)
def test_cli_fits_a_gpt_module_subclass_on_preference_data(tmp_path, class_path, metric, init_args):
    # --model.config.* (no init_args) still reaches the chosen class's config on the command line
    main(["fit", "--config", _yaml(tmp_path, class_path, init_args), "--model.config.hidden_size", "32"])
    rows, config = _logged(tmp_path)
    steps = sorted({int(r["step"]) for r in rows if r.get(metric)})
    assert steps == [0, 1]  # two optimizer steps ran, each logged the objective's own metric
    assert f"class_path: {class_path}" in config
    assert "seq_length: 12" in config and "vocab_size: 40" in config  # linked from the data
    if "DPO" in class_path:
        assert "beta: 0.2" in config and "loss_type: ipo" in config
