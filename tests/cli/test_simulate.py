"""`tailguard simulate batching`: static vs continuous batching in discrete time."""

from __future__ import annotations

import json
import random
from collections.abc import Sequence

import pytest
from typer.testing import CliRunner

from gateway.cli import app
from gateway.tools.batching import (
    MODES,
    Mode,
    equal_lengths,
    random_lengths,
    run_experiment,
    simulate,
)


def reference(lengths: Sequence[int], max_batch: int, mode: Mode) -> tuple[list[int], list[int]]:
    """The exercise read literally, one tick at a time: (starts, completions)."""
    queue = list(range(len(lengths)))
    batch: list[int] = []
    left = list(lengths)
    starts, done = [0] * len(lengths), [0] * len(lengths)
    tick = 0
    while queue or batch:
        if mode == "continuous" or not batch:
            while queue and len(batch) < max_batch:
                starts[queue[0]] = tick
                batch.append(queue.pop(0))
        tick += 1
        for request in batch:
            left[request] -= 1
            if left[request] == 0:
                done[request] = tick
        batch = [r for r in batch if left[r]]
    return starts, done


# Hand-computed cases.


def test_three_requests_on_two_slots() -> None:
    """Lengths 1, 2, 10 on two slots.

    static: [1, 2] run ticks 0-1 (the first slot idles in tick 1), then [10] runs ticks 2-11.
    continuous: the 10 takes the slot the 1 frees, starting at tick 1 and done at 11.
    """
    static = simulate([1, 2, 10], 2, "static")
    assert (static.starts, static.completions, static.total_ticks) == ((0, 0, 2), (1, 2, 12), 12)
    assert static.mean_wait == pytest.approx(2 / 3)
    assert static.mean_completion == pytest.approx(15 / 3)
    assert static.utilisation == pytest.approx(13 / 24)  # 13 tokens in 2 slots x 12 ticks

    continuous = simulate([1, 2, 10], 2, "continuous")
    assert continuous.starts == (0, 0, 1)
    assert continuous.completions == (1, 2, 11)
    assert continuous.total_ticks == 11
    assert continuous.mean_wait == pytest.approx(1 / 3)
    assert continuous.mean_completion == pytest.approx(14 / 3)
    assert continuous.utilisation == pytest.approx(13 / 22)
    assert continuous.tokens_per_tick == pytest.approx(13 / 11)


def test_same_drain_time_but_lower_latency() -> None:
    """Lengths 3, 1, 2, 2 on two slots: both drain in 5 ticks, continuous finishes #2 earlier."""
    static = simulate([3, 1, 2, 2], 2, "static")
    continuous = simulate([3, 1, 2, 2], 2, "continuous")
    assert static.completions == (3, 1, 5, 5)
    assert continuous.completions == (3, 1, 3, 5)
    assert static.total_ticks == continuous.total_ticks == 5
    assert (static.mean_completion, continuous.mean_completion) == (3.5, 3.0)


def test_percentiles_are_nearest_rank() -> None:
    run = simulate([1, 2, 3, 4], 4, "static")
    assert run.completions == (1, 2, 3, 4)
    assert (run.completion_percentile(0.5), run.completion_percentile(0.99)) == (2, 4)


def test_one_slot_makes_the_modes_equal() -> None:
    lengths = [5, 1, 9, 2]
    static, continuous = (simulate(lengths, 1, mode) for mode in MODES)
    assert static.completions == continuous.completions == (5, 6, 15, 17)
    assert static.utilisation == continuous.utilisation == 1.0


def test_invalid_input() -> None:
    with pytest.raises(ValueError, match="max_batch"):
        simulate([1], 0, "static")
    with pytest.raises(ValueError, match="at least one"):
        simulate([], 2, "static")
    with pytest.raises(ValueError, match=">= 1 token"):
        simulate([1, 0], 2, "continuous")
    with pytest.raises(ValueError, match="min_tokens"):
        random_lengths(5, 10, 9, seed=1)


