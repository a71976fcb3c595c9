"""What every request goes through, on a real server: request ids and the access log,
the API key, the body-size bound, CORS (off unless origins are allowed)."""

import logging
import re
import time
import uuid

import httpx
import openai
import pytest

from tests.live_server import assert_error, running_server

API_KEY = "sk-test-4f3a"
SECOND_KEY = "sk-test-rotated-9c1d"
ORIGIN = "https://app.example.com"
MAX_REQUEST_BYTES = 4096


@pytest.fixture(scope="module")
def guarded(ours_default):
    with running_server(
        ours_default,
        api_keys=[API_KEY, SECOND_KEY],
        metrics_require_api_key=True,
        allowed_origins=[ORIGIN],
        max_request_bytes=MAX_REQUEST_BYTES,
    ) as live:
        yield live


def access_lines(caplog, request_id: str, timeout_s: float = 10.0) -> list[str]:
    """Access-log lines of one request; written when the response has ended, so they may
    arrive a moment after the client has its answer."""
    deadline = time.monotonic() + timeout_s
    while True:
        lines = [
            r.getMessage()
            for r in caplog.records
            if r.name == "llamaserve.access" and r.getMessage().startswith(request_id)
        ]
        if lines or time.monotonic() > deadline:
            return lines
        time.sleep(0.05)


# ---- request ids and the access log ------------------------------------------------------


def test_request_id_is_echoed_or_made(live_server):
    with httpx.Client(base_url=live_server.base_url, timeout=60) as c:
        r = c.get("/v1/models", headers={"X-Request-Id": "client-chosen-id"})
        assert r.headers["x-request-id"] == "client-chosen-id"
        made = {c.get("/v1/models").headers["x-request-id"] for _ in range(3)}
        assert len(made) == 3 and all(re.fullmatch(r"[0-9a-f]{32}", m) for m in made)
        # Errors and streams carry it too.
        r = c.post("/v1/completions", json={"prompt": "Hi", "max_tokens": -1})
        assert r.status_code == 400 and r.headers["x-request-id"]
        body = {"prompt": "Hi", "max_tokens": 1, "stream": True}
        with c.stream("POST", "/v1/completions", json=body, headers={"X-Request-Id": "s1"}) as r:
            assert r.headers["x-request-id"] == "s1"


def test_one_access_log_line_per_request(live_server, caplog):
    caplog.set_level(logging.INFO, logger="llamaserve.access")
    tag = uuid.uuid4().hex[:12]
    with httpx.Client(base_url=live_server.v1, timeout=60) as c:
        r = c.post(
            "/completions",
            json={"prompt": "Hello there", "max_tokens": 3, "temperature": 0},
            headers={"X-Request-Id": f"{tag}-plain"},
        )
        usage = r.json()["usage"]
        body = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2, "stream": True}
        with c.stream(
            "POST", "/chat/completions", json=body, headers={"X-Request-Id": f"{tag}-stream"}
        ) as r:
            r.read()
        c.post("/completions", json={"prompt": 5}, headers={"X-Request-Id": f"{tag}-bad"})

    (plain,) = access_lines(caplog, f"{tag}-plain")
    assert "POST /v1/completions 200" in plain
    assert f"prompt_tokens={usage['prompt_tokens']}" in plain
    assert f"completion_tokens={usage['completion_tokens']}" in plain
    (stream,) = access_lines(caplog, f"{tag}-stream")
    assert "POST /v1/chat/completions 200" in stream and "completion_tokens=2" in stream
    (bad,) = access_lines(caplog, f"{tag}-bad")
    assert "POST /v1/completions 400" in bad


# ---- API key -----------------------------------------------------------------------------


def test_api_key_required(guarded):
    body = {"prompt": "Hi", "max_tokens": 1}
    with httpx.Client(base_url=guarded.v1, timeout=60) as c:
        for headers in (
            {},
            {"Authorization": "Bearer wrong"},
            {"Authorization": API_KEY},
            {"Authorization": f"Basic {API_KEY}"},
            {"Authorization": f"Bearer {API_KEY}x"},
        ):
            error = assert_error(c.post("/completions", json=body, headers=headers), 401)
            assert error["type"] == "authentication_error"
            assert API_KEY not in error["message"]
        assert_error(c.get("/models"), 401)
        assert_error(c.post("/chat/completions", json={"messages": []}), 401)
        # A wrong key is refused before the model name or the fields are looked at.
        assert_error(c.post("/completions", json={**body, "model": "nope"}), 401)
        good = {"Authorization": f"Bearer {API_KEY}"}
        assert c.post("/completions", json=body, headers=good).status_code == 200
        assert c.get("/models", headers=good).status_code == 200
        # Health is for load balancers and needs no key.
        assert c.get(f"{guarded.base_url}/health").status_code == 200


