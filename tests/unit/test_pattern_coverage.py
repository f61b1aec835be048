"""Every pattern the detector can name is met in the three places a person looks for it: a branch
of the diagnosis, an alert (in the canonical rules, the chart's copy, and the rules' promtool
tests) and the runbook section of that alert, which names the pattern as its label spells it.

    python -m pytest tests/unit/test_pattern_coverage.py

The patterns come from the code's table (``agent/detect/verdict.py`` ``PATTERNS``), so a new
pattern fails here until each place knows it. Only files are read: no promtool, no server
(``tests/integration/test_observability.py`` runs promtool over the same files).
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml

import torchvitals
from torchvitals.agent.detect import verdict as P
from torchvitals.agent.tools import diagnose

ROOT = Path(torchvitals.__file__).resolve().parent
RULES = sorted((ROOT / "grafana" / "rules").glob("*.rules.yml"))
CHART_RULES = sorted((ROOT / "helm" / "torchvitals" / "files" / "rules").glob("*.rules.yml"))
RULE_TESTS = ROOT / "grafana" / "rules" / "tests.yml"
RUNBOOKS = ROOT / "docs" / "runbooks.md"
DETECTION = ROOT / "docs" / "detection.md"
VERDICT_METRICS = ("torchvitals_verdicts_total", "torchvitals_active_verdicts")
"""The series that carry a pattern label (``outputs/metrics.py``: ``pattern``, ``severity``)."""

ALERTED_FROM_OTHER_SERIES = {
    P.STRAGGLER: (
        "TorchvitalsStraggler",
        "Prometheus judges the slow rank itself from every rank's compute-time histogram, so "
        "the alert carries the rank and instance to look at; the verdict's counter is global "
        "rank 0's, labelled by pattern and severity only",
    ),
}
"""Patterns whose alert reads another series than the verdict's, with the alert and why."""


def no_alert_expected(pattern: str) -> str | None:
    """Why ``pattern`` has no alert of its own (None: it must have one), from the code's data."""
    if P.PATTERNS[pattern] == P.INFO:
        return "info only annotates (the dashboard's verdict annotations show it)"
    if pattern in P.RESPONSE_PATTERNS:
        return "it records the job's response to other verdicts (verdict.RESPONSE_PATTERNS)"
    return None


def alerts(path: Path) -> list[dict]:
    groups = yaml.safe_load(path.read_text())["groups"]
    return [r for g in groups for r in g["rules"] if "alert" in r]


_SELECTOR = re.compile(r"\b(" + "|".join(VERDICT_METRICS) + r")\s*\{([^}]*)\}")
_MATCHER = re.compile(r'(\w+)\s*(=~|!~|!=|=)\s*"((?:[^"\\]|\\.)*)"')
_MATCHER_EQ = re.compile(r'(\w+)\s*=\s*"((?:[^"\\]|\\.)*)"')


def selects(expr: str, labels: dict[str, str]) -> bool:
    """Whether a verdict series with ``labels`` is selected anywhere in ``expr`` (Prometheus
    matchers: ``=~``/``!~`` are anchored regular expressions; an absent label is "")."""
    for _, body in _SELECTOR.findall(expr):
        ok = True
        for name, op, value in _MATCHER.findall(body):
            have = labels.get(name, "")
            if op in ("=~", "!~"):
                hit = re.fullmatch(value, have) is not None
                ok &= hit if op == "=~" else not hit
            else:
                ok &= (have == value) if op == "=" else (have != value)
        if ok:
            return True
    return False


def covering(pattern: str, rules: list[dict]) -> list[str]:
    """The alerts of ``rules`` that fire on the pattern's verdict series."""
    labels = {"pattern": pattern, "severity": P.PATTERNS[pattern]}
    return [a["alert"] for a in rules if selects(a["expr"], labels)]


def runbook_sections() -> dict[str, str]:
    """Anchor (as mkdocs and the runbook_url spell it) -> the section's text."""
    parts = re.split(r"^## (.+)$", RUNBOOKS.read_text(), flags=re.M)
    return {
        re.sub(r"[^a-z0-9 -]", "", title.lower()).replace(" ", "-"): body
        for title, body in zip(parts[1::2], parts[2::2], strict=True)
    }


def named(pattern: str, text: str) -> bool:
    """Whether ``text`` names the pattern as the alert's label spells it: `pattern`."""
    return f"`{pattern}`" in text


def fires_in_a_promtool_case(pattern: str, alert_names: set[str]) -> bool:
    """Whether a promtool test feeds the pattern's verdict series and expects one of
    ``alert_names`` to fire for that series' job (and pattern, when the alert keeps it)."""
    for group in yaml.safe_load(RULE_TESTS.read_text())["tests"]:
        jobs = set()
        for s in group.get("input_series", []):
            metric, _, body = s["series"].partition("{")
            labels = dict(_MATCHER_EQ.findall(body))
            if metric in VERDICT_METRICS and labels.get("pattern") == pattern:
                jobs.add(labels.get("job", ""))
        for case in group.get("alert_rule_test", []):
            if case["alertname"] not in alert_names:
                continue
            for exp in case.get("exp_alerts") or []:
                got = {k: str(v) for k, v in exp.get("exp_labels", {}).items()}
                if got.get("job") in jobs and got.get("pattern", pattern) == pattern:
                    return True
    return False