# Properties.


@pytest.mark.parametrize("seed", range(20))
def test_matches_a_tick_by_tick_reading(seed: int) -> None:
    """Jumping to the next completion gives exactly what stepping every tick gives."""
    rng = random.Random(seed)
    lengths = [rng.randint(1, 40) for _ in range(rng.randint(1, 30))]
    max_batch = rng.randint(1, 6)
    for mode in MODES:
        run = simulate(lengths, max_batch, mode)
        starts, done = reference(lengths, max_batch, mode)
        assert (list(run.starts), list(run.completions)) == (starts, done)


@pytest.mark.parametrize("seed", range(20))
def test_continuous_is_never_worse_on_random_lengths(seed: int) -> None:
    """Every request starts and finishes no later; drain time and mean completion drop."""
    lengths = random_lengths(60, 10, 200, seed)
    static = simulate(lengths, 8, "static")
    continuous = simulate(lengths, 8, "continuous")
    assert all(c <= s for c, s in zip(continuous.completions, static.completions, strict=True))
    assert all(c <= s for c, s in zip(continuous.starts, static.starts, strict=True))
    assert continuous.total_ticks < static.total_ticks
    assert continuous.mean_completion < static.mean_completion
    assert continuous.mean_wait < static.mean_wait
    assert continuous.utilisation > static.utilisation
    assert continuous.work == static.work == sum(lengths)  # idle slots are not work


def test_equal_lengths_erase_the_difference() -> None:
    lengths = equal_lengths(random_lengths(60, 10, 200, seed=1))
    assert len(set(lengths)) == 1
    static, continuous = (simulate(lengths, 8, mode) for mode in MODES)
    assert static.summary() | {"mode": ""} == continuous.summary() | {"mode": ""}
    assert static.total_ticks == 8 * lengths[0]  # ceil(60 / 8) batches of the common length


def test_experiment_is_deterministic_under_a_seed() -> None:
    first, again = run_experiment(seed=5).to_json(), run_experiment(seed=5).to_json()
    assert first == again
    assert run_experiment(seed=6).to_json()["varied"] != first["varied"]
    lengths = random_lengths(60, 10, 200, seed=5)
    assert first["varied"]["lengths"]["mean"] == pytest.approx(sum(lengths) / 60, abs=1e-3)
    assert first["equal"]["lengths"]["min"] == round(sum(lengths) / 60)


def test_the_conclusion_follows_the_numbers() -> None:
    experiment = run_experiment(seed=1)
    text = experiment.to_json()["conclusion"]
    static, continuous = experiment.varied["static"], experiment.varied["continuous"]
    assert f"in {continuous.total_ticks} ticks instead of {static.total_ticks}" in text
    assert "the advantage disappears" in text
    assert "Variance in output length" in text
    small = run_experiment(requests=4, max_batch=8).to_json()["conclusion"]
    assert "gained nothing" in small
    assert "fit in one batch" in small


# The command.


def invoke(*args: str) -> tuple[int, str]:
    result = CliRunner().invoke(app, ["simulate", "batching", *args])
    return result.exit_code, result.output


def test_cli_prints_both_modes_and_a_conclusion() -> None:
    code, output = invoke()
    assert code == 0, output
    experiment = run_experiment()
    for mode in MODES:
        assert mode in output
    assert str(experiment.varied["static"].total_ticks) in output
    assert str(experiment.varied["continuous"].total_ticks) in output
    assert "continuous batching drained the 60 requests" in " ".join(output.split())


def test_cli_json_is_the_experiment() -> None:
    args = ("--requests", "20", "--max-batch", "4", "--min-tokens", "5", "--max-tokens", "50")
    code, output = invoke(*args, "--seed", "3", "--json")
    assert code == 0, output
    report = json.loads(output)
    assert report == run_experiment(20, 4, 5, 50, seed=3).to_json()
    assert report["parameters"]["requests"] == 20
    for block in ("varied", "equal"):
        assert set(MODES) <= set(report[block])
    assert report["equal"]["continuous_gain"]["total_ticks"] == 0


