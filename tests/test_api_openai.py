"""The official `openai` client, sync and async, against a real server on a loopback port:
completions and chat, whole and streamed, n > 1, logprobs, echo, stop, seeds, usage.

Greedy output is compared with `model.greedy.greedy_tokens` on the same token ids (tied to
transformers in test_default_model.py) and, for a chat prompt, with transformers'
`generate` directly; usage counts are compared with the tokenizer."""

import asyncio
import time

import httpx
import openai
import pytest
import torch

from model.greedy import greedy_tokens

PROMPTS = [
    "The capital of France is",
    "def add(a, b):\n    return",
    "List three colours:\n1.",
]
MAX_TOKENS = 10


@pytest.fixture(scope="module")
def client(live_server):
    with openai.OpenAI(base_url=live_server.v1, api_key="unused", max_retries=0, timeout=120) as c:
        yield c


@pytest.fixture(scope="module")
def model_name(live_server):
    return live_server.state.model_name


@pytest.fixture(scope="module")
def tok(ours_default):
    return ours_default.tokenizer


@pytest.fixture(scope="module")
def reference(ours_default):
    """Greedy tokens of the model alone (no scheduler, no server), stop token included."""
    cache: dict[tuple[tuple[int, ...], int], list[int]] = {}

    def run(ids: list[int], max_tokens: int = MAX_TOKENS) -> list[int]:
        key = (tuple(ids), max_tokens)
        if key not in cache:
            stop = ours_default.tokenizer.stop_ids
            cache[key] = list(greedy_tokens(ours_default.model, ids, max_tokens, stop))
        return cache[key]

    return run


def visible(tokens: list[int], tok) -> str:
    """The text a client sees for these tokens: the stop token is not part of it."""
    if tokens and tokens[-1] in tok.stop_ids:
        tokens = tokens[:-1]
    return tok.decode(tokens)


def expected_finish(tokens: list[int], max_tokens: int, tok) -> str:
    return "stop" if tokens and tokens[-1] in tok.stop_ids else "length"


def is_special_text(token: str) -> bool:
    return token.startswith("<|") and token.endswith("|>")


def chat_ids(live_server, messages) -> list[int]:
    r = httpx.post(f"{live_server.base_url}/tokenize", json={"messages": messages}, timeout=30)
    assert r.status_code == 200, r.text
    return r.json()["tokens"]


# ---- completions -------------------------------------------------------------------------


@pytest.mark.parametrize("text", PROMPTS)
def test_completion_greedy_equals_model(text, client, model_name, tok, reference):
    ids = tok.encode(text)
    want = reference(ids)
    started = int(time.time())
    r = client.completions.create(
        model=model_name, prompt=text, max_tokens=MAX_TOKENS, temperature=0, logprobs=0
    )
    assert r.id.startswith("cmpl-") and r.object == "text_completion"
    assert r.model == model_name and r.system_fingerprint
    assert started - 5 <= r.created <= time.time() + 5
    (choice,) = r.choices
    assert choice.index == 0
    assert choice.text == visible(want, tok)
    assert choice.finish_reason == expected_finish(want, MAX_TOKENS, tok)
    # One logprob entry per generated token, and they are the reference's tokens.
    assert choice.logprobs.tokens == [tok.decode([t]) for t in want]
    assert all(lp <= 0 for lp in choice.logprobs.token_logprobs)
    assert r.usage.prompt_tokens == len(ids)
    assert r.usage.completion_tokens == len(want)
    assert r.usage.total_tokens == len(ids) + len(want)


def test_completion_prompt_forms(client, model_name, tok, reference):
    texts = PROMPTS[:2]
    ids = [tok.encode(t) for t in texts]
    want = [visible(reference(i, 6), tok) for i in ids]
    for prompt in (texts, ids, ids[0]):
        r = client.completions.create(model=model_name, prompt=prompt, max_tokens=6, temperature=0)
        n_prompts = 1 if prompt is ids[0] else 2
        assert [c.index for c in r.choices] == list(range(n_prompts))
        assert [c.text for c in r.choices] == want[:n_prompts]
        assert r.usage.prompt_tokens == sum(len(i) for i in ids[:n_prompts])
        assert r.usage.completion_tokens == 6 * n_prompts


