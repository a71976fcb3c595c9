"""LoRA adapters through the HTTP API, with the openai client and httpx against a real
uvicorn: a request names its adapter as `model` and gets PEFT's greedy tokens; /v1/models
lists adapters with their base as `parent`; vLLM's load and unload endpoints sit behind
the API key; an unloaded name is a 404 in OpenAI's shape; eviction under load fails nobody."""

import threading

import httpx
import openai
import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families
from transformers import LlamaForCausalLM

from model.loader import load_model
from tests.live_server import assert_error, engine_config, running_server
from tests.lora_adapters import make_adapter
from tests.tiny_models import make_tiny_llama, write_tiny_tokenizer

KEY = "sk-lora"
PROMPT = [5, 9, 101, 7, 300, 44, 2, 17, 250, 33]
NEW_TOKENS = 8


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    base_dir = tmp_path_factory.mktemp("base")
    make_tiny_llama(base_dir)
    write_tiny_tokenizer(base_dir)
    adapters, expected = [], []
    for index in range(3):
        directory = tmp_path_factory.mktemp(f"adapter{index}")
        peft_model = make_adapter(
            LlamaForCausalLM.from_pretrained(base_dir), directory, 8, index == 2, index
        )
        expected.append(greedy_tokens(peft_model))
        adapters.append(directory)
    loaded = load_model(base_dir, dtype="float32", quantization="none", progress=False)
    engine = engine_config(max_loras=1, max_lora_rank=16, max_model_len=256)
    with running_server(
        loaded,
        engine,
        served_model_name=["base"],
        api_keys=[KEY],
        lora_modules={"a0": str(adapters[0]), "a1": str(adapters[1])},
    ) as live:
        yield live, adapters, expected, loaded


def greedy_tokens(peft_model) -> list[int]:
    """PEFT's argmax, token after token (no end-of-text rule, as `ignore_eos`)."""
    ids = list(PROMPT)
    with torch.no_grad():
        for _ in range(NEW_TOKENS):
            ids.append(int(peft_model(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(PROMPT) :]


def text(client: openai.OpenAI, model: str) -> str:
    r = client.completions.create(
        model=model,
        prompt=PROMPT,
        max_tokens=NEW_TOKENS,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    assert r.model == model
    return r.choices[0].text


def test_models_lists_adapters_with_their_parent(setup):
    live, adapters, _, _ = setup
    client = openai.OpenAI(base_url=live.v1, api_key=KEY)
    cards = {m.id: m for m in client.models.list().data}
    assert set(cards) == {"base", "a0", "a1"}
    assert cards["a0"].model_extra["parent"] == "base"
    assert cards["a0"].model_extra["root"] == str(adapters[0])
    assert cards["base"].model_extra.get("parent") is None


def test_a_request_runs_with_the_adapter_its_model_names(setup):
    live, _, expected, loaded = setup
    client = openai.OpenAI(base_url=live.v1, api_key=KEY)
    for name, want in (("a0", expected[0]), ("a1", expected[1])):
        assert text(client, name) == loaded.tokenizer.decode(want)
    assert text(client, "base") not in {loaded.tokenizer.decode(e) for e in expected}
    metrics = httpx.get(f"{live.base_url}/metrics").text
    samples = {
        (s.name, s.labels.get("lora_name")): s.value
        for family in text_string_to_metric_families(metrics)
        for s in family.samples
    }
    assert samples[("llamaserve:lora_requests_total", "a0")] >= 1
    assert samples[("llamaserve:lora_generation_tokens_total", "a1")] >= NEW_TOKENS
    assert samples[("llamaserve:lora_adapters_resident", None)] == 1  # --max-loras 1


def test_load_and_unload_are_guarded_and_answer_in_openai_shape(setup):
    live, adapters, expected, loaded = setup
    body = {"lora_name": "a2", "lora_path": str(adapters[2])}
    r = httpx.post(f"{live.v1}/load_lora_adapter", json=body)
    assert_error(r, 401)
    auth = {"Authorization": f"Bearer {KEY}"}
    r = httpx.post(f"{live.v1}/load_lora_adapter", json=body, headers=auth)
    assert r.status_code == 200, r.text
    assert_error(httpx.post(f"{live.v1}/load_lora_adapter", json=body, headers=auth), 400)
    client = openai.OpenAI(base_url=live.v1, api_key=KEY)
    assert text(client, "a2") == loaded.tokenizer.decode(expected[2])
    r = httpx.post(f"{live.v1}/unload_lora_adapter", json={"lora_name": "a2"}, headers=auth)
    assert r.status_code == 200, r.text
    with pytest.raises(openai.NotFoundError) as caught:
        text(client, "a2")
    assert caught.value.body["code"] == "model_not_found"
    r = httpx.post(f"{live.v1}/unload_lora_adapter", json={"lora_name": "a2"}, headers=auth)
    assert_error(r, 404, "lora_name")
    bad = {"lora_name": "bad", "lora_path": str(adapters[2] / "missing")}
    r = httpx.post(f"{live.v1}/load_lora_adapter", json=bad, headers=auth)
    assert_error(r, 400, "lora_path")


def test_eviction_under_load_fails_no_request(setup):
    """One slot, three adapters and the base at once, while a fourth name comes and goes:
    every request gets its own adapter's tokens."""
    live, adapters, expected, loaded = setup
    client = openai.OpenAI(base_url=live.v1, api_key=KEY, max_retries=0)
    auth = {"Authorization": f"Bearer {KEY}"}
    body = {"lora_name": "a2", "lora_path": str(adapters[2])}
    assert httpx.post(f"{live.v1}/load_lora_adapter", json=body, headers=auth).status_code == 200
    want = {
        n: loaded.tokenizer.decode(e) for n, e in zip(("a0", "a1", "a2"), expected, strict=True)
    }
    want["base"] = text(client, "base")
    got: dict[str, list[str]] = {name: [] for name in want}
    errors: list[BaseException] = []

    def ask(name: str) -> None:
        try:
            for _ in range(3):
                got[name].append(text(client, name))
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=ask, args=(name,)) for name in want]
    for t in threads:
        t.start()
    for _ in range(3):  # a name loaded and unloaded while they run
        extra = {"lora_name": "extra", "lora_path": str(adapters[0])}
        httpx.post(f"{live.v1}/load_lora_adapter", json=extra, headers=auth)
        httpx.post(f"{live.v1}/unload_lora_adapter", json={"lora_name": "extra"}, headers=auth)
    for t in threads:
        t.join(120)
    assert not errors
    assert got == {name: [w] * 3 for name, w in want.items()}
    assert live.engine.runner.adapters.num_loads > 3  # the slot changed hands
    httpx.post(f"{live.v1}/unload_lora_adapter", json={"lora_name": "a2"}, headers=auth)
