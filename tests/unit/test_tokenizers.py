"""SentencePiece tokenizer: training on real Shakespeare text, exact round trips, the Llama model in tests/data."""

from __future__ import annotations

import gzip
import json
import os
import pickle
from pathlib import Path

import pytest

from megatron_lite.data import bundled_corpus
from megatron_lite.tokenizers import SentencePieceTokenizer, Tokenizer, train_sentencepiece

# shipped with the tests (tests/data/README.md: origin and licence)
LLAMA_MODEL = Path(__file__).resolve().parents[1] / "data" / "tokenizers" / "llama-sp" / "tokenizer.model"

# whitespace runs, leading indentation, tabs, blank lines, characters Shakespeare never used
TRICKY = "  To be, or not to be:\tthat is the question.\n\n\n   Whether 'tis nobler  é 日本 🙂 ~`|\n"


def _works(n: int) -> dict[str, str]:
    """The first ``n`` works of the bundled corpus, by id."""
    works = {}
    with gzip.open(bundled_corpus("shakespeare"), "rt", encoding="utf-8") as f:
        for line in f:
            obj = json.loads(line)
            works[obj["id"]] = obj["text"]
            if len(works) == n:
                break
    return works


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> tuple[SentencePieceTokenizer, dict[str, str], Path]:
    """A 1000-piece BPE model trained on three plays."""
    works = _works(3)
    out = tmp_path_factory.mktemp("spm")
    path = train_sentencepiece(works.values(), str(out / "shakespeare"), 1000)
    return SentencePieceTokenizer(path), works, out


def test_trained_model_files_and_special_ids(trained: tuple[SentencePieceTokenizer, dict[str, str], Path]) -> None:
    tok, _, out = trained
    assert isinstance(tok, Tokenizer)
    # only the final files remain: training happened in a temporary directory
    assert sorted(os.listdir(out)) == ["shakespeare.model", "shakespeare.vocab"]
    assert tok.vocab_size == 1000
    assert (tok.unk, tok.bos, tok.eos, tok.pad) == (0, 1, 2, None)
    assert tok.eod == tok.eos


def test_round_trip_is_exact_on_real_text(trained: tuple[SentencePieceTokenizer, dict[str, str], Path]) -> None:
    tok, works, _ = trained
    for text in works.values():
        ids = tok.tokenize(text)
        assert all(0 <= i < tok.vocab_size for i in ids)
        assert tok.detokenize(ids) == text
    # a text the model never saw, with characters only byte fallback can express
    assert tok.detokenize(tok.tokenize(TRICKY)) == TRICKY
    assert tok.tokenize_batch([TRICKY, "Romeo"]) == [tok.tokenize(TRICKY), tok.tokenize("Romeo")]
    # BPE learnt something: far fewer tokens than characters
    hamlet_like = next(iter(works.values()))
    assert len(tok.tokenize(hamlet_like)) < len(hamlet_like) / 2


def test_pickle_keeps_the_model(trained: tuple[SentencePieceTokenizer, dict[str, str], Path]) -> None:
    tok, _, _ = trained
    clone = pickle.loads(pickle.dumps(tok))
    assert clone.tokenize(TRICKY) == tok.tokenize(TRICKY)
    assert clone.model_path == tok.model_path


def test_training_errors_name_the_fix(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="vocab_size must be >= 260"):
        train_sentencepiece(["some text"], str(tmp_path / "a"), 100)
    with pytest.raises(ValueError, match="lower vocab_size or use more text"):
        train_sentencepiece(["a tiny corpus"], str(tmp_path / "b"), 5000)
    with pytest.raises(ValueError, match="non-empty corpus"):
        train_sentencepiece(["", "\n\n"], str(tmp_path / "c"), 300)
    with pytest.raises(FileNotFoundError, match="does not exist"):
        SentencePieceTokenizer(str(tmp_path / "missing.model"))
    assert os.listdir(tmp_path) == []  # failed runs leave no temporary directories behind


