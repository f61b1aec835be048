"""Each client address's scrapes a second on /metrics (``agent/outputs/ratelimit.py``), on a fake
clock: python -m pytest tests/unit/test_scrape_budget.py"""

from __future__ import annotations

import math

import pytest

from torchvitals.agent.config import Config
from torchvitals.agent.outputs.ratelimit import ScrapeBudget, ScrapeLimit
from torchvitals.errors import ConfigError


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def reference(rate: float, burst: int, times: list[float]) -> list[float]:
    """The token bucket by its definition, one request at each time: 0.0 when served, else the
    seconds until a token (a refused request spends nothing)."""
    tokens, last, out = float(burst), times[0], []
    for t in times:
        tokens = min(burst, tokens + (t - last) * rate)
        last = t
        if tokens >= 1:
            tokens -= 1
            out.append(0.0)
        else:
            out.append((1 - tokens) / rate)
    return out


def test_a_loop_gets_its_burst_then_one_scrape_per_refill_with_the_wait_until_the_next():
    clock = Clock()
    budget = ScrapeBudget(ScrapeLimit(scrapes_per_s=2.0, burst=5), clock=clock)
    times = [clock.now + 0.01 * i for i in range(300)]  # 100 scrapes a second for 3 s
    got = []
    for t in times:
        clock.now = t
        got.append(budget.take("10.0.0.9"))
    assert got == pytest.approx(reference(2.0, 5, times))
    served = sum(w == 0.0 for w in got)
    assert served == 5 + 5  # the burst, then 2 a second over the 2.99 s after it: 5 more
    # 50 ms in, the burst is spent and 0.1 token has come back: (1 - 0.1) / 2 s to the next.
    assert got[5] == pytest.approx(0.45)
    assert all(0 < w <= 0.5 for w in got if w)


@pytest.mark.parametrize("interval_s", [0.5, 1.0, 15.0, 60.0])
def test_a_scraper_at_prometheus_intervals_is_always_served(interval_s):
    clock = Clock()
    budget = ScrapeBudget(ScrapeLimit(scrapes_per_s=2.0, burst=5), clock=clock)
    for _ in range(200):
        assert budget.take("10.0.0.1") == 0.0
        clock.now += interval_s


def test_a_loop_from_one_address_spends_no_other_addresses_tokens():
    clock = Clock()
    budget = ScrapeBudget(ScrapeLimit(scrapes_per_s=0.1, burst=2), clock=clock)
    for _ in range(1000):
        budget.take("10.0.0.66")
    assert budget.take("10.0.0.66") == pytest.approx(10.0)
    assert [budget.take("10.0.0.1") for _ in range(3)] == [0.0, 0.0, pytest.approx(10.0)]


def test_the_addresses_held_are_bounded_and_the_least_recent_goes_first():
    clock = Clock()
    budget = ScrapeBudget(ScrapeLimit(scrapes_per_s=1.0, burst=1), clock=clock, max_clients=4)
    budget.take("loop")
    for i in range(50):
        # The loop keeps coming back between newcomers: it stays held, and stays refused.
        assert budget.take("loop") > 0
        budget.take(f"10.0.1.{i}")
        assert budget.addresses <= 4
    assert budget.take("loop") > 0
    # 10.0.1.0 was seen least recently: forgotten, it comes back with a full bucket.
    assert budget.take("10.0.1.0") == 0.0


def test_a_refused_scrape_spends_nothing_so_a_loop_is_served_at_the_rate():
    clock = Clock()
    budget = ScrapeBudget(ScrapeLimit(scrapes_per_s=4.0, burst=1), clock=clock)
    times = [clock.now + 0.001 * i for i in range(10_000)]  # 1000 scrapes a second for 10 s
    got = []
    for t in times:
        clock.now = t
        got.append(budget.take("loop"))
    assert got == pytest.approx(reference(4.0, 1, times))
    served = sum(w == 0.0 for w in got)
    assert abs(served - (1 + 4 * 10)) <= 1  # the burst, then 4 a second: what refusals leave


@pytest.mark.parametrize(
    "kwargs,field",
    [
        ({"scrapes_per_s": 0.0}, "metrics_scrapes_per_s"),
        ({"scrapes_per_s": math.inf}, "metrics_scrapes_per_s"),
        ({"scrapes_per_s": math.nan}, "metrics_scrapes_per_s"),
        ({"burst": 0}, "metrics_scrape_burst"),
    ],
)
def test_a_limit_that_cannot_be_is_an_error_naming_the_setting(kwargs, field):
    with pytest.raises(ConfigError) as e:
        ScrapeLimit(**kwargs)
    assert e.value.field == field


def test_the_settings_come_from_the_environment_and_zero_turns_the_limit_off():
    env = {"TORCHVITALS_METRICS_SCRAPES_PER_S": "0.5", "TORCHVITALS_METRICS_SCRAPE_BURST": "3"}
    config = Config.from_env(env)
    assert (config.metrics_scrapes_per_s, config.metrics_scrape_burst) == (0.5, 3)
    assert Config.from_env({"TORCHVITALS_METRICS_SCRAPES_PER_S": "0"}).metrics_scrapes_per_s == 0
    with pytest.raises(ConfigError, match="TORCHVITALS_METRICS_SCRAPES_PER_S"):
        Config.from_env({"TORCHVITALS_METRICS_SCRAPES_PER_S": "inf"})
