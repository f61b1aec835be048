"""The run report: plots of a finished (or running) run and one HTML page with its diagnosis.

    torchvitals report torchvitals_runs/<run>          # the folder holding events.jsonl
    torchvitals report torchvitals_runs/<run> --job-dir ckpt   # incidents/ and goodput/ there

Read from what the run left behind: the event log (every step report rank 0 wrote), when found
the watchdog's ledger (checkpoints, rollbacks, LR scale, skipped batches), and the job folder's
incident records and goodput accounting (``jobrecords.py`` says where it looks). Writes into the
run folder ``loss.png`` (with verdict and rollback markers), ``grad_norm.png`` (per block),
``update_ratio.png`` (per block, against the healthy 1e-3 band) and ``activations.png`` (abs max
per block), ``incidents.png`` (the incident timeline) and ``badput.png`` (the wall time by
cause) when there are incidents and goodput records, and ``report.html``, a page that needs
nothing but those files beside it. The diagnosis is ``diagnose_events`` on the same log and
records, as ``torchvitals diagnose`` prints it.

Steps repeat after a rollback (training resumes from the checkpoint's step): every plot draws the
abandoned branch faded and dashed, and the branch the run kept solid.
"""

from __future__ import annotations

import html
import math
import os
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ...records.goodput import Goodput
from ...records.incidents import Incident
from ...records.ledger import Ledger
from ..detect.verdict import CRITICAL, HOT_LR, INFO, WARNING
from ..jsonsafe import json_number
from ..outputs.eventlog import read_events
from ..report import Action, Rollback
from .diagnose import Diagnosis, diagnose_events
from .incidentplots import goodput_html, incidents_html, plot_badput, plot_incidents
from .jobrecords import JobRecords, find_ledger, read_job_records

PLOTS = ("loss", "grad_norm", "update_ratio", "activations")
HEALTHY_BAND = (10**-3.5, 10**-2.5)
"""The shaded update-ratio band: half a decade either side of the rule-of-thumb 1e-3."""
SEVERITY_COLORS = {WARNING: "#e69f00", CRITICAL: "#d62728", INFO: "#1f77b4"}
ROLLBACK_COLOR = "#9b30ff"


@dataclass
class RunReport:
    """What ``write_report`` wrote and what it found."""

    run_dir: Path
    html: Path
    images: dict[str, Path]
    """Plot name (PLOTS, then "incidents" and "badput" when drawn) -> its PNG."""
    diagnosis: Diagnosis
    rollbacks: list[dict[str, Any]] = field(default_factory=list)
    """The rollbacks as the ledger records them (or the event log, without a ledger)."""
    steps: int = 0
    final_loss: float = math.nan
    lr_scale: float = 1.0
    skipped: list[list[int]] = field(default_factory=list)
    healthy_at_end: bool | None = None
    """Whether the run ended healthy, when the caller knows it (None: unknown)."""
    records: JobRecords | None = None
    """The job folder's incidents and goodput (None: not read)."""

    @property
    def incidents(self) -> tuple[Incident, ...]:
        return self.records.incidents if self.records is not None else ()

    @property
    def goodput(self) -> Goodput | None:
        return self.records.goodput if self.records is not None else None

    def render_summary(self) -> str:
        """A few lines for a terminal: the outcome, the rollbacks and the diagnosis."""
        lines = [
            f"run: {self.steps} steps, final loss {self.final_loss:.4f}, "
            f"learning-rate scale {self.lr_scale:g}, "
            f"{sum(b - a for a, b in self.skipped)} batches skipped"
            + (
                ""
                if self.healthy_at_end is None
                else ", finished healthy"
                if self.healthy_at_end
                else ", NOT healthy at the end"
            )
        ]
        lines += [
            f"rollback at step {r['step']} to step {r['to_step']} ({r['reason']}), "
            f"lr scale {r['lr_scale']:g}, {_skipped(r['skipped'])}"
            for r in self.rollbacks
        ]
        if self.goodput is not None:
            g = self.goodput
            worst = max(g.badput, key=lambda c: g.badput[c]) if g.badput else None
            lines.append(
                f"goodput {g.goodput:.1%} of {g.wall_seconds:.1f} s wall"
                + (
                    f", most badput: {worst} ({g.badput[worst]:.1f} s)"
                    if worst is not None and g.badput[worst] > 0
                    else ""
                )
            )
        lines += [f"incident: {i.line()}" for i in self.incidents]
        return "\n".join([*lines, "diagnosis:", self.diagnosis.render()])


