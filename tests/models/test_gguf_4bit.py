"""GGUF 4-bit files served as they are (``quantization="gguf"``) and 4-bit quantization on load
(``quantization="w4a16"``, ``"w4a8"``): Q4_0/Q4_1 blocks become the int4 kernel's codes and scales
without passing through float, dequantize to exactly what gguf computes, and the model computes
what the dequantized model computes, layer by layer and end to end; the built-in Q4_1 model
included. A GGUF's blocks run against int8 activations (as llama.cpp): checked against the
dequantized model whose linears see their inputs quantized and dequantized per block of 32
(:func:`int8_inputs`), and, with float activations, against the dequantized model itself."""

from __future__ import annotations

import warnings
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from torch import nn

from fivefold.errors import ModelLoadError
from fivefold.models import load_model
from fivefold.models.assemble import ServedForm, assemble
from fivefold.models.forward import prefill_logits
from fivefold.models.gguf_file import gguf_config, gguf_tensors, open_gguf
from fivefold.models.int4_linear import Int4Linear, Int4Quantized, dequantize_activations, quantize_activations
from fivefold.models import int4_linear
from fivefold.models.layers import ROW_TILES_MAX_ROWS
from fivefold.models.int8_linear import Int8Linear, dense_weight
from fivefold.models.layers import HeadRowsEmbedding, SplitLinear, resident_weight_bytes
from fivefold.models.registry import BUILTIN_MODELS, DEFAULT_LLM
from tests.conftest import save_random_hf_model
from tests.models.test_gguf import HEADS, HIDDEN, INTER, write_tiny_gguf

PROJECTIONS = ("blk.0.attn_q.weight", "blk.0.attn_k.weight", "blk.0.attn_v.weight", "blk.0.attn_output.weight",
               "blk.0.ffn_gate.weight", "blk.0.ffn_up.weight", "blk.0.ffn_down.weight", "token_embd.weight")
IDS = [3, 17, 5, 40, 22, 9, 31, 1, 60, 12, 7, 2]


def fake_int8(x: torch.Tensor) -> torch.Tensor:
    """x's rows as the W4A8 kernel sees them: quantized per block of 32 and dequantized."""
    x2 = x.reshape(-1, x.shape[-1]).float()
    return dequantize_activations(*quantize_activations(x2)).reshape(x.shape).to(x.dtype)


class int8_inputs:
    """Within the block, the named linears of ``model`` see their inputs as :func:`fake_int8` makes
    them: the dequantized model computing what W4A8 computes."""

    def __init__(self, model: nn.Module, names) -> None:
        self.modules = [model.get_submodule(n) for n in names]

    def __enter__(self):
        self.hooks = [m.register_forward_pre_hook(lambda _m, args: (fake_int8(args[0]), *args[1:]))
                      for m in self.modules]

    def __exit__(self, *exc):
        for h in self.hooks:
            h.remove()


def int8_input_layers(model: nn.Module) -> list[str]:
    """The layers of ``model`` that quantize their inputs to int8 (4-bit ones, a GGUF's Q8_0 ones;
    a split projection's blocks named by the projection, as an unsplit model holds it)."""
    return list(dict.fromkeys(n.partition(".parts.")[0] for n, m in model.named_modules()
                              if isinstance(m, (Int4Linear, Int8Linear)) and m.int8_activations))


def set_activations(model: nn.Module, activations: str) -> None:
    """Every 4-bit layer and every W8A16 one (a GGUF's Q8_0 tensors) of ``model``."""
    for m in model.modules():
        if isinstance(m, Int4Linear) or (isinstance(m, Int8Linear) and m.scheme == "w8a16"):
            m.set_activations_(activations)


