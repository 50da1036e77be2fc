"""``fivefold bench offline``: the engine in-process on a fixed workload, stored as a run.

Workloads (prompts cut from pydoc_data's held-out part, fixed seed):
  throughput     ``num_requests`` prompts of ``input_len`` tokens, ``output_len`` tokens
                 each (EOS ignored), all submitted at once;
  shared-prefix  ``num_requests`` prompts made of one ``prefix_len``-token prefix and
                 ``input_len`` tokens of their own, submitted one after another (each
                 finishes before the next arrives, as turns of chats sharing a system
                 prompt do);
  copy           ``num_requests`` held-out passages followed by the passage begun again
                 (fivefold.eval.text.copy_prompts: continuing means copying, the workload
                 of prompt-lookup speculation), one after another, ``output_len`` tokens each.

The configuration (workload and every engine option) is the whole recipe: a run
re-created from it (``fivefold runs rollback ID`` then ``fivefold bench --recipe``)
runs the same thing. Metrics: output and total tokens/s, TTFT and end-to-end
latency statistics, prompt tokens actually computed, and the greedy output tokens
(``samples``) so that two runs can be compared for accuracy, not only speed.
"""

from __future__ import annotations

import time
from dataclasses import asdict
from typing import Any

from fivefold.serve.metrics import latency_stats
from fivefold.errors import FivefoldError

WORKLOADS = ("throughput", "shared-prefix", "copy")


def bench_name(workload: str) -> str:
    return f"offline {workload}"


def make_config(model: str, dtype: str = "float32", workload: str = "throughput", num_requests: int = 16,
                input_len: int = 64, output_len: int = 32, prefix_len: int = 0, seed: int = 0,
                quantization: dict | None = None, eval_windows: int = 0, **engine_options) -> dict[str, Any]:
    """A complete, validated run configuration (every engine option spelled out).

    ``quantization``: an ``Int8Config.to_dict()`` applied before the run (calibrated on 16
    windows of the calibration text when the config needs data), or ``{"on_load": Q}`` with Q a
    load-time form (``w8a16``, ``w4a16``, ``gguf``: see :func:`fivefold.models.load_model`); ``eval_windows``: also
    measure held-out perplexity on that many 256-token windows.
    """
    from fivefold.engine.config import EngineConfig
    from fivefold.quant.config import Int8Config

    if workload not in WORKLOADS:
        raise FivefoldError(f"workload must be one of {', '.join(WORKLOADS)}, got '{workload}'")
    if min(num_requests, input_len, output_len) < 1 or prefix_len < 0:
        raise FivefoldError("num_requests, input_len and output_len must be >= 1, prefix_len >= 0")
    if quantization is not None and "on_load" in quantization:
        from fivefold.models.assemble import ServedForm

        ServedForm(quantization=quantization["on_load"])  # validated
        quantization = {"on_load": quantization["on_load"]}
    elif quantization is not None and quantization.get("scheme") in ("w4a16", "w4a8"):
        from fivefold.quant.int4 import Int4Config

        quantization = Int4Config.from_dict(quantization).to_dict()
    elif quantization is not None:
        quantization = Int8Config.from_dict(quantization).to_dict()  # validated, every field spelled out
    return {"model": model, "dtype": dtype, "workload": workload, "num_requests": num_requests,
            "input_len": input_len, "output_len": output_len, "prefix_len": prefix_len, "seed": seed,
            "quantization": quantization, "eval_windows": eval_windows,
            "engine": asdict(EngineConfig.from_options(**engine_options))}


def prepared_model(config: dict, loaded=None):
    """``loaded`` as ``config`` wants it: loaded if None, reloaded if it carries another
    quantization (int8 cannot be undone), quantized by the quantization recipe
    (:func:`fivefold.jobs.quantize.quantize_loaded`) if the config asks."""
    from fivefold.models import load_model

    from fivefold.engine.config import EngineConfig
    from fivefold.engine.memory_plan import planned_form
    from fivefold.models.loader import parse_dtype
    from fivefold.quant.config import Int8Config

    wanted = config.get("quantization")
    if loaded is None or (loaded.quantization is not None and loaded.quantization != wanted):
        on_load = wanted is not None and (wanted == Int8Config(scheme="w8a16").to_dict() or "on_load" in wanted)
        # plain W8A16 needs no data: quantized tensor by tensor while loading (the same int8 values)
        # loaded as the engine serves it (one copy of every weight), refused if it cannot fit
        engine = EngineConfig.from_options(**config["engine"])
        quantization = (wanted.get("on_load", "w8a16") if on_load else None)
        dtype = parse_dtype(config["dtype"])
        # (dense when a calibrated recipe quantizes it after loading: SmoothQuant rescales dense weights)
        layout = engine.weight_layout if wanted is None or on_load else "dense"
        engine = EngineConfig.from_options(**{**config["engine"], "weight_layout": layout})
        loaded = load_model(config["model"], dtype, planned_form(config["model"], dtype, engine, quantization),
                            quantization=quantization, weight_layout=layout)
        if on_load:
            loaded.quantization = wanted
    if wanted is not None and loaded.quantization is None:
        from fivefold.jobs.quantize import quantize_loaded
        from fivefold.quant.int4 import Int4Config

        config_cls = Int4Config if wanted.get("scheme") in ("w4a16", "w4a8") else Int8Config
        quantize_loaded(loaded, config_cls.from_dict(wanted), show_progress=False)
    return loaded


