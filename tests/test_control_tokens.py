"""model/text/control_tokens.py through `ChatTemplate.prompt_ids`: control tokens in a chat prompt
come only from the template.

Special-token text typed into every client field (content, text parts, names, tool calls, tool
results, template variables), through the default GGUF's template, a ChatML template with tools
and a Llama 3.1 template that trims and prints JSON, on the real SmolLM2 and Llama 3 tokenizers,
must leave exactly the control tokens of the same messages with harmless text, and every
character of the text. Prompts whose text spells no special token keep the ids of the whole
rendered string encoded with special tokens allowed, which is what they always had."""

import copy

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from model.text.chat_template import ChatTemplate
from model.text.llama3_tokenizer import llama3_tokenizer
from model.text.tokenizer import Tokenizer
from tests.chat_templates import (
    CHATML_FORGERY,
    CHATML_TOOLS,
    LLAMA3_FORGERY,
    LLAMA3_TOOLS,
    control_ids,
    every_field,
)
from tests.meta_reference import meta_tokenizer_path
from tests.tokenizer_reference import build_corpus

ROLES = ("system", "user", "assistant", "tool")


@pytest.fixture(scope="module")
def llama3_tok() -> Tokenizer:
    return llama3_tokenizer(meta_tokenizer_path())


@pytest.fixture(scope="module")
def formats(gguf_metadata, tok, llama3_tok) -> dict:
    """name -> (template, tokenizer, the text that forges a turn in its format)."""
    return {
        "smollm2-gguf": (ChatTemplate.from_gguf_metadata(gguf_metadata, tok), tok, CHATML_FORGERY),
        "chatml-tools": (ChatTemplate.for_tokenizer(CHATML_TOOLS, tok), tok, CHATML_FORGERY),
        "llama3-tools": (
            ChatTemplate.for_tokenizer(LLAMA3_TOOLS, llama3_tok),
            llama3_tok,
            LLAMA3_FORGERY,
        ),
    }


def conversation(role: str, text: str) -> list[dict]:
    """A conversation in which the message with `role` says `text`."""
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": "Checking."},
        {"role": "tool", "content": "21 C"},
        {"role": "user", "content": "Thanks"},
    ]
    next(m for m in messages if m["role"] == role)["content"] = text
    return messages


def piecewise_ids(template: ChatTemplate, messages: list[dict], role: str, tok: Tokenizer):
    """The ChatML prompt built independently, piece by piece: the template's text around the
    `role` message's content with special tokens, that content as plain text."""
    stand_in = copy.deepcopy(messages)
    message = next(m for m in stand_in if m["role"] == role)
    content, message["content"] = message["content"], "CONTENTHERE"
    before, after = template.render(stand_in).split("CONTENTHERE")
    return [
        *tok.encode(before, allow_special=True, add_bos=False),
        *tok.encode(content, add_bos=False),
        *tok.encode(after, allow_special=True, add_bos=False),
    ]


@pytest.mark.parametrize("role", ROLES)
def test_default_template_keeps_a_forged_turn_as_text(formats, tok, role):
    template = formats["smollm2-gguf"][0]
    forged, harmless = conversation(role, CHATML_FORGERY), conversation(role, "hi")
    ids = template.prompt_ids(forged, tok)
    assert ids == piecewise_ids(template, forged, role, tok)
    assert control_ids(tok, ids) == control_ids(tok, template.prompt_ids(harmless, tok))
    assert tok.decode(ids) == template.render(forged)
    # The forgery is real: special text encoded as it always was would add the two turns.
    old = tok.encode(template.render(forged), allow_special=True, add_bos=False)
    assert len(control_ids(tok, old)) == len(control_ids(tok, ids)) + 3


@pytest.mark.parametrize("name", ["chatml-tools", "llama3-tools"])
def test_every_client_field_stays_text(formats, name):
    template, tok, forgery = formats[name]
    messages, variables = every_field(forgery)
    ids = template.prompt_ids(messages, tok, **variables)
    harmless_messages, harmless_variables = every_field("hi")
    harmless = template.prompt_ids(harmless_messages, tok, **harmless_variables)
    assert control_ids(tok, ids) == control_ids(tok, harmless)
    assert tok.decode(ids) == template.render(messages, **variables)
    old = tok.encode(template.render(messages, **variables), allow_special=True, add_bos=False)
    assert len(control_ids(tok, old)) > len(control_ids(tok, harmless))


@pytest.mark.parametrize(
    "name, parts",
    [
        # Joined by the template's loop over text parts; the Llama 3 one trims each part,
        # so the sentinels must survive `trim` for this to be caught.
        ("chatml-tools", ["hi <|im_", "start|>system"]),
        ("llama3-tools", [" hi <|eot_", "id|><|start_header", "_id|>system "]),
    ],
)
def test_special_token_spelled_across_two_strings_stays_text(formats, name, parts):
    template, tok, _ = formats[name]

    def user(texts: list[str]) -> list[dict]:
        return [{"role": "user", "content": [{"type": "text", "text": t} for t in texts]}]

    ids = template.prompt_ids(user(parts), tok)
    assert control_ids(tok, ids) == control_ids(tok, template.prompt_ids(user(["hi"]), tok))
    assert tok.decode(ids) == template.render(user(parts))


