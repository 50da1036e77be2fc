"""The stop-string holdback: the incremental KMP tracker against a brute-force reference, over
random texts fed in random pieces and random stop sets (issue 34, finding 8: the scan was
O(sum |stop|^2) per step; the tracker reads each new character once per stop)."""

from __future__ import annotations

import random

from fivefold.engine.stop_strings import StopStringTracker, stop_prefix_len


def _reference(text: str, stops) -> int:
    return max((k for s in stops for k in range(1, len(s)) if text.endswith(s[:k])), default=0)


def test_tracker_and_prefix_len_match_the_reference_after_every_piece():
    rng = random.Random(34)
    for _ in range(2000):
        alphabet = rng.choice(["ab", "abc", "a\u00e9\u2603"])
        stops = ["".join(rng.choice(alphabet) for _ in range(rng.randint(1, 8))) for _ in range(rng.randint(1, 4))]
        tracker, text = StopStringTracker(stops), ""
        for _ in range(rng.randint(1, 12)):
            piece = "".join(rng.choice(alphabet + "z") for _ in range(rng.randint(0, 4)))
            text += piece
            tracker.feed(piece)
            if any(s in text for s in stops):
                break  # the engine stops the request at a whole match
            assert tracker.holdback == _reference(text, stops), (text, stops)
            assert stop_prefix_len(text, stops) == _reference(text, stops), (text, stops)


def test_long_near_matches_of_long_stops_stay_exact():
    """16 stops of 1,000 characters and a text of 21,000 that keeps almost matching them, fed one
    character at a time (the worst case of the old scan, which compared every prefix of every stop
    at every step): the holdback stays exact."""
    stops = ["a" * 999 + chr(ord("b") + i) for i in range(16)]
    tracker, text = StopStringTracker(stops), ""
    for i in range(21_000):
        piece = "a" if i % 1500 else "x"
        text += piece
        tracker.feed(piece)
    assert tracker.holdback == _reference(text[-1000:], stops) == 999
