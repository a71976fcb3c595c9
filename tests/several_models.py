"""The models and references of tests/test_multimodel.py: tiny checkpoints of two
generating families and an embedding BERT, written by `transformers`; their greedy text
and embeddings by `transformers` itself; and the processes of a front, from /proc."""

import re
from pathlib import Path

import torch
from tokenizers import Tokenizer
from transformers import AutoModelForCausalLM, BertModel

from tests.test_embedding_models import reference, write_tiny_bert
from tests.test_tensor_parallel_server import children
from tests.tiny_families import make_tiny
from tests.tiny_models import make_tiny_llama, write_tiny_tokenizer


def write_model_set(root: Path) -> None:
    """The tiny llama, qwen (another family, another vocabulary) and bert, and `broken`:
    llama's files with a corrupt weights file."""
    for name in ("llama", "qwen", "bert", "broken"):
        (root / name).mkdir()
    make_tiny_llama(root / "llama")
    write_tiny_tokenizer(root / "llama")
    # Another family and a smaller vocabulary: the same prompt has other token ids and
    # another count, and an id of one model is no token of the other.
    make_tiny("qwen2", root / "qwen", vocab_size=300)
    write_tiny_tokenizer(root / "qwen", vocab_size=300)
    write_tiny_bert(root / "bert", "mean", True)
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        (root / "broken" / name).write_bytes((root / "llama" / name).read_bytes())
    (root / "broken" / "model.safetensors").write_bytes(
        b"\x08\x00\x00\x00\x00\x00\x00\x00{}garbage"
    )


def greedy_reference(directory: Path, prompt: str, max_tokens: int) -> tuple[int, str]:
    """Prompt token count and greedy continuation by transformers and `tokenizers`."""
    tok = Tokenizer.from_file(str(directory / "tokenizer.json"))
    model = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()
    ids = tok.encode(prompt).ids
    out = list(ids)
    with torch.no_grad():
        for _ in range(max_tokens):
            out.append(int(model(torch.tensor([out])).logits[0, -1].argmax()))
    return len(ids), tok.decode(out[len(ids) :], skip_special_tokens=False)


def reference_embedding(directory: Path, text: str) -> torch.Tensor:
    tok = Tokenizer.from_file(str(directory / "tokenizer.json"))
    tok.no_padding()
    model = BertModel.from_pretrained(directory).eval()
    return reference(model, [tok.encode(text).ids], "mean", True)[0]


def total_rss(pid: int) -> int:
    total = 0
    for p in [pid, *children(pid)]:
        try:
            status = Path(f"/proc/{p}/status").read_text()
        except FileNotFoundError:
            continue
        total += int(re.search(r"VmRSS:\s+(\d+)", status).group(1)) * 1024
    return total


def model_pid(front_pid: int, name: str) -> int:
    for pid in children(front_pid):
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        if argv[argv.index(b"--served-model-name") + 1] == name.encode():
            return pid
    raise AssertionError(f"no process serves {name}")
