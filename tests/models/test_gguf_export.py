"""GGUF export (fivefold.models.gguf_export): 4-bit layers are written as the blocks they are (the
built-in Q4_1 file round-trips byte for byte), float layers are quantized with llama.cpp's rules,
and llama.cpp itself loads the result and computes what fivefold computes (when llama-cpp-python
is installed in its peer environment; skipped with the reason otherwise)."""

from __future__ import annotations

import json
import subprocess
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch

from fivefold.errors import FivefoldError
from fivefold.models import load_model
from fivefold.models.forward import prefill_logits
from fivefold.models.gguf_export import export_gguf
from fivefold.models.gguf_file import open_gguf
from fivefold.models.registry import BUILTIN_MODELS, DEFAULT_LLM

LLAMACPP_PYTHON = Path.home() / "peers/llamacpp/bin/python"


def _builtin() -> str:
    return str(BUILTIN_MODELS[DEFAULT_LLM].path())


def test_4bit_model_exports_its_own_blocks_byte_for_byte(tmp_path):
    served = load_model(_builtin(), quantization="gguf")
    out = export_gguf(served, tmp_path / "again.gguf", "Q4_1")
    source = {t.name: t for t in open_gguf(Path(_builtin())).tensors}
    written = {t.name: t for t in open_gguf(out).tensors}
    assert set(written) == set(source)
    for name, tensor in source.items():
        if tensor.tensor_type.name == "Q4_1" and name != "token_embd.weight":
            assert written[name].tensor_type.name == "Q4_1", name
            assert np.array_equal(np.asarray(written[name].data), np.asarray(tensor.data)), name
    again = load_model(str(out), quantization="gguf")
    ids = served.tokenizer.encode("Exporting keeps every block as it was.")
    with torch.inference_mode():
        torch.testing.assert_close(prefill_logits(again.model, ids), prefill_logits(served.model, ids), rtol=0, atol=0)


def test_float_model_exports_with_llama_cpp_rounding(tmp_path):
    import gguf

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        loaded = load_model(_builtin())  # float32: the Q4_1 blocks dequantized
    out = export_gguf(loaded, tmp_path / "q4_0.gguf", "Q4_0")
    written = {t.name: t for t in open_gguf(out).tensors}
    down = written["blk.0.ffn_down.weight"]
    assert down.tensor_type.name == "Q4_0" and written["token_embd.weight"].tensor_type.name == "Q8_0"
    # our Q4_0 blocks dequantize to within half a step (plus one clipped level) of the float weights,
    # as gguf's own quantizer's do
    ref = loaded.model.layers[0].mlp.down_proj.weight.detach().float().numpy()
    ours = gguf.quants.dequantize(down.data, down.tensor_type).reshape(ref.shape)
    theirs = gguf.quants.dequantize(gguf.quants.quantize(ref, gguf.GGMLQuantizationType.Q4_0),
                                    gguf.GGMLQuantizationType.Q4_0).reshape(ref.shape)
    err_ours, err_theirs = np.abs(ours - ref).mean(), np.abs(theirs - ref).mean()
    assert err_ours <= err_theirs * 1.01, (err_ours, err_theirs)


def test_export_refuses_what_it_cannot_write(tmp_path):
    from tests.conftest import save_random_hf_model

    save_random_hf_model("llama", tmp_path / "hf")
    with pytest.raises(FivefoldError, match="copies the tokenizer of a GGUF source"):
        export_gguf(load_model(str(tmp_path / "hf")), tmp_path / "x.gguf", "Q4_0")
    with pytest.raises(FivefoldError, match="writes F32, Q8_0, Q4_0, Q4_1, got 'Q5_K'"):
        export_gguf(load_model(_builtin(), quantization="gguf"), tmp_path / "x.gguf", "Q5_K")


