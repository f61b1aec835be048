"""The diagnosis and the spike's verdict name what came first."""

import math

from torchvitals.agent.detect import CRITICAL, WARNING, Detector, Verdict
from torchvitals.agent.measure.blocks import EMBEDDING, HEAD, LAYER, OTHER
from torchvitals.agent.report import Report
from torchvitals.agent.tools.diagnose import diagnose


def healthy_losses(n=60):
    return [(s, 2.0 / math.sqrt(s)) for s in range(1, n + 1)]


def test_after_hot_lr_a_loss_spike_is_the_learning_rate_not_the_init():
    verdicts = [
        Verdict("hot_lr", WARNING, 110, "blocks.0", {"update_ratio": 0.037, "healthy": 1e-3}),
        Verdict("hot_lr", WARNING, 120, "tok_emb", {"update_ratio": 0.044, "healthy": 1e-3}),
        Verdict("loss_spike", CRITICAL, 121, "blocks.0", {"loss": 4.5, "median": 2.4}),
    ]
    d = diagnose(verdicts, healthy_losses(130))
    assert (d.cause, d.first_step, d.block) == ("gradient explosion", 110, "blocks.0")
    assert d.summary.startswith("The learning rate is too high")
    assert d.fix.startswith("Lower the learning rate")
    assert "only if the spike returns at a lower learning rate" in d.fix


def test_an_explosion_from_the_init_still_points_at_the_init_scale():
    verdicts = [
        Verdict("activation_explosion", WARNING, 1, "blocks.1", {"abs_max": 210.0}),
        Verdict("hot_lr", WARNING, 30, "blocks.1", {"update_ratio": 0.02}),
        Verdict("loss_spike", CRITICAL, 40, "blocks.1", {"loss": 9.0}),
    ]
    d = diagnose(verdicts, healthy_losses())
    assert "learning rate is too high" not in d.summary
    assert d.fix.startswith("Clip gradients") and "init scale of block blocks.1" in d.fix


def report(step, loss, norms):
    total = math.sqrt(sum(v * v for v in norms.values()))
    return Report(
        step=step,
        loss=loss,
        grad_norm=norms,
        grad_norm_total=total,
        nonfinite_loss=False,
        nonfinite_grad=False,
        nonfinite=False,
    )


def test_the_spike_names_the_block_that_led_not_other():
    names = ["emb", "layers.0", "layers.1", "head", OTHER]
    detector = Detector(names, [EMBEDDING, LAYER, LAYER, HEAD, OTHER])
    fired = []
    for s in range(1, 60):
        norms = {b: 1.0 + 0.01 * (s % 3) for b in names}
        fired += detector.observe(report(s, 2.0 + 0.01 * (s % 2), norms), None)
    # the leftovers (a final norm) rise most, the first layer rises too: the layer led
    norms = {"emb": 1.0, "layers.0": 6.0, "layers.1": 1.5, "head": 1.2, OTHER: 40.0}
    fired += detector.observe(report(60, 50.0, norms), None)
    spikes = [v for v in fired if v.pattern == "loss_outlier"]  # its first step: an outlier
    assert spikes and spikes[0].block == "layers.0"


def test_other_is_named_when_it_is_the_only_block():
    detector = Detector([OTHER], [OTHER])
    fired = []
    for s in range(1, 60):
        fired += detector.observe(
            report(s, 2.0 + 0.01 * (s % 2), {OTHER: 1.0 + 0.01 * (s % 3)}), None
        )
    fired += detector.observe(report(60, 50.0, {OTHER: 30.0}), None)
    assert [v.block for v in fired if v.pattern == "loss_outlier"] == [OTHER]
