"""Incremental detokenization for streaming.

Decoding one token at a time is wrong for byte-level BPE (a character can span
tokens) and for SentencePiece (a leading space depends on the previous token).
So each step decodes a short window that starts a few tokens back, and emits the
text beyond what the same window decoded before; a window ending in an incomplete
UTF-8 sequence (U+FFFD) emits nothing until it completes, or until MAX_PENDING_TOKENS
tokens show that it never will.

The window starts in the prompt's last tokens (as vLLM's does): the first generated
token is decoded after its real predecessor, so a SentencePiece model's leading space
("▁Paris" after "is") is kept instead of being stripped as at the start of a text.
The result equals ``decode(prompt + output)[len(decode(prompt)):]``.
"""

from __future__ import annotations

from fivefold.models.tokenizer import Tokenizer


PROMPT_CONTEXT = 5  # prompt tokens the first window starts with
# A character is at most 4 UTF-8 bytes, so at most 3 of them wait for the rest; a window that
# still ends in U+FFFD after this many new tokens holds bytes that will never form a character
# (a model writing lone continuation bytes): its text, replacement characters included, is
# emitted as transformers' decode renders it, and the window moves on. Without this bound the
# window grew with every token (quadratic time) and the text was never emitted.
MAX_PENDING_TOKENS = 8


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = True,
                 prompt_token_ids: list[int] | tuple[int, ...] = ()) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.token_ids: list[int] = list(prompt_token_ids[-PROMPT_CONTEXT:])
        self.prefix_offset = 0
        self.read_offset = len(self.token_ids)
        self.text = ""

    def add(self, token_ids: list[int]) -> str:
        """Append tokens; return the newly completed text."""
        self.token_ids.extend(token_ids)
        decode = lambda ids: self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)
        prefix_text = decode(self.token_ids[self.prefix_offset:self.read_offset])
        full_text = decode(self.token_ids[self.prefix_offset:])
        if len(full_text) <= len(prefix_text):
            return ""
        if full_text.endswith("\ufffd") and len(self.token_ids) - self.read_offset <= MAX_PENDING_TOKENS:
            return ""  # an incomplete character: its next byte may come with the next token
        delta = full_text[len(prefix_text):]
        self.prefix_offset = self.read_offset
        self.read_offset = len(self.token_ids)
        self.text += delta
        return delta
