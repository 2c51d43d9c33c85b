"""Resuming a run from a checkpoint: which checkpoint ``ckpt_path="last"`` takes (``auto_resume``), every rank's
RNG states and when they are restored (``rng``), and which model entries a load takes (``entries``: strict
loads, the quantization recipe)."""
