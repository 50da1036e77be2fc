"""Fivefold against its peers on one machine, in one run, on the same prompts.

SmolLM2-135M (the built-in default), prompts of 128 tokens cut from pydoc_data's text, EOS
ignored, greedy. Three workloads:

  single    1 prompt, 64 new tokens: decode tokens/s (first to last new token, prefill excluded;
            transformers: (t(64 tokens) - t(1 token)) / 63)
  batch16   16 prompts, 64 new tokens each: new tokens / wall time of the whole batch
  batch64   64 prompts, 128 new tokens each: the same

Systems: fivefold in float32, bfloat16 (where this CPU computes bf16 natively), W8A16, W8A8
(dynamic per-token), W4A16 (quantized on load: round to nearest, groups of 128 with a minimum, the
LM head W8A16) and the built-in Q4_1 file served as it is (``--quantization gguf``: its 4-bit
blocks on the int4 kernel, the tied LM head too), all on the serving engine with its defaults, and float32 with the int8 KV
cache (fivefold-float32-kv8, shown beside the defaults, not one of them); every fivefold system and
vLLM get the same KV cache space (KV_CACHE_GIB); transformers (float32, in
this process; batches padded on the left); vLLM (CPU build, float32) and llama.cpp (the built-in
Q4_1 GGUF, single stream) when installed in their own virtual environments (``../shared/PEERS.md``,
``~/peers/vllm`` and ``~/peers/llamacpp``, or ``--vllm-python`` / ``--llamacpp-python``), each run
in its own process (vLLM from a script written to a temporary directory, llama.cpp through
benchmarks/llamacpp_decode.py). A peer that is not installed is skipped, and the table says so.
llama.cpp gives two rows: ``llamacpp-q4_1``, its C API in a decode loop (llama-cli's and
llama-server's per-token work: the rate the fivefold rows are compared with, ``single_vs_llamacpp``
in the JSON), and ``llamacpp-q4_1-generate``, llama-cpp-python's ``Llama.generate``, whose
Python sampler adds milliseconds a token.

Roofs, measured in the run (fivefold.profile.roofline.measure_peaks, refreshed, at the start; the
bandwidth and each GEMM rate are the medians of that and one more measurement before each system):
the single stream's is the memory bandwidth over the weight bytes one token streams (each
system's own: 4 bytes per parameter in float32, 2 in bf16, 1 for int8 linears, the GGUF's
tensor bytes for llama.cpp); batch 64's is the GEMM peak of the system's arithmetic
(float32, bf16; int8 for W8A8) over the GEMM work the workload needs (gemm_flops_per_sequence:
2 FLOPs per weight for every token through the layers, the 128 prompt tokens of each sequence as
well as its new ones, and the LM head for sampled positions only; the batch's prefill is about
half its FLOPs; the JSON also gives the share counting the decode steps' work only).

    .venv/bin/python benchmarks/peers.py [--systems fivefold-float32,vllm-float32,...] [--quick]

Prints the table and one JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from decode import hf_decode_tok_s, ours_decode_tok_s  # noqa: E402

from fivefold.bench.report import json_line  # noqa: E402
from fivefold.eval.text import corpus_ids, corpus_prompts  # noqa: E402
from fivefold.models import load_model, resolve_model_path  # noqa: E402
from fivefold.models.registry import DEFAULT_LLM  # noqa: E402
from fivefold.platform import current_platform  # noqa: E402
from fivefold.profile.roofline import MachinePeaks, measure_bandwidth, measure_flops, measure_peaks  # noqa: E402

PROMPT_LEN = 128
# Every system gets the same KV cache space: vLLM's VLLM_CPU_KVCACHE_SPACE (GiB) and fivefold's pool.
# (Fivefold ran with 512 MiB here before: 11,650 float32 tokens, less than batch64's 64 x 256, so its
# scheduler preempted and recomputed sequences that vLLM's 4 GiB held: 243 tok/s against 301 with room.)
KV_CACHE_GIB = 4
WORKLOADS = {"single": (1, 64), "batch16": (16, 64), "batch64": (64, 128)}
FIVEFOLD = ("fivefold-float32", "fivefold-float32-kv8", "fivefold-bfloat16", "fivefold-w8a16", "fivefold-w8a8",
            "fivefold-w4a16", "fivefold-w4a8", "fivefold-q4_1")
# A system name's "-kv8" suffix: the same weights with kv_cache_dtype="int8" (a quality trade: not the
# float32 defaults that the ratios compare, shown beside them).
KV8_SUFFIX = "-kv8"
PEERS = ("transformers-float32", "vllm-float32", "llamacpp-q4_1")


def gemm_flops_per_sequence(config, prompt_len: int, num_new: int) -> int:
    """The GEMM work one sequence of the batch workload needs, however it is batched.

    Every token that enters the model goes through the layers (the prompt, then each new token
    but the last, which is sampled and never fed back); only a sampled position goes through the
    LM head (the prompt's last position and each decode step's), as every engine here runs it;
    the embedding is a lookup. 2 FLOPs per weight per token; attention's own FLOPs (under 3% at
    these lengths) are left out.
    """
    num_lm_head = config.vocab_size * config.hidden_size
    num_body = config.num_parameters() - num_lm_head * (1 if config.is_tied_embeddings else 2)
    return 2 * num_body * (prompt_len + num_new - 1) + 2 * num_lm_head * num_new


def prompts_for(tokenizer, num: int) -> list[list[int]]:
    return corpus_prompts(corpus_ids(tokenizer), num, PROMPT_LEN, seed=num)


# --- fivefold -------------------------------------------------------------------------------------

def load_fivefold(system: str):
    """The loaded model of a fivefold system; its weight bytes per token; its arithmetic's dtype."""
    from fivefold.quant.config import Int8Config
    from fivefold.models.forward import llm_forward
    from fivefold.quant.quantize import quantize_

    variant = system.removeprefix("fivefold-").removesuffix(KV8_SUFFIX)
    if variant in ("w4a16", "w4a8", "q4_1"):
        # 4-bit: quantized on load (RTN, g128) times float or int8 activations, or the GGUF's Q4_1
        # blocks as they are (times int8 activations, as llama.cpp)
        from fivefold.models.layers import resident_weight_bytes

        loaded = load_model(DEFAULT_LLM, quantization="gguf" if variant == "q4_1" else variant)
        arithmetic = "float32" if variant == "w4a16" else "int8"
        # a token's weights: all but the embedding table (none of its own when served from the head's blocks)
        return loaded, resident_weight_bytes(loaded.model) - resident_weight_bytes(loaded.model.embed_tokens), arithmetic
    if variant in ("float32", "bfloat16"):
        loaded = load_model(DEFAULT_LLM, variant)
        return loaded, loaded.config.num_parameters() * loaded.model.dtype.itemsize, variant
    loaded = load_model(DEFAULT_LLM)
    quantize_(loaded.model, Int8Config(scheme=variant), None, llm_forward)
    nbytes = sum(b.numel() * b.element_size() for name, b in loaded.model.named_buffers() if name.endswith(".weight"))
    return loaded, nbytes, "int8" if variant == "w8a8" else "float32"


