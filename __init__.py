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
from .agent.watchdog import TrainingAborted

__all__ = ["Agent", "Config", "Report", "Thresholds", "TrainingAborted", "Verdict",
           "record_attention", "watch"]
