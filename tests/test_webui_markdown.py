"""The chat page's Markdown renderer (server/webui/static/markdown.js), run in the real
browser, against markdown-it-py (CommonMark with tables, strike-through and hard line
breaks, raw HTML off) as the independent reference: the same answers give the same tree
of elements and text. Hostile input must come out as text, as it does there."""

from __future__ import annotations

from html.parser import HTMLParser

import pytest
from markdown_it import MarkdownIt

ANSWERS = [
    "# Plan\n\nSome **bold**, *italic*, `code` and ~~gone~~ words, snake_case_name kept.\n\n"
    "## Steps\n\n1. First\n2. Second, see [the docs](https://example.com/docs)\n"
    "   - nested a\n   - nested b\n3. Third\n\n> a *quoted* line\n\n---\n\n"
    "| name | value |\n|------|------:|\n| a | **1** |\n| b | `2` |\n\n"
    "```python\ndef f(x):\n    return x + 1  # one more\n```\n\nline one\nline two",
    "3. three\n4. four\n\n- loose a\n\n- loose b\n\n```\nplain <b>code</b>\n```",
    "### Notes ###\n* one\n* two\n  1. sub one\n  2. sub two\n\nUse ``a `tick` inside`` and "
    '**bold *nested* text**.\n\n~~~js\nconst s = "// not a comment"; // comment\n~~~\n\n'
    "| a | b |\n| :-- | :-: |\n| only one |\n",
    "<b>raw</b> <img src=x onerror=alert(1)> [click](javascript:alert(1)) "
    "<script>alert(2)</script>\n\n<div onclick=alert(3)>block</div>\n\n"
    "[data](data:text/html,<script>alert(4)</script>) and __init__ stays",
]

# The page's tree: each element as {tag, children}, with an anchor's href and a list's
# start; the code block's header (language, copy button) and the colouring spans are the
# page's own additions and are read through.
PAGE_TREE = """
const [answers, done] = arguments;
import('/webui/markdown.js').then((m) => {
  const tree = (node) => {
    if (node.nodeType === Node.TEXT_NODE) return node.data;
    const tag = node.tagName.toLowerCase();
    if (tag === 'div' && node.classList.contains('code')) return tree(node.querySelector('pre'));
    if (tag === 'div' && node.classList.contains('table')) return tree(node.querySelector('table'));
    if (tag === 'span') return node.textContent;
    const out = {tag, children: [...node.childNodes].map(tree)};
    if (tag === 'a') out.href = node.getAttribute('href');
    if (tag === 'ol' && node.start !== 1) out.start = node.start;
    return out;
  };
  done(answers.map((text) => {
    const box = document.createElement('div');
    box.append(m.renderMarkdown(text));
    return tree(box).children;
  }));
}).catch((error) => done(String(error)));
"""


class TreeBuilder(HTMLParser):
    """markdown-it's HTML as the same tree."""

    VOID = {"br", "hr", "img"}

    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.root: dict = {"tag": "div", "children": []}
        self.stack = [self.root]

    def handle_starttag(self, tag: str, attrs: list) -> None:
        node: dict = {"tag": tag, "children": []}
        attributes = dict(attrs)
        if tag == "a":
            node["href"] = attributes.get("href")
        if tag == "ol" and attributes.get("start", "1") != "1":
            node["start"] = int(attributes["start"])
        self.stack[-1]["children"].append(node)
        if tag not in self.VOID:
            self.stack.append(node)

    def handle_endtag(self, tag: str) -> None:
        if tag not in self.VOID:
            self.stack.pop()

    def handle_data(self, data: str) -> None:
        self.stack[-1]["children"].append(data)


def reference_tree(text: str) -> list:
    md = MarkdownIt("commonmark", {"breaks": True, "html": False}).enable(
        ["table", "strikethrough"]
    )
    builder = TreeBuilder()
    builder.feed(md.render(text))
    return builder.root["children"]


def tidy(children: list, in_code: bool = False) -> list:
    """Merges neighbouring text; whitespace counts only inside code blocks (and there the
    final newline markdown-it keeps does not)."""
    out: list = []
    for child in children:
        if isinstance(child, str):
            if out and isinstance(out[-1], str):
                out[-1] += child
            else:
                out.append(child)
        else:
            code = in_code or child["tag"] == "pre"
            out.append({**child, "children": tidy(child["children"], code)})
    if in_code:
        return [c.rstrip("\n") if isinstance(c, str) else c for c in out]
    return [
        " ".join(c.split()) if isinstance(c, str) else c
        for c in out
        if not isinstance(c, str) or c.strip()
    ]


@pytest.fixture(scope="module")
def page_trees(browser, live_server) -> list:
    browser.get(f"{live_server.base_url}/")
    trees = browser.execute_async_script(PAGE_TREE, ANSWERS)
    assert isinstance(trees, list), trees
    return trees


@pytest.mark.parametrize("index", range(len(ANSWERS)))
def test_renders_as_commonmark_does(page_trees, index: int) -> None:
    assert tidy(page_trees[index]) == tidy(reference_tree(ANSWERS[index]))


def test_hostile_markup_stays_text(page_trees) -> None:
    def tags(nodes: list) -> set[str]:
        found = set()
        for node in nodes:
            if isinstance(node, dict):
                found |= {node["tag"]} | tags(node["children"])
        return found

    assert tags(page_trees[3]) & {"a", "b", "img", "script", "div"} == set()