def run_fivefold(system: str, workloads: list[str]) -> tuple[dict, int, str]:
    from fivefold.llm import LLM
    from fivefold.sampling_params import SamplingParams

    loaded, nbytes, arithmetic = load_fivefold(system)
    results = {}
    for name in workloads:
        num, new = WORKLOADS[name]
        llm = LLM(loaded, max_num_seqs=max(num, 1), kv_cache_memory_bytes=float(KV_CACHE_GIB << 30),
                  kv_cache_dtype="int8" if system.endswith(KV8_SUFFIX) else "auto")
        prompts = prompts_for(llm.tokenizer, num)
        params = SamplingParams(temperature=0.0, max_tokens=new, ignore_eos=True)
        if name == "single":
            ours_decode_tok_s(llm, prompts[0], 8)  # warm-up
            results[name] = max(ours_decode_tok_s(llm, prompts[0], new) for _ in range(2))
        else:
            llm.generate(prompts[:2], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))
            start = time.perf_counter()
            outs = llm.generate(prompts, params)
            seconds = time.perf_counter() - start
            results[name] = sum(len(c.token_ids) for o in outs for c in o.outputs) / seconds
        del llm
    return results, nbytes, arithmetic


# --- transformers ---------------------------------------------------------------------------------

def run_transformers(workloads: list[str]) -> dict:
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging

    from fivefold.models.loader import load_tokenizer

    logging.set_verbosity_error()
    path = resolve_model_path(DEFAULT_LLM)
    model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32).eval()
    tokenizer, _ = load_tokenizer(DEFAULT_LLM)
    results = {}
    for name in workloads:
        num, new = WORKLOADS[name]
        if name == "batch64":
            continue  # padded generate of 64 x 128 tokens takes minutes and says nothing batch16 does not
        prompts = prompts_for(tokenizer, num)
        if name == "single":
            hf_decode_tok_s(model, prompts[0], 4)
            results[name] = hf_decode_tok_s(model, prompts[0], new)
            continue
        ids = torch.tensor(prompts)  # every prompt has PROMPT_LEN tokens: no padding needed
        start = time.perf_counter()
        with torch.inference_mode():
            out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new, min_new_tokens=new,
                                 do_sample=False, pad_token_id=2)
        results[name] = (out.shape[1] - PROMPT_LEN) * num / (time.perf_counter() - start)
    return results


