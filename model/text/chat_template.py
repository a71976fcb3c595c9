"""Renders a checkpoint's Jinja chat template into the prompt text the model was trained on.

Owns: finding the template (GGUF metadata, `chat_template.jinja`, `tokenizer_config.json`) and
rendering it the way `transformers.apply_chat_template` does, so prompts match byte for byte.
Must never run a template outside the immutable sandbox: templates ship with checkpoints and are
untrusted code. Must never let text from the messages become a control token (`prompt_ids`).
Every template failure surfaces as `ChatTemplateError` (a bad request when the messages caused
it, e.g. a template's `raise_exception("roles must alternate")`).
"""

import json
from collections.abc import Callable
from datetime import datetime
from pathlib import Path
from typing import Any, NoReturn

import jinja2
from jinja2 import meta, nodes
from jinja2.ext import Extension, loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment

from model.text.control_tokens import chat_prompt_ids
from model.text.tokenizer import Tokenizer


class ChatTemplateError(ValueError):
    """A template that does not compile, or that refused or failed to render these messages."""


def _raise_exception(message: str) -> NoReturn:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    # Jinja's own tojson escapes <, >, & and ' for HTML; templates expect plain JSON.
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(format: str) -> str:
    return datetime.now().strftime(format)


class _GenerationTag(Extension):
    """`{% generation %}...{% endgeneration %}` marks assistant text for training-time loss masks;
    when serving it only renders its body."""

    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return nodes.CallBlock(self.call_method("_render"), [], [], body).set_lineno(lineno)

    def _render(self, caller: Callable[[], str]) -> str:
        return caller()


class ChatTemplate:
    def __init__(self, template: str, bos_token: str = "", eos_token: str = "") -> None:
        self.source = template
        self.bos_token, self.eos_token = bos_token, eos_token
        # trim_blocks/lstrip_blocks and these globals are what transformers renders with;
        # templates are written against that environment.
        env = ImmutableSandboxedEnvironment(
            trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationTag, loopcontrols]
        )
        env.filters["tojson"] = _tojson
        env.globals["raise_exception"] = _raise_exception
        env.globals["strftime_now"] = _strftime_now
        try:
            self._template = env.from_string(template)
            self._variables = frozenset(meta.find_undeclared_variables(env.parse(template)))
        except jinja2.TemplateSyntaxError as exc:
            raise ChatTemplateError(
                f"chat template does not compile (line {exc.lineno}): {exc.message}"
            ) from None

    def reads(self, variable: str) -> bool:
        """Whether the template reads this variable at all (e.g. `tools`): a template that
        never mentions it would drop what is passed in silently."""
        return variable in self._variables

    def render(
        self, messages: list[dict[str, Any]], add_generation_prompt: bool = True, **kwargs: Any
    ) -> str:
        """`kwargs` reach the template as variables (e.g. `tools`, `enable_thinking`)."""
        # tools/documents default to None, not undefined: templates test `tools is not none`.
        context = {"bos_token": self.bos_token, "eos_token": self.eos_token}
        context = {**context, "tools": None, "documents": None, **kwargs}
        try:
            return self._template.render(
                messages=messages, add_generation_prompt=add_generation_prompt, **context
            )
        except jinja2.TemplateError as exc:
            raise ChatTemplateError(f"chat template failed: {exc.message or exc}") from None
        except (TypeError, ValueError, LookupError, AttributeError) as exc:
            raise ChatTemplateError(f"chat template failed on these messages: {exc!r}") from None

    def prompt_ids(
        self,
        messages: list[dict[str, Any]],
        tokenizer: Tokenizer,
        add_generation_prompt: bool = True,
        **kwargs: Any,
    ) -> list[int]:
        """The rendered prompt as token ids. Templates write BOS themselves where the model wants
        it, so the tokenizer adds none (a second BOS is what `encode`'s default would give a
        Llama 3 prompt). Special-token text the template writes is a control token; the same
        text inside the messages or `kwargs` is the client's and stays plain text, unlike
        transformers, where a user could forge a turn (control_tokens.py)."""

        def render(messages: list[dict[str, Any]], variables: dict[str, Any]) -> str:
            return self.render(messages, add_generation_prompt, **variables)

        return chat_prompt_ids(render, messages, kwargs, tokenizer, self.source)

    @classmethod
    def for_tokenizer(cls, template: str, tokenizer: Tokenizer) -> "ChatTemplate":
        def text(token_id: int | None) -> str:
            return "" if token_id is None else tokenizer.decode([token_id])

        return cls(template, bos_token=text(tokenizer.bos_id), eos_token=text(tokenizer.eos_id))

    @classmethod
    def from_gguf_metadata(
        cls, metadata: dict[str, Any], tokenizer: Tokenizer
    ) -> "ChatTemplate | None":
        template = metadata.get("tokenizer.chat_template")
        return cls.for_tokenizer(template, tokenizer) if template else None

    @classmethod
    def from_hf_dir(cls, path: str | Path, tokenizer: Tokenizer) -> "ChatTemplate | None":
        """A `chat_template.jinja` file wins over `tokenizer_config.json`, as in transformers."""
        path = Path(path)
        template = None
        if (path / "chat_template.jinja").is_file():
            template = (path / "chat_template.jinja").read_text(encoding="utf-8")
        elif (path / "tokenizer_config.json").is_file():
            config = json.loads((path / "tokenizer_config.json").read_text(encoding="utf-8"))
            template = config.get("chat_template")
            if isinstance(template, list):
                # Named templates ({"name", "template"}); the one for plain chat is "default".
                named = {entry["name"]: entry["template"] for entry in template}
                if "default" not in named:
                    raise ChatTemplateError(f"{path} has named chat templates but no 'default'")
                template = named["default"]
        return cls.for_tokenizer(template, tokenizer) if template else None