def test_cli_rejects_an_empty_length_range() -> None:
    code, _ = invoke("--min-tokens", "50", "--max-tokens", "10")
    assert code == 2
    code, _ = invoke("--max-batch", "0")
    assert code == 2


def test_simulate_alone_lists_its_simulations() -> None:
    result = CliRunner().invoke(app, ["simulate", "--help"])
    assert result.exit_code == 0
    assert "batching" in result.output


# `tailguard simulate speculative`.


def speculative(*args: str) -> tuple[int, str]:
    result = CliRunner().invoke(app, ["simulate", "speculative", *args])
    return result.exit_code, result.output


def test_speculative_json_follows_the_formula() -> None:
    """Tokens per step = sum(alpha**i, i = 0..k), step cost = 1 + k x (verify + draft), speedup
    their ratio; the drawn columns land near them and are reproducible under the seed."""
    args = ("--k", "3", "--acceptance", "0.05,0.5,0.9", "--verify-cost", "0.1")
    code, output = speculative(*args, "--draft-cost", "0.2", "--steps", "4000", "--json")
    assert code == 0, output
    report = json.loads(output)
    assert report["k"] == 3 and report["step_cost"] == pytest.approx(1 + 3 * 0.3)
    assert [row["acceptance"] for row in report["rows"]] == [0.05, 0.5, 0.9]
    for row in report["rows"]:
        alpha = row["acceptance"]
        tokens = sum(alpha**i for i in range(4))
        assert row["tokens_per_step"] == pytest.approx(tokens)
        assert row["step_cost"] == pytest.approx(1.9)
        assert row["speedup"] == pytest.approx(tokens / 1.9)
        # 4000 draws: the mean of 1 + accepted (sd < 1.2) within 0.1 of its expectation.
        assert row["measured_tokens_per_step"] == pytest.approx(tokens, abs=0.1)
        assert row["measured_speedup"] == pytest.approx(row["measured_tokens_per_step"] / 1.9)
        expected_rate = sum(alpha ** (i + 1) for i in range(3)) / 3  # vLLM's accepted / drafted
        assert row["measured_acceptance_rate"] == pytest.approx(expected_rate, abs=0.03)
    even = report["break_even_acceptance"]
    assert sum(even**i for i in range(4)) == pytest.approx(1.9)
    assert speculative(*args, "--draft-cost", "0.2", "--steps", "4000", "--json")[1] == output


def test_a_draft_that_is_rarely_right_slows_decoding_down() -> None:
    code, output = speculative("--json")
    assert code == 0, output
    rows = {row["acceptance"]: row for row in json.loads(output)["rows"]}
    assert set(rows) == {0.05, 0.2, 0.4, 0.6, 0.8, 0.9}
    assert rows[0.05]["speedup"] < 1 and rows[0.05]["measured_speedup"] < 1
    assert rows[0.9]["speedup"] > 3
    code, text = speculative()
    assert code == 0, text
    words = " ".join(text.split())
    assert "0.82x" in words and "18% slower than without a draft" in words
    assert "right more than 22% of the time" in words


def test_speculation_that_cannot_pay_for_itself_says_so() -> None:
    args = ("--k", "2", "--verify-cost", "0", "--draft-cost", "1.5", "--acceptance", "1")
    code, output = speculative(*args, "--json")
    assert code == 0, output
    report = json.loads(output)
    assert report["break_even_acceptance"] is None
    assert report["rows"][0]["speedup"] == pytest.approx(3 / 4)
    assert "no draft, however good, pays for itself" in report["conclusion"]


def test_speculative_rejects_bad_rates() -> None:
    assert speculative("--acceptance", "1.5")[0] == 2
    assert speculative("--acceptance", "x")[0] == 2
    assert speculative("--k", "0")[0] == 2
