"""Offline tools built on the agent's pieces: ``torchvitals diagnose``, ``report``, ``preflight``
and ``demo``.

``diagnose`` names one root cause from a run's verdicts and losses, ``runreport`` plots a run
and writes its HTML page, ``preflight`` runs the checks worth doing before a long run, ``demo``
trains a small GPT with an injected fault; ``examples`` holds what the framework examples train
(shared with the tests). ``diagnose`` and ``runreport`` read files only and import no torch.
May import every stage.
"""
