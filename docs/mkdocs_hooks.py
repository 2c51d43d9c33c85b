"""MkDocs hooks (``hooks:`` in mkdocs.yml): the README is the site's home page, and links to repository
files outside ``docs/`` are checked.

The pages are written to read well on GitHub too, where a link from ``docs/generation.md`` to
``../examples/demo.py`` (or from the README to ``examples/demo.py``) opens the file. The site has no such
files, so each link to one is checked here -- a missing file, or a missing heading on a Markdown file, is a
warning, which fails ``mkdocs build --strict`` like a broken link between pages -- and becomes a link to
``repo_url`` when mkdocs.yml sets one, else the path as code. Repository Markdown files listed in
``PAGES_FROM_REPO`` are pages of the site (the README is the home page), so links to them stay links.
"""

from __future__ import annotations

import logging
import posixpath
import re
from pathlib import Path

from mkdocs.structure.files import File
from pymdownx.slugs import slugify

log = logging.getLogger("mkdocs.hooks.repo_links")  # under "mkdocs": --strict counts its warnings

# repository file -> the site page it becomes
PAGES_FROM_REPO = {"README.md": "index.md", "benchmarks/README.md": "benchmark-results.md"}

_SLUG = slugify(case="lower")  # GitHub's heading anchors, so one link works on GitHub and on the site
_FENCE = re.compile(r"^[ \t]*(```|~~~).*?^[ \t]*\1[ \t]*$", re.MULTILINE | re.DOTALL)
# a code span (left as it is) or a link/image, whose text may hold code spans and one level of brackets
_SPAN_OR_LINK = re.compile(
    r"(?P<code>(?P<ticks>`+).+?(?P=ticks))"
    r"|(?P<text>!?\[(?:[^\[\]`]|`[^`]*`|\[[^\]]*\])*\])\((?P<target>[^()\s]+)\)",
    re.DOTALL,
)
_HEADING = re.compile(r"^#{1,6}\s+(.+?)\s*#*\s*$", re.MULTILINE)


def _repo_root(config) -> Path:
    return Path(config.config_file_path).resolve().parent


def on_files(files, config):
    root = _repo_root(config)
    for source, page in PAGES_FROM_REPO.items():
        files.append(File.generated(config, page, content=(root / source).read_text(encoding="utf-8")))
    return files


def _repo_path_of(page) -> str:
    """Where the page's Markdown lives in the repository."""
    source = {page_uri: repo for repo, page_uri in PAGES_FROM_REPO.items()}.get(page.file.src_uri)
    return source if source is not None else posixpath.join("docs", page.file.src_uri)


def _anchors(markdown: str) -> set[str]:
    text = _FENCE.sub("", markdown)
    return {_SLUG(re.sub(r"[`*_]", "", title), "-") for title in _HEADING.findall(text)}


def on_page_markdown(markdown: str, page, config, files):
    root = _repo_root(config)
    here = _repo_path_of(page)
    site_dir_of_page = posixpath.dirname(page.file.src_uri)
    pages_by_repo_path = {posixpath.join("docs", f.src_uri): f.src_uri for f in files}
    pages_by_repo_path.update({repo: uri for repo, uri in PAGES_FROM_REPO.items()})

    def rewrite(match: re.Match) -> str:
        if match.group("code"):
            return match.group(0)
        text, target = match.group("text"), match.group("target")
        if re.match(r"^[a-z][a-z0-9+.-]*:", target) or target.startswith(("#", "/")):
            return match.group(0)  # a URL, an anchor on this page, or a site-absolute path: mkdocs checks those
        path, _, anchor = target.partition("#")
        repo_path = posixpath.normpath(posixpath.join(posixpath.dirname(here), path))
        if repo_path in pages_by_repo_path:  # a page of the site: mkdocs checks the link and its anchor
            relative = posixpath.relpath(pages_by_repo_path[repo_path], site_dir_of_page or ".")
            return f"{text}({relative}{'#' + anchor if anchor else ''})"
        if repo_path.startswith("docs/"):  # inside docs/ but not a page (an image): mkdocs checks it
            relative = posixpath.relpath(repo_path[len("docs/") :], site_dir_of_page or ".")
            return f"{text}({relative}{'#' + anchor if anchor else ''})"
        file = root / repo_path
        if repo_path.startswith("..") or not file.exists():
            log.warning(f"{here} links to '{target}', which is not a file of the repository ({repo_path})")
        elif anchor and file.suffix == ".md" and anchor not in _anchors(file.read_text(encoding="utf-8")):
            log.warning(f"{here} links to '{target}', but {repo_path} has no heading with that anchor")
        if config.repo_url:
            kind = "tree" if file.is_dir() else "blob"
            return f"{text}({config.repo_url.rstrip('/')}/{kind}/main/{repo_path}{'#' + anchor if anchor else ''})"
        label = text[1:-1] if not text.startswith("!") else text[2:-1]
        return label if label.strip("`") == repo_path else f"{label} (`{repo_path}`)"

    out, last = [], 0  # fenced blocks are left as they are
    for fence in _FENCE.finditer(markdown):
        out += [_SPAN_OR_LINK.sub(rewrite, markdown[last : fence.start()]), fence.group(0)]
        last = fence.end()
    out.append(_SPAN_OR_LINK.sub(rewrite, markdown[last:]))
    return "".join(out)
