"""The run report's disruption pages: the incident timeline and the badput breakdown.

    write_report("torchvitals_runs/<run>", job_dirs=["ckpt"])   # draws both, via runreport

``incidents.png``: every incident on the job's time axis, one row per kind, from its detection
to its recovery (a bar when the job recovered, a marker alone when not), labelled with its
culprit and step. ``badput.png``: the job's wall time as one stacked bar (productive time and
each cause of badput), and the causes by seconds. With the HTML sections that list them. Torch-
free; matplotlib's ``Figure`` only (no pyplot: the user's backend is left alone).
"""

from __future__ import annotations

import html
import math
import time
from collections.abc import Sequence
from pathlib import Path

from ...records.goodput import CAUSES, Goodput
from ...records.incidents import Incident
from ...records.vocabulary import KINDS
from .culprit import STOPPED, who
from .jobrecords import JobRecords

LABELLED = 40
"""Incidents whose culprit is written beside its marker; past that the markers speak alone."""
PRODUCTIVE_COLOR = "#2ca02c"
PALETTE = ("#8c564b", "#1f77b4", "#d62728", "#9467bd", "#e377c2", "#ff7f0e", "#17becf", "#7f7f7f",
           "#bcbd22")  # fmt: skip
CAUSE_COLORS = {cause: PALETTE[n % len(PALETTE)] for n, cause in enumerate(CAUSES)}
"""One color per cause of badput, the same in both charts."""
COLUMNS = ("detected", "kind", "step", "culprit", "cause", "localized after", "recovered after",
           "lost")  # fmt: skip


def plot_incidents(
    incidents: Sequence[Incident],
    path: Path,
    *,
    started_at: float | None = None,
    ended_at: float | None = None,
) -> Path:
    """Draw the incident timeline into ``path``.

    Args:
        incidents: oldest first.
        path: the PNG to write.
        started_at: the job's start (unix seconds; the goodput accounting's), the time axis's
            zero; default: the first incident's detection.
        ended_at: the job's end, the axis's right edge (default: what the incidents reach).

    Returns:
        ``path``.
    """
    from matplotlib.figure import Figure

    t0 = started_at if started_at is not None else min(i.detected_at for i in incidents)
    kinds = [k for k in KINDS if any(i.kind == k for i in incidents)]
    kinds += sorted({i.kind for i in incidents} - set(kinds))
    fig = Figure(figsize=(9, 1.6 + 0.55 * len(kinds)), dpi=100)
    ax = fig.subplots()
    for n, incident in enumerate(incidents):
        y = kinds.index(incident.kind)
        x = (incident.detected_at - t0) / 60
        color = "#d62728" if incident.kind in STOPPED else "#e69f00"
        if incident.recovered_at is not None:
            width = max((incident.recovered_at - incident.detected_at) / 60, 0.0)
            ax.barh(y, width, left=x, height=0.35, color=color, alpha=0.35)
        ax.scatter([x], [y], marker="X" if incident.kind in STOPPED else "^", s=60, color=color)
        if n < LABELLED:
            step = "" if incident.step is None else f", step {incident.step}"
            ax.annotate(
                who(incident.culprit) + step,
                xy=(x, y),
                xytext=(4, 7 if n % 2 == 0 else -12),
                textcoords="offset points",
                fontsize=7,
            )
    ax.set_yticks(range(len(kinds)), kinds)
    if started_at is not None:
        # The whole job, so a reader sees when in its life the incidents came.
        right = max([ended_at or t0, *(i.recovered_at or i.detected_at for i in incidents)])
        ax.set_xlim(0, max((right - t0) / 60, 1e-3) * 1.02)
    ax.set_ylim(-0.7, len(kinds) - 0.3)
    ax.set_xlabel(
        "minutes since the job started"
        if started_at is not None
        else "minutes since the first incident"
    )
    stopped = sum(i.kind in STOPPED for i in incidents)
    ax.set_title(
        f"{len(incidents)} incident(s), {stopped} that stopped the job: detection to recovery"
    )
    ax.grid(alpha=0.3, axis="x")
    fig.tight_layout()
    fig.savefig(path)
    return path


