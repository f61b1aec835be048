"""What torchtitan 0.3.0's own Trainer needs to run on CPU with gloo (test harness only).

    import titan_harness            # first: before torch's inductor or torchtitan are imported
    config = titan_harness.debug_llama3(tmp, steps=20)
    trainer = config.build()

- the import-only stand-ins in ``titan_stubs/`` (torchtitan imports triton and datasets at
  module level), put on the path only after torch has cached that it has no triton;
- the device: torchtitan picks "cuda" when no accelerator is present; here "cpu" (gloo);
- the debug llama3 with FlexAttention computed as causal SDPA (no compiled flex kernel on
  CPU; the synthetic sequences hold no document boundaries), float32 parameters,
  short sequences, torchtitan's defaults otherwise (fused QKV, FSDP2, selective activation
  checkpointing, loss logging every step, its checkpointer off);
- a tiny tokenizer built with ``tokenizers`` (the wheel ships none) and a synthetic token loader
  (the Hugging Face datasets are not installed);
- gloo has no PREMUL_SUM (FSDP2's reduce-scatter divides in the collective by default): the
  gradient divide factor is applied before the collective instead;
- torch 2.13's ``torch.distributed`` has no ``set_timeout``: torchtitan's post-first-step
  timeout change is skipped;
- torchtitan's pipeline path hands its schedule microbatches already split
  (``step(arg_mbs=..., kwarg_mbs=..., target_mbs=...)``), which torch 2.13's schedules take only
  through their ``_step_microbatches``: ``step`` is given that form.
"""

from __future__ import annotations

import json
import os
import sys
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.utils._triton as _triton

_triton.has_triton_package()  # cached False before the stand-in is importable
import torch._inductor.runtime.hints  # noqa: E402
import torch._inductor.runtime.triton_compat  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent / "titan_stubs"))

import torchtitan.tools.utils as _tt_utils  # noqa: E402


class _CpuDevice:
    """torch.cpu, plus the accelerator queries torchtitan's metrics make (name, memory: 0)."""

    def __getattr__(self, name):
        if hasattr(torch.cpu, name):
            return getattr(torch.cpu, name)
        if name == "get_device_name":
            return lambda *a, **k: "cpu"
        if name == "get_device_properties":
            return lambda *a, **k: type("Props", (), {"name": "cpu", "total_memory": 1 << 34})()
        if name == "mem_get_info":
            return lambda *a, **k: (1 << 34, 1 << 34)
        if name == "memory_stats":
            return lambda *a, **k: {}
        return lambda *a, **k: 0


_tt_utils.device_type, _tt_utils.device_module = "cpu", _CpuDevice()

import torchtitan.distributed.utils as _dist_utils  # noqa: E402
from torchtitan.components.dataloader import BaseDataLoader  # noqa: E402
from torchtitan.models.common.attention import FlexAttention  # noqa: E402
from torchtitan.models.llama3 import model_registry  # noqa: E402
from torchtitan.models.llama3.config_registry import llama3_debugmodel  # noqa: E402

_dist_utils.set_pg_timeouts = lambda *args, **kwargs: None

from torch.distributed.fsdp._fully_shard import _fsdp_collectives  # noqa: E402

_divide_factors = _fsdp_collectives._get_gradient_divide_factors


def _sum_then_divide(
    reduce_scatter_group,
    all_reduce_group,
    reduce_dtype,
    device_type="",
    factor=None,
    force_sum_reduction_for_comms=False,
):
    """FSDP2's gradient divide as a SUM plus a division (gloo has no PREMUL_SUM)."""
    return _divide_factors(
        reduce_scatter_group, all_reduce_group, reduce_dtype, device_type, factor, True
    )


_fsdp_collectives._get_gradient_divide_factors = _sum_then_divide


def _causal_sdpa(
    self,
    q_BLNH,
    k_BLNH,
    v_BLNH,
    *,
    attention_masks=None,
    score_mod=None,
    scale=None,
    enable_gqa=False,
    out_transform=None,
    **kwargs,
):
    """FlexAttention's forward as causal SDPA (no compiled flex kernel on CPU)."""
    assert score_mod is None and out_transform is None
    q, k, v = (t.transpose(1, 2) for t in (q_BLNH, k_BLNH, v_BLNH))
    out = torch.nn.functional.scaled_dot_product_attention(
        q, k, v, is_causal=True, scale=scale, enable_gqa=enable_gqa
    )
    return out.transpose(1, 2)


FlexAttention.forward = _causal_sdpa

from torch.distributed.pipelining import schedules as _schedules  # noqa: E402


