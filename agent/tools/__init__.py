"""Offline tools built on the agent's pieces: ``torchvitals diagnose``, ``report``, ``backtest``,
``preflight`` and ``demo``.

``diagnose`` names one root cause from a run's verdicts and losses, ``runreport`` plots a run
and writes its HTML page, ``preflight`` runs the checks worth doing before a long run, ``demo``
trains a small GPT with an injected fault, ``backtest`` replays a past run's log through the
detector; ``examples`` holds what the framework examples train (shared with the tests).
``diagnose``, ``runreport`` and ``backtest`` read files only and import no torch.
May import every stage.
"""
