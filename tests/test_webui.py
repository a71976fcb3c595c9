"""The chat page at `/` (server/webui/) in a real headless Chromium against a real uvicorn
on the default model: it loads clean and offline, streams the greedy answer the API gives,
stops, renders hostile output inert, asks for the API key, and survives a reload. The
page's headers, weight and `--no-webui` are checked over plain HTTP."""

from __future__ import annotations

import json
import time
from importlib.resources import files

import httpx
import pytest
from fastapi.testclient import TestClient
from prometheus_client.parser import text_string_to_metric_families

from server.api import build_app
from server.edge.metrics import ServerMetrics
from tests.live_server import engine_config, running_server
from tests.webui_browser import (
    DESKTOP,
    PHONE,
    console_errors,
    current_messages,
    fill,
    new_chat,
    open_page,
    requested_urls,
    send,
    set_settings,
    wait_answer,
    wait_for,
)

PAGE_BUDGET_BYTES = 300_000
# Hostile markup, as a model could write it: each piece sets the flag if it ever runs.
PAYLOAD = "<img src=x onerror=__x=1><script>__x=2</script>[go](javascript:__x=3)"


def kv_usage(base_url: str) -> float:
    text = httpx.get(f"{base_url}/metrics", timeout=30).text
    for family in text_string_to_metric_families(text):
        if family.name == "llamaserve:kv_cache_usage_perc":
            return family.samples[0].value
    raise AssertionError("no KV-cache gauge in /metrics")


def test_page_weight_headers_and_switch(live_server) -> None:
    static = files("server.webui").joinpath("static")
    weight = sum(f.stat().st_size for f in static.iterdir() if f.suffix in {".html", ".js", ".css"})
    assert weight < PAGE_BUDGET_BYTES, weight
    page = httpx.get(f"{live_server.base_url}/", timeout=30)
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    policy = page.headers["content-security-policy"]
    assert "script-src 'self';" in policy and "default-src 'none'" in policy
    assert "unsafe-inline" not in policy and "unsafe-eval" not in policy
    assert httpx.head(f"{live_server.base_url}/", timeout=30).status_code == 200
    missing = httpx.get(f"{live_server.base_url}/webui/..%2Fpage.py", timeout=30)
    assert missing.status_code == 404 and missing.json()["error"]["message"]
    # --no-webui: `/` is the bare probe again (an empty 200), and the page's files are gone.
    state = live_server.state
    bare = TestClient(build_app(state, ServerMetrics(state.model_name, 1024, 2048), webui=False))
    assert bare.get("/").content == b"" and bare.head("/").status_code == 200
    assert bare.get("/webui/app.js").status_code == 404


class Built(Exception):
    """Raised by the stand-in for build_server: carries the configuration it was given."""


@pytest.mark.parametrize(("flags", "webui"), [([], True), (["--no-webui"], False)])
def test_the_flag_reaches_the_configuration(monkeypatch, flags: list[str], webui: bool) -> None:
    from server.startup import launch
    from server.startup.cli import build_parser, serve

    def capture(config, **_: object) -> None:
        raise Built(config)

    monkeypatch.setattr(launch, "build_server", capture)
    with pytest.raises(Built) as built:
        argv = ["serve", *flags]
        serve(build_parser().parse_args(argv), argv)
    assert built.value.args[0].webui is webui


def test_loads_clean_and_lists_the_models(browser, live_server) -> None:
    open_page(browser, live_server.base_url)
    listed = httpx.get(f"{live_server.v1}/models", timeout=30).json()["data"]
    options = browser.execute_script(
        "return [...document.querySelectorAll('#model option')].map(o => o.value)"
    )
    assert options == [card["id"] for card in listed]
    assert console_errors(browser) == []
    urls = requested_urls(browser)
    assert f"{live_server.base_url}/webui/app.js" in urls
    assert all(url.startswith(live_server.base_url + "/") for url in urls), urls


