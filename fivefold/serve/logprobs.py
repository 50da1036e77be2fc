"""Logprobs in OpenAI's two shapes, from the engine's entries ``{"token_id", "logprob", "top"}``
(``top``: (token id, logprob) pairs): the completions shape (tokens, token_logprobs,
top_logprobs, text_offset) and the chat shape (content: token, logprob, bytes, top_logprobs)."""

from __future__ import annotations

import itertools


def token_text(tokenizer, token_id: int) -> str:
    """One token's text, special tokens included."""
    return tokenizer.decode([token_id], skip_special_tokens=False)


def new_entries(out) -> list[dict] | None:
    """Logprob entries of the tokens this output added."""
    entries = out.outputs[0].logprobs
    return None if entries is None else entries[len(entries) - len(out.delta_token_ids):]


class LogprobBodies:
    """The logprobs fields of answers, with this tokenizer's token texts."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer

    def token_text(self, token_id: int) -> str:
        return token_text(self.tokenizer, token_id)

    def completion(self, entries: list[dict] | None) -> dict | None:
        """OpenAI's completions logprobs (an echoed prompt's first token has logprob and top None,
        as OpenAI and vLLM answer)."""
        if entries is None:
            return None
        tokens = [self.token_text(e["token_id"]) for e in entries]
        return {
            "tokens": tokens,
            "token_logprobs": [e["logprob"] for e in entries],
            "top_logprobs": [None if e["top"] is None else {self.token_text(t): lp for t, lp in e["top"]}
                             for e in entries],
            "text_offset": list(itertools.accumulate((len(t) for t in tokens[:-1]), initial=0)) if tokens else [],
        }

    def chat(self, entries: list[dict] | None) -> dict | None:
        """OpenAI's chat logprobs: each token with its bytes and its top alternatives."""
        if entries is None:
            return None
        content = []
        for e in entries:
            text = self.token_text(e["token_id"])
            top = [{"token": self.token_text(t), "logprob": lp, "bytes": list(self.token_text(t).encode())}
                   for t, lp in e["top"]]
            content.append({"token": text, "logprob": e["logprob"], "bytes": list(text.encode()), "top_logprobs": top})
        return {"content": content}