def test_completion_logprobs_top_n(client, model_name, tok, reference):
    ids = tok.encode(PROMPTS[0])
    want = reference(ids)
    r = client.completions.create(
        model=model_name, prompt=PROMPTS[0], max_tokens=MAX_TOKENS, temperature=0, logprobs=3
    )
    lp = r.choices[0].logprobs
    n = len(want)
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == n
    for token, chosen, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs, strict=True):
        assert 1 <= len(top) <= 3
        # Greedy: the chosen token is the most likely one.
        assert chosen == pytest.approx(max(top.values()), abs=1e-5)
        assert top[token] == pytest.approx(chosen, abs=1e-5)
    # Offsets index into the returned text.
    text = r.choices[0].text
    for token, offset in zip(lp.tokens, lp.text_offset, strict=True):
        if not is_special_text(token):
            assert text[offset : offset + len(token)] == token


def test_completion_echo(client, model_name, tok, reference):
    text = PROMPTS[1]
    r = client.completions.create(
        model=model_name, prompt=text, max_tokens=5, temperature=0, echo=True
    )
    assert r.choices[0].text == text + visible(reference(tok.encode(text), 5), tok)
    assert r.usage.completion_tokens == 5


def test_completion_echo_with_logprobs(client, model_name, tok, reference, hf_default):
    """Prompt logprobs (what evaluation harnesses read) equal transformers' teacher-forced
    log-softmax; the first prompt token has none."""
    hf, _ = hf_default
    text = PROMPTS[0]
    ids = tok.encode(text)
    with torch.no_grad():
        ref = torch.log_softmax(hf(torch.tensor([ids])).logits[0].float(), dim=-1)
    r = client.completions.create(
        model=model_name, prompt=text, max_tokens=3, temperature=0, echo=True, logprobs=2
    )
    lp = r.choices[0].logprobs
    generated = reference(ids, 3)
    assert r.choices[0].text == text + visible(generated, tok)
    assert lp.tokens == [tok.decode([t]) for t in ids + generated]
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    for pos in range(1, len(ids)):
        assert lp.token_logprobs[pos] == pytest.approx(ref[pos - 1, ids[pos]].item(), abs=1e-3)
        want = {tok.decode([t]) for t in ref[pos - 1].topk(2).indices.tolist()}
        assert set(lp.top_logprobs[pos]) == want
    assert all(v is not None for v in lp.token_logprobs[len(ids) :])
    assert r.usage.prompt_tokens == len(ids) and r.usage.completion_tokens == 3


def test_completion_stop_string(client, model_name, tok, reference):
    ids = tok.encode(PROMPTS[0])
    full = visible(reference(ids), tok)
    stop = full[4:7]
    assert stop and full.find(stop) > 0
    r = client.completions.create(
        model=model_name, prompt=PROMPTS[0], max_tokens=MAX_TOKENS, temperature=0, stop=[stop]
    )
    assert r.choices[0].text == full[: full.find(stop)]
    assert r.choices[0].finish_reason == "stop"
    assert 1 <= r.usage.completion_tokens < MAX_TOKENS


def test_completion_n2_and_seed_reproducibility(client, model_name):
    def sample(seed: int) -> list[str]:
        r = client.completions.create(
            model=model_name,
            prompt="My favourite animal is the",
            max_tokens=8,
            temperature=1.0,
            n=2,
            seed=seed,
            logprobs=0,
        )
        assert sorted(c.index for c in r.choices) == [0, 1]
        per_choice = [len(c.logprobs.tokens) for c in r.choices]
        assert r.usage.completion_tokens == sum(per_choice)
        return [c.text for c in sorted(r.choices, key=lambda c: c.index)]

    first = sample(1234)
    assert sample(1234) == first
    # Different seeds, and the two choices of one request, draw differently.
    assert sample(99) != first
    assert first[0] != first[1]


