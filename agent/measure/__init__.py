"""Stage 1, measure: what one rank sees in a step, on the device, and the one packed reduction.

``blocks`` says what a block is; ``stats`` computes per-block gradient and update sums of
squares (exact under DDP, FSDP2, HSDP and FSDP x TP), ``activations`` and ``attention`` the
forward hooks' statistics (``copies``: which ranks hold the same activations), ``scaler``
the GradScaler's unscale, ``loss`` where the step's loss comes from;
``vitals`` the non-numeric ones (``datawait``, ``host`` memory, ``fingerprint`` of DDP
replicas); ``reduce`` packs everything into one SUM (and, on sampled steps, one MAX) collective
with one device-to-host copy and unpacks the Report.
May import torch, ``..report`` and ``..config``; nothing from the later stages.
"""
