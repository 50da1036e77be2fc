"""Text for calibration, evaluation and benchmarks: pydoc_data.topics (in every CPython).

About 465 KB of English. ``pydoc_text(part)`` splits it by topic into a calibration
part (the first 80% of topics, sorted by name) and a held-out part (the rest), so that
nothing is ever evaluated on what it was calibrated on.
"""

from __future__ import annotations

import random

PARTS = ("all", "calibration", "heldout")
CALIBRATION_SHARE = 0.8


def pydoc_text(part: str = "all") -> str:
    from pydoc_data.topics import topics

    if part not in PARTS:
        raise ValueError(f"part must be one of {', '.join(PARTS)}, got '{part}'")
    names = sorted(topics)
    cut = int(len(names) * CALIBRATION_SHARE)
    chosen = names if part == "all" else names[:cut] if part == "calibration" else names[cut:]
    return "\n".join(topics[k] for k in chosen)


def corpus_ids(tokenizer, part: str = "all") -> list[int]:
    """The text of ``part`` as token ids."""
    return tokenizer.encode(pydoc_text(part), add_special_tokens=False)


def corpus_prompts(ids: list[int], num: int, length: int, seed: int = 0) -> list[list[int]]:
    """``num`` prompts of ``length`` tokens cut at random offsets from ``ids``."""
    rng = random.Random(seed)
    return [ids[s:s + length] for s in (rng.randrange(0, len(ids) - length) for _ in range(num))]


def text_windows(tokenizer, part: str, num: int, length: int, seed: int = 0) -> list[list[int]]:
    """``num`` windows of ``length`` tokens from the ``calibration`` or ``heldout`` part."""
    return corpus_prompts(corpus_ids(tokenizer, part), num, length, seed)


def copy_prompts(tokenizer, num: int, num_chars: int = 700, seed: int = 0) -> list[list[int]]:
    """The input-copying workload of speculative decoding: a held-out pydoc passage
    (``num_chars`` characters from a paragraph start), then the same passage begun again, so
    that continuing the text means copying it, as in a rewrite, a quotation or an edit of a
    document given in the prompt. Token ids."""
    text = pydoc_text("heldout")
    starts = [i + 2 for i in range(len(text) - num_chars) if text.startswith("\n\n", i) and text[i + 2].isalpha()]
    rng = random.Random(seed)
    prompts = []
    for start in rng.sample(starts, num):
        passage = text[start: start + num_chars].rsplit(" ", 1)[0]
        prompts.append(tokenizer.encode(f"{passage}\n\n{passage[:60]}", add_special_tokens=False))
    return prompts
