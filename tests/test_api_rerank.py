"""`/v1/rerank` (and `/rerank`, `/v2/rerank`) and `/score` (and `/v1/score`) on a real
uvicorn serving a tiny random cross-encoder packaged by sentence-transformers'
`CrossEncoder.save`, against `CrossEncoder.predict` on the same directory: through httpx and
through LangChain's `CohereRerank` pointed at the server by its `base_url`."""

import httpx
import numpy as np
import pytest

from tests.live_server import assert_error, engine_config, running_server
from tests.test_embedding_models import write_tiny_bert
from tests.tiny_cross_encoder import cross_encoder, write_tiny_cross_encoder

NAME = "tiny-reranker"
QUERY = "which cat sat on the mat?"
DOCUMENTS = [
    "the cat sat on the mat",
    "def return code",
    "",
    "a dog",
    " ".join(["the dog sat on a mat"] * 12),  # over the 64-token limit: cut
    "x y b",
]


@pytest.fixture(scope="module")
def reranker(tmp_path_factory):
    return write_tiny_cross_encoder(tmp_path_factory.mktemp("rerank") / NAME)


@pytest.fixture(scope="module")
def reference(reranker):
    return cross_encoder(reranker)


@pytest.fixture(scope="module")
def server(reranker):
    with running_server(None, engine_config(), model=str(reranker)) as live:
        yield live


def predict(reference, pairs) -> np.ndarray:
    return reference.predict(pairs, show_progress_bar=False)


def pair_tokens(reference, pairs) -> int:
    encoded = reference.tokenizer(
        [a for a, _ in pairs], [b for _, b in pairs], truncation="longest_first", max_length=64
    )
    return sum(len(ids) for ids in encoded["input_ids"])


@pytest.mark.parametrize("path", ["/v1/rerank", "/rerank", "/v2/rerank"])
def test_rerank_matches_cross_encoder(server, reference, path) -> None:
    documents = [d if i % 2 else {"text": d} for i, d in enumerate(DOCUMENTS)]  # both forms
    body = {"model": NAME, "query": QUERY, "documents": documents, "return_documents": True}
    r = httpx.post(server.base_url + path, json=body, timeout=60)
    assert r.status_code == 200, r.text
    got = r.json()
    expected = predict(reference, [(QUERY, d) for d in DOCUMENTS])
    assert np.std(expected) > 0.05  # scores that differ: the order below means something
    assert [x["index"] for x in got["results"]] == list(np.argsort(-expected, kind="stable"))
    for result in got["results"]:
        assert result["relevance_score"] == pytest.approx(expected[result["index"]], abs=1e-5)
        assert result["document"] == {"text": DOCUMENTS[result["index"]]}
    tokens = pair_tokens(reference, [(QUERY, d) for d in DOCUMENTS])
    assert got["usage"]["total_tokens"] == tokens and got["model"] == NAME


def test_top_n_and_documents_left_out(server, reference) -> None:
    expected = predict(reference, [(QUERY, d) for d in DOCUMENTS])
    with httpx.Client(base_url=server.v1, timeout=60) as c:
        top = c.post("/rerank", json={"query": QUERY, "documents": DOCUMENTS, "top_n": 2}).json()
        every = c.post("/rerank", json={"query": QUERY, "documents": DOCUMENTS, "top_n": 99})
    assert [x["index"] for x in top["results"]] == list(np.argsort(-expected)[:2])
    assert all(set(x) == {"index", "relevance_score"} for x in top["results"])
    assert len(every.json()["results"]) == len(DOCUMENTS)


def test_score_pairs_one_to_one_one_to_many_and_many_to_many(server, reference) -> None:
    firsts = ["the cat", "x", "", "code def"]
    seconds = ["sat on the mat", "y", "a dog", " ".join(["return"] * 80)]
    cases = [
        ({"text_1": firsts[0], "text_2": seconds[0]}, [(firsts[0], seconds[0])]),
        ({"text_1": firsts[0], "text_2": seconds}, [(firsts[0], s) for s in seconds]),
        ({"text_1": [firsts[1]], "text_2": seconds}, [(firsts[1], s) for s in seconds]),
        ({"text_1": firsts, "text_2": seconds}, list(zip(firsts, seconds, strict=True))),
    ]
    for path in ("/score", "/v1/score"):
        for body, pairs in cases:
            r = httpx.post(server.base_url + path, json={"model": NAME, **body}, timeout=60)
            assert r.status_code == 200, r.text
            got = r.json()
            assert got["object"] == "list" and got["model"] == NAME
            assert [d["index"] for d in got["data"]] == list(range(len(pairs)))
            assert all(d["object"] == "score" for d in got["data"])
            scores = [d["score"] for d in got["data"]]
            np.testing.assert_allclose(scores, predict(reference, pairs), atol=1e-5, rtol=0)
            assert got["usage"]["prompt_tokens"] == pair_tokens(reference, pairs)


