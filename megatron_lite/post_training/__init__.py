"""Post-training: quantization (nvidia-modelopt), distillation, speculative decoding and pruning of
megatron-lite models, on the training engine (see DESIGN.md §2 "Inference, post-training, RL")."""
