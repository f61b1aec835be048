"""The README and docs/ as a user reads them: the first commands, the links, the settings' defaults.

The site itself (`mkdocs build --strict`, which also fails on a broken link) is built by
`bash .ci/run docs`; these checks need no mkdocs, so every run of the suite holds them.
"""

import dataclasses
import re
from pathlib import Path

import yaml

from torchvitals.agent.config import _RENAMED, SECTIONS

REPO = Path(__file__).resolve().parents[2]
DOCS = REPO / "docs"
PAGES = sorted([REPO / "README.md", REPO / "CONTRIBUTING.md", *DOCS.glob("*.md")])

LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)\)")
FENCE = re.compile(r"^```.*?^```", re.DOTALL | re.MULTILINE)
HEADING = re.compile(r"^#{1,6}\s+(.+?)\s*#*$", re.MULTILINE)


def text_outside_code(page: Path) -> str:
    return FENCE.sub("", page.read_text(encoding="utf-8"))


def anchors(page: Path) -> set[str]:
    """The heading anchors GitHub and mkdocs' toc both make: lower case, punctuation dropped,
    spaces to hyphens (the docs keep to headings where the two agree)."""
    found = set()
    for title in HEADING.findall(text_outside_code(page)):
        slug = re.sub(r"[^\w\s-]", "", title.replace("`", "")).strip().lower()
        found.add(re.sub(r"[\s]+", "-", slug))
    return found


def test_the_readme_opens_with_the_two_set_up_commands():
    # A project rule: on a fresh machine the README's first lines install and run the demo, then
    # run the whole suite (.ci/run runs exactly the second).
    first = REPO.joinpath("README.md").read_text(encoding="utf-8").splitlines()[:6]
    commands = [
        line.split("#")[0].strip() for line in first if line and not line.startswith(("#", "```"))
    ]
    assert commands[:2] == ["pip install -e . && torchvitals demo", "bash .ci/run"], first


def test_every_relative_link_points_at_a_file_and_heading_that_exist():
    broken = []
    for page in PAGES:
        for target in LINK.findall(text_outside_code(page)):
            if re.match(r"[a-z]+:", target):
                broken.append(f"{page.name}: {target} points outside the repository")
                continue
            path, _, anchor = target.partition("#")
            dest = (page.parent / path).resolve() if path else page
            if not dest.exists():
                broken.append(f"{page.name}: {target} (no {dest.relative_to(REPO)})")
            elif anchor and (dest.suffix != ".md" or anchor not in anchors(dest)):
                broken.append(f"{page.name}: {target} (no heading #{anchor})")
    assert not broken, "\n".join(broken)


def test_the_site_lists_every_page_and_only_pages_that_exist():
    config = yaml.safe_load(REPO.joinpath("mkdocs.yml").read_text(encoding="utf-8"))

    def pages(nav):
        for entry in nav:
            for value in entry.values() if isinstance(entry, dict) else [entry]:
                yield from pages(value) if isinstance(value, list) else [value]

    listed = sorted(pages(config["nav"]))
    assert listed == sorted(p.name for p in DOCS.glob("*.md"))


def shown(value):
    """A default as docs/configuration.md writes it."""
    if isinstance(value, bool) or value is None:
        return str(value)
    if isinstance(value, int) and value >= 1 << 30 and value % (1 << 30) == 0:
        return f"{value >> 30} GiB"
    if isinstance(value, str):
        return f'"{value}"'
    return str(value)


def test_the_configuration_page_gives_every_setting_with_the_code_default():
    rows = dict(
        re.findall(
            r"^\| `(\w+)` \| ([^|]+?) \|", (DOCS / "configuration.md").read_text(), re.MULTILINE
        )
    )
    expected = {
        _RENAMED.get((section, f.name), f.name): shown(f.default)
        for section, cls in SECTIONS.items()
        for f in dataclasses.fields(cls)
    }
    assert {name: rows.get(name) for name in expected} == expected
