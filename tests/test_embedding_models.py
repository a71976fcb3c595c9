"""Embedding models against `transformers` on the same weights: a tiny random BERT written
by `transformers` (our encoder, its pooling as sentence-transformers configures it) and
tiny decoders of two families served with `--task embed` (their final hidden states,
pooled, against `output_hidden_states`)."""

import json
from pathlib import Path

import pytest
import torch
from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, processors
from transformers import BertConfig, BertModel

from model.encoder.checkpoint import load_encoder
from model.encoder.pooling import PoolingConfig, PoolingConfigError, pool
from model.loader import load_model
from scheduler.runner.pooling_runner import DecoderPoolingRunner, EncoderRunner
from tests.tiny_families import make_tiny

WORDS = ["the", "cat", "sat", "on", "mat", "code", "def", "return", "a", "b", "x", "y"]


def write_tiny_bert(directory: Path, pooling: str | None, normalize: bool, **extra) -> BertModel:
    """A random BERT saved by transformers, a WordPiece tokenizer.json built with the
    tokenizers library, and (unless `pooling` is None) the sentence-transformers files."""
    torch.manual_seed(0)
    vocab = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"] + WORDS
    vocab += [c for c in "abcdefghijklmnopqrstuvwxyz0123456789(),.:=+"]
    vocab += ["##" + c for c in "abcdefghijklmnopqrstuvwxyz0123456789"]
    config = BertConfig(
        vocab_size=len(vocab),
        hidden_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=96,
        max_position_embeddings=64,
        **extra,
    )
    model = BertModel(config, add_pooling_layer=True).eval()
    with torch.no_grad():
        for p in model.parameters():  # norms and biases random too, so each one matters
            p.normal_(0, 0.3)
    model.save_pretrained(directory)
    tok = Tokenizer(models.WordPiece({t: i for i, t in enumerate(vocab)}, unk_token="[UNK]"))
    tok.normalizer = normalizers.BertNormalizer(lowercase=True)
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]", special_tokens=[("[CLS]", 2), ("[SEP]", 3)]
    )
    tok.add_special_tokens(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"])
    tok.enable_padding(length=32)  # as the real file asks: the loader must undo it
    tok.save(str(directory / "tokenizer.json"))
    if pooling is not None:
        modules = [
            {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
            {
                "idx": 1,
                "name": "1",
                "path": "1_Pooling",
                "type": "sentence_transformers.models.Pooling",
            },
        ]
        if normalize:
            modules.append(
                {
                    "idx": 2,
                    "name": "2",
                    "path": "2_Normalize",
                    "type": "sentence_transformers.models.Normalize",
                }
            )
        (directory / "modules.json").write_text(json.dumps(modules))
        (directory / "1_Pooling").mkdir()
        flags = {
            "pooling_mode_cls_token": pooling == "cls",
            "pooling_mode_mean_tokens": pooling == "mean",
        }
        (directory / "1_Pooling" / "config.json").write_text(json.dumps(flags))
        (directory / "sentence_bert_config.json").write_text(json.dumps({"max_seq_length": 40}))
    return model


TEXTS = ["the cat sat on the mat", "x", "", "def f(a, b): return a+b", "zebra 42 unknown!"]


def reference(model: BertModel, ids: list[list[int]], mode: str, normalize: bool) -> torch.Tensor:
    """transformers on a padded batch with its attention mask, pooled as
    sentence-transformers pools."""
    longest = max(len(i) for i in ids)
    input_ids = torch.tensor([i + [0] * (longest - len(i)) for i in ids])
    mask = torch.tensor([[1] * len(i) + [0] * (longest - len(i)) for i in ids])
    with torch.no_grad():
        hidden = model(input_ids=input_ids, attention_mask=mask).last_hidden_state
    if mode == "cls":
        pooled = hidden[:, 0]
    else:
        pooled = (hidden * mask[..., None]).sum(1) / mask.sum(1, keepdim=True)
    return torch.nn.functional.normalize(pooled, dim=-1) if normalize else pooled


@pytest.mark.parametrize("mode,normalize", [("mean", True), ("cls", False)])
def test_tiny_bert_matches_transformers(tmp_path, mode, normalize) -> None:
    hf = write_tiny_bert(tmp_path, mode, normalize)
    encoder = load_encoder(tmp_path, progress=False)
    assert encoder.pooling == PoolingConfig(mode, normalize)
    assert encoder.max_model_len == 40  # sentence_bert_config's, under the model's 64
    ids = [encoder.tokenizer.encode(t) for t in TEXTS]
    assert all(i[0] == 2 and i[-1] == 3 for i in ids)  # [CLS] ... [SEP], no padding
    runner = EncoderRunner(encoder.model, encoder.pooling, encoder.max_model_len)
    ours = torch.from_numpy(runner.embed(ids))  # inputs of unequal lengths
    torch.testing.assert_close(ours, reference(hf, ids, mode, normalize), atol=1e-5, rtol=0)
    # Each alone (no padding, no neighbours) gives what it gives in the batch.
    alone = torch.cat([torch.from_numpy(runner.embed([i])) for i in ids])
    torch.testing.assert_close(alone, ours, atol=1e-5, rtol=0)


def test_bare_bert_directory_pools_as_sentence_transformers_would(tmp_path) -> None:
    write_tiny_bert(tmp_path, None, False)
    encoder = load_encoder(tmp_path, progress=False)
    assert encoder.pooling == PoolingConfig("mean", False)
    assert encoder.max_model_len == 64


def test_matryoshka_fields_are_read(tmp_path) -> None:
    write_tiny_bert(tmp_path, "mean", True, matryoshka_dimensions=[16, 32])
    assert load_encoder(tmp_path, progress=False).matryoshka == [16, 32]


@pytest.mark.parametrize(
    "spec,expected",
    [
        ("cls", PoolingConfig("cls", True)),
        ('{"pooling_type": "LAST", "normalize": false}', PoolingConfig("last", False)),
        ('{"normalize": false}', PoolingConfig("mean", False)),
    ],
)
def test_pooling_override(spec, expected) -> None:
    assert PoolingConfig("mean", True).overridden(spec) == expected


@pytest.mark.parametrize("spec", ["max", "{bad json", '{"pooling": "MEAN"}', '{"normalize": 1}'])
def test_bad_pooling_override_is_one_sentence(spec) -> None:
    with pytest.raises(PoolingConfigError):
        PoolingConfig().overridden(spec)


@pytest.mark.parametrize("family", ["qwen2", "mistral"])
@pytest.mark.parametrize("mode", ["last", "mean"])
def test_decoder_embeddings_match_transformers_hidden_states(tmp_path, family, mode) -> None:
    hf = make_tiny(family, tmp_path)
    loaded = load_model(tmp_path, dtype=torch.float32, progress=False)
    pooling = PoolingConfig(mode, normalize=False)
    runner = DecoderPoolingRunner(loaded.model, pooling, 256, 64, 4, block_size=16)
    ids = [[5, 9, 13, 200, 7], list(range(30, 70)), [3]]  # unequal, one over a block
    ours = torch.from_numpy(runner.embed(ids))
    for row, seq in enumerate(ids):
        with torch.no_grad():
            out = hf(torch.tensor([seq]), output_hidden_states=True)
        last = out.hidden_states[-1][0]
        expected = last[-1] if mode == "last" else last.mean(0)
        torch.testing.assert_close(ours[row], expected, atol=1e-4, rtol=0)
    # The scratch cache is reused: a second step over other inputs is as exact.
    again = torch.from_numpy(runner.embed([ids[1]]))
    torch.testing.assert_close(again[0], ours[1], atol=1e-5, rtol=0)


def test_pool_modes_pick_the_right_rows() -> None:
    hidden = torch.arange(12, dtype=torch.float32).reshape(6, 2)
    lengths = [2, 4]
    assert pool(hidden, lengths, PoolingConfig("cls", False)).tolist() == [[0, 1], [4, 5]]
    assert pool(hidden, lengths, PoolingConfig("last", False)).tolist() == [[2, 3], [10, 11]]
    assert pool(hidden, lengths, PoolingConfig("mean", False)).tolist() == [[1, 2], [7, 8]]


@pytest.mark.parametrize("bf16_ms,expected", [(50.0, torch.bfloat16), (90.0, torch.float32)])
def test_auto_dtype_takes_bfloat16_only_when_clearly_faster(
    tmp_path, monkeypatch, bf16_ms, expected
) -> None:
    import model.encoder.precision as precision

    write_tiny_bert(tmp_path, "mean", True)
    timings = {torch.float32: 100.0, torch.bfloat16: bf16_ms}
    monkeypatch.setattr(precision, "_time", lambda m, _: timings[m.word_embeddings.weight.dtype])
    encoder = load_encoder(tmp_path, dtype="auto", progress=False)
    assert encoder.model.word_embeddings.weight.dtype == expected
    assert all(p.dtype == expected for p in encoder.model.parameters())


def test_dimensions_cut_only_where_the_model_allows() -> None:
    import numpy as np

    from server.edge.errors import APIError
    from server.routes.embeddings import shaped
    from server.state import EmbeddingSpec

    vector = np.arange(1, 65, dtype=np.float32)
    listed = EmbeddingSpec(dim=64, normalize=True, matryoshka=[16, 32])
    cut = shaped(vector, 16, listed)
    np.testing.assert_allclose(cut, vector[:16] / np.linalg.norm(vector[:16]), rtol=1e-6)
    assert shaped(vector, 64, listed) is vector  # the model's own size: untouched
    raw = EmbeddingSpec(dim=64, normalize=False, matryoshka="any")
    np.testing.assert_array_equal(shaped(vector, 20, raw), vector[:20])
    for dims, spec in ((20, listed), (65, raw), (16, EmbeddingSpec(64, True, None))):
        with pytest.raises(APIError) as refused:
            shaped(vector, dims, spec)
        assert refused.value.status == 400 and refused.value.param == "dimensions"
