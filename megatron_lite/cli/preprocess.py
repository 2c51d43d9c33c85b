"""``megatron-lite preprocess``: tokenize a corpus into Megatron-LM ``.bin``/``.idx`` pairs, and
``megatron-lite preprocess merge``: concatenate pairs (:mod:`megatron_lite.data.preprocess` does the work).

    megatron-lite preprocess --input corpus.jsonl.gz --json-keys text --tokenizer-type GPT2BPETokenizer \\
        --vocab-file vocab.json --merge-file merges.txt --output-prefix out/corpus --workers 4 --append-eod
    megatron-lite preprocess merge --input out/a_text_document out/b_text_document --output-prefix out/ab_text_document

Exit code 2 on bad input, with one line that says what to change.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from typing import Optional

from megatron_lite.cli.command import run_verb
from megatron_lite.data.preprocess import PreprocessResult, merge, preprocess
from megatron_lite.utils.local_path import local_or_object_path_argument


def build_parser() -> argparse.ArgumentParser:
    """The ``preprocess`` argument parser (Megatron-LM's option names)."""
    p = argparse.ArgumentParser(
        prog="megatron-lite preprocess",
        description="Tokenize a corpus into Megatron-LM ``.bin``/``.idx`` pairs "
        "(``tools/preprocess_data.py``), and merge pairs.",
        epilog="Merge pairs: megatron-lite preprocess merge --input PREFIX... --output-prefix OUT",
    )
    p.add_argument(
        "--input",
        nargs="+",
        type=local_or_object_path_argument,
        required=True,
        help="files or globs: .jsonl[.gz], .json, .parquet, or datasets save_to_disk directories (local paths or "
        "s3://bucket/key URLs, streamed)",
    )
    p.add_argument(
        "--json-keys",
        "--json-key",
        nargs="+",
        default=["text"],
        dest="json_keys",
        help="keys (columns) holding the text; one output pair per key",
    )
    p.add_argument(
        "--output-prefix",
        type=local_or_object_path_argument,
        required=True,
        help="writes {prefix}_{key}_document.bin/.idx (a local path or s3://bucket/prefix)",
    )
    p.add_argument("--workers", type=int, default=1, help="tokenizing processes")
    p.add_argument("--append-eod", action="store_true", help="append the tokenizer's EOD id to every document")
    p.add_argument("--split-sentences", action="store_true", help="one sequence per sentence (regex splitter)")
    p.add_argument(
        "--tokenizer-type",
        required=True,
        help="SentencePieceTokenizer, GPT2BPETokenizer, HuggingFaceTokenizer, TikTokenizer or NullTokenizer",
    )
    p.add_argument(
        "--tokenizer-model",
        type=local_or_object_path_argument,
        help="SentencePiece .model, HF tokenizer dir/json, or tiktoken file (a local path or an s3:// URL)",
    )
    p.add_argument("--vocab-file", type=local_or_object_path_argument, help="GPT-2 vocab.json")
    p.add_argument("--merge-file", type=local_or_object_path_argument, help="GPT-2 merges.txt")
    p.add_argument("--vocab-size", type=int, help="vocabulary size (NullTokenizer, TikTokenizer)")
    p.add_argument("--log-interval", type=int, default=1000, help="documents between log lines without a tty")
    p.add_argument("--chunk-size", type=int, default=256, help="documents per task sent to a worker")
    p.add_argument("--hf-split", default="train", help="split of a saved DatasetDict")
    p.add_argument(
        "--progress",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="progress bar (default: when stderr is a terminal)",
    )
    return p


def main(argv: Optional[Sequence[str]] = None) -> int:
    """``megatron-lite preprocess ...`` (and ``... preprocess merge ...``): 0, or 2 on bad input (one line)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["merge"]:
        return merge_main(argv[1:])
    args = build_parser().parse_args(argv)

    def work() -> PreprocessResult:
        from megatron_lite.tokenizers import build_tokenizer

        tokenizer = build_tokenizer(
            args.tokenizer_type,
            tokenizer_model=args.tokenizer_model,
            vocab_file=args.vocab_file,
            merge_file=args.merge_file,
            vocab_size=args.vocab_size,
        )
        return preprocess(
            args.input,
            args.output_prefix,
            tokenizer,
            json_keys=args.json_keys,
            workers=args.workers,
            append_eod=args.append_eod,
            split_sentences=args.split_sentences,
            chunk_size=args.chunk_size,
            log_interval=args.log_interval,
            progress=args.progress,
            hf_split=args.hf_split,
        )

    def show(result: PreprocessResult) -> None:
        for key, prefix in result.output_prefixes.items():
            empty = result.empty_documents[key]
            print(
                f"preprocess: {key!r}: {result.documents[key]:,} documents ({empty:,} empty skipped), "
                f"{result.tokens[key]:,} tokens -> {prefix}.bin/.idx"
            )
        print(
            f"preprocess: {sum(result.tokens.values()):,} tokens in {result.seconds:.2f} s "
            f"({result.tokens_per_second:,.0f} tokens/s, workers={args.workers})"
        )

    return run_verb("megatron-lite preprocess", work, show)


def merge_main(argv: Optional[Sequence[str]] = None) -> int:
    """``... preprocess merge --input PREFIX... --output-prefix OUT``: concatenate ``.bin``/``.idx`` pairs."""
    p = argparse.ArgumentParser(
        prog="megatron-lite preprocess merge",
        description="Concatenate indexed datasets (in the order given) into one pair.",
    )
    p.add_argument(
        "--input",
        nargs="+",
        type=local_or_object_path_argument,
        required=True,
        help="prefixes (path without .bin/.idx), .idx/.bin files or globs of them, or a directory "
        "(all its pairs, sorted by name); local paths or s3:// URLs",
    )
    p.add_argument(
        "--output-prefix", type=local_or_object_path_argument, required=True, help="writes OUT.bin and OUT.idx"
    )
    args = p.parse_args(argv)
    return run_verb(
        "megatron-lite preprocess",
        lambda: merge(args.input, args.output_prefix),
        lambda prefixes: print(f"merge: {len(prefixes)} datasets -> {args.output_prefix}.bin/.idx"),
    )
