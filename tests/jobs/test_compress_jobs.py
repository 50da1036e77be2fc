"""fivefold prune / distill: the directories they write load back; bad input is one line."""

import json

import pytest
import torch

from fivefold.cli import main
from fivefold.jobs.compress import load_compressed
from fivefold.errors import FivefoldError
from fivefold.models import load_model
from tests.conftest import save_random_hf_model


def test_prune_llm_writes_a_loadable_hf_directory(tmp_path, capsys):
    save_random_hf_model("llama", tmp_path / "orig")
    out = tmp_path / "pruned"
    assert main(["prune", "--model", str(tmp_path / "orig"), "--out", str(out), "--ratio", "0.5",
                 "--attention-groups", "1", "--heal-steps", "2", "--num-calibration", "1", "--num-eval", "1",
                 "--window", "16"]) == 0
    report = json.loads((out / "report.json").read_text())
    original, pruned = report["rows"]
    assert pruned["parameters"] < original["parameters"] and pruned["decode_tok_s"] > 0
    loaded = load_model(str(out))
    assert (loaded.config.intermediate_size, loaded.config.num_kv_heads) == (80, 1)
    assert "pruned vs original" in capsys.readouterr().out


def test_distill_llm_every_other_layer(tmp_path):
    save_random_hf_model("qwen3", tmp_path / "teacher")  # 4 layers -> a 2-layer student
    out = tmp_path / "student"
    assert main(["distill", "--teacher", str(tmp_path / "teacher"), "--out", str(out), "--steps", "2",
                 "--num-eval", "1", "--window", "16"]) == 0
    assert load_model(str(out)).config.num_layers == 2


def test_prune_digits_writes_the_module_and_its_baseline(tmp_path):
    out = tmp_path / "digits"
    assert main(["prune", "--out", str(out), "--ratio", "0.5", "--finetune-epochs", "1"]) == 0
    report = json.loads((out / "report.json").read_text())
    assert report["rows"][1]["parameters"] < 0.3 * report["rows"][0]["parameters"]
    model = load_compressed(out)
    assert model(torch.zeros(2, 1, 8, 8)).shape == (2, 10)
    assert (out / "original_state_dict.pt").exists()


def test_bad_input_is_one_line(tmp_path, capsys):
    cases = [(["prune", "--ratio", "1.5"], "--ratio must be in [0, 1)"),
             (["prune", "--heal-steps", "3"], "--attention-groups and --heal-steps apply to LLMs"),
             (["prune", "--model", "nope"], "model 'nope' not found"),
             (["distill", "--alpha", "2"], "alpha must be in [0, 1]"),
             (["distill", "--steps", "-1"], "--steps must be >= 0")]
    for args, message in cases:
        assert main([*args, "--out", str(tmp_path / "x")]) == 1
        err = capsys.readouterr().err
        assert message in err and err.count("\n") == 1, err
    with pytest.raises(FivefoldError, match="not a digits directory"):
        load_compressed(tmp_path)
