"""What every lever reports an LLM's accuracy and speed with: held-out perplexity and
next-token accuracy (one prefill per window), and decode tokens/s on the serving engine.

Windows come from ``fivefold.eval.text``: calibration windows from the calibration part
of pydoc_data, evaluation windows from the held-out part, never the same text.
"""

from __future__ import annotations

import math

import torch

from fivefold.models.forward import sequence_logits

def language_metrics(model, windows: list[list[int]]) -> tuple[float, float]:
    """(perplexity, next-token accuracy in %) over every position of every window, one pass."""
    total, hits, count = 0.0, 0, 0
    for ids in windows:
        logits = sequence_logits(model, ids)[:-1]
        target = torch.as_tensor(ids[1:], dtype=torch.long)
        total += float(torch.nn.functional.cross_entropy(logits, target, reduction="sum"))
        hits += int((logits.argmax(dim=-1) == target).sum())
        count += target.numel()
    return math.exp(total / count), 100.0 * hits / count


def perplexity(model, windows: list[list[int]]) -> float:
    """exp(mean next-token negative log-likelihood) over every position of every window."""
    return language_metrics(model, windows)[0]


def next_token_accuracy(model, windows: list[list[int]]) -> float:
    """Share (%) of positions where the most likely token is the next one."""
    return language_metrics(model, windows)[1]


def served_model(loaded):
    """``loaded``'s model as the engine serves it by default (packed weights, the fused hot path;
    fivefold.engine.model_runner.serving_view): the model whose quality a lever reports. W8A8 with
    per-tensor activation scales moves held-out perplexity by ~0.6% between fused and eager ops."""
    from fivefold.engine.config import EngineConfig
    from fivefold.engine.model_runner import serving_view

    return serving_view(loaded.model, EngineConfig())


def decode_rate(outputs) -> float:
    """Decode tokens/s of finished requests that ran together: the tokens after each request's
    first, over the span from the first first-token to the last finish (prefill excluded, the
    batch's decode steps included)."""
    span = max(o.metrics.finished_time for o in outputs) - min(o.metrics.first_token_time for o in outputs)
    num_tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    return (num_tokens - len(outputs)) / span if span > 0 else 0.0


def decode_speed(loaded, batch: int, num_tokens: int, repeats: int = 2) -> float:
    """Decode tokens/s of ``batch`` concurrent 64-token held-out prompts on the serving engine
    (greedy, EOS ignored): the best of ``repeats`` runs, so that one-off costs (oneDNN compiling
    kernels for a new shape on its first call, page faults) are not counted against whichever
    configuration meets them first."""
    from fivefold.engine.config import EngineConfig
    from fivefold.engine.llm_engine import LLMEngine
    from fivefold.eval.text import corpus_ids, corpus_prompts
    from fivefold.sampling_params import SamplingParams

    c = loaded.config
    # room for every sequence at once (16-token blocks, float32 K and V): a pool that holds fewer
    # preempts and recomputes, and measures the scheduler's thrashing instead of decoding (an 8B's
    # 262 KB per token fills 512 MiB with 2,048 tokens, a third of batch 32's)
    kv_bytes = batch * (-(-(64 + num_tokens) // 16) + 1) * 16 * 2 * c.num_layers * c.kv_size * 4
    engine = LLMEngine(loaded, EngineConfig.from_options(max_num_seqs=batch,
                                                         kv_cache_memory_bytes=float(max(512 << 20, kv_bytes))))
    prompts = corpus_prompts(corpus_ids(loaded.tokenizer, "heldout"), batch, 64, seed=0)
    params = [SamplingParams(temperature=0, max_tokens=num_tokens, ignore_eos=True)] * batch
    return max(decode_rate(engine.run_to_completion(prompts, params)) for _ in range(repeats))


def engine_teacher_forced(loaded, windows: list[list[int]], chunk: int = 64, num_top: int = 1,
                          **engine_options) -> list[dict]:
    """Teacher-forced next-token entries ({"token_id", "logprob", "top": [(id, logprob)]}) of every
    position of every window after the first, computed by the serving engine through its paged KV
    cache: prompt logprobs, prefix caching off, ``chunk``-token chunks, so every chunk after the
    first reads its context from the cache as decoding does (what a KV cache option such as
    ``kv_cache_dtype="int8"`` changes, and a one-prefill perplexity would not see). ``num_top``:
    the most likely tokens each entry lists."""
    from fivefold.engine.config import EngineConfig
    from fivefold.engine.llm_engine import LLMEngine
    from fivefold.sampling_params import SamplingParams

    options = {"kv_cache_memory_bytes": float(64 << 20), **engine_options}
    engine = LLMEngine(loaded, EngineConfig.from_options(enable_prefix_caching=False, max_num_batched_tokens=chunk,
                                                         **options))
    outs = engine.run_to_completion(windows, [SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=num_top)]
                                    * len(windows))
    return [e for out in outs for e in out.prompt_logprobs[1:]]


def entries_perplexity(entries: list[dict]) -> float:
    """exp(mean negative log-likelihood) of teacher-forced entries (:func:`engine_teacher_forced`)."""
    return math.exp(-sum(e["logprob"] for e in entries) / len(entries))


def top1_agreement(a: list[dict], b: list[dict]) -> float:
    """Share of positions whose most likely token is the same in two runs' entries."""
    return sum(x["top"][0][0] == y["top"][0][0] for x, y in zip(a, b)) / len(a)