def _prompts(tokenizer, config: dict) -> list[list[int]]:
    from fivefold.eval.text import copy_prompts, corpus_ids, corpus_prompts

    if config["workload"] == "copy":
        return copy_prompts(tokenizer, config["num_requests"], seed=config["seed"])

    ids = corpus_ids(tokenizer, "heldout")
    own = corpus_prompts(ids, config["num_requests"], config["input_len"], seed=config["seed"])
    prefix = ids[: config["prefix_len"]]
    return [prefix + p for p in own]


def run_offline(config: dict, loaded=None, show_progress: bool = True) -> dict[str, Any]:
    """Run the workload of ``config``; return its metrics. ``loaded`` reuses a loaded model."""
    from fivefold.eval.language import decode_rate
    from fivefold.llm import LLM
    from fivefold.sampling_params import SamplingParams

    loaded = prepared_model(config, loaded)
    llm = LLM(loaded, **config["engine"])
    prompts = _prompts(llm.tokenizer, config)
    params = SamplingParams(temperature=0, max_tokens=config["output_len"], ignore_eos=True)
    start = time.perf_counter()
    if config["workload"] == "throughput":
        outputs = llm.generate(prompts, params, show_progress=show_progress)
    else:
        outputs = []
        for prompt in prompts:
            outputs += llm.generate([prompt], params)
    elapsed = time.perf_counter() - start
    stats = llm.engine.stats()
    quality = {}
    if config.get("eval_windows"):
        from fivefold.eval.language import language_metrics
        from fivefold.eval.text import text_windows

        windows = text_windows(llm.tokenizer, "heldout", config["eval_windows"], 256)
        # The model as the engine served it (its packed weights, its fused or eager hot path): W8A8's
        # per-tensor activation scales notice even the float rounding of fused against eager ops.
        ppl, acc = language_metrics(llm.engine.runner.model, windows)
        quality = {"heldout_perplexity": ppl, "heldout_next_token_accuracy": acc}
    num_out = sum(len(o.outputs[0].token_ids) for o in outputs)
    if config["workload"] == "throughput":
        decode_tok_s = decode_rate(outputs)
    else:  # one request at a time: each one's decode span, summed (the prefills between them excluded)
        decode_tok_s = (num_out - len(outputs)) / sum(o.metrics.finished_time - o.metrics.first_token_time
                                                      for o in outputs)
    num_prompt = sum(len(p) for p in prompts)
    ttfts = [o.metrics.ttft for o in outputs]
    e2es = [o.metrics.finished_time - o.metrics.arrival_time for o in outputs]
    return {
        "duration_s": elapsed,
        "output_tok_s": num_out / elapsed,
        "decode_tok_s": decode_tok_s,
        "total_tok_s": (num_out + num_prompt) / elapsed,
        "ttft_s": latency_stats(ttfts),
        "e2e_s": latency_stats(e2es),
        "num_prompt_tokens": num_prompt,
        "num_computed_prompt_tokens": num_prompt - sum(o.num_cached_tokens for o in outputs),
        "num_preemptions": stats["num_preemptions"],
        "speculative": {k: v for k, v in stats.items() if k.startswith("spec_")},
        **quality,
        "samples": {"e2e_s": e2es, "ttft_s": ttfts,
                    "output_token_ids": [o.outputs[0].token_ids for o in outputs]},
    }


def token_agreement(a: dict, b: dict) -> float:
    """Share of output tokens that two runs of the same workload agree on, position by position."""
    pairs = list(zip(a["samples"]["output_token_ids"], b["samples"]["output_token_ids"]))
    total = sum(max(len(x), len(y)) for x, y in pairs)
    same = sum(sum(1 for p, q in zip(x, y) if p == q) for x, y in pairs)
    return same / total if total else 1.0
