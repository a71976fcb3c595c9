"""The reasoning parsers a server can run (`--reasoning-parser`), named as vLLM names them,
and the one a chat template calls for when the flag leaves the choice to it.

`qwen3`: the model opens its think block itself (`<think>...</think>answer`); an output
with no `<think>` is all answer (Qwen3 with `enable_thinking: false` finds an empty think
block already in its prompt). `deepseek_r1`: the template ends the generation prompt with
`<think>\\n`, so the output begins inside the block and everything up to `</think>` is
reasoning, all of it when `</think>` never comes. `openai_gptoss` (vLLM's name for it):
gpt-oss's harmony format, where the `analysis` channel is reasoning and `final` the answer,
and tool calls are messages to `functions.NAME` (server/reasoning/harmony.py).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from model.text.chat_template import ChatTemplate, ChatTemplateError

logger = logging.getLogger("llamaserve.server")


@dataclass(frozen=True)
class ReasoningFormat:
    name: str
    starts_inside: bool  # the prompt has opened the think block already
    start_tag: str = "<think>"
    end_tag: str = "</think>"
    # Harmony's channels rather than a think block: the output is read with its special
    # tokens (`<|channel|>` ...), and the answer's calls come from the channels too.
    channels: bool = False


FORMATS = {
    "qwen3": ReasoningFormat("qwen3", starts_inside=False),
    "deepseek_r1": ReasoningFormat("deepseek_r1", starts_inside=True),
    "openai_gptoss": ReasoningFormat(
        "openai_gptoss",
        starts_inside=False,
        start_tag="<|channel|>analysis<|message|>",
        end_tag="<|end|>",
        channels=True,
    ),
}
HARMONY = FORMATS["openai_gptoss"]
CHOICES = ("auto", "none", *FORMATS)


def template_reasoning(template: ChatTemplate | None) -> ReasoningFormat | None:
    """The parser a chat template plainly calls for, or None when it is not plain.

    A template whose generation prompt ends in an open `<think>` makes the model start
    inside the block (DeepSeek-R1 and its distills, Qwen3's thinking-only 2507 models).
    One that never opens it but mentions both tags and `enable_thinking` leaves the model
    to open it (Qwen3). One that writes harmony's channels is gpt-oss's. Anything else, one
    tag without the other included, is not plain."""
    if template is not None and is_harmony(template):
        return HARMONY
    if template is None or "<think>" not in template.source:
        return None
    try:
        prompt = template.render([{"role": "user", "content": "x"}], add_generation_prompt=True)
    except ChatTemplateError:
        return None
    if prompt.rstrip().endswith("<think>"):
        return FORMATS["deepseek_r1"]
    if "</think>" in template.source and template.reads("enable_thinking"):
        return FORMATS["qwen3"]
    return None


def is_harmony(template: ChatTemplate) -> bool:
    """Whether the template writes harmony's messages (gpt-oss's): headers with channels."""
    source = template.source
    return all(tag in source for tag in ("<|start|>", "<|channel|>", "<|message|>", "analysis"))


def reasoning_format(flag: str, template: ChatTemplate | None) -> ReasoningFormat | None:
    """The parser `--reasoning-parser` asks for (`auto`: the template's, if plain)."""
    if flag == "none":
        chosen, why = None, "turned off"
    elif flag == "auto":
        chosen = template_reasoning(template)
        why = "picked from the chat template" if chosen else "the chat template names none"
    else:
        chosen, why = FORMATS[flag], "as asked"
    logger.info("reasoning parser: %s (%s)", chosen.name if chosen else "none", why)
    return chosen
