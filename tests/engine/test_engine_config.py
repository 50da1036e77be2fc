import pytest

from fivefold.engine.config import EngineConfig
from fivefold.errors import FivefoldError


@pytest.mark.parametrize("options, message", [
    ({"block_size": 3}, "block_size must be a power of two"),
    ({"max_num_seqs": 0}, "max_num_seqs must be >= 1"),
    ({"preallocation": "all"}, "preallocation must be one of none, full, predicted"),
    ({"weight_layout": "blocked"}, "weight_layout must be one of packed, dense"),
    ({"decode_attention": "flash"}, "decode_attention must be one of kernel, torch"),
])
def test_bad_options_name_the_option_and_the_choices(options, message):
    with pytest.raises(FivefoldError, match=message):
        EngineConfig(**options)


def test_dense_layout_and_torch_decode_really_switch_the_path(tmp_path):
    from fivefold.llm import LLM
    from fivefold.models import load_model
    from fivefold.models.layers import PackedLinear
    from tests.conftest import save_random_hf_model

    save_random_hf_model("llama", tmp_path)
    dense = LLM(load_model(str(tmp_path)), weight_layout="dense", decode_attention="torch", kv_cache_memory_bytes=8 << 20)
    assert not any(isinstance(m, PackedLinear) for m in dense.engine.runner.model.modules())
    assert dense.engine.runner.use_decode_kernel is False
    packed = LLM(load_model(str(tmp_path)), kv_cache_memory_bytes=8 << 20)
    assert any(isinstance(m, PackedLinear) for m in packed.engine.runner.model.modules())


@pytest.mark.parametrize("options, message", [
    ({"kv_cache_memory_bytes": 0}, "kv_cache_memory_bytes must be a whole number of bytes >= 1, got 0"),
    ({"kv_cache_memory_bytes": 1.5}, "kv_cache_memory_bytes must be a whole number of bytes >= 1"),
    ({"kv_cache_memory_fraction": 0.0}, r"kv_cache_memory_fraction must be in \(0, 1\], got 0.0"),
    ({"kv_cache_memory_fraction": 1.5}, r"kv_cache_memory_fraction must be in \(0, 1\]"),
    ({"kv_cache_memory_bytes": 1 << 20, "kv_cache_memory_fraction": 0.1}, "not both"),
])
def test_kv_cache_memory_is_bytes_or_a_fraction(options, message):
    with pytest.raises(FivefoldError, match=message):
        EngineConfig(**options)


def test_kv_cache_size_and_the_old_spelling():
    from fivefold.engine.config import available_memory_bytes

    assert EngineConfig().kv_cache_bytes() == 1 << 30
    assert EngineConfig(kv_cache_memory_bytes=float(64 << 20)).kv_cache_bytes() == 64 << 20
    fraction = EngineConfig(kv_cache_memory_fraction=0.01).kv_cache_bytes()
    assert abs(fraction - 0.01 * available_memory_bytes()) < 0.001 * available_memory_bytes()
    with pytest.raises(FivefoldError, match="kv_cache_memory was split in two: kv_cache_memory_bytes .* or "
                                            "kv_cache_memory_fraction"):
        EngineConfig.from_options(kv_cache_memory=1 << 20)
    with pytest.raises(FivefoldError, match=r"unknown engine option\(s\) \['kv_pool'\]"):
        EngineConfig.from_options(kv_pool=3)


def test_the_cli_refuses_the_old_flag_in_one_line():
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-m", "fivefold", "generate", "--prompt", "hi", "--kv-cache-memory", "1e6"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode != 0 and "Traceback" not in out.stderr
    assert "--kv-cache-memory was split in two: --kv-cache-memory-bytes B or --kv-cache-memory-fraction F" in out.stderr


def test_runners_never_change_a_shared_model(tmp_path):
    """A packed engine, then a dense one and an eager one, on one loaded model: each runs the layout
    it asked for, the loaded model keeps its dense nn.Linear projections, and all agree."""
    from torch import nn

    from fivefold.llm import LLM
    from fivefold.models import load_model
    from fivefold.models.layers import FusableOp, PackedLinear
    from fivefold.sampling_params import SamplingParams
    from tests.conftest import save_random_hf_model

    save_random_hf_model("llama", tmp_path)
    loaded = load_model(str(tmp_path))
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    packed = LLM(loaded, kv_cache_memory_bytes=8 << 20)
    dense = LLM(loaded, weight_layout="dense", hot_path="eager", kv_cache_memory_bytes=8 << 20)
    again = LLM(loaded, kv_cache_memory_bytes=8 << 20)
    assert not any(isinstance(m, PackedLinear) for m in loaded.model.modules())
    assert isinstance(loaded.model.layers[0].mlp.down_proj, nn.Linear)
    assert not any(isinstance(m, PackedLinear) for m in dense.engine.runner.model.modules())
    assert all(not m.use_fused for m in dense.engine.runner.model.modules() if isinstance(m, FusableOp))
    assert all(m.use_fused for m in packed.engine.runner.model.modules() if isinstance(m, FusableOp))
    # the packed copies are made once per weight and shared
    assert again.engine.runner.model.layers[0].mlp.down_proj is packed.engine.runner.model.layers[0].mlp.down_proj
    prompt = [[5, 6, 7, 8, 9]]
    outs = [llm.generate(prompt, params)[0].outputs[0].token_ids for llm in (packed, dense, again)]
    assert outs[0] == outs[1] == outs[2]
