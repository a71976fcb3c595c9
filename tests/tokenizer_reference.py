"""What the tokenizer and chat-template tests compare against: a deterministic multilingual
corpus built in code (no downloads), and transformers' tokenizer for the default GGUF.

Each corpus case is a short text (a line or a few lines) chosen to exercise what pre-tokenizers
and byte-level BPE get wrong: whitespace runs before digits, non-ASCII numerals, contractions, code
indentation, CJK, emoji sequences that span several tokens, and unusual whitespace.

The GGUF and transformers' tokenizer for it take seconds each to load, so they are loaded once per
test process and shared; callers must not modify them.
"""

import functools
import json
import random
from typing import Any

from tokenizers import Tokenizer as HFBackend
from tokenizers import pre_tokenizers
from transformers import AutoTokenizer, PreTrainedTokenizerBase

from model.checkpoint.default_model import default_model_path
from model.checkpoint.gguf_file import open_gguf

PROSE_WORDS = (
    "the of and to in is was for on that with as by at from his her it an were are which this "
    "be or has had one their not but all new more two after first also who other they been "
    "time into most only over city when world state year many three people school during "
    "government between before under university known later national however while since "
    "model token server request stream latency budget cache block prefix engine kernel "
    "Hello World Python OpenAI Llama SmolLM London Paris McDonald's O'Neil iPhone eBay"
).split()
CONTRACTIONS = ("don't", "it's", "I'M", "YOU'RE", "we've", "they'll", "she'd", "'S", "o'clock")

MULTILINGUAL = (
    "Der schnelle braune Fuchs springt über den faulen Hund. Größe, Straße, Ärger, Öl.",
    "Le cœur a ses raisons que la raison ne connaît point. Où est l'hôtel ? Très bien !",
    "¿Dónde está la biblioteca? ¡Qué día tan bonito! Mañana será otro día, señor Núñez.",
    "Съешь же ещё этих мягких французских булок, да выпей чаю. Привет, мир!",
    "Ξεσκεπάζω την ψυχοφθόρα βδελυγμία. Καλημέρα κόσμε, τι κάνεις;",
    "مرحبا بالعالم. هذه جملة عربية للاختبار مع أرقام ١٢٣ و ٤٥٦.",
    "שלום עולם. זהו משפט בעברית לבדיקה.",
    "नमस्ते दुनिया। यह हिंदी में एक परीक्षण वाक्य है। संख्या १२३४।",
    "สวัสดีชาวโลก นี่คือประโยคทดสอบภาษาไทย",
    "你好，世界！今天天气很好，我们去公园散步吧。机器学习模型需要大量数据。中文分词很有趣。",
    "東京は日本の首都です。ひらがな、カタカナ、漢字を混ぜて書きます。ラーメンが好きです。",
    "안녕하세요 세계! 오늘은 날씨가 좋네요. 한국어 문장을 시험합니다.",
    "Tiếng Việt có dấu: Xin chào, tôi tên là Nguyễn. Cảm ơn bạn rất nhiều.",
    "Türkçe: Çok güzel bir gün, ağaçlar yeşil. İstanbul'da ışıklar yanıyor.",
    "Polski: Zażółć gęślą jaźń. Čeština: Příliš žluťoučký kůň úpěl ďábelské ódy.",
    "Combining marks: Cafe\u0301 nai\u0308ve Z\u0351\u0300a\u0300\u0301l\u0360g\u0328o",
    "Devanagari vowel sign \u0915\u093f and Hangul jamo \u1100\u1161",
    "Ṭhē qüïck ẞrown fōx ǰumps — “quoted” ‘text’ … «guillemets» „Anführung“ ‹single›",
)
EMOJI = (
    "🤖",
    "😀😃😄",
    "👍🏽",
    "👨‍👩‍👧‍👦",
    "🇫🇷🇯🇵",
    "1️⃣",
    "❤️",
    "🏳️‍🌈",
    "🧑🏿‍💻",
    "✅ done ❌ failed ⚠️ warn",
    "I ❤ tokens 🎉🎉",
)
NUMERALS = (
    "  12",
    "\n\n1.",
    " 3.14159",
    "1,000,000",
    "x = 42;",
    "½ ² Ⅻ ①",
    "٣٤٥",
    "１２３",
    "१२३",
    "10^9",
    "v2.0.1",
    "0xFF00",
    "2024-06-01T12:30:45Z",
    "+1 (555) 010-9999",
    "    123456789",
    "\t7",
    "³⁄₄ ⅔ ⑫ ⓵",
    "No. 5: $12.50 (≈ €11,20)",
)
WHITESPACE = (
    "a  b   c    d",
    "trailing spaces   ",
    "\ttab\tseparated\tvalues\t",
    "line one\r\nline two\r\n",
    "nbsp\u00a0here\u00a0\u00a0twice",
    "ideographic\u3000space",
    "em\u2003space and thin\u2009space",
    "zero\u200bwidth\u200djoiner",
    "form\x0cfeed and vertical\x0btab",
    "\n\n\n\nmany newlines\n\n",
    "   leading spaces",
    " \n \n mixed \t \n",
)
CODE = (
    "def forward(self, x: torch.Tensor) -> torch.Tensor:\n    return self.w2(F.silu(self.w1(x)))\n",
    "for (int i = 0; i < n; ++i) {\n\tsum += a[i] * b[i];\n}\n",
    "const items = data.filter((d) => d.score >= 0.5).map(({ id }) => id);\n",
    "SELECT name, COUNT(*) AS n FROM users WHERE age > 30 GROUP BY name;\n",
    '{"model": "smollm", "max_tokens": 128, "temperature": 0.7, "stop": ["\\n"]}',
    "1. First item\n2. Second item\n\n3. Third item after a blank line\n",
    "- [ ] todo\n- [x] done\n  - nested 42\n",
    "| col | 1 | 2 |\n|-----|---|---|\n| a   | 3 | 4 |\n",
    '#!/usr/bin/env bash\nset -euo pipefail\necho "$HOME" && ls -la ~/.cache 2>/dev/null\n',
    "    if x == 10:\n        y = x ** 2  # square it\n",
    "<div class=\"row\"><span id='x1'>&nbsp;&lt;tag&gt;</span></div>",
    "https://example.com/path?q=a+b&n=12#frag user@example.org",
    "s = '''it's a \"quote\"'''; print(f\"{s!r:>20}\")",
    "x'y'z 'quoted' can't won't 'll 've 're 'ſ",
)


