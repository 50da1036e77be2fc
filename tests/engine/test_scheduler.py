"""Continuous batching on a fake model: the real scheduler and KV cache manager, driven
by a stand-in for the model whose next token is a function of the tokens so far."""

from __future__ import annotations

from fivefold.engine.config import EngineConfig
from fivefold.engine.kv_cache_manager import KVCacheManager
from fivefold.engine.scheduler import Scheduler
from fivefold.engine.sequence import Sequence
from fivefold.sampling_params import SamplingParams

BS = 4


class FakeEngine:
    def __init__(self, num_blocks: int, prefix: bool = True, **config) -> None:
        self.config = EngineConfig(block_size=BS, **config)
        self.kv = KVCacheManager(num_blocks, BS, prefix)
        self.sched = Scheduler(self.config, self.kv, max_model_len=4096)
        self.live: dict[str, Sequence] = {}
        self.done: dict[str, Sequence] = {}

    def add(self, name: str, prompt: list[int], max_tokens: int) -> Sequence:
        seq = Sequence(name, prompt, SamplingParams(max_tokens=max_tokens))
        self.live[name] = seq
        self.sched.add(seq)
        return seq

    def step(self) -> list[tuple[str, int]]:
        out = self.sched.schedule()
        plan = [(s.request_id, n) for s, n in out.scheduled]
        self.sched.commit_computed(out)
        for seq, _ in out.scheduled:
            if seq.num_computed_tokens == seq.num_tokens:
                seq.token_ids.append(1000 + sum(seq.token_ids) % 997)  # deterministic "model"
                if seq.num_output_tokens >= seq.params.max_tokens:
                    seq.finish("length")
                    self.sched.finish(seq)
                    self.done[seq.request_id] = self.live.pop(seq.request_id)
        self.kv.check_integrity(self.live.values())
        return plan

    def abort(self, name: str) -> None:
        seq = self.live.pop(name)
        seq.finish("abort")
        self.sched.finish(seq)
        self.kv.check_integrity(self.live.values())

    def run(self, max_steps: int = 1000) -> None:
        for _ in range(max_steps):
            if not self.sched.has_unfinished:
                return
            self.step()
        raise AssertionError("did not finish")


def test_chunked_prefill_never_stalls_decodes():
    eng = FakeEngine(num_blocks=64, max_num_batched_tokens=8)
    eng.add("a", list(range(6)), max_tokens=10)
    assert eng.step() == [("a", 6)]
    eng.add("b", list(range(100, 120)), max_tokens=2)
    # a decodes every step; b's 20-token prompt comes in chunks of what is left of the budget.
    assert eng.step() == [("a", 1), ("b", 7)]
    assert eng.step() == [("a", 1), ("b", 7)]
    assert eng.step() == [("a", 1), ("b", 6)]
    assert eng.step() == [("a", 1), ("b", 1)]
    assert eng.done["b"].num_output_tokens == 2 and eng.live["a"].num_output_tokens == 5


def test_finished_sequence_frees_blocks_in_its_step_and_waiting_joins():
    eng = FakeEngine(num_blocks=3, prefix=False, max_num_batched_tokens=64)
    eng.add("a", list(range(7)), max_tokens=2)  # computes 8 tokens at most: 2 blocks
    eng.add("b", list(range(50, 57)), max_tokens=1)  # needs 2 blocks, 1 is free: waits
    assert eng.step() == [("a", 7)]
    assert eng.live["a"].block_ids == [0, 1]
    assert eng.step() == [("a", 1)]  # a finishes here, its blocks return
    assert "a" in eng.done and eng.kv.num_free_blocks == 3
    assert eng.step() == [("b", 7)]
    assert eng.done["b"].finish_reason == "length"
    assert eng.kv.num_free_blocks == 3


def test_preemption_victim_is_most_recent_and_nothing_is_lost():
    reference = FakeEngine(num_blocks=100, prefix=False)
    tight = FakeEngine(num_blocks=7, prefix=False)
    for eng in (reference, tight):
        for i, n in enumerate([5, 6, 7]):
            eng.add(f"s{i}", list(range(10 * i, 10 * i + n)), max_tokens=8)
    reference.run()
    # 3 prompts need 2+2+2 blocks; growth to 13-15 tokens needs 4 each: someone must give way.
    plan = tight.step()
    assert plan == [("s0", 5), ("s1", 6), ("s2", 7)]
    while not tight.sched.num_preemptions:
        tight.step()
    assert tight.live["s2"].num_preemptions == 1 and tight.live["s2"].num_computed_tokens == 0
    assert tight.live["s0"].num_preemptions == 0 and tight.live["s1"].num_preemptions == 0
    assert tight.sched.waiting[0].request_id == "s2"
    tight.run()
    assert {k: v.token_ids for k, v in tight.done.items()} == {k: v.token_ids for k, v in reference.done.items()}
    assert tight.kv.num_free_blocks == 7


