"""model/text/chat_template.py against `transformers.apply_chat_template`, for the default GGUF's
template, the same template saved in a tokenizer directory, and a template that uses the
helpers transformers provides (tojson, loop controls, raise_exception, strftime_now)."""

import json

import jinja2
import pytest
from transformers import AutoTokenizer

from model.text.chat_template import ChatTemplate, ChatTemplateError
from model.text.tokenizer_files import tokenizer_from_hf_dir

CONVERSATIONS = [
    [{"role": "user", "content": "Hi!"}],
    [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "What is 2 + 2?"},
    ],
    [
        {"role": "system", "content": "Answer in French."},
        {"role": "user", "content": "Hello"},
        {"role": "assistant", "content": "Bonjour !"},
        {"role": "user", "content": "  12 apples\n\n1. 🤖 中文 <|im_end|>"},
    ],
    [
        {"role": "user", "content": "first"},
        {"role": "assistant", "content": "second"},
        {"role": "user", "content": ""},
        {"role": "assistant", "content": "  trailing spaces  \n"},
    ],
]

# Exercises what transformers adds to plain Jinja; written like real Llama-3/Qwen templates.
FEATURE_TEMPLATE = """{{- bos_token }}
{%- set ns = namespace(turns=0) %}
{%- for message in messages %}
    {%- if loop.index0 > 0 and message.role == messages[loop.index0 - 1].role %}
        {{- raise_exception('Conversation roles must alternate') }}
    {%- endif %}
    {%- if message.role == 'system' %}{% continue %}{% endif %}
    {%- set ns.turns = ns.turns + 1 %}
    {{- '<|' + message.role + '|>' + message.content | trim }}
    {%- if message.role == 'assistant' %}
        {%- generation %}{{ eos_token }}{% endgeneration %}
    {%- endif %}
{%- endfor %}
{%- if tools is not none %}{{ '\\nTools: ' + tools | tojson(indent=2) }}{% endif %}
{{- '\\nturns=' ~ ns.turns ~ ' date_len=' ~ strftime_now('%Y-%m-%d') | length }}
{% if add_generation_prompt %}
    {{ '\\n<|assistant|>' }}
{% endif %}
"""


@pytest.fixture(scope="module")
def hf_dir_pair(hf_dir):
    """transformers' and our tokenizer, both loaded from the saved directory."""
    return AutoTokenizer.from_pretrained(hf_dir), tokenizer_from_hf_dir(hf_dir)


@pytest.mark.parametrize("add_generation_prompt", [True, False])
@pytest.mark.parametrize("conversation", range(len(CONVERSATIONS)))
def test_gguf_template_matches_transformers(
    gguf_metadata, tok, hf_tok, conversation, add_generation_prompt
):
    messages = CONVERSATIONS[conversation]
    template = ChatTemplate.from_gguf_metadata(gguf_metadata, tok)
    expected = hf_tok.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=add_generation_prompt
    )
    assert template.render(messages, add_generation_prompt=add_generation_prompt) == expected


def test_default_system_turn_and_generation_prompt(gguf_metadata, tok):
    prompt = ChatTemplate.from_gguf_metadata(gguf_metadata, tok).render(CONVERSATIONS[0])
    assert prompt.startswith("<|im_start|>system\nYou are a helpful AI assistant named SmolLM")
    assert prompt.endswith("<|im_start|>user\nHi!<|im_end|>\n<|im_start|>assistant\n")


@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_hf_dir_template_matches_transformers(hf_dir, hf_dir_pair, add_generation_prompt):
    assert (hf_dir / "chat_template.jinja").is_file()
    hf, ours = hf_dir_pair
    template = ChatTemplate.from_hf_dir(hf_dir, ours)
    for messages in CONVERSATIONS:
        expected = hf.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=add_generation_prompt
        )
        assert template.render(messages, add_generation_prompt=add_generation_prompt) == expected


def test_template_from_tokenizer_config_or_none(hf_dir, tok, tmp_path):
    source = (hf_dir / "chat_template.jinja").read_text()
    config = json.loads((hf_dir / "tokenizer_config.json").read_text())
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    assert ChatTemplate.from_hf_dir(tmp_path, tok) is None
    named = [{"name": "tool_use", "template": "x"}, {"name": "default", "template": source}]
    for stored in (source, named):
        (tmp_path / "tokenizer_config.json").write_text(
            json.dumps({**config, "chat_template": stored})
        )
        assert ChatTemplate.from_hf_dir(tmp_path, tok).source == source
    metadata = {"tokenizer.ggml.model": "gpt2"}
    assert ChatTemplate.from_gguf_metadata(metadata, tok) is None


@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_transformers_helpers_render_the_same(tok, hf_tok, add_generation_prompt):
    template = ChatTemplate.for_tokenizer(FEATURE_TEMPLATE, tok)
    tools = [{"type": "function", "function": {"name": "été", "parameters": {"x": "<b>"}}}]
    for messages in CONVERSATIONS:
        for extra in ({}, {"tools": tools}):
            expected = hf_tok.apply_chat_template(
                messages,
                chat_template=FEATURE_TEMPLATE,
                tokenize=False,
                add_generation_prompt=add_generation_prompt,
                **extra,
            )
            rendered = template.render(messages, add_generation_prompt, **extra)
            assert rendered == expected


def test_template_errors_are_chat_template_errors(tok, hf_tok):
    template = ChatTemplate.for_tokenizer(FEATURE_TEMPLATE, tok)
    repeated = [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]
    with pytest.raises(jinja2.TemplateError, match="must alternate"):
        hf_tok.apply_chat_template(repeated, chat_template=FEATURE_TEMPLATE, tokenize=False)
    with pytest.raises(ChatTemplateError, match="Conversation roles must alternate"):
        template.render(repeated)
    with pytest.raises(ChatTemplateError, match="does not compile"):
        ChatTemplate("{% for m in messages %}{{ m.content }}", "", "")
    with pytest.raises(ChatTemplateError):
        ChatTemplate("{{ messages.append({'role': 'x'}) }}").render(repeated)
    with pytest.raises(ChatTemplateError):
        ChatTemplate("{{ ''.__class__.__mro__[1].__subclasses__() }}").render(repeated)
    with pytest.raises(ChatTemplateError):
        ChatTemplate("{{ messages[0]['content'] + 1 }}").render(repeated)
    assert issubclass(ChatTemplateError, ValueError) and len(repeated) == 2


@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_prompt_ids_match_transformers(gguf_metadata, tok, hf_tok, add_generation_prompt):
    """Ids, not only text: transformers tokenizes its rendered prompt with special tokens
    parsed everywhere, which for messages that spell no special token is what we do too."""
    template = ChatTemplate.from_gguf_metadata(gguf_metadata, tok)
    for messages in CONVERSATIONS:
        text = hf_tok.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=add_generation_prompt
        )
        want = hf_tok(text, add_special_tokens=False)["input_ids"]
        ids = template.prompt_ids(messages, tok, add_generation_prompt)
        if "<|im_end|>" not in str(messages):
            assert ids == want
        else:
            # There transformers turns the user's "<|im_end|>" into a control token; we do not.
            assert tok.decode(ids) == tok.decode(want) == text
            im_end = tok.special_tokens["<|im_end|>"]
            assert ids.count(im_end) == want.count(im_end) - 1
