"""Tokenizers for Hugging Face directories and GGUF files, with the chat template.

A GGUF tokenizer is rebuilt by transformers from the file's metadata, which takes
seconds for a 49k-token BPE vocabulary; the result is cached as a Hugging Face
tokenizer directory under ``$FIVEFOLD_CACHE`` (default ``~/.cache/fivefold``),
keyed by the file's path, size and modification time.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path
from typing import Any

from fivefold.errors import ModelLoadError
from fivefold.paths import tokenizer_cache_dir

TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "vocab.txt")


def _quiet_transformers() -> None:
    from transformers.utils import logging

    logging.set_verbosity_error()


class Tokenizer:
    """Text <-> token ids, special tokens and the chat template of one model."""

    def __init__(self, hf_tokenizer: Any, eos_token_ids: tuple[int, ...] = ()) -> None:
        self.hf = hf_tokenizer
        ids = set(eos_token_ids)
        if hf_tokenizer.eos_token_id is not None:
            ids.add(hf_tokenizer.eos_token_id)
        self.eos_token_ids: tuple[int, ...] = tuple(sorted(ids))

    @property
    def vocab_size(self) -> int:
        return len(self.hf)

    @property
    def has_chat_template(self) -> bool:
        return bool(getattr(self.hf, "chat_template", None))

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(self.hf.encode(text, add_special_tokens=add_special_tokens))

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.hf.decode(token_ids, skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True,
                            tools: list[dict] | None = None, template_kwargs: dict | None = None) -> list[int]:
        """Token ids of a conversation rendered with the model's chat template (``tools``: OpenAI's
        tool definitions, for templates that render them; ``template_kwargs``: extra template
        variables, e.g. Qwen3's ``enable_thinking``)."""
        if not self.has_chat_template:
            raise ModelLoadError("this model's tokenizer has no chat template; use a plain prompt instead")
        from jinja2 import TemplateError

        from fivefold.errors import InvalidRequestError

        try:
            text = self.hf.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, tokenize=False,
                                               tools=tools, **(template_kwargs or {}))
        except TemplateError as exc:  # e.g. raise_exception() for roles that do not alternate
            raise InvalidRequestError(f"the chat template refused the messages: {exc}") from None
        # The template writes the special tokens itself (BOS included), so add none.
        return self.encode(text, add_special_tokens=False)


def load_hf_tokenizer(directory: Path, eos_token_ids: tuple[int, ...] = ()) -> Tokenizer:
    if not any((directory / name).exists() for name in TOKENIZER_FILES):
        raise ModelLoadError(
            f"no tokenizer found in {directory} (looked for {', '.join(TOKENIZER_FILES)})"
        )
    _quiet_transformers()
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    # tokenizer.json is the full pipeline: load it as written. AutoTokenizer would pick the
    # model family's class, which in transformers 5 may rebuild the pipeline differently.
    cls = PreTrainedTokenizerFast if (directory / "tokenizer.json").exists() else AutoTokenizer
    try:
        hf = cls.from_pretrained(str(directory))
    except Exception as exc:
        raise ModelLoadError(f"tokenizer in {directory} could not be loaded: {type(exc).__name__}: {exc}") from None
    return Tokenizer(hf, eos_token_ids)


def load_gguf_tokenizer(path: Path, reader, eos_token_ids: tuple[int, ...] = ()) -> Tokenizer:
    if "tokenizer.ggml.tokens" not in reader.fields:
        raise ModelLoadError(f"no tokenizer found in {path} (GGUF metadata has no tokenizer.ggml.tokens)")
    stat = path.stat()
    key = hashlib.sha256(f"{path.resolve()}|{stat.st_size}|{stat.st_mtime_ns}".encode()).hexdigest()[:16]
    cached = tokenizer_cache_dir() / key
    if (cached / "tokenizer.json").exists():
        return load_hf_tokenizer(cached, eos_token_ids)
    _quiet_transformers()
    from transformers import AutoTokenizer

    try:
        hf = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    except Exception as exc:
        raise ModelLoadError(f"tokenizer in {path} could not be built: {type(exc).__name__}: {exc}") from None
    try:
        tmp = cached.with_name(cached.name + f".tmp{os.getpid()}")
        hf.save_pretrained(str(tmp))
        os.replace(tmp, cached) if not cached.exists() else None
    except OSError:
        pass  # a read-only cache only costs the rebuild next time
    return Tokenizer(hf, eos_token_ids)
