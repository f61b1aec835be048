"""What the test tiers share: the models they train and the harness that runs them.

- ``models``: the small GPT (from the package), its test size ``TINY``, synthetic batches;
- ``reference``: float64 references the exactness tests compare the agent against;
- ``world``: spawned gloo ranks (``run_world``, ``spawn_job``), free ports, DDP/FSDP2 wrapping;
- ``preflight_factories``: the setups ``torchvitals preflight support.preflight_factories:<name>``
  loads;
- ``goodput_jobs``: goodput record folders (a crash and a rollback) the accounting's tests read.

What the examples train ships with the package, and the tests import it from there:
``torchvitals.agent.tools.examples`` (the Lightning module, the Hugging Face GPT-2, the nanoGPT
loop) and ``torchvitals.agent.tools.demo`` (the small GPT, the regression task).

``tests/conftest.py`` puts ``tests/`` on ``sys.path``; a script a test starts as a subprocess
(torchrun) inserts it itself. Nothing here imports from ``examples/``.
"""
