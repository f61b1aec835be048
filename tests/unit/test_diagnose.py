"""Unit tests for the decision-tree diagnosis: python -m pytest tests/unit/test_diagnose.py"""

from __future__ import annotations

import math

import pytest

from torchvitals.__main__ import main
from torchvitals.agent.detect import CRITICAL, WARNING, Verdict
from torchvitals.agent.outputs.eventlog import EventLog
from torchvitals.agent.report import Report
from torchvitals.agent.tools.diagnose import CAUSES, diagnose, diagnose_events

NAN = math.nan


def healthy_losses(n: int = 60) -> list[tuple[int, float]]:
    return [(s, 2.0 / math.sqrt(s)) for s in range(1, n + 1)]


def tanh_mlp_verdicts() -> list[Verdict]:
    """The background's seed example: saturation, then vanishing gradients, then a NaN loss."""
    return [
        Verdict(
            "saturation", WARNING, 10, "layers.5", {"saturation_fraction": 0.91, "abs_max": 1.0}
        ),
        Verdict(
            "vanishing_gradients",
            WARNING,
            20,
            "layers.0",
            {"ratio": 812.0, "first": "layers.0", "last": "layers.5"},
        ),
        Verdict("nonfinite_loss", CRITICAL, 40, None, {"loss": NAN}),
        Verdict("nonfinite_loss", CRITICAL, 41, None, {"loss": NAN}),
    ]


def test_no_anomaly_on_a_healthy_run():
    d = diagnose([], healthy_losses(), [(20, 1.0), (40, 0.9), (60, 0.85)])
    assert d.cause == "no anomaly" and d.evidence == [] and d.first_step is None
    assert "no anomaly" in d.render()


def test_nan_without_precursor_is_numerical_instability():
    verdicts = [Verdict("nonfinite_loss", CRITICAL, 33, None, {"loss": NAN})]
    d = diagnose(verdicts, [*healthy_losses(32), (33, NAN)])
    assert (d.cause, d.first_step) == ("numerical instability", 33)
    assert d.evidence == ["step 33: nonfinite_loss (loss=nan)"]
    assert "log" in d.fix and "bf16" in d.fix


def test_nan_loss_alone_is_caught_from_the_curve():
    d = diagnose([], [*healthy_losses(20), (21, math.inf), (22, NAN)])
    assert (d.cause, d.first_step) == ("numerical instability", 21)


def test_saturation_before_the_nan_is_the_root_cause():
    d = diagnose(tanh_mlp_verdicts(), [*healthy_losses(39), (40, NAN)])
    assert d.cause == "vanishing gradients"
    assert (d.first_step, d.block) == (10, "layers.5")
    assert "Saturation-driven" in d.summary and "step 40" in d.summary and "far apart" in d.summary
    # One line per (pattern, block), earliest first, the crash included.
    assert d.evidence == [
        "step 10: saturation in layers.5 (saturation_fraction=0.91)",
        "step 20: vanishing_gradients in layers.0 (ratio=812, first=layers.0, last=layers.5)",
        "step 40: nonfinite_loss (loss=nan)",
    ]
    assert "initialization scale" in d.fix
    assert d.also == []  # the NaN is part of this story, not a second cause


def test_explosion_names_the_earliest_block_and_leads_with_hot_lr():
    verdicts = [
        Verdict(
            "loss_spike", CRITICAL, 18, "blocks.1", {"loss": 9.0, "median": 2.0, "threshold": 4.0}
        ),
        Verdict(
            "grad_explosion", WARNING, 16, "blocks.1", {"grad_norm_total": 400.0, "median": 0.8}
        ),
        Verdict(
            "layer_divergence", WARNING, 14, "blocks.0", {"ratio_to_median": 6.0, "grad_norm": 5.0}
        ),
        Verdict("hot_lr", WARNING, 12, "blocks.0", {"update_ratio": 0.05, "healthy": 1e-3}),
    ]
    d = diagnose(verdicts, healthy_losses())
    assert (d.cause, d.first_step, d.block) == ("gradient explosion", 12, "blocks.0")
    assert d.evidence[0] == "step 12: hot_lr in blocks.0 (update_ratio=0.05, healthy=0.001)"
    assert [e.split(":")[0] for e in d.evidence] == ["step 12", "step 14", "step 16", "step 18"]
    assert "clip_grad_norm" in d.fix and "init scale of block blocks.0" in d.fix


def test_explosion_before_the_nan_is_the_root_cause():
    verdicts = [
        Verdict("grad_explosion", WARNING, 30, "blocks.0", {"grad_norm_total": 1e4}),
        Verdict("nonfinite_grad", CRITICAL, 34, "blocks.0", {"blocks": ["blocks.0"]}),
    ]
    d = diagnose(verdicts, healthy_losses(34))
    assert (d.cause, d.first_step) == ("gradient explosion", 30)
    assert "nonfinite_grad at step 34" in d.summary