def test_answer_streams_equals_greedy_and_survives_reload(
    browser, live_server, screenshot_dir
) -> None:
    set_settings(browser, temperature=0, top_p=1, max_tokens=16)
    browser.execute_script(
        "window.__lengths = [];"
        "new MutationObserver(() => {"
        "  const c = document.querySelector('.msg.assistant .content');"
        "  if (c && !document.getElementById('stop').hidden)"
        "    window.__lengths.push(c.textContent.length);"
        "}).observe(document.getElementById('messages'),"
        "  {childList: true, subtree: true, characterData: true});"
    )
    question = "What is the capital of France?"
    send(browser, question)
    wait_answer(browser)
    grown = sorted(set(browser.execute_script("return window.__lengths")) - {0})
    assert len(grown) >= 3, grown  # seen growing over several frames, not once at the end
    messages = current_messages(browser)
    assert [m["role"] for m in messages] == ["user", "assistant"]
    greedy = httpx.post(
        f"{live_server.v1}/chat/completions",
        json={
            "messages": [{"role": "user", "content": question}],
            "temperature": 0,
            "max_tokens": 16,
        },
        timeout=60,
    ).json()
    assert messages[1]["content"] == greedy["choices"][0]["message"]["content"]
    stats = browser.find_element("css selector", ".msg.assistant .stats").text
    assert f"{greedy['usage']['completion_tokens']} tokens" in stats and "tok/s" in stats
    browser.save_screenshot(str(screenshot_dir / "web-ui-desktop.png"))
    browser.refresh()
    wait_for(browser, "document.querySelectorAll('.msg').length === 2")
    assert browser.find_element("css selector", ".msg.user .content").text == question
    assert question in browser.find_element("id", "conversations").text
    browser.set_window_size(*PHONE)
    try:
        # Under 720 px the sidebar slides away: the screenshot waits until it has.
        wait_for(browser, "document.getElementById('sidebar').getBoundingClientRect().right <= 0")
        browser.save_screenshot(str(screenshot_dir / "web-ui-phone.png"))
        assert browser.execute_script("return document.documentElement.scrollWidth") <= PHONE[0]
    finally:
        browser.set_window_size(*DESKTOP)
    assert console_errors(browser) == []


def test_shift_enter_regenerate_and_edit_resend(browser, live_server) -> None:
    from selenium.webdriver import ActionChains, Keys  # where it is missing, `browser` skips

    new_chat(browser, live_server.base_url)
    set_settings(browser, temperature=0, max_tokens=3)
    prompt = browser.find_element("id", "prompt")
    prompt.send_keys("Name a colour.")
    ActionChains(browser).key_down(Keys.SHIFT).send_keys(Keys.ENTER).key_up(Keys.SHIFT).perform()
    assert prompt.get_attribute("value") == "Name a colour.\n"  # a new line, nothing sent
    assert browser.find_elements("css selector", ".msg") == []
    prompt.send_keys("Briefly.\n")
    wait_answer(browser)
    first = current_messages(browser)
    assert first[0]["content"] == "Name a colour.\nBriefly."
    browser.find_element("css selector", ".msg.assistant .regenerate").click()
    wait_answer(browser)
    again = current_messages(browser)
    assert len(again) == 2 and again[1]["content"] == first[1]["content"]  # greedy: the same
    browser.find_element("css selector", ".msg.user .edit").click()
    edit = browser.find_element("css selector", ".msg.user .edit-box")
    edit.clear()
    edit.send_keys("Name a fruit.")
    browser.find_element("css selector", ".msg.user .resend").click()
    wait_answer(browser)
    edited = current_messages(browser)
    assert [m["role"] for m in edited] == ["user", "assistant"]
    assert edited[0]["content"] == "Name a fruit."
    titles = browser.find_element("id", "conversations").text
    assert "Name a colour." in titles  # the conversation keeps its name


def test_stop_ends_the_stream_and_frees_the_kv_blocks(browser, live_server) -> None:
    new_chat(browser, live_server.base_url)
    set_settings(browser, max_tokens=800)
    send(browser, "Write a very long story about a dragon who learns to cook.")
    wait_for(browser, "document.querySelector('.msg.assistant .content')?.textContent.length > 0")
    browser.find_element("id", "stop").click()
    wait_answer(browser)
    assert "stopped" in browser.find_element("css selector", ".msg.assistant .stats").text
    deadline = time.monotonic() + 30
    while kv_usage(live_server.base_url) != 0 and time.monotonic() < deadline:
        time.sleep(0.1)
    assert kv_usage(live_server.base_url) == 0
    assert live_server.wait_kv_free() == 0


