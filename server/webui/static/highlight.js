// Syntax colouring for code blocks, as DOM spans around text nodes: comments, strings,
// numbers and keywords of the languages answers use most. One tokenizer for all of them,
// told only which comment style a language has: a colouring aid, not a parser, and it
// never interprets the code as markup.

const HASH_COMMENTS = new Set([
  "python", "py", "sh", "bash", "shell", "zsh", "ruby", "rb", "yaml", "yml", "toml",
  "r", "perl", "dockerfile", "makefile", "ini", "conf", "powershell", "ps1",
]);
const DASH_COMMENTS = new Set(["sql", "lua", "haskell", "hs"]);
const KEYWORDS = new Set(
  (
    "and as assert async await break case catch class const continue def default del do " +
    "elif else enum except export extends false final finally fn for from func function go " +
    "if impl import in interface is lambda let loop match mod module mut new nil none not " +
    "null or package pass private protected pub public raise return self static struct " +
    "super switch this throw true try type typeof use var void while with yield " +
    "select insert update delete where join on group order by limit into values create " +
    "table int float double char bool string long short unsigned echo fi then esac done"
  ).split(" "),
);

function tokenPattern(lang) {
  const comment = HASH_COMMENTS.has(lang)
    ? "#.*"
    : DASH_COMMENTS.has(lang)
      ? "--.*"
      : "\\/\\/.*|\\/\\*[\\s\\S]*?(?:\\*\\/|$)";
  const strings = '"(?:[^"\\\\\\n]|\\\\.)*"?|\'(?:[^\'\\\\\\n]|\\\\.)*\'?|`[^`]*`?';
  const numbers = "\\b(?:0x[\\da-fA-F]+|\\d+(?:\\.\\d+)?(?:e[+-]?\\d+)?)\\b";
  return new RegExp(`(${comment})|(${strings})|(${numbers})|([A-Za-z_]\\w*)`, "g");
}

function span(className, text) {
  const s = document.createElement("span");
  s.className = className;
  s.textContent = text;
  return s;
}

export function highlight(code, lang) {
  const out = document.createDocumentFragment();
  if (["text", "txt", "plain", "markdown", "md"].includes(lang)) {
    out.append(document.createTextNode(code));
    return out;
  }
  let last = 0;
  let plain = "";
  const flush = () => {
    if (plain) out.append(document.createTextNode(plain));
    plain = "";
  };
  for (const m of code.matchAll(tokenPattern(lang))) {
    plain += code.slice(last, m.index);
    last = m.index + m[0].length;
    const kind = m[1] ? "tok-c" : m[2] ? "tok-s" : m[3] ? "tok-n" : KEYWORDS.has(m[4]) ? "tok-k" : "";
    if (!kind) {
      plain += m[0];
      continue;
    }
    flush();
    out.append(span(kind, m[0]));
  }
  plain += code.slice(last);
  flush();
  return out;
}
