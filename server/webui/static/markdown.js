// Markdown to DOM nodes, for model output, which is untrusted. Every piece of text
// becomes a text node (textContent), never markup: raw HTML in an answer shows as the
// characters it is made of, and a link keeps its href only for http(s) and mailto.
// Covers what chat answers use: headings, paragraphs, lists (nested by indentation),
// block quotes, tables, fenced code (with a copy button and colouring), rules, and
// inline code, bold, italic, strike-through and links. Half-written input (a stream in
// progress) renders as far as it goes: an open fence runs to the end.

import { highlight } from "./highlight.js";

const FENCE = /^ {0,3}(`{3,}|~{3,})\s*([\w+#.-]*)/;
const HEADING = /^ {0,3}(#{1,6})\s+(.*?)\s*#*\s*$/;
const RULE = /^ {0,3}([-*_])(\s*\1){2,}\s*$/;
const ITEM = /^(\s*)([-*+]|\d{1,9}[.)])\s+(.*)$/;
const QUOTE = /^ {0,3}>\s?(.*)$/;
const TABLE_RULE = /^\s*\|?\s*:?-+:?\s*(\|\s*:?-+:?\s*)*\|?\s*$/;
const INLINE =
  /(`+)([^`]|[^`][\s\S]*?[^`])\1(?!`)|\[([^\]\n]+)\]\(\s*([^)\s]+)\s*\)|\*\*(?=\S)([\s\S]*?\S)\*\*|(?<!\w)__(?=\S)([\s\S]*?\S)__(?!\w)|~~(?=\S)([\s\S]*?\S)~~|\*(?=[^\s*])([\s\S]*?[^\s*])\*|(?<!\w)_(?=[^\s_])([\s\S]*?[^\s_])_(?!\w)/g;
const SAFE_PROTOCOLS = new Set(["http:", "https:", "mailto:"]);

function el(tag, className) {
  const node = document.createElement(tag);
  if (className) node.className = className;
  return node;
}

export function renderMarkdown(text) {
  const root = document.createDocumentFragment();
  blocks(text.replace(/\r\n?/g, "\n").split("\n"), root);
  return root;
}

function blocks(lines, parent) {
  let i = 0;
  while (i < lines.length) {
    const line = lines[i];
    if (!line.trim()) {
      i += 1;
    } else if (FENCE.test(line)) {
      i = codeBlock(lines, i, parent);
    } else if (HEADING.test(line)) {
      const [, hashes, title] = line.match(HEADING);
      const h = el(`h${hashes.length}`);
      inline(title, h);
      parent.append(h);
      i += 1;
    } else if (RULE.test(line)) {
      parent.append(el("hr"));
      i += 1;
    } else if (QUOTE.test(line)) {
      const quoted = [];
      while (i < lines.length && QUOTE.test(lines[i])) quoted.push(lines[i++].match(QUOTE)[1]);
      const q = el("blockquote");
      blocks(quoted, q);
      parent.append(q);
    } else if (ITEM.test(line)) {
      i = list(lines, i, parent);
    } else if (line.includes("|") && i + 1 < lines.length && TABLE_RULE.test(lines[i + 1])) {
      i = table(lines, i, parent);
    } else {
      i = paragraph(lines, i, parent);
    }
  }
}

function startsBlock(lines, i) {
  const line = lines[i];
  return (
    !line.trim() ||
    FENCE.test(line) ||
    HEADING.test(line) ||
    RULE.test(line) ||
    QUOTE.test(line) ||
    ITEM.test(line)
  );
}

function paragraph(lines, i, parent) {
  const taken = [lines[i++]];
  while (i < lines.length && !startsBlock(lines, i)) taken.push(lines[i++]);
  const p = el("p");
  inline(taken.map((l) => l.trim()).join("\n"), p);
  parent.append(p);
  return i;
}

function codeBlock(lines, i, parent) {
  const [, fence, lang] = lines[i].match(FENCE);
  const body = [];
  i += 1;
  while (i < lines.length && !lines[i].trim().startsWith(fence)) body.push(lines[i++]);
  const code = body.join("\n");
  const wrap = el("div", "code");
  const bar = el("div", "code-bar");
  const name = el("span");
  name.textContent = lang || "text";
  const copy = el("button", "copy");
  copy.type = "button";
  copy.textContent = "Copy";
  copy.addEventListener("click", () => copyText(code, copy));
  bar.append(name, copy);
  const pre = el("pre");
  const codeEl = el("code");
  codeEl.append(highlight(code, lang.toLowerCase()));
  pre.append(codeEl);
  wrap.append(bar, pre);
  parent.append(wrap);
  return i + 1;
}

