"""The endpoints a router calls on a replica besides the OpenAI API, on the live server:
render gives the ids /tokenize (and so /v1/completions) gives, and refuses what
/v1/completions refuses; the load endpoints count what the scheduler holds."""

import httpx


def test_completion_render_gives_the_ids_tokenize_gives(live_server) -> None:
    prompt = "The capital of France is"
    tokens = httpx.post(f"{live_server.base_url}/tokenize", json={"prompt": prompt}).json()
    url = f"{live_server.v1}/completions/render"
    texts = httpx.post(url, json={"prompt": [prompt, "Water boils at"]})
    assert texts.status_code == 200
    body = texts.json()
    assert len(body) == 2 and body[0]["token_ids"] == tokens["tokens"]
    assert all(r["model"] == live_server.state.model_name for r in body)
    ids = httpx.post(url, json={"prompt": [[5, 6], [7]]}).json()
    assert [r["token_ids"] for r in ids] == [[5, 6], [7]]


def test_completion_render_refuses_what_completions_refuses(live_server) -> None:
    for prompt in ([[1, 2], []], [-5], [10**12], ""):
        reply = httpx.post(f"{live_server.v1}/completions/render", json={"prompt": prompt})
        assert reply.status_code == 400, prompt
        assert reply.json()["error"]["param"].startswith("prompt")


def test_load_endpoints_count_running_and_waiting(live_server) -> None:
    idle = httpx.get(f"{live_server.base_url}/get_load").json()
    assert idle == {"load": 0, "num_reqs": 0, "num_waiting_reqs": 0}
    assert httpx.get(f"{live_server.base_url}/load").json() == {"server_load": 0}
    body = {"prompt": "Once upon a time", "max_tokens": 64, "stream": True, "ignore_eos": True}
    with httpx.stream("POST", f"{live_server.v1}/completions", json=body, timeout=60) as response:
        lines = response.iter_lines()
        next(line for line in lines if line.startswith("data: {"))
        busy = httpx.get(f"{live_server.base_url}/get_load").json()
        assert busy["load"] == busy["num_reqs"] + busy["num_waiting_reqs"] >= 1
        for _ in lines:
            pass
