"""The engine behind the coordinator's API: the :class:`ChatBackend` protocol the server runs,
and :class:`EngineBackend`, which encodes a request with the model's chat template, checks it
against the context and hands it to the continuous-batching schedulers
(:mod:`swarm.compute.serving`: one, or one per stage when stages run on other peers);
:class:`Reply` is one admitted request's text pieces
(``str``, or :class:`Piece` with their tokens' logprobs when the request asks for them).
"""

from __future__ import annotations

import builtins
import dataclasses
import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, Protocol

from swarm.compute.constrain import Grammar, JsonGrammar
from swarm.compute.sampling import Sampled
from swarm.compute.serving import SchedulerPool, TokenStream
from swarm.compute.textgen import (GenerationStats, PieceMaker, ReplyPiece, context_limit, encode_prompt,
                                   token_bytes, with_stop_tokens)
from swarm.peer.coordinator.api_metrics import Histogram, SwarmLoad
from swarm.peer.coordinator.api_request import ChatRequest
from swarm.peer.coordinator.api_tools import check_tools_served, template_messages
from swarm.peer.coordinator.dispatch import RemoteFFN
from swarm.peer.coordinator.stages import StagedFFN


class ChatBackend(Protocol):
    """What the API runs. ``prepare`` encodes and checks the prompt (raising
    :class:`~swarm.errors.ContextLengthError` or :class:`~swarm.errors.ChatTemplateError`
    before any generation; run in a thread); ``generate`` is called on the event loop and must
    not block: it admits the request (or raises
    :class:`~swarm.compute.serving.QueueFullError`) and returns a *blocking* iterator of text
    pieces — ``str``, or :class:`Piece` with the logprobs of its tokens — (iterated in a thread)
    that fills ``stats`` as it goes; its ``cancel()``, when it
    has one, is called from the event loop when the client goes away. An iterator that also has
    ``listen(listener, key)`` and ``poll()`` (:class:`Reply`) is not iterated in a thread: the
    event loop polls it when its listener is told of new tokens. ``concurrency``: how many
    requests it takes at once (running and queued)."""

    model_id: str
    max_tokens_limit: int
    concurrency: int

    def prepare(self, request: ChatRequest) -> ChatRequest: ...

    def generate(self, request: ChatRequest, stats: GenerationStats) -> Iterator[str | Piece]: ...


@dataclass(frozen=True)
class TokenLogprob:
    """One token of a reply as OpenAI's logprobs report it: its text (``bytes`` decoded, a
    partial character as U+FFFD), its bytes, its log-probability (None when not asked for) and
    its most likely alternatives ``(text, bytes, logprob)``, most likely first."""

    token: str
    bytes: builtins.bytes
    logprob: float | None
    top: tuple[tuple[str, builtins.bytes, float], ...] = ()


@dataclass(frozen=True)
class Piece:
    """A piece of reply text, the tokens that completed it (with logprobs, when the request
    asks for them) and how many generated tokens it ends (``generated``: 0 when not known)."""

    text: str
    tokens: tuple[TokenLogprob, ...] = ()
    generated: int = 0


