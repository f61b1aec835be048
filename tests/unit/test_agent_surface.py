"""The agent's public surface is ``agent.PUBLIC``, no more: the class, its docstring and the
docs' table name the same set, so a new public attribute is a decision, never an accident."""

from __future__ import annotations

import re
from collections.abc import Iterable
from pathlib import Path

import torch
from torch import nn

import torchvitals
from torchvitals.agent.agent import PUBLIC, Agent

ROOT = Path(torchvitals.__file__).resolve().parent


def _public(names: Iterable[str]) -> set[str]:
    return {n for n in names if not n.startswith("_")}


def test_the_public_names_are_listed_once():
    assert len(PUBLIC) == len(set(PUBLIC)), sorted(n for n in PUBLIC if PUBLIC.count(n) > 1)


def test_the_class_declares_and_defines_exactly_the_public_names():
    declared = _public(Agent.__annotations__) | _public(vars(Agent))
    assert declared == set(PUBLIC), (sorted(declared - set(PUBLIC)), sorted(set(PUBLIC) - declared))


def test_a_watched_agent_holds_no_other_public_name():
    model = nn.Linear(4, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with torchvitals.watch(model, optimizer, metrics_port=0, log_dir="") as agent:
        model(torch.randn(3, 4)).sum().backward()
        agent.step()
        held = _public(dir(agent))
        assert held == set(PUBLIC), (sorted(held - set(PUBLIC)), sorted(set(PUBLIC) - held))
        assert agent.block_names and agent.block_names == list(agent._blocks.names)


def test_the_docstring_and_the_docs_list_the_public_names():
    doc = Agent.__doc__ or ""
    in_doc = set(re.findall(r"``([a-z_]+)``", doc[doc.index("no more:") :]))
    assert set(PUBLIC) <= in_doc, sorted(set(PUBLIC) - in_doc)
    page = (ROOT / "docs" / "extending.md").read_text()
    table = page[page.index("## What the agent offers") :]
    table = table[: table.index("\n\n", table.index("| --- |"))]
    first_cells = [row.split("|")[1] for row in table.splitlines() if row.startswith("| `")]
    in_table = {n for cell in first_cells for n in re.findall(r"`([a-z_]+)(?:\(|`)", cell)}
    assert set(PUBLIC) == in_table, (sorted(in_table - set(PUBLIC)), sorted(set(PUBLIC) - in_table))
