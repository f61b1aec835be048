"""A model whose state-dict hooks rename parameters (a fused QKV projection saved as separate
``wq``/``wk``/``wv``, as torchtitan's llama3 does) checkpoints and restores exactly, on disk and
from the in-memory snapshot, alone and under an optimizer container."""

from __future__ import annotations

import torch
from support.llamalike import LlamaLike

from torchvitals.agent.recover.checkpoint import CheckpointStore
from torchvitals.agent.recover.snapshot import restore, stage

VOCAB = 64


def train(model, opt, steps, seed):
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        x = torch.randint(0, VOCAB, (4, 8), generator=g)
        model.loss(x, x.roll(-1, 1)).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)


def state(model, opt):
    params = {n: p.detach().clone() for n, p in model.named_parameters()}
    moments = {
        n: {k: v.clone() for k, v in opt.state[p].items()} for n, p in model.named_parameters()
    }
    return params, moments


def same(a, b):
    (pa, ma), (pb, mb) = a, b
    return (
        pa.keys() == pb.keys()
        and all(torch.equal(pa[k], pb[k]) for k in pa)
        and all(torch.equal(ma[n][k], mb[n][k]) for n in ma for k in ma[n])
    )


def setup(seed=0):
    torch.manual_seed(seed)
    model = LlamaLike(vocab=VOCAB, fused=True)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def test_the_hooks_rename_the_fused_weight():
    keys = list(LlamaLike(fused=True).state_dict())
    assert "layers.0.qkv.wq.weight" in keys and "layers.0.qkv.wqkv.weight" not in keys


def test_fused_model_round_trips_through_the_disk(tmp_path):
    model, opt = setup()
    train(model, opt, 3, seed=1)
    store = CheckpointStore(tmp_path)
    store.save(3, model, opt, None)
    at_save = state(model, opt)
    train(model, opt, 2, seed=2)
    assert not same(state(model, opt), at_save)
    restored = store.load(model, opt, None)
    assert restored.step == 3 and same(state(model, opt), at_save)

    fresh, fresh_opt = setup(seed=5)
    train(fresh, fresh_opt, 1, seed=9)  # optimizer state exists, different values
    store.load(fresh, fresh_opt, None)
    assert same(state(fresh, fresh_opt), at_save)


def test_fused_model_round_trips_through_the_snapshot():
    model, opt = setup()
    train(model, opt, 3, seed=1)
    snap = stage(3, model, opt, None, extra={}, rank_state=None)
    at_save = state(model, opt)
    train(model, opt, 2, seed=2)
    restore(snap, model, opt, None)
    assert same(state(model, opt), at_save)
