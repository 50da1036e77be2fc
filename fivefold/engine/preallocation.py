"""Pre-allocation: how much KV capacity a request reserves when it is admitted.

A reservation is a guess of the request's final length. Too small, and the request needs
more blocks mid-decode (and may preempt another); too large, and whole blocks are held that
nobody writes. Each policy is one class; the engine config's ``preallocation`` names one.

    none       reserve nothing: each step allocates what it computes (the default)
    full       prompt + max_tokens: the request never needs another block
    predicted  prompt + the 90th percentile of recent output lengths, capped at max_tokens

The policy owns its statistics (:class:`ReservationStats`): the scheduler reports each
admission, each step's need and each finish, and the queries (:meth:`reservation`,
:meth:`lookahead`) change nothing.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass

from fivefold.engine.sequence import Sequence


@dataclass
class ReservationStats:
    """How the pre-allocation policy's guesses turned out."""

    num_reservations: int = 0
    num_too_small: int = 0  # the sequence outgrew its reservation
    num_too_large: int = 0  # it finished with whole reserved blocks unused
    num_unused_blocks: int = 0  # total reserved blocks never written


class PreallocationPolicy:
    """Reserves nothing (``none``); the base of the others."""

    name = "none"

    def __init__(self, max_model_len: int) -> None:
        self.max_model_len = max_model_len
        self.stats = ReservationStats()

    def reservation(self, seq: Sequence) -> int:
        """Tokens of capacity to reserve for ``seq`` at admission (0: none)."""
        return 0

    def lookahead(self, seq: Sequence, num_new: int) -> int:
        """Tokens to allocate beyond this step's ``num_new``, to honour the reservation."""
        return max(0, seq.num_reserved_tokens - (seq.num_computed_tokens + num_new)) if seq.num_reserved_tokens else 0

    def on_admit(self, seq: Sequence) -> None:
        """``seq`` was admitted for the first time (not after a preemption)."""

    def on_step(self, seq: Sequence, num_new: int) -> None:
        """``seq`` computes ``num_new`` tokens this step: count a reservation it outgrows."""
        if seq.num_reserved_tokens and not seq.is_reservation_exceeded and \
                seq.num_computed_tokens + num_new > seq.num_reserved_tokens:
            seq.is_reservation_exceeded = True
            self.stats.num_too_small += 1

    def on_finish(self, seq: Sequence, num_unused_blocks: int) -> None:
        """``seq`` finished holding ``num_unused_blocks`` blocks it never wrote."""
        if seq.num_reserved_tokens and num_unused_blocks > 0:
            self.stats.num_too_large += 1
            self.stats.num_unused_blocks += num_unused_blocks


class FullPreallocation(PreallocationPolicy):
    """Prompt + max_tokens (capped at the context length)."""

    name = "full"

    def reservation(self, seq: Sequence) -> int:
        return min(seq.num_prompt_tokens + self.expected_output(seq), self.max_model_len)

    def expected_output(self, seq: Sequence) -> int:
        return seq.params.max_tokens

    def on_admit(self, seq: Sequence) -> None:
        self.stats.num_reservations += 1


class PredictedPreallocation(FullPreallocation):
    """Prompt + the 90th percentile of the last 100 finished requests' output lengths
    (max_tokens until there is a history, and never above it)."""

    name = "predicted"
    HISTORY = 100

    def __init__(self, max_model_len: int) -> None:
        super().__init__(max_model_len)
        self.recent_output_lengths: deque[int] = deque(maxlen=self.HISTORY)

    def expected_output(self, seq: Sequence) -> int:
        if not self.recent_output_lengths:
            return seq.params.max_tokens
        ordered = sorted(self.recent_output_lengths)
        p90 = ordered[min(len(ordered) - 1, math.ceil(0.9 * len(ordered)) - 1)]
        return min(seq.params.max_tokens, p90)

    def on_finish(self, seq: Sequence, num_unused_blocks: int) -> None:
        super().on_finish(seq, num_unused_blocks)
        if seq.finish_reason != "abort":
            self.recent_output_lengths.append(seq.num_output_tokens)


POLICIES = {p.name: p for p in (PreallocationPolicy, FullPreallocation, PredictedPreallocation)}


def make_preallocation_policy(name: str, max_model_len: int) -> PreallocationPolicy:
    """The policy ``EngineConfig.preallocation`` names (validated there)."""
    return POLICIES[name](max_model_len)
