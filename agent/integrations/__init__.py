"""The frameworks' ways in: one callback each, the only line a user adds.

    Trainer(callbacks=[torchvitals.LightningCallback(checkpoint_dir="ckpt")])      # Lightning
    Trainer(..., callbacks=[torchvitals.TransformersCallback(checkpoint_dir="ckpt")])  # HF

Each builds the agent once the framework has set up its model, optimizer and scheduler; from
then on the framework's own ``optimizer.step()`` goes through the guard (``agent/guard.py``).
The callbacks only tell the agent what the framework knows and the guard cannot see: the
micro-batch losses, and the moment before the framework clips the gradients. Lightning and
transformers are optional: each module imports its framework, nothing else here does. May
import every stage (they sit above the agent, like ``tools``).
"""
