"""Real-size models on this machine: load time, peak RSS, resident weight bytes and decode speed
of random-weight Llama models of the shapes users run, fivefold against llama.cpp on the same file.

Shapes (the built-in SmolLM2 tokenizer and its 49,152-token vocabulary, tied embeddings):
  1b   Llama-3.2-1B: hidden 2048, 16 layers, MLP 8192, 32 heads / 8 KV heads   (1.07B parameters)
  3b   Llama-3.2-3B: hidden 3072, 28 layers, MLP 8192, 24 / 8                   (3.2B)
  8b   Llama-3-8B:   hidden 4096, 32 layers, MLP 14336, 32 / 8                  (7.2B)

Each shape is synthesized once (seeded, tensor by tensor: no step holds the model) into
``~/.cache/fivefold/scale/<shape>/`` in the forms asked for: a bf16 safetensors directory (one
shard per layer + ``model.safetensors.index.json``), a GGUF Q8_0 file and a GGUF Q4_0 file (the
built-in GGUF's tokenizer and chat-template metadata, this shape's hyper-parameters; projections in
Q8_0 blocks, one fp16 scale per 32 weights, or Q4_0 blocks, the same scale over 32 4-bit codes; the
tied embedding Q8_0 in both). Random weights are fine for speed and memory; quality is measured on
the built-in model.

Forms (FORM:DTYPE): the bf16 directory served in float32 or bfloat16, or quantized while loading
(``w8a16``, ``w4a16``: RTN, groups of 128 with a minimum, the tied head W8A16; ``w4a8``: the same
4-bit weights times int8 activations); the Q8_0 file (float32 activations, Q8_0 served int8 as it
is; ``gguf``: the Q8_0 blocks times int8 activations, as llama.cpp); the Q4_0 file served as it is
(``gguf``: its blocks on the int4 kernel times int8 activations, the tied table held once in the
head's Q8_0 blocks). llama.cpp runs each GGUF file; every fivefold form is compared with
llama.cpp on the file of its precision (4-bit forms with Q4_0, the others with Q8_0).

Each measurement runs in a fresh process (so that one run's memory cannot count for another):
load time, the OS's peak RSS (VmHWM of /proc/self/status) after loading and at the end, the
model's resident weight bytes (the engine's stats: every distinct tensor the loaded model and its
serving view hold, in every layout), the target bound 1.15 x those + the KV pool + 1 GiB, and
decode tokens/s at batch 1 and 8 (128-token held-out
prompts, 64 new tokens, EOS ignored, greedy; prefill excluded). llama.cpp (``~/peers/llamacpp``, see
``../shared/PEERS.md``) runs the same GGUF file single stream when it is installed, through
``benchmarks/llamacpp_decode.py`` (its C API in a decode loop, as llama-cli runs a token).

This VM's memory bandwidth drifts by up to 1.6x from minute to minute, so a single fivefold run
and a single llama.cpp run a minute apart can differ by that much whichever is faster.
``--repeats N`` runs the whole set N times, the systems alternating (fivefold's forms, then
llama.cpp's files, then again), and reports each row's median decode rate (the samples in the JSON
line), the largest peak RSS and the median load time.

    .venv/bin/python benchmarks/scale.py [--shapes 1b,3b,8b] [--forms bf16-dir:w8a16,gguf-q8_0:float32,gguf-q4_0:gguf] [--repeats 3]

Prints a table and one JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
import zlib
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

SHAPES = {  # hidden, layers, MLP, heads, KV heads
    "1b": (2048, 16, 8192, 32, 8),
    "3b": (3072, 28, 8192, 24, 8),
    "8b": (4096, 32, 14336, 32, 8),
}
VOCAB = 49152
# FORM:DTYPE, or FORM:w8a16 / FORM:w4a16 (float32 activations, int8 or 4-bit weights quantized while
# loading), FORM:w4a8 (the 4-bit weights times int8 activations), or FORM:gguf (a GGUF's 4-bit blocks
# served as they are, times int8 activations as llama.cpp). The GGUF's Q8_0 tensors are served int8
# with their block scales whatever the dtype (float32 activations).
FORMS = ("bf16-dir:float32", "bf16-dir:bfloat16", "bf16-dir:w8a16", "gguf-q8_0:float32", "gguf-q8_0:gguf",
         "bf16-dir:w4a16", "bf16-dir:w4a8", "gguf-q4_0:gguf", "gguf-q4_k_m:gguf")
# gguf-q4_k_m: llama.cpp's own Q4_K_M mix (Q4_K projections, Q6_K for half of ffn_down and attn_v and
# for the table), made by llama-cpp-python's llama_model_quantize from the Q8_0 file (requantized:
# random weights, so only speed and memory mean anything); needs ~/peers/llamacpp
GGUF_TYPES = {"gguf-q8_0": "Q8_0", "gguf-q4_0": "Q4_0", "gguf-q4_k_m": "Q4_K_M"}
PROMPT_LEN, NEW_TOKENS, BATCHES = 128, 64, (1, 8)
KV_CACHE_BYTES = 512 << 20
Q8_BLOCK = 32
LLAMACPP_PYTHON = Path.home() / "peers/llamacpp/bin/python"


def cache_dir() -> Path:
    from fivefold.paths import cache_dir as fivefold_cache

    return fivefold_cache() / "scale"


# --- synthesis ------------------------------------------------------------------------------------

def hf_config(shape: str) -> dict:
    hidden, layers, mlp, heads, kv_heads = SHAPES[shape]
    return {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": VOCAB,
            "hidden_size": hidden, "intermediate_size": mlp, "num_hidden_layers": layers,
            "num_attention_heads": heads, "num_key_value_heads": kv_heads, "head_dim": hidden // heads,
            "rms_norm_eps": 1e-5, "rope_theta": 500000.0, "max_position_embeddings": 8192,
            "tie_word_embeddings": True, "hidden_act": "silu", "bos_token_id": 1, "eos_token_id": 2,
            "torch_dtype": "bfloat16"}


def layer_shapes(shape: str, layer: int) -> dict[str, tuple[int, ...]]:
    """HF names and shapes of one decoder layer's tensors."""
    hidden, _, mlp, heads, kv_heads = SHAPES[shape]
    head_dim = hidden // heads
    p = f"model.layers.{layer}."
    return {p + "input_layernorm.weight": (hidden,), p + "post_attention_layernorm.weight": (hidden,),
            p + "self_attn.q_proj.weight": (heads * head_dim, hidden),
            p + "self_attn.k_proj.weight": (kv_heads * head_dim, hidden),
            p + "self_attn.v_proj.weight": (kv_heads * head_dim, hidden),
            p + "self_attn.o_proj.weight": (hidden, heads * head_dim),
            p + "mlp.gate_proj.weight": (mlp, hidden), p + "mlp.up_proj.weight": (mlp, hidden),
            p + "mlp.down_proj.weight": (hidden, mlp)}


