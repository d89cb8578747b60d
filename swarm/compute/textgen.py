"""Text in, text out on top of the engine.

:func:`generate_text` is the seam between text and tokens: chat messages (or a raw
prompt) → chat template → token ids, checked against the vocabulary and the context
(:func:`encode_prompt`) → the engine's token generator → streaming detokenization → text
pieces (:func:`stream_reply`). It takes any model the engine's ``generate`` accepts; the
swarm's API encodes through the same function and turns the tokens of its batch scheduler
(:mod:`swarm.compute.serving`) into text with the same :func:`reply_pieces`. The
``generate`` command around it lives in :mod:`swarm.cli.generate`.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, replace
from functools import lru_cache
from typing import Any

from tokenizers import decoders

from swarm.compute.sampling import Sampled, SamplingParams, generate
from swarm.compute.tokenizer import TextTokenizer, _bytes_to_unicode
from swarm.errors import ContextLengthError, ModelFileError, SwarmError

MAX_TEMPERATURE = 2.0  # the highest sampling temperature the CLI and the API accept (OpenAI's bound)


@dataclass
class GenerationStats:
    """What a generation reports as it runs: token counts and OpenAI's ``finish_reason``.

    ``completion_tokens`` counts every generated id, a final stop token included;
    ``cached_tokens``: prompt tokens whose KV cache an earlier sequence left (prefix reuse), not
    prefilled again.
    """

    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0
    finish_reason: str = "stop"  # "stop" (a stop token or string) or "length" (max_tokens)


def context_limit(config: Any, context: int | None = None) -> int | None:
    """The most positions one sequence may take: the model's context
    (``max_position_embeddings``), or its attention window when the engine cannot attend past
    it (``sliding_window``), and at most ``context`` (a server's own bound, e.g. the KV cache its
    memory plan reserves); None when none of them is stated."""
    limits = [n for n in (getattr(config, "max_position_embeddings", 0),
                          getattr(config, "sliding_window", None), context) if n]
    return min(limits) if limits else None


def _context_words(config: Any, limit: int) -> str:
    """How an error names the context ``limit``: the model's, or the server's narrower bound."""
    model = context_limit(config)
    return (f"the model's context of {limit} tokens" if model == limit else
            f"this server's context of {limit} tokens (its join --context; the model's is {model})")


def encode_prompt(model: Any, tokenizer: TextTokenizer, messages: Sequence[Mapping[str, Any]] | str,
                  max_tokens: int, context: int | None = None, *,
                  tools: Sequence[Mapping[str, Any]] | None = None, max_tokens_set: bool = True) -> list[int]:
    """The prompt's token ids, checked before any work is done.

    messages: chat messages (``[{"role", "content"}, ...]``), rendered with the checkpoint's
        chat template and its generation prompt; or a ``str``, encoded as is (with BOS when
        the checkpoint asks for it) — ``--raw``.
    tools: function tools handed to the chat template (OpenAI's shape).
    max_tokens: the most tokens the reply may take; prompt + reply must fit
        :func:`context_limit` (of ``context``, a server's own bound, when given).
    max_tokens_set: whether the user chose ``max_tokens`` (an error names it only then; else
        the prompt is said to leave no room for ``max_tokens`` reply tokens).
    Raises: :class:`~swarm.errors.ChatTemplateError` if the template rejects the messages;
    :class:`~swarm.errors.ModelFileError` if the tokenizer yields ids outside the model's
    vocabulary; :class:`~swarm.errors.ContextLengthError` naming the numbers when the prompt
    and ``max_tokens`` do not fit; :class:`~swarm.errors.SwarmError` for an empty prompt.
    """
    text = messages if isinstance(messages, str) else tokenizer.apply_chat_template(
        messages, **({"tools": tools} if tools else {}))
    limit = context_limit(model.config, context)
    fewest = tokenizer.fewest_tokens(text) if limit is not None else None
    reply, advice = (f"and max_tokens is {max_tokens}", "shorten the prompt or ask for fewer tokens") if max_tokens_set \
        else (f"with room for {max_tokens} reply token{'s' if max_tokens != 1 else ''}", "shorten the prompt")
    if fewest is not None and fewest + max_tokens > limit:  # surely too long: refused without encoding it
        raise ContextLengthError(
            f"the prompt{'' if isinstance(messages, str) else ' in its chat template'} is "
            f"{len(text.encode('utf-8', 'surrogatepass'))} bytes, so at least {fewest} tokens (no "
            f"token of this model stands for more than {tokenizer.max_token_bytes} bytes), {reply}: "
            f"more than {_context_words(model.config, limit)}; {advice}"
        )
    prompt_ids = tokenizer.encode(text, add_special_tokens=isinstance(messages, str))
    if not prompt_ids:
        raise SwarmError("the prompt is empty after tokenization; give some text")
    vocab = model.config.vocab_size
    if max(prompt_ids) >= vocab:
        raise ModelFileError(
            f"{tokenizer.source}: the tokenizer gave id {max(prompt_ids)}, but the model's vocabulary "
            f"has {vocab} entries; the tokenizer files do not belong to this model"
        )
    if limit is not None and len(prompt_ids) + max_tokens > limit:
        raise ContextLengthError(
            f"the prompt is {len(prompt_ids)} tokens {reply}: "
            f"{len(prompt_ids) + max_tokens} > {_context_words(model.config, limit)}; {advice}"
        )
    return prompt_ids


def stream_reply(
    model: Any,
    tokenizer: TextTokenizer,
    prompt_ids: Sequence[int],
    params: SamplingParams,
    *,
    ffn: Any = None,
    stats: GenerationStats | None = None,
) -> Iterator[str]:
    """Yield the reply to ``prompt_ids`` (from :func:`encode_prompt`) as text pieces, as soon
    as each is complete UTF-8. The CLI streams through here; the API through
    :func:`reply_pieces` over its batch scheduler's tokens.

    params: sampling options; the end-of-sequence ids of the tokenizer and of the model
        config are added to ``params.stop_tokens`` (:func:`with_stop_tokens`). A stop token ends
        the reply unprinted.
    ffn: the FFN backend handed to the engine's ``generate`` (None: local; the swarm passes
        its remote backend here).
    stats: filled as the reply is generated (prompt and completion token counts, finish reason).
    """
    params = with_stop_tokens(model, tokenizer, params)
    tokens = generate(model, prompt_ids, params, ffn=ffn)
    yield from reply_pieces(tokens, tokenizer, params, len(prompt_ids), stats)


def with_stop_tokens(model: Any, tokenizer: TextTokenizer, params: SamplingParams) -> SamplingParams:
    """``params`` with the end-of-sequence ids of the tokenizer and the model config added to
    its ``stop_tokens``."""
    stop = tuple(dict.fromkeys(
        [*params.stop_tokens, *tokenizer.eos_token_ids, *(getattr(model.config, "eos_token_ids", ()) or ())]
    ))
    return replace(params, stop_tokens=stop)


def reply_pieces(tokens: Iterable[int], tokenizer: TextTokenizer, params: SamplingParams, prompt_tokens: int,
                 stats: GenerationStats | None = None) -> Iterator[str]:
    """Text pieces of generated ``tokens`` (complete UTF-8 each), up to the first of
    ``params.stop_tokens`` (not printed); ``stats`` counts them and says why the reply ended."""
    for piece in sampled_pieces((Sampled(t) for t in tokens), tokenizer, params, prompt_tokens, stats):
        if piece.text:
            yield piece.text


@dataclass(frozen=True)
class ReplyPiece:
    """A piece of reply text and the generated tokens that completed it (in order; a token
    whose bytes end mid-character goes with the piece its next token completes)."""

    text: str
    tokens: tuple[Sampled, ...]


def sampled_pieces(sampled: Iterable[Sampled], tokenizer: TextTokenizer, params: SamplingParams,
                   prompt_tokens: int, stats: GenerationStats | None = None) -> Iterator[ReplyPiece]:
    """:func:`reply_pieces` that keeps each piece's tokens (with their logprobs): the pieces'
    texts joined are the reply; their tokens, every generated token but a final stop token."""
    pieces = PieceMaker(tokenizer, params, prompt_tokens, stats)
    for item in sampled:
        piece = pieces.push(item)
        if pieces.stopped:
            break
        if piece is not None:
            yield piece
    if (last := pieces.finish()) is not None:
        yield last


class PieceMaker:
    """:func:`sampled_pieces` one token at a time, for a caller that is handed the tokens
    (the API's event loop) rather than pulling them: :meth:`push` each sampled token until
    :attr:`stopped`, then :meth:`finish` once. ``stats`` counts the tokens and says why the
    reply ended (``length`` until a stop token comes)."""

    def __init__(self, tokenizer: TextTokenizer, params: SamplingParams, prompt_tokens: int,
                 stats: GenerationStats | None = None) -> None:
        self.stats = stats if stats is not None else GenerationStats()
        self.stats.prompt_tokens = prompt_tokens
        self.stats.finish_reason = "length"
        self.stop = set(params.stop_tokens)
        self.stopped = False  # a stop token came: push no more
        self._decoder = tokenizer.stream_decoder()
        self._held: list[Sampled] = []

    def push(self, item: Sampled) -> ReplyPiece | None:
        """The piece ``item`` completes (None: its text is not complete yet, or it is a stop token,
        which sets :attr:`stopped`)."""
        self.stats.completion_tokens += 1
        if item.token in self.stop:
            self.stats.finish_reason = "stop"
            self.stopped = True
            return None
        self._held.append(item)
        if piece := self._decoder.push(item.token):
            held, self._held = tuple(self._held), []
            return ReplyPiece(piece, held)
        return None

    def finish(self) -> ReplyPiece | None:
        """The held-back rest at the end of the reply (None: nothing held)."""
        rest = self._decoder.flush()
        if rest or self._held:
            held, self._held = tuple(self._held), []
            return ReplyPiece(rest, held)
        return None


_BYTE_FALLBACK = re.compile(r"<0x([0-9A-Fa-f]{2})>")


def token_bytes(tokenizer: TextTokenizer, token: int) -> bytes:
    """The bytes token id ``token`` stands for (OpenAI's logprobs ``bytes``): a byte-level
    vocabulary's entry respelled from GPT-2's byte alphabet, a byte-fallback ``<0xHH>`` its
    byte, anything else its decoded text as UTF-8. A token may hold part of a character."""
    piece = tokenizer.tokenizer.id_to_token(token)
    if piece is None:
        return b""
    if isinstance(tokenizer.tokenizer.decoder, decoders.ByteLevel):
        table = _byte_alphabet()
        if all(c in table for c in piece):
            return bytes(table[c] for c in piece)
        return piece.encode()
    if m := _BYTE_FALLBACK.fullmatch(piece):
        return bytes([int(m.group(1), 16)])
    return tokenizer.decode([token], skip_special_tokens=False).encode()


@lru_cache(maxsize=1)
def _byte_alphabet() -> dict[str, int]:
    """GPT-2's byte-level alphabet, inverted: stand-in character → byte."""
    return {c: b for b, c in _bytes_to_unicode().items()}


def generate_text(
    model: Any,
    tokenizer: TextTokenizer,
    messages: Sequence[Mapping[str, Any]] | str,
    params: SamplingParams,
    *,
    ffn: Any = None,
    stats: GenerationStats | None = None,
) -> Iterator[str]:
    """:func:`encode_prompt` then :func:`stream_reply`: the reply to ``messages`` as text pieces.

    Raises: as :func:`encode_prompt`, when the first piece is asked for.
    """
    prompt_ids = encode_prompt(model, tokenizer, messages, params.max_tokens)
    yield from stream_reply(model, tokenizer, prompt_ids, params, ffn=ffn, stats=stats)
