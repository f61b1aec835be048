"""The live terminal view: the vital signs of the last steps, verdicts and rollbacks as they come.

    TORCHVITALS_LIVE=1 torchrun --nproc-per-node 2 train.py      # or watch(..., live=True)

Global rank 0 draws it from the ``Report`` the agent already produced (host floats): it adds no
device sync and no collective to the step. On a terminal it is a ``rich`` panel redrawn a few
times a second (step, loss, total grad norm, per-block grad-norm sparklines and update-ratio bars,
active verdicts in colour, the rollbacks), with each verdict and rollback also printed as a line
above it. When stdout is not a terminal (CI, a file, a pipe) it writes plain lines instead: one
status line every ``every`` steps and one line per verdict, rollback and skipped step, no escape
codes.
"""

from __future__ import annotations

import math
import sys
import time
from collections import deque
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any, ClassVar, TextIO

from ..detect.verdict import CRITICAL, INFO, WARNING
from ..report import Action, Report

if TYPE_CHECKING:
    from rich.console import JustifyMethod, RenderableType
    from rich.live import Live

SPARKS = "▁▂▃▄▅▆▇█"
HEALTHY_RATIO = 1e-3
"""The rule-of-thumb update ratio of a well-tuned learning rate (log10 ≈ -3)."""
RATIO_RANGE = (-6.0, -1.0)
"""log10 range of the update-ratio bars: 1e-6 (dead, the detector's dead_ratio) to 1e-1."""


def sparkline(values: Iterable[float]) -> str:
    """Values as block characters scaled between their min and max (NaN/Inf as a space)."""
    values = list(values)
    finite = [v for v in values if math.isfinite(v)]
    if not finite:
        return " " * len(values)
    lo, hi = min(finite), max(finite)
    span = hi - lo or 1.0
    return "".join(
        SPARKS[min(7, int((v - lo) / span * 8))] if math.isfinite(v) else " " for v in values
    )


def ratio_bar(ratio: float, width: int = 12) -> str:
    """An update ratio as a bar on a log scale from 1e-6 to 1e-1 (``|`` marks 1e-3)."""
    lo, hi = RATIO_RANGE
    mark = round((math.log10(HEALTHY_RATIO) - lo) / (hi - lo) * width)
    filled = 0
    if ratio > 0 and math.isfinite(ratio):
        filled = max(1, min(width, round((math.log10(ratio) - lo) / (hi - lo) * width)))
    elif not math.isfinite(ratio):
        filled = width
    cells = ["█" if i < filled else " " for i in range(width)]
    if cells[mark - 1] == " ":
        cells[mark - 1] = "|"
    return "".join(cells)


def ratio_state(ratio: float) -> str:
    """ "hot", "dead" or "ok": where an update ratio sits against the detector's defaults."""
    if not math.isfinite(ratio) or ratio >= 1e-2:
        return "hot"
    if ratio <= 1e-6:
        return "dead"
    return "ok"


def _fmt(x: float | None, spec: str = ".4g") -> str:
    return "-" if x is None else format(x, spec)


def describe_event(report: Report) -> list[tuple[str, str]]:
    """(severity, text) lines for what happened at this step: verdicts, rollback, skip, abort."""
    lines = []
    for v in report.verdicts:
        ev = v.evidence or {}
        shown = ", ".join(
            f"{k}={_fmt(ev[k], '.3g') if isinstance(ev[k], float) else ev[k]}"
            for k in list(ev)[:3]
            if isinstance(ev[k], (int, float, str))
        )
        where = f" in {v.block}" if v.block else ""
        lines.append(
            (
                v.severity,
                f"{v.severity.upper()} step {v.step}: {v.pattern}{where}"
                + (f" ({shown})" if shown else ""),
            )
        )
    if report.action == Action.ROLLBACK and report.rollback is not None:
        rb = report.rollback
        if rb.skipped is not None:
            start, stop = rb.skipped
            skipped = f"batches {start}..{stop - 1} skipped ({stop - start})"
        else:
            skipped = "the loop's RNGs re-seeded"
        lines.append(
            (
                "rollback",
                f"ROLLBACK at step {report.step}: back to the healthy checkpoint "
                f"of step {rb.to_step}, learning rate x{rb.lr_scale:g}, {skipped}",
            )
        )
    elif report.action == Action.SKIP:
        lines.append((WARNING, f"SKIP step {report.step}: optimizer step skipped on every rank"))
    elif report.action == Action.ABORT:
        why = [v.pattern for v in report.verdicts if v.severity == CRITICAL]  # rollback_loop, say
        lines.append((CRITICAL, f"ABORT at step {report.step}: {why[-1] if why else 'gave up'}"))
    return lines


