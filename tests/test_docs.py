"""The documentation: the MkDocs site builds with --strict (a broken link or anchor, a page
left out of the nav, fails it); every flag `llamaserve serve --help` and `generate --help`
print, read from a real process, is on the generated command-line page, and every metric
family a live server's /metrics exports, parsed by prometheus_client, on the metrics page;
the README stays short and its links lead to files that exist."""

import html
import os
import re
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text()


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    try:
        import mkdocs  # noqa: F401
    except ImportError:
        if os.environ.get("CI"):
            raise
        pytest.skip("mkdocs is not installed (make docs installs it)")
    out = tmp_path_factory.mktemp("site")
    env = {**os.environ, "LLAMASERVE_API_KEY": "sk-must-not-leak"}
    result = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(out)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        env=env,
        timeout=240,
        check=False,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return out


def page_text(site: Path, page: str) -> str:
    """The text of a built page's article: its content without the navigation."""
    built = (site / page / "index.html").read_text()
    article = built[built.index("<article") : built.index("</article>")]
    return html.unescape(re.sub(r"<[^>]+>", "", article))


def help_flags(*command: str) -> set[str]:
    result = subprocess.run(
        [sys.executable, "-m", "server.startup.cli", *command, "--help"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    return set(re.findall(r"(?<![\w-])--[a-z][a-z0-9-]*", result.stdout)) - {"--help"}


@pytest.mark.parametrize("command", ["serve", "generate"])
def test_every_flag_is_on_the_cli_page(site: Path, command: str) -> None:
    flags = help_flags(command)
    assert {"--port", "--max-num-seqs"} <= flags or command == "generate"
    assert "--max-tokens" in flags or command == "serve"
    page = page_text(site, "reference/cli")
    start = page.index(f"llamaserve {command}")
    ends = [page.find(f"llamaserve {other}", start) for other in ("serve", "generate")]
    section = page[start : min([end for end in ends if end > start] + [len(page)])]
    missing = sorted(flag for flag in flags if flag not in section)
    assert not missing, f"not on the command-line page: {missing}"
    assert "sk-must-not-leak" not in page


def test_every_exported_metric_is_on_the_metrics_page(site: Path, live_server) -> None:
    text = httpx.get(f"{live_server.base_url}/metrics", timeout=10).text
    names = {family.name for family in text_string_to_metric_families(text)}
    assert "llamaserve:kv_cache_usage_perc" in names and len(names) > 20
    page = page_text(site, "reference/metrics")
    missing = sorted(name for name in names if name not in page)
    assert not missing, f"not on the metrics page: {missing}"


def test_every_page_is_built(site: Path) -> None:
    for page in (ROOT / "docs").rglob("*.md"):
        built = site / page.relative_to(ROOT / "docs").with_suffix("")
        if page.name == "index.md":
            built = built.parent
        assert (built / "index.html").exists(), page


def test_the_readme_is_short_and_its_links_resolve() -> None:
    assert len(README.splitlines()) <= 150
    links = re.findall(r"\]\(([^)#]+)(?:#[^)]*)?\)", README)
    local = [link for link in links if not link.startswith(("http://", "https://"))]
    assert local
    for link in local:
        assert (ROOT / link).exists(), link