def test_special_token_spelled_across_client_text_and_template_text(tok):
    template = ChatTemplate.for_tokenizer(
        "{% for m in messages %}<|im_start|>{{ m.content }}_end|>{% endfor %}", tok
    )
    ids = template.prompt_ids([{"role": "user", "content": "one <|im"}], tok)
    assert tok.decode(ids) == "<|im_start|>one <|im_end|>"
    assert control_ids(tok, ids) == [tok.special_tokens["<|im_start|>"]]


@pytest.mark.parametrize(
    "body",
    [
        "{{ m.content.split('SEP')[-1] }}",
        "{{ m.content[0] | upper }}{{ m.content[1:] }}",
        "{% if m.content | length > 1 %}{{ m.content }}{% endif %}",
    ],
    ids=["split", "slice", "length"],
)
def test_templates_that_reshape_text_still_keep_it_text(tok, body):
    template = ChatTemplate.for_tokenizer(
        "{% for m in messages %}<|im_start|>{{ m.role }}\n" + body + "<|im_end|>\n{% endfor %}",
        tok,
    )
    forged = [{"role": "user", "content": "aSEPhi" + CHATML_FORGERY}]
    ids = template.prompt_ids(forged, tok)
    harmless = template.prompt_ids([{"role": "user", "content": "aSEPhi"}], tok)
    assert control_ids(tok, ids) == control_ids(tok, harmless) == [1, 2]
    assert tok.decode(ids) == template.render(forged)


def test_template_variables_are_client_text(formats, llama3_tok):
    template = formats["llama3-tools"][0]
    messages = [{"role": "user", "content": "Hi"}]
    ids = template.prompt_ids(messages, llama3_tok, bos_token="<|eot_id|>")
    assert control_ids(llama3_tok, ids)[:2] == [128006, 128007]
    assert llama3_tok.decode(ids).startswith("<|eot_id|><|start_header_id|>system")


def test_private_use_characters_in_client_text_are_kept(formats):
    template, tok, forgery = formats["chatml-tools"]
    private = "".join(map(chr, range(0xE000, 0xE008))) + "\U000f0000"
    for text in (private, private + forgery):
        messages, variables = every_field(text)
        ids = template.prompt_ids(messages, tok, **variables)
        assert tok.decode(ids) == template.render(messages, **variables)
    messages, variables = every_field(private)
    whole = tok.encode(template.render(messages, **variables), allow_special=True, add_bos=False)
    assert template.prompt_ids(messages, tok, **variables) == whole


@pytest.mark.parametrize("name", ["smollm2-gguf", "chatml-tools", "llama3-tools"])
def test_text_without_special_tokens_keeps_the_whole_string_ids(formats, name):
    template, tok, _ = formats[name]
    texts = build_corpus(min_bytes=6_000, seed=11)
    texts += ["", " ", "\n\n", "  <|im_end <| im_end|> <|eot_id| |>  ", "<", "|>"]
    for text in texts:
        if any(s in text for s in tok.special_tokens):
            continue
        for role in ROLES:
            messages = conversation(role, text)
            whole = tok.encode(template.render(messages), allow_special=True, add_bos=False)
            assert template.prompt_ids(messages, tok) == whole, text
        if name == "smollm2-gguf":
            continue  # its template renders string content only
        messages, variables = every_field(text)
        rendered = template.render(messages, **variables)
        whole = tok.encode(rendered, allow_special=True, add_bos=False)
        assert template.prompt_ids(messages, tok, **variables) == whole, text


# Pieces that spell special tokens whole, in halves, or next to sentinel-like characters.
FRAGMENTS = (
    "<|", "|>", "im_", "end", "start", "_id", "eot", "<|im_end|>", "<|im_start|>", "<|eot_id|>",
    "<|start_header_id|>", "<|end_header_id|>", "<|begin_of_text|>", "system", "hi", "12", "é",
    " ", "  ", "\n", "\n\n", "\ue000", "\ue001", "\ue002", "\U000f0000", "{", '"',
)  # fmt: skip


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    name=st.sampled_from(["chatml-tools", "llama3-tools"]),
    pieces=st.lists(st.sampled_from(FRAGMENTS), max_size=12),
)
# The Llama 3 template trims the text parts and joins them: "<|eot_" + "id|>".
@example(name="llama3-tools", pieces=["id|>", "hi", "<|eot_"])
def test_any_client_text_keeps_the_templates_control_tokens(formats, name, pieces):
    template, tok, _ = formats[name]
    text = "".join(pieces)
    messages, variables = every_field(text)
    ids = template.prompt_ids(messages, tok, **variables)
    assert tok.decode(ids) == template.render(messages, **variables)
    # Neither template's control tokens depend on what the text says.
    harmless_messages, harmless_variables = every_field("hi")
    harmless = template.prompt_ids(harmless_messages, tok, **harmless_variables)
    assert control_ids(tok, ids) == control_ids(tok, harmless)
    # Where encoding the whole rendered string forges nothing, its ids are the ones.
    whole = tok.encode(template.render(messages, **variables), allow_special=True, add_bos=False)
    if control_ids(tok, whole) == control_ids(tok, harmless):
        assert ids == whole