def test_server_errors_show_the_servers_message(browser, live_server) -> None:
    new_chat(browser, live_server.base_url)
    set_settings(browser, max_tokens=100_000)  # past the context: a 400
    send(browser, "Hello")
    wait_answer(browser)
    refused = httpx.post(
        f"{live_server.v1}/chat/completions",
        json={
            "messages": [{"role": "user", "content": "Hello"}],
            "max_tokens": 100_000,
            "stream": True,
        },
        timeout=30,
    )
    assert refused.status_code == 400
    shown = browser.find_element("css selector", ".msg.assistant .error")
    assert shown.text == refused.json()["error"]["message"]
    # Chrome logs the refused request itself; nothing else may be there.
    assert all("400" in entry["message"] for entry in console_errors(browser))


def test_a_busy_server_shows_its_503_and_a_retry(browser, ours_default) -> None:
    # No room in the waiting queue: every request is turned away with 503 and Retry-After.
    with running_server(ours_default, engine=engine_config(max_waiting=0)) as server:
        body = {"messages": [{"role": "user", "content": "Hello"}], "stream": True}
        refused = httpx.post(f"{server.v1}/chat/completions", json=body, timeout=30)
        assert refused.status_code == 503
        open_page(browser, server.base_url)
        send(browser, "Hello")
        wait_answer(browser)
        shown = browser.find_element("css selector", ".msg.assistant .error").text
        assert shown.startswith(refused.json()["error"]["message"])
        assert f"retry in {refused.headers['retry-after']} s" in shown
        retry = browser.find_element("css selector", ".msg.assistant .regenerate")
        assert retry.text == "Retry"
        retry.click()
        wait_answer(browser)
        assert len(browser.find_elements("css selector", ".msg.assistant")) == 1
        assert all("503" in entry["message"] for entry in console_errors(browser))


def test_hostile_output_runs_nothing(browser, live_server) -> None:
    new_chat(browser, live_server.base_url)
    schema = json.dumps({"type": "string", "const": PAYLOAD})
    set_settings(browser, max_tokens=120, schema=schema)
    send(browser, "Say something.")
    wait_answer(browser)
    assert json.loads(current_messages(browser)[1]["content"]) == PAYLOAD  # forced, not luck
    answer = browser.find_element("css selector", ".msg.assistant .content")
    assert "<img src=x onerror=__x=1>" in answer.text and "<script>" in answer.text
    assert answer.find_elements("css selector", "img, script, iframe, [onerror]") == []
    links = [a.get_attribute("href") for a in answer.find_elements("css selector", "a")]
    assert links == []
    assert browser.execute_script("return typeof window.__x") == "undefined"
    # The second wall: were the renderer ever to pass the markup on as HTML, the page's
    # Content-Security-Policy still runs none of it (Chrome logs each refusal, and the 404
    # of the image's `x`).
    browser.execute_script(
        "const box = document.createElement('div');"
        "box.innerHTML = arguments[0];"
        "document.body.append(box);"
        "const s = document.createElement('script');"
        "s.textContent = '__x = 4';"
        "document.body.append(s);",
        PAYLOAD,
    )
    time.sleep(0.3)  # the image's error event fires after the failed load
    assert browser.execute_script("return typeof window.__x") == "undefined"
    refusals = console_errors(browser)
    assert any("Content Security Policy" in e["message"] for e in refusals), refusals
    set_settings(browser, schema="")


def test_api_key_is_asked_and_a_wrong_one_shows_the_401(browser, ours_default) -> None:
    key = "webui-test-key"
    with running_server(ours_default, api_keys=[key], reasoning_parser="deepseek_r1") as server:
        open_page(browser, server.base_url)
        assert browser.execute_script("return document.getElementById('key-dialog').open")
        fill(browser, "key-input", "wrong-key")
        browser.find_element("id", "key-save").click()
        refused = httpx.get(
            f"{server.v1}/models", headers={"Authorization": "Bearer wrong-key"}, timeout=30
        )
        assert refused.status_code == 401
        message = refused.json()["error"]["message"]
        wait_for(
            browser, f"document.getElementById('key-error').textContent === {json.dumps(message)}"
        )
        fill(browser, "key-input", key)
        browser.find_element("id", "key-save").click()
        wait_for(browser, "document.querySelectorAll('#model option').length")
        # deepseek_r1: the output begins inside the think block, so it all streams as
        # reasoning_content, which the page folds above the (here empty) answer.
        set_settings(browser, temperature=0, max_tokens=6)
        send(browser, "Hi")
        wait_answer(browser)
        first = browser.find_element("css selector", ".msg.assistant > :first-child")
        assert first.tag_name == "details" and first.get_attribute("open") is None
        assert current_messages(browser)[1]["reasoning"]
        assert all("401" in entry["message"] for entry in console_errors(browser))