def test_completion_stream_with_usage(client, model_name, tok, reference):
    ids = tok.encode(PROMPTS[2])
    want = reference(ids)
    chunks = list(
        client.completions.create(
            model=model_name,
            prompt=PROMPTS[2],
            max_tokens=MAX_TOKENS,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    *body, last = chunks
    assert last.choices == []
    assert last.usage.prompt_tokens == len(ids)
    assert last.usage.completion_tokens == len(want)
    assert all(c.usage is None for c in body)
    assert "".join(c.choices[0].text for c in body) == visible(want, tok)
    finishes = [c.choices[0].finish_reason for c in body]
    assert finishes[-1] == expected_finish(want, MAX_TOKENS, tok)
    assert all(f is None for f in finishes[:-1])
    assert len({c.id for c in chunks}) == 1


def test_vllm_extras(client, model_name, tok, reference):
    ids = tok.encode(PROMPTS[0])
    want = reference(ids)

    def complete(**extra) -> openai.types.Completion:
        return client.completions.create(
            model=model_name, prompt=PROMPTS[0], max_tokens=MAX_TOKENS, extra_body=extra
        )

    # top_k=1 samples the argmax whatever the temperature.
    r = complete(top_k=1, temperature=1.0, seed=3)
    assert r.choices[0].text == visible(want, tok)
    # stop_token_ids: generation ends at that token (which is counted but not shown).
    k = next(i for i in range(1, len(want)) if want[i] not in want[:i])
    r = complete(temperature=0, stop_token_ids=[want[k]])
    assert r.choices[0].finish_reason == "stop" and r.usage.completion_tokens == k + 1
    assert r.choices[0].text == tok.decode(want[:k])
    # ignore_eos with min_tokens: exactly max_tokens.
    r = complete(temperature=0, ignore_eos=True, min_tokens=MAX_TOKENS)
    assert r.usage.completion_tokens == MAX_TOKENS
    # logit_bias (OpenAI's field) can force a token.
    forced = tok.encode(" banana")[0]
    r = client.completions.create(
        model=model_name,
        prompt=PROMPTS[0],
        max_tokens=4,
        temperature=0,
        logit_bias={str(forced): 100},
    )
    assert r.choices[0].text == tok.decode([forced] * 4)
    # The other samplers are accepted and keep within the limits.
    r = complete(temperature=0.8, min_p=0.1, repetition_penalty=1.2, seed=1)
    r2 = client.completions.create(
        model=model_name,
        prompt=PROMPTS[0],
        max_tokens=MAX_TOKENS,
        presence_penalty=1.0,
        frequency_penalty=0.5,
        top_p=0.9,
        user="tester",
    )
    for resp in (r, r2):
        assert 1 <= resp.usage.completion_tokens <= MAX_TOKENS


# ---- chat --------------------------------------------------------------------------------

MESSAGES = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "What is the capital of France?"},
]


@pytest.mark.slow
def test_chat_greedy_equals_transformers(client, model_name, live_server, hf_default, tok):
    hf, hf_tok = hf_default
    # The prompt as transformers renders it: our template and tokenizer must agree.
    hf_text = hf_tok.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=False)
    ids = hf_tok(hf_text, add_special_tokens=False)["input_ids"]
    assert chat_ids(live_server, MESSAGES) == ids
    with torch.no_grad():
        out = hf.generate(
            torch.tensor([ids]),
            attention_mask=torch.ones(1, len(ids), dtype=torch.long),
            max_new_tokens=16,
            do_sample=False,
            eos_token_id=sorted(tok.stop_ids),
            pad_token_id=0,
        )
    want = out[0, len(ids) :].tolist()
    r = client.chat.completions.create(
        model=model_name, messages=MESSAGES, max_tokens=16, temperature=0
    )
    assert r.id.startswith("chatcmpl-") and r.object == "chat.completion"
    assert r.model == model_name and r.system_fingerprint
    (choice,) = r.choices
    assert choice.message.role == "assistant"
    assert choice.message.content == visible(want, tok)
    assert choice.finish_reason == expected_finish(want, 16, tok)
    assert r.usage.prompt_tokens == len(ids)
    assert r.usage.completion_tokens == len(want)
    assert r.usage.total_tokens == len(ids) + len(want)


def test_chat_greedy_equals_model(client, model_name, live_server, tok, reference):
    ids = chat_ids(live_server, MESSAGES[1:])
    want = reference(ids, 12)
    # max_completion_tokens is the newer name of max_tokens.
    r = client.chat.completions.create(
        model=model_name, messages=MESSAGES[1:], max_completion_tokens=12, temperature=0
    )
    assert r.choices[0].message.content == visible(want, tok)
    assert r.usage.prompt_tokens == len(ids)
    assert r.usage.completion_tokens == len(want)


def test_chat_text_parts_and_roles(client, model_name, live_server, tok, reference):
    parts = [
        {"role": "system", "content": [{"type": "text", "text": "You are terse."}]},
        {
            "role": "user",
            "content": [{"type": "text", "text": "Name a "}, {"type": "text", "text": "colour."}],
        },
        {"role": "assistant", "content": "Blue."},
        {"role": "user", "content": "Another one?"},
    ]
    plain = [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Name a colour."},
        *parts[2:],
    ]
    ids = chat_ids(live_server, plain)
    want = reference(ids, 8)
    r = client.chat.completions.create(
        model=model_name, messages=parts, max_tokens=8, temperature=0
    )
    assert r.choices[0].message.content == visible(want, tok)
    assert r.usage.prompt_tokens == len(ids)


