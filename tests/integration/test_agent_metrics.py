"""A live agent's /metrics over HTTP, and its event log, during a real training loop."""

import socket
import urllib.request

import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families
from support.models import TINY, TINY_BLOCKS, TinyGPT, random_batches
from support.world import free_port

import torchvitals
from torchvitals.agent.outputs.eventlog import read_events
from torchvitals.agent.outputs.exporter import MetricsPortError


def scrape(url: str) -> dict[tuple[str, tuple], float]:
    text = urllib.request.urlopen(url, timeout=5).read().decode()
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def train(agent, model, opt, steps, seed=0):
    for x, y in random_batches(
        steps, batch=4, seq_len=TINY["seq_len"], vocab=TINY["vocab"], seed=seed
    ):
        loss = model.loss(x, y)
        loss.backward()
        report = agent.step(loss, samples=4)
        opt.zero_grad(set_to_none=True)
    return report


def test_live_agent_serves_the_report_and_a_constant_series_count(tmp_path):
    torch.manual_seed(0)
    model = TinyGPT(**TINY)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    agent = torchvitals.watch(
        model, opt, metrics_port=free_port(), log_dir=str(tmp_path), run_name="run", log_every=5
    )
    try:
        assert agent.metrics_url.startswith("http://127.0.0.1:")
        report = train(agent, model, opt, 10)
        after_10 = scrape(agent.metrics_url)
        rank = (("rank", "0"),)
        assert after_10[("torchvitals_steps_total", rank)] == 10
        assert after_10[("torchvitals_loss", rank)] == pytest.approx(report.loss, rel=1e-12)
        assert after_10[("torchvitals_grad_norm_global", rank)] == pytest.approx(
            report.grad_norm_total
        )
        for block in TINY_BLOCKS:
            key = ("torchvitals_grad_norm", (("block", block), ("rank", "0")))
            assert after_10[key] == pytest.approx(report.grad_norm[block], rel=1e-12)
            ratio = after_10[("torchvitals_update_ratio", (("block", block), ("rank", "0")))]
            assert ratio == pytest.approx(report.update_ratio[block], rel=1e-12)
        assert after_10[
            ("torchvitals_activation_abs_max", (("block", "blocks.0"), ("rank", "0")))
        ] == pytest.approx(report.activations["blocks.0"]["abs_max"])
        assert after_10[("torchvitals_samples_total", rank)] == 40  # 10 steps of 4
        assert after_10[("torchvitals_step_duration_seconds_count", rank)] == 10
        train(agent, model, opt, 190, seed=1)
        after_200 = scrape(agent.metrics_url)
        assert after_200[("torchvitals_steps_total", rank)] == 200
        assert set(after_200) == set(after_10), "the series set changed between step 10 and 200"
    finally:
        agent.close()
    events = read_events(tmp_path / "run" / "events.jsonl")
    assert [e["step"] for e in events] == list(range(5, 201, 5))
    assert set(events[1]["grad_norm"]) == set(TINY_BLOCKS)


def test_taken_port_is_a_clear_error_naming_port_and_setting_when_strict():
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        model = TinyGPT(**TINY)
        with pytest.raises(MetricsPortError) as info:
            torchvitals.watch(
                model,
                torch.optim.SGD(model.parameters(), lr=0.1),
                metrics_port=port,
                metrics_port_strict=True,
            )
    message = str(info.value)
    assert (
        str(port) in message and "TORCHVITALS_METRICS_PORT" in message and "metrics_port" in message
    )