class LiveView:
    """Rank 0's view of the run; ``update`` after each step, ``close`` at the end.

    Args:
        blocks: the block names, in order.
        stream: where to write (default: stdout).
        terminal: draw the rich panel (True) or plain lines (False); None asks ``stream.isatty()``.
        every: plain mode writes a status line every this many steps (and at step 1).
        title: the panel's title (e.g. the metrics URL).
        history: steps kept for the sparklines.
        clock: seconds, for throttling the panel's redraws.
    """

    def __init__(
        self,
        blocks: list[str],
        *,
        stream: TextIO | None = None,
        terminal: bool | None = None,
        every: int = 10,
        title: str = "torchvitals",
        history: int = 16,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.blocks = list(blocks)
        self.stream = stream or sys.stdout
        if terminal is None:
            terminal = bool(getattr(self.stream, "isatty", lambda: False)())
        self.terminal = terminal
        self.every = max(1, every)
        self.title = title
        self._clock = clock
        self._norms: dict[str, deque[float]] = {b: deque(maxlen=history) for b in self.blocks}
        self._losses: deque[float] = deque(maxlen=history)
        self._ratios: dict[str, float] = {}
        self._abs_max: dict[str, float] = {}
        self._rollbacks: deque[str] = deque(maxlen=3)  # the panel shows the last 3
        self._last: Report | None = None
        self._active: list[Any] = []
        self._recovery: dict[str, float] | None = None
        self._drawn = -math.inf
        self._live: Live | None = None
        if terminal:
            from rich.console import Console
            from rich.live import Live

            self._console = Console(file=self.stream)
            self._live = Live(
                console=self._console, refresh_per_second=4, transient=False, auto_refresh=False
            )
            self._live.start()

    def update(
        self, report: Report, active: Iterable[Any] = (), recovery: dict[str, float] | None = None
    ) -> None:
        """Take one step's report.

        Args:
            report: the step's report (already on the host).
            active: the detector's active verdicts now.
            recovery: the watchdog's values (``rollbacks``, ``lr_scale``, ...), when it runs.
        """
        self._last, self._active, self._recovery = report, list(active), recovery
        self._losses.append(report.loss)
        for b, v in report.grad_norm.items():
            if b in self._norms:
                self._norms[b].append(v)
        if report.update_ratio:
            self._ratios = dict(report.update_ratio)
        if report.activations:
            self._abs_max = {b: a["abs_max"] for b, a in report.activations.items()}
        events = describe_event(report)
        if report.action == Action.ROLLBACK:
            self._rollbacks.append(events[-1][1])
        if self.terminal:
            self._draw(report, events)
        else:
            self._lines(report, events)

    # ------------------------------------------------------------ plain lines

    def _lines(self, report: Report, events: list[tuple[str, str]]) -> None:
        out = []
        if report.step == 1 or report.step % self.every == 0 or events:
            scale = self._recovery["lr_scale"] if self._recovery else 1.0
            out.append(
                f"step {report.step:5d}  loss {report.loss:8.4f}  grad_norm "
                f"{report.grad_norm_total:9.4g}  lr_scale {scale:g}  action {report.action}"
            )
            if self._ratios and report.update_ratio:
                out.append(
                    "  update_ratio "
                    + "  ".join(f"{b} {r:.1e}" for b, r in report.update_ratio.items())
                )
        out += [f"  {text}" for _, text in events]
        if out:
            self.stream.write("\n".join(out) + "\n")
            self.stream.flush()

    # ------------------------------------------------------------ the rich panel

    STYLES: ClassVar[dict[str, str]] = {
        INFO: "cyan",
        WARNING: "bold yellow",
        CRITICAL: "bold red",
        "rollback": "bold magenta",
    }

    def _draw(self, report: Report, events: list[tuple[str, str]]) -> None:
        from rich.text import Text

        live = self._live
        if live is None:
            raise RuntimeError("the live view was closed: update() after close()")
        for severity, text in events:
            live.console.print(Text(text, style=self.STYLES.get(severity, "")))
        now = self._clock()
        if events or now - self._drawn >= 0.25:
            self._drawn = now
            live.update(self._panel(report), refresh=True)

    def _panel(self, r: Report) -> Any:
        from rich.console import Group
        from rich.panel import Panel
        from rich.table import Table
        from rich.text import Text

        scale = self._recovery["lr_scale"] if self._recovery else 1.0
        rollbacks = int(self._recovery["rollbacks"]) if self._recovery else 0
        head = Text.assemble(
            ("step ", "dim"),
            (f"{r.step}", "bold"),
            ("  loss ", "dim"),
            (f"{r.loss:.4f} ", "bold"),
            (sparkline(self._losses), "cyan"),
            ("  grad norm ", "dim"),
            (f"{r.grad_norm_total:.3g}", "bold"),
            ("  lr x", "dim"),
            (f"{scale:g}", "bold" if scale == 1 else "bold magenta"),
            ("  rollbacks ", "dim"),
            (f"{rollbacks}", "bold" if not rollbacks else "bold magenta"),
        )
        table = Table(box=None, padding=(0, 1), header_style="dim")
        columns: tuple[tuple[str, JustifyMethod], ...] = (
            ("block", "left"),
            ("grad norm", "right"),
            ("last steps", "left"),
            ("update ratio", "right"),
            ("1e-6 ·|· 1e-1", "left"),
            ("act |max|", "right"),
        )
        for column, justify in columns:
            table.add_column(column, justify=justify, no_wrap=True)
        flagged = {v.block for v in self._active if getattr(v, "block", None)}
        for b in self.blocks:
            norms = self._norms[b]
            ratio = self._ratios.get(b)
            state = ratio_state(ratio) if ratio is not None else "ok"
            color = {"hot": "red", "dead": "yellow", "ok": "green"}[state]
            table.add_row(
                Text(b, style="bold yellow" if b in flagged else ""),
                _fmt(norms[-1] if norms else None, ".3g"),
                Text(sparkline(norms), style="cyan"),
                _fmt(ratio, ".1e"),
                Text(ratio_bar(ratio) if ratio is not None else "", style=color),
                _fmt(self._abs_max.get(b), ".3g"),
            )
        verdicts = Text("active: ", style="dim")
        if not self._active:
            verdicts.append("none", style="green")
        for v in self._active:
            where = f"@{v.block}" if v.block else ""
            verdicts.append(f"{v.pattern}{where} ", style=self.STYLES.get(v.severity, ""))
        parts: list[RenderableType] = [head, table, verdicts]
        parts += [Text(line, style="magenta") for line in self._rollbacks]
        return Panel(Group(*parts), title=self.title, title_align="left")

    def close(self) -> None:
        """Leave the last panel on the screen; safe to call twice."""
        if self._live is not None:
            if self._last is not None:
                self._live.update(self._panel(self._last), refresh=True)
            self._live.stop()
            self._live = None