def test_quantize_cli_also_writes_a_gguf_file(tmp_path):
    """``fivefold quantize --scheme w4a8 --format gguf``: the directory and <out>/model.gguf hold the
    same 4-bit codes and scales (the GGUF read back block by block equals the directory's layers);
    what a GGUF cannot hold is refused before any work, in one line."""
    import sys

    from fivefold.models.int4_linear import Int4Linear
    from tests.conftest import save_random_hf_model

    def cli(*args):
        return subprocess.run([sys.executable, "-m", "fivefold", "quantize", *args], capture_output=True, text=True,
                              timeout=600, cwd=tmp_path)

    proc = cli("--scheme", "w4a8", "--group-size", "64", "--format", "gguf", "--num-eval", "1", "--window", "32",
               "--no-baseline", "--out", "q")
    assert proc.returncode == 0, proc.stderr[-2000:]
    report = json.loads((tmp_path / "q" / "report.json").read_text())
    assert report["gguf"] == str(Path("q") / "model.gguf") and report["config"]["scheme"] == "w4a8"
    directory = load_model(str(tmp_path / "q"))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from_gguf = load_model(str(tmp_path / report["gguf"]), quantization="gguf")
    four_bit = {n: m for n, m in directory.model.named_modules() if isinstance(m, Int4Linear)}
    assert len(four_bit) == 4 * directory.config.num_layers and all(m.int8_activations for m in four_bit.values())
    for name, module in four_bit.items():
        assert torch.equal(from_gguf.model.get_submodule(name).dequantized_weight(), module.dequantized_weight()), name
    w8a8 = cli("--scheme", "w8a8", "--format", "gguf", "--out", "x")
    assert w8a8.returncode == 1 and "--format gguf writes weights only" in w8a8.stderr
    save_random_hf_model("llama", tmp_path / "hf")
    hf = cli("--model", str(tmp_path / "hf"), "--scheme", "w4a16", "--format", "gguf", "--out", "x")
    assert hf.returncode == 1 and "copies the tokenizer of a GGUF source" in hf.stderr
    assert not (tmp_path / "x").exists()


LLAMACPP_LOGITS = r'''
import json, sys
import numpy as np
from llama_cpp import Llama
spec = json.load(open(sys.argv[1]))
llm = Llama(model_path=spec["gguf"], n_ctx=128, logits_all=True, n_threads=2, verbose=False)
llm.eval(spec["ids"])
print("RESULT " + json.dumps(np.array(llm.scores[:len(spec["ids"])]).tolist()))
'''


@pytest.mark.skipif(not LLAMACPP_PYTHON.exists(), reason=f"llama-cpp-python is not installed ({LLAMACPP_PYTHON})")
def test_llama_cpp_runs_an_exported_gptq_style_file(tmp_path):
    """A model quantized by fivefold (RTN symmetric, groups of 64: Q4_0 blocks sharing scales), exported,
    then run by llama.cpp: its logits agree with fivefold's on the same file (llama.cpp multiplies
    in W4A8, so close, not equal)."""
    from fivefold.models.forward import llm_forward
    from fivefold.quant.int4 import Int4Config, quantize_int4_

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        loaded = load_model(_builtin())
    quantize_int4_(loaded.model, Int4Config(method="rtn", group_size=64, symmetric=True), None, llm_forward,
                   show_progress=False)
    out = export_gguf(loaded, tmp_path / "fivefold-q4_0.gguf", "Q4_0")
    ids = loaded.tokenizer.encode("The Python language reference describes the syntax")
    (tmp_path / "run.py").write_text(LLAMACPP_LOGITS)
    (tmp_path / "spec.json").write_text(json.dumps({"gguf": str(out), "ids": ids}))
    proc = subprocess.run([str(LLAMACPP_PYTHON), str(tmp_path / "run.py"), str(tmp_path / "spec.json")],
                          capture_output=True, text=True, timeout=300)
    line = next((x for x in proc.stdout.splitlines() if x.startswith("RESULT ")), None)
    assert line is not None, proc.stderr[-2000:]
    theirs = torch.tensor(json.loads(line[len("RESULT "):]))
    ours = prefill_logits(load_model(str(out), quantization="gguf").model, ids)
    cos = torch.nn.functional.cosine_similarity(ours, theirs, dim=-1)
    assert float(cos.min()) > 0.99, cos
    assert float((ours.argmax(-1) == theirs.argmax(-1)).float().mean()) >= 0.8
