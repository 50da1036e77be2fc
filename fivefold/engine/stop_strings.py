"""Stop strings: how much of a text's tail could still grow into one, in time linear in the text.

A streaming request holds back the tail of its text that is a proper prefix of a stop string
(vLLM does the same), so a client never receives text that the final answer cuts. Finding that
tail by comparing every prefix of every stop string costs O(sum |stop|^2) per step (16 stops of
1,000 characters: ~1 s a step at 64 sequences). Here each stop string gets a Knuth-Morris-Pratt
automaton whose state, the length of the longest prefix of the stop that ends the text, is
advanced over the new characters only: O(new characters x stops) per step, amortized.
"""

from __future__ import annotations

from functools import lru_cache


@lru_cache(maxsize=1024)
def _failure(stop: str) -> tuple[int, ...]:
    """KMP's failure function: entry i is the length of the longest proper border of stop[:i + 1]."""
    fail = [0] * len(stop)
    k = 0
    for i in range(1, len(stop)):
        while k and stop[i] != stop[k]:
            k = fail[k - 1]
        if stop[i] == stop[k]:
            k += 1
        fail[i] = k
    return tuple(fail)


def _advance(stop: str, fail: tuple[int, ...], k: int, text: str) -> int:
    """The automaton of ``stop`` in state ``k`` after reading ``text``."""
    for ch in text:
        if k == len(stop):  # a whole match: continue from its longest border
            k = fail[k - 1]
        while k and stop[k] != ch:
            k = fail[k - 1]
        if stop[k] == ch:
            k += 1
    return k


class StopStringTracker:
    """Per request: fed each new piece of text, it knows the longest tail that is a proper prefix of
    one of ``stops`` (:attr:`holdback`)."""

    def __init__(self, stops: tuple[str, ...] | list[str]) -> None:
        self.stops = tuple(s for s in stops if s)
        self._fail = [_failure(s) for s in self.stops]
        self._states = [0] * len(self.stops)

    def feed(self, text: str) -> None:
        for i, stop in enumerate(self.stops):
            self._states[i] = _advance(stop, self._fail[i], self._states[i], text)

    @property
    def holdback(self) -> int:
        """Characters at the end of the text fed so far that could still begin a stop string."""
        return max((k for k, stop in zip(self._states, self.stops) if k < len(stop)), default=0)


def stop_prefix_len(text: str, stops: list[str] | tuple[str, ...]) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of one of ``stops`` (0 if none),
    in O(sum |stop|): only the last |stop| - 1 characters can matter."""
    longest = 0
    for stop in stops:
        if len(stop) > 1:
            k = _advance(stop, _failure(stop), 0, text[-(len(stop) - 1):])
            longest = max(longest, k if k < len(stop) else _failure(stop)[-1])
    return longest