def plot_badput(goodput: Goodput, path: Path) -> Path:
    """Draw the wall time split into productive time and badput by cause into ``path``.

    Returns:
        ``path``.
    """
    from matplotlib.figure import Figure

    fig = Figure(figsize=(9, 4.6), dpi=100)
    whole, parts = fig.subplots(2, 1, gridspec_kw={"height_ratios": [1, 3]})
    wall = goodput.wall_seconds
    left = goodput.productive_seconds
    whole.barh(0, left, color=PRODUCTIVE_COLOR, label="productive")
    for cause in CAUSES:
        seconds = goodput.badput.get(cause, 0.0)
        if seconds > 0:
            whole.barh(0, seconds, left=left, color=CAUSE_COLORS[cause], label=cause)
            left += seconds
    whole.set_yticks([])
    whole.set_xlim(0, max(wall, 1e-9))
    whole.set_title(
        f"goodput {goodput.goodput:.1%}: {_duration(goodput.productive_seconds)} productive "
        f"of {_duration(wall)} wall, {goodput.attempts} attempt(s)"
    )
    whole.legend(fontsize=7, ncol=5, loc="upper center", bbox_to_anchor=(0.5, -0.25))
    lost = sorted(
        ((c, s) for c, s in goodput.badput.items() if s > 0), key=lambda cs: cs[1], reverse=True
    )
    if lost:
        names = [c for c, _ in lost]
        parts.barh(names, [s for _, s in lost], color=[CAUSE_COLORS.get(c, "gray") for c in names])
        parts.invert_yaxis()
        for y, (_, seconds) in enumerate(lost):
            share = seconds / wall if wall > 0 else 0.0
            parts.annotate(
                f" {_duration(seconds)} ({share:.1%})", xy=(seconds, y), va="center", fontsize=8
            )
        parts.set_xlabel("seconds of wall time not training, by cause")
        parts.set_xlim(0, lost[0][1] * 1.3)
    else:
        parts.text(0.5, 0.5, "no badput", ha="center", va="center", transform=parts.transAxes)
        parts.set_axis_off()
    fig.tight_layout()
    fig.savefig(path)
    return path


# ---------------------------------------------------------------- the page


def incidents_html(records: JobRecords, image: Path | None) -> str:
    """The report's incidents section: the timeline and one row per incident."""
    esc = html.escape
    if not records.incidents:
        where = ", ".join(str(f) for f in records.folders) or "no folder"
        body = (
            f"<p>no incident records (looked in {esc(where)}; name the job's folder with "
            f"--job-dir)</p>"
        )
    else:
        rows = "".join(
            "<tr>"
            + "".join(
                f"<td>{esc(str(cell))}</td>"
                for cell in (
                    time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(i.detected_at)),
                    i.kind,
                    "" if i.step is None else i.step,
                    who(i.culprit) + ("" if i.culprit.pid is None else f", pid {i.culprit.pid}"),
                    i.cause,
                    _after(i.detected_at, i.localized_at),
                    _after(i.detected_at, i.recovered_at),
                    _seconds(records.lost_seconds(i)),
                )
            )
            + "</tr>"
            for i in records.incidents
        )
        head = "".join(f"<th>{h}</th>" for h in COLUMNS)
        img = f"<img src='{esc(image.name)}' alt='incident timeline'>" if image else ""
        body = f"{img}<table><tr>{head}</tr>{rows}</table>"
    problems = "".join(f"<li>{esc(p)}</li>" for p in records.problems)
    unreadable = f"<p>unreadable records:</p><ul>{problems}</ul>" if problems else ""
    return f"<h2>incidents</h2>{body}{unreadable}"


def goodput_html(records: JobRecords, image: Path | None) -> str:
    """The report's goodput section: the breakdown and its table, or why there is none."""
    esc = html.escape
    g = records.goodput
    if g is None:
        return f"<h2>goodput</h2><p>{esc(records.goodput_note)}</p>"
    rows = [("productive", g.productive_seconds)] + [(c, g.badput.get(c, 0.0)) for c in CAUSES]
    table = "".join(
        f"<tr><th>{esc(name)}</th><td>{_seconds(s)}</td>"
        f"<td>{(s / g.wall_seconds if g.wall_seconds > 0 else 0.0):.1%}</td></tr>"
        for name, s in rows
    )
    img = f"<img src='{esc(image.name)}' alt='badput by cause'>" if image else ""
    problems = "".join(f"<li>{esc(p)}</li>" for p in g.problems)
    return (
        f"<h2>goodput</h2><p>goodput <b>{g.goodput:.1%}</b>: {_duration(g.productive_seconds)} "
        f"productive of {_duration(g.wall_seconds)} wall, {g.attempts} attempt(s), "
        f"{g.processes} process(es), up to step {g.last_step} "
        f"({esc(g.folder)})</p>{img}<table><tr><th></th><th>seconds</th><th>share</th></tr>"
        f"{table}</table>" + (f"<p>skipped records:</p><ul>{problems}</ul>" if problems else "")
    )


def _after(start: float, end: float | None) -> str:
    return "" if end is None else f"{end - start:.1f} s"


def _seconds(seconds: float | None) -> str:
    return "" if seconds is None or not math.isfinite(seconds) else f"{seconds:.1f} s"


def _duration(seconds: float) -> str:
    """``42.0 s``, ``12 min 5 s``, ``3 h 04 min``."""
    if seconds < 60:
        return f"{seconds:.1f} s"
    if seconds < 3600:
        return f"{int(seconds // 60)} min {int(seconds % 60)} s"
    return f"{int(seconds // 3600)} h {int(seconds % 3600 // 60):02d} min"
