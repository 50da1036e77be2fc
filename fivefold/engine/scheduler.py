"""Iteration-level (continuous) batching.

Each step the scheduler picks which sequences run and how many tokens each
computes, within a token budget (``max_num_batched_tokens``) and a sequence cap
(``max_num_seqs``). Running sequences go first, so decodes never wait behind a long
prompt; a prompt that does not fit the remaining budget is computed in chunks over
several steps (chunked prefill). When blocks run out, the most recently admitted
sequence is preempted: its blocks are freed and it is recomputed later from its
tokens, so no request is lost and greedy output stays identical.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from fivefold.engine.config import EngineConfig
from fivefold.engine.kv_cache_manager import KVCacheManager
from fivefold.engine.sequence import Sequence, SequenceStatus


@dataclass
class SchedulerOutput:
    """The sequences of one step and the number of new tokens each computes."""

    scheduled: list[tuple[Sequence, int]] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)

    @property
    def num_batched_tokens(self) -> int:
        return sum(n for _, n in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


class Scheduler:
    """Owns the waiting and running queues."""

    def __init__(self, config: EngineConfig, kv_cache: KVCacheManager) -> None:
        self.config = config
        self.kv_cache = kv_cache
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    @property
    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.config.max_num_batched_tokens
        scheduled_ids: set[str] = set()
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            num_new = min(seq.num_uncomputed_tokens, budget)
            while not self.kv_cache.allocate_slots(seq, num_new):
                victim = self.running[-1]
                self._preempt(victim)
                out.preempted.append(victim)
                if victim is seq:
                    break
            else:
                out.scheduled.append((seq, num_new))
                scheduled_ids.add(seq.request_id)
                budget -= num_new
                i += 1
                continue
            break  # seq itself was preempted: nothing after it is running
        # Admit waiting sequences, oldest first, unless this step already had to preempt.
        while self.waiting and budget > 0 and not out.preempted and len(self.running) < self.config.max_num_seqs:
            seq = self.waiting[0]
            num_new = min(seq.num_uncomputed_tokens, budget)
            if not self.kv_cache.allocate_slots(seq, num_new):
                break
            self.waiting.popleft()
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            out.scheduled.append((seq, num_new))
            budget -= num_new
        return out

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.kv_cache.free(seq)
        seq.num_computed_tokens = 0
        seq.status = SequenceStatus.WAITING
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(seq)

    def finish(self, seq: Sequence) -> None:
        """Remove a finished (or aborted) sequence and free its blocks in this step."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.kv_cache.free(seq)