# --- peers in their own virtual environments ------------------------------------------------------

VLLM_SCRIPT = r'''
import json, sys, time
def main():
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt
    spec = json.load(open(sys.argv[1]))
    llm = LLM(model=spec["model"], dtype="float32", max_model_len=1024, max_num_seqs=64, seed=0)
    results = {}
    for name, (prompts, new) in spec["workloads"].items():
        params = SamplingParams(temperature=0.0, max_tokens=new, min_tokens=new, ignore_eos=True)
        inputs = [TokensPrompt(prompt_token_ids=p) for p in prompts]
        llm.generate(inputs[:1], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True), use_tqdm=False)
        if name == "single":
            # decode only: time(new tokens) - time(1 token), as for transformers
            t0 = time.perf_counter(); llm.generate(inputs, SamplingParams(temperature=0.0, max_tokens=1), use_tqdm=False)
            t1 = time.perf_counter(); llm.generate(inputs, params, use_tqdm=False); t2 = time.perf_counter()
            results[name] = (new - 1) / ((t2 - t1) - (t1 - t0))
        else:
            start = time.perf_counter(); outs = llm.generate(inputs, params, use_tqdm=False)
            results[name] = sum(len(o.outputs[0].token_ids) for o in outs) / (time.perf_counter() - start)
    print("RESULT " + json.dumps(results), flush=True)
if __name__ == "__main__":
    main()
'''

def run_llamacpp(python: Path, gguf: Path, prompt: list[int], new: int) -> dict:
    """llama.cpp's single-stream rates on ``gguf`` (benchmarks/llamacpp_decode.py in the peer's venv):
    {"single": its C API decode loop, "single_generate": llama-cpp-python's Llama.generate}."""
    script = Path(__file__).resolve().parent / "llamacpp_decode.py"
    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / "prompt.json").write_text(json.dumps(prompt))
        proc = subprocess.run([str(python), str(script), str(gguf), "--prompt", str(Path(tmp) / "prompt.json"),
                               "--new", str(new), "--threads", str(torch.get_num_threads())],
                              capture_output=True, text=True, timeout=600)
    if proc.returncode != 0:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
        raise RuntimeError(f"exit code {proc.returncode}: {' | '.join(tail)}")
    found = json.loads(proc.stdout.strip().splitlines()[-1])
    return {"single": found["decode_tok_s"], "single_generate": found["generate_tok_s"]}


def run_in_venv(python: Path, script: str, spec: dict, timeout: int) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / "run.py").write_text(script)
        (Path(tmp) / "spec.json").write_text(json.dumps(spec))
        env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": str(KV_CACHE_GIB), "TOKENIZERS_PARALLELISM": "false"}
        proc = subprocess.run([str(python), str(Path(tmp) / "run.py"), str(Path(tmp) / "spec.json")], cwd=tmp,
                              env=env, capture_output=True, text=True, timeout=timeout)
    for line in proc.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT "):])
    tail = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
    raise RuntimeError(f"exit code {proc.returncode}: {' | '.join(tail)}")


