"""Small standard-library helpers shared by the data and tokenizer packages.

Nothing here imports the rest of ``megatron_lite`` (or any third-party package), so every package can use
it without an import cycle: ``megatron_lite.tokenizers`` cannot import ``megatron_lite.data``, which imports
the tokenizers.
"""