async function copyText(text, button) {
  try {
    await navigator.clipboard.writeText(text);
    button.textContent = "Copied";
  } catch {
    button.textContent = "Copy failed";
  }
  setTimeout(() => (button.textContent = "Copy"), 1500);
}

function list(lines, i, parent) {
  const [, indent, marker] = lines[i].match(ITEM);
  const ordered = /\d/.test(marker);
  const node = el(ordered ? "ol" : "ul");
  if (ordered && parseInt(marker, 10) !== 1) node.start = parseInt(marker, 10);
  const depth = indent.length;
  let loose = false;
  const sameList = (line) => {
    const m = line.match(ITEM);
    return m !== null && m[1].length === depth && /\d/.test(m[2]) === ordered;
  };
  while (i < lines.length && sameList(lines[i])) {
    const m = lines[i].match(ITEM);
    const body = [m[3]];
    i += 1;
    // An item runs on over lines indented past its marker, and over blank lines
    // followed by such lines.
    while (i < lines.length) {
      const next = lines[i];
      if (next.trim() ? !indented(next, depth) : !indented(lines[i + 1] ?? "", depth)) break;
      body.push(next.slice(Math.min(depth + 2, leading(next))));
      i += 1;
    }
    loose ||= body.some((l) => !l.trim());
    const li = el("li");
    blocks(body, li);
    node.append(li);
    while (i + 1 < lines.length && !lines[i].trim() && sameList(lines[i + 1])) {
      loose = true;
      i += 1;
    }
  }
  // A tight list (no blank line in or between its items) shows its items' text bare, as
  // CommonMark does.
  if (!loose) {
    for (const li of node.children) {
      for (const p of [...li.children].filter((c) => c.tagName === "P")) p.replaceWith(...p.childNodes);
    }
  }
  parent.append(node);
  return i;
}

function leading(line) {
  return line.length - line.trimStart().length;
}

function indented(line, depth) {
  return line.trim() !== "" && leading(line) > depth;
}

function cells(line) {
  let row = line.trim();
  if (row.startsWith("|")) row = row.slice(1);
  if (row.endsWith("|")) row = row.slice(0, -1);
  return row.split("|").map((c) => c.trim());
}

function table(lines, i, parent) {
  const head = cells(lines[i]);
  const aligns = cells(lines[i + 1]).map((c) =>
    c.startsWith(":") && c.endsWith(":") ? "center" : c.endsWith(":") ? "right" : "",
  );
  const wrap = el("div", "table");
  const t = el("table");
  const row = (values, tag) => {
    const tr = el("tr");
    head.forEach((_, k) => {
      const cell = el(tag);
      if (aligns[k]) cell.className = `align-${aligns[k]}`;
      inline(values[k] ?? "", cell);
      tr.append(cell);
    });
    return tr;
  };
  const thead = el("thead");
  thead.append(row(head, "th"));
  const tbody = el("tbody");
  i += 2;
  while (i < lines.length && lines[i].includes("|") && lines[i].trim()) tbody.append(row(cells(lines[i++]), "td"));
  t.append(thead, tbody);
  wrap.append(t);
  parent.append(wrap);
  return i;
}

function safeHref(href) {
  try {
    return SAFE_PROTOCOLS.has(new URL(href, window.location.href).protocol) ? href : null;
  } catch {
    return null;
  }
}

function textWithBreaks(text, parent) {
  text.split("\n").forEach((part, k) => {
    if (k) parent.append(el("br"));
    if (part) parent.append(document.createTextNode(part));
  });
}

function inline(text, parent) {
  let last = 0;
  for (const m of text.matchAll(INLINE)) {
    textWithBreaks(text.slice(last, m.index), parent);
    last = m.index + m[0].length;
    if (m[1]) {
      const code = el("code");
      code.textContent = m[2].trim() ? m[2].replace(/^ (.*) $/, "$1") : m[2];
      parent.append(code);
    } else if (m[3]) {
      const href = safeHref(m[4]);
      if (href === null) {
        textWithBreaks(m[0], parent);
        continue;
      }
      const a = el("a");
      a.href = href;
      a.rel = "noopener noreferrer nofollow";
      a.target = "_blank";
      inline(m[3], a);
      parent.append(a);
    } else {
      const [tag, inner] =
        m[5] || m[6] ? ["strong", m[5] || m[6]] : m[7] ? ["s", m[7]] : ["em", m[8] || m[9]];
      const node = el(tag);
      inline(inner, node);
      parent.append(node);
    }
  }
  textWithBreaks(text.slice(last), parent);
}
