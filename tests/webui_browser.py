"""A real headless Chromium (Debian's `chromium` and `chromium-driver`) driven by
Selenium, for the chat page's tests: one browser for the whole session, its console and its
network requests read back from Chrome's own logs; and the steps the tests take on the page
(open it, change settings, send, wait for the answer, read the stored conversation). Where
Chromium is missing the tests skip, except under CI (LLAMASERVE_REQUIRE_BROWSER=1, set by
.ci/run), where they fail."""

from __future__ import annotations

import json
import os
import shutil
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

DESKTOP = (1280, 800)
PHONE = (390, 844)
BY_ID = "document.getElementById"
ANSWER = "document.querySelector('.msg.assistant"
MODELS_LISTED = "document.querySelectorAll('#model option').length"


def browser_binaries() -> tuple[str, str]:
    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    driver = shutil.which("chromedriver")
    if chromium is None or driver is None:
        message = (
            "chromium or chromedriver is not installed "
            "(apt-get install chromium chromium-driver; .ci/run does)"
        )
        if os.environ.get("LLAMASERVE_REQUIRE_BROWSER") == "1":
            pytest.fail(message)
        pytest.skip(message)
    return chromium, driver


@pytest.fixture(scope="session")
def browser() -> Iterator[object]:
    chromium, driver = browser_binaries()
    webdriver = pytest.importorskip("selenium.webdriver")
    options = webdriver.ChromeOptions()
    options.binary_location = chromium
    for flag in (
        "--headless=new",
        "--no-sandbox",  # tests run as root in containers, where the sandbox cannot start
        "--disable-dev-shm-usage",
        "--disable-gpu",
        "--no-first-run",
        "--disable-extensions",
        f"--window-size={DESKTOP[0]},{DESKTOP[1]}",
    ):
        options.add_argument(flag)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL", "performance": "ALL"})
    session = webdriver.Chrome(options=options, service=webdriver.ChromeService(driver))
    session.set_script_timeout(60)
    try:
        yield session
    finally:
        session.quit()


def console_errors(browser) -> list[dict]:
    """What the page logged at error level since the last call (reading empties the log)."""
    return [entry for entry in browser.get_log("browser") if entry["level"] == "SEVERE"]


def requested_urls(browser) -> list[str]:
    """Every URL the page asked for since the last call, from Chrome's network events."""
    urls = []
    for entry in browser.get_log("performance"):
        message = json.loads(entry["message"])["message"]
        if message["method"] == "Network.requestWillBeSent":
            urls.append(message["params"]["request"]["url"])
    return urls


@pytest.fixture(scope="session")
def screenshot_dir(tmp_path_factory) -> Path:
    """Where the page's screenshots go: $LLAMASERVE_WEBUI_SCREENSHOTS, else a temporary
    folder of the test run."""
    chosen = os.environ.get("LLAMASERVE_WEBUI_SCREENSHOTS")
    path = Path(chosen) if chosen else tmp_path_factory.mktemp("webui-screenshots")
    path.mkdir(parents=True, exist_ok=True)
    return path


def wait_for(browser, script: str, timeout_s: float = 60.0) -> object:
    """Polls a JavaScript expression until it is truthy; returns its value."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = browser.execute_script(f"return {script};")
        if value:
            return value
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for: {script}")


def open_page(browser, base_url: str) -> None:
    browser.get(f"{base_url}/")
    wait_for(browser, f"{MODELS_LISTED} || document.getElementById('key-dialog').open")


def fill(browser, element_id: str, value: object) -> None:
    field = browser.find_element("id", element_id)
    field.clear()
    field.send_keys(str(value))


def set_settings(browser, **values: object) -> None:
    browser.find_element("id", "open-settings").click()
    for element_id, value in values.items():
        fill(browser, f"set-{element_id.replace('_', '-')}", value)
    browser.find_element("id", "settings-save").click()
    wait_for(browser, "!document.getElementById('settings').open")


def send(browser, text: str) -> None:
    browser.find_element("id", "prompt").send_keys(text + "\n")  # Enter sends


def wait_answer(browser) -> None:
    # The answer is complete once Send is back and its measurements are written.
    wait_for(browser, f"!{BY_ID}('send').hidden && {ANSWER} .stats')?.textContent")


def current_messages(browser) -> list[dict]:
    return browser.execute_script(
        "const id = JSON.parse(localStorage.getItem('llamaserve.current'));"
        "const all = JSON.parse(localStorage.getItem('llamaserve.conversations'));"
        "return all.find(c => c.id === id).messages;"
    )


def new_chat(browser, base_url: str) -> None:
    """An empty conversation on base_url's page (opened first if another is showing)."""
    if not browser.current_url.startswith(f"{base_url}/"):
        open_page(browser, base_url)
    browser.find_element("id", "new-chat").click()
    wait_for(browser, "!document.querySelector('.msg')")
