"""A BERT sentence encoder behind the dynamic batcher, and the "auto" queue delay.

Embeddings follow the model's sentence-transformers files: tokenize with [CLS]/[SEP], run the
encoder, pool as its Pooling module says (``1_Pooling/config.json``: mean, CLS, last token, max
or mean over sqrt(length)), L2-normalise when modules.json lists a Normalize module. A directory
without sentence-transformers files gets mean pooling and normalisation (all-MiniLM-L6-v2's, and
TEI's default), stated in ``EncoderModel.pooling``. An input longer than the model's
``max_seq_length`` (sentence_bert_config.json; else its position table) is refused rather than
silently cut, as the OpenAI API refuses an input over the context, unless the request asks for
truncation.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Callable

import torch

from fivefold.errors import InvalidRequestError, ModelLoadError


def is_encoder_dir(path: Path) -> bool:
    """True for a directory holding a BERT-style checkpoint (what the embeddings server runs)."""
    config = path / "config.json"
    if not path.is_dir() or not config.exists():
        return False
    try:
        return json.loads(config.read_text()).get("model_type") == "bert"
    except (OSError, json.JSONDecodeError):
        return False


# sentence-transformers' Pooling config flags -> our mode names
_POOLING_FLAGS = {"pooling_mode_mean_tokens": "mean", "pooling_mode_cls_token": "cls",
                  "pooling_mode_lasttoken": "lasttoken", "pooling_mode_max_tokens": "max",
                  "pooling_mode_mean_sqrt_len_tokens": "mean_sqrt_len"}


def read_pooling(path: Path) -> tuple[str, bool]:
    """(pooling mode, normalize) from a sentence-transformers directory's modules.json and its
    Pooling module's config.json; ("mean", True) without them. A config that combines modes
    (sentence-transformers concatenates them) or names none is refused in one line."""
    modules_file = path / "modules.json"
    if not modules_file.exists():
        return "mean", True
    try:
        modules = json.loads(modules_file.read_text())
        types = [m.get("type", "") for m in modules]
        pooling_dir = next((m.get("path", "") for m in modules if m.get("type", "").endswith(".Pooling")), None)
        normalize = any(t.endswith(".Normalize") for t in types)
        if pooling_dir is None:
            return "mean", normalize
        config = json.loads((path / pooling_dir / "config.json").read_text())
    except (OSError, ValueError, AttributeError) as exc:
        raise ModelLoadError(f"{path}: the sentence-transformers pooling files are unreadable: {exc}") from None
    modes = [mode for flag, mode in _POOLING_FLAGS.items() if config.get(flag)]
    if config.get("pooling_mode") in _POOLING_FLAGS.values():  # newer sentence-transformers also write this
        modes = [config["pooling_mode"]]
    if len(modes) != 1:
        raise ModelLoadError(f"{path / pooling_dir / 'config.json'}: pooling must be exactly one of "
                             f"{', '.join(_POOLING_FLAGS.values())}; got {modes or 'none'}")
    return modes[0], normalize


class EncoderModel:
    """``embed(batch of token-id lists) -> list of [hidden] float32 unit vectors``, padded per batch.

    ``packed``: every linear runs on a oneDNN-packed weight (as the LLM engine's do). Measured
    per request here: 5 tokens alone 6.2 -> 3.2 ms, 59 tokens alone 13.9 -> 10.8 ms; outputs
    within 6e-6 of the plain model.
    """

    def __init__(self, path: str | Path, packed: bool = True) -> None:
        from fivefold.models.bert import load_bert
        from fivefold.models.layers import pack_linears_
        from fivefold.models.tokenizer import load_hf_tokenizer

        path = Path(path)
        self.path = path
        self.model = load_bert(path)
        if packed:
            pack_linears_(self.model)
        self.tokenizer = load_hf_tokenizer(path)
        self.hidden_size = self.model.config.hidden_size
        self.vocab_size = self.model.config.vocab_size
        self.max_length = self.model.config.max_position_embeddings
        st_config = path / "sentence_bert_config.json"
        if st_config.exists():
            try:
                self.max_length = min(self.max_length, int(json.loads(st_config.read_text())["max_seq_length"]))
            except (KeyError, ValueError, json.JSONDecodeError) as exc:
                raise ModelLoadError(f"{st_config} is unreadable: {exc}") from None
        self.pad_id = self.tokenizer.hf.pad_token_id or 0
        self.pooling, self.normalize = read_pooling(path)

    def encode(self, text: str, truncate_to: int | None = None) -> list[int]:
        """Token ids of ``text`` with the special tokens, refused if over ``max_length``; with
        ``truncate_to``, cut to that many first (the end goes, the closing [SEP] stays:
        sentence-transformers' and TEI's right truncation)."""
        ids = self.tokenizer.encode(text, add_special_tokens=True)
        if truncate_to is not None and len(ids) > truncate_to:
            ids = ids[: truncate_to - 1] + ids[-1:] if truncate_to > 1 else ids[:1]
        self.check_ids(ids)
        return ids

    def check_ids(self, ids: list[int]) -> None:
        if len(ids) > self.max_length:
            raise InvalidRequestError(f"input is {len(ids)} tokens; this model's limit is {self.max_length} tokens")
        if not ids:
            raise InvalidRequestError("input is empty; at least one token is required")
        if min(ids) < 0 or max(ids) >= self.vocab_size:
            raise InvalidRequestError(f"token ids must be in [0, {self.vocab_size})")

    def embed(self, batch: list[list[int]]) -> list[torch.Tensor]:
        """The model's embeddings: pooled, then L2-normalised when the model says so."""
        vectors = self.pooled(batch)
        return [torch.nn.functional.normalize(v, dim=0) for v in vectors] if self.normalize else vectors

    def pooled(self, batch: list[list[int]]) -> list[torch.Tensor]:
        """The pooled vectors before any normalisation (what the batcher computes: the server
        normalises per API, TEI's /embed taking ``normalize`` from the request)."""
        from fivefold.models.bert import pool

        longest = max(len(ids) for ids in batch)
        input_ids = torch.full((len(batch), longest), self.pad_id, dtype=torch.long)
        mask = torch.zeros((len(batch), longest), dtype=torch.long)
        for i, ids in enumerate(batch):
            input_ids[i, : len(ids)] = torch.tensor(ids)
            mask[i, : len(ids)] = 1
        with torch.inference_mode():
            vectors = pool(self.model(input_ids, mask), mask, self.pooling, normalize=False)
        return list(vectors)


def measure_auto_delay(run_batch: Callable[[list], list], payload, factor: float, num_calls: int = 5) -> float:
    """``factor`` x the median time of a single-request ``run_batch([payload])``, after a warm-up."""
    run_batch([payload])
    times = []
    for _ in range(num_calls):
        start = time.perf_counter()
        run_batch([payload])
        times.append(time.perf_counter() - start)
    return factor * sorted(times)[len(times) // 2]
