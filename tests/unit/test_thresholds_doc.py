"""docs/detection.md's table of thresholds is the one ``Thresholds`` defines: every field, its
default and its description, read from agent/detect/thresholds.py, so the page cannot drift.

    python -m pytest tests/unit/test_thresholds_doc.py
    python tests/unit/test_thresholds_doc.py --write     # rewrite the table after a change
"""

from __future__ import annotations

import ast
import dataclasses
import itertools
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SOURCE = ROOT / "agent" / "detect" / "thresholds.py"
PAGE = ROOT / "docs" / "detection.md"
BEGIN = "<!-- the thresholds table: generated from agent/detect/thresholds.py -->"
END = "<!-- end of the generated table -->"


def described() -> dict[str, str]:
    """Each field of ``Thresholds`` and the docstring under it, one line."""
    tree = ast.parse(SOURCE.read_text())
    (cls,) = [n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "Thresholds"]
    out, body = {}, cls.body
    for node, after in itertools.pairwise(body):
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            doc = after.value.value if isinstance(after, ast.Expr) else ""
            out[node.target.id] = " ".join(str(doc).split()).replace("|", "\\|")
    return out


def table() -> str:
    from torchvitals.agent.detect.thresholds import Thresholds

    docs = described()
    rows = ["| field | default | what it means |", "| --- | --- | --- |"]
    for f in dataclasses.fields(Thresholds):
        rows.append(f"| `{f.name}` | {f.default!r} | {docs.get(f.name, '')} |")
    return "\n".join(rows)


def section(text: str) -> str:
    start, end = text.index(BEGIN) + len(BEGIN), text.index(END)
    return text[start:end].strip()


def test_every_field_has_a_description():
    from torchvitals.agent.detect.thresholds import Thresholds

    docs = described()
    assert [f.name for f in dataclasses.fields(Thresholds) if not docs.get(f.name)] == []


def test_the_page_shows_the_thresholds_the_code_has():
    assert section(PAGE.read_text()) == table(), (
        "docs/detection.md's thresholds table is stale: python tests/unit/test_thresholds_doc.py "
        "--write"
    )


if __name__ == "__main__" and sys.argv[1:] == ["--write"]:
    text = PAGE.read_text()
    start, end = text.index(BEGIN) + len(BEGIN), text.index(END)
    PAGE.write_text(text[:start] + "\n\n" + table() + "\n\n" + text[end:])
