"""The code blocks of README.md and docs/*.md, as the docs tests run them.

Every ```python block is run, and every ``megatron-lite ...`` / ``python -m megatron_lite ...`` /
``python examples/...`` command of a ```bash block (or a ``$ ``-prompted line of a ```console block),
unless an HTML comment on the line before the block says otherwise (invisible on GitHub and on the site):

    <!-- not-run: the reason -->              the block is not run; the reason is required
    <!-- run-with: OLD => NEW -->             text replaced before running, at test sizes; each OLD must
    <!-- run-with:                            occur in the block, so a replacement cannot go stale
    max_steps=800 => max_steps=2
    -->

Python blocks run in page order in one namespace per page (a later block may use an earlier one's names),
which starts with ``import lightning as L`` and ``import megatron_lite as ml``, in a working directory
holding the files the pages name (:mod:`docs_workspace`). Commands run in page order in a working
directory of their own per page. Optional ``[...]`` parts of a command are run with the rest.
"""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
RUN_LANGUAGES = ("python", "bash", "console")
_FENCE = re.compile(r"^(?P<indent>[ \t]*)```(?P<lang>[\w+-]*)[ \t]*$")
_MARKER = re.compile(r"<!--\s*(?P<kind>[\w-]+):(?P<body>.*?)-->", re.DOTALL)
_COMMAND = re.compile(r"^((megatron-lite|python -m megatron_lite)(\s|$)|python examples/\S)")


def doc_pages() -> list[Path]:
    """The Markdown a user reads: the README and every page of docs/."""
    return [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]


@dataclass
class Block:
    """One fenced code block of a page, with what its marker says."""

    page: str  # repository-relative path
    line: int  # 1-based line of the opening fence
    lang: str
    code: str  # as shown
    not_run: str | None = None
    replacements: list[tuple[str, str]] = field(default_factory=list)

    @property
    def where(self) -> str:
        return f"{self.page}:{self.line}"

    def code_to_run(self) -> str:
        """The code with the marker's replacements made; a replacement whose text is not there fails."""
        code = self.code
        for old, new in self.replacements:
            if old not in code:
                raise ValueError(f"{self.where}: run-with replaces {old!r}, which the block does not contain")
            code = code.replace(old, new)
        return code

    def commands(self) -> list[list[str]]:
        """The megatron-lite / python examples commands of a bash or console block, as argv lists."""
        if self.lang not in ("bash", "console"):
            return []
        lines, current = [], ""
        for raw in self.code_to_run().splitlines():
            if self.lang == "console":
                if not current and not raw.startswith("$ "):
                    continue  # output shown after a command
                raw = raw[2:] if not current else raw
            current += raw.rstrip()
            if current.endswith("\\"):
                current = current[:-1] + " "
                continue
            lines.append(current.strip())
            current = ""
        commands = []
        for line in lines:
            if not _COMMAND.match(line):
                continue
            commands.append(_without_brackets(shlex.split(line, comments=True)))
        return commands


def _without_brackets(argv: list[str]) -> list[str]:
    """The options of ``[--opt value]`` groups kept, their brackets dropped; ``[a, b]`` list values kept."""
    out, in_group = [], False
    for arg in argv:
        if not in_group and arg.startswith("[-"):
            in_group, arg = True, arg[1:]
        if in_group and arg.endswith("]"):
            in_group, arg = False, arg[:-1]
        out.append(arg)
    return out


def _marker(comment: str, where: str) -> tuple[str | None, list[tuple[str, str]]]:
    match = _MARKER.fullmatch(comment.strip())
    if match is None:
        raise ValueError(
            f"{where}: a comment before a code block must be <!-- not-run: reason --> or "
            f"<!-- run-with: OLD => NEW -->, got {comment.strip()[:80]!r}"
        )
    kind, body = match.group("kind"), match.group("body").strip()
    if kind == "not-run":
        if not body:
            raise ValueError(f"{where}: <!-- not-run: --> needs the reason the block cannot run here")
        return body, []
    if kind == "run-with":
        pairs = []
        for line in body.splitlines():
            if not line.strip():
                continue
            if " => " not in line:
                raise ValueError(f"{where}: run-with line {line.strip()!r} is not 'OLD => NEW'")
            old, new = line.strip().split(" => ", 1)
            pairs.append((old, new))
        if not pairs:
            raise ValueError(f"{where}: <!-- run-with: --> without a replacement")
        return None, pairs
    raise ValueError(f"{where}: unknown marker <!-- {kind}: -->; use not-run or run-with")


def parse_page(path: Path) -> list[Block]:
    """The fenced blocks of one page, each with the marker on the lines before it."""
    text = path.read_text(encoding="utf-8")
    lines = text.splitlines()
    page = path.resolve().relative_to(REPO).as_posix() if path.resolve().is_relative_to(REPO) else path.name
    blocks, i = [], 0
    while i < len(lines):
        fence = _FENCE.match(lines[i])
        if fence is None:  # outside a block, every fence opens one (a block is skipped to its closing fence)
            i += 1
            continue
        indent, lang, start = fence.group("indent"), fence.group("lang"), i
        end = next((j for j in range(i + 1, len(lines)) if lines[j].strip() == "```"), None)
        if end is None:
            raise ValueError(f"{page}:{start + 1}: a code block that is never closed")
        code = "\n".join(line[len(indent) :] if line.startswith(indent) else line for line in lines[start + 1 : end])
        comment = _comment_before(lines, start)
        not_run, replacements = _marker(comment, f"{page}:{start + 1}") if comment is not None else (None, [])
        blocks.append(Block(page, start + 1, lang, code + "\n", not_run, replacements))
        i = end + 1
    return blocks


def _comment_before(lines: list[str], start: int) -> str | None:
    """The HTML comment ending on the line right before the fence, if any."""
    j = start - 1
    if j < 0 or not lines[j].rstrip().endswith("-->"):
        return None
    while j >= 0 and "<!--" not in lines[j]:
        j -= 1
    return "\n".join(lines[j:start]) if j >= 0 else None


def all_blocks() -> list[Block]:
    return [block for page in doc_pages() for block in parse_page(page)]


def runnable_python(blocks: list[Block]) -> list[Block]:
    return [b for b in blocks if b.lang == "python" and b.not_run is None]


def runnable_commands(blocks: list[Block]) -> list[tuple[Block, list[str]]]:
    return [(b, argv) for b in blocks if b.not_run is None for argv in b.commands()]


def forked(code: str) -> str:
    """Ranks forked from the test process, as in a notebook: the default 'popen' launcher would re-run the
    test process's command line (pytest) once per rank. A one-process fit is left as it is: it runs in the
    calling process, as it does in a script."""
    if "start_method" not in code:
        code = code.replace("MegatronStrategy(", 'MegatronStrategy(start_method="fork", ')
    if re.search(r"devices=([2-9]|[1-9][0-9]+)\b", code):
        code = re.sub(r"""strategy=(["'])megatron\1""", 'strategy="megatron_fork"', code)
    return code


def run_python(blocks: list[Block]) -> None:
    """One page's runnable Python blocks in order, in one namespace, in the current directory; a failing block
    raises an AssertionError naming its page and line (the traceback's lines are the page's own)."""
    namespace = {"__name__": "__docs__"}
    exec("import lightning as L\nimport megatron_lite as ml", namespace)
    for block in runnable_python(blocks):
        code = "\n" * block.line + forked(block.code_to_run())
        try:
            exec(compile(code, block.page, "exec"), namespace)
        except Exception as exc:
            raise AssertionError(f"the snippet at {block.where} fails: {type(exc).__name__}: {exc}") from exc
