import json
import subprocess
import sys

import pytest
import torch

from fivefold.llm import LLM
from fivefold.models import load_model
from fivefold.quant.config import Int8Config
from fivefold.models.forward import llm_forward
from fivefold.eval.text import text_windows
from fivefold.models.int8_linear import Int8Linear
from fivefold.quant.quantize import quantize_
from fivefold.models.loader import save_quantized
from fivefold.sampling_params import SamplingParams
from tests.conftest import save_random_hf_model


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = tmp_path_factory.mktemp("tinyq") / "qwen2"  # tied embeddings and qkv bias
    save_random_hf_model("qwen2", path)
    return str(path)


@pytest.mark.parametrize("config", [Int8Config("w8a16"),
                                    Int8Config("w8a8", activation="static", activation_symmetric=False,
                                               calibration="entropy", bias_correction=True),
                                    Int8Config("w8a8", activation_granularity="per-tensor", skip=("lm_head",))])
def test_saved_model_reloads_bit_identical_and_generates_the_same_tokens(tiny, tmp_path, config):
    loaded = load_model(tiny)
    calib = text_windows(loaded.tokenizer, "calibration", 2, 32)
    result = quantize_(loaded.model, config, calib, llm_forward, show_progress=False)
    assert ("lm_head" in result.quantized) == ("lm_head" not in config.skip)
    out = save_quantized(loaded, config.to_dict(), result.quantized, tmp_path / "q")
    reloaded = load_model(str(out))
    a, b = loaded.model.state_dict(), reloaded.model.state_dict()
    assert a.keys() == b.keys()
    for key in a:
        assert a[key].dtype == b[key].dtype and torch.equal(a[key], b[key]), key
    assert sum(isinstance(m, Int8Linear) for m in reloaded.model.modules()) == len(result.quantized)
    if "lm_head" in config.skip:  # tied and float: one tensor again after reload
        assert reloaded.model.lm_head.weight is reloaded.model.embed_tokens.weight
    prompts = [[5, 17, 33, 2 + i, 90] for i in range(3)]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    first = [o.outputs[0].token_ids for o in LLM(loaded, kv_cache_memory_bytes=8 << 20).generate(prompts, params)]
    second = [o.outputs[0].token_ids for o in LLM(reloaded, kv_cache_memory_bytes=8 << 20).generate(prompts, params)]
    assert first == second


def test_quantize_cli_writes_a_model_that_generate_runs(tiny, tmp_path):
    def cli(*args):
        return subprocess.run([sys.executable, "-m", "fivefold", *args], capture_output=True, text=True,
                              timeout=600, cwd=tmp_path)

    proc = cli("quantize", "--model", tiny, "--scheme", "w8a8", "--activation", "static", "--calib", "percentile",
               "--mixed-precision", "--max-ppl-increase", "0.5%", "--num-calibration", "2", "--num-eval", "2",
               "--window", "32", "--out", "q")
    assert proc.returncode == 0, proc.stderr[-2000:]
    report = json.loads((tmp_path / "q" / "report.json").read_text())
    assert report["config"]["activation"] == "static" and report["int8"]["perplexity"] > 0
    assert report["float"]["decode_tok_s_batch1"] > 0 and report["int8"]["decode_tok_s_batch32"] > 0
    scan = json.loads((tmp_path / "q" / "sensitivity.json").read_text())
    assert len(scan["layers"]) == 2 * 2 + 2 * 2 + 1  # qkv, o, gate_up, down per layer, and the LM head
    assert report["num_int8_modules"] + len(report["kept_float"]) == len(scan["layers"])
    # The kernel that ran (the subprocess inherits any AVX2 forcing) and the machine it ran on.
    from fivefold.platform import current_platform
    from fivefold.models.int8_backends import w8a8_kernel

    assert report["kernels"] == {w8a8_kernel("static"): report["num_int8_modules"]}
    assert report["platform"]["isa_level"] == current_platform().isa_level
    assert "int8 kernels on this CPU" in proc.stdout
    gen = cli("generate", "--model", "q", "--prompt", "w5 w6 w7", "--max-tokens", "4")
    assert gen.returncode == 0, gen.stderr[-2000:]
    bad = cli("quantize", "--model", tiny, "--scheme", "w4a4", "--out", "x")
    assert bad.returncode == 2 and "invalid choice" in bad.stderr  # argparse's own one-line usage error
    long = cli("quantize", "--model", tiny, "--window", "100000", "--out", "x")
    assert long.returncode == 1 and "longer than the model's context (256 tokens)" in long.stderr
    tune = cli("quantize", "--model", tiny, "--tune-steps", "4", "--out", "x")
    assert tune.returncode == 1 and "--tune-steps trains 4-bit group scales: use --scheme w4a16 or w4a8" in tune.stderr
    budget = cli("quantize", "--model", tiny, "--max-ppl-increase", "lots", "--out", "x")
    assert budget.returncode == 1 and budget.stderr.strip() == "error: --max-ppl-increase takes a percentage such as 0.5%, got 'lots'"


def test_fivefold_serve_runs_the_quantized_directory(tiny, tmp_path):
    import httpx

    from tests.serve.conftest import serve_process

    loaded = load_model(tiny)
    config = Int8Config("w8a8", activation_granularity="per-tensor")
    result = quantize_(loaded.model, config, text_windows(loaded.tokenizer, "calibration", 2, 32), llm_forward,
                       show_progress=False)
    out = save_quantized(loaded, config.to_dict(), result.quantized, tmp_path / "q")
    prompt = [5, 17, 33, 90]
    expected = LLM(load_model(str(out)), kv_cache_memory_bytes=8 << 20).generate(
        [prompt], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))[0].outputs[0].text
    with serve_process("--model", str(out), "--kv-cache-memory-bytes", str(8 << 20)) as (_, url):
        r = httpx.post(url + "/v1/completions", json={"model": str(out), "prompt": prompt, "max_tokens": 6,
                                                      "temperature": 0, "ignore_eos": True}, timeout=60)
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["text"] == expected and r.json()["usage"]["completion_tokens"] == 6