def model_tensors(shape: str):
    """(HF name, shape) groups, one per shard: the embedding and final norm, then each layer."""
    hidden, layers = SHAPES[shape][0], SHAPES[shape][1]
    yield "embed", {"model.embed_tokens.weight": (VOCAB, hidden), "model.norm.weight": (hidden,)}
    for i in range(layers):
        yield f"layer-{i:03d}", layer_shapes(shape, i)


def random_tensor(name: str, shape: tuple[int, ...]):
    """The same float32 values for the same name in every form (seeded by the name)."""
    import torch

    if name.endswith("norm.weight"):
        return torch.ones(shape)
    g = torch.Generator().manual_seed(zlib.crc32(name.encode()))
    return torch.randn(shape, generator=g) * 0.02


def write_hf_directory(shape: str, out: Path) -> None:
    import torch
    from safetensors.torch import save_file

    from fivefold.models.loader import load_tokenizer
    from fivefold.models.registry import DEFAULT_LLM

    out.mkdir(parents=True, exist_ok=True)
    weight_map = {}
    for shard, tensors in model_tensors(shape):
        file = f"{shard}.safetensors"
        save_file({n: random_tensor(n, s).to(torch.bfloat16) for n, s in tensors.items()}, str(out / file))
        weight_map.update(dict.fromkeys(tensors, file))
    (out / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    load_tokenizer(DEFAULT_LLM)[0].hf.save_pretrained(str(out))
    (out / "config.json").write_text(json.dumps(hf_config(shape), indent=2))  # last: marks the directory done


GGUF_NAMES = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm", "self_attn.q_proj": "attn_q",
              "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
              "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}


def gguf_name(hf: str) -> str:
    if hf == "model.embed_tokens.weight":
        return "token_embd.weight"
    if hf == "model.norm.weight":
        return "output_norm.weight"
    _, _, layer, rest = hf.split(".", 3)
    return f"blk.{layer}.{GGUF_NAMES[rest.removesuffix('.weight')]}.weight"


BLOCK_BYTES = {"Q8_0": Q8_BLOCK + 2, "Q4_0": Q8_BLOCK // 2 + 2}  # per 32 weights


def block_bytes(w, qtype: str) -> "numpy.ndarray":
    """llama.cpp's blocks of a float32 [rows, cols] tensor ([rows, cols / 32 * bytes] uint8),
    quantized with llama.cpp's rules (fivefold.models.gguf_export)."""
    from fivefold.models.gguf_export import q4_bytes, q8_0_bytes
    from fivefold.models.int4_linear import Int4Format, quantize_int4

    if qtype == "Q8_0":
        return q8_0_bytes(w)
    return q4_bytes(quantize_int4(w, Int4Format(group_size=Q8_BLOCK, symmetric=True)))


def write_gguf(shape: str, out: Path, qtype: str = "Q8_0") -> None:
    """A llama GGUF with the built-in file's tokenizer metadata, streamed tensor by tensor: the
    projections in ``qtype`` (Q8_0 or Q4_0), the tied embedding in Q8_0, norms in F32."""
    import gguf
    import numpy as np

    from fivefold.models.registry import DEFAULT_LLM, resolve_model_path

    hidden, layers, mlp, heads, kv_heads = SHAPES[shape]
    source = gguf.GGUFReader(str(resolve_model_path(DEFAULT_LLM)))
    tmp = out.with_suffix(".partial")
    writer = gguf.GGUFWriter(str(tmp), "llama")
    writer.add_name(f"fivefold-scale-{shape}")
    writer.add_block_count(layers)
    writer.add_context_length(8192)
    writer.add_embedding_length(hidden)
    writer.add_feed_forward_length(mlp)
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_rope_dimension_count(hidden // heads)
    writer.add_rope_freq_base(500000.0)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_vocab_size(VOCAB)
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_Q8_0 if qtype == "Q8_0" else gguf.LlamaFileType.MOSTLY_Q4_0)
    for key, field in source.fields.items():
        if key.startswith("tokenizer."):
            value = field.contents()
            types = field.types
            if types[0] == gguf.GGUFValueType.ARRAY:
                writer.add_array(key, value) if types[-1] == gguf.GGUFValueType.STRING else \
                    writer.add_key_value(key, value, types[0], sub_type=types[-1])
            else:
                writer.add_key_value(key, value, types[0])
    specs = [(n, s) for _, tensors in model_tensors(shape) for n, s in tensors.items()]
    def kind(name):
        return "Q8_0" if name == "model.embed_tokens.weight" else qtype

    for name, s in specs:
        if len(s) == 1:
            writer.add_tensor_info(gguf_name(name), s, np.dtype(np.float32), s[0] * 4)
        else:
            row = s[1] // Q8_BLOCK * BLOCK_BYTES[kind(name)]
            writer.add_tensor_info(gguf_name(name), (s[0], row), np.dtype(np.uint8), s[0] * row,
                                   raw_dtype=gguf.GGMLQuantizationType[kind(name)])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    for name, s in specs:
        w = random_tensor(name, s)
        writer.write_tensor_data(w.numpy() if len(s) == 1 else block_bytes(w, kind(name)))
    writer.close()
    tmp.rename(out)


LLAMACPP_QUANTIZE = r"""
import ctypes, sys
import llama_cpp
params = llama_cpp.llama_model_quantize_default_params()
params.ftype = llama_cpp.LLAMA_FTYPE_MOSTLY_Q4_K_M
params.allow_requantize = True
rc = llama_cpp.llama_model_quantize(sys.argv[1].encode(), sys.argv[2].encode(), ctypes.byref(params))
raise SystemExit(f"llama_model_quantize failed: {rc}" if rc else 0)
"""


def llamacpp_quantize(source: Path, out: Path) -> None:
    """``out``: llama.cpp's Q4_K_M of ``source`` (written by llama-cpp-python in its own venv)."""
    if not LLAMACPP_PYTHON.exists():
        raise SystemExit(f"gguf-q4_k_m needs llama-cpp-python in {LLAMACPP_PYTHON.parent.parent} (../shared/PEERS.md)")
    tmp = out.with_suffix(".partial")
    subprocess.run([str(LLAMACPP_PYTHON), "-c", LLAMACPP_QUANTIZE, str(source), str(tmp)], check=True,
                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    tmp.rename(out)


def synthesize(shape: str, console, sources: set[str] = frozenset(("bf16-dir", "gguf-q8_0"))) -> dict[str, Path]:
    """The files of ``shape`` that ``sources`` name, written once into the cache."""
    root = cache_dir() / shape
    files = {"bf16-dir": root / "bf16", **{src: root / f"scale-{shape}-{src.removeprefix('gguf-')}.gguf"
                                          for src in GGUF_TYPES}}
    if "bf16-dir" in sources and not (files["bf16-dir"] / "config.json").exists():
        console.print(f"synthesizing {shape}: bf16 safetensors -> {files['bf16-dir']}")
        write_hf_directory(shape, files["bf16-dir"])
    for src, qtype in GGUF_TYPES.items():
        if src in sources and not files[src].exists():
            console.print(f"synthesizing {shape}: GGUF {qtype} -> {files[src]}")
            root.mkdir(parents=True, exist_ok=True)
            if qtype == "Q4_K_M":
                if not files["gguf-q8_0"].exists():
                    write_gguf(shape, files["gguf-q8_0"], "Q8_0")
                llamacpp_quantize(files["gguf-q8_0"], files[src])
            else:
                write_gguf(shape, files[src], qtype)
    return {src: path for src, path in files.items() if src in sources}


# --- measurement, each in its own process ----------------------------------------------------------

FIVEFOLD_CHILD = r"""
import json, sys, time
def peak_rss():
    for line in open("/proc/self/status"):
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
path, dtype, prompt_len, new_tokens, batches, kv_bytes = sys.argv[1], sys.argv[2], *map(int, sys.argv[3:5]), json.loads(sys.argv[5]), int(sys.argv[6])
quantization = None
if dtype in ("w8a16", "w4a16", "w4a8", "gguf"):
    dtype, quantization = "float32", dtype
from fivefold.llm import LLM
from fivefold.sampling_params import SamplingParams
from fivefold.eval.language import decode_rate
from fivefold.eval.text import corpus_ids, corpus_prompts
start = time.perf_counter()
llm = LLM(path, dtype=dtype, quantization=quantization, max_num_seqs=max(batches), kv_cache_memory_bytes=kv_bytes)
load_s = time.perf_counter() - start
rss_load = peak_rss()
stats = llm.engine.stats()  # every distinct weight tensor the engine holds, in every layout
prompts = corpus_prompts(corpus_ids(llm.tokenizer, "heldout"), max(batches), prompt_len, seed=0)
params = SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True)
llm.generate(prompts[:1], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))  # first-call costs
speed = {f"decode_tok_s_batch{b}": decode_rate(llm.generate(prompts[:b], params)) for b in batches}
print(json.dumps({"load_s": load_s, "peak_rss_load": rss_load, "peak_rss": peak_rss(),
                  "weight_bytes": stats["weight_bytes"], "kv_cache_bytes": stats["kv_cache_bytes"], **speed}))
"""

def run_child(argv: list[str], timeout: int = 3600) -> dict:
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=timeout,
                          cwd=Path(__file__).resolve().parents[1])
    if proc.returncode != 0:
        lines = (proc.stderr or proc.stdout).strip().splitlines()
        return {"error": lines[-1] if lines else f"exit {proc.returncode}"}
    return json.loads(proc.stdout.strip().splitlines()[-1])


def measure_fivefold(path: Path, dtype: str) -> dict:
    return run_child([sys.executable, "-c", FIVEFOLD_CHILD, str(path), dtype, str(PROMPT_LEN), str(NEW_TOKENS),
                      json.dumps(list(BATCHES)), str(KV_CACHE_BYTES)])


def measure_llamacpp(path: Path) -> dict:
    from fivefold.eval.text import corpus_ids, corpus_prompts
    from fivefold.models.loader import load_tokenizer
    from fivefold.models.registry import DEFAULT_LLM

    tokenizer = load_tokenizer(DEFAULT_LLM)[0]
    prompt = corpus_prompts(corpus_ids(tokenizer, "heldout"), 1, PROMPT_LEN, seed=0)[0]
    # benchmarks/llamacpp_decode.py: llama.cpp's C API decode loop (what llama-cli runs a token), one run
    # per call as fivefold's child does; this script repeats the whole measurement.
    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / "prompt.json").write_text(json.dumps(prompt))
        found = run_child([str(LLAMACPP_PYTHON), str(Path(__file__).resolve().parent / "llamacpp_decode.py"),
                           str(path), "--prompt", str(Path(tmp) / "prompt.json"), "--new", str(NEW_TOKENS),
                           "--n-ctx", "512", "--repeats", "1", "--no-generate"])
    if "error" in found:
        return found
    return {k: found[k] for k in ("load_s", "peak_rss_load", "peak_rss")} | {"decode_tok_s_batch1": found["decode_tok_s"]}


def brief(run: dict) -> str:
    """One run's decode rates (or its error), printed as it ends."""
    if "error" in run:
        return f"error: {run['error']}"
    return ", ".join(f"b{k.removeprefix('decode_tok_s_batch')} {v:.2f} tok/s" for k, v in run.items()
                     if k.startswith("decode_tok_s"))


def combine(samples: list[dict]) -> dict:
    """One row from repeated runs: median rates and load time, the largest peak RSS, the samples."""
    import statistics

    ok = [r for r in samples if "error" not in r]
    if not ok:
        return samples[0]
    out = dict(ok[0])
    for key in list(out):
        values = [r[key] for r in ok]
        if key.startswith("decode_tok_s") or key == "load_s":
            out[key] = statistics.median(values)
            if len(ok) > 1 and key.startswith("decode_tok_s"):
                out[f"{key}_samples"] = [round(v, 2) for v in values]
        elif key.startswith("peak_rss"):
            out[key] = max(values)
    return out


def gb(n) -> str:
    return f"{n / 1e9:.2f}" if isinstance(n, (int, float)) else "-"


def main() -> int:
    from rich.console import Console

    from fivefold.bench.report import json_line, results_table
    from fivefold.platform import current_platform

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", default="1b", help=f"comma-separated, of {', '.join(SHAPES)}")
    ap.add_argument("--forms", default=",".join(FORMS), help=f"comma-separated FORM:DTYPE, of {', '.join(FORMS)}")
    ap.add_argument("--no-llamacpp", action="store_true")
    ap.add_argument("--repeats", type=int, default=1, help="alternating runs of every system; medians reported")
    args = ap.parse_args()
    if args.repeats < 1:
        ap.error("--repeats must be at least 1")
    shapes = [s for s in args.shapes.split(",") if s]
    forms = [f for f in args.forms.split(",") if f]
    for s in shapes:
        if s not in SHAPES:
            ap.error(f"unknown shape '{s}'; choose from {', '.join(SHAPES)}")
    for f in forms:
        if f not in FORMS:
            ap.error(f"unknown form '{f}'; choose from {', '.join(FORMS)}")
    console = Console(width=150)
    results = []
    sources = {f.split(":")[0] for f in forms}
    sources.add("gguf-q8_0")  # llama.cpp's reference file
    for shape in shapes:
        files = synthesize(shape, console, sources)
        runs: dict[tuple[str, str], list[dict]] = {}
        for rep in range(args.repeats):
            tag = f" (run {rep + 1} of {args.repeats})" if args.repeats > 1 else ""
            for form in forms:
                source, dtype = form.split(":")
                console.print(f"  fivefold {shape} {form}{tag} ...")
                runs.setdefault(("fivefold", form), []).append(
                    {"file_bytes": sum(p.stat().st_size for p in files[source].glob("*.safetensors"))
                     if files[source].is_dir() else files[source].stat().st_size,
                     **measure_fivefold(files[source], dtype)})
                console.print(f"    {brief(runs[('fivefold', form)][-1])}")
            if LLAMACPP_PYTHON.exists() and not args.no_llamacpp:
                for src in sorted(s for s in files if s in GGUF_TYPES):
                    console.print(f"  llama.cpp {shape} {src}{tag} ...")
                    runs.setdefault(("llama.cpp", src), []).append(
                        {"file_bytes": files[src].stat().st_size, **measure_llamacpp(files[src])})
                    console.print(f"    {brief(runs[('llama.cpp', src)][-1])}")
        for (system, form), samples in runs.items():
            results.append({"shape": shape, "system": system, "form": form, **combine(samples)})
    rows = []
    # each fivefold form against llama.cpp on the same GGUF file, or on the file of its precision (a
    # directory quantized on load: 4-bit forms against Q4_0, 8-bit against Q8_0)
    llamacpp_b1 = {(r["shape"], r["form"]): r["decode_tok_s_batch1"] for r in results
                   if r["system"] == "llama.cpp" and "decode_tok_s_batch1" in r}
    for r in results:
        if "error" in r:
            rows.append((r["shape"], r["system"], r["form"], gb(r["file_bytes"]), r["error"][:60], *[""] * 8))
            continue
        bound = "-"
        if "weight_bytes" in r:  # the target: peak RSS <= 1.15 x resident weights + KV pool + 1 GiB
            r["rss_bound"] = 1.15 * r["weight_bytes"] + r["kv_cache_bytes"] + (1 << 30)
            bound = f"{gb(r['rss_bound'])} {'ok' if r['peak_rss'] <= r['rss_bound'] else 'over'}"
            if r["form"].startswith("gguf"):  # issue 37's bound for a GGUF: 1.15 x its file + KV pool + 1 GiB
                r["file_rss_bound"] = 1.15 * r["file_bytes"] + r["kv_cache_bytes"] + (1 << 30)
                bound += f" (file: {'ok' if r['peak_rss'] <= r['file_rss_bound'] else 'over'})"
        four_bit = "q4" in r["form"] or "w4a" in r["form"]
        source = r["form"].split(":")[0]  # a GGUF against llama.cpp on the same file
        ref = llamacpp_b1.get((r["shape"], source if source in GGUF_TYPES else "gguf-q4_0" if four_bit else "gguf-q8_0"))
        b8 = r.get("decode_tok_s_batch8")
        rows.append((r["shape"], r["system"], r["form"], gb(r["file_bytes"]), f"{r['load_s']:.1f}",
                     gb(r["peak_rss_load"]), gb(r["peak_rss"]), gb(r.get("weight_bytes")), bound,
                     f"{r['decode_tok_s_batch1']:.1f}", f"{b8:.1f}" if b8 else "-",
                     f"{r['decode_tok_s_batch1'] / ref:.2f}x" if ref else "-",
                     f"{b8 / ref:.2f}x" if ref and b8 else "-"))
    isa = current_platform().isa_level
    console.print(results_table(f"real-size random-weight Llama shapes, {PROMPT_LEN}-token prompt, {NEW_TOKENS} new "
                                f"tokens ({isa}, {os.cpu_count()} cores"
                                f"{f'; medians of {args.repeats} alternating runs' if args.repeats > 1 else ''})",
                                ("shape", "system", "form:dtype", "file GB", "load s", "peak RSS load GB",
                                 "peak RSS GB", "weights GB", "RSS bound GB", "tok/s b1", "tok/s b8",
                                 "b1 / llama.cpp b1", "b8 / llama.cpp b1"), rows))
    print(json_line({"benchmark": "scale", "results": results}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
