"""The kinds of block, spelled once: a leaf that imports nothing, so the rules (and the offline
replay of a past run's log) read them without importing torch.

``blocks`` assigns them; ``detect.rules`` compares layers with layers and leaves ``other`` (the
small leftovers such as final norms) out of its leader.
"""

from __future__ import annotations

OTHER = "other"
"""The block of every parameter outside the layers, embeddings and head."""
LAYER, EMBEDDING, HEAD, NAMED = "layer", "embedding", "head", "named"
"""A repeated layer, an embedding, the head (the last Linear outside the layers), a block the
user named (``watch(blocks=...)``)."""
