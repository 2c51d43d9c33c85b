"""The ``--tokenizer-*`` options of the verbs that read a model (``generate``, ``quantize``, ``prune``): by default
the model's own tokenizer (:func:`~megatron_lite.tokenizers.model_tokenizer.model_tokenizer`), or another one."""

from __future__ import annotations

import argparse

from megatron_lite.utils.local_path import local_or_object_path_argument


def add_tokenizer_options(parser: argparse.ArgumentParser) -> None:
    """``--tokenizer-type`` and its files, overriding the tokenizer the model brings."""
    parser.add_argument(
        "--tokenizer-type", default=None, help="override the checkpoint's tokenizer (build_tokenizer type)"
    )
    # local paths or s3:// URLs (build_tokenizer reads an object from a local copy)
    parser.add_argument("--tokenizer-model", type=local_or_object_path_argument, default=None)
    parser.add_argument("--vocab-file", type=local_or_object_path_argument, default=None)
    parser.add_argument("--merge-file", type=local_or_object_path_argument, default=None)


def tokenizer_options(args: argparse.Namespace) -> dict:
    """The options :func:`add_tokenizer_options` added, as ``model_tokenizer`` takes them."""
    return {
        "tokenizer_type": args.tokenizer_type,
        "tokenizer_model": args.tokenizer_model,
        "vocab_file": args.vocab_file,
        "merge_file": args.merge_file,
    }
