"""4-bit weight quality: RTN, GPTQ and AWQ at 4.25-5 bits per weight against float32, beside
llama.cpp's own Q4_0 of the same float32 weights, on held-out text never used for calibration.

SmolLM2-135M (the built-in; its float32 weights are its Q4_1 file dequantized, so re-quantizing them
in groups of 32 can be nearly free: groups of 64 and 128 are the honest test). Held-out pydoc_data
perplexity (``--num-eval`` windows of ``--window`` tokens, the held-out part) and next-token
accuracy; calibration for GPTQ and AWQ: ``--num-calibration`` windows of the calibration part.
Bits per weight count the decoder's projections with their float16 scales (and minimums); the LM
head stays 8-bit (W8A16 per channel) and is not counted, as GPTQ's and AWQ's papers count.

llama.cpp: the float32 model is exported as an F32 GGUF (fivefold.models.gguf_export), quantized to
Q4_0 with llama-cpp-python's ``llama_model_quantize`` (its default mix: Q4_0 projections, the tied
embedding/head at Q6_K), and its perplexity computed from llama.cpp's own logits on the same
windows, in the peer's virtual environment (``~/peers/llamacpp``, ../shared/PEERS.md; skipped with
a reason when it is not installed). Fivefold then serves that same Q4_0 file as it is
(``--quantization gguf``) for a cross-check of the two implementations on one file.

all-MiniLM-L6-v2 (float): every linear quantized to 4 bits (RTN and GPTQ; AWQ's folds are for
decoders), mean/min cosine of sentence embeddings to float32 and top-1 retrieval agreement (the
nearest of the other held-out sentences to each one, float32's choice vs the quantized model's).

    .venv/bin/python benchmarks/int4_quality.py [--groups 64,128] [--methods rtn,gptq,awq] [--tune-steps 64] [--quick]

``--tune-steps N`` (default 64) adds GPTQ rows whose group scales were then trained end to end
against the float logits (fivefold.quant.int4_tune; about 2 s per step on two cores).

Prints tables and one JSON line.
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from fivefold.bench.report import json_line  # noqa: E402
from fivefold.eval.language import language_metrics  # noqa: E402
from fivefold.eval.text import text_windows  # noqa: E402
from fivefold.models import load_model  # noqa: E402
from fivefold.models.forward import llm_forward  # noqa: E402
from fivefold.models.registry import DEFAULT_LLM  # noqa: E402
from fivefold.platform import current_platform  # noqa: E402
from fivefold.quant.int4 import Int4Config, bits_per_weight, quantize_int4_  # noqa: E402

LLAMACPP_PYTHON = Path.home() / "peers/llamacpp/bin/python"

LLAMACPP_PPL = r'''
import ctypes, json, math, os, sys
import numpy as np
import llama_cpp
spec = json.load(open(sys.argv[1]))
params = llama_cpp.llama_model_quantize_default_params()
params.ftype = llama_cpp.LLAMA_FTYPE_MOSTLY_Q4_0
params.nthread = spec["threads"]
rc = llama_cpp.llama_model_quantize(spec["f32"].encode(), spec["q4_0"].encode(), ctypes.byref(params))
if rc != 0:
    raise SystemExit(f"llama_model_quantize failed: {rc}")
llm = llama_cpp.Llama(model_path=spec["q4_0"], n_ctx=spec["window"], logits_all=True, n_threads=spec["threads"],
                      n_batch=spec["window"], verbose=False)
total, hits, count = 0.0, 0, 0
for ids in spec["windows"]:
    llm.reset()
    llm.eval(ids)
    logits = np.array(llm.scores[:len(ids) - 1], dtype=np.float64)
    logits -= logits.max(axis=1, keepdims=True)
    logp = logits - np.log(np.exp(logits).sum(axis=1, keepdims=True))
    target = np.array(ids[1:])
    total -= float(logp[np.arange(len(target)), target].sum())
    hits += int((logp.argmax(axis=1) == target).sum())
    count += len(target)
print("RESULT " + json.dumps({"perplexity": math.exp(total / count), "next_token_accuracy": 100 * hits / count,
                              "file_bytes": os.path.getsize(spec["q4_0"])}), flush=True)
'''


def llamacpp_q4_0(loaded_float, windows, window: int, workdir: Path) -> dict:
    """llama.cpp's Q4_0 of the float32 weights: its perplexity from its own logits, and the file."""
    import subprocess

    from fivefold.models.gguf_export import export_gguf

    if not LLAMACPP_PYTHON.exists():
        raise FileNotFoundError(f"llama-cpp-python is not installed ({LLAMACPP_PYTHON} missing; ../shared/PEERS.md)")
    f32 = export_gguf(loaded_float, workdir / "f32.gguf", "F32")
    spec = {"f32": str(f32), "q4_0": str(workdir / "q4_0.gguf"), "windows": windows, "window": window,
            "threads": torch.get_num_threads()}
    (workdir / "spec.json").write_text(json.dumps(spec))
    (workdir / "run.py").write_text(LLAMACPP_PPL)
    proc = subprocess.run([str(LLAMACPP_PYTHON), str(workdir / "run.py"), str(workdir / "spec.json")],
                          capture_output=True, text=True, timeout=1200)
    for line in proc.stdout.splitlines():
        if line.startswith("RESULT "):
            return {**json.loads(line[len("RESULT "):]), "path": spec["q4_0"]}
    raise RuntimeError(f"exit code {proc.returncode}: {' | '.join((proc.stderr or proc.stdout).strip().splitlines()[-3:])}")


