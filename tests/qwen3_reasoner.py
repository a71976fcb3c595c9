"""A tiny random Qwen3 that can think: `make_tiny`'s checkpoint (written by `transformers`)
with a tokenizer that knows Qwen3's markup (`<|im_start|>`, `<|im_end|>` as special
tokens; `<think>`, `</think>` as plain added tokens, as Qwen3's own tokenizer has them) and a
chat template modeled on Qwen3's: the think block of earlier turns dropped, tools in
<tools>, Hermes-style <tool_call>s, and `enable_thinking: false` writing an empty think
block into the generation prompt."""

# The template's lines stay as long as the checkpoint's own, so the two read alike.
# ruff: noqa: E501

import json
from pathlib import Path

from tests.tiny_families import make_tiny

QWEN3_TEMPLATE = """\
{%- if tools %}
    {{- '<|im_start|>system\\n' }}
    {%- if messages[0].role == 'system' %}
        {{- messages[0].content + '\\n\\n' }}
    {%- endif %}
    {{- "# Tools\\n\\nYou are provided with function signatures within <tools></tools>:\\n<tools>" }}
    {%- for tool in tools %}
        {{- "\\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\\n</tools>\\n\\nFor each function call, return a json object within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{\\"name\\": <function-name>, \\"arguments\\": <args-json-object>}\\n</tool_call><|im_end|>\\n" }}
{%- else %}
    {%- if messages[0].role == 'system' %}
        {{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}
    {%- endif %}
{%- endif %}
{%- set ns = namespace(last_query_index=messages|length - 1) %}
{%- for message in messages %}
    {%- if message.role == 'user' %}{% set ns.last_query_index = loop.index0 %}{% endif %}
{%- endfor %}
{%- for message in messages %}
    {%- if message.content is string %}
        {%- set content = message.content %}
    {%- else %}
        {%- set content = '' %}
    {%- endif %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) %}
        {{- '<|im_start|>' + message.role + '\\n' + content + '<|im_end|>' + '\\n' }}
    {%- elif message.role == "assistant" %}
        {%- set reasoning_content = '' %}
        {%- if '</think>' in content %}
            {%- set reasoning_content = content.split('</think>')[0].rstrip('\\n').split('<think>')[-1].lstrip('\\n') %}
            {%- set content = content.split('</think>')[-1].lstrip('\\n') %}
        {%- endif %}
        {%- if loop.index0 > ns.last_query_index and reasoning_content %}
            {{- '<|im_start|>assistant\\n<think>\\n' + reasoning_content.strip('\\n') + '\\n</think>\\n\\n' + content.lstrip('\\n') }}
        {%- else %}
            {{- '<|im_start|>assistant\\n' + content }}
        {%- endif %}
        {%- for tool_call in message.tool_calls or [] %}
            {%- if (loop.first and content) or (not loop.first) %}{{- '\\n' }}{% endif %}
            {%- set call = tool_call.function %}
            {{- '<tool_call>\\n{"name": "' + call.name + '", "arguments": ' }}
            {%- if call.arguments is string %}{{- call.arguments }}{% else %}{{- call.arguments | tojson }}{% endif %}
            {{- '}\\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\\n' }}
    {%- elif message.role == "tool" %}
        {%- if loop.first or (messages[loop.index0 - 1].role != "tool") %}{{- '<|im_start|>user' }}{% endif %}
        {{- '\\n<tool_response>\\n' + content + '\\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}{{- '<|im_end|>\\n' }}{% endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
    {%- if enable_thinking is defined and enable_thinking is false %}
        {{- '<think>\\n\\n</think>\\n\\n' }}
    {%- endif %}
{%- endif %}
"""

# DeepSeek-R1's distills: earlier answers lose their think block, and the generation
# prompt opens one, so the model's output begins inside it.
R1_TEMPLATE = (
    "{% for message in messages %}{% if message.role == 'user' %}"
    "{{ '<|im_start|>user\\n' + message.content + '<|im_end|>\\n' }}{% else %}"
    "{% set content = message.content.split('</think>')[-1] %}"
    "{{ '<|im_start|>assistant\\n' + content + '<|im_end|>\\n' }}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n<think>\\n' }}{% endif %}"
)

MARKUP = [("<|im_start|>", True), ("<|im_end|>", True), ("<think>", False), ("</think>", False)]


def make_tiny_qwen3_reasoner(directory: Path, template: str = QWEN3_TEMPLATE) -> Path:
    """The checkpoint directory; the last filler tokens of the tiny vocabulary become the
    markup, so the vocabulary keeps the model's size."""
    make_tiny("qwen3", directory)
    spec = json.loads((directory / "tokenizer.json").read_text())
    fillers = [t for t in spec["added_tokens"] if t["content"].startswith("<|t")]
    for token, (content, special) in zip(fillers[-len(MARKUP) :], MARKUP, strict=True):
        token.update(content=content, special=special)
    (directory / "tokenizer.json").write_text(json.dumps(spec))
    config = {
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "model_max_length": 256,
        "chat_template": template,
    }
    (directory / "tokenizer_config.json").write_text(json.dumps(config))
    return directory
