"""One line for a mistake on the ``megatron-lite fit/validate/test/predict`` command line or in its YAML.

jsonargparse reports a bad option after the whole usage (some 66 lines), as a nested report: every subtype of a
Union it tried, the value it was given, the error of each. :func:`explain_parse_error` finds the error that
matters in that report and says it in one line, with a "did you mean" for a misspelled option or class name.
Anything it does not recognise is passed on as jsonargparse's innermost line, still one line.
"""

from __future__ import annotations

import difflib
import importlib
import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Optional

_PARSER_KEY = re.compile(r'^Parser key "(?P<key>[^"]+)":\s*(?P<error>.*)$')
_CLASS_PATH = re.compile(r"^Problem with given class_path '(?P<class_path>[^']+)':$")
_STRUCTURE = re.compile(
    r"^(Does not validate against any of the Union subtypes|Errors:|Given value type: |"
    r"Given value: )"
)
_SUBTYPES = re.compile(r"^Subtypes: (?P<subtypes>.*)$")
# the alternatives of a Union that the user did not mean: a config file path, None, or a plain string
_OTHER_ALTERNATIVE = re.compile(
    r"^(Expected a path but .* either not accessible or invalid|"
    r"Expected a <class '(NoneType|str)'>)$"
)
_UNRECOGNIZED = re.compile(r"^unrecognized arguments: --(?P<name>[^\s=]+)")
# an unknown option from the command line or from a YAML file (the last: "Subcommand 'fit' does not accept option
# 'trainer.max_stepz'", "Group 'optimizer' does not accept option 'lrr'")
_NOT_ACCEPTED = re.compile(
    r"^(Option '(?P<name>[^']+)' is not accepted|Subcommand '\w+' does not accept option "
    r"'(?P<top>[^']+)'|Group '(?P<group>[^']+)' does not accept option '(?P<member>[^']+)')$"
)
_WRONG_TYPE = re.compile(r"^Expected a <class '(?P<type>[^']+)'>\. Got value: (?P<value>.*)$")
_NOT_A_CLASS = re.compile(r"^Expected a dot import path string: (?P<value>.+)$")
_NO_ATTRIBUTE = re.compile(r"^module '(?P<module>[^']+)' has no attribute '(?P<name>[^']+)'$")
_CLASS_NAME = re.compile(r"<class '([\w.]+)'>|\[([\w.]+)\]")


@dataclass
class _Error:
    """One innermost error of the report and where it sits."""

    keys: tuple[str, ...]
    """The parser keys around it, from the outside in (those inside a class are relative to it)."""
    class_path: Optional[str]
    """The class whose arguments were being parsed, if any."""
    subtypes: Optional[str]
    """The Union's subtypes jsonargparse listed around it, if any (as text)."""
    text: str
    """The error itself."""

    @property
    def option(self) -> str:
        """The option as given on the command line: ``--model.optimizer.lr``."""
        return "--" + ".".join(self.keys)


def explain_parse_error(message: str, known_options: Callable[[], Iterable[str]]) -> str:
    """The one line that matters in jsonargparse's error ``message``; ``known_options`` gives the parser's own
    keys (``trainer.max_steps``, ...), for a "did you mean" about a misspelled one."""
    errors = _errors(message)
    wanted = [e for e in errors if not _OTHER_ALTERNATIVE.match(e.text)] or errors
    if not wanted:
        return message.strip().splitlines()[0] if message.strip() else "invalid arguments"
    error = wanted[0]
    if (match := _UNRECOGNIZED.match(error.text) or _NOT_ACCEPTED.match(error.text)) is not None:
        groups = match.groupdict()
        name = groups["name"] or groups.get("top") or f"{groups.get('group')}.{groups.get('member')}"
        keys = (*error.keys, name)
        if error.class_path is not None:  # an argument of a class given by class_path
            prefix = ".".join(error.keys)
            candidates = [f"{prefix}.{k}" if prefix else k for k in _class_options(error.class_path)]
            where = f": {_short(error.class_path)} has no such argument"
        else:
            candidates, where = list(known_options()), ""
        return f"unknown option --{'.'.join(keys)}{where}{_did_you_mean('.'.join(keys), candidates, '--')}"
    if (match := _WRONG_TYPE.match(error.text)) is not None:
        return f"{error.option} expects {_article(match['type'])} {match['type']}, got {match['value']!r}"
    if (match := _NOT_A_CLASS.match(error.text)) is not None:
        value = match["value"]
        names = _subclass_names(error.subtypes or "")
        return (
            f"{error.option}: {value} is neither a known class name nor an import path"
            f"{_did_you_mean(value, names)}; give the class's import path, e.g. package.module.ClassName"
        )
    if (match := _NO_ATTRIBUTE.match(error.text)) is not None:
        module, name = match["module"], match["name"]
        try:
            names = [n for n in dir(importlib.import_module(module)) if not n.startswith("_")]
        except Exception:  # noqa: BLE001 - a suggestion only: none rather than another error
            names = []
        return f"{error.option}: {module} has no {name}{_did_you_mean(name, names, module + '.')}"
    return f"{error.option}: {error.text}" if error.keys else error.text