def test_earliest_class_wins_between_explosion_and_vanishing():
    verdicts = [
        Verdict("vanishing_gradients", WARNING, 5, "layers.0", {"ratio": 300.0}),
        Verdict("loss_spike", CRITICAL, 50, None, {"loss": 7.0}),
    ]
    assert diagnose(verdicts, healthy_losses()).cause == "vanishing gradients"
    verdicts[0] = Verdict("dead_relu", WARNING, 80, "layers.2", {"zero_fraction": 0.97})
    d = diagnose(verdicts, healthy_losses())
    assert d.cause == "gradient explosion" and d.also == ["vanishing gradients from step 80"]


def test_dead_pipeline():
    verdicts = [
        Verdict("dead_pipeline", WARNING, 3, None, {"max_grad_norm": 0.0, "detached": True})
    ]
    d = diagnose(verdicts, [(s, 2.3) for s in range(1, 30)])
    assert d.cause == "dead pipeline" and "detached=True" in d.evidence[0]
    assert "detached" in d.fix and "preflight" in d.fix


def test_generalization_gap_from_a_verdict_and_from_the_curves():
    verdict = Verdict(
        "generalization_gap",
        WARNING,
        80,
        None,
        {"validation": [0.5, 0.55, 0.6, 0.7], "best_validation": 0.5},
    )
    assert diagnose([verdict], healthy_losses(100)).cause == "generalization gap"
    validation = [(20, 0.6), (40, 0.5), (60, 0.55), (80, 0.6), (100, 0.7)]
    d = diagnose([], healthy_losses(100), validation)
    assert (d.cause, d.first_step) == ("generalization gap", 60)
    assert "early" in d.fix and "regularization" in d.fix
    # Both curves rising is not a generalization gap.
    rising = [(s, 0.01 * s) for s in range(1, 101)]
    assert diagnose([], rising, validation).cause == "no anomaly"


def test_non_fatal_causes_rank_below_the_optimization_failures():
    dead = Verdict(
        "dead_layer",
        WARNING,
        1,
        "blocks.2",
        {"requires_grad_false": ["blocks.2.w"], "not_in_optimizer": []},
    )
    slow = Verdict("straggler", WARNING, 40, None, {"rank": 1, "seconds": 0.3, "others_mean": 0.1})
    d = diagnose([slow, dead], healthy_losses())
    assert (d.cause, d.block) == ("dead layer", "blocks.2")
    assert d.evidence == ["step 1: dead_layer in blocks.2 (requires_grad_false=[blocks.2.w])"]
    assert "Unfreeze block blocks.2" in d.fix and d.also == ["straggler from step 40"]
    d = diagnose([slow], healthy_losses())
    assert d.cause == "straggler" and "Rank 1" in d.summary
    d = diagnose(
        [slow, dead, Verdict("nonfinite_loss", CRITICAL, 50, None, {"loss": NAN})], healthy_losses()
    )
    assert d.cause == "numerical instability"
    assert set(d.also) == {"dead layer from step 1", "straggler from step 40"}


def test_verdict_dicts_and_objects_agree():
    objects = tanh_mlp_verdicts()
    assert diagnose([v.to_dict() for v in objects], healthy_losses()) == diagnose(
        objects, healthy_losses()
    )
    assert {diagnose(v, healthy_losses()).cause for v in ([], objects)} <= set(CAUSES)


def test_render_is_readable():
    text = diagnose(tanh_mlp_verdicts(), healthy_losses()).render()
    lines = text.splitlines()
    assert lines[0] == "cause: vanishing gradients (from step 10, block layers.5)"
    assert "evidence:" in lines and any(line.startswith("fix: ") for line in lines)
    assert sum(line.startswith("  - step") for line in lines) == 3


def write_run(path) -> None:
    """A run that saturates, then vanishes, then goes NaN, with one validation line."""
    verdicts = {v.step: v.to_dict() for v in tanh_mlp_verdicts()}
    with EventLog(path) as log:
        for step in range(1, 43):
            loss = NAN if step >= 40 else 2.0 / step
            log.write(
                Report(
                    step=step,
                    loss=loss,
                    grad_norm={"layers.0": 0.01, "layers.5": 8.0},
                    grad_norm_total=8.0,
                    nonfinite=step >= 40,
                    nonfinite_loss=step >= 40,
                    verdicts=[verdicts[step]] if step in verdicts else [],
                )
            )
            if step == 20:
                log.write_event({"event": "validation", "step": step, "loss": 0.3})


def test_diagnose_events_reads_a_run(tmp_path):
    path = tmp_path / "run" / "events.jsonl"
    write_run(path)
    d = diagnose_events(path)
    assert (d.cause, d.first_step, d.block) == ("vanishing gradients", 10, "layers.5")
    assert "nonfinite_loss at step 40" in d.summary


def test_diagnose_events_rejects_a_log_without_steps(tmp_path):
    path = tmp_path / "events.jsonl"
    path.write_text('{"event": "validation", "step": 1, "loss": 0.5}\n')
    with pytest.raises(ValueError, match="no step reports"):
        diagnose_events(path)


