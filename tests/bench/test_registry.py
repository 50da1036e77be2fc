import json

import pytest

from fivefold.bench.registry import RunRegistry
from fivefold.errors import FivefoldError


@pytest.fixture
def registry(tmp_path):
    reg = RunRegistry(tmp_path / "runs.db")
    yield reg
    reg.close()


def test_round_trip(registry, tmp_path):
    run_id = registry.record("bench serve", {"engine": {"block_size": 16}, "rate": 4.0}, {"tok_s": 150.0},
                             model_fingerprint="fp")
    run = registry.get(run_id)
    assert run.config == {"engine": {"block_size": 16}, "rate": 4.0} and run.metrics == {"tok_s": 150.0}
    assert run.model_fingerprint == "fp" and run.package_version and run.machine["cpus"] >= 1
    reopened = RunRegistry(tmp_path / "runs.db")
    assert [r.id for r in reopened.list()] == [run_id]
    reopened.close()
    with pytest.raises(FivefoldError, match="no run 99"):
        registry.get(99)


def test_compare_ratios_and_the_one_variable_warning(registry):
    a = registry.record("b", {"engine": {"block_size": 16, "prefix": True}, "rate": 4.0}, {"tok_s": 100.0, "ttft": 0.5})
    b = registry.record("b", {"engine": {"block_size": 32, "prefix": True}, "rate": 4.0}, {"tok_s": 150.0, "ttft": 0.4})
    c = registry.record("b", {"engine": {"block_size": 32, "prefix": False}, "rate": 8.0}, {"tok_s": 90.0, "ttft": 0.9})
    one = registry.compare(a, b)
    assert one.config_diff == {"engine.block_size": (16, 32)} and one.warning is None
    assert one.metric_ratios["tok_s"] == (100.0, 150.0, 1.5)
    many = registry.compare(a, c)
    assert many.num_changed_variables == 3
    assert "3 variables changed (engine.block_size, engine.prefix, rate)" in many.warning


def test_baseline_and_rollback_recreate_the_configuration(registry, tmp_path):
    config = {"engine": {"block_size": 16}, "rate": 4.0, "dataset": "pydoc"}
    a = registry.record("bench serve", config, {"tok_s": 100.0})
    assert registry.baseline("bench serve") is None
    registry.set_baseline(a)
    assert registry.baseline("bench serve").id == a
    recipe = json.loads(registry.rollback(a, tmp_path / "recipe.json").read_text())
    assert recipe["config"] == config and recipe["benchmark"] == "bench serve" and recipe["from_run"] == a


def test_runs_cli(tmp_path):
    import subprocess
    import sys

    db = str(tmp_path / "runs.db")
    reg = RunRegistry(db)
    a = reg.record("bench serve", {"rate": 1.0, "dataset": "pydoc"}, {"tok_s": 50.0})
    b = reg.record("bench serve", {"rate": 4.0, "dataset": "random"}, {"tok_s": 150.0})
    reg.close()

    def cli(*args):
        return subprocess.run([sys.executable, "-m", "fivefold", "runs", "--registry", db, *args],
                              capture_output=True, text=True, timeout=60, cwd=tmp_path)

    listing = cli("list")
    assert listing.returncode == 0 and "bench serve" in listing.stdout and listing.stdout.count("\n") == 2
    compared = cli("compare", str(a), str(b))
    assert "3.000x" in compared.stdout and "2 variables changed" in compared.stdout
    assert cli("baseline", "set", str(a)).returncode == 0
    assert f"bench serve: run {a}" in cli("baseline").stdout
    assert cli("rollback", str(b), "--out", "r.json").returncode == 0
    assert json.loads((tmp_path / "r.json").read_text())["config"] == {"rate": 4.0, "dataset": "random"}
    missing = cli("show", "42")
    assert missing.returncode == 1 and missing.stderr.strip().startswith("error: no run 42")


def test_a_sub_config_of_another_kind_is_one_variable():
    """W8A16 -> W4A16 replaces the quantization sub-config (its scheme differs): one variable; a
    field changed within one scheme is still counted field by field."""
    from fivefold.bench.registry import config_diff

    w8 = {"quantization": {"scheme": "w8a16", "weight_granularity": "per-channel"}, "dtype": "float32"}
    w4 = {"quantization": {"scheme": "w4a16", "group_size": 64, "method": "awq"}, "dtype": "float32"}
    assert list(config_diff(w8, w4)) == ["quantization"]
    w4_g128 = {"quantization": {**w4["quantization"], "group_size": 128}, "dtype": "bfloat16"}
    assert set(config_diff(w4, w4_g128)) == {"quantization.group_size", "dtype"}
