"""What the framework examples train, shipped with the package so the examples and the tests run
one source (the tests never import from ``examples/``).

    python examples/nanogpt_loop.py      # nanogpt.train: the nanoGPT-shaped loop under the agent
    python examples/lightning_ddp.py     # lightning_gpt: the LightningModule, loader and Trainer
    python examples/hf_trainer.py        # hf_gpt2: the tiny GPT-2, its data and TrainingArguments

Each module needs what its example needs (``lightning_gpt`` Lightning, ``hf_gpt2`` transformers)
and nothing imports them but the examples and the tests. The small GPT and the regression task
the other examples train are ``demo.model`` and ``demo.regression``.
"""
