"""The Llama 3 chat format, token for token as Meta's reference `ChatFormat` builds it, for
Llama 3 checkpoints that carry no Jinja template (Meta's own layout never does).

Owns turning chat messages into Llama 3 prompt ids: `<|begin_of_text|>`, then per message a
header (`<|start_header_id|>role<|end_header_id|>` and "\\n\\n"), the content, `<|eot_id|>`,
then the assistant header that the model completes. Must never render message text with
special tokens allowed: content is encoded as plain text, so a user cannot inject a control token.
"""

from typing import Any

from model.text.chat_template import ChatTemplate, ChatTemplateError
from model.text.tokenizer import Tokenizer

_ROLES = ("system", "user", "assistant", "tool", "ipython")
_REQUIRED_TOKENS = (
    "<|begin_of_text|>",
    "<|start_header_id|>",
    "<|end_header_id|>",
    "<|eot_id|>",
)
# The same prompt as text; it tokenizes differently only where content starts with whitespace
# that would merge with the header's "\n\n" (Meta encodes header and content separately), so
# `prompt_ids` is what the model gets.
LLAMA3_CHAT_TEMPLATE = (
    "{{- bos_token -}}"
    "{%- for message in messages -%}"
    "{{- '<|start_header_id|>' + ('ipython' if message.role == 'tool' else message.role)"
    " + '<|end_header_id|>\\n\\n' -}}"
    "{%- if message.content is string -%}{{- message.content -}}"
    "{%- elif message.content is not none -%}"
    "{%- for part in message.content -%}{{- part.text -}}{%- endfor -%}"
    "{%- endif -%}"
    "{{- '<|eot_id|>' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}"
    "{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' -}}"
    "{%- endif -%}"
)


def _header_role(message: dict[str, Any]) -> str:
    role = message.get("role")
    if role not in _ROLES:
        raise ChatTemplateError(
            f"message role {role!r} is not one of {', '.join(_ROLES)} (Llama 3 chat format)"
        )
    if message.get("tool_calls"):
        raise ChatTemplateError("the built-in Llama 3 chat format does not render tool_calls")
    # Meta's format names the tool-output turn "ipython".
    return "ipython" if role == "tool" else role


def _content_texts(message: dict[str, Any]) -> list[str]:
    """Meta encodes each text part of a message on its own and concatenates the ids."""
    content = message.get("content")
    if content is None or isinstance(content, str):
        return [content or ""]
    if not isinstance(content, list):
        raise ChatTemplateError(f"message content must be a string or a list of parts: {content!r}")
    texts = []
    for part in content:
        if not isinstance(part, dict) or part.get("type") != "text":
            kind = part.get("type") if isinstance(part, dict) else type(part).__name__
            raise ChatTemplateError(f"content part of type {kind!r} is not supported (text only)")
        texts.append(str(part.get("text", "")))
    return texts


class Llama3ChatFormat(ChatTemplate):
    def __init__(self) -> None:
        super().__init__(
            LLAMA3_CHAT_TEMPLATE, bos_token="<|begin_of_text|>", eos_token="<|end_of_text|>"
        )

    def render(
        self, messages: list[dict[str, Any]], add_generation_prompt: bool = True, **kwargs: Any
    ) -> str:
        _check(messages, kwargs)
        return super().render(messages, add_generation_prompt, **kwargs)

    def prompt_ids(
        self,
        messages: list[dict[str, Any]],
        tokenizer: Tokenizer,
        add_generation_prompt: bool = True,
        **kwargs: Any,
    ) -> list[int]:
        _check(messages, kwargs)
        try:
            bos, start, end, eot = (tokenizer.special_tokens[t] for t in _REQUIRED_TOKENS)
        except KeyError as exc:
            raise ChatTemplateError(f"the tokenizer has no Llama 3 special token {exc}") from None
        newlines = tokenizer.encode("\n\n", add_bos=False)

        def header(role: str) -> list[int]:
            return [start, *tokenizer.encode(role, add_bos=False), end, *newlines]

        ids = [bos]
        for message in messages:
            ids += header(_header_role(message))
            for text in _content_texts(message):
                ids += tokenizer.encode(text, add_bos=False)
            ids.append(eot)
        if add_generation_prompt:
            ids += header("assistant")
        return ids


def _check(messages: list[dict[str, Any]], kwargs: dict[str, Any]) -> None:
    for name in ("tools", "documents"):
        if kwargs.get(name):
            raise ChatTemplateError(f"the built-in Llama 3 chat format does not render {name}")
    for message in messages:
        _header_role(message)
        _content_texts(message)


def llama3_chat_format(tokenizer: Tokenizer) -> Llama3ChatFormat | None:
    """Meta's format for a tokenizer with the Llama 3 special tokens, else None."""
    if all(t in tokenizer.special_tokens for t in _REQUIRED_TOKENS):
        return Llama3ChatFormat()
    return None
