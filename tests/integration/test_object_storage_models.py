"""Models at ``s3://`` URLs (issue 28) against a real S3 server (moto's, in a subprocess on loopback): a tiny random
Hugging Face Llama put into the bucket loads with ``from_pretrained`` to the local directory's logits exactly;
``convert --from hf`` from the bucket into it, then ``generate`` (the greedy tokens of the local conversion, with
the tokenizer the checkpoint carries), ``checkpoint inspect``, ``prune`` with its checkpoint and output there, and
``convert --to hf`` back into the bucket, which ``from_pretrained`` loads to the same logits; an export into a
prefix that holds objects is refused without ``--overwrite`` and replaces it with. An export cut short (an error
while it is written: nothing uploaded; a kill mid-upload: no ``config.json``, uploaded last) is refused by
``from_pretrained`` naming what is missing, as is a PEFT adapter without its ``adapter_config.json``. ``Distill``
takes its teacher from a URL. CLI calls are in-process."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # before transformers is imported: never reach the hub
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE))
transformers = pytest.importorskip("transformers", reason="transformers is not installed (pip install -e '.[dev]')")

from s3_server import make_bucket, s3_environment, s3_server, skip_without_s3_tools  # noqa: E402
from test_hf_interop import VOCAB, _random_hf_model, _tokens  # noqa: E402

import megatron_lite as ml  # noqa: E402
from megatron_lite.callbacks import Distill, TrainDraftHead  # noqa: E402
from megatron_lite.cli import main as cli  # noqa: E402
from megatron_lite.core.models.draft_head import EagleDraftHead, base_fingerprint  # noqa: E402
from megatron_lite.core.object_staging import objects_under, published_directory  # noqa: E402
from megatron_lite.post_training.speculative import load_draft_head, save_draft_head  # noqa: E402

BUCKET = "models"
HF_URL = f"s3://{BUCKET}/llama"
CKPT_URL = f"s3://{BUCKET}/llama-ckpt"


@pytest.fixture(scope="module")
def s3(tmp_path_factory):
    """One server for the module, the AWS environment pointed at it, a bucket, and a cache of local copies of
    objects of the module's own."""
    skip_without_s3_tools()
    cache = tmp_path_factory.mktemp("xdg-cache")
    with s3_server() as endpoint, s3_environment(endpoint), pytest.MonkeyPatch.context() as patch:
        patch.setenv("XDG_CACHE_HOME", str(cache))
        make_bucket(BUCKET)
        yield endpoint


def _fs():
    import s3fs

    return s3fs.S3FileSystem(skip_instance_cache=True)