def set_int4_activations(model, activations: str) -> None:
    from fivefold.models.int4_linear import Int4Linear

    for m in model.modules():
        if isinstance(m, Int4Linear):
            m.set_activations_(activations)


def llm_rows(args, console) -> list[dict]:
    from rich.progress import Progress

    loaded = load_model(DEFAULT_LLM)
    tok = loaded.tokenizer
    windows = text_windows(tok, "heldout", args.num_eval, args.window, seed=0)
    calibration = text_windows(tok, "calibration", args.num_calibration, args.window)
    ppl, acc = language_metrics(loaded.model, windows)
    rows = [{"name": "float32", "method": "-", "group": "-", "bits": 32.0, "perplexity": ppl, "accuracy": acc,
             "quantize_s": 0.0}]
    configs = [Int4Config(method=m, group_size=g) for g in args.groups for m in args.methods]
    configs.append(Int4Config(method="rtn", group_size=32, symmetric=True))  # llama.cpp Q4_0's form, our RTN
    # then the same GPTQ codes with their scales trained against the float logits (int4_tune)
    configs += [Int4Config(method="gptq", group_size=g, tune_steps=args.tune_steps) for g in args.groups if args.tune_steps]
    with Progress(console=console, transient=True) as bar:
        task = bar.add_task("4-bit methods", total=len(configs))
        for config in configs:
            model = load_model(DEFAULT_LLM).model  # a fresh float32 copy
            start = time.perf_counter()
            quantize_int4_(model, config, calibration if config.uses_calibration else None, llm_forward,
                           show_progress=False)
            seconds = time.perf_counter() - start
            for activations in args.activations:  # the same 4-bit weights times float or int8 activations
                set_int4_activations(model, activations)
                ppl, acc = language_metrics(model, windows)
                label = config.label.replace("W4A16", "W4A8") if activations == "int8" else config.label
                rows.append({"name": label, "method": config.method, "group": config.group_size,
                             "tune_steps": config.tune_steps,
                             "symmetric": config.symmetric, "activations": activations,
                             "bits": bits_per_weight(model), "perplexity": ppl, "accuracy": acc, "quantize_s": seconds})
            del model
            bar.advance(task)
    with tempfile.TemporaryDirectory() as tmp:
        try:
            peer = llamacpp_q4_0(loaded, windows, args.window, Path(tmp))
            rows.append({"name": "llama.cpp Q4_0 (its logits)", "method": "llama.cpp", "group": 32, "symmetric": True,
                         "bits": 4.5, "perplexity": peer["perplexity"], "accuracy": peer["next_token_accuracy"],
                         "quantize_s": None})
            served = load_model(peer["path"], quantization="gguf")  # the same file, served by fivefold as it is
            for activations in args.activations:
                set_int4_activations(served.model, activations)
                ppl, acc = language_metrics(served.model, windows)
                rows.append({"name": f"llama.cpp's Q4_0 file, fivefold ({activations} activations)",
                             "method": "llama.cpp", "group": 32, "symmetric": True, "activations": activations,
                             "bits": 4.5, "perplexity": ppl, "accuracy": acc, "quantize_s": None})
        except Exception as exc:  # a missing peer is reported, not fatal
            console.print(f"llama.cpp Q4_0 skipped: {type(exc).__name__}: {exc}")
            rows.append({"name": "llama.cpp Q4_0", "skipped": f"{type(exc).__name__}: {exc}"})
    base = rows[0]["perplexity"]
    for r in rows:
        if "perplexity" in r:
            r["ppl_increase"] = r["perplexity"] / base - 1
    return rows


def _sentences(num: int) -> list[str]:
    from fivefold.eval.text import pydoc_text

    words = pydoc_text("heldout").split()
    return [" ".join(words[i:i + 24]) for i in range(0, 24 * num, 24)]