def write_report(
    run_dir: str | os.PathLike,
    *,
    ledger: str | os.PathLike | None = None,
    out_dir: str | os.PathLike | None = None,
    healthy_at_end: bool | None = None,
    facts: Sequence[tuple[str, str]] = (),
    job_dirs: Sequence[str | os.PathLike] = (),
) -> RunReport:
    """Plot a run and write its HTML page.

    Args:
        run_dir: the folder holding ``events.jsonl`` (``<log_dir>/<run_name>``).
        ledger: the watchdog's ledger (default: ``find_ledger(run_dir)``; none is fine).
        out_dir: where the PNGs and ``report.html`` go (default: ``run_dir``).
        healthy_at_end: whether the run ended healthy, when the caller knows (the demo does).
        facts: more (name, value) rows for the page's table, first (the demo's injected fault).
        job_dirs: folders holding the job's ``incidents/`` and ``goodput/`` besides the run
            folder and the ledger's (the shared ``checkpoint_dir``, when it is elsewhere).

    Returns:
        The RunReport.

    Raises:
        OSError: the event log cannot be read, or a folder of ``job_dirs`` is not one.
        ValueError: the event log is corrupt or holds no step report.
    """
    run_dir = Path(run_dir)
    out = Path(out_dir) if out_dir is not None else run_dir
    out.mkdir(parents=True, exist_ok=True)
    events_path = run_dir / "events.jsonl"
    ledger_path = Path(ledger) if ledger is not None else find_ledger(run_dir)
    records = read_job_records(run_dir, job_dirs, ledger=ledger_path)
    # raises on a missing, corrupt or empty log
    diagnosis = diagnose_events(events_path, job_dirs=job_dirs, ledger=ledger_path)
    steps = [
        e
        for e in read_events(events_path)
        if isinstance(e, dict) and e.get("event", "step") == "step" and "step" in e
    ]
    book = Ledger(ledger_path, writer=False).load() if ledger_path is not None else None
    rollbacks = (
        [e for e in book.entries if e["event"] == "rollback"]
        if book is not None
        else [
            {
                "step": e["step"],
                "reason": ", ".join(
                    v["pattern"] for v in e["verdicts"] if v.get("severity") == CRITICAL
                ),
                **e["rollback"],
            }
            for e in steps
            if e.get("action") == Action.ROLLBACK
        ]
    )
    report = RunReport(
        run_dir,
        out / "report.html",
        {},
        diagnosis,
        rollbacks,
        steps=steps[-1]["step"],
        final_loss=json_number(steps[-1].get("loss")),
        lr_scale=book.lr_scale
        if book is not None
        else (rollbacks[-1]["lr_scale"] if rollbacks else 1.0),
        skipped=[list(r) for r in book.skipped]
        if book is not None
        else [list(r["skipped"]) for r in rollbacks if r["skipped"]],
    )
    report.images = _plots(steps, out)
    report.records = records
    if records.incidents:
        g = records.goodput
        report.images["incidents"] = plot_incidents(
            records.incidents,
            out / "incidents.png",
            started_at=g.started_at if g is not None else None,
            ended_at=g.ended_at if g is not None else None,
        )
    if records.goodput is not None:
        report.images["badput"] = plot_badput(records.goodput, out / "badput.png")
    report.healthy_at_end = healthy_at_end
    report.html.write_text(_page(report, steps, book, facts), encoding="utf-8")
    return report


# ---------------------------------------------------------------- series


