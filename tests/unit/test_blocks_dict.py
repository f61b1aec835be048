"""Block discovery under an ``nn.ModuleDict`` (torchtitan keeps its layers in one)."""

from support.llamalike import LlamaLike
from torch import nn

from torchvitals.agent.measure.blocks import EMBEDDING, HEAD, LAYER, OTHER, discover


def test_layers_in_a_module_dict_are_one_block_each():
    model = LlamaLike(n_layers=3)
    blocks = discover(model)
    assert blocks.names == ["tok_embeddings", "layers.0", "layers.1", "layers.2", "output", OTHER]
    assert blocks.kinds == [EMBEDDING, LAYER, LAYER, LAYER, HEAD, OTHER]
    owners = {n: b for b, ps in zip(blocks.names, blocks.params) for n, _ in ps}
    assert owners["layers.1.w2.weight"] == "layers.1"
    assert owners["norm.weight"] == OTHER
    assert blocks.output_modules[2] is model.layers["1"]
    assert sum(len(ps) for ps in blocks.params) == len(list(model.parameters()))


def test_a_dict_of_different_heads_is_not_taken_for_layers():
    class TwoHeads(nn.Module):
        def __init__(self):
            super().__init__()
            self.trunk = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 8))
            self.heads = nn.ModuleDict(
                {"cls": nn.Linear(8, 3), "box": nn.Sequential(nn.Linear(8, 2), nn.Linear(2, 4))}
            )

    blocks = discover(TwoHeads())
    assert [n for n, k in zip(blocks.names, blocks.kinds) if k == LAYER] == ["trunk.0", "trunk.2"]