class EngineBackend:
    """The numpy engine behind the API: the chat template, the context check and the token
    loop of :mod:`swarm.compute.textgen` (the ``generate`` command's own).

    ``ffn`` is the engine's FFN backend: None for ``LocalFFN`` (one machine), the
    coordinator's ``RemoteFFN`` in the swarm — the tokens are the same either way; it may be
    replaced at any time (read at each step). ``max_batch`` sequences run at once and
    ``max_queue`` wait (:class:`~swarm.compute.serving.BatchScheduler`; None: the process's
    defaults, ``join --max-batch/--max-queue``).

    Stages on other peers: while ``ffn`` is a stage dispatch with more than one stage and a
    worker among them, one batch scheduler per stage steps its own sequences through it (a
    :class:`~swarm.compute.serving.SchedulerPool`), so one scheduler's step is at one stage while
    another's is at the next; a new request goes to the least loaded and its sequence stays
    there — or, when the planner prices groups cut on the kernels' row tile cheaper, a tile at a
    time, which may take a scheduler past one per stage (on CPUs a group past a multiple of 4 rows
    costs each stage a kernel pass more: 16 sequences over three stages run as four groups of 4). ``max_batch``, ``max_queue`` and ``context`` hold for all of them together; finished
    sequences' KV caches are kept for prompts that start with their tokens (``prefix_reuse``,
    :mod:`swarm.compute.prefix`) within the ``context`` positions the running ones leave. Otherwise
    (and with one stage) one scheduler, as on one machine. A sequence's tokens are its solo
    run's either way (every row is batch-invariant).
    """

    def __init__(self, model: Any, tokenizer: Any, *, model_id: str, ffn: Any = None,
                 max_tokens_limit: int | None = None, max_batch: int | None = None,
                 max_queue: int | None = None, context: int | None = None, prefix_reuse: bool = True) -> None:
        self.model, self.tokenizer, self.ffn = model, tokenizer, ffn
        self.model_id = model_id
        # ``context``: positions of KV cache this server may hold, all sequences together (the memory
        # plan's reserve): one sequence never takes more, and sequences wait until theirs fit.
        self.context = context
        self.max_tokens_limit = max_tokens_limit or context_limit(model.config, context) or 8192
        self.vocab_size = model.config.vocab_size  # logit_bias ids are checked against it
        self.scheduler = SchedulerPool(model, lambda: self.ffn, max_batch=max_batch, max_queue=max_queue,
                                       max_positions=context, prefix_reuse=prefix_reuse)
        self._share(ffn)
        self.concurrency = self.scheduler.max_batch + self.scheduler.max_queue

    def set_ffn(self, ffn: Any) -> None:
        """Requests that start from now on compute their FFN with ``ffn`` (the coordinator's newest
        backend), over as many schedulers as it has stages on other peers (:func:`schedulers_for`)."""
        self.ffn = ffn
        self._share(ffn)

    def _share(self, ffn: Any) -> None:
        """As many schedulers as ``ffn`` has stages on other peers — more where the planner prices
        groups cut on the kernels' row tile cheaper (a priced stage dispatch's pricer,
        :meth:`~swarm.peer.coordinator.costmodel.GroupPricer.row_tile`: the schedulers fill a tile
        at a time); a stage dispatch is told how many step through it at least (their steps are
        its groups in flight: none cut within a step)."""
        n = schedulers_for(ffn)
        pricer = ffn.pricer if isinstance(ffn, StagedFFN) and n > 1 else None
        self.scheduler.set_width(n, pricer.row_tile() if pricer is not None else None)
        if isinstance(ffn, StagedFFN):
            ffn.set_schedulers(n)

    def running(self) -> int:
        """Sequences running now, every scheduler's (the planner's load)."""
        return self.scheduler.running()

    def fail_all(self, exc: BaseException) -> int:
        """End every admitted request now with ``exc`` (:meth:`BatchScheduler.fail_all`)."""
        return self.scheduler.fail_all(exc)

    def load(self) -> dict[str, float]:
        """Sequences ``running`` and ``waiting`` now, forward ``steps`` run and their total
        ``step_seconds``, prompt tokens ``prefilled`` and ``reused`` (prefix reuse) so far, KV
        positions ``prefix_positions`` kept for reuse now and ``prefix_evictions`` so far (for
        ``GET /metrics`` and status)."""
        now = self.scheduler.snapshot()
        pool = self.scheduler
        with pool.cond:
            kept, evicted, reused = pool.prefixes.positions(), pool.prefixes.evicted, pool.prefixes.reused_tokens
        return {"running": len(now["running"]), "waiting": len(now["waiting"]), "steps": now["steps"],
                "step_seconds": pool.step_s_total, "prefilled": pool.prompt_tokens_prefilled, "reused": reused,
                "prefix_positions": kept, "prefix_evictions": evicted}

    def swarm_load(self) -> SwarmLoad | None:
        """The dispatch's plan version, each peer's answer times and marked-down count (for
        ``GET /metrics``), over the stage dispatch and the FFN ranges alike; None on one machine."""
        ffn, trackers, version = self.ffn, [], 0
        if isinstance(ffn, StagedFFN):
            trackers.append(ffn.tracker)
            version, ffn = ffn.layout.version, ffn.inner
        if isinstance(ffn, RemoteFFN):
            trackers.append(ffn.tracker)
            version = ffn.plan.version  # the plan's version (a stage layout is one of its parts)
        if not trackers:
            return None
        answers: dict[str, Histogram] = {}
        down: dict[str, int] = {}
        for tracker in trackers:
            for peer, (hist, failures) in tracker.answer_times().items():
                if peer in answers:
                    answers[peer].merge(hist)
                else:
                    answers[peer] = hist
                down[peer] = down.get(peer, 0) + failures
        return SwarmLoad(version, answers, down)

    def prepare(self, request: ChatRequest) -> ChatRequest:
        """``request`` with its encoded prompt; a ``max_tokens`` the client did not set shrinks
        to what the context leaves (as OpenAI's API does).

        Its ``json_schema``, when it has one, is compiled into its ``constraint``
        (:class:`~swarm.compute.constrain.JsonGrammar`); so is a forced tool call
        (``tool_choice`` ``required`` or a function: :mod:`swarm.peer.coordinator.api_tools`).
        Tools and tool messages are rendered by the chat template.

        Raises: ContextLengthError (the numbers named), ChatTemplateError, ModelFileError,
        GrammarError (a schema that cannot constrain output), ToolsNotServed (tools for a
        template without a tool format).
        """
        vocab = self.model.config.vocab_size
        if request.json_schema is not None and request.constraint is None:
            request = dataclasses.replace(request, constraint=JsonGrammar(
                self.tokenizer, vocab, json.loads(request.json_schema)))
        fmt = None if request.prompt is not None else check_tools_served(
            self.tokenizer.chat_template, request.tools, request.messages, self.tokenizer.special_tokens)
        if fmt is not None:
            request = dataclasses.replace(request, tool_format=fmt)
        if fmt is not None and request.tool_choice in ("required", "function") and request.constraint is None:
            request = dataclasses.replace(request, constraint=Grammar(
                self.tokenizer, vocab, fmt.grammar(list(request.tools), request.tool_name)))
        messages = request.prompt if request.prompt is not None else template_messages(request.messages)
        tools = list(request.tools) or None
        limit = context_limit(self.model.config, self.context)
        if request.max_tokens_set or limit is None:
            ids = encode_prompt(self.model, self.tokenizer, messages, request.max_tokens, self.context, tools=tools)
            return dataclasses.replace(request, prompt_ids=tuple(ids))
        ids = encode_prompt(self.model, self.tokenizer, messages, 1, self.context, tools=tools, max_tokens_set=False)
        return dataclasses.replace(request, prompt_ids=tuple(ids), max_tokens=min(request.max_tokens, limit - len(ids)))

    def generate(self, request: ChatRequest, stats: GenerationStats) -> Reply:
        """Admit ``request`` to the batch (non-blocking once prepared) and return its reply.

        Raises: QueueFullError when every slot and queue place is taken; as :meth:`prepare`
        for a request not prepared yet.
        """
        from swarm.compute.sampling import SamplingParams

        if request.prompt_ids is None:
            request = self.prepare(request)
        params = with_stop_tokens(self.model, self.tokenizer, SamplingParams(
            temperature=request.temperature, top_p=request.top_p, top_k=request.top_k,
            seed=request.seed, max_tokens=request.max_tokens, presence_penalty=request.presence_penalty,
            frequency_penalty=request.frequency_penalty, logit_bias=request.logit_bias, logprobs=request.logprobs,
            constraint=request.constraint, prompt_logprobs=request.echo and request.logprobs is not None))
        prompt_ids = request.prompt_ids
        assert prompt_ids is not None  # prepared above
        tokens = self.scheduler.submit(prompt_ids, params)
        pieces = PieceMaker(self.tokenizer, params, len(prompt_ids), stats)
        if request.logprobs is None:
            return Reply(tokens, pieces, _text)
        return Reply(tokens, pieces, self._piece, self._token)

    def _piece(self, piece: ReplyPiece) -> Piece:
        return Piece(piece.text, tuple(self._token(s) for s in piece.tokens), len(piece.tokens))

    def _token(self, sampled: Sampled) -> TokenLogprob:
        def text(token: int) -> tuple[str, bytes]:
            raw = token_bytes(self.tokenizer, token)
            return raw.decode("utf-8", "replace"), raw

        return TokenLogprob(*text(sampled.token), sampled.logprob,
                            tuple((*text(t), lp) for t, lp in sampled.top))