def test_cli_diagnose(tmp_path, capsys):
    path = tmp_path / "events.jsonl"
    write_run(path)
    assert main(["diagnose", str(path)]) == 0
    out, err = capsys.readouterr()
    assert out.startswith("cause: vanishing gradients") and "fix: " in out, err


def test_cli_diagnose_missing_or_corrupt_log(tmp_path, capsys):
    assert main(["diagnose", str(tmp_path / "nope.jsonl")]) == 2
    out, err = capsys.readouterr()
    assert (
        out == ""
        and err.startswith("torchvitals diagnose: FileNotFoundError")
        and err.count("\n") == 1
    )
    path = tmp_path / "events.jsonl"
    write_run(path)
    with open(path, "a") as f:
        f.write("{not json\n")  # a complete line, not a crash mid-write: corrupt
    assert main(["diagnose", str(path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("torchvitals diagnose: JSONDecodeError") and err.count("\n") == 1


@pytest.mark.parametrize(
    "pattern, evidence, cause, words",
    [
        (
            "replica_divergence",
            {"blocks": {"blocks.1": [3]}, "ranks": [3]},
            "replica divergence",
            "[3]",
        ),
        (
            "memory_growth",
            {"memory": "resident_bytes", "rise_bytes": 3e8, "bytes_per_step": 4e6},
            "memory leak",
            "resident_bytes",
        ),
        (
            "data_stall",
            {"data_wait_ratio": 0.8, "data_wait_seconds": 0.06},
            "data stall",
            "step 19",
        ),
    ],
)
def test_vitals_patterns_are_causes_of_their_own(pattern, evidence, cause, words):
    severity = CRITICAL if pattern == "replica_divergence" else WARNING
    d = diagnose([Verdict(pattern, severity, 19, None, evidence)], healthy_losses())
    assert d.cause == cause and cause in CAUSES and d.first_step == 19
    assert words in d.summary and d.fix


def test_what_the_job_did_is_listed_beside_the_cause_not_taken_for_one():
    """A rollback loop and a collector's order record the job's response: the cause still comes
    from the symptoms (here the spikes), and the responses are listed, each once."""
    spikes = [Verdict("loss_spike", CRITICAL, s, None, {"loss": 9.0}) for s in (30, 45, 60)]
    responses = [
        Verdict("collector_directive", CRITICAL, 50, None, {"action": "rollback"}),
        Verdict("collector_directive", CRITICAL, 51, None, {"action": "rollback"}),
        Verdict(
            "rollback_loop",
            CRITICAL,
            60,
            None,
            {"reason": "loss_spike", "max_rollbacks": 3, "exit_code": 75},
        ),
    ]
    d = diagnose([*spikes, *responses], healthy_losses(60))
    assert d.cause == "gradient explosion" and d.also == []
    assert d.responses == [
        "step 50: obeyed the collector's order to rollback",
        "step 60: gave up (too many rollbacks, last: loss_spike): exit code 75",
    ]
    no_target = Verdict(
        "rollback_loop",
        CRITICAL,
        62,
        None,
        {"reason": "loss_spike", "why": "no trusted checkpoint is left", "exit_code": 75},
    )
    assert diagnose([*spikes, no_target], healthy_losses(62)).responses == [
        "step 62: gave up (no trusted checkpoint is left): exit code 75"
    ]
    assert "the job's response:" in d.render()
    assert diagnose(spikes, healthy_losses(60)).responses == []


def test_outliers_and_grad_spikes_alone_are_an_unsteady_loss_not_an_explosion():
    verdicts = [
        Verdict("loss_outlier", WARNING, 100, None, {"loss": 4.1, "median": 2.9, "threshold": 3.3}),
        Verdict("grad_spike", WARNING, 200, None, {"grad_norm_total": 2.1, "median": 0.3}),
    ]
    d = diagnose(verdicts, healthy_losses(300))
    assert (d.cause, d.first_step) == ("unsteady loss", 100)
    assert "never spiked for two steps" in d.summary and "look them up by step" in d.fix


def test_an_outlier_long_before_a_nan_did_not_feed_it():
    verdicts = [
        Verdict("loss_outlier", WARNING, 100, None, {"loss": 4.1, "median": 2.9}),
        Verdict("nonfinite_loss", CRITICAL, 5000, None, {"loss": NAN}),
    ]
    d = diagnose(verdicts, healthy_losses(300))
    assert (d.cause, d.first_step) == ("numerical instability", 5000)
    assert d.also == ["unsteady loss from step 100"]


def test_a_slow_divergence_is_named_with_its_rise():
    verdicts = [
        Verdict(
            "loss_divergence",
            WARNING,
            4200,
            None,
            {"median": 3.4, "lowest_median": 3.0, "rise": 0.133, "steps": 50},
        )
    ]
    d = diagnose(verdicts, healthy_losses(300))
    assert d.cause == "unsteady loss" and "climbed slowly from step 4200" in d.summary
    assert "13%" in d.summary and "lower the peak learning rate" in d.fix