def test_every_key_is_accepted_and_every_route_but_health_is_guarded(guarded):
    base = guarded.base_url
    with httpx.Client(base_url=base, timeout=60) as c:
        for key in (API_KEY, SECOND_KEY):
            r = c.post(
                "/v1/completions",
                json={"prompt": "Hi", "max_tokens": 1},
                headers={"Authorization": f"Bearer {key}"},
            )
            assert r.status_code == 200, r.text
        good = {"Authorization": f"Bearer {SECOND_KEY}"}
        routes = [
            ("POST", "/tokenize", {"prompt": "Hi"}),
            ("POST", "/detokenize", {"tokens": [1, 2]}),
            ("GET", "/metrics", None),
        ]
        for method, path, body in routes:
            assert_error(c.request(method, path, json=body), 401)
            assert_error(
                c.request(method, path, json=body, headers={"Authorization": "Bearer nope"}), 401
            )
            assert c.request(method, path, json=body, headers=good).status_code == 200, path
        assert c.get("/health").status_code == 200


def test_api_key_with_openai_client(guarded):
    name = guarded.state.model_name
    with openai.OpenAI(base_url=guarded.v1, api_key="wrong", max_retries=0) as bad:
        with pytest.raises(openai.AuthenticationError) as info:
            bad.completions.create(model=name, prompt="Hi", max_tokens=1)
        assert info.value.status_code == 401
    with openai.OpenAI(base_url=guarded.v1, api_key=API_KEY, max_retries=0) as good:
        r = good.chat.completions.create(
            model=name, messages=[{"role": "user", "content": "Hi"}], max_tokens=2
        )
        assert r.usage.completion_tokens == 2


# ---- body size ---------------------------------------------------------------------------


def test_oversized_body_is_413(guarded):
    auth = {"Authorization": f"Bearer {API_KEY}", "Content-Type": "application/json"}
    big = b'{"prompt": "' + b"a" * MAX_REQUEST_BYTES + b'", "max_tokens": 1}'
    with httpx.Client(base_url=guarded.v1, timeout=60) as c:
        assert_error(c.post("/completions", content=big, headers=auth), 413)
        # Without a Content-Length (chunked), the bound holds while reading.
        chunks = (big[i : i + 1000] for i in range(0, len(big), 1000))
        assert_error(c.post("/completions", content=chunks, headers=auth), 413)
        # Just under the bound is served (the bytes in a field that costs no compute).
        fits = b'{"prompt": "Hi", "max_tokens": 1, "user": "' + b"u" * 4000 + b'"}'
        assert MAX_REQUEST_BYTES - 100 < len(fits) <= MAX_REQUEST_BYTES
        assert c.post("/completions", content=fits, headers=auth).status_code == 200


# ---- CORS --------------------------------------------------------------------------------

PREFLIGHT = {
    "Origin": ORIGIN,
    "Access-Control-Request-Method": "POST",
    "Access-Control-Request-Headers": "authorization,content-type",
}


def test_cors_off_by_default(live_server):
    with httpx.Client(base_url=live_server.v1, timeout=60) as c:
        r = c.options("/chat/completions", headers=PREFLIGHT)
        assert "access-control-allow-origin" not in r.headers
        r = c.get("/models", headers={"Origin": ORIGIN})
        assert r.status_code == 200 and "access-control-allow-origin" not in r.headers


def test_cors_for_allowed_origins(guarded):
    with httpx.Client(base_url=guarded.v1, timeout=60) as c:
        r = c.options("/chat/completions", headers=PREFLIGHT)
        assert r.status_code == 200
        assert r.headers["access-control-allow-origin"] == ORIGIN
        auth = {"Authorization": f"Bearer {API_KEY}"}
        r = c.get("/models", headers={"Origin": ORIGIN, **auth})
        assert r.headers["access-control-allow-origin"] == ORIGIN
        r = c.options("/chat/completions", headers={**PREFLIGHT, "Origin": "https://evil.test"})
        assert r.headers.get("access-control-allow-origin") != "https://evil.test"
        r = c.get("/models", headers={"Origin": "https://evil.test", **auth})
        assert "access-control-allow-origin" not in r.headers
