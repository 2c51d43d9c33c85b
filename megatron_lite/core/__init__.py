"""Plain-PyTorch core of megatron-lite. Never imports Lightning."""
