"""Encoder FFN-neuron and head pruning: shapes consistent, ratio 0 identical, outputs still sensible."""

import pytest
import torch

from fivefold.compress.encoder_prune import prune_encoder_ffn, prune_encoder_heads
from fivefold.errors import FivefoldError
from fivefold.models.bert import BertConfig, BertEncoder


def _encoder():
    torch.manual_seed(0)
    return BertEncoder(BertConfig(100, 32, 2, 4, 64)).eval()


def test_ffn_and_heads_prune_to_consistent_shapes():
    model = _encoder()
    ids = torch.randint(0, 100, (2, 7))
    mask = torch.ones_like(ids)
    with torch.no_grad():
        assert torch.equal(prune_encoder_ffn(model, (ids, mask), 0.0)(ids, mask), model(ids, mask))
        assert torch.equal(prune_encoder_heads(model, 0)(ids, mask), model(ids, mask))
    small = prune_encoder_heads(prune_encoder_ffn(model, (ids, mask), 0.5), 2)
    for layer in small.encoder.layer:
        assert layer.intermediate.dense.out_features == 32 and layer.output.dense.in_features == 32
        assert layer.attention.self.num_heads == 2 and layer.attention.self.query.out_features == 16
        assert layer.attention.output.dense.in_features == 16
    with torch.no_grad():
        assert small(ids, mask).shape == (2, 7, 32)


def test_the_weakest_head_goes_first_and_limits_are_checked():
    model = _encoder()
    with torch.no_grad():
        for layer in model.encoder.layer:  # head 1 of every layer: all its weights near zero
            for lin in (layer.attention.self.query, layer.attention.self.key, layer.attention.self.value):
                lin.weight[8:16] *= 1e-3
            layer.attention.output.dense.weight[:, 8:16] *= 1e-3
    pruned = prune_encoder_heads(model, 1)
    kept = torch.cat([torch.arange(0, 8), torch.arange(16, 32)])
    assert torch.equal(pruned.encoder.layer[0].attention.self.value.weight,
                       model.encoder.layer[0].attention.self.value.weight[kept])
    with pytest.raises(FivefoldError, match="can remove 0 to 3 of 4 heads"):
        prune_encoder_heads(model, 4)


def test_every_other_layer_student_copies_layers_0_2_4():
    from fivefold.compress.encoder_prune import every_other_layer_encoder

    torch.manual_seed(0)
    teacher = BertEncoder(BertConfig(100, 32, 5, 4, 64)).eval()
    student = every_other_layer_encoder(teacher)
    assert len(student.encoder.layer) == 3
    for s, t in zip(student.encoder.layer, [teacher.encoder.layer[i] for i in (0, 2, 4)]):
        assert torch.equal(s.intermediate.dense.weight, t.intermediate.dense.weight)
    ids = torch.randint(0, 100, (2, 6))
    with torch.no_grad():
        assert student(ids, torch.ones_like(ids)).shape == (2, 6, 32)