def _errors(message: str) -> list[_Error]:
    """The innermost errors of jsonargparse's indented report, each with the keys and class around it."""
    frames: list[dict] = []  # {"indent", "key" | "class_path", "subtypes"}, outermost first
    errors = []
    for raw in message.splitlines():
        line = raw.strip()
        if not line:
            continue
        indent = len(raw) - len(raw.lstrip())
        while frames and frames[-1]["indent"] >= indent:
            frames.pop()
        line = line[2:] if line.startswith("- ") else line
        if (match := _PARSER_KEY.match(line)) is not None:
            frames.append({"indent": indent, "key": match["key"]})
            if match["error"]:  # the key's error on the same line
                errors.append(_Error(tuple(f["key"] for f in frames if "key" in f), None, None, match["error"]))
        elif (match := _CLASS_PATH.match(line)) is not None:
            frames.append({"indent": indent, "class_path": match["class_path"]})
        elif (match := _SUBTYPES.match(line)) is not None:
            if frames:
                frames[-1]["subtypes"] = match["subtypes"]
        elif not _STRUCTURE.match(line):
            class_path = next((f["class_path"] for f in reversed(frames) if "class_path" in f), None)
            subtypes = next((f["subtypes"] for f in reversed(frames) if "subtypes" in f), None)
            errors.append(_Error(tuple(f["key"] for f in frames if "key" in f), class_path, subtypes, line))
    return errors


def _class_options(class_path: str) -> list[str]:
    """The arguments (``optimizer.lr``, ...) jsonargparse accepts for the class at ``class_path``."""
    from jsonargparse import ArgumentParser

    try:
        module, _, name = class_path.rpartition(".")
        parser = ArgumentParser(exit_on_error=False)
        parser.add_class_arguments(getattr(importlib.import_module(module), name))
        return list(parser.get_defaults().keys())
    except Exception:  # noqa: BLE001 - a suggestion only: none rather than another error
        return []


def _subclass_names(subtypes: str) -> list[str]:
    """Names of the loaded subclasses of the classes in jsonargparse's ``Subtypes: [...]`` text: the short
    names it accepts for a class (``ModelCheckpoint`` for a callback)."""
    names: set[str] = set()
    for match in _CLASS_NAME.finditer(subtypes):
        module, _, name = (match[1] or match[2]).rpartition(".")
        try:
            base = getattr(importlib.import_module(module), name)
        except Exception:  # noqa: BLE001 - builtins, typing names: no subclasses to offer
            continue
        pending = list(base.__subclasses__()) if isinstance(base, type) else []
        while pending:
            cls = pending.pop()
            if not cls.__name__.startswith("_"):
                names.add(cls.__name__)
            pending.extend(cls.__subclasses__())
    return sorted(names)


def _did_you_mean(word: str, candidates: Iterable[str], prefix: str = "") -> str:
    """`` (did you mean <prefix><closest>?)``, or nothing when no candidate is close. A misspelled first part of
    a dotted key (``modle.config.x``) is matched on its own and the rest kept."""
    candidates = list(candidates)
    head, _, rest = word.partition(".")
    heads = {c.partition(".")[0] for c in candidates}
    if rest and head not in heads:  # the misspelling is in the first part: keep what follows it
        close = [f"{h}.{rest}" for h in difflib.get_close_matches(head, heads, n=1, cutoff=0.6)]
    else:
        close = difflib.get_close_matches(word, candidates, n=1, cutoff=0.6)
    return f" (did you mean {prefix}{close[0]}?)" if close else ""


def _short(class_path: str) -> str:
    return class_path.rpartition(".")[2]


def _article(noun: str) -> str:
    return "an" if noun[:1].lower() in "aeiou" else "a"
