"""torchvitals: vital signs, failure detection and rollback for distributed PyTorch training.

    import torchvitals
    agent = torchvitals.watch(model, optimizer, scheduler)
    ...
    loss.backward()
    report = agent.step(loss)
"""

from .agent import Agent, Config, Report, watch
from .agent.attention import record_attention
from .agent.detect import Thresholds, Verdict

__all__ = ["Agent", "Config", "Report", "Thresholds", "Verdict", "record_attention", "watch"]
