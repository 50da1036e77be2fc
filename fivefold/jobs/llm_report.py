"""The structure lever on an LLM: MLP neurons pruned, with and without a short KD heal.

Token-level KD: the original model is the teacher; the pruned one is trained for a few
steps on windows of the calibration text to match the teacher's next-token distribution
(temperature schedule 2 -> 1, soft term only), then evaluated on held-out text. Decode
speed is the engine's single-stream decode tokens/s (best of 2), in the same run.
"""

from __future__ import annotations

import copy
import time

import torch

from fivefold.compress.llm_prune import kd_heal_, prune_mlp_neurons_


def llm_rows(pairs, windows: list[list[int]]) -> list[dict]:
    """Parameters, held-out perplexity and single-stream decode tok/s (best of 2) of each
    (name, LoadedModel), with the change against the first."""
    from fivefold.eval.language import decode_speed, perplexity, served_model

    rows = [{"variant": name, "parameters": loaded.config.num_parameters(),
             "perplexity": perplexity(served_model(loaded), windows), "decode_tok_s": decode_speed(loaded, 1, 64)}
            for name, loaded in pairs]
    for r in rows:
        r["perplexity_change"] = r["perplexity"] / rows[0]["perplexity"] - 1
        r["speedup"] = r["decode_tok_s"] / rows[0]["decode_tok_s"]
    return rows


def print_llm_rows(console, title: str, rows: list[dict]) -> None:
    from fivefold.jobs.report import results_table

    console.print(results_table(title, ("variant", "params", "held-out ppl", "ppl change", "decode tok/s", "speed-up"),
                                [(r["variant"], f"{r['parameters'] / 1e6:.1f}M", f"{r['perplexity']:.3f}",
                                  f"{r['perplexity_change']:+.1%}", f"{r['decode_tok_s']:.1f}", f"{r['speedup']:.2f}x")
                                 for r in rows]))


def run_llm_report(model_name: str = "smollm2-135m-instruct", ratio: float = 0.25, heal_steps: int = 40,
                   num_eval: int = 8, window: int = 256, console=None) -> dict:
    from fivefold.models import load_model
    from fivefold.eval.text import text_windows

    log = console.print if console is not None else print
    original = load_model(model_name, "float32")
    heldout = text_windows(original.tokenizer, "heldout", num_eval, window)
    calibration = text_windows(original.tokenizer, "calibration", max(heal_steps, 1), window)
    pruned = prune_mlp_neurons_(copy.deepcopy(original), ratio, "activation", calibration[:8])
    healed = copy.deepcopy(pruned)
    if heal_steps:
        start = time.perf_counter()
        kd_heal_(healed, original, calibration, heal_steps, log=log)
        heal_s = time.perf_counter() - start
    pairs = [("original", original), (f"{ratio:.0%} MLP neurons pruned", pruned)]
    if heal_steps:
        pairs.append((f"{ratio:.0%} pruned + KD heal ({heal_steps} steps)", healed))
    rows = llm_rows(pairs, heldout)
    if console is not None:
        print_llm_rows(console, f"{model_name}: structured MLP pruning vs the original ({num_eval} held-out "
                                f"{window}-token windows)", rows)
    return {"model": model_name, "ratio": ratio, "heal_steps": heal_steps,
            "heal_seconds": heal_s if heal_steps else 0.0, "rows": rows}