def diagnose_branch(pattern: str) -> bool:
    return any(pattern in symptoms for symptoms in diagnose.CLASSES.values()) or (
        pattern in diagnose.RESPONSES
    )


def problems_of(pattern: str) -> list[str]:
    """Every place that misses ``pattern``, one line each, naming the place."""
    found = []
    if not diagnose_branch(pattern):
        found.append(
            "agent/tools/diagnose.py: no branch (no cause of CLASSES lists it, and RESPONSES "
            "does not take it as the job's response)"
        )
    sections = runbook_sections()
    why_none = no_alert_expected(pattern)
    for path in [*RULES, *CHART_RULES]:
        where = path.relative_to(ROOT)
        rules = alerts(path)
        names = covering(pattern, rules)
        if pattern in ALERTED_FROM_OTHER_SERIES:
            other, _ = ALERTED_FROM_OTHER_SERIES[pattern]
            if names:
                found.append(f"{where}: {names} fire on its verdict: drop the exception")
            names = [a["alert"] for a in rules if a["alert"] == other]
            if not names:
                found.append(f"{where}: no alert {other} (its listed exception)")
        elif why_none is not None:
            if names:
                found.append(f"{where}: {names} fire on it, yet {why_none}")
            continue
        elif not names:
            found.append(f"{where}: no alert fires on its series ({' or '.join(VERDICT_METRICS)})")
            continue
        if path in CHART_RULES:
            continue  # the same alerts: the runbook and promtool checks below are the canonical's
        if pattern not in ALERTED_FROM_OTHER_SERIES and not fires_in_a_promtool_case(
            pattern, set(names)
        ):
            found.append(
                f"{RULE_TESTS.relative_to(ROOT)}: no case where {' or '.join(names)} fires on "
                f"its verdict series"
            )
        anchors = {
            a["annotations"]["runbook_url"].rpartition("#")[2] for a in rules if a["alert"] in names
        }
        if not any(named(pattern, sections.get(anchor, "")) for anchor in anchors):
            found.append(
                f"docs/runbooks.md: the section of {' or '.join(sorted(names))} does not name "
                f"`{pattern}`"
            )
    if why_none is not None and not named(pattern, RUNBOOKS.read_text()):
        found.append(f"docs/runbooks.md: names `{pattern}` nowhere (it has no alert: {why_none})")
    return found


def test_the_files_and_the_table_are_there():
    assert RULES and CHART_RULES and RULE_TESTS.is_file() and RUNBOOKS.is_file()
    assert [p.name for p in RULES] == [p.name for p in CHART_RULES]
    assert set(diagnose.RESPONSES) == P.RESPONSE_PATTERNS
    assert set(ALERTED_FROM_OTHER_SERIES) <= set(P.PATTERNS)


@pytest.mark.parametrize("pattern", sorted(P.PATTERNS))
def test_every_pattern_has_a_diagnosis_an_alert_and_a_runbook(pattern):
    problems = problems_of(pattern)
    if problems:
        pytest.fail(f"pattern {pattern!r} is missing:\n  " + "\n  ".join(problems), False)


def test_the_verdict_table_has_a_row_for_every_pattern_with_its_severity():
    """docs/detection.md's table of verdicts: one row per pattern (a row may name two), in the
    severity the code gives it, and no row for a pattern the code does not have."""
    rows = {}
    for line in DETECTION.read_text().split("## Thresholds")[0].splitlines():
        cells = [c.strip() for c in re.split(r"(?<!\\)\|", line.strip().strip("|"))]
        if line.startswith("| `") and len(cells) == 3:
            for name in re.findall(r"`([a-z0-9_]+)`", cells[0]):
                rows[name] = cells[1]
    assert rows == dict(P.PATTERNS)


@pytest.mark.parametrize(
    ("expr", "labels", "hit"),
    [
        ('x{pattern="hot_lr"}', {"pattern": "hot_lr"}, False),
        ('torchvitals_active_verdicts{pattern="hot_lr"} > 0', {"pattern": "hot_lr"}, True),
        ('torchvitals_verdicts_total{pattern=~"a|b"}', {"pattern": "b"}, True),
        ('torchvitals_verdicts_total{pattern=~"a|b"}', {"pattern": "ab"}, False),
        (
            'torchvitals_verdicts_total{severity="warning", pattern!~"a|b"}',
            {"pattern": "c", "severity": "warning"},
            True,
        ),
        (
            'torchvitals_verdicts_total{severity="warning", pattern!~"a|b"}',
            {"pattern": "c", "severity": "critical"},
            False,
        ),
        ('torchvitals_verdicts_total{severity="warning", pattern!~"a|b"}', {"pattern": "a"}, False),
    ],
)
def test_the_selector_reading_follows_prometheus(expr, labels, hit):
    assert selects(expr, labels) is hit
