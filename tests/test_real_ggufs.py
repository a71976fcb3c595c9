"""Real GGUFs fetched from PyPI against `transformers` loading the same file: the same
greedy continuations in float32 for Qwen2.5-Coder-0.5B-Instruct (`qwen2`; Q4_K_M: Q4_K,
Q5_0, Q6_K and Q8_0 tensors, untied output) and Gemma 3 270M (`gemma3`: head_dim 256,
windowed layers of 512 among global ones, a 262,144-token SentencePiece vocabulary), and
for Qwen the same token ids on a varied corpus with every special token (Gemma's
tokenizer: tests/test_spm_tokenizer.py); and their Q5_0 layers against the `gguf`
package's dequantisation, and their Q6_K ones against int6."""

import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as T
from gguf.quants import dequantize

from model.checkpoint.gguf_file import open_gguf
from model.checkpoint.pypi_models import pypi_model_path
from model.loader import load_model
from model.quant.base import INT4_GROUP
from model.quant.int5 import _grid_step
from model.quant.int6 import Int6Linear
from scheduler.config import EngineConfig
from scheduler.engine.factory import create_engine
from scheduler.sampling_params import SamplingParams
from tests.engine_driver import run_engine
from tests.real_references import hf_model_of, hf_tokenizer_of
from tests.tokenizer_reference import build_corpus

pytestmark = pytest.mark.slow

PROMPTS = [
    "def quicksort(arr):",
    "The capital of France is",
    "# Write a function that reverses a string\n",
    "import numpy as np\n\n",
    "SELECT name FROM",
    "Once upon a time",
    "1, 2, 3, 4,",
    "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n",
]


CONTINUATION = 32  # tokens each prompt continues by

# Past Gemma's window of 512 positions.
LONG = " ".join(f"Item {i} of the list is the word number {i * 7 % 13}." for i in range(60))


@pytest.fixture(scope="module", params=["qwen2.5-coder-0.5b-instruct", "gemma-3-270m"])
def real(request):
    path = pypi_model_path(request.param)
    return path, load_model(path, dtype=torch.float32, progress=False)


def test_qwen_tokenizer_matches_transformers(real) -> None:
    qwen_path, ours = real
    if ours.config.architecture != "qwen2":
        pytest.skip("Gemma's tokenizer has its own tests")
    hf = hf_tokenizer_of(qwen_path)
    specials = ["<|im_start|>", "<|im_end|>", "<|endoftext|>", "<tool_call>", "</tool_call>"]
    specials += ["<|fim_prefix|>", "<|fim_middle|>", "<|fim_suffix|>", "<|repo_name|>"]
    corpus = build_corpus() + [f"a{s}b {s}\n{s}" for s in specials]
    for text in corpus:
        want = hf.encode(text, add_special_tokens=False)
        assert ours.tokenizer.encode(text, allow_special=True) == want, text
        assert ours.tokenizer.decode(want) == hf.decode(want), text


CONVERSATIONS = [
    [{"role": "user", "content": "Write a function that reverses a string."}],
    [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi! 你好 🙂"},
        {"role": "assistant", "content": "Hello."},
        {"role": "user", "content": "What is 2+2?"},
    ],
]


def test_chat_template_matches_transformers(real) -> None:
    """The file's own chat template, rendered and tokenized, as transformers does from the
    same GGUF; a file without one (Gemma 3 270M is a base model) has none in either."""
    path, ours = real
    hf = hf_tokenizer_of(path)
    if hf.chat_template is None:
        assert ours.chat_template is None
        return
    for messages in CONVERSATIONS:
        want = hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        assert ours.chat_template.render(messages) == want
        ids = ours.chat_template.prompt_ids(messages, ours.tokenizer)
        assert ids == hf.encode(want, add_special_tokens=False)


def test_greedy_continuations_match_transformers(real) -> None:
    """transformers, teacher-forced on our continuation, predicts each of its tokens: its
    own greedy generation would be the same 32 tokens (one forward per prompt rather than
    32 steps). Ours come from the engine, all prompts in one batch; past Gemma's 512-token
    window on one prompt."""
    path, ours = real
    # A fixed step budget: no start-up timing of a prefill chunk.
    engine = create_engine(ours.model, ours.tokenizer, EngineConfig(max_num_batched_tokens=1024))
    params = SamplingParams(max_tokens=CONTINUATION, temperature=0.0, ignore_eos=True)
    prompts = [ours.tokenizer.encode(text, allow_special=True) for text in PROMPTS]
    if ours.config.sliding_window:
        prompts[-1] = prompts[-1] + ours.tokenizer.encode(LONG)
    results, _ = run_engine(engine, {str(i): (ids, params) for i, ids in enumerate(prompts)})
    hf = hf_model_of(path)
    for i, ids in enumerate(prompts):
        got = results[(str(i), 0)].token_ids
        assert len(got) == CONTINUATION
        with torch.no_grad():
            logits = hf(torch.tensor([ids + got[:-1]]), logits_to_keep=len(got)).logits[0]
        assert logits.argmax(-1).tolist() == got, PROMPTS[i]


def some_layers_in(path, config, qtype: T) -> list[tuple[str, torch.Tensor]]:
    """The matrices of type `qtype` in the file's first, middle and last layers, by name,
    dequantised by the `gguf` package."""
    n = config.n_layers
    layers = tuple(f"blk.{i}." for i in (0, n // 2, n - 1))
    tensors = [t for t in open_gguf(path).tensors if t.tensor_type == qtype]
    block_weights, block_bytes = GGML_QUANT_SIZES[qtype]
    matrices = []
    for tensor in (t for t in tensors if t.name.startswith(layers)):
        rows, width = tensor.shape[1], tensor.shape[0]
        size = rows * width // block_weights * block_bytes
        raw = np.fromfile(path, dtype=np.uint8, count=size, offset=tensor.offset)
        blocks = raw.reshape(rows, width // block_weights * block_bytes)
        matrices.append((tensor.name, torch.from_numpy(dequantize(blocks, qtype).copy())))
    return matrices


def test_every_q5_0_layer_loads_into_int5_bit_for_bit(real) -> None:
    """The steps int5 finds (model/quant/int5.py) on the Q5_0 matrices of the real file's
    first, middle and last layers, dequantised by the `gguf` package: every weight is its
    step times an integer in -16..15, exactly (every layer: 10 s a file)."""
    path, ours = real
    q5_0 = some_layers_in(path, ours.config, T.Q5_0)
    assert q5_0
    for name, weight in q5_0:
        groups = weight.reshape(-1, 1, INT4_GROUP)
        step = _grid_step(groups)
        q = (groups / step).round()
        assert q.amin() >= -16 and q.amax() <= 15, name
        assert torch.equal(q * step, groups), name


def test_every_q6_k_matrix_loads_into_int6_bit_for_bit(real) -> None:
    """int6 (model/quant/int6.py) on the Q6_K matrices of the real file's first, middle and
    last layers, dequantised by the `gguf` package: every super-block is found on its grid,
    and the weights int6 holds (read back as a tied embedding reads them) are the file's."""
    path, ours = real
    q6_k = some_layers_in(path, ours.config, T.Q6_K)
    if not q6_k:
        pytest.skip("no Q6_K matrix in those layers")
    for name, weight in q6_k:
        rows, width = weight.shape
        layer = Int6Linear(width, rows, "cpu", logits=True)
        layer.load_rows(0, weight)
        assert layer._rounded == 0, name
        assert torch.equal(layer.embed(torch.arange(rows), torch.float32), weight), name
