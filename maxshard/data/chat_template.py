"""Chat templates: jinja2 programs that turn a conversation into the text a model was trained on.

A Hugging Face model ships its template as `chat_template` in `tokenizer_config.json` (or as `chat_template.jinja`
beside it, as transformers 5 saves it). transformers renders it with jinja2, and so does this module, in the same
environment, so the text is the one `tokenizer.apply_chat_template(messages, tokenize=False)` gives:

- a sandboxed environment (`ImmutableSandboxedEnvironment`): a template cannot reach Python objects or mutate
  its inputs; `trim_blocks` and `lstrip_blocks` on (the whitespace rules template authors write for);
- `raise_exception(message)` (templates refuse conversations they cannot render: a `TemplateError` here, which the
  pipeline turns into a skipped record), `strftime_now(format)`, a `tojson` filter that keeps non-ASCII text;
- the template's variables: `messages`, `add_generation_prompt`, `tools` (None unless a caller lists functions the
  model may call, as JSON schemas), and every special token of `tokenizer_config.json` (`bos_token`,
  `eos_token`, ...), as text;
- the `{% generation %} ... {% endgeneration %}` tag: its output is the text of an assistant turn, recorded as a
  character span (transformers' `return_assistant_tokens_mask`).

Templates without the generation tag (most published ones) get their assistant spans by rendering prefixes: the
text that assistant message i adds is render(messages[:i + 1]) minus render(messages[:i], add_generation_prompt=True),
without its trailing whitespace (the newline after an end-of-turn token formats the next turn). That is the
assistant's content plus the turn's end (`<|im_end|>`, `<|eot_id|>`, `</s>`): what the model must learn to write,
stop included, and what a template author marks with the generation tag. It needs each prefix to be a prefix of
the whole rendering; a template that rewrites earlier turns once later ones exist (some strip old reasoning) fails
that, and its conversations are skipped as "template not prefix-stable" rather than trained on wrong spans.

`DEFAULT_TEMPLATE` is maxshard's own, for tokenizers that ship none (byte-level, SentencePiece):

    <bos><|user|>\\nHello\\n<|assistant|>\\nHi!<eos>\\n

where <bos>/<eos> are the tokenizer's BOS and EOS ids, not text (see `chat.encode_conversation`).
"""

from __future__ import annotations

import datetime
import functools
import hashlib
import json
import re
from typing import Any

from maxshard.errors import ConfigError

__all__ = ["DEFAULT_TEMPLATE", "ChatTemplate", "TemplateError"]

DEFAULT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}<|{{ message['role'] }}|>\n"
    "{% if message['role'] == 'assistant' %}{% generation %}{{ message['content'] }}{{ eos_token }}"
    "{% endgeneration %}{% else %}{{ message['content'] }}{% endif %}{{ '\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)


_GENERATION_TAG = re.compile(r"{%-?\s*generation\s*-?%}")


class TemplateError(Exception):
    """A conversation the template cannot render (it raised, or it is not prefix-stable): a skipped record."""


def _raise_exception(message: str) -> None:
    raise TemplateError(message)


def _tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None, separators: Any = None,
            sort_keys: bool = False) -> str:
    """jinja2's own tojson escapes HTML characters; chat templates want the JSON text as it is."""
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.datetime.now().strftime(fmt)


@functools.cache
def _environment() -> Any:
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[_generation_extension()])
    env.filters["tojson"] = _tojson
    env.globals.update(raise_exception=_raise_exception, strftime_now=_strftime_now)
    return env


@functools.cache
def _generation_extension() -> type:
    """The `{% generation %}` tag: renders its body and records where that text starts and ends in the output.

    The body's offset is the length of everything rendered so far; the render loop (`ChatTemplate._render`) keeps
    that count in the context variable `_chunks` (a list of the pieces yielded so far)."""
    from jinja2 import nodes, pass_context
    from jinja2.ext import Extension

    class Generation(Extension):
        tags = {"generation"}

        def parse(self, parser: Any) -> Any:
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return nodes.CallBlock(self.call_method("_mark"), [], [], body).set_lineno(lineno)

        @pass_context
        def _mark(self, context: Any, caller: Any) -> str:
            text = caller()
            tracker = context.get("_tracker")
            if tracker is not None:
                start = sum(len(c) for c in tracker["chunks"])
                tracker["spans"].append((start, start + len(text)))
            return text

    return Generation


class ChatTemplate:
    """A compiled template, its name for logs, and the special tokens it sees as variables."""

    def __init__(self, source: str, name: str, special_tokens: dict[str, str]) -> None:
        self.source, self.name = source, name
        self.special_tokens = dict(special_tokens)
        self.has_generation_tag = _GENERATION_TAG.search(source) is not None
        try:
            self._template = _environment().from_string(source)
        except Exception as e:  # noqa: BLE001 - jinja2.TemplateSyntaxError and friends: a broken template
            raise ConfigError(f"chat_template: {name} is not a jinja2 template ({type(e).__name__}: {e})") from None

    def __getstate__(self) -> dict[str, Any]:
        """Pickled as its source (grain workers compile it again): a compiled template does not pickle."""
        return {"source": self.source, "name": self.name, "special_tokens": self.special_tokens}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(state["source"], state["name"], state["special_tokens"])  # type: ignore[misc]

    @property
    def digest(self) -> str:
        return hashlib.sha256(self.source.encode()).hexdigest()[:12]

    def render(self, messages: list[dict[str, Any]], add_generation_prompt: bool = False,
               tools: list[dict[str, Any]] | None = None) -> str:
        """The text `apply_chat_template(messages, tokenize=False, add_generation_prompt=..., tools=...)` gives
        (`tools`: JSON schemas of the functions the model may call, as the template lists them)."""
        return self._render(messages, add_generation_prompt, tools)[0]

    def render_with_spans(self, messages: list[dict[str, Any]]) -> tuple[str, list[tuple[int, int]]]:
        """The whole conversation's text and the character spans [start, end) of its assistant turns."""
        text, spans = self._render(messages, False)
        if self.has_generation_tag:
            return text, spans
        return text, self._prefix_spans(messages, text)

    def _render(self, messages: list[dict[str, Any]], add_generation_prompt: bool,
                tools: list[dict[str, Any]] | None = None) -> tuple[str, list[tuple[int, int]]]:
        tracker: dict[str, list[Any]] = {"chunks": [], "spans": []}
        variables = {**self.special_tokens, "messages": messages, "add_generation_prompt": add_generation_prompt,
                     "tools": tools, "_tracker": tracker}
        try:
            for chunk in self._template.generate(**variables):
                tracker["chunks"].append(chunk)
        except TemplateError:
            raise
        except Exception as e:  # noqa: BLE001 - any jinja2 or sandbox error renders nothing usable
            raise TemplateError(f"{type(e).__name__}: {e}") from None
        return "".join(tracker["chunks"]), tracker["spans"]

    def _prefix_spans(self, messages: list[dict[str, Any]], text: str) -> list[tuple[int, int]]:
        """Assistant spans by rendering prefixes (module docstring)."""
        spans = []
        for i, message in enumerate(messages):
            if message.get("role") != "assistant":
                continue
            before = self.render(messages[:i], add_generation_prompt=True) if i else ""
            upto = self.render(messages[: i + 1]).rstrip()
            if not (upto.startswith(before) and text.startswith(upto)):
                raise TemplateError("template not prefix-stable")
            if len(upto) > len(before):
                spans.append((len(before), len(upto)))
        return spans