def _presplit_step(step):
    """A schedule's ``step`` that also takes the microbatches already split (torchtitan 0.3.0)."""

    def run(
        self,
        *args,
        arg_mbs=None,
        kwarg_mbs=None,
        target_mbs=None,
        losses=None,
        return_outputs=True,
        loss_kwargs=None,
        **kwargs,
    ):
        if arg_mbs is None and kwarg_mbs is None and target_mbs is None:
            return step(
                self,
                *args,
                losses=losses,
                return_outputs=return_outputs,
                loss_kwargs=loss_kwargs,
                **kwargs,
            )
        stages = getattr(self, "_stages", None) or [self._stage]
        for stage in stages:
            stage.has_backward = self._has_backward
            stage.clear_runtime_states()
        self._step_microbatches(
            arg_mbs, kwarg_mbs, target_mbs, losses, return_outputs, loss_kwargs=loss_kwargs
        )
        return None

    return run


for _schedule in (_schedules.PipelineScheduleSingle, _schedules.PipelineScheduleMulti):
    _schedule.step = _presplit_step(_schedule.step)

VOCAB = 2048


class SyntheticTokens(BaseDataLoader):
    """Deterministic token sequences with a learnable pattern, a different stream per dp rank."""

    @dataclass(kw_only=True, slots=True)
    class Config(BaseDataLoader.Config):
        seed: int = 0

    def __init__(
        self,
        config: SyntheticTokens.Config,
        *,
        dp_world_size: int,
        dp_rank: int,
        tokenizer,
        seq_len: int,
        local_batch_size: int,
        **kwargs,
    ) -> None:
        self.seq_len, self.batch, self.dp_rank = seq_len, local_batch_size, dp_rank
        self.generator = torch.Generator().manual_seed(1000 * config.seed + dp_rank)

    def __iter__(self):
        while True:
            start = torch.randint(0, VOCAB, (self.batch, 1), generator=self.generator)
            stride = torch.randint(1, 5, (self.batch, 1), generator=self.generator)
            seq = (start + stride * torch.arange(self.seq_len + 1)) % VOCAB
            yield {"input": seq[:, :-1]}, seq[:, 1:]

    # Keyed by dp rank, as torchtitan's own loader does: DCP keeps one copy of a non-tensor
    # value that every rank saves under the same key.
    def state_dict(self):
        return {f"dp_rank_{self.dp_rank}": self.generator.get_state().tolist()}

    def load_state_dict(self, state):
        self.generator.set_state(torch.tensor(state[f"dp_rank_{self.dp_rank}"], dtype=torch.uint8))


def tokenizer_folder(root: Path) -> Path:
    """A word-level tokenizer of VOCAB entries with llama-style special tokens."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    folder = root / "tokenizer"
    folder.mkdir(parents=True, exist_ok=True)
    if not (folder / "tokenizer.json").exists():
        vocab = {"<|begin_of_text|>": 0, "<|end_of_text|>": 1, "<unk>": 2}
        vocab.update({f"w{i}": i for i in range(3, VOCAB)})
        tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
        tok.pre_tokenizer = pre_tokenizers.Whitespace()
        tok.save(str(folder / "tokenizer.json"))
        (folder / "tokenizer_config.json").write_text(
            json.dumps(
                {
                    "bos_token": "<|begin_of_text|>",
                    "eos_token": "<|end_of_text|>",
                    "add_bos_token": True,
                    "add_eos_token": False,
                }
            )
        )
    return folder


def debug_llama3(
    root: Path,
    *,
    steps: int,
    seq_len: int = 32,
    batch: int = 2,
    seed: int = 0,
    pipeline: int = 1,
    schedule: str = "1F1B",
):
    """torchtitan's llama3 debug config, sized for CPU, everything else its defaults;
    ``pipeline`` > 1: that many pipeline stages over the ranks (``schedule``)."""
    config = llama3_debugmodel()
    config.model_spec = model_registry("debugmodel")
    config.hf_assets_path = str(tokenizer_folder(root))
    config.dataloader = SyntheticTokens.Config(seed=seed)
    config.training.steps = steps
    config.training.seq_len = seq_len
    config.training.local_batch_size = batch
    config.training.mixed_precision_param = "float32"
    # The classic FSDP2 path (fully_shard over the dp mesh): torch 2.13's fully_shard refuses
    # the spmd_types default's plain-tensor parameters on CPU.
    config.parallelism.spmd_backend = "partial_dtensor"
    config.dump_folder = str(root / "titan")
    if pipeline > 1:
        config.parallelism.pipeline_parallel_degree = pipeline
        config.parallelism.pipeline_parallel_schedule = schedule
        config.training.disable_cuda_graphs = True  # torchtitan requires it with pipelines
    return config


def rank() -> int:
    return int(os.environ.get("RANK", "0"))