def test_a_corpus_of_overlong_lines_names_max_sentence_length(tmp_path: Path) -> None:
    """SentencePiece skips lines longer than max_sentence_length without a word: one long line (a document
    without newlines) left it nothing to train on, and the error blamed an empty corpus."""
    line = "to be or not to be, that is the question " * 2000  # 82 KB on one line
    with pytest.raises(
        ValueError,
        match=r"1 of its 1 lines are longer than max_sentence_length \(65536 bytes; the "
        r"longest holds 82000\).*split the text into shorter lines.*"
        r"max_sentence_length=82000",
    ):
        train_sentencepiece([line], str(tmp_path / "long"), 300)
    with pytest.warns(UserWarning, match="trained without part of the corpus: 1 of its 2 lines are longer"):
        train_sentencepiece([line + "\n" + line[:3000]], str(tmp_path / "part"), 300)
    assert SentencePieceTokenizer(
        train_sentencepiece([line], str(tmp_path / "raised"), 300, max_sentence_length=100_000)
    ).tokenize(line[:41])


def test_llama_sentencepiece_model() -> None:
    tok = SentencePieceTokenizer(str(LLAMA_MODEL))
    assert tok.vocab_size == 32000
    assert (tok.bos, tok.eos, tok.eod, tok.pad) == (1, 2, 2, None)
    text = next(iter(_works(1).values()))[:5000]
    ids = tok.tokenize(text)
    assert tok.detokenize(ids) == text
    assert tok.detokenize(tok.tokenize(TRICKY)) == TRICKY
    assert tok.detokenize([tok.bos, *tok.tokenize("Hello"), tok.eos]) == "Hello"


# --- the interface, chat templates, the null tokenizer and build_tokenizer -------------------------------

from collections.abc import Sequence  # noqa: E402

from megatron_lite.tokenizers import (  # noqa: E402
    DEFAULT_CHAT_TEMPLATE,
    TOKENIZER_TYPES,
    ChatTemplateError,
    NullTokenizer,
    build_tokenizer,
    render_chat_template,
)

CHAT = [{"role": "system", "content": "Speak as Hamlet."}, {"role": "user", "content": "To be?"}]


class _CharTokenizer(Tokenizer):
    """The smallest backend: code points as ids; only the abstract members are implemented."""

    def tokenize(self, text: str) -> list[int]:
        return [ord(c) for c in text]

    def detokenize(self, ids: Sequence[int]) -> str:
        return "".join(chr(i) for i in ids)

    @property
    def vocab_size(self) -> int:
        return 0x110000

    @property
    def eod(self) -> int:
        return 0


def test_interface_defaults_and_batch_loop() -> None:
    tok = _CharTokenizer()
    assert tok.tokenize_batch(["ab", "", "c"]) == [[97, 98], [], [99]]
    assert (tok.bos, tok.eos, tok.pad, tok.unk, tok.bos_token, tok.eos_token, tok.chat_template) == (None,) * 7
    with pytest.raises(ValueError, match=r"_CharTokenizer has no chat template; pass chat_template=\.\.\."):
        tok.apply_chat_template(CHAT)
    # a template given per call, then one set on the tokenizer (None restores the model's: none here)
    assert tok.apply_chat_template(CHAT, chat_template="{{ messages | length }}") == "2"
    tok.chat_template = DEFAULT_CHAT_TEMPLATE
    assert tok.apply_chat_template(CHAT).startswith("<|im_start|>system\n")
    tok.chat_template = None
    assert tok.chat_template is None
    with pytest.raises(TypeError, match="Jinja2 string"):
        tok.chat_template = 3  # type: ignore[assignment]


def test_default_chat_template_is_chatml() -> None:
    text = render_chat_template(DEFAULT_CHAT_TEMPLATE, CHAT)
    assert text == "<|im_start|>system\nSpeak as Hamlet.<|im_end|>\n<|im_start|>user\nTo be?<|im_end|>\n"
    prompt = render_chat_template(DEFAULT_CHAT_TEMPLATE, CHAT, add_generation_prompt=True)
    assert prompt == text + "<|im_start|>assistant\n"
    assert render_chat_template(DEFAULT_CHAT_TEMPLATE, []) == ""


def test_chat_template_variables_and_hf_conventions() -> None:
    template = (
        "{{ bos_token }}{% for m in messages %}{% if m['role'] == 'tool' %}"
        "{{ raise_exception('no tools here') }}{% endif %}{{ m['content'] | tojson }}{{ eos_token }}"
        "{% endfor %}"
    )
    text = render_chat_template(template, [{"role": "user", "content": "é <b>"}], bos_token="<s>", eos_token="</s>")
    assert text == '<s>"é <b>"</s>'  # HF's tojson: no HTML escaping, no ASCII escaping
    assert render_chat_template(template, CHAT[:1]) == '"Speak as Hamlet."'  # missing tokens render empty
    with pytest.raises(ChatTemplateError, match="no tools here"):
        render_chat_template(template, [{"role": "tool", "content": "x"}])