def branches(steps: list[dict[str, Any]]) -> list[tuple[list[dict[str, Any]], list[bool]]]:
    """Split the step reports at each rollback; mark each report kept (True) or abandoned.

    A report is abandoned when a later branch went back to its step or before it.
    """
    segments: list[list[dict[str, Any]]] = [[]]
    for e in steps:
        segments[-1].append(e)
        if e.get("action") == Action.ROLLBACK:
            segments.append([])
    segments = [s for s in segments if s]
    out = []
    for i, seg in enumerate(segments):
        later = min((s[0]["step"] for s in segments[i + 1 :]), default=math.inf)
        out.append((seg, [e["step"] < later for e in seg]))
    return out


def _runs(xs: list[float], ys: list[float], kept: list[bool]) -> Iterable[tuple[list, list, bool]]:
    """Consecutive stretches of equal ``kept``; a stretch repeats the previous point, so the
    line stays connected where the kept part turns into the abandoned one."""
    start = 0
    for i in range(1, len(xs) + 1):
        if i == len(xs) or kept[i] != kept[start]:
            lo = max(0, start - 1)
            yield xs[lo:i], ys[lo:i], kept[start]
            start = i


def _series(
    ax: Any,
    steps: list[dict[str, Any]],
    value: Any,
    color: str,
    label: str | None,
    x_of: Any = lambda e: e["step"],
) -> None:
    """Plot ``value(report)`` (None: no point) along every branch."""
    for seg, kept in branches(steps):
        points = [(x_of(e), value(e), k) for e, k in zip(seg, kept) if value(e) is not None]
        if not points:
            continue
        xs, ys, ks = (list(t) for t in zip(*points))
        for rx, ry, keep in _runs(xs, ys, ks):
            ax.plot(
                rx,
                ry,
                color=color,
                lw=1.4 if keep else 1.0,
                alpha=1.0 if keep else 0.35,
                ls="-" if keep else "--",
                label=label if keep else None,
            )
            if keep:
                label = None


def _rollback_lines(ax: Any, steps: list[dict[str, Any]]) -> None:
    for e in steps:
        if e.get("action") == Action.ROLLBACK:
            ax.axvline(e["step"], color=ROLLBACK_COLOR, ls=":", lw=1.2)


def _block_names(steps: list[dict[str, Any]], key: str) -> list[str]:
    names: list[str] = []
    for e in steps:
        for b in e.get(key) or {}:
            if b not in names:
                names.append(b)
    return names


# ---------------------------------------------------------------- plots


def _plots(steps: list[dict[str, Any]], out: Path) -> dict[str, Path]:
    from matplotlib.figure import Figure  # no pyplot: leaves the user's backend alone

    images = {}
    for name, draw in (
        ("loss", _plot_loss),
        ("grad_norm", _plot_grad_norm),
        ("update_ratio", _plot_update_ratio),
        ("activations", _plot_activations),
    ):
        fig = Figure(figsize=(9, 4.2), dpi=100)
        ax = fig.subplots()
        draw(ax, steps)
        _rollback_lines(ax, steps)
        ax.set_xlabel("step (after a rollback the steps are counted again from the checkpoint)")
        ax.grid(alpha=0.3)
        handles, _ = ax.get_legend_handles_labels()
        if handles:
            ax.legend(fontsize=7, loc="best", ncol=2 if len(handles) > 6 else 1)
        fig.tight_layout()
        images[name] = out / f"{name}.png"
        fig.savefig(images[name])
    return images


def _finite_loss(e: dict[str, Any]) -> float | None:
    loss = json_number(e.get("loss"))
    return loss if math.isfinite(loss) else None


def _plot_loss(ax: Any, steps: list[dict[str, Any]]) -> None:
    ax.set_title("loss (mean over ranks), verdicts and rollbacks")
    finite = _finite_loss
    _series(ax, steps, finite, "#1f77b4", "loss (kept)")
    seen: set[tuple[str, Any]] = set()
    top = max((loss for loss in map(finite, steps) if loss is not None), default=1.0)
    for e in steps:
        for v in e.get("verdicts") or []:
            sev = v.get("severity", INFO)
            y = finite(e) if finite(e) is not None else top
            label = f"{sev}: {v['pattern']}" if (sev, v["pattern"]) not in seen else None
            seen.add((sev, v["pattern"]))
            ax.scatter(
                [e["step"]],
                [y],
                marker="^" if sev == WARNING else "X",
                s=60,
                zorder=5,
                color=SEVERITY_COLORS.get(sev, "gray"),
                label=label,
            )
        if e.get("action") == Action.ROLLBACK:
            rb = Rollback.from_dict(e["rollback"])
            ax.annotate(
                f"rollback to step {rb.to_step}\nlr x{rb.lr_scale:g}, {_skipped(rb.skipped)}",
                xy=(e["step"], finite(e) or top),
                xytext=(-150, -10),
                textcoords="offset points",
                fontsize=8,
                color=ROLLBACK_COLOR,
                arrowprops=dict(arrowstyle="->", color=ROLLBACK_COLOR),
            )
    ax.set_ylabel("loss")


