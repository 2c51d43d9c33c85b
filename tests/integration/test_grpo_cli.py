"""`megatron-lite fit --config examples/configs/grpo.yaml`: GRPOModule as model.class_path, the prompt
datamodule with the character tokenizer, the reward function by import path; a real 2-rollout fit with
pass@k on the held-out prompts, logged to CSV."""
import csv
from pathlib import Path

from megatron_lite.cli import main

ROOT = Path(__file__).resolve().parents[2]


def test_cli_fits_grpo_from_the_example_config(tmp_path):
    main(["fit", "--config", str(ROOT / "examples/configs/grpo.yaml"),
          "--data.init_args.path", str(ROOT / "examples/data/addition.jsonl"),
          "--trainer.max_steps", "2", "--trainer.val_check_interval", "2", "--trainer.enable_progress_bar", "false",
          "--model.init_args.grpo.group_size", "4", "--data.init_args.global_batch_size", "8",  # a smaller step
          "--trainer.enable_model_summary", "false", "--trainer.enable_checkpointing", "false",
          "--trainer.logger", "lightning.pytorch.loggers.CSVLogger", "--trainer.logger.save_dir", str(tmp_path)])
    rows = list(csv.DictReader(open(next(tmp_path.rglob("metrics.csv")))))
    steps = sorted({int(r["step"]) for r in rows if r.get("train/reward_mean")})
    assert steps == [0, 1]  # two rollouts, each logged its reward
    assert any(r.get("val/pass_at_k") for r in rows)
    config = next(tmp_path.rglob("config.yaml")).read_text()
    assert "class_path: megatron_lite.rl.GRPOModule" in config
    assert "reward_fn: megatron_lite.rl.rewards.exact_match" in config