def gguf_tensor_bytes(path: Path) -> int:
    from fivefold.models.gguf_file import open_gguf

    return sum(int(t.n_bytes) for t in open_gguf(path).tensors)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--systems", default=",".join(FIVEFOLD + PEERS))
    ap.add_argument("--workloads", default=",".join(WORKLOADS))
    ap.add_argument("--vllm-python", default=str(Path.home() / "peers/vllm/bin/python"))
    ap.add_argument("--llamacpp-python", default=str(Path.home() / "peers/llamacpp/bin/python"))
    ap.add_argument("--quick", action="store_true", help="batch64 with 32 new tokens instead of 128")
    args = ap.parse_args()

    from rich.console import Console
    from rich.table import Table

    console = Console(width=160)
    if args.quick:
        WORKLOADS["batch64"] = (64, 32)
    plat = current_platform()
    systems = [s for s in args.systems.split(",") if s]
    workloads = [w for w in args.workloads.split(",") if w]
    skipped = {}
    if "fivefold-bfloat16" in systems and not plat.has_bf16_compute:
        systems.remove("fivefold-bfloat16")
        skipped["fivefold-bfloat16"] = "this CPU has no native bf16 arithmetic (it would be emulated)"
        console.print(f"fivefold-bfloat16 skipped: {skipped['fivefold-bfloat16']}")
    # bf16's GEMM peak only where bf16 runs: emulated, it measures ~0.3 GFLOP/s and takes minutes.
    peaks = measure_peaks(refresh=True, dtypes=("float32", "int8") + (("bfloat16",) if plat.has_bf16_compute else ()))
    loaded = load_model(DEFAULT_LLM)
    num_params = loaded.config.num_parameters()
    new = WORKLOADS["batch64"][1]
    flops_per_new_token = gemm_flops_per_sequence(loaded.config, PROMPT_LEN, new) / new
    flops_per_decode_token = gemm_flops_per_sequence(loaded.config, 1, 1)  # one token in, one sampled
    tokenizer = loaded.tokenizer
    del loaded
    rows, measured = [], []
    bandwidth_samples = [peaks.bandwidth]
    flops_samples = {dtype: [flops] for dtype, flops in peaks.flops.items()}
    for system in systems:
        console.print(f"[bold]{system}[/bold] ...")
        extra = []  # rows a system's run adds after its own
        bandwidth_samples.append(measure_bandwidth())
        for dtype, samples in flops_samples.items():
            samples.append(measure_flops(getattr(torch, dtype)))
        try:
            if system.startswith("fivefold-"):
                tok_s, nbytes, arithmetic = run_fivefold(system, workloads)
            elif system == "transformers-float32":
                tok_s, nbytes, arithmetic = run_transformers(workloads), num_params * 4, "float32"
            elif system == "vllm-float32":
                python = Path(args.vllm_python)
                if not python.exists():
                    raise FileNotFoundError(f"not installed ({python} missing; see ../shared/PEERS.md)")
                from fivefold.models.loader import export_hf_directory

                with tempfile.TemporaryDirectory() as model_dir:
                    export_hf_directory(load_model(DEFAULT_LLM), model_dir)
                    spec = {"model": model_dir, "workloads": {w: (prompts_for(tokenizer, WORKLOADS[w][0]),
                                                                  WORKLOADS[w][1]) for w in workloads}}
                    tok_s = run_in_venv(python, VLLM_SCRIPT, spec, timeout=1800)
                nbytes, arithmetic = num_params * 4, "float32"
            elif system == "llamacpp-q4_1":
                python = Path(args.llamacpp_python)
                if not python.exists():
                    raise FileNotFoundError(f"not installed ({python} missing; see ../shared/PEERS.md)")
                if "single" not in workloads:
                    raise ValueError("runs the single-stream workload only")
                gguf = resolve_model_path(DEFAULT_LLM)
                rates = run_llamacpp(python, gguf, prompts_for(tokenizer, 1)[0], WORKLOADS["single"][1])
                nbytes, arithmetic = gguf_tensor_bytes(gguf), "int8"
                # Two rows: the C API loop (llama.cpp's own rate, the one compared) and its Python
                # binding's generate (a Python sampler per token), so the gap between them is visible.
                extra.append((system + "-generate", {"single": rates["single_generate"]}, nbytes, arithmetic))
                tok_s = {"single": rates["single"]}
            else:
                raise ValueError(f"unknown system (choose from {', '.join(FIVEFOLD + PEERS)})")
        except Exception as exc:  # a peer that is missing or fails is reported, not fatal
            skipped[system] = f"{type(exc).__name__}: {exc}"
            console.print(f"  skipped: {skipped[system]}")
            continue
        measured.append((system, tok_s, nbytes, arithmetic))
        measured.extend(extra)
    # This VM's copy bandwidth swings (23-50 GB/s from one minute to the next) and so does its GEMM
    # rate (98-200 GFLOP/s float32 seen): each roof uses the median of a measurement before each
    # system, and the JSON keeps every sample.
    bandwidth = statistics.median(bandwidth_samples)
    peaks = MachinePeaks(bandwidth, {dtype: statistics.median(samples) for dtype, samples in flops_samples.items()})
    for system, tok_s, nbytes, arithmetic in measured:
        bandwidth_roof = bandwidth / nbytes
        # new tokens/s at the GEMM peak, with the prompts' work (compute_roof) and without it
        compute_roof = peaks.peak_flops(arithmetic) / flops_per_new_token
        compute_roof_new_only = peaks.peak_flops(arithmetic) / flops_per_decode_token
        rows.append({"system": system, "weight_MB_per_token": round(nbytes / 1e6, 1), "arithmetic": arithmetic,
                     **{f"{w}_tok_s": round(v, 2) for w, v in tok_s.items()},
                     "single_share_of_bandwidth_roof": round(tok_s["single"] / bandwidth_roof, 3) if "single" in tok_s else None,
                     "batch64_share_of_compute_roof": round(tok_s["batch64"] / compute_roof, 3) if "batch64" in tok_s else None,
                     "batch64_share_of_compute_roof_new_only": (round(tok_s["batch64"] / compute_roof_new_only, 3)
                                                                if "batch64" in tok_s else None)})

    # Single stream against llama.cpp's C API loop on the built-in Q4_1 file (the peer's own rate).
    peer = next((r for r in rows if r["system"] == "llamacpp-q4_1"), None)
    for r in rows:
        if peer and r["system"].startswith("fivefold-") and r.get("single_tok_s"):
            r["single_vs_llamacpp"] = round(r["single_tok_s"] / peer["single_tok_s"], 3)
    base = next((r for r in rows if r["system"] == "fivefold-float32"), None)
    table = Table(title=f"SmolLM2-135M, {PROMPT_LEN}-token pydoc prompts, EOS ignored; {plat.isa_level}, "
                        f"{torch.get_num_threads()} threads; bandwidth {bandwidth / 1e9:.1f} GB/s (median of "
                        f"{len(bandwidth_samples)}), float32 "
                        f"{peaks.peak_flops('float32') / 1e9:.0f} GFLOP/s, "
                        + (f"bf16 {peaks.flops['bfloat16'] / 1e9:.0f}, " if "bfloat16" in peaks.flops else "") +
                        f"int8 {peaks.peak_flops('int8') / 1e9:.0f} GOP/s")
    for col in ("system", "weights MB/token", "single tok/s", "of bandwidth roof", "batch16 tok/s",
                f"batch64 tok/s ({WORKLOADS['batch64'][1]} out)", "of compute roof (prompt + new tokens)", "ratio to fivefold f32 (single / b16 / b64)"):
        table.add_column(col, justify="right")

    def cell(r, key, fmt="{:.1f}"):
        return fmt.format(r[key]) if r.get(key) is not None else "-"

    for r in rows:
        ratios = [f"{r[k] / base[k]:.2f}x" if base and r.get(k) and base.get(k) else "-"
                  for k in ("single_tok_s", "batch16_tok_s", "batch64_tok_s")]
        table.add_row(r["system"], f"{r['weight_MB_per_token']:.0f}", cell(r, "single_tok_s"),
                      cell(r, "single_share_of_bandwidth_roof", "{:.0%}"), cell(r, "batch16_tok_s"),
                      cell(r, "batch64_tok_s"), cell(r, "batch64_share_of_compute_roof", "{:.0%}"), " / ".join(ratios))
    for system, why in skipped.items():
        table.add_row(system, "skipped", why[:60], "", "", "", "", "")
    console.print(table)
    if peer:
        console.print("single stream / llama.cpp's (C API loop, Q4_1 file): " + ", ".join(
            f"{r['system']} {r['single_vs_llamacpp']:.2f}x" for r in rows if "single_vs_llamacpp" in r))
    print(json_line({"benchmark": "peers", "machine": plat.isa_level, "bandwidth_GB_s": round(bandwidth / 1e9, 2),
                     "bandwidth_samples_GB_s": [round(b / 1e9, 1) for b in bandwidth_samples],
                     "peak_GFLOP_s": {k: round(v / 1e9, 1) for k, v in peaks.flops.items()},
                     "peak_GFLOP_s_samples": {k: [round(v / 1e9, 1) for v in samples]
                                              for k, samples in flops_samples.items()},
                     "workloads": {k: {"prompts": n, "new_tokens": t} for k, (n, t) in WORKLOADS.items()},
                     "results": rows, "skipped": skipped}))


if __name__ == "__main__":
    main()
