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
    dense = LLM(load_model(str(tmp_path)), weight_layout="dense", decode_attention="torch", kv_cache_memory=8 << 20)
    assert not any(isinstance(m, PackedLinear) for m in dense.engine.runner.model.modules())
    assert dense.engine.runner.use_decode_kernel is False
    packed = LLM(load_model(str(tmp_path)), kv_cache_memory=8 << 20)
    assert any(isinstance(m, PackedLinear) for m in packed.engine.runner.model.modules())
