"""INT8 quantization report: SmolLM2-135M, all-MiniLM-L6-v2 and the digits CNN, float and
int8 measured in the same run.

SmolLM2: held-out pydoc_data perplexity (8 windows x 256 tokens) and next-token
accuracy; decode tok/s at batch 1 and 32 on the serving engine (float32 runs
oneDNN-packed weights, the fastest float path we have). Calibration: 16 windows of
the calibration part. Mixed precision: sensitivity scan on other held-out windows,
budget +0.5% perplexity decided on a third set.
MiniLM: mean (and min) cosine between int8 and float sentence embeddings (mean
pooling, normalised) on 256 held-out sentences; sentences/s at batch 32.
Digits CNN: test accuracy of float, PTQ (static W8A8, min-max, calibration split) and
QAT (3 epochs of fake-quant fine-tuning, then converted), with float fine-tuned for the
same 3 epochs as the control.

    .venv/bin/python benchmarks/quantization.py [--parts llm,minilm,digits] [--quick]
"""

from __future__ import annotations

import argparse
import copy
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from fivefold.bench.report import json_line  # noqa: E402
from fivefold.quant.config import Int8Config  # noqa: E402
from fivefold.quant.quantize import quantize_  # noqa: E402

SQ_DYNAMIC, SQ_STATIC = 0.7, 0.8  # SmoothQuant alpha per activation mode (best of 0.5/0.7/0.8/0.9 here)
LLM_CONFIGS = [
    ("W8A16 per-channel", Int8Config("w8a16"), False),
    ("W8A8 dynamic per-token", Int8Config("w8a8"), False),
    ("W8A8 dynamic per-token + SmoothQuant", Int8Config("w8a8", smoothquant_alpha=SQ_DYNAMIC), False),
    ("W8A8 dynamic per-tensor", Int8Config("w8a8", activation_granularity="per-tensor"), False),
    ("W8A8 dynamic per-tensor + SmoothQuant",
     Int8Config("w8a8", activation_granularity="per-tensor", smoothquant_alpha=SQ_DYNAMIC), False),
    ("W8A8 static minmax, per-tensor w", Int8Config("w8a8", "per-tensor", activation="static", calibration="minmax"), False),
    ("W8A8 static minmax, per-channel w", Int8Config("w8a8", activation="static", calibration="minmax"), False),
    ("W8A8 static entropy, per-tensor w", Int8Config("w8a8", "per-tensor", activation="static", calibration="entropy"), False),
    ("W8A8 static entropy, per-channel w", Int8Config("w8a8", activation="static", calibration="entropy"), False),
    ("W8A8 static minmax + SmoothQuant",
     Int8Config("w8a8", activation="static", calibration="minmax", smoothquant_alpha=SQ_STATIC), False),
    ("W8A8 static entropy + SmoothQuant",
     Int8Config("w8a8", activation="static", calibration="entropy", smoothquant_alpha=SQ_STATIC), False),
    ("mixed: W8A8 dyn. per-tensor + SQ, +0.5%",
     Int8Config("w8a8", activation_granularity="per-tensor", smoothquant_alpha=SQ_DYNAMIC), True),
    ("mixed: W8A8 static minmax + SQ, +0.5%",
     Int8Config("w8a8", activation="static", calibration="minmax", smoothquant_alpha=SQ_STATIC), True),
]


def llm_report(console, quick: bool) -> list[dict]:
    from rich.table import Table

    from fivefold.models import load_model
    from fivefold.models.registry import DEFAULT_LLM
    from fivefold.eval.text import text_windows
    from fivefold.jobs.quantize import QuantizeJob, build_quantized, evaluate

    base_job = QuantizeJob(DEFAULT_LLM, Int8Config(), "/tmp/fivefold-quant-scan", num_eval=4 if quick else 8)
    loaded = load_model(DEFAULT_LLM)
    windows = text_windows(loaded.tokenizer, "heldout", base_job.num_eval, base_job.window, seed=0)
    rows = [{"name": "float32", **evaluate(loaded, windows, base_job)}]
    del loaded
    configs = LLM_CONFIGS[:3] if quick else LLM_CONFIGS
    for name, config, mixed in configs:
        console.print(f"  {name} ...")
        job = QuantizeJob(DEFAULT_LLM, config, base_job.out, mixed_precision=mixed, max_ppl_increase=0.005,
                          num_eval=base_job.num_eval)
        start = time.perf_counter()
        loaded, modules, kept, _ = build_quantized(job)
        seconds = time.perf_counter() - start
        rows.append({"name": name, "num_float_layers": len(kept), "quantize_s": seconds,
                     **evaluate(loaded, windows, base_job)})
        del loaded
    f = rows[0]
    table = Table(title="SmolLM2-135M-Instruct: INT8 vs float32 (held-out pydoc_data)")
    for col in ("scheme", "float layers", "perplexity", "vs float", "next-token acc", "tok/s b1", "x", "tok/s b32", "x"):
        table.add_column(col, justify="left" if col == "scheme" else "right")
    for r in rows:
        r["perplexity_increase"] = r["perplexity"] / f["perplexity"] - 1
        r["speedup_b1"] = r["decode_tok_s_batch1"] / f["decode_tok_s_batch1"]
        r["speedup_b32"] = r["decode_tok_s_batch32"] / f["decode_tok_s_batch32"]
        table.add_row(r["name"], str(r.get("num_float_layers", "all")), f"{r['perplexity']:.3f}",
                      f"{r['perplexity_increase']:+.2%}", f"{r['next_token_accuracy']:.2f}%",
                      f"{r['decode_tok_s_batch1']:.1f}", f"{r['speedup_b1']:.2f}x", f"{r['decode_tok_s_batch32']:.1f}",
                      f"{r['speedup_b32']:.2f}x")
    console.print(table)
    return rows