def minilm_rows(args) -> list[dict]:
    from transformers import AutoModel, PreTrainedTokenizerFast

    from fivefold.eval.text import pydoc_text
    from fivefold.models.registry import resolve_model_path

    path = resolve_model_path("all-minilm-l6-v2")
    tok = PreTrainedTokenizerFast(tokenizer_file=str(path / "tokenizer.json"))
    sentences = _sentences(64 if args.quick else 256)
    batches = [tok(sentences[i:i + 32], padding=True, truncation=True, max_length=64, return_tensors="pt")
               for i in range(0, len(sentences), 32)]
    words = pydoc_text("calibration").split()
    calib_text = [" ".join(words[i:i + 24]) for i in range(0, 24 * 128, 24)]
    calib = [tok(calib_text[i:i + 32], padding=True, truncation=True, max_length=64, return_tensors="pt")
             for i in range(0, 128, 32)]

    def embed(model):
        with torch.inference_mode():
            out = []
            for b in batches:
                hidden = model(input_ids=b["input_ids"], attention_mask=b["attention_mask"]).last_hidden_state
                mask = b["attention_mask"].unsqueeze(-1).float()
                out.append(torch.nn.functional.normalize((hidden * mask).sum(1) / mask.sum(1), dim=-1))
            return torch.cat(out)

    def top1(vectors):
        sim = vectors @ vectors.t()
        sim.fill_diagonal_(-2.0)
        return sim.argmax(dim=1)

    base = AutoModel.from_pretrained(str(path)).eval()
    ref = embed(base)
    ref_top = top1(ref)
    rows = [{"name": "float32", "mean_cosine": 1.0, "min_cosine": 1.0, "top1_agreement": 1.0, "bits": 32.0}]
    forward = lambda m, b: m(input_ids=b["input_ids"], attention_mask=b["attention_mask"])  # noqa: E731
    for g in args.groups:
        for method in [m for m in args.methods if m != "awq"]:
            config = Int4Config(method=method, group_size=g, head_bits=16)
            model = copy.deepcopy(base)
            quantize_int4_(model, config, calib if config.uses_calibration else None, forward, show_progress=False)
            vectors = embed(model)
            cos = (vectors * ref).sum(-1)
            rows.append({"name": config.label, "mean_cosine": float(cos.mean()), "min_cosine": float(cos.min()),
                         "top1_agreement": float((top1(vectors) == ref_top).float().mean()),
                         "bits": bits_per_weight(model)})
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--groups", default="64,128")
    ap.add_argument("--methods", default="rtn,gptq,awq")
    ap.add_argument("--num-eval", type=int, default=16)
    ap.add_argument("--num-calibration", type=int, default=32)
    ap.add_argument("--window", type=int, default=256)
    ap.add_argument("--parts", default="llm,minilm")
    ap.add_argument("--tune-steps", type=int, default=64,
                    help="also GPTQ with its group scales tuned end to end for this many windows (0: no such rows)")
    ap.add_argument("--activations", default="float,int8",
                    help="each 4-bit model measured with float activations (W4A16) and/or int8 ones (W4A8)")
    ap.add_argument("--quick", action="store_true", help="4 held-out windows, 8 calibration windows, 64 sentences")
    args = ap.parse_args()
    args.groups = [int(g) for g in args.groups.split(",")]
    args.methods = [m for m in args.methods.split(",") if m]
    args.activations = [a for a in args.activations.split(",") if a]
    if args.quick:
        args.num_eval, args.num_calibration, args.tune_steps = 4, 8, min(args.tune_steps, 8)

    from rich.console import Console
    from rich.table import Table

    console = Console(width=150)
    plat = current_platform()
    out: dict = {"benchmark": "int4_quality", "platform": plat.describe(), "num_eval": args.num_eval,
                 "window": args.window, "num_calibration": args.num_calibration}
    if "llm" in args.parts.split(","):
        rows = llm_rows(args, console)
        table = Table(title=f"SmolLM2-135M, 4-bit weights: held-out perplexity ({args.num_eval} x {args.window} tokens; "
                            f"GPTQ/AWQ calibrated on {args.num_calibration} other windows); {plat.isa_level}")
        for col in ("weights", "bits/weight", "perplexity", "vs float32", "next-token acc %", "quantize s"):
            table.add_column(col, justify="left" if col == "weights" else "right")
        for r in rows:
            if "skipped" in r:
                table.add_row(r["name"], "", "skipped", "", "", "")
                continue
            table.add_row(r["name"], f"{r['bits']:.2f}", f"{r['perplexity']:.3f}", f"{r['ppl_increase']:+.2%}",
                          f"{r['accuracy']:.2f}", "" if r.get("quantize_s") is None else f"{r['quantize_s']:.1f}")
        console.print(table)
        out["smollm2"] = rows
    if "minilm" in args.parts.split(","):
        rows = minilm_rows(args)
        table = Table(title="all-MiniLM-L6-v2, 4-bit weights vs float32 embeddings (held-out sentences)")
        for col in ("weights", "bits/weight", "mean cosine", "min cosine", "top-1 retrieval agreement"):
            table.add_column(col, justify="left" if col == "weights" else "right")
        for r in rows:
            table.add_row(r["name"], f"{r['bits']:.2f}", f"{r['mean_cosine']:.4f}", f"{r['min_cosine']:.4f}",
                          f"{r['top1_agreement']:.1%}")
        console.print(table)
        out["minilm"] = rows
    print(json_line(out))


if __name__ == "__main__":
    main()