def test_langchain_cohere_rerank(server, reference) -> None:
    from langchain_cohere import CohereRerank
    from langchain_core.documents import Document

    expected = predict(reference, [(QUERY, d) for d in DOCUMENTS])
    lc = CohereRerank(model=NAME, base_url=server.base_url, cohere_api_key="none", top_n=3)
    ranked = lc.rerank(DOCUMENTS, QUERY)
    assert [x["index"] for x in ranked] == list(np.argsort(-expected)[:3])
    for x in ranked:
        assert x["relevance_score"] == pytest.approx(expected[x["index"]], abs=1e-5)
    kept = lc.compress_documents([Document(page_content=d) for d in DOCUMENTS], QUERY)
    assert [d.page_content for d in kept] == [DOCUMENTS[x["index"]] for x in ranked]


def test_more_pairs_than_one_wave_come_back_in_order(server, reference) -> None:
    words = ["the", "cat", "dog", "mat", "code", "x", "y"]
    documents = [f"{words[i % 7]} {words[i // 7 % 7]} {i}" for i in range(300)]
    r = httpx.post(f"{server.v1}/score", json={"text_1": QUERY, "text_2": documents}, timeout=120)
    scores = [d["score"] for d in r.json()["data"]]
    expected = predict(reference, [(QUERY, d) for d in documents])
    np.testing.assert_allclose(scores, expected, atol=1e-5, rtol=0)


BAD = {
    "no query": ("/v1/rerank", {"documents": ["a"]}, "query"),
    "no documents": ("/v1/rerank", {"query": "a"}, "documents"),
    "empty documents": ("/v1/rerank", {"query": "a", "documents": []}, "documents"),
    "documents not a list": ("/v1/rerank", {"query": "a", "documents": "a"}, "documents"),
    "document without text": ("/v1/rerank", {"query": "a", "documents": [{"t": 1}]}, "documents"),
    "document a number": ("/v1/rerank", {"query": "a", "documents": ["a", 3]}, "documents"),
    "too many documents": ("/v1/rerank", {"query": "a", "documents": ["a"] * 2049}, "documents"),
    "negative top_n": ("/v1/rerank", {"query": "a", "documents": ["a"], "top_n": -1}, "top_n"),
    "query a list": ("/v1/rerank", {"query": ["a"], "documents": ["a"]}, "query"),
    "no text_2": ("/score", {"text_1": "a"}, "text_2"),
    "empty text_1": ("/score", {"text_1": [], "text_2": "a"}, "text_1"),
    "empty text_2": ("/score", {"text_1": "a", "text_2": []}, "text_2"),
    "lengths differ": ("/score", {"text_1": ["a", "b"], "text_2": ["a", "b", "c"]}, "text_2"),
    "many against one": ("/score", {"text_1": ["a", "b"], "text_2": "c"}, "text_2"),
    "text_1 numbers": ("/score", {"text_1": [1], "text_2": "a"}, "text_1"),
    "unknown model": ("/score", {"model": "other", "text_1": "a", "text_2": "b"}, "model"),
}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_input_is_a_400_naming_the_field(server, case) -> None:
    path, body, param = BAD[case]
    status = 404 if case == "unknown model" else 400
    assert_error(httpx.post(server.base_url + path, json=body, timeout=60), status, param)


def test_only_a_cross_encoder_reranks(server, live_server, tmp_path) -> None:
    """A generating model and an embedding model asked to rerank or score, and the
    cross-encoder asked to embed or chat: each a 400 naming `model`."""
    write_tiny_bert(tmp_path, "mean", True)
    rerank = {"query": "a", "documents": ["b"]}
    score = {"text_1": "a", "text_2": "b"}
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    with running_server(None, engine_config(), model=str(tmp_path)) as embedder:
        with httpx.Client(timeout=60) as c:
            for other in (live_server, embedder):
                assert_error(c.post(f"{other.v1}/rerank", json=rerank), 400, "model")
                assert_error(c.post(f"{other.base_url}/score", json=score), 400, "model")
            assert_error(c.post(f"{server.v1}/embeddings", json={"input": "a"}), 400, "model")
            assert_error(c.post(f"{server.v1}/chat/completions", json=chat), 400, "model")
            assert c.get(f"{server.v1}/models").json()["data"][0]["task"] == "score"


def test_lone_surrogates_are_read_as_replacement_characters(server, reference) -> None:
    """Legal in JSON, without a UTF-8 form: U+FFFD, as the other routes read them."""
    raw = '{"text_1": "the cat\\ud800", "text_2": ["a\\udfff dog", "mat"]}'
    r = httpx.post(
        f"{server.base_url}/score",
        content=raw,
        headers={"content-type": "application/json"},
        timeout=60,
    )
    assert r.status_code == 200, r.text
    pairs = [("the cat\ufffd", "a\ufffd dog"), ("the cat\ufffd", "mat")]
    scores = [d["score"] for d in r.json()["data"]]
    np.testing.assert_allclose(scores, predict(reference, pairs), atol=1e-5, rtol=0)
