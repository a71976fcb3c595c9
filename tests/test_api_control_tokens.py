"""Control tokens over the wire: chat messages are the client's text, a raw prompt is the
client's markup.

Through `/v1/chat/completions` and `/tokenize`, special-token text in every role and content form
(string, text parts, `name`, tool results, and tools sent as template variables) must leave the
control tokens of the same messages with harmless text, and the engine must get the ids
`/tokenize` shows. (The server passes no `name` or `tool_calls` to templates yet; the template
paths for them are tested in test_control_tokens.py.) A raw `/v1/completions` prompt (and
`/tokenize` with `prompt`) that spells the chat markup by hand must give the chat template's ids
for the same messages, an independent path to the same prompt. Run on the default model (SmolLM2
GGUF, ChatML) and on a tiny random Llama 3 with Meta's format and with a Jinja Llama 3.1 template.
"""

import dataclasses

import httpx
import pytest

from model.config import ModelConfig
from model.greedy import greedy_tokens
from model.loader import LoadedModel
from model.random_model import random_llama
from model.text.chat_template import ChatTemplate
from model.text.llama3_chat import Llama3ChatFormat, llama3_chat_format
from model.text.llama3_tokenizer import llama3_tokenizer
from tests.chat_templates import CHATML_FORGERY, LLAMA3_FORGERY, LLAMA3_TOOLS, control_ids
from tests.live_server import running_server
from tests.meta_reference import meta_tokenizer_path

CHATML_MARKUP = (
    "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi there<|im_end|>\n"
    "<|im_start|>assistant\n"
)
LLAMA3_MARKUP = (
    "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nBe brief.<|eot_id|>"
    "<|start_header_id|>user<|end_header_id|>\n\nHi there<|eot_id|>"
    "<|start_header_id|>assistant<|end_header_id|>\n\n"
)
SAME_MESSAGES = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Hi there"},
]


def every_role(text: str, roles: tuple[str, ...]) -> list[dict]:
    """`text` in each role, as a string, as text parts and as a `name`."""
    messages = []
    for role in roles:
        messages.append({"role": role, "content": text, "name": text})
        parts = [{"type": "text", "text": text}, {"type": "text", "text": f" {text} "}]
        messages.append({"role": role, "content": parts})
    return messages + [{"role": "user", "content": "Go on"}]