def _plot_grad_norm(ax: Any, steps: list[dict[str, Any]]) -> None:
    ax.set_title("gradient L2 norm per block")
    for i, b in enumerate(_block_names(steps, "grad_norm")):
        value = lambda e, b=b: _positive((e.get("grad_norm") or {}).get(b))  # noqa: E731
        _series(ax, steps, value, f"C{i % 10}", b)
    ax.set_yscale("log")
    ax.set_ylabel("grad norm")


def _plot_update_ratio(ax: Any, steps: list[dict[str, Any]]) -> None:
    ax.set_title("update ratio |dw|/|w| per block (sampled steps)")
    ax.axhspan(*HEALTHY_BAND, color="#2ca02c", alpha=0.12, label="healthy band around 1e-3")
    ax.axhline(1e-3, color="#2ca02c", lw=0.8)
    ax.axhline(1e-2, color=SEVERITY_COLORS[CRITICAL], lw=0.8, ls="--", label=f"{HOT_LR} (1e-2)")
    sampled = [e for e in steps if e.get("update_ratio")]
    for i, b in enumerate(_block_names(sampled, "update_ratio")):
        value = lambda e, b=b: _positive(e["update_ratio"].get(b))  # noqa: E731
        # The ratio rides the next sampled step's report; it describes update_ratio_step.
        _series(
            ax,
            sampled,
            value,
            f"C{i % 10}",
            b,
            x_of=lambda e: e.get("update_ratio_step") or e["step"],
        )
    ax.set_yscale("log")
    ax.set_ylabel("update ratio")


def _plot_activations(ax: Any, steps: list[dict[str, Any]]) -> None:
    ax.set_title("activation abs max per block output (sampled steps)")
    sampled = [e for e in steps if e.get("activations")]
    for i, b in enumerate(_block_names(sampled, "activations")):
        value = lambda e, b=b: _positive((e["activations"].get(b) or {}).get("abs_max"))  # noqa: E731
        _series(ax, sampled, value, f"C{i % 10}", b)
    ax.set_yscale("log")
    ax.set_ylabel("|activation| max")


def _positive(x: Any) -> float | None:
    """A value a log axis can show, else None (no point)."""
    v = json_number(x)
    return v if math.isfinite(v) and v > 0 else None


# ---------------------------------------------------------------- the page

CSS = """
body{font:15px/1.45 system-ui,sans-serif;max-width:980px;margin:2em auto;padding:0 1em;color:#222}
h1{font-size:1.5em}h2{font-size:1.15em;margin-top:1.6em;border-bottom:1px solid #ddd}
pre{background:#f6f6f6;padding:.8em;white-space:pre-wrap}table{border-collapse:collapse}
td,th{padding:.2em .8em;border-bottom:1px solid #eee;text-align:left}img{max-width:100%}
.warning{color:#b07800}.critical{color:#d62728}.rollback{color:#9b30ff}"""


