"""The per-rank agent: exact per-block vital signs, one packed reduction, Prometheus exposition."""

from .agent import Agent, watch
from .config import Config
from .report import Report

__all__ = ["Agent", "Config", "Report", "watch"]
