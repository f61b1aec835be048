"""torchvitals command line: the demo, a run's report or diagnosis, preflight, the supervisor.

    torchvitals demo --fault lr-spike --ranks 2 --steps 150 --out torchvitals_demo/run
    torchvitals report torchvitals_runs/<run> [--job-dir ckpt]
    torchvitals diagnose torchvitals_runs/<run>/events.jsonl [--job-dir ckpt]
    torchvitals preflight mypkg.train:preflight_setup --steps 300 --png lr_range.png
    torchvitals supervise --checkpoint-dir ckpt -- torchrun --nproc-per-node 8 train.py
    torchvitals incidents ckpt [--json]
    torchvitals goodput ckpt [--json]
    torchvitals backtest run.csv [more pieces ...] [--json] [--plot run.png]
    python -m torchvitals --help            # the same program

``demo`` trains a small GPT on the bundled text with ``--ranks`` CPU ranks (gloo) under the agent,
injects ``--fault`` (lr-spike, nan, frozen or none) mid-run, shows the live view, and writes the
run report into ``--out`` (default ``torchvitals_demo/<time>``; an existing run folder is refused:
the watchdog would resume it). Exit 0 when it finished, 1 when a rank failed (named), 2 on bad
options. Flags from ``TORCHVITALS_DEMO_<FLAG>`` too.

``report`` writes the run report of a run folder (the one holding events.jsonl): loss, grad norm,
update ratio and activation plots (PNG), the incident timeline and the badput breakdown when the
job folder holds incidents and goodput records, and report.html with the diagnosis; exit 2 when
the log is missing or corrupt.

``diagnose`` prints the decision-tree diagnosis of a run's event log, led by the culprit when an
incident record or a verdict names one (exit 0; exit 2 with a one-line error when the log is
missing or corrupt).

Both look for the job's incidents/ and goodput/ in the run folder and the watchdog ledger's
folder; ``--job-dir`` (repeatable; env ``TORCHVITALS_REPORT_JOB_DIR`` /
``TORCHVITALS_DIAGNOSE_JOB_DIR``, one folder) names the shared checkpoint folder when it lies
elsewhere.

``supervise`` runs the command after ``--`` and restarts it when it crashes or its heartbeat
stalls (``torchvitals.supervisor``: exit 0 when the job exits 0, 76 when restarts stop making
progress, 77 when the restart budget is spent). Its flags are read from
``TORCHVITALS_SUPERVISOR_<FLAG>`` too (``--help`` lists them).

``incidents`` lists the job's incidents (a hang, a crash, a lost node, a non-finite step...):
when, what, at which step, the culprit (global rank, node, host, pid), the cause, the seconds
from detection to localization and to recovery, and what each cost. DIR is the job's folder
(the checkpoint_dir the ranks and supervisors share, or the run folder without one) or its
``incidents/``; ``--json`` prints the records as a list of objects. A corrupt record is named on
stderr and skipped; exit 2 when DIR is not a folder.

``goodput`` prints the job's wall time, its productive time and their ratio, the rest (badput)
by cause and each incident's lost seconds, across every attempt (the rules: records/goodput.py);
``--json`` prints them as one object. DIR as for ``incidents`` (or its ``goodput/``); exit 2
with a one-line error when it holds no records. Both read ``--json`` from
``TORCHVITALS_INCIDENTS_JSON`` / ``TORCHVITALS_GOODPUT_JSON`` too.

``backtest`` replays a past run's log (CSV, TSV, JSONL, TensorBoard event files, Megatron-style
lines; gzipped too; several FILEs are pieces of one run in order, a later piece winning where
steps overlap) through the live detector with its default thresholds (``--detect JSON``
overrides them, as ``watch(detect=...)``) and prints the pages and warnings it would have raised,
by pattern with their steps and as rates per 100k steps; ``--json`` prints one object instead,
``--plot OUT.png`` draws the loss and grad norm with the findings marked. Exit 0 when it read the
log, 2 with one line naming the file and the problem when it could not. Flags from
``TORCHVITALS_BACKTEST_<FLAG>`` too (``--detect`` from ``TORCHVITALS_DETECT``, as the agent).

``preflight`` imports MODULE, calls FACTORY() and runs the memorization test, the learning-rate
range test and the wiring checks (exit 0 when all pass, 1 when one fails, 2 when the factory
cannot be loaded). FACTORY returns a dict:

    # mypkg/train.py
    def preflight_setup():
        model = MyModel()
        x, y = next(iter(train_loader))
        return {
            "model": model,                                        # required
            "loss_fn": lambda m, b: F.cross_entropy(m(b[0]), b[1]),  # required: (model, batch)
            "batch": (x[:12], y[:12]),                             # required: memorization batch
            "batches": [next(it) for _ in range(20)],              # LR test (default: [batch])
            "optimizer": lambda params: torch.optim.AdamW(params, lr=3e-4),  # default: Adam(3e-3)
            "evaluate": lambda m: run_validation(m, val_loader),   # checks train/eval wiring
            "model_factory": MyModel,                              # LR test (default: copies)
        }

MODULE is imported from the current directory and sys.path. Every option can also be set from
the environment; precedence: argument > environment > default. ``--steps``
(TORCHVITALS_PREFLIGHT_STEPS, 300), ``--lr-steps`` (TORCHVITALS_PREFLIGHT_LR_STEPS, 100),
``--png`` (TORCHVITALS_PREFLIGHT_PNG, no plot).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

from .errors import ConfigError, TorchvitalsError
from .protocol import DEMO_FAULTS
from .supervisor.options import SupervisorConfig


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Parse the command line (``sys.argv[1:]`` when ``argv`` is None)."""
    # Defaults stay strings: argparse runs them through `type`, so a bad environment value
    # fails like a bad flag, with a usage line and exit 2.
    env = os.environ.get
    # prog: the console script's name, also under `python -m torchvitals` (argparse would say
    # "__main__.py" there), so --help and every usage error name the command users type.
    parser = argparse.ArgumentParser(prog="torchvitals", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    d = sub.add_parser("diagnose", help="name the root cause of a run from its event log")
    d.add_argument("events", help="the run's events.jsonl (or the run folder holding it)")
    p = sub.add_parser(
        "preflight", help="memorization, LR range and wiring checks before a long run"
    )
    p.add_argument("factory", metavar="MODULE:FACTORY", help="callable returning the setup dict")
    p.add_argument(
        "--steps",
        type=int,
        default=env("TORCHVITALS_PREFLIGHT_STEPS", "300"),
        help="memorization steps (default: 300; env TORCHVITALS_PREFLIGHT_STEPS)",
    )
    p.add_argument(
        "--lr-steps",
        type=int,
        default=env("TORCHVITALS_PREFLIGHT_LR_STEPS", "100"),
        help="LR range test steps (default: 100; env TORCHVITALS_PREFLIGHT_LR_STEPS)",
    )
    p.add_argument(
        "--png",
        default=env("TORCHVITALS_PREFLIGHT_PNG") or None,
        help="save the LR range plot here (default: no plot; env TORCHVITALS_PREFLIGHT_PNG)",
    )
    demo = sub.add_parser(
        "demo",
        help="train a small GPT on 2 CPU ranks, inject a fault, "
        "watch torchvitals catch it and roll back",
    )
    demo.add_argument(
        "--fault",
        choices=DEMO_FAULTS,
        default=env("TORCHVITALS_DEMO_FAULT", "lr-spike"),
        help="the fault injected mid-run (default: lr-spike; env TORCHVITALS_DEMO_FAULT)",
    )
    demo.add_argument(
        "--ranks",
        type=int,
        default=env("TORCHVITALS_DEMO_RANKS", "2"),
        help="CPU ranks (default: 2; env TORCHVITALS_DEMO_RANKS)",
    )
    demo.add_argument(
        "--steps",
        type=int,
        default=env("TORCHVITALS_DEMO_STEPS", "200"),
        help="training steps (default: 200; env TORCHVITALS_DEMO_STEPS)",
    )
    demo.add_argument(
        "--out",
        default=env("TORCHVITALS_DEMO_OUT") or None,
        help="run folder (default: torchvitals_demo/<time>; env TORCHVITALS_DEMO_OUT)",
    )
    demo.add_argument(
        "--metrics-port",
        type=int,
        default=env("TORCHVITALS_DEMO_METRICS_PORT", "0"),
        help="base port of the ranks' /metrics (default: 0, free ports; env "
        "TORCHVITALS_DEMO_METRICS_PORT)",
    )
    demo.add_argument(
        "--timeout-s",
        type=float,
        default=env("TORCHVITALS_DEMO_TIMEOUT_S", "600"),
        help="stop the ranks past this many seconds (default: 600; env TORCHVITALS_DEMO_TIMEOUT_S)",
    )
    r = sub.add_parser("report", help="plots and an HTML page with the diagnosis of a run")
    r.add_argument("run_dir", help="the run folder (holding events.jsonl)")
    r.add_argument(
        "--ledger",
        default=None,
        help="the watchdog's ledger.json (default: found in the run folder or one below it)",
    )
    for reader in (d, r):
        reader.add_argument(
            "--job-dir",
            action="append",
            default=None,
            help="the job's folder holding incidents/ and goodput/ (the shared checkpoint_dir), "
            "besides the run folder and the ledger's; repeatable (default: none; env "
            f"TORCHVITALS_{reader.prog.split()[-1].upper()}_JOB_DIR)",
        )
    job_commands = {
        "incidents": "the job's incidents: what stopped it, who and where, what it cost",
        "goodput": "the job's productive time over its wall time, and the rest by cause",
    }
    for name, what in job_commands.items():
        c = sub.add_parser(name, help=what, description=what)
        c.add_argument(
            "folder",
            metavar="DIR",
            help=f"the job's folder (the shared checkpoint_dir, or the run folder) or its {name}/",
        )
        c.add_argument(
            "--json",
            action=argparse.BooleanOptionalAction,
            default=None,
            help=f"print JSON (default: False; env TORCHVITALS_{name.upper()}_JSON)",
        )
    b = sub.add_parser(
        "backtest",
        help="replay a past run's log through the detector: what would have paged",
        description="replay a past run's log through the detector: what would have paged",
    )
    b.add_argument("files", metavar="FILE", nargs="+", help="the log, or its pieces in order")
    b.add_argument(
        "--format",
        default=env("TORCHVITALS_BACKTEST_FORMAT", "auto"),
        # Checked by the reader (exit 2 naming the choices): the choices live beside it, and
        # importing it here would load the agent's package for every other command.
        help="auto, csv, tsv, jsonl, tensorboard or megatron (default: auto, by name then "
        "content; env TORCHVITALS_BACKTEST_FORMAT)",
    )
    b.add_argument(
        "--json",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="print one JSON object (default: False; env TORCHVITALS_BACKTEST_JSON)",
    )
    b.add_argument(
        "--plot",
        metavar="OUT.png",
        default=env("TORCHVITALS_BACKTEST_PLOT") or None,
        help="draw the loss and grad norm with the findings marked (default: no plot; env "
        "TORCHVITALS_BACKTEST_PLOT)",
    )
    b.add_argument(
        "--detect",
        metavar="JSON",
        default=env("TORCHVITALS_DETECT") or None,
        help="threshold overrides, e.g. '{\"loss_spike_mads\": 8}' (default: none; env "
        "TORCHVITALS_DETECT)",
    )
    s = sub.add_parser(
        "supervise",
        help="run a training command, restart it on a crash or hang",
        usage="%(prog)s [options] -- CMD [ARGS...]",
    )
    SupervisorConfig.add_arguments(s)
    if argv is None:
        argv = sys.argv[1:]
    command: list[str] = []
    if argv[:1] == ["supervise"] and "--" in argv:
        cut = argv.index("--")
        argv, command = argv[:cut], argv[cut + 1 :]
    args = parser.parse_args(argv)
    args.job_command = command
    if args.command in ("diagnose", "report") and args.job_dir is None:
        folder = env(f"TORCHVITALS_{args.command.upper()}_JOB_DIR")
        args.job_dir = [folder] if folder else []
    if args.command in (*job_commands, "backtest") and args.json is None:
        key = f"TORCHVITALS_{args.command.upper()}_JSON"
        text = env(key, "").strip().lower()
        if text not in ("", "0", "false", "no", "off", "1", "true", "yes", "on"):
            sub.choices[args.command].error(f"{key}={text!r}: expected true or false")
        args.json = text in ("1", "true", "yes", "on")
    return args


def main(argv: list[str] | None = None) -> int:
    """Run one command.

    Args:
        argv: the arguments after ``torchvitals`` (default: ``sys.argv[1:]``).

    Returns:
        The exit code: 0 done/passed, 1 preflight failed, 2 unreadable input or bad factory.
    """
    args = parse_args(argv)
    if args.command == "supervise":
        return _supervise(args)
    if args.command == "demo":
        return _demo(args)
    if args.command == "incidents":
        return _incidents(args)
    if args.command == "goodput":
        return _goodput(args)
    if args.command == "backtest":
        return _backtest(args)
    try:
        if args.command == "diagnose":
            from .agent.tools.diagnose import diagnose_events

            print(diagnose_events(args.events, job_dirs=args.job_dir).render())
            return 0
        if args.command == "report":
            from .agent.tools.runreport import write_report

            report = write_report(args.run_dir, ledger=args.ledger, job_dirs=args.job_dir)
            print(report.render_summary())
            print(f"report: {report.html}")
            return 0
        from .agent.tools.preflight import load_setup, preflight

        setup = load_setup(args.factory)
    except (OSError, ValueError, ImportError, AttributeError, TorchvitalsError) as exc:
        # One line, not a traceback: the usual causes are a wrong path or a wrong name. Errors
        # raised while the checks run are the user's code failing and keep their traceback.
        print(f"torchvitals {args.command}: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 2
    checked = preflight(**setup, steps=args.steps, lr_steps=args.lr_steps, png=args.png)
    print(checked.render())
    return 0 if checked.passed else 1


def _demo(args: argparse.Namespace) -> int:
    import time

    from .agent.tools.demo.launch import run_demo
    from .agent.tools.demo.train import DemoRun

    out = args.out or os.path.join("torchvitals_demo", time.strftime("%Y%m%d-%H%M%S"))
    if os.path.exists(os.path.join(out, "events.jsonl")) or os.path.exists(
        os.path.join(out, "checkpoints")
    ):
        print(
            f"torchvitals demo: {out} holds a run already (its watchdog would resume it); "
            f"choose another --out or remove it",
            file=sys.stderr,
        )
        return 2
    try:
        if args.ranks < 1:
            raise ValueError(f"--ranks must be >= 1, got {args.ranks}")
        run = DemoRun(out=out, steps=args.steps, fault=args.fault, metrics_port=args.metrics_port)
    except ValueError as exc:
        print(f"torchvitals demo: {exc}", file=sys.stderr)
        return 2
    return run_demo(run, world=args.ranks, timeout_s=args.timeout_s)


def _job_folder(given: str, sub: str) -> Path:
    """The job's folder from DIR, which may also be its ``sub`` folder itself."""
    folder = Path(given)
    if folder.name == sub and not (folder / sub).is_dir():
        return folder.parent
    return folder


def _incidents(args: argparse.Namespace) -> int:
    from .records.incidents import FOLDER, IncidentLog

    folder = _job_folder(args.folder, FOLDER)
    if not folder.is_dir():
        print(f"torchvitals incidents: {args.folder}: not a folder", file=sys.stderr)
        return 2
    found, problems = IncidentLog(folder).read()
    for problem in problems:
        print(f"torchvitals incidents: skipped {problem}", file=sys.stderr)
    if args.json:
        print(json.dumps([i.to_dict() for i in found], indent=1))
    elif not found:
        print(f"no incidents recorded in {folder / FOLDER}")
    else:
        print(_incident_table(found, _accounted(folder)))
    return 0


def _accounted(folder: Path) -> dict[str, float | None]:
    """Each incident's lost seconds as the goodput accounting finds them ({} without records)."""
    from .records.goodput import GoodputError, account

    try:
        return {i.key: i.lost_seconds for i in account(folder).incidents}
    except GoodputError:
        return {}


def _incident_table(found: list, accounted: dict[str, float | None]) -> str:
    """One row per incident: when, what, who, how fast it was found and fixed, what it cost
    (``~`` before what the goodput accounting found for a record that says nothing)."""

    def after(t: float | None, t0: float) -> str:
        return "-" if t is None else f"+{t - t0:.1f}"

    def shown(v: object) -> str:
        return "-" if v is None else str(v)

    def lost(key: str, seconds: float | None) -> str:
        if seconds is not None:
            return f"{seconds:.1f}"
        found = accounted.get(key)
        return "-" if found is None else f"~{found:.1f}"

    header = ("detected", "kind", "step", "rank", "node", "host", "pid", "localized", "recovered")
    rows = [(*header, "lost s", "cause")]
    for i in found:
        c = i.culprit
        rows.append(
            (
                time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(i.detected_at)),
                i.kind,
                shown(i.step),
                shown(c.rank),
                shown(c.node),
                shown(c.host),
                shown(c.pid),
                after(i.localized_at, i.detected_at),
                after(i.recovered_at, i.detected_at),
                lost(i.key, i.lost_seconds),
                i.cause,
            )
        )
    widths = [max(len(r[k]) for r in rows) for k in range(len(rows[0]) - 1)]
    return "\n".join(
        "  ".join(v.ljust(w) for v, w in zip(r[:-1], widths, strict=True)) + "  " + r[-1]
        for r in rows
    )


def _goodput(args: argparse.Namespace) -> int:
    from .records.goodput import FOLDER, GoodputError, account

    try:
        figures = account(_job_folder(args.folder, FOLDER))
    except GoodputError as exc:
        print(f"torchvitals goodput: {exc}", file=sys.stderr)
        return 2
    print(json.dumps(figures.to_dict(), indent=1) if args.json else figures.render())
    return 0


def _backtest(args: argparse.Namespace) -> int:
    from .agent.detect.thresholds import Thresholds
    from .agent.tools.backtest.logs import read_logs
    from .agent.tools.backtest.replay import replay

    try:
        overrides = json.loads(args.detect) if args.detect else None
        if overrides is not None and not isinstance(overrides, dict):
            raise ConfigError("--detect", args.detect, "a JSON object of threshold overrides")
        thresholds = Thresholds.from_overrides(overrides)
        series = read_logs(args.files, args.format)
    except json.JSONDecodeError as exc:
        print(f"torchvitals backtest: --detect is not JSON: {exc}", file=sys.stderr)
        return 2
    except TorchvitalsError as exc:
        print(f"torchvitals backtest: {exc}", file=sys.stderr)
        return 2
    result = replay(series, thresholds)
    print(json.dumps(result.to_dict()) if args.json else result.render())
    if args.plot:
        from .agent.tools.backtest.plot import plot_backtest

        try:
            print(f"plot: {plot_backtest(series, result, args.plot)}", file=sys.stderr)
        except OSError as exc:
            print(f"torchvitals backtest: --plot {args.plot}: {exc}", file=sys.stderr)
            return 2
    return 0


def _supervise(args: argparse.Namespace) -> int:
    from .supervisor.command import supervise

    flags = {
        k: v for k, v in vars(args).items() if k not in ("command", "job_command") and v is not None
    }
    if not args.job_command:
        print("torchvitals supervise: no command to run (put it after --)", file=sys.stderr)
        return 2
    try:
        config = SupervisorConfig.from_env(**flags)
    except ValueError as exc:
        print(f"torchvitals supervise: {exc}", file=sys.stderr)
        return 2
    return supervise(config, args.job_command)


if __name__ == "__main__":
    sys.exit(main())
