"""The documentation site builds with ``mkdocs build --strict`` (what ``make docs`` runs), and the strict build
really fails on a broken link: to a page, to an anchor, or to a repository file outside docs/."""

import logging
import shutil
from pathlib import Path

import pytest
from mkdocs.commands.build import build
from mkdocs.config import load_config
from mkdocs.exceptions import Abort

REPO = Path(__file__).resolve().parents[2]


def _build(site_dir: Path, **overrides) -> None:
    config = load_config(str(REPO / "mkdocs.yml"), site_dir=str(site_dir), **overrides)
    assert config.strict, "mkdocs.yml must set strict: true (make docs and this test rely on it)"
    build(config)


@pytest.fixture(autouse=True)
def _quiet_material(monkeypatch):
    monkeypatch.setenv("NO_MKDOCS_2_WARNING", "1")  # Material's end-of-life banner


def test_site_builds_strictly(tmp_path):
    _build(tmp_path / "site")
    site = tmp_path / "site"
    home = (site / "index.html").read_text()
    assert "make demo" in home and "make test" in home  # the README is the home page
    assert (site / "checkpoint-format" / "index.html").is_file() and (site / "reliability" / "index.html").is_file()
    assert "fonts.googleapis.com" not in home  # nothing is fetched from the network when the site is read


def test_strict_build_fails_on_broken_links(tmp_path, caplog):
    docs = tmp_path / "docs"
    shutil.copytree(REPO / "docs", docs, ignore=shutil.ignore_patterns("__pycache__"))
    page = docs / "checkpoint-format.md"
    page.write_text(
        page.read_text() + "\nSee [a](no-such-page.md), [b](reliability.md#no-such-heading) "
        "and [c](../examples/no_such_example.py).\n"
    )
    with caplog.at_level(logging.WARNING, logger="mkdocs"), pytest.raises(Abort, match="strict mode"):
        _build(tmp_path / "site", docs_dir=str(docs))
    warnings = "\n".join(r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING)
    assert "no-such-page.md" in warnings
    assert "no-such-heading" in warnings
    assert "../examples/no_such_example.py" in warnings
