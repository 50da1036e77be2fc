"""A seeded random workload for the scheduler, the KV cache manager and the prefix cache,
with the invariants checked after every operation (the kind of test that finds what
hand-written scenarios miss).

No model runs: the next token is a function of the tokens so far, so every step is
cheap and a failure replays exactly from its seed. Arrivals mix identical prompts,
block-aligned prefixes of them, shared starts with random tails and random prompts;
sequences are prefilled in chunks, preempted when the pool runs dry, aborted at random
and finished by length; with ``speculation_rate`` decoding rows also get speculative
proposals, of which a random prefix is accepted (the rejected tail's blocks released). After every step and abort:

- ``KVCacheManager.check_integrity``: free + cached + in use == total, ref counts equal
  the live block tables, and every block counted as evictable can be evicted now;
- each waiting/running sequence is in exactly one queue, and nothing is lost: every
  request added is live or finished;
- no running sequence holds a block past its tokens and its reservation;
- the whole pool is reclaimable: evicting every evictable block leaves none cached.

``run_stress(seed, num_ops)`` is what the test suite runs with a fixed seed and
``benchmarks/scheduler_stress.py`` runs for many seeds.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from fivefold.engine.config import EngineConfig
from fivefold.engine.kv_cache_manager import KVCacheManager
from fivefold.engine.scheduler import Scheduler
from fivefold.engine.sequence import Sequence, SequenceStatus
from fivefold.sampling_params import SamplingParams


@dataclass(frozen=True)
class StressConfig:
    num_blocks: int = 24
    block_size: int = 16
    max_num_seqs: int = 8
    max_num_batched_tokens: int = 96
    prompt_len: int = 64
    max_tokens: int = 120
    abort_rate: float = 0.05  # chance of one abort per step
    arrival_rate: float = 0.3  # chance of a wave of arrivals per step
    wave_size: int = 12
    max_live: int = 24  # no new wave while this many requests are live (the queue stays bounded)
    enable_prefix_caching: bool = True
    preallocation: str = "none"
    speculation_rate: float = 0.0  # chance that a decoding row gets 1-4 proposals in a step

    def __post_init__(self) -> None:
        if self.num_blocks < 1 or self.block_size < 1 or self.prompt_len < 1:
            raise ValueError("num_blocks, block_size and prompt_len must be >= 1")
        if self.prompt_len + self.max_tokens > self.num_blocks * self.block_size:
            raise ValueError("one request must fit the pool alone (prompt_len + max_tokens <= pool tokens)")


@dataclass
class StressResult:
    num_steps: int = 0
    num_added: int = 0
    num_finished: int = 0
    num_aborted: int = 0
    num_preemptions: int = 0
    num_prefix_hit_tokens: int = 0
    num_accepted_tokens: int = 0  # speculative proposals accepted (speculation_rate > 0)


def _prompt(rng: random.Random, base: list[int], cfg: StressConfig) -> list[int]:
    kind = rng.randrange(4)
    bs = cfg.block_size
    if kind == 0:
        return list(base)  # identical
    if kind == 1:  # a block-aligned prefix of it
        return base[: bs * rng.randint(1, max(1, len(base) // bs))]
    if kind == 2:  # its start plus a random tail
        return base[: rng.randint(1, len(base))] + [rng.randrange(1, 500) for _ in range(rng.randint(1, 40))]
    return [rng.randrange(1, 500) for _ in range(rng.randint(1, cfg.prompt_len))]


def check_invariants(sched: Scheduler, kv: KVCacheManager, live: dict[str, Sequence]) -> None:
    kv.check_integrity(live.values())
    queued = [s.request_id for s in sched.waiting] + [s.request_id for s in sched.running]
    assert len(queued) == len(set(queued)), "a sequence is queued twice"
    assert set(queued) == set(live), "a live request is in no queue, or a finished one still is"
    for seq in sched.running:
        assert seq.status == SequenceStatus.RUNNING and seq.num_computed_tokens <= seq.num_tokens
        # No block beyond the sequence's tokens and reservation (a rejected proposal's tail is released).
        limit = kv.num_blocks_for(max(seq.num_tokens + len(seq.spec_token_ids), seq.num_reserved_tokens))
        assert len(seq.block_ids) <= limit, f"{seq.request_id} holds {len(seq.block_ids)} blocks, needs {limit}"
    for seq in sched.waiting:
        assert not seq.block_ids and seq.num_computed_tokens == 0, "a waiting sequence holds blocks"


def check_reclaimable(kv: KVCacheManager) -> None:
    """Evict everything evictable (on the real structures: call between runs or at the end)."""
    if kv.prefix_cache is None:
        return
    num = kv.num_evictable_blocks
    kv._evict(num)
    assert kv.num_evictable_blocks == 0, f"{kv.num_evictable_blocks} of {num} evictable blocks could not be evicted"


def run_stress(seed: int, num_steps: int = 400, cfg: StressConfig = StressConfig()) -> StressResult:
    """Drive ``num_steps`` random steps; raise AssertionError (with the seed) on any broken invariant."""
    rng = random.Random(seed)
    engine = EngineConfig(block_size=cfg.block_size, max_num_seqs=cfg.max_num_seqs,
                          max_num_batched_tokens=cfg.max_num_batched_tokens,
                          enable_prefix_caching=cfg.enable_prefix_caching, preallocation=cfg.preallocation)
    kv = KVCacheManager(cfg.num_blocks, cfg.block_size, cfg.enable_prefix_caching)
    sched = Scheduler(engine, kv, max_model_len=cfg.num_blocks * cfg.block_size)
    live: dict[str, Sequence] = {}
    result = StressResult()
    base = [rng.randrange(1, 500) for _ in range(cfg.prompt_len)]
    try:
        for step in range(num_steps):
            if not live or (len(live) < cfg.max_live and rng.random() < cfg.arrival_rate):
                for _ in range(rng.randint(1, cfg.wave_size)):
                    name = f"r{result.num_added}"
                    params = SamplingParams(max_tokens=rng.randint(1, cfg.max_tokens))
                    seq = Sequence(name, _prompt(rng, base, cfg), params)
                    live[name] = seq
                    sched.add(seq)
                    result.num_added += 1
            if live and rng.random() < cfg.abort_rate:
                seq = live.pop(rng.choice(sorted(live)))
                seq.finish("abort")
                sched.finish(seq)
                result.num_aborted += 1
                check_invariants(sched, kv, live)
            for seq in sched.running:  # speculation: proposals, a random prefix of which is accepted
                room = seq.params.max_tokens - seq.num_output_tokens - 1
                if seq.num_uncomputed_tokens == 1 and room > 0 and rng.random() < cfg.speculation_rate:
                    seq.spec_token_ids = [rng.randrange(1, 500) for _ in range(rng.randint(1, min(4, room)))]
            batch = sched.schedule()
            sched.commit_computed(batch)
            for seq, _ in batch.scheduled:
                if seq.num_computed_tokens == seq.num_tokens and not seq.is_finished:
                    proposals = seq.spec_token_ids
                    num_accepted = rng.randint(0, len(proposals)) if proposals else 0
                    for token in proposals[:num_accepted] + [1000 + sum(seq.token_ids[-8:]) % 997]:  # the "model"
                        seq.token_ids.append(token)
                        if seq.num_output_tokens >= seq.params.max_tokens:
                            break
                    if seq.num_output_tokens >= seq.params.max_tokens:
                        seq.finish("length")
                        sched.finish(seq)
                        del live[seq.request_id]
                        result.num_finished += 1
                    elif proposals:
                        sched.commit_accepted(seq, num_accepted)
                        result.num_accepted_tokens += num_accepted
            result.num_steps = step + 1
            check_invariants(sched, kv, live)
        for seq in list(live.values()):  # drain: abort what is left, then the pool must be whole again
            seq.finish("abort")
            sched.finish(seq)
        live.clear()
        check_invariants(sched, kv, live)
        check_reclaimable(kv)
        assert kv.num_free_blocks == cfg.num_blocks, "blocks leaked"
    except Exception as exc:
        raise AssertionError(f"seed {seed}, step {result.num_steps}: {type(exc).__name__}: {exc}") from exc
    result.num_preemptions = sched.num_preemptions
    result.num_prefix_hit_tokens = kv.stats.num_hits
    return result
