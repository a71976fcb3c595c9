"""Cross-encoders (model/encoder/classifier.py and the encoder's pair input) against
sentence-transformers' `CrossEncoder.predict` on a tiny random `BertForSequenceClassification`
written by transformers and packaged by `CrossEncoder.save`: the activation from each place
CrossEncoder reads it, pairs cut to the model's length as it cuts them, in a batch and alone."""

import json
import shutil

import numpy as np
import pytest
import torch
from tokenizers import Tokenizer, processors

from model.encoder.checkpoint import load_encoder
from model.errors import ModelFileError, UnsupportedModelError
from scheduler.runner.pooling_runner import CrossEncoderRunner
from tests.tiny_cross_encoder import cross_encoder, write_tiny_cross_encoder

LONG = " ".join(["the cat sat on the mat"] * 12)  # 72 words: over the 64-token limit
PAIRS = [
    ("the cat", "sat on the mat"),
    ("", "code def return"),
    ("x", ""),
    ("a [SEP] b", "dog"),  # special-token text in the first segment stays in it
    ("which code?", LONG),  # the document is cut
    (LONG, "the dog"),  # the query is cut
    (LONG, LONG + " x y"),  # both are cut, the longer first
    ("b", "zebra 42 unknown!"),
]


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    return write_tiny_cross_encoder(tmp_path_factory.mktemp("ce") / "tiny-reranker")


def variant(saved, tmp_path, st_activation="keep", config_fields=None):
    """A copy of the package with its activation stated elsewhere: `st_activation` in
    config_sentence_transformers.json (None: removed), `config_fields` in config.json."""
    directory = tmp_path / "variant"
    shutil.copytree(saved, directory)
    if st_activation != "keep":
        st_file = directory / "config_sentence_transformers.json"
        fields = json.loads(st_file.read_text())
        fields["activation_fn"] = st_activation
        st_file.write_text(json.dumps(fields))
    if config_fields:
        config_file = directory / "config.json"
        config_file.write_text(json.dumps(json.loads(config_file.read_text()) | config_fields))
    return directory


def our_scores(directory, pairs=PAIRS) -> np.ndarray:
    encoder = load_encoder(directory, progress=False)
    assert encoder.head is not None and encoder.max_model_len == 64
    encoded = encoder.tokenizer.encode_pairs(pairs, encoder.max_model_len)
    runner = CrossEncoderRunner(encoder.model, encoder.head, encoder.max_model_len)
    batch = runner.embed([ids for ids, _ in encoded], [types for _, types in encoded])
    alone = np.concatenate([runner.embed([ids], [types]) for ids, types in encoded])
    np.testing.assert_allclose(alone, batch, atol=1e-5, rtol=0)
    return batch[:, 0]


ACTIVATIONS = {
    # as CrossEncoder.save writes it: sigmoid in config_sentence_transformers.json
    "saved": ("keep", None, "sigmoid"),
    "config.json": (None, {"sentence_transformers": {"activation_fn": "torch.nn.Identity"}}, None),
    "legacy": (
        None,
        {"sbert_ce_default_activation_function": "torch.nn.modules.activation.Tanh"},
        "tanh",
    ),
    # code outside torch runs only with trust_remote_code: the default instead
    "untrusted": ("my_package.Activation", None, "sigmoid"),
}


@pytest.mark.parametrize("source", list(ACTIVATIONS))
def test_scores_match_cross_encoder_predict(saved, tmp_path, source) -> None:
    st_activation, config_fields, squash = ACTIVATIONS[source]
    directory = variant(saved, tmp_path, st_activation, config_fields)
    reference = cross_encoder(directory)
    expected = reference.predict(PAIRS, batch_size=3, show_progress_bar=False)
    ours = our_scores(directory)
    np.testing.assert_allclose(ours, expected, atol=1e-5, rtol=0)
    assert np.std(ours) > 0.05  # not saturated: the comparison means something
    if squash == "sigmoid":
        assert ((ours > 0) & (ours < 1)).all()
    elif squash is None:
        assert (ours < 0).any() or (ours > 1).any()  # raw logits


def test_pairs_are_tokenized_and_cut_as_cross_encoder_does(saved) -> None:
    hf = cross_encoder(saved).tokenizer
    expected = hf(
        [a for a, _ in PAIRS], [b for _, b in PAIRS], truncation="longest_first", max_length=64
    )
    ours = load_encoder(saved, progress=False).tokenizer.encode_pairs(PAIRS, 64)
    assert [ids for ids, _ in ours] == expected["input_ids"]
    assert [types for _, types in ours] == expected["token_type_ids"]
    assert max(len(ids) for ids, _ in ours) == 64


def test_more_than_one_label_is_refused(saved, tmp_path) -> None:
    directory = variant(saved, tmp_path, config_fields={"id2label": {"0": "no", "1": "yes"}})
    with pytest.raises(UnsupportedModelError, match="2 labels"):
        load_encoder(directory, progress=False)


def test_a_tokenizer_without_a_pair_template_is_refused(saved, tmp_path) -> None:
    directory = variant(saved, tmp_path)
    tok = Tokenizer.from_file(str(directory / "tokenizer.json"))
    tok.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]", special_tokens=[("[CLS]", 2), ("[SEP]", 3)]
    )
    tok.save(str(directory / "tokenizer.json"))
    with pytest.raises(ModelFileError, match="pairs"):
        load_encoder(directory, progress=False)


def test_bfloat16_encoder_keeps_the_head_in_float32(saved) -> None:
    encoder = load_encoder(saved, dtype=torch.bfloat16, progress=False)
    assert encoder.head is not None
    assert all(p.dtype == torch.float32 for p in encoder.head.parameters())
    expected = cross_encoder(saved).predict(PAIRS[:3], show_progress_bar=False)
    encoded = encoder.tokenizer.encode_pairs(PAIRS[:3], 64)
    runner = CrossEncoderRunner(encoder.model, encoder.head, 64)
    got = runner.embed([i for i, _ in encoded], [t for _, t in encoded])[:, 0]
    np.testing.assert_allclose(got, expected, atol=0.02, rtol=0)