def test_interleaved_arrivals_with_shared_prefix():
    eng = FakeEngine(num_blocks=16, max_num_batched_tokens=32)
    system = list(range(200, 212))  # 3 full blocks
    eng.add("a", system + [1, 2], max_tokens=3)
    eng.step()
    assert eng.live["a"].block_ids == [0, 1, 2, 3]
    eng.add("b", system + [3], max_tokens=3)
    plan = eng.step()
    assert plan == [("a", 1), ("b", 1)]  # b computes only its last token
    assert eng.live["b"].block_ids == [0, 1, 2, 4] and eng.live["b"].num_cached_tokens == 12
    assert eng.kv.ref_counts[:5] == [2, 2, 2, 1, 1]
    eng.add("c", system[:8] + [9, 9, 9, 9, 9], max_tokens=2)
    eng.step()
    # a finished in this step (3 outputs): b and c share blocks 0-1, b alone holds 2.
    assert "a" in eng.done
    assert eng.live["c"].block_ids[:2] == [0, 1] and eng.kv.ref_counts[:3] == [2, 2, 1]
    eng.run()
    stats = eng.kv.stats
    assert (stats.num_queries, stats.num_hits) == (14 + 13 + 13, 12 + 8)
    # Everything finished: the published blocks are cached, nothing is in use.
    assert eng.kv.num_used_blocks == 0 and eng.kv.num_evictable_blocks > 0


def test_abort_mid_prefill_and_mid_decode_frees_blocks():
    eng = FakeEngine(num_blocks=16, max_num_batched_tokens=8)
    eng.add("a", list(range(6)), max_tokens=20)
    eng.step()
    eng.add("b", list(range(50, 70)), max_tokens=5)
    eng.step()  # b has computed one chunk
    assert 0 < eng.live["b"].num_computed_tokens < 20
    b_blocks = list(eng.live["b"].block_ids)
    eng.abort("b")
    assert all(eng.kv.ref_counts[i] == 0 for i in b_blocks)
    eng.step()
    eng.abort("a")  # mid-decode
    assert eng.kv.num_used_blocks == 0 and not eng.sched.has_unfinished


def test_pool_exhaustion_keeps_requests_waiting_until_blocks_allow():
    eng = FakeEngine(num_blocks=3, prefix=False)
    eng.add("a", list(range(8)), max_tokens=4)  # 3 blocks
    eng.add("b", list(range(20, 28)), max_tokens=4)
    eng.step()
    assert [s.request_id for s in eng.sched.running] == ["a"] and len(eng.sched.waiting) == 1
    eng.run()
    assert set(eng.done) == {"a", "b"}


def test_preallocation_full_and_predicted_count_bad_guesses():
    full = FakeEngine(num_blocks=32, prefix=False, preallocation="full")
    full.add("a", list(range(5)), max_tokens=12)
    full.step()
    assert len(full.live["a"].block_ids) == 5  # 17 tokens reserved up front
    full.run()
    assert full.sched.preallocation.stats.num_reservations == 1 and full.sched.preallocation.stats.num_too_small == 0

    pred = FakeEngine(num_blocks=32, prefix=False, preallocation="predicted")
    pred.add("a", list(range(4)), max_tokens=2)
    pred.run()
    pred.add("b", list(range(4)), max_tokens=9)  # predicted 2 outputs, will need 9
    pred.step()
    assert len(pred.live["b"].block_ids) == 2
    pred.run()
    r = pred.sched.preallocation.stats
    assert (r.num_reservations, r.num_too_small) == (2, 1)
    early = FakeEngine(num_blocks=32, prefix=False, preallocation="full")
    seq = early.add("c", list(range(4)), max_tokens=12)
    early.step()
    seq.finish("stop")
    early.sched.finish(seq)  # stopped after 1 of 12 tokens: 2 of its 4 reserved blocks never written
    assert early.sched.preallocation.stats.num_too_large == 1 and early.sched.preallocation.stats.num_unused_blocks == 2


def test_shared_prefix_arriving_together_is_computed_once():
    eng = FakeEngine(num_blocks=32, max_num_batched_tokens=64)
    system = list(range(300, 312))  # 3 full blocks
    eng.add("a", system + [1, 2], max_tokens=2)
    eng.add("b", system + [3, 4, 5], max_tokens=2)
    eng.add("c", [7, 8, 9], max_tokens=2)  # unrelated: not held back
    # b's next block is being computed by a: b waits a step instead of computing it twice.
    assert eng.step() == [("a", 14), ("c", 3)]
    assert [s.request_id for s in eng.sched.waiting] == ["b"]
    assert eng.step() == [("a", 1), ("c", 1), ("b", 3)]
    assert eng.done["a"].num_output_tokens == 2
    # a held blocks 0-3 and c block 4; b reuses a's three published prefix blocks.
    assert eng.live["b"].num_cached_tokens == 12 and eng.live["b"].block_ids[:3] == [0, 1, 2]


def test_without_prefix_cache_nothing_is_held_back():
    eng = FakeEngine(num_blocks=32, prefix=False, max_num_batched_tokens=64)
    system = list(range(300, 312))
    eng.add("a", system + [1, 2], max_tokens=2)
    eng.add("b", system + [3, 4, 5], max_tokens=2)
    assert eng.step() == [("a", 14), ("b", 15)]
