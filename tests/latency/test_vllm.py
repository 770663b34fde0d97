"""Reading a vLLM server's load and predicting TTFT from it (no network)."""

from __future__ import annotations

from dataclasses import replace

import pytest

from gateway.latency.vllm import Histogram, ServerState, beside_v1, metrics_url, parse_metrics
from gateway.routing.predict import TTFTPredictor, prompt_band

PAGE_NEW = """\
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="llama"} 12.0
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="llama"} 5.0
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine="0",model_name="llama"} 0.83
# TYPE vllm:time_to_first_token_seconds histogram
vllm:time_to_first_token_seconds_bucket{le="0.1",model_name="llama"} 4.0
vllm:time_to_first_token_seconds_bucket{le="0.5",model_name="llama"} 9.0
vllm:time_to_first_token_seconds_bucket{le="+Inf",model_name="llama"} 10.0
vllm:time_to_first_token_seconds_count{model_name="llama"} 10.0
vllm:time_to_first_token_seconds_sum{model_name="llama"} 2.5
# TYPE vllm:inter_token_latency_seconds histogram
vllm:inter_token_latency_seconds_bucket{le="0.05",model_name="llama"} 100.0
vllm:inter_token_latency_seconds_bucket{le="+Inf",model_name="llama"} 100.0
vllm:inter_token_latency_seconds_count{model_name="llama"} 100.0
vllm:inter_token_latency_seconds_sum{model_name="llama"} 2.0
"""

PAGE_OLD = """\
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{model_name="m"} 3.0
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{model_name="m"} 0.0
# TYPE vllm:gpu_cache_usage_perc gauge
vllm:gpu_cache_usage_perc{model_name="m"} 0.25
# TYPE vllm:time_per_output_token_seconds histogram
vllm:time_per_output_token_seconds_bucket{le="0.02",model_name="m"} 7.0
vllm:time_per_output_token_seconds_bucket{le="+Inf",model_name="m"} 8.0
vllm:time_per_output_token_seconds_count{model_name="m"} 8.0
vllm:time_per_output_token_seconds_sum{model_name="m"} 0.2
"""


def test_current_metric_names_are_read() -> None:
    """Running, waiting, KV-cache usage and the TTFT and inter-token histograms."""
    load = parse_metrics(PAGE_NEW)
    assert (load.running, load.waiting, load.kv_usage) == (12.0, 5.0, 0.83)
    assert load.ttft.count == 10 and load.ttft.quantile(0.5) == 0.5
    assert load.tpot.count == 100


def test_older_metric_names_are_read_too() -> None:
    """gpu_cache_usage_perc and time_per_output_token_seconds from older vLLM releases."""
    load = parse_metrics(PAGE_OLD)
    assert (load.running, load.waiting, load.kv_usage) == (3.0, 0.0, 0.25)
    assert load.tpot.count == 8 and load.tpot.quantile(0.5) == 0.02


def test_a_page_without_queue_gauges_is_not_a_vllm_server() -> None:
    """Garbage, or another server's metrics, is an error: the server stays unknown."""
    with pytest.raises(ValueError):
        parse_metrics("# TYPE up gauge\nup 1\n")
    with pytest.raises(ValueError):
        parse_metrics("<html>not metrics</html>")


def test_histogram_deltas_and_quantiles() -> None:
    """The TTFTs seen between two scrapes, and their bucketed quantile."""
    before = Histogram(((0.1, 4.0), (0.5, 9.0), (float("inf"), 10.0)), 10, 2.5)
    after = Histogram(((0.1, 4.0), (0.5, 19.0), (float("inf"), 20.0)), 20, 6.0)
    recent = after.since(before)
    assert recent.count == 10 and recent.quantile(0.5) == 0.5
    assert after.since(Histogram(count=99)) is after  # a counter reset: the new values stand


def test_a_stale_or_failing_scrape_is_unknown() -> None:
    """Older than three intervals, or failing: no load (unknown, not idle)."""
    now = [100.0]
    state = ServerState("http://x/metrics", 1.0, clock=lambda: now[0])
    assert state.current() is None
    state.load = replace(parse_metrics(PAGE_NEW), scraped_at=99.5)
    assert state.current() is not None
    now[0] = 103.0
    assert state.current() is None
    now[0] = 100.0
    state.failures = 1
    assert state.current() is None


def test_recent_ttft_median_is_taken_once_per_scrape() -> None:
    """The median of the TTFTs between the last two scrapes; a new scrape gives a new one."""
    state = ServerState("http://x/metrics", 1.0, clock=lambda: 100.0)
    base = replace(parse_metrics(PAGE_NEW), scraped_at=99.5)
    before = Histogram(((0.1, 4.0), (0.5, 9.0), (float("inf"), 10.0)), 10, 2.5)
    state.previous = replace(base, ttft=before)
    state.load = replace(
        base, ttft=Histogram(((0.1, 4.0), (0.5, 19.0), (float("inf"), 20.0)), 20, 6.0)
    )
    assert state.recent_ttft_p50() == 0.5
    state.previous, state.load = (
        state.load,
        replace(base, ttft=Histogram(((0.1, 24.0), (0.5, 39.0), (float("inf"), 40.0)), 40, 8.0)),
    )
    assert state.recent_ttft_p50() == 0.1  # 20 new TTFTs, all under 0.1 s
    state.failures = 1
    assert state.recent_ttft_p50() is None


def test_metrics_and_tokenize_sit_beside_v1() -> None:
    assert metrics_url("http://gpu:8000/v1") == "http://gpu:8000/metrics"
    assert metrics_url("https://h/prefix/v1/") == "https://h/prefix/metrics"
    assert beside_v1("http://gpu:8000/v1", "/tokenize") == "http://gpu:8000/tokenize"
    assert beside_v1("http://gpu:8000", "/tokenize") == "http://gpu:8000/tokenize"


def test_prediction_starts_from_the_prior_and_learns_the_queue_cost() -> None:
    """Before observations: p50 TTFT + waiting x (p50 total / running). After traffic at
    varied queue depths, the fitted line takes over."""
    p = TTFTPredictor()
    prior = p.predict("d", "short", waiting=4, running=8, ttft_p50_s=0.2, total_p50_s=1.6)
    assert prior == pytest.approx(0.2 + 4 * 0.2)
    for waiting in (0, 2, 4, 8, 0, 6) * 5:
        p.observe("d", "short", waiting, 0.1 + 0.05 * waiting)
    learned = p.predict("d", "short", waiting=10, running=8, ttft_p50_s=None, total_p50_s=None)
    assert learned == pytest.approx(0.1 + 0.05 * 10, rel=1e-6)
    assert p.learned()["d/short"]["per_waiting_ms"] == pytest.approx(50)


def test_prediction_without_anything_to_go_on_is_none() -> None:
    p = TTFTPredictor()
    assert p.predict("d", "short", waiting=3, running=1, ttft_p50_s=None, total_p50_s=None) is None


def test_prompt_bands() -> None:
    assert prompt_band(100) == "short"
    assert prompt_band(20_000) == "long"