def _text(piece: ReplyPiece) -> Piece | None:
    """A reply piece without logprobs: its text and token count, None when it has neither."""
    return Piece(piece.text, (), len(piece.tokens)) if piece.text or piece.tokens else None


def schedulers_for(ffn: Any) -> int:
    """How many batch schedulers serve over ``ffn``: one per stage of a stage dispatch whose
    stages include one on another peer (the stages then pipeline the schedulers' steps), else 1."""
    if not isinstance(ffn, StagedFFN) or not ffn.layout.workers():
        return 1
    return len(ffn.layout.stages)


class Reply:
    """The pieces (:class:`Piece`) of one admitted request: a blocking iterator, or (on an event loop)
    :meth:`listen` and :meth:`poll`; :meth:`cancel` (any thread) takes its sequence out of the
    batch and ends the iteration; :meth:`close` does the same. ``pieces`` turns the tokens into
    reply pieces (and fills the request's stats); ``convert`` makes each what the reply yields
    (None: skipped); ``as_logprob``: a prompt token's logprobs when the request echoes them."""

    def __init__(self, tokens: TokenStream, pieces: PieceMaker, convert: Callable[[ReplyPiece], Piece | None],
                 as_logprob: Callable[[Sampled], TokenLogprob] | None = None) -> None:
        self.tokens, self._maker, self._convert, self._as_logprob = tokens, pieces, convert, as_logprob
        self._ended = False
        self._blocking: Iterator[Piece] | None = None

    def prompt_logprobs(self) -> list[TokenLogprob]:
        """The prompt's tokens with their logprobs (the first's None) when the request echoes
        its prompt with logprobs, else []; complete once the first piece has come."""
        convert = self._as_logprob
        return [] if convert is None else [convert(s) for s in self.tokens.prompt_sampled]

    def __iter__(self) -> Iterator[Piece]:
        return self

    def __next__(self) -> Piece:
        if self._blocking is None:
            self._blocking = self._pieces()
        return next(self._blocking)

    def _pieces(self) -> Iterator[Piece]:
        for sampled in self.tokens.sampled():
            out, end = self._take([sampled], False)
            yield from out
            if end:
                return
        yield from self._take([], True)[0]

    def listen(self, listener: Callable[[list[Any]], None] | None, key: Any = None) -> None:
        """Have ``listener([key, ...])`` called, from the batch scheduler's thread, when tokens of
        this reply are ready for :meth:`poll` — once per step for all the replies that share the
        listener (:meth:`TokenStream.listen`); None: no more calls."""
        self.tokens.listen(listener, key)

    def poll(self) -> tuple[list[Piece], bool | BaseException]:
        """Without blocking: the pieces ready now, and how the reply stands after them — False
        (more to come), True (it ended), or the exception that failed its generation (the
        blocking iteration raises it at that point). Not to be mixed with iterating."""
        if self._ended:
            return [], True
        items, end = self.tokens.drain()
        out, ended = self._take(items, end is True)
        if ended:
            return out, True
        if isinstance(end, BaseException):
            self._ended = True
        return out, end

    def _take(self, items: list[Sampled], last: bool) -> tuple[list[Piece], bool]:
        """The pieces ``items`` complete (with ``last``: and the held-back rest), and whether the
        reply ended with them (a stop token, or ``last``)."""
        maker, convert, out = self._maker, self._convert, []
        for sampled in items:
            maker.stats.cached_tokens = self.tokens.reused  # known once the sequence has joined
            piece = maker.push(sampled)
            if maker.stopped:
                last = True
                break
            if piece is not None and (value := convert(piece)) is not None:
                out.append(value)
        if last:
            self._ended = True
            piece = maker.finish()
            if piece is not None and (value := convert(piece)) is not None:
                out.append(value)
        return out, last

    def cancel(self) -> None:
        self.tokens.cancel()

    close = cancel  # what iterating code calls when it stops early
