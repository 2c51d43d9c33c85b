"""Chat templates: Jinja2 rendered in a sandbox the way Hugging Face's ``apply_chat_template`` does."""

from __future__ import annotations

import functools
import json
from collections.abc import Mapping, Sequence
from datetime import datetime
from typing import Any, NoReturn

import jinja2
from jinja2.ext import loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment

# ChatML: what most open chat models use; for tokenizers whose model files carry no template
DEFAULT_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
"""ChatML: ``<|im_start|>{role}\\n{content}<|im_end|>\\n`` per message; ``<|im_start|>assistant\\n`` prompts."""


class ChatTemplateError(ValueError):
    """A chat template failed to compile or render, or called ``raise_exception``."""


def _raise_exception(message: str) -> NoReturn:
    """Templates call ``raise_exception(msg)`` to reject a conversation (HF convention)."""
    raise ChatTemplateError(message)


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    """HF's ``tojson``: plain JSON (Jinja's built-in one HTML-escapes, which would change the prompt text)."""
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    """HF's ``strftime_now`` global (Llama 3 templates print today's date)."""
    return datetime.now().strftime(fmt)


@functools.lru_cache(maxsize=32)
def _compile(template: str) -> jinja2.Template:
    """Compile once per template string: data pipelines render thousands of conversations."""
    # the same environment settings as transformers, so model templates render identically
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    try:
        return env.from_string(template)
    except jinja2.TemplateSyntaxError as err:
        raise ChatTemplateError(
            f"chat template does not compile (line {err.lineno}: {err.message}); fix the Jinja2 syntax of the template"
        ) from err


def render_chat_template(
    template: str,
    messages: Sequence[Mapping[str, Any]],
    *,
    add_generation_prompt: bool = False,
    bos_token: str | None = None,
    eos_token: str | None = None,
) -> str:
    """Render ``messages`` with ``template``; missing special tokens render as empty strings."""
    if isinstance(messages, (str, bytes)) or not isinstance(messages, Sequence):
        raise TypeError(f"messages must be a list of dicts with 'role' and 'content', got {type(messages).__name__}")
    for index, message in enumerate(messages):
        if not isinstance(message, Mapping) or "role" not in message or "content" not in message:
            raise ValueError(f"messages[{index}] = {message!r} must be a dict with 'role' and 'content' keys")
    try:
        return _compile(template).render(
            messages=[dict(m) for m in messages],
            add_generation_prompt=bool(add_generation_prompt),
            bos_token=bos_token or "",
            eos_token=eos_token or "",
        )
    except ChatTemplateError:
        raise
    except jinja2.TemplateError as err:
        raise ChatTemplateError(
            f"chat template failed to render: {err}; check the template against the messages"
        ) from err
