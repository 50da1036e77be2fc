import json
import re
import subprocess
import sys

import pytest

from fivefold.bench.demo import DemoSizes, run_demo
from fivefold.bench.registry import RunRegistry
from tests.conftest import save_random_hf_model


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny") / "llama"
    save_random_hf_model("llama", path)
    return str(path)


def _cli(*args, cwd):
    return subprocess.run([sys.executable, "-m", "fivefold", *args], capture_output=True, text=True, timeout=300,
                          cwd=cwd)


def test_bench_offline_rollback_and_recipe_recreate_the_same_run(tiny_model, tmp_path):
    db = str(tmp_path / "runs.db")
    first = _cli("bench", "offline", "--model", tiny_model, "--num-requests", "3", "--input-len", "8",
                 "--output-len", "5", "--max-num-seqs", "2", "--registry", db, cwd=tmp_path)
    assert first.returncode == 0, first.stderr
    line = json.loads(first.stdout.strip().splitlines()[-1])
    assert line["benchmark"] == "offline throughput" and line["output_tok_s"] > 0
    assert "set as the baseline" in first.stdout
    assert _cli("runs", "--registry", db, "rollback", "1", "--out", "recipe.json", cwd=tmp_path).returncode == 0
    again = _cli("bench", "--recipe", "recipe.json", "--registry", db, cwd=tmp_path)
    assert again.returncode == 0, again.stderr
    assert "against the baseline (run 1)" in again.stdout and "variables changed" not in again.stdout
    registry = RunRegistry(db)
    a, b = registry.get(1), registry.get(2)
    assert a.config == b.config and registry.compare(1, 2).config_diff == {}
    assert a.config["engine"]["max_num_seqs"] == 2 and a.model_fingerprint and a.model_fingerprint == b.model_fingerprint
    # Same configuration, greedy: the same tokens.
    assert a.metrics["samples"]["output_token_ids"] == b.metrics["samples"]["output_token_ids"]
    registry.close()
    plot = _cli("runs", "--registry", db, "plot", "--out", "runs.png", cwd=tmp_path)
    assert plot.returncode == 0, plot.stderr
    assert (tmp_path / "runs.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_bad_recipes_get_one_line_errors(tmp_path):
    (tmp_path / "bad.json").write_text("{not json")
    (tmp_path / "odd.json").write_text(json.dumps({"benchmark": "nope", "config": {}}))
    for name, message in (("missing.json", "does not exist"), ("bad.json", "not valid JSON"),
                          ("odd.json", "is not one fivefold can re-run")):
        proc = _cli("bench", "--recipe", name, "--registry", "", cwd=tmp_path)
        assert proc.returncode == 1 and proc.stderr.startswith("error: ") and message in proc.stderr
        assert "Traceback" not in proc.stderr
    empty = _cli("runs", "--registry", str(tmp_path / "empty.db"), "plot", cwd=tmp_path)
    assert empty.returncode == 1 and "none of these runs" in empty.stderr


def test_demo_runs_every_landed_lever_with_one_variable_per_row(tiny_model, tmp_path):
    from rich.console import Console

    sizes = DemoSizes(hardware_requests=3, batching_requests=4, prefix_requests=3, prefix_len=64, input_len=8,
                      output_len=6, profile_seq=24, eval_windows=1, cnn_image_size=32,
                      embedding_requests=48, digits_epochs=1, copy_requests=1, copy_output_len=8,
                      draft_distill_steps=1, long_context=96)
    console = Console(file=open(tmp_path / "out.txt", "w"), width=160)
    summary = run_demo(tiny_model, registry_path=str(tmp_path / "runs.db"), out_dir=tmp_path, console=console,
                       sizes=sizes, html_path=tmp_path / "demo.html")
    page = (tmp_path / "demo.html").read_text()  # the self-contained report: table, verdicts, the plot inlined
    assert page.count("<tr><td>") >= len(summary["rows"]) and "profile verdicts" in page
    assert "src='data:image/png;base64," in page
    assert not re.search(r"(https?:)?//[a-z0-9]", re.sub(r"data:[^']*", "", page), re.I)  # no external URL
    measured = [r for r in summary["rows"] if r["status"] == "measured"]
    assert {r["lever"] for r in measured} == {"1 structure", "2 hardware", "3 quantization", "4 scheduling",
                                              "5 caching"}
    assert all(r["ratio"] > 0 and r["accuracy"] for r in measured)
    # Speed levers do not change greedy tokens; quantization reports its perplexity cost.
    engine_rows = [r for r in measured if r["runs"]]
    kv_int8 = [r for r in measured if r["change"].startswith("int8 KV cache")]
    assert len(kv_int8) == 2 and kv_int8[0]["ratio"] > 1.8  # tokens that fit the same pool
    assert kv_int8[0]["accuracy"].startswith("held-out ppl ") and "top-1 agreement" in kv_int8[0]["accuracy"]
    assert all(r["accuracy"].startswith("none: greedy tokens identical") for r in engine_rows
               if r["lever"] != "3 quantization" and r not in kv_int8)
    speculation = [r for r in engine_rows if r["change"].startswith("speculative decoding")]
    assert len(speculation) == 2 and all("tokens per verification" in r["accuracy"] for r in speculation)
    assert (tmp_path / "student-1" / "config.json").exists()  # the draft: fivefold distill's student
    batching = [r for r in measured if r["change"].startswith("dynamic batching")]
    assert len(batching) == 1 and float(batching[0]["accuracy"].split("min cosine ")[1].split(";")[0]) > 0.99999
    structure = [r for r in measured if r["lever"] == "1 structure"]
    cnn = [r for r in measured if not r["runs"] and r not in batching + structure + kv_int8]  # fx fusion of the CNNs
    assert [r["change"].split(":")[0] for r in cnn] == ["resnet18", "mobilenet_v2"]
    assert all(r["accuracy"].startswith("none: max |diff|") and float(r["accuracy"].split()[-1]) < 1e-5 for r in cnn)
    assert any("hot path" in r["change"] for r in engine_rows)
    quant = [r for r in measured if r["lever"] == "3 quantization"]
    assert len(quant) == 3 and all(r["accuracy"].startswith("held-out ppl ") for r in quant)
    assert {r["status"] for r in summary["rows"]} == {"measured"}  # every lever has landed
    assert len(structure) == 2 and all(r["accuracy"].startswith("test accuracy ") for r in structure)
    assert set(summary["verdicts"]) == {"decode", "prefill"} and all(summary["verdicts"].values())
    registry = RunRegistry(tmp_path / "runs.db")
    for r in engine_rows:
        assert registry.compare(*r["runs"]).num_changed_variables == 1
    for r in quant:  # the int8 run really ran int8 layers, and recorded its configuration
        assert registry.get(r["runs"][1]).config["quantization"]["scheme"] in ("w8a16", "w8a8", "w4a16")
        assert registry.compare(*r["runs"]).config_diff.keys() == {"quantization"}
    w4 = [r for r in quant if registry.get(r["runs"][1]).config["quantization"]["scheme"] == "w4a16"]
    assert len(w4) == 1 and registry.get(w4[0]["runs"][0]).config["quantization"]["scheme"] == "w8a16"
    caching = next(r for r in measured if r["change"].startswith("prefix cache"))
    no_cache, cache = (registry.get(i).metrics for i in caching["runs"])
    assert cache["num_computed_prompt_tokens"] < no_cache["num_computed_prompt_tokens"] == no_cache["num_prompt_tokens"]
    registry.close()
    assert (tmp_path / "demo.png").exists() and (tmp_path / "demo-trace-decode.json").exists()
