"""Iteration-level (continuous) batching.

Each step the scheduler picks which sequences run and how many tokens each
computes, within a token budget (``max_num_batched_tokens``) and a sequence cap
(``max_num_seqs``). Running sequences go first, so decodes never wait behind a long
prompt; a prompt that does not fit the remaining budget is computed in chunks over
several steps (chunked prefill). A newly admitted sequence starts after its longest
cached prefix. When blocks run out, the most recently admitted sequence is
preempted: its blocks are freed and it is recomputed later from its tokens (its
published blocks usually still in the prefix cache), so no request is lost and
greedy output stays identical.
"""

from __future__ import annotations

import math
import time
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
    def is_empty(self) -> bool:
        return not self.scheduled


@dataclass
class ReservationStats:
    """How the pre-allocation policy's guesses turned out."""

    num_reservations: int = 0
    num_too_small: int = 0  # the sequence outgrew its reservation
    num_too_large: int = 0  # it finished with whole reserved blocks unused
    num_unused_blocks: int = 0  # total reserved blocks never written


class Scheduler:
    """Owns the waiting and running queues."""

    def __init__(self, config: EngineConfig, kv_cache: KVCacheManager, max_model_len: int) -> None:
        self.config = config
        self.kv_cache = kv_cache
        self.max_model_len = max_model_len
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0
        self.reservations = ReservationStats()
        self.recent_output_lengths: deque[int] = deque(maxlen=100)

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    @property
    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.config.max_num_batched_tokens
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            num_new = min(seq.num_uncomputed_tokens, budget)
            while not self.kv_cache.allocate_slots(seq, num_new, num_lookahead_tokens=self._lookahead(seq, num_new)):
                victim = self.running[-1]
                self._preempt(victim)
                out.preempted.append(victim)
                if victim is seq:
                    break
            else:
                out.scheduled.append((seq, num_new))
                budget -= num_new
                i += 1
                continue
            break  # seq itself was preempted: nothing after it is running
        # Admit waiting sequences, oldest first, unless this step already had to preempt.
        in_flight = self._in_flight_prefix_blocks()
        for seq in list(self.waiting):
            if budget <= 0 or out.preempted or len(self.running) >= self.config.max_num_seqs:
                break
            if seq.num_reserved_tokens == 0 or seq.num_preemptions:
                seq.num_reserved_tokens = self._reservation(seq)
            computed = self.kv_cache.get_computed_blocks(seq)
            if self._is_prefix_in_flight(seq, len(computed), in_flight):
                continue  # its next block is being computed by another prompt: reuse it next step
            num_hit_tokens = len(computed) * self.kv_cache.block_size
            num_new = min(seq.num_uncomputed_tokens - num_hit_tokens, budget)
            lookahead = max(0, seq.num_reserved_tokens - (seq.num_computed_tokens + num_hit_tokens + num_new))
            if not self.kv_cache.allocate_slots(seq, num_new, computed, lookahead):
                break
            self.waiting.remove(seq)
            if seq.num_preemptions == 0:
                self.kv_cache.record_prefix_query(seq.num_tokens, num_hit_tokens)
                seq.num_cached_tokens = num_hit_tokens
                seq.metrics.first_scheduled_time = time.monotonic()
                if self.config.preallocation != "none":
                    self.reservations.num_reservations += 1
            seq.num_computed_tokens += num_hit_tokens
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            out.scheduled.append((seq, num_new))
            budget -= num_new
            if self.kv_cache.prefix_cache is not None:
                in_flight.update(self._uncomputed_prompt_blocks(seq))
        return out

    # In-batch prefix sharing (as SGLang does): a prompt whose next uncached block is
    # being computed right now by another prompt waits a step and then reuses it,
    # instead of computing the same keys and values twice.
    def _uncomputed_prompt_blocks(self, seq: Sequence) -> list[int]:
        hashes = seq.prompt_block_hashes(self.kv_cache.block_size)
        return hashes[seq.num_computed_tokens // self.kv_cache.block_size:]

    def _in_flight_prefix_blocks(self) -> set[int]:
        if self.kv_cache.prefix_cache is None:
            return set()
        blocks: set[int] = set()
        for seq in self.running:
            if seq.num_computed_tokens < seq.num_prompt_tokens:
                blocks.update(self._uncomputed_prompt_blocks(seq))
        return blocks

    def _is_prefix_in_flight(self, seq: Sequence, num_hit_blocks: int, in_flight: set[int]) -> bool:
        if not in_flight or seq.num_preemptions:
            return False
        hashes = seq.prompt_block_hashes(self.kv_cache.block_size)
        # The last prompt token is always computed, so a block ending there is never shared.
        if num_hit_blocks >= len(hashes) or (num_hit_blocks + 1) * self.kv_cache.block_size >= seq.num_prompt_tokens:
            return False
        return hashes[num_hit_blocks] in in_flight

    def _reservation(self, seq: Sequence) -> int:
        """Token capacity to reserve at admission, per the pre-allocation policy."""
        policy = self.config.preallocation
        if policy == "none":
            return 0
        max_output = seq.params.max_tokens
        if policy == "predicted" and self.recent_output_lengths:
            ordered = sorted(self.recent_output_lengths)
            p90 = ordered[min(len(ordered) - 1, math.ceil(0.9 * len(ordered)) - 1)]
            max_output = min(max_output, p90)
        return min(seq.num_prompt_tokens + max_output, self.max_model_len)

    def _lookahead(self, seq: Sequence, num_new: int) -> int:
        if not seq.num_reserved_tokens:
            return 0
        needed = seq.num_computed_tokens + num_new
        if needed > seq.num_reserved_tokens and not seq.is_reservation_exceeded:
            seq.is_reservation_exceeded = True
            self.reservations.num_too_small += 1
        return max(0, seq.num_reserved_tokens - needed)

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.kv_cache.free(seq)
        seq.num_computed_tokens = 0
        seq.status = SequenceStatus.WAITING
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(seq)

    def postprocess(self, batch: SchedulerOutput) -> None:
        """Advance progress counters and publish newly completed blocks to the prefix cache."""
        for seq, num_new in batch.scheduled:
            seq.num_computed_tokens += num_new
            self.kv_cache.cache_full_blocks(seq)

    def finish(self, seq: Sequence) -> None:
        """Remove a finished (or aborted) sequence and free its blocks in this step."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        if seq.num_reserved_tokens and seq.block_ids:
            unused = len(seq.block_ids) - self.kv_cache.num_blocks_for(seq.num_tokens)
            if unused > 0:
                self.reservations.num_too_large += 1
                self.reservations.num_unused_blocks += unused
        if seq.finish_reason != "abort":
            self.recent_output_lengths.append(seq.num_output_tokens)
        self.kv_cache.free(seq)