@pytest.mark.parametrize("qtype", ["Q4_0", "Q4_1"])
def test_q4_blocks_are_kept_as_codes_that_dequantize_exactly(qtype, tmp_path):
    import gguf

    write_tiny_gguf(tmp_path / "m.gguf", {"blk.0.ffn_down.weight": qtype, "blk.0.attn_q.weight": qtype})
    reader = open_gguf(tmp_path / "m.gguf")
    config = gguf_config(reader, tmp_path / "m.gguf")
    tensors = dict(gguf_tensors(reader, config, keep_4bit=True))
    down = tensors["model.layers.0.mlp.down_proj.weight"]
    assert isinstance(down, Int4Quantized) and down.group_size == 32 and down.q.dtype == torch.uint8
    assert down.scale.dtype == torch.float16 and down.scale.shape == (HIDDEN, INTER // 32)
    assert (down.offset is None) == (qtype == "Q4_0")
    raw = {t.name: t for t in reader.tensors}
    want = gguf.quants.dequantize(raw["blk.0.ffn_down.weight"].data, raw["blk.0.ffn_down.weight"].tensor_type)
    assert np.array_equal(down.dequantize().numpy(), want.reshape(HIDDEN, INTER))
    # q's rows, their scales and offsets move together through llama.cpp's RoPE un-permutation
    q = tensors["model.layers.0.self_attn.q_proj.weight"].dequantize()
    head_rows = HIDDEN // HEADS
    repermuted = q.reshape(HEADS, 2, head_rows // 2, HIDDEN).transpose(1, 2).reshape(HIDDEN, HIDDEN)
    want_q = gguf.quants.dequantize(raw["blk.0.attn_q.weight"].data, raw["blk.0.attn_q.weight"].tensor_type)
    assert np.array_equal(repermuted.numpy(), want_q.reshape(HIDDEN, HIDDEN))
    # without keep_4bit (the default) the same blocks are dequantized to float32, with a note
    with pytest.warns(UserWarning, match="--quantization gguf serves Q4_0/Q4_1/Q4_K in 4-bit"):
        floats = dict(gguf_tensors(reader, config))
    assert floats["model.layers.0.mlp.down_proj.weight"].dtype == torch.float32


@pytest.mark.parametrize("qtype", ["Q4_0", "Q4_1"])
def test_4bit_gguf_model_computes_what_its_dequantized_model_computes(qtype, tmp_path, monkeypatch):
    path = tmp_path / "m.gguf"
    write_tiny_gguf(path, dict.fromkeys(PROJECTIONS, qtype))
    reader = open_gguf(path)
    config = gguf_config(reader, path)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        reference = SimpleNamespace(model=assemble(config, gguf_tensors(reader, config, path), ServedForm()))
    served = SimpleNamespace(model=assemble(config, gguf_tensors(reader, config, path, keep_4bit=True),
                                            ServedForm(quantization="gguf")))
    int4 = {n: m for n, m in served.model.named_modules() if isinstance(m, Int4Linear)}
    assert set(int4) == {"layers.0.self_attn.qkv_proj", "layers.0.self_attn.o_proj", "layers.0.mlp.gate_up_proj",
                         "layers.0.mlp.down_proj", "lm_head"}  # the tied head in the embedding's blocks
    assert all(m.int8_activations for m in int4.values())  # llama.cpp's way: Q4 blocks times Q8 activations
    for name, module in int4.items():
        dense = reference.model.get_submodule(name)
        assert torch.equal(module.dequantized_weight(), dense.weight.float()), name
        for rows in (1, 3, 8, 65, 1100):
            x = torch.randn(rows, module.in_features, generator=torch.Generator().manual_seed(rows))
            with torch.inference_mode():
                for activations, xin in (("int8", fake_int8(x)), ("float", x)):
                    module.set_activations_(activations)
                    want = nn.functional.linear(xin.double(), dense.weight.double()).float()
                    torch.testing.assert_close(module(x), want, rtol=1e-4, atol=1e-4 * float(want.abs().max()))
                    if rows > ROW_TILES_MAX_ROWS:  # the dequantized tiles (builds without panels; forced)
                        with monkeypatch.context() as m:
                            m.setattr(int4_linear, "quantized_kernel_max_rows", lambda bits: ROW_TILES_MAX_ROWS)
                            torch.testing.assert_close(module(x), want, rtol=1e-4,
                                                       atol=1e-4 * float(want.abs().max()))
        module.set_activations_("int8")
    with torch.inference_mode():
        with int8_inputs(reference.model, int8_input_layers(served.model)):
            ours, ref = prefill_logits(served.model, IDS), prefill_logits(reference.model, IDS)
        # per layer the bytes agree; through the layers float rounding can put an activation on the
        # other side of a rounding boundary, moving its code by one (a step of amax / 127)
        torch.testing.assert_close(ours, ref, rtol=1e-2, atol=1e-2 * float(ref.abs().max()))
        set_activations(served.model, "float")
        ours, ref = prefill_logits(served.model, IDS), prefill_logits(reference.model, IDS)
    torch.testing.assert_close(ours, ref, rtol=1e-4, atol=1e-4 * float(ref.abs().max()))
    # 4-bit codes and float16 scales: well under a third of the float32 model's bytes
    assert resident_weight_bytes(served.model) < resident_weight_bytes(reference.model) / 3


def _reference_and_served(path):
    """(reader, config, the file dequantized to float (Q8_0/Q6_K kept int8), the file served as
    stored with --quantization gguf)."""
    reader = open_gguf(path)
    config = gguf_config(reader, path)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        reference = assemble(config, gguf_tensors(reader, config, path), ServedForm())
    served = assemble(config, gguf_tensors(reader, config, path, keep_4bit=True), ServedForm(quantization="gguf"))
    return reader, config, reference, served


def test_q4_k_blocks_become_int4_groups_of_32_within_float16_rounding(tmp_path):
    """Q4_K super-blocks (--quantization gguf): each sub-block of 32 becomes a group of the int4
    kernel with the file's codes, its scale d sc_j and minimum dmin m_j multiplied out and rounded to
    float16: within that rounding of what gguf dequantizes, rows and groups in place (the q rows
    through llama.cpp's RoPE un-permutation too)."""
    import gguf

    write_tiny_gguf(tmp_path / "m.gguf", {"blk.0.ffn_down.weight": "Q4_K", "blk.0.attn_q.weight": "Q4_K"})
    reader = open_gguf(tmp_path / "m.gguf")
    config = gguf_config(reader, tmp_path / "m.gguf")
    tensors = dict(gguf_tensors(reader, config, keep_4bit=True))
    raw = {t.name: t for t in reader.tensors}
    for name, gguf_name, rows in (("model.layers.0.mlp.down_proj.weight", "blk.0.ffn_down.weight", None),
                                  ("model.layers.0.self_attn.q_proj.weight", "blk.0.attn_q.weight", HEADS)):
        read = tensors[name]
        assert isinstance(read, Int4Quantized) and read.group_size == 32 and read.offset is not None
        ours = read.dequantize()
        if rows is not None:  # back to the file's row order
            ours = ours.reshape(rows, 2, HIDDEN // rows // 2, -1).transpose(1, 2).reshape(ours.shape)
        want = torch.from_numpy(gguf.quants.dequantize(raw[gguf_name].data, raw[gguf_name].tensor_type)).reshape(ours.shape)
        # |error| <= 15 |d sc| 2^-11 + |dmin m| 2^-11 per weight; d, dmin < 0.02 and sc, m < 64 here
        assert float((ours - want).abs().max()) <= 16 * 0.02 * 64 * 2 ** -11
        q = read.q.reshape(-1, 32).float()
        assert torch.equal(read.q, read.q.clamp(0, 15))
        assert q.std() > 3  # the codes are the file's nibbles, not a constant


def test_q4_k_m_file_served_as_it_is(tmp_path):
    """A Q4_K_M-like file (Q4_K projections, Q6_K ffn_down and attn_v, a Q6_K tied table) with
    --quantization gguf: Q4_K layers run the int4 kernel, Q6_K layers the int8 kernel with a float16
    scale per 16, both against int8 activations (as llama.cpp); each layer computes what its
    dequantized weight computes (Q4_K: the file's exact weights, its two scale levels held as they
    are), the logits agree with the dequantized model's, and the weights are held at 4.625 bits
    (Q4_K: codes, sc and m a byte per 32, d and dmin per 256) and 7 (Q6_K: its 6-bit codes as q6_pack
    holds them and a float16 scale per 16, in the kernel's tile order), not in float."""
    path = tmp_path / "m.gguf"
    write_tiny_gguf(path, {**dict.fromkeys(PROJECTIONS, "Q4_K"), "blk.0.ffn_down.weight": "Q6_K",
                           "blk.0.attn_v.weight": "Q6_K", "token_embd.weight": "Q6_K"})
    reader, config, reference, served = _reference_and_served(path)
    kinds = {n: type(m).__name__ for n, m in served.named_modules() if isinstance(m, (Int4Linear, Int8Linear))}
    # v is Q6_K beside q and k (Q4_K): the projection is held in two row blocks, each in its own form
    qkv = served.layers[0].self_attn.qkv_proj
    assert isinstance(qkv, SplitLinear) and [p.out_features for p in qkv.parts] == [HIDDEN + HIDDEN // 2, HIDDEN // 2]
    assert kinds["layers.0.self_attn.qkv_proj.parts.0"] == "Int4Linear"
    assert kinds["layers.0.self_attn.qkv_proj.parts.1"] == "Int8Linear"
    assert kinds["layers.0.self_attn.o_proj"] == "Int4Linear"
    assert kinds["layers.0.mlp.down_proj"] == "Int8Linear" and kinds["layers.0.mlp.gate_up_proj"] == "Int4Linear"
    assert kinds["lm_head"] == "Int8Linear" and isinstance(served.embed_tokens, HeadRowsEmbedding)
    for name, module in served.named_modules():
        if isinstance(module, Int8Linear):
            assert module.group_size == 16 and module.int8_activations and module._prepare()["six"], name
        elif isinstance(module, Int4Linear):
            assert module.int8_activations and module.kernel_tensors()[1].dtype == torch.uint8, name
        else:
            continue
        dense = (module.dequantized_weight() if isinstance(module, Int4Linear)
                 else module.rows(torch.arange(module.out_features)))
        owner, _, block = name.partition(".parts.")  # a block of the split qkv: its rows of the reference's
        ref_module = reference.get_submodule(owner)  # float, or Q6_K kept int8 (always)
        ref_dense = (ref_module.rows(torch.arange(ref_module.out_features)) if isinstance(ref_module, Int8Linear)
                     else dense_weight(ref_module))
        if block:
            start = sum(p.out_features for p in qkv.parts[:int(block)])
            ref_dense = ref_dense[start:start + module.out_features]
        error = (dense - ref_dense).abs()
        float16_bound = 16 * 0.02 * 64 * 2 ** -11  # Q4_K's two scale levels multiplied into float16
        relative = ref_dense.abs() * 2 ** -11  # Q6_K's d x sc rounded to float16
        if isinstance(module, Int8Linear):  # Q6_K as stored (v's rows of qkv too)
            assert bool((error <= relative).all()), name
        else:  # Q4_K
            assert float(error.max()) <= float16_bound, name
        for rows in (1, 5, 70):
            x = torch.randn(rows, module.in_features, generator=torch.Generator().manual_seed(rows))
            xin = fake_int8(x) if module.int8_activations else x
            exact = ref_dense if isinstance(module, Int4Linear) else dense  # Q4_K's levels: the file's weights
            with torch.inference_mode():
                want = nn.functional.linear(xin.double(), exact.double()).float()
                torch.testing.assert_close(module(x), want, rtol=1e-4, atol=1e-4 * float(want.abs().max()))
    with torch.inference_mode(), int8_inputs(reference, int8_input_layers(served)):
        ours, ref = prefill_logits(served, IDS), prefill_logits(reference, IDS)
    torch.testing.assert_close(ours, ref, rtol=2e-2, atol=2e-2 * float(ref.abs().max()))
    # held at 4.625 bits per weight (Q4_K, q and k included: codes, sc and m per 32, d and dmin per 256)
    # and 7 (Q6_K: 6-bit codes, a float16 scale per 16), plus the float norms: nothing in float beside them
    for m in served.modules():
        if isinstance(m, (Int4Linear, Int8Linear)):  # (an int8 layer's three activation-quantization scalars: 16 bytes)
            held = m.in_features * m.out_features * (4.625 / 8 if isinstance(m, Int4Linear) else 7 / 8)
            assert resident_weight_bytes(m) - held in (0, 16), m
    assert isinstance(served.embed_tokens, HeadRowsEmbedding) and resident_weight_bytes(served.embed_tokens) == 0
    # the memory plan's bits per layer weight: the file's mix as served; without keep_4bit, float
    from fivefold.models.gguf_file import gguf_served_bits
    from fivefold.models.native_decode import NativeDecoder

    layer = {t.name: int(t.n_elements) for t in reader.tensors if t.name.startswith("blk.") and len(t.shape) == 2}
    six = layer["blk.0.ffn_down.weight"] + layer["blk.0.attn_v.weight"]
    assert gguf_served_bits(reader, True) == pytest.approx((7 * six + 4.625 * (sum(layer.values()) - six)) / sum(layer.values()))
    assert gguf_served_bits(reader, False) is None
    assert NativeDecoder.unsupported_reason(served) is None  # the C++ decode loop runs the mix


def test_six_bit_hold_follows_the_activations_and_keeps_the_weights():
    """An Int8Linear in groups of 16 with codes in [-32, 31] (Q6_K) holds them at 6 bits only while it
    takes int8 activations (the float-activation kernels read int8 bytes): switching back and forth
    re-holds them, and the weight, its rows, the state dict and the results stay those of the int8
    form. A code outside 6 bits keeps the layer int8."""
    from fivefold.models.int8_linear import Int8Format

    gen = torch.Generator().manual_seed(16)
    fmt = Int8Format(scheme="w8a16", weight_granularity="per-group", group_size=16)
    for lo, hi, six in ((-32, 32, True), (-33, 32, False)):
        module = Int8Linear(256, 36, True, fmt)
        q = torch.randint(lo, hi, (36, 256), dtype=torch.int8, generator=gen)
        q[5, 7] = lo
        scale = (torch.rand(36, 16, generator=gen) / 50).half().float()
        module.weight, module.weight_scale, module.bias = q.clone(), scale.clone(), torch.randn(36, generator=gen)
        x = torch.randn(9, 256, generator=gen)
        dense = q.float() * scale.repeat_interleave(16, dim=1)
        with torch.inference_mode():
            float_out = module.pack_()(x)  # float activations: the int8 form
            assert not module._prepare()["six"]
            module.set_activations_("int8")
            assert module._prepare()["six"] is six
            int8_out = module(x)
            want = fake_int8(x).double() @ dense.double().t() + module.bias.double()
            torch.testing.assert_close(int8_out.double(), want, rtol=1e-5, atol=1e-4)
            assert torch.equal(module.int8_weight(), q)
            assert torch.equal(module.rows(torch.tensor([0, 5, 35, 5])), dense[[0, 5, 35, 5]])
            state = module.state_dict()
            assert torch.equal(state["weight"], q) and torch.equal(state["weight_scale"], scale)
            module.set_activations_("float")
            assert not module._prepare()["six"]
            assert torch.equal(module(x), float_out)
            module.set_activations_("int8")
            assert module._prepare()["six"] is six and torch.equal(module(x), int8_out)


def test_q4_k_levels_follow_the_activations_and_keep_the_weights():
    """An Int4Linear from Q4_K (two scale levels) reads the levels as stored only while it takes int8
    activations, a float16 scale and minimum per 32 (d sc_j rounded once) while it takes float ones:
    switching back and forth re-holds them, the results follow, and the weight, its rows and the
    state dict stay the one-level form's. A shape the levels do not fit (out_features not a multiple
    of 4) keeps the float16 form."""
    from fivefold.models.int4_linear import Int4Levels, dequantize_int4

    gen = torch.Generator().manual_seed(17)
    for n, fits in ((36, True), (38, False)):
        k = 512
        q = torch.randint(0, 16, (n, k), dtype=torch.uint8, generator=gen)
        levels = Int4Levels(torch.randint(0, 64, (n, 16), dtype=torch.uint8, generator=gen),
                            torch.randint(0, 64, (n, 16), dtype=torch.uint8, generator=gen),
                            (torch.rand(n, 2, generator=gen) / 500).half(), (torch.rand(n, 2, generator=gen) / 500).half())
        quantized = Int4Quantized(q, levels.scale(), levels.offset(), 32, levels)
        module = Int4Linear.from_quantized(quantized, torch.randn(n, generator=gen), activations="int8")
        x = torch.randn(9, k, generator=gen)
        one_level = dequantize_int4(q, levels.scale(), levels.offset(), 32)
        exact = (q.double() * (levels.d.double().repeat_interleave(8, 1) * levels.sc.double()).repeat_interleave(32, 1)
                 - (levels.dmin.double().repeat_interleave(8, 1) * levels.m.double()).repeat_interleave(32, 1))
        held = lambda: module.kernel_tensors()[1].dtype == torch.uint8  # noqa: E731
        with torch.inference_mode():
            assert held() is fits
            int8_out = module(x)
            weights = exact if fits else one_level.double()
            want = fake_int8(x).double() @ weights.t() + module.bias.double()
            torch.testing.assert_close(int8_out.double(), want, rtol=1e-5, atol=1e-4)
            assert torch.equal(module.dequantized_weight(), one_level)
            assert torch.equal(module.rows(torch.tensor([0, 5, n - 1, 5])), one_level[[0, 5, n - 1, 5]])
            state = module.state_dict()
            assert torch.equal(state["scale"], levels.scale()) and torch.equal(state["offset"], levels.offset())
            module.set_activations_("float")
            assert not held()
            float_out = module(x)
            torch.testing.assert_close(float_out.double(), x.double() @ one_level.double().t() + module.bias.double(),
                                       rtol=1e-5, atol=1e-4)
            module.set_activations_("int8")
            assert held() is fits and torch.equal(module(x), int8_out)


def test_q8_0_served_as_stored_multiplies_int8_activations(tmp_path):
    """``--quantization gguf``: Q8_0 projections (and a Q8_0 head) take int8 activations as llama.cpp
    does, layer by layer what the dequantized model computes on int8-rounded inputs; without the
    flag they keep float activations (W8A16). The C++ decode loop runs them like the Python loop."""
    path = tmp_path / "m.gguf"
    write_tiny_gguf(path, {**dict.fromkeys(PROJECTIONS, "Q8_0"), "blk.0.ffn_down.weight": "Q4_0"})
    reader = open_gguf(path)
    config = gguf_config(reader, path)
    reference = assemble(config, gguf_tensors(reader, config, path), ServedForm())
    served = assemble(config, gguf_tensors(reader, config, path, keep_4bit=True), ServedForm(quantization="gguf"))
    int8 = {n: m for n, m in served.named_modules() if isinstance(m, Int8Linear)}
    assert set(int8) >= {"layers.0.self_attn.qkv_proj", "lm_head"} and all(m.int8_activations for m in int8.values())
    assert not any(m.int8_activations for m in reference.modules() if isinstance(m, Int8Linear))
    for name, module in int8.items():
        dense = module.rows(torch.arange(module.out_features))  # the dequantized Q8_0 weight
        for rows in (1, 5, 70):
            x = torch.randn(rows, module.in_features, generator=torch.Generator().manual_seed(rows))
            with torch.inference_mode():
                want = nn.functional.linear(fake_int8(x).double(), dense.double()).float()
                torch.testing.assert_close(module(x), want, rtol=1e-4, atol=1e-4 * float(want.abs().max()))
    from fivefold.models.native_decode import NativeDecoder

    assert NativeDecoder.unsupported_reason(served) is None


@pytest.mark.parametrize("table", ["Q4_0", "Q4_1", "Q8_0"])
def test_tied_table_is_held_once_and_looked_up_in_the_heads_blocks(table, tmp_path):
    """A GGUF served as stored with a quantized, tied token table: the LM head holds the blocks and
    the embedding reads each token's row from them (no float copy), exactly the dequantized table's
    values, for ids in any tile of the kernels' layouts; the engine's bytes drop by the float table."""
    path = tmp_path / "m.gguf"
    write_tiny_gguf(path, {**dict.fromkeys(PROJECTIONS, "Q4_0"), "token_embd.weight": table})
    _, config, reference, served = _reference_and_served(path)
    embed = served.embed_tokens
    assert isinstance(embed, HeadRowsEmbedding) and served.dtype == torch.float32
    assert isinstance(served.lm_head, Int4Linear if table != "Q8_0" else Int8Linear)
    ids = torch.tensor([[0, 1, 2, 3, 4, 5], [config.vocab_size - 1, config.vocab_size - 2, 7, 7, 0, 13]])
    with torch.inference_mode():
        assert torch.equal(embed(ids), reference.embed_tokens(ids))
        assert torch.equal(embed.weight, reference.embed_tokens.weight)
    assert "embed_tokens.weight" in served.state_dict()  # a checkpoint still holds the table
    with pytest.raises(IndexError, match="out of range"):
        embed(torch.tensor([config.vocab_size]))
    assert resident_weight_bytes(embed) == 0 and resident_weight_bytes(served.lm_head) > 0


def test_builtin_q4_1_model_served_as_it_is():
    """SmolLM2's Q4_1 file in 4-bit: every projection holds exactly the file's weights (its float
    model is those blocks dequantized), each layer and the logits agree with the float model within
    float rounding (with int8 activations: with the float model whose linears see int8-rounded
    inputs), and greedy decoding picks the same tokens."""
    path = str(BUILTIN_MODELS[DEFAULT_LLM].path())
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        reference = load_model(path)
    served = load_model(path, quantization="gguf")
    int4 = {n: m for n, m in served.model.named_modules() if isinstance(m, Int4Linear)}
    assert len(int4) >= 4 * served.config.num_layers
    gen = torch.Generator().manual_seed(0)
    for name, module in int4.items():
        dense = reference.model.get_submodule(name)
        weight = dense.unpacked_weight() if hasattr(dense, "unpacked_weight") else dense.weight
        assert torch.equal(module.dequantized_weight(), weight.float()), name
        if not (name.startswith(("layers.0.", f"layers.{served.config.num_layers - 1}.")) or name == "lm_head"):
            continue  # each layer's output: the first and last layers' projections and the head
        x = torch.randn(2, module.in_features, generator=gen)
        with torch.inference_mode():
            for activations, xin in (("int8", fake_int8(x)), ("float", x)):
                module.set_activations_(activations)
                want = nn.functional.linear(xin.double(), weight.double()).float()
                torch.testing.assert_close(module(x), want, rtol=1e-4, atol=1e-4 * float(want.abs().max()))
        module.set_activations_("int8")
    ids = served.tokenizer.encode("The quick brown fox jumps over the lazy dog. Python is")
    with torch.inference_mode():
        with int8_inputs(reference.model, int8_input_layers(served.model)):
            ours, ref = prefill_logits(served.model, ids), prefill_logits(reference.model, ids)
        # through 30 layers the rounding boundaries of the last test compound (SmolLM2's outlier
        # channels make a code step large), so the order of the kernel's float sums moves one
        # position more than the rest: close in direction, the same next token nearly always.
        # Measured (the panel paths, 12 rows): median cosine 0.9998 on both ISAs; the worst
        # position (the 4th) 0.990 on AVX-512 VNNI, 0.978 on AVX2; argmax 10 and 12 of 12.
        cosine = nn.functional.cosine_similarity(ours, ref, dim=-1)
        assert float(cosine.median()) > 0.999 and float(cosine.min()) > 0.96
        assert float((ours.argmax(-1) == ref.argmax(-1)).float().mean()) >= 0.75
        set_activations(served.model, "float")
        ours, ref = prefill_logits(served.model, ids), prefill_logits(reference.model, ids)
    torch.testing.assert_close(ours, ref, rtol=1e-3, atol=1e-3 * float(ref.abs().max()))
    assert torch.equal(ours.argmax(-1), ref.argmax(-1))
    assert resident_weight_bytes(served.model) < resident_weight_bytes(reference.model) / 2.5


@pytest.mark.parametrize("arch", ["llama", "qwen2"])  # an untied head; a tied one with q/k/v biases
def test_w4a16_on_load_quantizes_projections_keeps_the_head_8bit(arch, tmp_path):
    save_random_hf_model(arch, tmp_path / "hf")
    float_model = load_model(str(tmp_path / "hf"))
    served = load_model(str(tmp_path / "hf"), quantization="w4a16")
    int4 = [m for m in served.model.modules() if isinstance(m, Int4Linear)]
    assert len(int4) == 4 * served.config.num_layers and all(m.format.group_size == 128 for m in int4)
    assert isinstance(served.model.lm_head, Int8Linear)
    assert served.quantization["scheme"] == "w4a16"
    ids = [3, 17, 5, 40, 22, 9, 31, 1]
    with torch.inference_mode():
        ours, ref = prefill_logits(served.model, ids), prefill_logits(float_model.model, ids)
    # 4 bits of random weights: close in direction, not equal
    cos = nn.functional.cosine_similarity(ours.flatten(), ref.flatten(), dim=0)
    assert float(cos) > 0.95
    with pytest.raises(ModelLoadError, match="not a GGUF file"):
        load_model(str(tmp_path / "hf"), quantization="gguf")
