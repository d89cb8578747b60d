"""What the coordinator's API has served, for ``GET /metrics`` and the access log.

:class:`ApiMetrics` counts requests (by method, route and status), their duration, prompt and
completion tokens and the time to first token, and renders them with the scheduler's load
(running and waiting sequences, forward steps and their time) in Prometheus' text exposition
format, version 0.0.4 (prometheus.io, "Exposition formats"). Updated on the event loop only;
nothing here does I/O.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
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

    def lines(self, name: str, labels: str = "") -> list[str]:
        """The exposition lines; ``labels``: more labels, e.g. ``peer="x",``."""
        out = [f'{name}_bucket{{{labels}le="{_number(b)}"}} {c}' for b, c in zip(self.buckets, self.counts)]
        tail = "{" + labels.rstrip(",") + "}" if labels else ""
        return out + [f'{name}_bucket{{{labels}le="+Inf"}} {self.count}', f"{name}_sum{tail} {_number(self.sum)}",
                      f"{name}_count{tail} {self.count}"]


class ApiMetrics:
    """The API's counters (see the module docstring)."""

    def __init__(self) -> None:
        self.requests: Counter[tuple[str, str, int]] = Counter()  # (method, route, status) → requests
        self.request_seconds = Histogram(REQUEST_BUCKETS_S)
        self.ttft_seconds = Histogram(TTFT_BUCKETS_S)
        self.tpot_seconds = Histogram(TPOT_BUCKETS_S)
        self.prompt_tokens = 0
        self.completion_tokens = 0

    def request_done(self, method: str, route: str, status: int, seconds: float) -> None:
        """One request answered (or its client gone: ``status`` :data:`CLIENT_GONE`)."""
        self.requests[(method, route, status)] += 1
        self.request_seconds.observe(seconds)

    def generation_done(self, prompt_tokens: int, completion_tokens: int, decode_seconds: float | None = None) -> None:
        """A generation ended; ``decode_seconds``: from its first text to its end (its time per
        output token is that over the tokens after the first)."""
        self.prompt_tokens += prompt_tokens
        self.completion_tokens += completion_tokens
        if decode_seconds is not None and completion_tokens > 1:
            self.tpot_seconds.observe(decode_seconds / (completion_tokens - 1))

    def first_token(self, seconds: float) -> None:
        """A reply's first text arrived ``seconds`` after its request did."""
        self.ttft_seconds.observe(seconds)

    def render(self, load: Mapping[str, float] | None = None, swarm: SwarmLoad | None = None) -> str:
        """The exposition text. ``load`` (the backend's, when it has one): ``running`` and
        ``waiting`` sequences, ``steps`` run and ``step_seconds`` (their total wall time), prompt
        tokens ``prefilled`` and ``reused``; ``swarm``: the plan and the peers' answers."""
        p = PREFIX
        out = [f"# HELP {p}api_requests_total HTTP requests answered, by method, route and status "
               f"({CLIENT_GONE}: the client went away).",
               f"# TYPE {p}api_requests_total counter"]
        out += [f'{p}api_requests_total{{method="{m}",route="{_label(r)}",status="{s}"}} {n}'
                for (m, r, s), n in sorted(self.requests.items())]
        out += [f"# HELP {p}api_request_duration_seconds Time from a request's arrival to the end of its answer.",
                f"# TYPE {p}api_request_duration_seconds histogram",
                *self.request_seconds.lines(f"{p}api_request_duration_seconds"),
                f"# HELP {p}time_to_first_token_seconds Time from a generation request's arrival to its first text.",
                f"# TYPE {p}time_to_first_token_seconds histogram",
                *self.ttft_seconds.lines(f"{p}time_to_first_token_seconds"),
                f"# HELP {p}time_per_output_token_seconds A generation's time from its first text to its end "
                "per token after the first.",
                f"# TYPE {p}time_per_output_token_seconds histogram",
                *self.tpot_seconds.lines(f"{p}time_per_output_token_seconds"),
                f"# HELP {p}prompt_tokens_total Prompt tokens of the generations served.",
                f"# TYPE {p}prompt_tokens_total counter",
                f"{p}prompt_tokens_total {self.prompt_tokens}",
                f"# HELP {p}completion_tokens_total Tokens generated (a final stop token included).",
                f"# TYPE {p}completion_tokens_total counter",
                f"{p}completion_tokens_total {self.completion_tokens}"]
        if load is not None:
            out += [f"# HELP {p}sequences_running Sequences in the batch now.",
                    f"# TYPE {p}sequences_running gauge",
                    f"{p}sequences_running {load['running']}",
                    f"# HELP {p}sequences_waiting Sequences queued for a batch slot now.",
                    f"# TYPE {p}sequences_waiting gauge",
                    f"{p}sequences_waiting {load['waiting']}",
                    f"# HELP {p}step_duration_seconds Wall time of the forward steps (all running sequences each).",
                    f"# TYPE {p}step_duration_seconds summary",
                    f"{p}step_duration_seconds_sum {_number(load['step_seconds'])}",
                    f"{p}step_duration_seconds_count {int(load['steps'])}"]
            if "prefilled" in load:
                out += [f"# HELP {p}prompt_tokens_prefilled_total Prompt tokens run through the model.",
                        f"# TYPE {p}prompt_tokens_prefilled_total counter",
                        f"{p}prompt_tokens_prefilled_total {int(load['prefilled'])}",
                        f"# HELP {p}prompt_tokens_reused_total Prompt tokens whose KV cache an earlier "
                        "sequence left (prefix reuse), not prefilled.",
                        f"# TYPE {p}prompt_tokens_reused_total counter",
                        f"{p}prompt_tokens_reused_total {int(load['reused'])}",
                        f"# HELP {p}prefix_cache_positions KV positions kept for prefix reuse now.",
                        f"# TYPE {p}prefix_cache_positions gauge",
                        f"{p}prefix_cache_positions {int(load['prefix_positions'])}",
                        f"# HELP {p}prefix_cache_evictions_total Kept KV caches evicted to make room.",
                        f"# TYPE {p}prefix_cache_evictions_total counter",
                        f"{p}prefix_cache_evictions_total {int(load['prefix_evictions'])}"]
        if swarm is not None:
            out += self._swarm_lines(swarm)
        return "\n".join(out) + "\n"


    @staticmethod
    def _swarm_lines(swarm: SwarmLoad) -> list[str]:
        p = PREFIX
        out = [f"# HELP {p}plan_version The version of the plan the coordinator runs (0: none).",
               f"# TYPE {p}plan_version gauge",
               f"{p}plan_version {swarm.plan_version}",
               f"# HELP {p}peer_answer_seconds Time from a request to a peer to its answer, by peer "
               "(FFN ranges and stages; late answers too).",
               f"# TYPE {p}peer_answer_seconds histogram"]
        for peer, hist in sorted(swarm.answers.items()):
            out += hist.lines(f"{p}peer_answer_seconds", f'peer="{_label(peer)}",')
        out += [f"# HELP {p}peer_marked_down_total Times a peer was marked down (gone, wrong, refused or "
                "late again and again), by peer.",
                f"# TYPE {p}peer_marked_down_total counter"]
        out += [f'{p}peer_marked_down_total{{peer="{_label(peer)}"}} {n}' for peer, n in sorted(swarm.marked_down.items())]
        return out


@dataclass(frozen=True)
class SwarmLoad:
    """What the coordinator's dispatch has seen: its plan's version, each peer's answer times
    (s) and how often each was marked down."""

    plan_version: int
    answers: Mapping[str, Histogram]
    marked_down: Mapping[str, int]


def _number(x: float) -> str:
    if math.isinf(x):
        return "+Inf" if x > 0 else "-Inf"
    return repr(float(x))


def _label(value: str) -> str:
    """A label value escaped as the format asks (backslash, double quote, newline)."""
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")