def _page(
    report: RunReport,
    steps: list[dict[str, Any]],
    book: Ledger | None,
    extra_facts: Sequence[tuple[str, str]],
) -> str:
    esc = html.escape
    facts = [
        *extra_facts,
        ("steps", report.steps),
        ("final loss", f"{report.final_loss:.4f}"),
        ("rollbacks", len(report.rollbacks)),
        ("learning-rate scale", f"{report.lr_scale:g}"),
        ("batches skipped", sum(b - a for a, b in report.skipped)),
    ]
    if report.healthy_at_end is not None:
        facts.append(("finished healthy", "yes" if report.healthy_at_end else "no"))
    if report.records is not None:
        facts.append(("incidents", len(report.incidents)))
    if report.goodput is not None:
        facts.append(("goodput", f"{report.goodput.goodput:.1%}"))
    rows = "".join(f"<tr><th>{esc(k)}</th><td>{esc(str(v))}</td></tr>" for k, v in facts)
    timeline = []
    for e in steps:
        for v in e.get("verdicts") or []:
            where = f" in {v['block']}" if v.get("block") else ""
            sev = v.get("severity", INFO)
            timeline.append(
                f"<li class='{esc(sev)}'>step {e['step']}: {esc(sev)} "
                f"<b>{esc(v['pattern'])}</b>{esc(where)}</li>"
            )
        if e.get("action") == Action.ROLLBACK:
            rb = Rollback.from_dict(e["rollback"])
            timeline.append(
                f"<li class='rollback'>step {e['step']}: <b>rollback</b> to step "
                f"{rb.to_step}, lr scale {rb.lr_scale:g}, {esc(_skipped(rb.skipped))}</li>"
            )
    ledger_rows = "".join(
        f"<tr><td>{esc(x['event'])}</td><td>{x['step']}</td><td>{esc(_ledger_detail(x))}</td></tr>"
        for x in (book.entries if book is not None else [])
    )
    images = "".join(
        f"<h2>{esc(name.replace('_', ' '))}</h2><img src='{esc(path.name)}' alt='{esc(name)}'>"
        for name, path in report.images.items()
        if name in PLOTS
    )
    disruptions = (
        incidents_html(report.records, report.images.get("incidents"))
        + goodput_html(report.records, report.images.get("badput"))
        if report.records is not None
        else ""
    )
    title = f"torchvitals run report: {report.run_dir.name}"
    return f"""<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>{esc(title)}</title>
<style>{CSS}</style></head><body>
<h1>{esc(title)}</h1>
<table>{rows}</table>
<h2>diagnosis</h2>
<pre>{esc(report.diagnosis.render())}</pre>
{disruptions}
<h2>verdicts and rollbacks</h2>
<ul>{"".join(timeline) or "<li>none</li>"}</ul>
{images}
<h2>ledger</h2>
{
        f"<table><tr><th>event</th><th>step</th><th></th></tr>{ledger_rows}</table>"
        if ledger_rows
        else "<p>no ledger (the watchdog was off)</p>"
    }
</body></html>
"""


def _ledger_detail(entry: dict[str, Any]) -> str:
    if entry["event"] == "rollback":
        again = (
            f", a repeat of the rollback at step {entry['repeat_of']}"
            if entry.get("repeat_of") is not None
            else ""
        )
        return (
            f"to step {entry['to_step']} ({entry['reason']}), lr scale {entry['lr_scale']:g}, "
            f"{_skipped(entry['skipped'])}{again}"
        )
    if entry["event"] == "distrust":
        return f"{os.path.basename(entry['path'])} never restored: {entry['reason']}"
    if entry["event"] == "checkpoint":
        return os.path.basename(entry["path"])
    if entry["event"] == "trust":
        fingerprint = (
            f", state fingerprint {entry['fingerprint']}" if "fingerprint" in entry else ""
        )
        return (
            f"{os.path.basename(entry['path'])} trusted: clean through step "
            f"{entry['clean_through']}{fingerprint}"
        )
    if entry["event"] == "ramp":
        return f"lr scale back to {entry['lr_scale']:g}"
    if entry["event"] == "adopt":
        return f"from {entry['source']}, lr scale {entry['lr_scale']:g}"
    return entry.get("reason", "")


def _skipped(skipped: Sequence[int] | None) -> str:
    """What a rollback did about the batches that led to it: skipped them, or (a loop that
    draws its own) re-seeded the RNGs so the same draws do not come back."""
    if not skipped:
        return "the loop's RNGs re-seeded"
    return f"batches {skipped[0]}..{skipped[1] - 1} skipped"
