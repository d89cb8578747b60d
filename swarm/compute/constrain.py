"""Output constrained to a JSON schema while sampling (OpenAI's ``response_format``).

A :class:`JsonGrammar` is a request's schema compiled by llguidance (its JSON-schema compiler,
whitespace fixed to ``", "`` and ``": "`` so a small model cannot wander off into blank lines);
a :class:`Grammar` of a tool format's grammar
(:meth:`swarm.peer.coordinator.api_tools.ToolFormat.grammar`) forces one tool call in the chat
template's format. Calling either gives one sequence's :class:`JsonConstraint`, whose :meth:`~JsonConstraint.allowed`
is the mask of tokens that keep the reply a prefix of a document the schema accepts, and which
:meth:`~JsonConstraint.advance` moves past each sampled token. Once the document is complete,
only the end-of-sequence token is allowed. The :class:`~swarm.compute.sampling.Sampler` applies
the mask after the logits, on the machine that samples — every forward pass, and every peer's
part of it, is the same with or without it.

llguidance was chosen by measurement (``bench/constrain.py``, ``bench/results/constrain.json``):
at SmolLM2's 49,152 tokens a mask takes ~0.01 ms (p90 0.03 ms) against xgrammar's ~0.02 ms
(0.02 ms, p90 0.06 ms, at 151,000 tokens), it
has no runtime dependencies (xgrammar needs torch, triton and transformers), and wheels for
macOS arm64 and Linux x86_64/aarch64 (1.6.x: manylinux_2_28; later releases need glibc 2.31).
"""

from __future__ import annotations

import json
import threading
from typing import Any

import numpy as np

from swarm.errors import SwarmError

# Fixed separators and no free whitespace: the reply is compact JSON (OpenAI's strict mode allows
# any whitespace, and a 135M model given that freedom may write newlines until max_tokens).
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}

_lock = threading.Lock()
_tokenizers: dict[int, tuple[Any, Any]] = {}  # id(TextTokenizer) → (the tokenizer, its LLTokenizer)


class GrammarError(SwarmError):
    """A schema that cannot constrain output (not a JSON schema, or one llguidance refuses)."""


def _llguidance() -> Any:
    try:
        import llguidance
    except ImportError:  # a declared dependency; missing only from a broken install
        raise GrammarError("constrained output needs the llguidance package (pip install llguidance)") from None
    return llguidance


def _ll_tokenizer(tokenizer: Any, vocab_size: int, eos: int) -> Any:
    """llguidance's view of ``tokenizer`` (built once per tokenizer: ~0.2 s for 49k tokens)."""
    llguidance = _llguidance()

    with _lock:
        held = _tokenizers.get(id(tokenizer))
        if held is None or held[0] is not tokenizer:
            held = (tokenizer, llguidance.LLTokenizer(tokenizer.tokenizer.to_str(), n_vocab=vocab_size,
                                                      eos_token=eos))
            _tokenizers[id(tokenizer)] = held
        return held[1]


class Grammar:
    """An llguidance ``grammar`` (from :func:`json_grammar`, or a tool format's Lark grammar)
    compiled for ``tokenizer`` (a :class:`~swarm.compute.tokenizer.TextTokenizer`) over
    ``vocab_size`` logits; the end of the output is ``tokenizer.eos_token_ids[0]``. Call it for a
    fresh :class:`JsonConstraint`.

    Raises: GrammarError naming what the compiler refused.
    """

    def __init__(self, tokenizer: Any, vocab_size: int, grammar: str) -> None:
        llguidance = _llguidance()

        if not tokenizer.eos_token_ids:
            raise GrammarError("the tokenizer has no end-of-sequence token to end a constrained reply with")
        self.vocab_size = vocab_size
        self._tokenizer = _ll_tokenizer(tokenizer, vocab_size, tokenizer.eos_token_ids[0])
        self._grammar = grammar
        probe = llguidance.LLMatcher(self._tokenizer, self._grammar, log_level=0)
        if probe.is_error():
            raise GrammarError(f"the schema cannot constrain output: {probe.get_error()}")

    def __call__(self) -> JsonConstraint:
        return JsonConstraint(self._tokenizer, self._grammar, self.vocab_size)


class JsonGrammar(Grammar):
    """Output that is one JSON document ``schema`` (a JSON schema, as a dict) accepts."""

    def __init__(self, tokenizer: Any, vocab_size: int, schema: dict[str, Any]) -> None:
        super().__init__(tokenizer, vocab_size, json_grammar(schema))


def json_grammar(schema: dict[str, Any]) -> str:
    """The llguidance grammar of the JSON documents ``schema`` accepts (compact: :data:`JSON_OPTIONS`).

    Raises: GrammarError for a schema that is not a JSON object."""
    llguidance = _llguidance()

    try:
        return llguidance.LLMatcher.grammar_from_json_schema(json.dumps(schema), overrides=JSON_OPTIONS)
    except (ValueError, TypeError) as exc:
        raise GrammarError(f"not a JSON schema: {exc}") from None


class JsonConstraint:
    """One sequence's place in the grammar (used by one thread)."""

    def __init__(self, ll_tokenizer: Any, grammar: str, vocab_size: int) -> None:
        import llguidance

        self._matcher = llguidance.LLMatcher(ll_tokenizer, grammar, log_level=0)
        self._words = np.full((vocab_size + 31) // 32, -1, np.int32)  # llguidance's bitmask: bit i = token i
        self.vocab_size = vocab_size

    def allowed(self) -> np.ndarray:
        """Which tokens may come next: bool [vocab_size].

        Raises: GrammarError when the matcher failed (it refuses every token then)."""
        self._matcher.unsafe_compute_mask_ptr(self._words.ctypes.data, self._words.nbytes)
        if self._matcher.is_error():
            raise GrammarError(f"constrained decoding failed: {self._matcher.get_error()}")
        return np.unpackbits(self._words.view(np.uint8), bitorder="little")[:self.vocab_size].astype(bool)

    def advance(self, token: int) -> None:
        """Take ``token`` (one :meth:`allowed` allowed) as the next of the reply."""
        if not self._matcher.consume_token(token):
            raise GrammarError(f"token {token} does not continue the JSON reply: {self._matcher.get_error()}")

    @property
    def finished(self) -> bool:
        """Whether the document is complete (only the end-of-sequence token may follow)."""
        return self._matcher.is_accepting()