def _sentences(num: int) -> list[str]:
    from fivefold.eval.text import pydoc_text

    words = pydoc_text("heldout").split()
    return [" ".join(words[i:i + 24]) for i in range(0, 24 * num, 24)]


def minilm_report(console, quick: bool) -> list[dict]:
    from rich.table import Table
    from transformers import AutoModel, PreTrainedTokenizerFast

    from fivefold.models.registry import resolve_model_path

    path = resolve_model_path("all-minilm-l6-v2")
    tok = PreTrainedTokenizerFast(tokenizer_file=str(path / "tokenizer.json"))
    sentences = _sentences(128 if quick else 256)
    batches = [tok(sentences[i:i + 32], padding=True, truncation=True, max_length=64, return_tensors="pt")
               for i in range(0, len(sentences), 32)]
    calib = [tok(s, padding=True, truncation=True, max_length=64, return_tensors="pt")
             for s in [_sentences(512)[-128:][i:i + 32] for i in range(0, 128, 32)]]

    def embed(model, batch):
        with torch.inference_mode():
            out = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).last_hidden_state
            mask = batch["attention_mask"].unsqueeze(-1).float()
            return torch.nn.functional.normalize((out * mask).sum(1) / mask.sum(1), dim=-1)

    def run(model):
        embed(model, batches[0])
        start = time.perf_counter()
        vectors = torch.cat([embed(model, b) for b in batches])
        return vectors, len(sentences) / (time.perf_counter() - start)

    base = AutoModel.from_pretrained(str(path)).eval()
    ref, ref_speed = run(base)
    rows = [{"name": "float32", "mean_cosine": 1.0, "min_cosine": 1.0, "sentences_s": ref_speed}]
    forward = lambda m, b: m(input_ids=b["input_ids"], attention_mask=b["attention_mask"])  # noqa: E731
    for name, config in (("W8A16 per-channel", Int8Config("w8a16")),
                         ("W8A8 dynamic per-token", Int8Config("w8a8")),
                         ("W8A8 dynamic per-tensor", Int8Config("w8a8", activation_granularity="per-tensor")),
                         ("W8A8 static minmax", Int8Config("w8a8", activation="static", calibration="minmax")),
                         ("W8A8 static percentile", Int8Config("w8a8", activation="static", calibration="percentile"))):
        model = copy.deepcopy(base)
        quantize_(model, config, calib if config.is_static else None, forward, show_progress=False)
        vectors, speed = run(model)
        cos = (vectors * ref).sum(-1)
        rows.append({"name": name, "mean_cosine": float(cos.mean()), "min_cosine": float(cos.min()),
                     "sentences_s": speed})
    table = Table(title=f"all-MiniLM-L6-v2: int8 vs float32 embeddings ({len(sentences)} held-out sentences)")
    for col in ("scheme", "mean cosine", "min cosine", "sentences/s (batch 32)", "x"):
        table.add_column(col, justify="left" if col == "scheme" else "right")
    for r in rows:
        r["speedup"] = r["sentences_s"] / ref_speed
        table.add_row(r["name"], f"{r['mean_cosine']:.5f}", f"{r['min_cosine']:.5f}", f"{r['sentences_s']:.1f}",
                      f"{r['speedup']:.2f}x")
    console.print(table)
    return rows


def digits_report(console) -> list[dict]:
    from rich.table import Table

    from fivefold.models.cnn import DigitsCNN

    from fivefold.eval.digits import accuracy, load_digits_split, train
    from fivefold.quant.qat import convert, prepare_qat

    data = load_digits_split()
    torch.manual_seed(0)  # the initial weights too: the table is reproducible
    model = train(DigitsCNN(), data.train, epochs=15)
    config = Int8Config("w8a8", activation="static", calibration="minmax")
    ptq = copy.deepcopy(model)
    quantize_(ptq, config, data.calibration[0].split(64), show_progress=False)
    control = train(copy.deepcopy(model), data.train, epochs=3, lr=1e-3)
    qat = prepare_qat(copy.deepcopy(model), config)
    train(qat, data.train, epochs=3, lr=1e-3)
    fake = accuracy(qat, data.test)
    convert(qat)
    rows = [{"name": "float32", "accuracy": accuracy(model, data.test)},
            {"name": "PTQ W8A8 static minmax", "accuracy": accuracy(ptq, data.test)},
            {"name": "float32 + 3 epochs (control)", "accuracy": accuracy(control, data.test)},
            {"name": "QAT 3 epochs, fake-quant", "accuracy": fake},
            {"name": "QAT 3 epochs, converted to int8", "accuracy": accuracy(qat, data.test)}]
    table = Table(title=f"digits CNN (sklearn load_digits, {len(data.test[1])} test images)")
    table.add_column("model")
    table.add_column("test accuracy", justify="right")
    for r in rows:
        table.add_row(r["name"], f"{r['accuracy']:.2f}%")
    console.print(table)
    return rows


def main() -> None:
    from rich.console import Console

    ap = argparse.ArgumentParser()
    ap.add_argument("--parts", default="llm,minilm,digits")
    ap.add_argument("--quick", action="store_true", help="fewer configurations and windows")
    args = ap.parse_args()
    console = Console(width=140)
    out = {"benchmark": "quantization"}
    parts = args.parts.split(",")
    if "digits" in parts:
        out["digits"] = digits_report(console)
    if "minilm" in parts:
        out["minilm"] = minilm_report(console, args.quick)
    if "llm" in parts:
        out["llm"] = llm_report(console, args.quick)
    print(json_line(out))


if __name__ == "__main__":
    main()