def _sentence(rng: random.Random) -> str:
    words = [rng.choice(PROSE_WORDS) for _ in range(rng.randint(4, 14))]
    if rng.random() < 0.4:
        words.insert(rng.randrange(len(words)), rng.choice(CONTRACTIONS))
    if rng.random() < 0.3:
        words.insert(rng.randrange(len(words)), str(rng.randint(0, 10 ** rng.randint(1, 7))))
    text = " ".join(words)
    return text[0].upper() + text[1:] + rng.choice(".!?;:,") + rng.choice(["", " ", "  ", "\n"])


def _case(rng: random.Random) -> str:
    pools = (MULTILINGUAL, EMOJI, NUMERALS, WHITESPACE, CODE)
    parts = []
    for _ in range(rng.randint(1, 5)):
        if rng.random() < 0.35:
            parts.append(_sentence(rng))
        else:
            parts.append(rng.choice(rng.choice(pools)))
    joiners = ["", " ", "  ", "\n", "\n\n", "\t", " \n"]
    return "".join(part + rng.choice(joiners) for part in parts)


def build_corpus(min_bytes: int = 60_000, seed: int = 0) -> list[str]:
    """Every fixed fragment once on its own, then random mixtures until `min_bytes` of UTF-8."""
    cases = [*MULTILINGUAL, *EMOJI, *NUMERALS, *WHITESPACE, *CODE]
    rng = random.Random(seed)
    while sum(len(c.encode("utf-8")) for c in cases) < min_bytes:
        cases.append(_case(rng))
    return cases


def smollm_pre_tokenizer() -> pre_tokenizers.PreTokenizer:
    """The pre-tokenizer of SmolLM2's own tokenizer.json, which transformers' GGUF loader drops
    (FACTS.md Trap 2); llama.cpp's `smollm` pre-tokenizer agrees with it."""
    return pre_tokenizers.Sequence(
        [
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
        ]
    )


@functools.cache
def smollm2_metadata() -> dict[str, Any]:
    return open_gguf(default_model_path()).metadata


@functools.cache
def smollm2_hf_tokenizer() -> PreTrainedTokenizerBase:
    path = default_model_path()
    hf = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    hf.backend_tokenizer.pre_tokenizer = smollm_pre_tokenizer()
    return hf


def gemma3_whitespace_runs_restored(hf: PreTrainedTokenizerBase) -> HFBackend:
    """transformers' tokenizer for a Gemma 3 GGUF with its whitespace runs made added tokens again.

    Gemma has 30 tokens for runs of 2 to 31 spaces, user-defined in the GGUF (token type 4,
    spelled with real spaces). llama.cpp matches them whole in the text before any merge, longest
    first, and so does SentencePiece given the same pieces as user-defined symbols. transformers'
    GGUF loader instead respells them "▁▁".. as ordinary BPE vocabulary reached by merges ranked
    by id, which agrees only up to 31 spaces: 32 spaces become 16 + 16 where SentencePiece and
    llama.cpp write 31 + 1. Here the runs are spelled with spaces again, their merges dropped,
    and they are added tokens matched in the raw text, as the token types say. One other
    difference follows, on llama.cpp's side: a literal "▁" in the input no longer joins a run
    (SentencePiece, matching after escaping, lets it, and so does unpatched transformers)."""
    spec = json.loads(hf.backend_tokenizer.to_str())
    vocab = spec["model"]["vocab"]
    runs = {"▁" * n: " " * n for n in range(2, 32) if "▁" * n in vocab}
    for spelled, spaces in runs.items():
        vocab[spaces] = vocab.pop(spelled)
    merges = [m.split(" ") if isinstance(m, str) else m for m in spec["model"]["merges"]]
    spec["model"]["merges"] = [m for m in merges if not {*m, "".join(m)} & runs.keys()]
    flags = dict.fromkeys(("single_word", "lstrip", "rstrip", "normalized", "special"), False)
    spec["added_tokens"] += [{"id": vocab[t], "content": t, **flags} for t in runs.values()]
    return HFBackend.from_str(json.dumps(spec))
