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

from fivefold.compress.distill import kd_loss, temperature_at
from fivefold.compress.llm_prune import make_trainable_, prune_mlp_neurons_
from fivefold.eval.language import prefill_logits


def kd_heal_(student_loaded, teacher_loaded, windows: list[list[int]], steps: int, lr: float = 3e-5,
             t_start: float = 2.0, t_end: float = 1.0, alpha: float = 1.0, log=None) -> None:
    """``steps`` of token-level KD of the student towards the teacher on ``windows`` (in place).
    ``alpha`` < 1 mixes in the next-token cross-entropy on the text itself."""
    student = make_trainable_(student_loaded.model)
    opt = torch.optim.AdamW(student.parameters(), lr=lr, weight_decay=0.0)
    for step in range(steps):
        ids = torch.tensor(windows[step % len(windows)])
        with torch.inference_mode():
            teacher_logits = prefill_logits(teacher_loaded.model, ids).clone()
        t = temperature_at(step, steps, t_start, t_end, "cosine")
        labels = ids[1:] if alpha < 1 else None
        student_logits = prefill_logits(student, ids)
        if labels is not None:
            student_logits, teacher_logits = student_logits[:-1], teacher_logits[:-1]
        loss = kd_loss(student_logits, teacher_logits, labels, t, alpha)
        opt.zero_grad()
        loss.backward()
        opt.step()
        if log is not None and (step % 10 == 0 or step == steps - 1):
            log(f"  KD heal step {step + 1}/{steps}: T {t:.2f}, loss {loss.item():.4f}")
    for p in student.parameters():
        p.requires_grad_(False)
    student.set_fused_ops(True)


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
    from fivefold.bench.report import results_table

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