def test_chat_n2_logprobs_and_seed(client, model_name, tok):
    def sample(seed: int) -> openai.types.chat.ChatCompletion:
        return client.chat.completions.create(
            model=model_name,
            messages=[{"role": "user", "content": "Tell me a one-line story."}],
            max_tokens=8,
            temperature=1.0,
            n=2,
            seed=seed,
            logprobs=True,
            top_logprobs=2,
        )

    r = sample(42)
    assert sorted(c.index for c in r.choices) == [0, 1]
    total = 0
    for choice in r.choices:
        content = choice.logprobs.content
        total += len(content)
        for entry in content:
            assert entry.logprob <= 0 and len(entry.top_logprobs) == 2
            assert bytes(entry.bytes).decode("utf-8", "replace") == entry.token
            assert entry.top_logprobs[0].logprob >= entry.top_logprobs[1].logprob
        # The tokens' bytes make the text (special tokens such as the end token aside).
        shown = b"".join(bytes(e.bytes) for e in content if not is_special_text(e.token))
        assert shown.decode("utf-8", "replace") == choice.message.content
    assert r.usage.completion_tokens == total
    again = sample(42)
    assert [c.message.content for c in again.choices] == [c.message.content for c in r.choices]


def test_chat_stop(client, model_name, live_server, tok, reference):
    messages = [{"role": "user", "content": "Write a sentence about the sea."}]
    full = visible(reference(chat_ids(live_server, messages), 12), tok)
    stop = full[5:8]
    assert stop and full.find(stop) > 0
    r = client.chat.completions.create(
        model=model_name, messages=messages, max_tokens=12, temperature=0, stop=stop
    )
    assert r.choices[0].message.content == full[: full.find(stop)]
    assert r.choices[0].finish_reason == "stop"


def test_chat_stream_with_usage(client, model_name, live_server, tok, reference):
    ids = chat_ids(live_server, MESSAGES)
    want = reference(ids, 12)
    chunks = list(
        client.chat.completions.create(
            model=model_name,
            messages=MESSAGES,
            max_tokens=12,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    first, *middle, finish, usage = chunks
    assert first.choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in middle) == visible(want, tok)
    assert all(c.choices[0].finish_reason is None for c in [first, *middle])
    assert finish.choices[0].finish_reason == expected_finish(want, 12, tok)
    assert not finish.choices[0].delta.content
    assert usage.choices == []
    assert usage.usage.prompt_tokens == len(ids)
    assert usage.usage.completion_tokens == len(want)
    assert all(c.usage is None for c in chunks[:-1])


def test_models(client, model_name, live_server):
    models = client.models.list().data
    assert [m.id for m in models] == [model_name]
    assert models[0].object == "model"
    assert client.models.list().data[0].model_extra["max_model_len"] == (
        live_server.state.max_model_len
    )


def test_tokenize_detokenize(live_server, tok):
    text = "Héllo, wörld! 🤖 12345"
    with httpx.Client(base_url=live_server.base_url, timeout=30) as c:
        r = c.post("/tokenize", json={"prompt": text})
        assert r.status_code == 200
        body = r.json()
        assert body["tokens"] == tok.encode(text) and body["count"] == len(body["tokens"])
        assert body["max_model_len"] == live_server.state.max_model_len
        r = c.post("/detokenize", json={"tokens": body["tokens"]})
        assert r.json() == {"prompt": text}


# ---- the async client --------------------------------------------------------------------


def test_async_client(live_server, model_name, tok, reference):
    async def main() -> None:
        async with openai.AsyncOpenAI(
            base_url=live_server.v1, api_key="unused", max_retries=0, timeout=120
        ) as aclient:

            async def complete(text: str) -> str:
                r = await aclient.completions.create(
                    model=model_name, prompt=text, max_tokens=MAX_TOKENS, temperature=0
                )
                return r.choices[0].text

            async def stream_chat(messages: list[dict]) -> tuple[str, int]:
                stream = await aclient.chat.completions.create(
                    model=model_name,
                    messages=messages,
                    max_tokens=MAX_TOKENS,
                    temperature=0,
                    stream=True,
                    stream_options={"include_usage": True},
                )
                text, usage = "", None
                async for chunk in stream:
                    if chunk.choices:
                        text += chunk.choices[0].delta.content or ""
                    if chunk.usage is not None:
                        usage = chunk.usage
                return text, usage.completion_tokens

            messages = [{"role": "user", "content": "Say hello."}]
            results = await asyncio.gather(*(complete(t) for t in PROMPTS), stream_chat(messages))
        *texts, (chat_text, chat_tokens) = results
        assert texts == [visible(reference(tok.encode(t)), tok) for t in PROMPTS]
        want = reference(chat_ids(live_server, messages))
        assert chat_text == visible(want, tok)
        assert chat_tokens == len(want)

    asyncio.run(main())
