"""A tiny random cross-encoder as users get them: a `BertForSequenceClassification` of one
label written by `transformers`, a WordPiece tokenizer with BERT's pair template, packaged by
sentence-transformers' own `CrossEncoder.save`; and the `CrossEncoder` that reads it back,
the reference every score is compared with."""

from pathlib import Path

import torch
from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, processors
from transformers import BertConfig, BertForSequenceClassification, BertTokenizerFast

WORDS = ["the", "cat", "sat", "on", "mat", "code", "def", "return", "a", "b", "x", "y", "dog"]
MAX_POSITION = 64


def write_tiny_cross_encoder(directory: Path, num_labels: int = 1) -> Path:
    """Writes the transformers checkpoint beside `directory` and the CrossEncoder package
    into it; returns `directory`."""
    from sentence_transformers import CrossEncoder

    torch.manual_seed(0)
    vocab = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"] + WORDS
    vocab += list("abcdefghijklmnopqrstuvwxyz0123456789(),.:=+!?")
    vocab += ["##" + c for c in "abcdefghijklmnopqrstuvwxyz0123456789"]
    config = BertConfig(
        vocab_size=len(vocab),
        hidden_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=96,
        max_position_embeddings=MAX_POSITION,
        num_labels=num_labels,
    )
    model = BertForSequenceClassification(config).eval()
    with torch.no_grad():
        # Every tensor random, biases and segments too, so each one matters; the norms
        # near 1 and the pooler small, or the [CLS] state comes out nearly the same for
        # every pair and the pooler's tanh saturates: scores would hardly differ.
        for name, p in model.named_parameters():
            p.normal_(0, 0.3)
            if "LayerNorm" in name:
                p.mul_(0.3).add_(1.0 if name.endswith("weight") else 0.0)
        model.bert.pooler.dense.weight.normal_(0, 0.1)
    source = directory.parent / f"{directory.name}-transformers"
    model.save_pretrained(source)
    tok = Tokenizer(models.WordPiece({t: i for i, t in enumerate(vocab)}, unk_token="[UNK]"))
    tok.normalizer = normalizers.BertNormalizer(lowercase=True)
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]",
        pair="[CLS] $A [SEP] $B:1 [SEP]:1",
        special_tokens=[("[CLS]", 2), ("[SEP]", 3)],
    )
    tok.add_special_tokens(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"])
    BertTokenizerFast(tokenizer_object=tok, model_max_length=512).save_pretrained(source)
    CrossEncoder(str(source), device="cpu").save(str(directory))
    return directory


def cross_encoder(directory: Path):
    from sentence_transformers import CrossEncoder

    return CrossEncoder(str(directory), device="cpu")