def test_chat_template_errors() -> None:
    with pytest.raises(ChatTemplateError, match="does not compile"):
        render_chat_template("{% for m in messages %}", CHAT)
    # the sandbox: templates cannot mutate their inputs or reach Python internals
    with pytest.raises(ChatTemplateError, match="failed to render"):
        render_chat_template("{{ messages.append(1) }}", CHAT)
    with pytest.raises(ChatTemplateError, match="failed to render"):
        render_chat_template("{{ messages.__class__.__mro__ }}", CHAT)
    with pytest.raises(ValueError, match=r"messages\[1\] = .* must be a dict with 'role' and 'content'"):
        render_chat_template(DEFAULT_CHAT_TEMPLATE, [CHAT[0], {"content": "no role"}])
    with pytest.raises(TypeError, match="messages must be a list"):
        render_chat_template(DEFAULT_CHAT_TEMPLATE, "hello")  # type: ignore[arg-type]


def test_null_tokenizer() -> None:
    tok = NullTokenizer(100)
    assert (tok.vocab_size, tok.eod, tok.eos, tok.bos, tok.pad) == (100, 99, 99, None, None)
    assert tok.tokenize("1 2  3\n99") == [1, 2, 3, 99]
    assert tok.tokenize("") == []
    assert tok.detokenize([1, 2, 3]) == "1 2 3"
    assert tok.detokenize(tok.tokenize("0 5 99")) == "0 5 99"
    assert tok.tokenize_batch(["1", "2 3"]) == [[1], [2, 3]]
    with pytest.raises(ValueError, match=r"token id 100 is outside \[0, 100\)"):
        tok.tokenize("1 100")
    with pytest.raises(ValueError, match=r"token id -1 is outside"):
        tok.detokenize([-1])
    with pytest.raises(ValueError, match="whitespace-separated integer ids, got 'x'"):
        tok.tokenize("1 x")
    with pytest.raises(ValueError, match="vocab_size >= 1"):
        NullTokenizer(0)
    clone = pickle.loads(pickle.dumps(tok))
    assert (clone.vocab_size, clone.tokenize("7 8")) == (100, [7, 8])


def _write_jsonl(path: Path, texts: list[str], key: str = "text") -> Path:
    """A JSONL corpus with one object per text."""
    path.write_text("".join(json.dumps({key: t, "id": i}) + "\n" for i, t in enumerate(texts)), encoding="utf-8")
    return path


def test_build_sentencepiece_trains_on_a_jsonl_corpus(tmp_path: Path) -> None:
    text = next(iter(_works(1).values()))[:30_000]
    corpus = _write_jsonl(tmp_path / "corpus.jsonl", [text[:15_000], "", text[15_000:]])
    tok = build_tokenizer(
        "sentencepiece",
        train_corpus=corpus,
        vocab_size=400,
        output_prefix=tmp_path / "spm",
        chat_template=DEFAULT_CHAT_TEMPLATE,
    )
    assert isinstance(tok, SentencePieceTokenizer)
    assert (tmp_path / "spm.model").is_file() and tok.vocab_size == 400
    assert tok.detokenize(tok.tokenize(text)) == text
    assert tok.apply_chat_template(CHAT[1:], add_generation_prompt=True).endswith("<|im_start|>assistant\n")
    clone = pickle.loads(pickle.dumps(tok))
    assert clone.chat_template == DEFAULT_CHAT_TEMPLATE and clone.tokenize(TRICKY) == tok.tokenize(TRICKY)
    # loading the trained model by type name (any case, - or _) gives the same ids
    loaded = build_tokenizer("SentencePieceTokenizer", tokenizer_model=str(tmp_path / "spm.model"))
    assert loaded.tokenize(TRICKY) == tok.tokenize(TRICKY) and loaded.chat_template is None


