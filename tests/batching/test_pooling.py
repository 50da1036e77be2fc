"""Embeddings pool as the model's sentence-transformers files say (issue 38), checked against
sentence-transformers itself: the built-in all-MiniLM-L6-v2 (mean, normalised) and a random BERT
saved with a CLS pooling config and no Normalize module (before, every model was mean-pooled and
normalised: this one's vectors were silently wrong)."""

import importlib.util
import json
import shutil
from pathlib import Path

import pytest
import torch

from fivefold.batching.encoder import EncoderModel, read_pooling
from fivefold.errors import ModelLoadError
from fivefold.models.bert import pool
from fivefold.models.registry import BUILTIN_MODELS

SENTENCES = ["The cat sat on the mat.", "A quick brown fox jumps over the lazy dog near the river bank today",
             "Embeddings", "Python's for statement iterates over the items of any sequence, in order."]


def _builtin_dir() -> Path:
    return BUILTIN_MODELS["all-minilm-l6-v2"].path()


def _ours(path) -> torch.Tensor:
    model = EncoderModel(path)
    return torch.stack(model.embed([model.encode(s) for s in SENTENCES]))


def _theirs(path) -> torch.Tensor:
    from sentence_transformers import SentenceTransformer

    return SentenceTransformer(str(path), device="cpu").encode(SENTENCES, convert_to_tensor=True).float()


def test_builtin_encoder_matches_sentence_transformers():
    assert read_pooling(_builtin_dir()) == ("mean", True)
    cosine = torch.nn.functional.cosine_similarity(_ours(_builtin_dir()), _theirs(_builtin_dir()))
    assert float(cosine.min()) >= 0.9999


def _random_bert(directory: Path, pooling: dict, normalize: bool) -> Path:
    from transformers import BertConfig, BertModel

    torch.manual_seed(0)
    source = _builtin_dir()
    config = BertConfig(vocab_size=30522, hidden_size=48, num_hidden_layers=2, num_attention_heads=4,
                        intermediate_size=96, max_position_embeddings=128)
    BertModel(config).eval().save_pretrained(str(directory))
    for name in ("vocab.txt", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        shutil.copy(source / name, directory / name)
    (directory / "1_Pooling").mkdir()
    (directory / "1_Pooling" / "config.json").write_text(json.dumps({"word_embedding_dimension": 48, **pooling}))
    modules = [{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
               {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}]
    if normalize:
        modules.append({"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"})
    (directory / "modules.json").write_text(json.dumps(modules))
    (directory / "sentence_bert_config.json").write_text(json.dumps({"max_seq_length": 128, "do_lower_case": False}))
    return directory


@pytest.mark.parametrize("mode,flag,normalize", [("cls", "pooling_mode_cls_token", False),
                                                 ("lasttoken", "pooling_mode_lasttoken", True),
                                                 ("max", "pooling_mode_max_tokens", False)])
def test_a_random_bert_pools_as_its_config_says(tmp_path, mode, flag, normalize):
    path = _random_bert(tmp_path, {flag: True}, normalize)
    assert read_pooling(path) == (mode, normalize)
    ours, theirs = _ours(path), _theirs(path)
    assert float(torch.nn.functional.cosine_similarity(ours, theirs).min()) >= 0.9999
    torch.testing.assert_close(ours, theirs, rtol=1e-3, atol=1e-4)  # the norms too: normalised only if asked
    if not normalize:
        assert float((ours.norm(dim=-1) - 1).abs().max()) > 0.01


def test_combined_or_missing_pooling_modes_are_refused(tmp_path):
    path = _random_bert(tmp_path, {"pooling_mode_cls_token": True, "pooling_mode_mean_tokens": True}, True)
    with pytest.raises(ModelLoadError, match="pooling must be exactly one of"):
        read_pooling(path)


def test_pool_modes_on_padded_rows():
    hidden = torch.arange(2 * 3 * 2, dtype=torch.float32).view(2, 3, 2)
    mask = torch.tensor([[1, 1, 0], [1, 1, 1]])
    assert pool(hidden, mask, "cls", False).tolist() == [[0, 1], [6, 7]]
    assert pool(hidden, mask, "lasttoken", False).tolist() == [[2, 3], [10, 11]]
    assert pool(hidden, mask, "max", False).tolist() == [[2, 3], [10, 11]]
    assert pool(hidden, mask, "mean", False).tolist() == [[1, 2], [8, 9]]
