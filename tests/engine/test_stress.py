"""Randomized, stateful tests of scheduler + KV cache manager + prefix cache: many random
operations against a tiny pool, the invariants checked after each (fivefold/engine/stress.py).
benchmarks/scheduler_stress.py runs the same driver over many more seeds."""

from __future__ import annotations

import random

import pytest

from fivefold.engine.config import EngineConfig
from fivefold.engine.kv_cache_manager import KVCacheManager
from fivefold.engine.llm_engine import LLMEngine
from fivefold.engine.sequence import Sequence
from fivefold.engine.stress import StressConfig, run_stress
from fivefold.models import load_model
from fivefold.sampling_params import SamplingParams
from tests.conftest import TINY_VOCAB, save_random_hf_model

CONFIGS = {
    "issue-16": StressConfig(),  # 24 blocks of 16, waves of 12, 64-token shared prompt, max_tokens 1-120
    "reserve-full": StressConfig(preallocation="full"),
    "reserve-predicted": StressConfig(preallocation="predicted"),
    "no-prefix-cache": StressConfig(enable_prefix_caching=False),
    "tiny-chunks": StressConfig(num_blocks=40, block_size=4, prompt_len=40, max_tokens=100,
                                max_num_batched_tokens=16),
    "speculation": StressConfig(speculation_rate=0.5),
    "speculation-reserve-full": StressConfig(speculation_rate=0.5, preallocation="full"),
    "speculation-tiny-chunks": StressConfig(num_blocks=40, block_size=4, prompt_len=40, max_tokens=100,
                                            max_num_batched_tokens=16, speculation_rate=0.7),
}


@pytest.mark.parametrize("name", CONFIGS)
def test_random_workloads_keep_every_invariant(name):
    totals = {"finished": 0, "aborted": 0, "preemptions": 0, "hits": 0, "accepted": 0}
    for seed in range(40):
        r = run_stress(seed, 300, CONFIGS[name])
        totals["finished"] += r.num_finished
        totals["aborted"] += r.num_aborted
        totals["preemptions"] += r.num_preemptions
        totals["hits"] += r.num_prefix_hit_tokens
        totals["accepted"] += r.num_accepted_tokens
    # The workload reaches what it is for: finishes, aborts, preemption and (with the cache) prefix hits.
    assert totals["finished"] > 100 and totals["aborted"] > 20, totals
    # Reserving every request's whole length at admission is what makes preemption unnecessary.
    assert (totals["preemptions"] > 20) == (CONFIGS[name].preallocation != "full"), totals
    assert (totals["hits"] > 0) == CONFIGS[name].enable_prefix_caching, totals
    assert (totals["accepted"] > 100) == (CONFIGS[name].speculation_rate > 0), totals


def test_a_private_copy_is_never_linked_below_a_block_its_sequence_does_not_hold():
    """Issue 16's crash: two sequences computed the same prefix at once. The second's copy stays
    private, and so do its later blocks, so the first's blocks become evictable, and are evicted, when
    it finishes, even while the second still runs."""
    kv = KVCacheManager(num_blocks=8, block_size=4)
    prefix = list(range(1, 9))  # two full blocks
    a = Sequence("a", prefix + [50], SamplingParams(max_tokens=4))
    b = Sequence("b", prefix + [60, 61, 62, 63, 64], SamplingParams(max_tokens=4))
    assert kv.allocate_slots(a, a.num_tokens) and kv.allocate_slots(b, b.num_tokens)
    assert (a.block_ids, b.block_ids) == ([0, 1, 2], [3, 4, 5, 6])
    for seq in (a, b):
        seq.num_computed_tokens = seq.num_tokens
        kv.cache_full_blocks(seq)
    assert sorted(kv.prefix_cache.nodes_by_block) == [0, 1]  # b's [3, 4] duplicate a's; its block 5 not linked
    kv.free(a)
    assert kv.evictable == {0, 1} and kv.ref_counts[:7] == [0, 0, 0, 1, 1, 1, 1]
    kv.check_integrity([b])
    c = Sequence("c", list(range(100, 116)), SamplingParams(max_tokens=4))
    assert kv.allocate_slots(c, c.num_tokens)  # 4 blocks: the 2 free ones, then a's evicted leaf-first
    assert c.block_ids == [7, 2, 1, 0]
    kv.check_integrity([b, c])
    assert kv.num_evictable_blocks == 0 and kv.prefix_cache.num_published_blocks == 0


@pytest.mark.parametrize("speculative", [None, "ngram"])
def test_the_engine_survives_the_issue_16_workload(tmp_path, speculative):
    """The reported crash, on the real engine: a random-weight 2-layer Llama, 24 blocks of 16,
    prefix caching, waves of 12 mixing identical, block-aligned, shared-start and random prompts,
    max_tokens 1-120, random aborts; integrity checked after every step. With prompt-lookup
    speculation too (1-grams matched, so most decoding rows carry proposals)."""
    save_random_hf_model("llama", tmp_path, seed=1)
    loaded = load_model(str(tmp_path))
    c = loaded.config
    bytes_per_block = 2 * c.num_layers * c.num_kv_heads * c.head_dim * 4 * 16
    engine = LLMEngine(loaded, EngineConfig(block_size=16, kv_cache_memory_bytes=24 * bytes_per_block,
                                            max_num_batched_tokens=128, max_num_seqs=12, speculative=speculative,
                                            prompt_lookup_min=1))
    assert engine.kv_cache.num_blocks == 24
    rng = random.Random(0)
    base = [rng.randrange(3, TINY_VOCAB) for _ in range(64)]
    finished, aborted = 0, 0
    for wave in range(3):
        ids = []
        for i in range(12):
            kind = i % 4
            prompt = (base if kind == 0 else base[: 16 * rng.randint(1, 4)] if kind == 1 else
                      base[: rng.randint(1, 64)] + [rng.randrange(3, TINY_VOCAB) for _ in range(rng.randint(1, 30))]
                      if kind == 2 else [rng.randrange(3, TINY_VOCAB) for _ in range(rng.randint(1, 64))])
            ids.append(engine.add_request(prompt, SamplingParams(temperature=0, max_tokens=rng.randint(1, 120),
                                                                 ignore_eos=True)))
        while engine.has_unfinished:
            for out in engine.step():
                finished += out.finished
            if rng.random() < 0.05 and engine.requests:
                engine.abort(rng.choice(sorted(engine.requests)))
                aborted += 1
            engine.kv_cache.check_integrity([s.seq for s in engine.requests.values()])
    assert finished + aborted == 36
    assert engine.stats()["num_used_blocks"] == 0 and engine.stats()["num_preemptions"] > 0
    assert (engine.stats()["spec_num_draft_tokens"] > 0) == (speculative is not None)
