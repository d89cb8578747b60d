"""What the coordinator's API has served, for ``GET /metrics`` and the access log.

:class:`ApiMetrics` counts requests (by method, route and status), their duration, prompt and
completion tokens, the time to first token and per output token, in prometheus-client's metrics
(its own registry per server), and renders them with the scheduler's load (running and waiting
sequences, forward steps, prompt tokens prefilled and reused) and the swarm's (:class:`SwarmLoad`:
the plan version, each peer's answer times and marked-down count) in Prometheus' text exposition
format, version 0.0.4 (prometheus.io, "Exposition formats"). Updated on the event loop only;
nothing here does I/O.

:class:`Histogram` is the plain cumulative count a request tracker keeps of a peer's answer times
(copied and merged across trackers, then exported as one labelled histogram family).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass

import prometheus_client
from prometheus_client.core import (CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric,
                                    SummaryMetricFamily)
from prometheus_client.exposition import CONTENT_TYPE_PLAIN_0_0_4

CONTENT_TYPE = CONTENT_TYPE_PLAIN_0_0_4
PREFIX = "colibri_swarm_"
# Bucket bounds in seconds: a token on a busy 2-core machine takes ~20 ms, a long prompt seconds.
REQUEST_BUCKETS_S = (0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
TTFT_BUCKETS_S = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
TPOT_BUCKETS_S = (0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0)  # a token every ~20 ms on 2 cores
CLIENT_GONE = 499  # the status logged and counted for a request whose client went away (nginx's)


class Histogram:
    """Observations counted into cumulative buckets (upper bounds ``buckets``, then +Inf)."""

    def __init__(self, buckets: Sequence[float]) -> None:
        self.buckets = tuple(buckets)
        self.counts = [0] * len(self.buckets)
        self.sum, self.count = 0.0, 0

    def observe(self, value: float) -> None:
        for i, bound in enumerate(self.buckets):
            if value <= bound:
                self.counts[i] += 1
        self.sum += value
        self.count += 1

    def copy(self) -> Histogram:
        twin = Histogram(self.buckets)
        twin.counts, twin.sum, twin.count = list(self.counts), self.sum, self.count
        return twin

    def merge(self, other: Histogram) -> None:
        """Add ``other``'s observations (the same buckets)."""
        assert other.buckets == self.buckets
        self.counts = [a + b for a, b in zip(self.counts, other.counts)]
        self.sum += other.sum
        self.count += other.count

    def cumulative(self) -> list[tuple[str, float]]:
        """``(upper bound, count)`` per bucket, +Inf last: prometheus-client's histogram buckets."""
        return [(repr(float(b)), float(c)) for b, c in zip(self.buckets, self.counts)] + [("+Inf", float(self.count))]


@dataclass(frozen=True)
class SwarmLoad:
    """What the coordinator's dispatch has seen: its plan's version, each peer's answer times
    (s) and how often each was marked down."""

    plan_version: int
    answers: Mapping[str, Histogram]
    marked_down: Mapping[str, int]