@pytest.fixture(scope="module")
def hf_dir(s3, tmp_path_factory) -> Path:
    """A tiny random HF Llama with a word-level tokenizer of its vocabulary on disk, and the same put at ``HF_URL``."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    directory = tmp_path_factory.mktemp("llama")
    _random_hf_model("llama_gqa_untied", seed=3).save_pretrained(directory)
    tokenizer = Tokenizer(models.WordLevel({f"w{i}": i for i in range(VOCAB)}, unk_token="w0"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps({"eos_token": "w1"}))
    _fs().put(f"{directory}/", HF_URL, recursive=True)
    return directory


def _cli(*argv: str) -> int:
    with pytest.raises(SystemExit) as done:
        cli([str(a) for a in argv])
    return done.value.code


def _logits(path) -> torch.Tensor:
    return ml.GPTModule.from_pretrained(path).full_logits(_tokens())


def test_an_hf_directory_at_a_url_loads_as_the_local_one(hf_dir):
    torch.testing.assert_close(_logits(HF_URL), _logits(hf_dir), rtol=0, atol=0)
    assert ml.GPTModule.from_pretrained(HF_URL).pretrained_source.path == HF_URL  # a LoRA run records the URL


def _generate(ckpt, capsys, *options: str) -> list[dict]:
    argv = ["generate", "--ckpt", ckpt, "--prompt", "w5 w17 w42", "--prompt", "w7", "--max-new-tokens", "5", "--json"]
    argv += options
    assert _cli(*argv) == 0
    return [json.loads(line) for line in capsys.readouterr().out.splitlines()]


def _inspect(ckpt, capsys) -> dict:
    assert _cli("checkpoint", "inspect", ckpt, "--json") == 0
    return json.loads(capsys.readouterr().out)


def test_convert_s3_to_s3_then_generate_inspect_prune_and_export_back(hf_dir, tmp_path, capsys):
    local = tmp_path / "ckpt"
    assert _cli("convert", "--from", "hf", "--input", hf_dir, "--output", local) == 0
    assert _cli("convert", "--from", "hf", "--input", HF_URL, "--output", CKPT_URL) == 0
    capsys.readouterr()
    torch.testing.assert_close(_logits(CKPT_URL), _logits(hf_dir), rtol=0, atol=0)  # our format, read natively

    # the tokenizer came along in the checkpoint's hf/ and is read from the store
    greedy = _generate(CKPT_URL, capsys)
    assert greedy == _generate(local, capsys)
    # a draft head file in the store (untrained: its proposals only change the speed) gives the same tokens
    base = ml.GPTModule.from_pretrained(CKPT_URL).model
    head = EagleDraftHead(base.config, seed=4)
    head.bind(base_fingerprint(base))
    save_draft_head(head, f"s3://{BUCKET}/draft.safetensors")
    assert [r["new_tokens"] for r in _generate(CKPT_URL, capsys, "--draft", f"s3://{BUCKET}/draft.safetensors")] == [
        r["new_tokens"] for r in greedy
    ]
    # a checkpoint in the store is read where it is (this one, of a plain model, has no draft head in it)
    with pytest.raises(
        ValueError, match=rf"{CKPT_URL}/v-[0-9a-f]+ holds no model tensors \(no 'model\.model\.draft_head"
    ):
        load_draft_head(CKPT_URL, base)

    remote, disk = _inspect(CKPT_URL, capsys), _inspect(local, capsys)
    assert remote["checksums"]["status"] == "ok" and remote["path"].startswith(f"{CKPT_URL}/v-")
    for key in ("files", "tensors", "model_parameters", "hyper_parameters"):  # meta.json differs: where it came from
        assert remote[key] == disk[key], key

    # pruned from the store into the store, as from disk to disk
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text(
        "".join(json.dumps({"text": " ".join(f"w{(7 * i + j) % VOCAB}" for i in range(40))}) + "\n" for j in range(4))
    )
    prune = ["--data", corpus, "--num-layers", "1", "--calib-batches", "1", "--eval-batches", "0"]
    prune += ["--batch-size", "2", "--seq-length", "16"]
    assert _cli("prune", "--ckpt", local, "--output", tmp_path / "pruned", *prune) == 0
    assert _cli("prune", "--ckpt", CKPT_URL, "--output", f"s3://{BUCKET}/pruned", *prune) == 0
    pruned = ml.GPTModule.from_pretrained(f"s3://{BUCKET}/pruned")
    assert pruned.config.num_layers == 1
    torch.testing.assert_close(pruned.full_logits(_tokens()), _logits(tmp_path / "pruned"), rtol=0, atol=0)

    export = f"s3://{BUCKET}/export"
    assert _cli("convert", "--to", "hf", "--input", CKPT_URL, "--output", export, "--tokenizer", HF_URL) == 0
    torch.testing.assert_close(_logits(export), _logits(hf_dir), rtol=0, atol=0)
    assert _fs().cat_file(f"{export}/tokenizer.json") == (hf_dir / "tokenizer.json").read_bytes()
    capsys.readouterr()
    assert _cli("convert", "--to", "hf", "--input", CKPT_URL, "--output", export) == 2
    assert f"--output {export} holds objects already; pass a new prefix, or --overwrite" in capsys.readouterr().err
    _fs().pipe_file(f"{export}/model-00001-of-00009.safetensors", b"left by an earlier export")
    assert _cli("convert", "--to", "hf", "--input", CKPT_URL, "--output", export, "--overwrite") == 2
    assert "holds model-00001-of-00009.safetensors, which megatron-lite did not write" in capsys.readouterr().err
    _fs().rm_file(f"{export}/model-00001-of-00009.safetensors")
    assert (
        _cli("convert", "--to", "hf", "--input", CKPT_URL, "--output", export, "--overwrite", "--dtype", "bfloat16")
        == 0
    )
    assert json.loads(_fs().cat_file(f"{export}/config.json"))["torch_dtype"] == "bfloat16"

    # a kill during the upload, after the weights and before config.json: no model there
    _fs().rm_file(f"{export}/config.json")
    with pytest.raises(FileNotFoundError, match=rf"{export} is neither a Hugging Face model directory \(no config"):
        ml.GPTModule.from_pretrained(export)


def test_an_export_that_fails_while_written_uploads_nothing(s3):
    url = f"s3://{BUCKET}/failed-export"
    with pytest.raises(RuntimeError, match="killed"), published_directory(url, last=("config.json",)) as folder:
        (Path(folder) / "model.safetensors").write_bytes(b"weights")
        raise RuntimeError("killed")
    assert objects_under(url) == {}
    with pytest.raises(FileNotFoundError, match=rf"{url} is neither a Hugging Face model directory"):
        ml.GPTModule.from_pretrained(url)


def test_teachers_and_draft_head_bases_at_urls(hf_dir):
    teacher = Distill(teacher=HF_URL).teacher
    torch.testing.assert_close(teacher.full_logits(_tokens()), _logits(hf_dir), rtol=0, atol=0)
    TrainDraftHead(base=HF_URL, save_path=f"s3://{BUCKET}/draft.safetensors")
    # a PEFT adapter whose upload was cut short before its adapter_config.json (uploaded last)
    _fs().pipe_file(f"s3://{BUCKET}/adapter/adapter_model.safetensors", b"partial")
    with pytest.raises(
        FileNotFoundError, match=rf"s3://{BUCKET}/adapter is not a PEFT adapter directory \(no adapter_"
    ):
        ml.GPTModule.from_pretrained(hf_dir, adapter=f"s3://{BUCKET}/adapter")
    with pytest.raises(FileNotFoundError, match=rf"s3://{BUCKET}/nothing is neither a Hugging Face model directory"):
        TrainDraftHead(base=f"s3://{BUCKET}/nothing")