def post(server, path: str, body: dict) -> dict:
    r = httpx.post(f"{server.base_url}{path}", json=body, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def check_chat_keeps_forgery_as_text(server, forged: dict, harmless: dict) -> list[int]:
    """`/tokenize` shows no control token the template did not write, and chat completion
    counts the same prompt; returns the ids."""
    tok = server.state.tokenizer
    ids = post(server, "/tokenize", forged)["tokens"]
    want = control_ids(tok, post(server, "/tokenize", harmless)["tokens"])
    assert control_ids(tok, ids) == want
    reply = post(server, "/v1/chat/completions", {**forged, "max_tokens": 3, "temperature": 0})
    assert reply["usage"]["prompt_tokens"] == len(ids)
    return ids


def test_default_model_chat_forgery_stays_text(live_server, ours_default):
    roles = ("system", "developer", "user", "assistant", "tool")
    forged = {"messages": every_role(CHATML_FORGERY, roles)}
    ids = check_chat_keeps_forgery_as_text(
        live_server, forged, {"messages": every_role("hi", roles)}
    )
    # The engine ran on exactly these ids: greedy text of the model alone on them.
    tok = ours_default.tokenizer
    want = list(greedy_tokens(ours_default.model, ids, 6, tok.stop_ids))
    reply = post(live_server, "/v1/chat/completions", {**forged, "max_tokens": 6, "temperature": 0})
    visible = want[:-1] if want[-1] in tok.stop_ids else want
    assert reply["choices"][0]["message"]["content"] == tok.decode(visible)


def test_default_model_raw_prompt_markup_is_control_tokens(live_server):
    tok = live_server.state.tokenizer
    chat_ids = post(live_server, "/tokenize", {"messages": SAME_MESSAGES})["tokens"]
    assert post(live_server, "/tokenize", {"prompt": CHATML_MARKUP})["tokens"] == chat_ids
    assert control_ids(tok, chat_ids) == [1, 2, 1, 2, 1]
    body = {"max_tokens": 6, "temperature": 0}
    completion = post(live_server, "/v1/completions", {**body, "prompt": CHATML_MARKUP})
    chat = post(live_server, "/v1/chat/completions", {**body, "messages": SAME_MESSAGES})
    # The same ids: the same counts (the second one finds the first's blocks cached).
    completion["usage"].pop("prompt_tokens_details")
    chat["usage"].pop("prompt_tokens_details")
    assert completion["usage"] == chat["usage"]
    assert completion["choices"][0]["text"] == chat["choices"][0]["message"]["content"]
    # Special text in a raw prompt is parsed wherever it is, partial markup stays text.
    ids = post(live_server, "/tokenize", {"prompt": "a<|im_end|>b <|im_end| <|im_start"})["tokens"]
    assert control_ids(tok, ids) == [2]


@pytest.fixture(scope="module", params=["meta-format", "jinja-template"])
def llama3_server(request):
    """A tiny random Llama 3 with the real Llama 3 tokenizer, chatting in Meta's format (Meta
    checkpoints) or through a Jinja template (HF checkpoints)."""
    tok = llama3_tokenizer(meta_tokenizer_path())
    config = ModelConfig(
        dim=64, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=16, ffn_dim=128,
        vocab_size=tok.vocab_size, rope_theta=500000.0, max_position=1024,
    )  # fmt: skip
    model = random_llama(config, seed=3)
    loaded = LoadedModel("tiny-llama3", meta_tokenizer_path(), config, model, tok, None)
    if request.param == "meta-format":
        loaded = dataclasses.replace(loaded, chat_template=llama3_chat_format(tok))
    else:
        template = ChatTemplate.for_tokenizer(LLAMA3_TOOLS, tok)
        loaded = dataclasses.replace(loaded, chat_template=template)
    with running_server(loaded) as live:
        yield live


def test_llama3_chat_forgery_stays_text(llama3_server):
    roles = ("system", "user", "assistant", "tool")
    forged: dict = {"messages": every_role(LLAMA3_FORGERY, roles)}
    harmless: dict = {"messages": every_role("hi", roles)}
    if not isinstance(llama3_server.state.chat_template, Llama3ChatFormat):
        # The Jinja template also renders tools, template variables the client sends.
        for body, text in ((forged, LLAMA3_FORGERY), (harmless, "hi")):
            tool = {"type": "function", "function": {"name": text, "description": text}}
            body["chat_template_kwargs"] = {"tools": [tool]}
    check_chat_keeps_forgery_as_text(llama3_server, forged, harmless)


def test_llama3_raw_prompt_markup_is_control_tokens(llama3_server):
    tok = llama3_server.state.tokenizer
    chat_ids = post(llama3_server, "/tokenize", {"messages": SAME_MESSAGES})["tokens"]
    raw = {"prompt": LLAMA3_MARKUP, "add_special_tokens": False}
    assert post(llama3_server, "/tokenize", raw)["tokens"] == chat_ids
    assert control_ids(tok, chat_ids)[:4] == [128000, 128006, 128007, 128009]
    # As in vLLM, the tokenizer's own BOS still comes first unless turned off.
    with_bos = post(llama3_server, "/tokenize", {"prompt": LLAMA3_MARKUP})["tokens"]
    assert with_bos == [tok.bos_id, *chat_ids]
    body = {"max_tokens": 4, "temperature": 0}
    completion = post(llama3_server, "/v1/completions", {**body, "prompt": LLAMA3_MARKUP})
    chat = post(llama3_server, "/v1/chat/completions", {**body, "messages": SAME_MESSAGES})
    assert completion["usage"]["prompt_tokens"] == len(with_bos)
    assert chat["usage"]["prompt_tokens"] == len(chat_ids)
