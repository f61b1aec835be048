"""The 2-D layouts large runs use, on 4 gloo ranks (2 x 2): HSDP and FSDP x tensor parallel.

    from support.meshes import LAYOUTS, shard, data_slice, logits_loss

    model = shard(kind, LlamaLike(...))    # kind in LAYOUTS; on every rank, after init
    x[data_slice(kind, per)]               # this rank's part of the global batch

- ``hsdp``: ``fully_shard`` over a 2-D mesh (replicate x shard): every rank its own data.
- ``fsdp_tp``: the attention and feed-forward projections tensor parallel (``ColwiseParallel``,
  ``RowwiseParallel``) on the ``tp`` mesh, then ``fully_shard`` on the ``dp`` mesh. The
  embedding, the norms and the head stay outside the plan: they live on the dp mesh only, one
  copy per tp rank. The layers' outputs are replicated on the tp ranks (after
  ``RowwiseParallel``).
- ``fsdp_tp_sp``: torchtitan's plan, with sequence and loss parallelism: the embedding and the
  head tensor parallel too, the norms ``SequenceParallel`` (replicated on the tp mesh), the
  embedding's and the layers' outputs sharded along the sequence, the head's a DTensor sharded
  over the vocabulary, the loss computed on it under ``loss_parallel`` (a DTensor too).

In both tensor-parallel layouts the ranks of one tp group train on the same data: the batch is
split over the dp ranks only.
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    RowwiseParallel,
    SequenceParallel,
    loss_parallel,
    parallelize_module,
)

LAYOUTS = ("hsdp", "fsdp_tp", "fsdp_tp_sp")
WORLD = 4


def mesh(kind: str) -> DeviceMesh:
    """The job's 2 x 2 mesh: (replicate, shard) for HSDP, (dp, tp) otherwise."""
    names = ("replicate", "shard") if kind == "hsdp" else ("dp", "tp")
    return init_device_mesh("cpu", (2, 2), mesh_dim_names=names)


def shard(kind: str, model: nn.Module) -> nn.Module:
    """``model`` (a ``LlamaLike``, unfused) laid out as ``kind``, in place; every rank calls it."""
    grid = mesh(kind)
    if kind == "hsdp":
        dp = grid
    else:
        dp, tp = grid["dp"], grid["tp"]
        if kind == "fsdp_tp_sp":
            parallelize_module(
                model,
                tp,
                {
                    "tok_embeddings": RowwiseParallel(
                        input_layouts=Replicate(), output_layouts=Shard(1)
                    ),
                    "norm": SequenceParallel(),
                    "output": ColwiseParallel(
                        input_layouts=Shard(1), output_layouts=Shard(-1), use_local_output=False
                    ),
                },
            )
        sequence = kind == "fsdp_tp_sp"
        colwise = ColwiseParallel(input_layouts=Shard(1)) if sequence else ColwiseParallel()
        rowwise = RowwiseParallel(output_layouts=Shard(1)) if sequence else RowwiseParallel()
        plan: dict = {name: colwise for name in ("wq", "wk", "wv", "w1", "w3")}
        plan.update(wo=rowwise, w2=rowwise)
        if sequence:
            plan.update(attention_norm=SequenceParallel(), ffn_norm=SequenceParallel())
        for layer in model.layers.values():
            parallelize_module(layer, tp, plan)
    for layer in model.layers.values():
        fully_shard(layer, mesh=dp)
    fully_shard(model, mesh=dp)
    return model


def ddp_over_tensor_parallel(model: nn.Module) -> nn.Module:
    """``model``'s layers tensor parallel on the tp mesh, then DDP on the dp mesh (torch's DDP +
    TP workaround: DDP turns the DTensor parameters into plain tensors of their pieces)."""
    from torch.nn.parallel import DistributedDataParallel

    grid = mesh("fsdp_tp")
    for layer in model.layers.values():
        parallelize_module(
            layer,
            grid["tp"],
            {name: ColwiseParallel() for name in ("wq", "wk", "wv", "w1", "w3")}
            | {"wo": RowwiseParallel(), "w2": RowwiseParallel()},
        )
    return DistributedDataParallel(model, device_mesh=grid["dp"])


def data_slice(kind: str, per: int) -> slice:
    """This rank's ``per`` samples of the global batch: HSDP splits it over all 4 ranks, the
    tensor-parallel layouts over the dp ranks only (a tp group shares its samples)."""
    rank = torch.distributed.get_rank()
    index = rank if kind == "hsdp" else rank // 2  # dp coordinate of a (dp, tp) = (2, 2) mesh
    return slice(index * per, (index + 1) * per)


def data_ranks(kind: str) -> int:
    """How many different parts the global batch is split into."""
    return WORLD if kind == "hsdp" else WORLD // 2


def train_context(kind: str) -> contextlib.AbstractContextManager:
    """What the forward pass, the loss and the backward pass run in (torchtitan's
    ``train_context``): ``loss_parallel`` where the head's output is sharded over the vocabulary."""
    return loss_parallel() if kind == "fsdp_tp_sp" else contextlib.nullcontext()


def logits_loss(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Cross entropy of a language model's logits (a DTensor under ``loss_parallel``)."""
    return F.cross_entropy(logits.flatten(0, 1), y.flatten())


def holds_first_logit(kind: str) -> bool:
    """Whether this rank's head output holds logit 0 of global sample 0 (locally at
    ``[0, 0, 0]``): the ranks that train sample 0, and of them, where the head is sharded over
    the vocabulary, the first tp rank."""
    rank = torch.distributed.get_rank()
    return rank == 0 if kind in ("hsdp", "fsdp_tp_sp") else rank in (0, 1)