class ApiMetrics:
    """The API's counters (see the module docstring)."""

    def __init__(self) -> None:
        p = PREFIX
        self.registry = prometheus_client.CollectorRegistry(auto_describe=True)
        reg = self.registry
        self.requests = prometheus_client.Counter(
            f"{p}api_requests", f"HTTP requests answered, by method, route and status ({CLIENT_GONE}: the client "
            "went away).", ["method", "route", "status"], registry=reg)
        self.request_seconds = prometheus_client.Histogram(
            f"{p}api_request_duration_seconds", "Time from a request's arrival to the end of its answer.",
            buckets=REQUEST_BUCKETS_S, registry=reg)
        self.ttft_seconds = prometheus_client.Histogram(
            f"{p}time_to_first_token_seconds", "Time from a generation request's arrival to its first text.",
            buckets=TTFT_BUCKETS_S, registry=reg)
        self.tpot_seconds = prometheus_client.Histogram(
            f"{p}time_per_output_token_seconds", "A generation's time from its first text to its end per token "
            "after the first.", buckets=TPOT_BUCKETS_S, registry=reg)
        self.prompt_tokens = prometheus_client.Counter(
            f"{p}prompt_tokens", "Prompt tokens of the generations served.", registry=reg)
        self.completion_tokens = prometheus_client.Counter(
            f"{p}completion_tokens", "Tokens generated (a final stop token included).", registry=reg)

    def request_done(self, method: str, route: str, status: int, seconds: float) -> None:
        """One request answered (or its client gone: ``status`` :data:`CLIENT_GONE`)."""
        self.requests.labels(method, route, str(status)).inc()
        self.request_seconds.observe(seconds)

    def generation_done(self, prompt_tokens: int, completion_tokens: int, decode_seconds: float | None = None) -> None:
        """A generation ended; ``decode_seconds``: from its first text to its end (its time per
        output token is that over the tokens after the first)."""
        self.prompt_tokens.inc(prompt_tokens)
        self.completion_tokens.inc(completion_tokens)
        if decode_seconds is not None and completion_tokens > 1:
            self.tpot_seconds.observe(decode_seconds / (completion_tokens - 1))

    def first_token(self, seconds: float) -> None:
        """A reply's first text arrived ``seconds`` after its request did."""
        self.ttft_seconds.observe(seconds)

    def render(self, load: Mapping[str, float] | None = None, swarm: SwarmLoad | None = None) -> str:
        """The exposition text. ``load`` (the backend's, when it has one): ``running`` and
        ``waiting`` sequences, ``steps`` run and ``step_seconds`` (their total wall time), and
        with prefix reuse prompt tokens ``prefilled`` and ``reused``, ``prefix_positions`` kept now
        and ``prefix_evictions``; ``swarm``: the plan and the peers' answers."""
        now = prometheus_client.CollectorRegistry(auto_describe=True)
        now.register(_Now(load, swarm))
        return (prometheus_client.generate_latest(self.registry) + prometheus_client.generate_latest(now)).decode()


class _Now:
    """The values read at render time (a prometheus-client collector)."""

    def __init__(self, load: Mapping[str, float] | None, swarm: SwarmLoad | None) -> None:
        self.load, self.swarm = load, swarm

    def collect(self) -> Iterator[Metric]:
        p, load, swarm = PREFIX, self.load, self.swarm
        if load is not None:
            yield GaugeMetricFamily(f"{p}sequences_running", "Sequences in the batch now.", value=load["running"])
            yield GaugeMetricFamily(f"{p}sequences_waiting", "Sequences queued for a batch slot now.",
                                    value=load["waiting"])
            yield SummaryMetricFamily(f"{p}step_duration_seconds", "Wall time of the forward steps (all running "
                                      "sequences each).", count_value=int(load["steps"]), sum_value=load["step_seconds"])
            if "prefilled" in load:
                yield CounterMetricFamily(f"{p}prompt_tokens_prefilled", "Prompt tokens run through the model.",
                                          value=load["prefilled"])
                yield CounterMetricFamily(f"{p}prompt_tokens_reused", "Prompt tokens whose KV cache an earlier "
                                          "sequence left (prefix reuse), not prefilled.", value=load["reused"])
                yield GaugeMetricFamily(f"{p}prefix_cache_positions", "KV positions kept for prefix reuse now.",
                                        value=load["prefix_positions"])
                yield CounterMetricFamily(f"{p}prefix_cache_evictions", "Kept KV caches evicted to make room.",
                                          value=load["prefix_evictions"])
        if swarm is None:
            return
        yield GaugeMetricFamily(f"{p}plan_version", "The version of the plan the coordinator runs.",
                                value=swarm.plan_version)
        answers = HistogramMetricFamily(f"{p}peer_answer_seconds", "Time from a request to a peer to its answer, "
                                        "by peer (FFN ranges and stages; late answers too).", labels=["peer"])
        for peer, hist in sorted(swarm.answers.items()):
            answers.add_metric([peer], hist.cumulative(), sum_value=hist.sum)
        yield answers
        down = CounterMetricFamily(f"{p}peer_marked_down", "Times a peer was marked down (gone, wrong, refused "
                                   "or late again and again), by peer.", labels=["peer"])
        for peer, n in sorted(swarm.marked_down.items()):
            down.add_metric([peer], n)
        yield down
