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

import time
from collections import deque
from dataclasses import dataclass, field

from fivefold.engine.config import EngineConfig
from fivefold.engine.kv_cache_manager import KVCacheManager
from fivefold.engine.preallocation import make_preallocation_policy
from fivefold.engine.sequence import Sequence, SequenceStatus


@dataclass
class SchedulerOutput:
    """The sequences of one step and the number of new tokens each computes."""

    scheduled: list[tuple[Sequence, int]] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


class Scheduler:
    """Owns the waiting and running queues."""

    def __init__(self, config: EngineConfig, kv_cache: KVCacheManager, max_model_len: int) -> None:
        self.config = config
        self.kv_cache = kv_cache
        self.max_model_len = max_model_len
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0
        self.preallocation = make_preallocation_policy(config.preallocation, max_model_len)

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
            if not seq.is_ready:  # its grammar is still computing the next mask: it sits this step out
                i += 1
                continue
            num_new = min(seq.num_scheduled_tokens_wanted, budget)
            del seq.spec_token_ids[max(0, num_new - seq.num_uncomputed_tokens):]  # proposals past the budget
            self.preallocation.on_step(seq, num_new - len(seq.spec_token_ids))
            lookahead = self.preallocation.lookahead(seq, num_new)
            while not self.kv_cache.allocate_slots(seq, num_new, num_lookahead_tokens=lookahead):
                if seq.spec_token_ids:  # short of blocks: drop the proposals before preempting anyone
                    num_new -= len(seq.spec_token_ids)
                    seq.spec_token_ids.clear()
                    lookahead = self.preallocation.lookahead(seq, num_new)
                    continue
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
            if not seq.is_ready:
                continue
            if seq.num_reserved_tokens == 0 or seq.num_preemptions:
                seq.num_reserved_tokens = self.preallocation.reservation(seq)
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
                self.preallocation.on_admit(seq)
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

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.kv_cache.free(seq)
        seq.spec_token_ids.clear()
        seq.num_computed_tokens = 0
        seq.status = SequenceStatus.WAITING
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(seq)

    def commit_computed(self, batch: SchedulerOutput) -> None:
        """After the forward pass: the scheduled tokens are in the KV cache. Advance progress
        counters and publish newly completed blocks to the prefix cache."""
        for seq, num_new in batch.scheduled:
            # Proposals are not the sequence's tokens until verified: see commit_accepted.
            seq.num_computed_tokens += num_new - len(seq.spec_token_ids)
            self.kv_cache.cache_full_blocks(seq)

    def commit_accepted(self, seq: Sequence, num_accepted: int) -> None:
        """After verification: the first ``num_accepted`` proposals were appended to ``seq``'s
        tokens, and their keys and values, computed this step, are valid. The rejected tail's
        slots are released: blocks beyond what the sequence holds (and its reservation) go back."""
        seq.num_computed_tokens += num_accepted
        seq.spec_token_ids.clear()
        self.kv_cache.cache_full_blocks(seq)
        self.kv_cache.free_tail(seq, max(seq.num_tokens, seq.num_reserved_tokens))

    def finish(self, seq: Sequence) -> None:
        """Remove a finished (or aborted) sequence and free its blocks in this step."""
        seq.spec_token_ids.clear()
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        unused = len(seq.block_ids) - self.kv_cache.num_blocks_for(seq.num_tokens) if seq.block_ids else 0
        self.preallocation.on_finish(seq, unused)
        self.kv_cache.free(seq)
