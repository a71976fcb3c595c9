"""A real headless Chromium (Debian's `chromium` and `chromium-driver`) driven by
Selenium, for the chat page's tests: one browser for the whole session, its console and its
network requests read back from Chrome's own logs. Where Chromium is missing the tests
skip, except under CI (LLAMASERVE_REQUIRE_BROWSER=1, set by .ci/run), where they fail."""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest

DESKTOP = (1280, 800)
PHONE = (390, 844)


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