def test_build_sentencepiece_corpus_errors(tmp_path: Path) -> None:
    corpus = _write_jsonl(tmp_path / "c.jsonl", ["some text"] * 3, key="content")
    with pytest.raises(
        ValueError, match=r"c\.jsonl:1 has no key 'text' \(its keys: \['content', 'id'\]\); pass json_key"
    ):
        build_tokenizer("sentencepiece", train_corpus=corpus, vocab_size=300, output_prefix=tmp_path / "m")
    (tmp_path / "bad.jsonl").write_text('{"text": "ok"}\nnot json\n', encoding="utf-8")
    with pytest.raises(ValueError, match=r"bad\.jsonl:2 is not valid JSON"):
        build_tokenizer(
            "sentencepiece", train_corpus=tmp_path / "bad.jsonl", vocab_size=300, output_prefix=tmp_path / "m"
        )
    with pytest.raises(ValueError, match="needs vocab_size and output_prefix"):
        build_tokenizer("sentencepiece", train_corpus=corpus, vocab_size=300)
    with pytest.raises(FileNotFoundError, match=r"train_corpus .*missing\.jsonl does not exist"):
        build_tokenizer(
            "sentencepiece", train_corpus=tmp_path / "missing.jsonl", vocab_size=300, output_prefix=tmp_path / "m"
        )
    with pytest.raises(ValueError, match="not both"):
        build_tokenizer("sentencepiece", tokenizer_model="x.model", train_corpus=corpus)
    assert not (tmp_path / "m.model").exists()


def test_build_tokenizer_argument_errors(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="unknown tokenizer_type 'bert'; use one of " + ", ".join(TOKENIZER_TYPES)):
        build_tokenizer("bert")
    with pytest.raises(ValueError, match="SentencePieceTokenizer needs tokenizer_model"):
        build_tokenizer("SentencePieceTokenizer")
    with pytest.raises(ValueError, match="GPT2BPETokenizer needs vocab_file and merge_file"):
        build_tokenizer("GPT2BPETokenizer", vocab_file="vocab.json")
    with pytest.raises(ValueError, match="HuggingFaceTokenizer needs tokenizer_model"):
        build_tokenizer("hf")
    with pytest.raises(ValueError, match="TikTokenizer needs tokenizer_model"):
        build_tokenizer("tiktoken")
    with pytest.raises(ValueError, match="NullTokenizer needs vocab_size"):
        build_tokenizer("null")
    missing = tmp_path / "nope.model"
    with pytest.raises(FileNotFoundError, match=f"SentencePiece tokenizer_model {missing} does not exist"):
        build_tokenizer("sentencepiece", tokenizer_model=missing)
    with pytest.raises(
        FileNotFoundError,
        match="'meta-llama/Llama-2-7b' is not a local path; megatron-lite never "
        "downloads tokenizers — download it once",
    ):
        build_tokenizer("sentencepiece", tokenizer_model="meta-llama/Llama-2-7b")


def test_build_null_tokenizer_with_chat_template_file(tmp_path: Path) -> None:
    (tmp_path / "t.jinja").write_text("{% for m in messages %}{{ m['content'] }} {% endfor %}", encoding="utf-8")
    tok = build_tokenizer("Null_Tokenizer", vocab_size=10, chat_template=str(tmp_path / "t.jinja"))
    assert isinstance(tok, NullTokenizer) and tok.eod == 9
    text = tok.apply_chat_template([{"role": "user", "content": "1 2"}, {"role": "assistant", "content": "3"}])
    assert tok.tokenize(text) == [1, 2, 3]
    with pytest.raises(FileNotFoundError, match="chat_template file"):
        build_tokenizer("null", vocab_size=10, chat_template=str(tmp_path / "missing.jinja"))


def test_build_llama_sentencepiece_model() -> None:
    tok = build_tokenizer("SentencePieceTokenizer", tokenizer_model=LLAMA_MODEL)
    assert isinstance(tok, SentencePieceTokenizer) and (tok.vocab_size, tok.eod) == (32000, 2)
    text = next(iter(_works(2).values()))[:20_000]
    assert tok.detokenize(tok.tokenize(text)) == text
    assert tok.tokenize_batch([text, "Hello"]) == [tok.tokenize(text), tok.tokenize("Hello")]
    assert pickle.loads(pickle.dumps(tok)).tokenize(text) == tok.tokenize(text)
    # chat templates print the model's own BOS/EOS pieces
    assert (tok.bos_token, tok.eos_token) == ("<s>", "</s>")
    rendered = tok.apply_chat_template(
        CHAT[1:], chat_template="{{ bos_token }}[INST] {{ messages[0]['content'] }} [/INST]{{ eos_token }}"
    )
    assert rendered == "<s>[INST] To be? [/INST]</s>"
