"""torchvitals: vital signs, failure detection and rollback for distributed PyTorch training.

    import torchvitals
    agent = torchvitals.watch(model, optimizer, scheduler)
    ...
    loss.backward()
    report = agent.step(loss)
"""

from .agent import Agent, Config, Report, watch

__all__ = ["Agent", "Config", "Report", "watch"]
