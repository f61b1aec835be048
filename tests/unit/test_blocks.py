import pytest
from support.models import TINY, TINY_BLOCKS, TinyGPT
from torch import nn

from torchvitals.agent.measure.blocks import discover


def test_transformer_blocks_embeddings_head_and_other():
    model = TinyGPT(**TINY)
    blocks = discover(model)
    assert blocks.names == TINY_BLOCKS
    owners = {n: b for b, ps in zip(blocks.names, blocks.params) for n, _ in ps}
    assert owners["blocks.1.attn.qkv.weight"] == "blocks.1"
    assert owners["ln_f.weight"] == "other"
    assert sum(len(ps) for ps in blocks.params) == len(list(model.parameters()))
    assert blocks.output_modules[2] is model.blocks[0]
    assert blocks.output_modules[-1] is None
    assert blocks.numels == [sum(p.numel() for _, p in ps) for ps in blocks.params]


def test_tied_head_is_counted_once():
    model = TinyGPT(**TINY)
    model.lm_head.weight = model.tok_emb.weight
    blocks = discover(model)
    assert "lm_head" not in blocks.names
    assert sum(len(ps) for ps in blocks.params) == len(list(model.parameters()))


def test_user_named_blocks_by_module_path():
    model = TinyGPT(**TINY)
    blocks = discover(model, {"early": ["blocks.0", "blocks.1"], "late": "blocks.2.mlp"})
    assert blocks.names == ["early", "late", "other"]
    assert blocks.output_modules[1] is model.blocks[2].mlp
    late = {n for n, _ in blocks.params[1]}
    assert late == {n for n, _ in model.named_parameters() if n.startswith("blocks.2.mlp.")}


def test_unknown_module_path_is_a_clear_error():
    with pytest.raises(ValueError, match=r"no module at path\(s\) \['blocks.9'\]"):
        discover(TinyGPT(**TINY), ["blocks.9"])


def test_wrapper_prefixes_are_ignored():
    model = TinyGPT(**TINY)
    assert discover(model, ["module.blocks.0"]).names == ["blocks.0", "other"]


def test_sequential_mlp_groups_activation_with_its_linear():
    model = nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2))
    blocks = discover(model)
    assert blocks.names == ["0", "2", "4"]
    assert blocks.output_modules[0] is model[1]


def test_model_without_parameters_is_refused():
    with pytest.raises(ValueError, match="no parameters"):
        discover(nn.ReLU())
