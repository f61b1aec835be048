"""Copy the canonical alert rules and dashboards from grafana/ into the Helm chart.

    python helm/sync.py            # refresh helm/torchvitals/files/ from grafana/
    python helm/sync.py --check    # exit 1 and list the stale copies, change nothing

Helm reads no file outside the chart's folder, so the chart carries copies of
``grafana/rules/*.rules.yml`` (not the rules' promtool tests) and ``grafana/dashboards/*.json``;
the PrometheusRule and the dashboard ConfigMaps are rendered from them.
``tests/deploy/test_helm_chart.py`` fails when a copy differs from its canonical file, so edit
grafana/ and run this, never the copies.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CHART_FILES = ROOT / "helm" / "torchvitals" / "files"
COPIES = {
    # canonical folder -> (glob, folder of the copies in the chart)
    ROOT / "grafana" / "rules": ("*.rules.yml", CHART_FILES / "rules"),
    ROOT / "grafana" / "dashboards": ("*.json", CHART_FILES / "dashboards"),
}


def plan() -> tuple[dict[Path, Path], list[Path]]:
    """What a sync would do.

    Returns:
        ``(copies, extra)``: every canonical file mapped to its copy in the chart, and the files
        in the chart's copy folders that have no canonical file any more.
    """
    copies: dict[Path, Path] = {}
    extra: list[Path] = []
    for source_dir, (pattern, target_dir) in COPIES.items():
        sources = sorted(source_dir.glob(pattern))
        copies.update({src: target_dir / src.name for src in sources})
        names = {src.name for src in sources}
        extra += sorted(p for p in target_dir.glob(pattern) if p.name not in names)
    return copies, extra


def stale() -> list[str]:
    """Returns: one line per copy that is missing, differs, or has no canonical file."""
    copies, extra = plan()
    problems = [
        f"{dst.relative_to(ROOT)} differs from {src.relative_to(ROOT)}"
        for src, dst in copies.items()
        if not dst.exists() or dst.read_bytes() != src.read_bytes()
    ]
    problems += [f"{p.relative_to(ROOT)} has no canonical file in grafana/" for p in extra]
    return problems


def sync() -> list[str]:
    """Make the chart's copies equal to the canonical files.

    Returns:
        What changed, one line per file.
    """
    copies, extra = plan()
    changed = []
    for src, dst in copies.items():
        if not dst.exists() or dst.read_bytes() != src.read_bytes():
            dst.parent.mkdir(parents=True, exist_ok=True)
            dst.write_bytes(src.read_bytes())
            changed.append(f"copied {src.relative_to(ROOT)} -> {dst.relative_to(ROOT)}")
    for p in extra:
        p.unlink()
        changed.append(f"removed {p.relative_to(ROOT)}")
    return changed


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="only report stale copies")
    args = parser.parse_args(argv)
    lines = stale() if args.check else sync()
    for line in lines:
        print(line)
    return 1 if args.check and lines else 0


if __name__ == "__main__":
    sys.exit(main())
