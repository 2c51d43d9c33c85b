"""GPT-2 BPE, Hugging Face tokenizer.json and tiktoken backends on real files and real Shakespeare text."""

from __future__ import annotations

import base64
import gzip
import json
import pickle
from pathlib import Path

import pytest
import tiktoken
import tiktoken.load
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, pre_tokenizers, trainers

from megatron_lite.data import bundled_corpus
from megatron_lite.tokenizers import (
    DEFAULT_CHAT_TEMPLATE,
    GPT2BPETokenizer,
    HuggingFaceTokenizer,
    TikTokenizer,
    Tokenizer,
    build_tokenizer,
)
from megatron_lite.tokenizers.tiktoken_tokenizer import PATTERNS

# real files shipped with the tests (tests/data/README.md: origin and licences) and the bundled corpus
GPT2_DIR = Path(__file__).resolve().parents[1] / "data" / "tokenizers" / "gpt2"
SHAKESPEARE = Path(bundled_corpus("shakespeare"))

TRICKY = "  To be, or not to be:\tthat is the question.\n\n\n   Whether 'tis nobler  é 日本 🙂 ~`|\n"
CHAT = [{"role": "system", "content": "Speak as Hamlet."}, {"role": "user", "content": "To be?"}]
# ChatML with a BOS in front and the EOS after each turn: exercises the template variables
HF_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{{ message['content'] }}<|im_end|>{{ eos_token }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


@pytest.fixture(scope="module")
def text() -> str:
    """About 40 KB of real text from two works, plus characters Shakespeare never used."""
    with gzip.open(SHAKESPEARE, "rt", encoding="utf-8") as f:
        works = [json.loads(next(f))["text"] for _ in range(2)]
    return works[0][:20_000] + works[1][-20_000:] + TRICKY


@pytest.fixture(scope="module")
def gpt2_ranks() -> dict[bytes, int]:
    """GPT-2's ranks as tiktoken derives them from merges.txt + vocab.json (tiktoken checks they agree)."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TIKTOKEN_CACHE_DIR", "")  # "" disables tiktoken's by-path cache of local files
        return tiktoken.load.data_gym_to_mergeable_bpe_ranks(str(GPT2_DIR / "merges.txt"), str(GPT2_DIR / "vocab.json"))


@pytest.fixture(scope="module")
def gpt2() -> GPT2BPETokenizer:
    """The GPT-2 files, loaded once."""
    return GPT2BPETokenizer(GPT2_DIR / "vocab.json", GPT2_DIR / "merges.txt")


def _assert_round_trip(tok: Tokenizer, text: str) -> list[int]:
    """Exact round trip, ids in range, the batch call agrees, and pickling keeps it all."""
    ids = tok.tokenize(text)
    assert all(0 <= i < tok.vocab_size for i in ids)
    assert tok.detokenize(ids) == text
    assert tok.tokenize_batch([text, "", "Romeo"]) == [ids, [], tok.tokenize("Romeo")]
    clone = pickle.loads(pickle.dumps(tok))
    assert clone.tokenize(text) == ids and clone.vocab_size == tok.vocab_size and clone.eod == tok.eod
    assert clone.chat_template == tok.chat_template
    return ids


# --- GPT-2 BPE -------------------------------------------------------------------------------------------


def test_gpt2_known_ids(gpt2: GPT2BPETokenizer) -> None:
    assert gpt2.tokenize("Hello world") == [15496, 995]
    assert gpt2.tokenize(" the") == [262]
    assert (gpt2.vocab_size, gpt2.eod, gpt2.eos) == (50257, 50256, 50256)
    assert (gpt2.bos, gpt2.pad, gpt2.unk) == (None, None, None)
    assert gpt2.detokenize([gpt2.eod]) == "<|endoftext|>"
    # a literal end-of-text marker in a document stays text: only the pipeline places EOD ids
    assert gpt2.eod not in gpt2.tokenize("a<|endoftext|>b")


def test_gpt2_round_trip_and_agreement_with_tiktoken(
    gpt2: GPT2BPETokenizer, gpt2_ranks: dict[bytes, int], text: str
) -> None:
    ids = _assert_round_trip(gpt2, text)
    assert len(ids) < len(text) / 3
    # tiktoken's gpt2 encoding rebuilt from the same files: an independent BPE implementation
    reference = tiktoken.Encoding(
        "gpt2-local", pat_str=PATTERNS["gpt2"], mergeable_ranks=gpt2_ranks, special_tokens={"<|endoftext|>": 50256}
    )
    assert ids == reference.encode_ordinary(text)


def test_gpt2_bad_files(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="check they are not swapped"):
        GPT2BPETokenizer(GPT2_DIR / "merges.txt", GPT2_DIR / "vocab.json")
    with pytest.raises(FileNotFoundError, match=f"GPT-2 merge_file {tmp_path / 'merges.txt'} does not exist"):
        GPT2BPETokenizer(GPT2_DIR / "vocab.json", tmp_path / "merges.txt")
    with pytest.raises(FileNotFoundError, match="is a directory, not a file"):
        GPT2BPETokenizer(GPT2_DIR, GPT2_DIR / "merges.txt")
    # a byte-level vocabulary without GPT-2's end-of-text token
    vocab = json.loads((GPT2_DIR / "vocab.json").read_text(encoding="utf-8"))
    (tmp_path / "vocab.json").write_text(json.dumps({t: i for t, i in vocab.items() if i < 256}), encoding="utf-8")
    (tmp_path / "merges.txt").write_text("#version: 0.2\n", encoding="utf-8")
    with pytest.raises(ValueError, match="has no '<\\|endoftext\\|>' token; .*use HuggingFaceTokenizer"):
        GPT2BPETokenizer(tmp_path / "vocab.json", tmp_path / "merges.txt")


def test_build_gpt2_with_chat_template() -> None:
    tok = build_tokenizer(
        "gpt2",
        vocab_file=GPT2_DIR / "vocab.json",
        merge_file=GPT2_DIR / "merges.txt",
        chat_template=DEFAULT_CHAT_TEMPLATE,
    )
    assert isinstance(tok, GPT2BPETokenizer) and tok.chat_template == DEFAULT_CHAT_TEMPLATE
    rendered = tok.apply_chat_template(CHAT, add_generation_prompt=True)
    assert rendered.endswith("<|im_start|>user\nTo be?<|im_end|>\n<|im_start|>assistant\n")
    assert tok.detokenize(tok.tokenize(rendered)) == rendered
    assert pickle.loads(pickle.dumps(tok)).chat_template == DEFAULT_CHAT_TEMPLATE


# --- Hugging Face tokenizer.json --------------------------------------------------------------------------


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory: pytest.TempPathFactory, text: str) -> Path:
    """A directory as transformers writes it: a byte-level BPE trained here, its config and template."""
    tok = HFTokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=700,
        show_progress=False,
        special_tokens=["<s>", "</s>", "<pad>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(text[:20_000].split("\n"), trainer)
    out = tmp_path_factory.mktemp("hf")
    tok.save(str(out / "tokenizer.json"))
    config = {
        "bos_token": "<s>",
        "pad_token": "<pad>",
        "unk_token": None,
        "chat_template": HF_TEMPLATE,
        "eos_token": {"content": "</s>", "lstrip": False, "normalized": False, "special": True},
    }
    (out / "tokenizer_config.json").write_text(json.dumps(config), encoding="utf-8")
    return out


def test_hf_directory(hf_dir: Path, text: str) -> None:
    tok = HuggingFaceTokenizer(hf_dir)
    assert (tok.bos, tok.eos, tok.eod, tok.pad, tok.unk) == (0, 1, 1, 2, None)
    assert (tok.bos_token, tok.eos_token, tok.vocab_size) == ("<s>", "</s>", 700)
    ids = _assert_round_trip(tok, text)
    assert len(ids) < len(text) / 2  # the trained merges are used
    assert tok.tokenize("<s>") == [0]  # added special tokens in text encode to their ids, as in transformers


def test_hf_chat_template(hf_dir: Path) -> None:
    tok = HuggingFaceTokenizer(hf_dir)
    assert tok.chat_template == HF_TEMPLATE
    rendered = tok.apply_chat_template(CHAT)
    assert rendered == (
        "<s><|im_start|>system\nSpeak as Hamlet.<|im_end|></s>\n<|im_start|>user\nTo be?<|im_end|></s>\n"
    )
    prompt = tok.apply_chat_template(CHAT, add_generation_prompt=True)
    assert prompt == rendered + "<|im_start|>assistant\n"
    ids = tok.tokenize(prompt)
    assert ids[:2] == [0, 3] and ids.count(3) == 3 and ids.count(4) == 2  # <s>, <|im_start|> x3, <|im_end|> x2
    assert tok.detokenize(ids) == prompt
    # an override (here the default ChatML) wins over the model's own, and None restores it
    tok.chat_template = DEFAULT_CHAT_TEMPLATE
    assert tok.apply_chat_template(CHAT) == rendered.replace("<s>", "").replace("</s>", "")
    tok.chat_template = None
    assert tok.chat_template == HF_TEMPLATE


def test_hf_file_alone_and_overrides(hf_dir: Path, tmp_path: Path) -> None:
    (tmp_path / "tokenizer.json").write_bytes((hf_dir / "tokenizer.json").read_bytes())
    tok = HuggingFaceTokenizer(tmp_path / "tokenizer.json")
    assert (tok.bos, tok.eos, tok.chat_template) == (None, None, None)
    with pytest.raises(ValueError, match="names no eos_token .*set eos_token in tokenizer_config.json"):
        _ = tok.eod
    tok = HuggingFaceTokenizer(tmp_path, special_tokens={"eos_token": "<|im_end|>"})
    assert tok.eod == 4
    # special_tokens_map.json and chat_template.jinja, as older / newer transformers write them
    (tmp_path / "special_tokens_map.json").write_text(json.dumps({"eos_token": "</s>"}), encoding="utf-8")
    (tmp_path / "chat_template.jinja").write_text("{{ messages[0]['content'] }}", encoding="utf-8")
    tok = HuggingFaceTokenizer(tmp_path)
    assert tok.eod == 1 and tok.apply_chat_template(CHAT) == "Speak as Hamlet."


def test_hf_errors(hf_dir: Path, tmp_path: Path) -> None:
    for hub_id in ("meta-llama/Llama-3.1-8B", "gpt2"):
        with pytest.raises(
            FileNotFoundError,
            match=f"'{hub_id}' is not a local path; megatron-lite never downloads "
            f"tokenizers — download it once .* and pass the directory",
        ):
            HuggingFaceTokenizer(hub_id)
    with pytest.raises(FileNotFoundError, match=f"{tmp_path / 'absent'} does not exist; pass a local directory"):
        HuggingFaceTokenizer(tmp_path / "absent")
    (tmp_path / "tokenizer.model").write_bytes(b"")
    with pytest.raises(
        FileNotFoundError,
        match=r"tokenizer\.json does not exist \(it has a SentencePiece "
        r"tokenizer\.model: use SentencePieceTokenizer\)",
    ):
        HuggingFaceTokenizer(tmp_path)
    (tmp_path / "tokenizer.json").write_text("{}", encoding="utf-8")
    with pytest.raises(ValueError, match="is not a Hugging Face tokenizers file"):
        HuggingFaceTokenizer(tmp_path)
    (tmp_path / "tokenizer.json").write_bytes((hf_dir / "tokenizer.json").read_bytes())
    (tmp_path / "tokenizer_config.json").write_text('{"eos_token": "<eos>"}', encoding="utf-8")
    with pytest.raises(ValueError, match="eos_token '<eos>' .* is not in the vocabulary .*fix eos_token"):
        HuggingFaceTokenizer(tmp_path)
    (tmp_path / "tokenizer_config.json").write_text('{"eos_token": ', encoding="utf-8")
    with pytest.raises(ValueError, match=r"tokenizer_config\.json is not valid JSON"):
        HuggingFaceTokenizer(tmp_path)
    with pytest.raises(ValueError, match="special_tokens key 'cls_token' is not one of"):
        HuggingFaceTokenizer(hf_dir, special_tokens={"cls_token": "<s>"})


def test_build_hf(hf_dir: Path) -> None:
    tok = build_tokenizer("HuggingFaceTokenizer", tokenizer_model=hf_dir)
    assert isinstance(tok, HuggingFaceTokenizer) and tok.chat_template == HF_TEMPLATE
    tok = build_tokenizer("HF", tokenizer_model=str(hf_dir / "tokenizer.json"), chat_template=DEFAULT_CHAT_TEMPLATE)
    assert tok.chat_template == DEFAULT_CHAT_TEMPLATE
    with pytest.raises(FileNotFoundError, match="'Qwen/Qwen2.5-0.5B' is not a local path"):
        build_tokenizer("hf", tokenizer_model="Qwen/Qwen2.5-0.5B")


# --- tiktoken ----------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def rank_file(tmp_path_factory: pytest.TempPathFactory, gpt2_ranks: dict[bytes, int]) -> Path:
    """GPT-2's vocabulary as a tiktoken rank file (``<base64 token> <rank>`` lines)."""
    path = tmp_path_factory.mktemp("tiktoken") / "gpt2.tiktoken"
    lines = (
        base64.b64encode(token) + b" " + str(rank).encode()
        for token, rank in sorted(gpt2_ranks.items(), key=lambda kv: kv[1])
    )
    path.write_bytes(b"\n".join(lines) + b"\n")
    return path


def test_tiktoken_megatron_id_layout(rank_file: Path, gpt2: GPT2BPETokenizer) -> None:
    tok = TikTokenizer(rank_file, pattern="gpt2")
    # ids 0..999 are special; BPE rank r is id r + 1000, so GPT-2 ids shift by 1000
    assert (tok.unk, tok.bos, tok.eos, tok.eod, tok.pad) == (0, 1, 2, 2, None)
    assert tok.vocab_size == 1000 + 50256 and tok.num_special_tokens == 1000
    assert tok.special_tokens[:4] == ["<unk>", "<s>", "</s>", "<SPECIAL_3>"] and len(tok.special_tokens) == 1000
    assert tok.tokenize("Hello world") == [16496, 1995]
    sample = "Hello world, the end. Sonnets 123 and  more\n"
    assert tok.tokenize(sample) == [i + 1000 for i in gpt2.tokenize(sample)]
    assert tok.detokenize([tok.bos, *tok.tokenize("Hi"), tok.eos]) == "<s>Hi</s>"
    assert tok.eos not in tok.tokenize("a</s>b")  # special-token text in documents stays text
    with pytest.raises(ValueError, match=r"token ids \[52000\] are outside \[0, 51256\)"):
        tok.detokenize([52000])


@pytest.mark.parametrize("pattern", ["v1", "v2", "gpt2"])
def test_tiktoken_round_trip(rank_file: Path, text: str, pattern: str) -> None:
    tok = TikTokenizer(rank_file, pattern=pattern, num_special_tokens=8, special_tokens=["<s>", "</s>", "<unk>"])
    assert (tok.bos, tok.eos, tok.unk, tok.vocab_size) == (0, 1, 2, 8 + 50256)
    ids = _assert_round_trip(tok, text)
    assert min(ids) >= 8


def test_tiktoken_truncation_json_format_and_chat(
    rank_file: Path, gpt2_ranks: dict[bytes, int], text: str, tmp_path: Path
) -> None:
    # Megatron's vocab_size keeps the lowest ranks: here only the 256 bytes, still lossless
    tok = TikTokenizer(rank_file, num_special_tokens=10, vocab_size=266)
    assert tok.vocab_size == 266 and _assert_round_trip(tok, text[:3000]) and len(tok.tokenize("Hamlet")) == 6
    # Megatron/NeMo's JSON vocabulary gives the same ids as the rank file
    entries = [
        {"rank": r, "token_bytes": base64.b64encode(t).decode(), "token_str": t.decode("utf-8", "replace")}
        for t, r in sorted(gpt2_ranks.items(), key=lambda kv: kv[1])
    ]
    (tmp_path / "vocab.json").write_text(json.dumps(entries), encoding="utf-8")
    assert TikTokenizer(tmp_path / "vocab.json").tokenize(text) == TikTokenizer(rank_file).tokenize(text)
    built = build_tokenizer(
        "TikTokenizer",
        tokenizer_model=rank_file,
        tiktoken_pattern="v1",
        tiktoken_num_special_tokens=100,
        chat_template=HF_TEMPLATE,
    )
    assert isinstance(built, TikTokenizer) and built.vocab_size == 100 + 50256
    assert built.apply_chat_template(CHAT[:1]) == "<s><|im_start|>system\nSpeak as Hamlet.<|im_end|></s>\n"


def test_tiktoken_errors(rank_file: Path, tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match=f"tiktoken rank file {tmp_path / 'x.tiktoken'} does not exist"):
        TikTokenizer(tmp_path / "x.tiktoken")
    with pytest.raises(FileNotFoundError, match="'openai/cl100k' is not a local path"):
        build_tokenizer("tiktoken", tokenizer_model="openai/cl100k")
    with pytest.raises(ValueError, match=r"must include \['<unk>', '<s>', '</s>'\] \(missing \['<unk>'\]\)"):
        TikTokenizer(rank_file, special_tokens=["<s>", "</s>"])
    with pytest.raises(ValueError, match="special_tokens must be unique"):
        TikTokenizer(rank_file, special_tokens=["<unk>", "<s>", "</s>", "<s>"])
    with pytest.raises(ValueError, match=r"num_special_tokens=2 must be an int >= len\(special_tokens\) = 3"):
        TikTokenizer(rank_file, num_special_tokens=2)
    with pytest.raises(ValueError, match=r"use a vocab_size in \[1256, 51256\] or None"):
        TikTokenizer(rank_file, vocab_size=60_000)
    with pytest.raises(ValueError, match="pattern '\\(' is not a valid regex"):
        TikTokenizer(rank_file, pattern="(")
    bad = tmp_path / "bad.tiktoken"
    bad.write_bytes(b"IQ== 0\nnot-a-line\n")
    with pytest.raises(ValueError, match=r"bad\.tiktoken:2: b'not-a-line' is not '<base64 token> <rank>'"):
        TikTokenizer(bad)
    bad.write_bytes(b"IQ== 0\nIg== 1\n")
    with pytest.raises(ValueError, match="lacks 254 single-byte tokens .*needs all 256"):
        TikTokenizer(bad)
    bad.write_bytes(b"IQ== 0\nIg== 2\n")
    with pytest.raises(ValueError, match="ranks must be 0..1, each once"):
        TikTokenizer(bad)
    bad.write_text('[{"rank": 1, "token_bytes": "IQ==", "token_str": "!"}]', encoding="utf-8")
    with pytest.raises(ValueError, match="not a Megatron tiktoken JSON vocabulary .*entry 0 has rank 1"):
        TikTokenizer(bad)
