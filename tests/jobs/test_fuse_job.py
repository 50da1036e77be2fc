"""fivefold fuse: the directory it writes loads back and equals eager; bad input is one line."""

import json

import pytest
import torch

from fivefold.cli import main
from fivefold.errors import FivefoldError
from fivefold.jobs.fuse import build_fusable, load_fused


def test_fuse_cnn_writes_a_loadable_directory(tmp_path, capsys):
    out = tmp_path / "fused"
    assert main(["fuse", "--model", "mobilenet_v2", "--out", str(out), "--batch-sizes", "1,2",
                 "--image-size", "64"]) == 0
    report = json.loads((out / "report.json").read_text())
    assert [r["batch"] for r in report["latency"]] == [1, 2]
    assert all(r["max_abs_diff"] < 1e-5 for r in report["latency"])
    assert report["counts"]["num_folded_batchnorms"] == 52
    assert "contiguous(memory_format = torch.channels_last)" in (out / "graph.py").read_text()
    model, inputs = build_fusable("mobilenet_v2", 64)
    x = inputs(3)
    with torch.inference_mode():
        torch.testing.assert_close(load_fused(out)(*x), model(*x), atol=1e-5, rtol=1e-5)
    assert "eager vs fused latency" in capsys.readouterr().out


def test_fuse_encoder_merges_qkv(tmp_path):
    out = tmp_path / "enc"
    assert main(["fuse", "--model", "all-minilm-l6-v2", "--out", str(out), "--batch-sizes", "2",
                 "--seq-len", "16"]) == 0
    report = json.loads((out / "report.json").read_text())
    assert report["counts"]["num_merged_linear_groups"] == 6
    assert report["counts"]["num_fused_activations"] == 6
    assert report["latency"][0]["max_abs_diff"] < 1e-5


def test_fuse_bad_input_is_one_line(tmp_path, capsys):
    cases = [(["--model", "smollm2-135m-instruct"], "LLMs are fused by the engine"),
             (["--model", "nope"], "unknown model 'nope'"),
             (["--batch-sizes", "1,x"], "--batch-sizes must be comma-separated integers"),
             (["--batch-sizes", "0"], "batch sizes must be >= 1"),
             (["--image-size", "8"], "image size must be in [32, 1024]")]
    for args, message in cases:
        assert main(["fuse", "--out", str(tmp_path / "x"), *args]) == 1
        err = capsys.readouterr().err
        assert message in err and err.count("\n") == 1, err
    with pytest.raises(FivefoldError, match="not a directory written by 'fivefold fuse'"):
        load_fused(tmp_path)
