"""Tokenizer, chat template and streaming detokenization, read from the checkpoint.

Theory of operation: the tokenizer itself is a Hugging Face ``tokenizers.Tokenizer``.
For an HF directory it is ``tokenizer.json`` as saved; for a GGUF file it is assembled
from the metadata llama.cpp writes (``tokenizer.ggml.tokens`` / ``merges`` /
``token_type`` / ``pre``) as a ``tokenizers`` BPE model with the pre-tokenizer that
llama.cpp uses for that ``pre`` name — the library does the BPE, we only pick its parts.
A ``pre`` name without a known split is refused by name; one whose vocabulary is not
byte-level (SentencePiece-style or WordPiece) is refused saying so. A SentencePiece vocabulary
(``tokenizer.ggml.model == "llama"``: tokens, ``scores``, byte tokens) becomes a BPE with
byte fallback whose merges follow the scores, as llama.cpp's SPM tokenizer merges.
This is what transformers' GGUF conversion does too (``integrations/gguf``), without
needing transformers at run time.

The chat template (a Jinja2 string from ``tokenizer.chat_template`` or
``tokenizer_config.json`` / ``chat_template.jinja``) is rendered in Jinja2's immutable
sandbox with the environment transformers uses (``trim_blocks``, ``lstrip_blocks``,
``raise_exception``, a ``tojson`` that keeps non-ASCII), so the prompt text is the one
``apply_chat_template`` produces.

:class:`StreamDecoder` turns token ids into text one id at a time and only ever yields
complete characters: a multi-byte UTF-8 character split over several byte-level tokens
is held back until its last byte arrives.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from functools import cached_property
from pathlib import Path
from typing import Any

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers

from swarm.errors import ChatTemplateError, ModelFileError

# llama.cpp ``llm_tokenizer_bpe`` pre-tokenizer regexes, by ``tokenizer.ggml.pre``
# (llama.cpp src/llama-vocab.cpp; the same table as transformers' GGUF_PRE_TOKENIZER_SPLITS).
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# Qwen3.5's: Qwen2's with combining marks kept in words (llama.cpp QWEN35, from its tokenizer.json)
_QWEN35_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}"
    r"| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# GPT-4o's (o200k) split, as its tokenizer.json writes it (llama.cpp GPT4O, MINIMAX_M2)
_GPT4O_SPLIT = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_TEKKEN_SPLIT = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
    r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_GPT2_SPLIT = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
_DEEPSEEK3_SPLITS = (
    r"\p{N}{1,3}",
    r"[一-龥぀-ゟ゠-ヿ]+",
    r"""[!"#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~][A-Za-z]+|[^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+"""
    r"| ?[\p{P}\p{S}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
)
_PORO_SPLIT = r" ?[^(\s|.,!?…。，、।۔،)]+"
# Kimi-K2's (tokenization_kimi.py; llama.cpp splits it with custom code): Han runs apart, GPT-4o's
# letter runs without Han, digits in threes. [A&&[^B]] is a class intersection (Oniguruma, regex V1).
_KIMI_K2_SPLIT = (
    r"[\p{Han}]+"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+"
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*"
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# Single-regex splits of other tokenizer.json files, as llama.cpp lists them (src/llama-vocab.cpp)
_SEED_CODER_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1}| ?[^\s\p{L}\p{N}\r\n]+|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_BAILINGMOE_SPLIT = (
    r"'(?i:[sdmt]|ll|ve|re)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]|\s+(?!\S)|\s+"
)
_UFAKZEKA_SPLIT = r"[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
_JAIS2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
    r"|\s{512}(?!\S)|\s{256}(?!\S)|\s{128}(?!\S)|\s{64}(?!\S)|\s{32}(?!\S)|\s{16}(?!\S)|\s{8}(?!\S)|\s{4}(?!\S)"
    r"|\s{1,2}(?!\S)|\s{1}"
)
_TINY_AYA_SPLITS = (r"\d{1,3}(?=(?:\d{3})*\b)", _GPT4O_SPLIT)
_EXAONE_MOE_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?(?:\p{L}\p{M}*(?: \p{L}\p{M}*)*)+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n/]?|\s*[\r\n]|\s+(?!\S)|\s+"
)
_SPARK2_5_SPLITS = (
    r"\p{N}{1,3}",
    r"[一-龥぀-ゟ゠-ヿ]+",
    r"""[!"#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~][A-Za-z]+|[^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+"""
    r"| ?[\p{P}\p{S}]+|[\r\n]|\s+(?!\S)|\s+",
    r"\p{N}",
)
_MINICPM5_SPLITS = (
    r"\p{N}{1,3}",
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}+| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
)
# DeepSeek-LLM's (its tokenizer.json, as llama.cpp lists it): letter runs of a listed set of scripts,
# ASCII and fullwidth punctuation runs, trailing whitespace, CJK runs, digit runs
_DEEPSEEK_LLM_SPLITS = (
    r"[\r\n]",
    r"\s?[A-Za-z" "\u00b5" r"À-ÖØ-öø-ƺƼ-ƿ" "\u01c4" r"-ʓʕ-ʯͰ-ͳͶͷͻ-ͽͿΆΈ-ΊΌΎ-ΡΣ-" "\u03f5"
    r"Ϸ-ҁҊ-ԯԱ-ՖႠ-ჅᎠ-Ᏽᏸ-ᏽᲐ-ᲺᲽ-Ჿᴀ-ᴫᵫ-ᵷᵹ-ᶚḀ-ἕἘ-Ἕἠ-ὅὈ-Ὅὐ-ὗὙὛὝὟ-" "\u1f7d" r"ᾀ-ᾴᾶ-ᾼ" "\u1fbe" r"ῂ-ῄῆ-ῌῐ-" "\u1fd3"
    r"ῖ-" "\u1fdb" r"ῠ-Ῥῲ-ῴῶ-ῼ" "\u2102\u2107\u210a" r"-" "\u2113\u2115\u2119" r"-"
    "\u211d\u2124\u2126\u2128\u212a" r"-" "\u212d\u212f" r"-" "\u2134\u2139\u213c" r"-" "\u213f\u2145" r"-"
    "\u2149" r"ⅎↃↄⰀ-ⱻⱾ-ⳤⳫ-ⳮⳲⳳꙀ-ꙭꚀ-ꚛꜢ-ꝯꝱ-ꞇꞋ-ꞎꭰ-ꮿ" "\ufb00" r"-" "\ufb06\ufb13" r"-" "\ufb17\uff21" r"-"
    "\uff3a\uff41" r"-" "\uff5a" r"𐐀-𐑏𐒰-𐓓𐓘-𐓻𐲀-𐲲𐳀-𐳲𑢠-𑣟𞤀-𞥃]+",
    r"\s?[!-/:-~" "\uff01" r"-" "\uff0f\uff1a" r"-" "\uff5e" r"‘-‟" "\u3000" r"-。]+",
    r"\s+$",
    r"[一-龥ࠀ-一가-" "\ud7ff" r"]+",
    r"\p{N}+",
)
# Youtu-LLM's: Hangul, CJK punctuation, Bopomofo and Han/kana runs apart, then GPT-4o's split with single digits
_YOUTU_SPLITS = (
    r"[가-힣" "\u3131" r"-" "\u318e" r"]+|[" "\uff01\u2026" r"“”‘’—" "\uff1a\uff1b\uff0c" r"、-〿" "\ufe30" r"-"
    "\ufe4f" r"]+|[ㄅ-ㄯ]+|[一-龥" "\u3040" r"-" "\u309f" r"゠-" "\u30ff" r"]+",
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+",
)
# Chameleon's: sentinel and image tokens, tabs/newlines and 4- or 2-space runs, single digits, single
# punctuation marks, then GPT-2's regex
_CHAMELEON_SPLITS = (r"<sentinel:[0-9]+>", r"(IMGIMG)((A|B|C|D|E|F|G|H|I){1,4})Z", r"([\t\n]|    |  )", r"\p{N}",
                     r"[\p{P}!-/:-@\[-`{-~]", _GPT2_SPLIT)
# granite-embedding-97m-multilingual-r2's, as llama.cpp writes it: GPT-4o's split with its case classes as
# lookaheads (letters or marks but a-z, then letters or marks but A-Z), so a non-ASCII letter counts as
# either case ("aÉb" is one piece, where GPT-4o's \p{Lu}/\p{Ll} classes cut it after "a")
_GRANITE_EMB_MULTI_SPLIT = (
    r"[^\r\n\p{L}\p{N}]?((?=[\p{L}\p{M}])([^a-z]))*((?=[\p{L}\p{M}])([^A-Z]))+(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|[^\r\n\p{L}\p{N}]?((?=[\p{L}\p{M}])([^a-z]))+((?=[\p{L}\p{M}])([^A-Z]))*(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# SuperBPE's: digit runs, each cut before every position with a multiple of three digits after it
# (a zero-width match, which splits as llama.cpp's offsets do); no whitespace split: its tokens span words
_SUPERBPE_SPLITS = (r"\p{N}+", r"(?=(\d{3})+(?!\d))")
# AFMoE's (Trinity): llama.cpp's custom digit split (unicode_regex_split_custom_afmoe) cuts each digit run
# in threes from the right, the first group keeping the text before it since the last cut: that is this
# regex's matches each merged with the gap before it. Then CJK and other Asian script runs, then
# DeepSeek-V3's third regex.
_AFMOE_DIGITS = r"\p{N}{1,3}(?=(?:\p{N}{3})*(?!\p{N}))"
_AFMOE_SPLITS = (
    _AFMOE_DIGITS,
    r"[一-鿿㐀-䶿豈-" "\ufaff\u3040" r"-" "\u309f" r"゠-" "\u30ff\uff65" r"-" "\uff9f\u2f00" r"-" "\u2fdf" r"เ-"
    "\u0e7f\u0e80" r"-" "\u0eff" r"ក-" "\u17ff" r"က-႟ꩠ-ꩿꧠ-" "\ua9ff" r"가-" "\ud7af" r"ᄀ-ᇿ]+",
    _DEEPSEEK3_SPLITS[2],
)
# How a split's matches are kept (tokenizers' SplitDelimiterBehavior): each apart unless listed
_SPLIT_BEHAVIOR = {_AFMOE_DIGITS: "merged_with_previous"}
# tokenizer.ggml.pre → the regexes llama.cpp splits text with, one after the other
# (llm_tokenizer_bpe, src/llama-vocab.cpp), then the byte-level alphabet.
_REGEX_SPLITS: dict[str, tuple[str, ...]] = {
    **dict.fromkeys(("llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral", "midm-2.0", "lfm2",
                     "smaug-bpe", "dbrx", "glm4", "glm5", "chatglm-bpe", "jina-v5-nano"), (_LLAMA3_SPLIT,)),
    **dict.fromkeys(("qwen2", "deepseek-r1-qwen", "kormo", "megrez", "stablelm2", "hunyuan", "grok-2", "f2llmv2",
                     "solar-open"), (_QWEN2_SPLIT,)),
    **dict.fromkeys(("deepseek-v3", "hunyuan-dense", "joyai-llm", "hy_v4"), _DEEPSEEK3_SPLITS),
    **dict.fromkeys(("gpt-4o", "llama4", "minimax-m2", "kanana2", "talkie"), (_GPT4O_SPLIT,)),
    "kimi-k2": (_KIMI_K2_SPLIT,),
    "seed-coder": (_SEED_CODER_SPLIT,),
    **dict.fromkeys(("bailingmoe", "bailingmoe2", "llada-moe"), (_BAILINGMOE_SPLIT,)),
    "ufakzeka": (_UFAKZEKA_SPLIT,),
    "jais-2": (_JAIS2_SPLIT,),
    **dict.fromkeys(("tiny_aya", "cohere2moe"), _TINY_AYA_SPLITS),
    "minicpm5": _MINICPM5_SPLITS,
    "exaone-moe": (_EXAONE_MOE_SPLIT,),
    "spark2_5": _SPARK2_5_SPLITS,
    "laguna": (r"[^\n]+|[\n]+", _QWEN2_SPLIT),  # lines first, then Qwen2's split
    "qwen35": (_QWEN35_SPLIT,),
    "tekken": (_TEKKEN_SPLIT,),
    "deepseek-coder": (r"[\r\n]", r"\s?\p{L}+", r"\s?\p{P}+", r"[一-龥ࠀ-一가-퟿]+", r"\p{N}"),
    "falcon": (r"[\p{P}\$\+<=>\^~\|`]+", _GPT2_SPLIT, r"[0-9][0-9][0-9]"),
    **dict.fromkeys(("poro-chat", "bloom", "gpt3-finnish"), (_PORO_SPLIT,)),
    "viking": (_PORO_SPLIT, r"\p{N}"),
    "deepseek-llm": _DEEPSEEK_LLM_SPLITS,
    "youtu": _YOUTU_SPLITS,
    "chameleon": _CHAMELEON_SPLITS,
    "granite-embed-multi-97m": (_GRANITE_EMB_MULTI_SPLIT,),
    "superbpe": _SUPERBPE_SPLITS,
    "afmoe": _AFMOE_SPLITS,
}
# These split every digit on its own first, then apply GPT-2's regex (llama.cpp groups
# STARCODER, REFACT, COMMAND_R, SMOLLM, CODESHELL, EXAONE, MINERVA this way).
_DIGIT_SPLIT_PRES = {"smollm", "starcoder", "refact", "command-r", "codeshell", "exaone", "minerva-7b", "mellum2"}
# GPT-2's regex alone (llama.cpp GPT2, MPT, OLMO, JAIS, TRILLION, GRANITE_DOCLING); "default"
# and a file without the field too, as transformers reads them. (llama.cpp also lets modern-bert's
# "[MASK]" take the spaces before it, a token attribute kept by no GGUF field and not applied here.)
_GPT2_PRES = {"default", "gpt2", "gpt-2", "phi-2", "jina-es", "jina-de", "gigachat", "jina-v1-en", "jina-v2-es",
              "jina-v2-de", "jina-v2-code", "roberta-bpe", "a.x-4.0", "mellum", "mpt", "olmo", "jais", "trillion",
              "granite-docling", "exaone4", "modern-bert"}
# Names llama.cpp's converter writes whose vocabulary is no byte-level BPE, each with why it is refused.
_SPM_STYLE_BPE = ("llama.cpp runs it as SentencePiece-style BPE over raw UTF-8 (spaces written '▁', text "
                  "cut at newlines only), not over byte-level pieces")
_NOT_BYTE_LEVEL_PRES = {
    **dict.fromkeys(("gemma4", "granite-embed-multi-311m", "sarvam-moe"), _SPM_STYLE_BPE),
    "whitespace": ("its vocabulary is split at whitespace, which is dropped, and matched as raw UTF-8 "
                   "(tokenizer.ggml.model 'whitespace' in llama.cpp)"),
    "chatglm-spm": "it names ChatGLM's SentencePiece vocabulary, which llama.cpp refuses in a BPE file too",
    **dict.fromkeys(("bert-bge", "bert-bge-large", "jina-v2-en"),
                    "it names a WordPiece (BERT) vocabulary, which llama.cpp refuses in a BPE file too"),
}

_TOKEN_TYPE_CONTROL = 3  # llama.cpp LLAMA_TOKEN_TYPE_CONTROL
_TOKEN_TYPE_USER_DEFINED = 4


@dataclass
class TextTokenizer:
    """A checkpoint's tokenizer, special token ids and chat template.

    ``eos_token_ids`` are the ids that end a reply (the file's EOS, plus generation-config
    EOS ids for HF directories). ``add_bos`` says whether :meth:`encode` with
    ``add_special_tokens=True`` puts ``bos_token_id`` first (GGUF ``add_bos_token``, as
    llama.cpp does; an HF ``tokenizer.json`` does this in its own post-processor). Chat
    prompts are encoded without it, as transformers does: the template writes its own
    special tokens.
    """

    tokenizer: Tokenizer
    chat_template: str | None
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]
    special_tokens: dict[str, str]
    source: str
    add_bos: bool = False

    @property
    def vocab_size(self) -> int:
        """Number of ids, added tokens included."""
        return self.tokenizer.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        """Token ids of ``text`` (int, each < vocab_size).

        Encoded by the library's batch call, which releases the GIL while it works: its one-text
        call holds it throughout (0.9 s for 1 MB of text with SmolLM2's tokenizer), and every
        other thread of the process — the event loop's included — waits that long.
        """
        ids = self.tokenizer.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids
        if add_special_tokens and self.add_bos:
            ids.insert(0, self.bos_token_id)
        return ids

    def decode(self, ids: Sequence[int], *, skip_special_tokens: bool = True) -> str:
        """Text of ``ids``; bytes that do not form UTF-8 become U+FFFD."""
        return self.tokenizer.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, messages: Sequence[Mapping[str, Any]], *, add_generation_prompt: bool = True,
                            tools: Sequence[Mapping[str, Any]] | None = None) -> str:
        """The prompt text for ``messages`` (``[{"role": ..., "content": ...}, ...]``); ``tools``
        (OpenAI's ``[{"type": "function", "function": {...}}]``) are handed to the template as
        transformers does, for a template that writes them.

        Raises: :class:`~swarm.errors.ChatTemplateError` when the checkpoint has no
        template, or the template rejects the messages or fails to render.
        """
        if self.chat_template is None:
            raise ChatTemplateError(f"{self.source} has no chat template; pass --raw to send the prompt as is")
        try:
            return self._compiled_template.render(
                messages=list(messages), add_generation_prompt=add_generation_prompt, **self.special_tokens,
                **({"tools": list(tools)} if tools is not None else {})
            )
        except ChatTemplateError:
            raise
        except Exception as exc:  # jinja2 raises many types (TemplateError, TypeError, SecurityError …)
            raise ChatTemplateError(f"the chat template of {self.source} failed: {exc}") from exc

    def encode_chat(self, messages: Sequence[Mapping[str, Any]]) -> list[int]:
        """Ids of the rendered chat prompt with the generation prompt (no extra BOS)."""
        return self.encode(self.apply_chat_template(messages), add_special_tokens=False)

    @cached_property
    def max_token_bytes(self) -> int | None:
        """The most bytes of UTF-8 text one token can stand for, so that a text of ``n`` bytes
        is at least ``ceil(n / max_token_bytes)`` tokens; None when no such bound holds: a
        normalizer that may shrink the text, a pre-tokenizer that drops some
        (:func:`_pre_tokenizer_keeps_text`), an unknown token without byte fallback (a run of
        unknown characters becomes one token), or an added token that strips whitespace.

        A byte-level vocabulary writes each byte as one character (GPT-2's map), so such an
        entry stands for as many bytes as it has characters; any other entry, and each added
        token, for at most its own UTF-8 length (a SentencePiece ``▁`` is 3 bytes for one space,
        a byte-fallback ``<0x41>`` 6 for one byte).
        """
        normalizer = self.tokenizer.normalizer
        if normalizer is not None and not _normalizer_only_grows(json.loads(normalizer.__getstate__())):
            return None
        pre = self.tokenizer.pre_tokenizer
        if pre is not None and not _pre_tokenizer_keeps_text(json.loads(pre.__getstate__())):
            return None  # it drops text (whitespace splitting, removed splits): no bound holds
        model = json.loads(self.tokenizer.model.__getstate__())
        if model.get("unk_token") is not None or model.get("unk_id") is not None:
            if not model.get("byte_fallback"):
                return None  # a run of unknown characters may become one unk token
        if any(t.lstrip or t.rstrip for t in self.tokenizer.get_added_tokens_decoder().values()):
            return None  # such a token swallows any amount of whitespace beside it
        byte_chars = set(_bytes_to_unicode().values()) if isinstance(self.tokenizer.decoder, decoders.ByteLevel) else set()
        longest = 0
        for piece in self.tokenizer.get_vocab(with_added_tokens=False):
            longest = max(longest, len(piece) if byte_chars.issuperset(piece) else len(piece.encode()))
        for added in self.tokenizer.get_added_tokens_decoder().values():
            longest = max(longest, len(added.content.encode()))
        return longest or None

    def fewest_tokens(self, text: str) -> int | None:
        """A lower bound of ``len(self.encode(text))`` found without encoding (see
        :attr:`max_token_bytes`); None when the tokenizer allows none."""
        most = self.max_token_bytes
        return None if most is None else -(-len(text.encode("utf-8", "surrogatepass")) // most)

    def stream_decoder(self) -> StreamDecoder:
        """A fresh incremental detokenizer for one reply."""
        return StreamDecoder(self)

    @cached_property
    def _compiled_template(self):
        return _compile_template(self.chat_template or "")


class StreamDecoder:
    """Incremental detokenization that only emits complete characters.

    ``push(id)`` returns the text that id completes (maybe ``""``); ``flush()`` returns
    whatever was held back at the end. The concatenation of every returned piece equals
    ``decode(all ids)``. The method is the one of text-generation-inference: decode a
    short window before and after the new id and emit the difference once it no longer
    ends in U+FFFD (an incomplete UTF-8 sequence); the window restarts at each emitted
    piece, so each push costs O(1) amortized.
    """

    def __init__(self, tokenizer: TextTokenizer) -> None:
        self._tok = tokenizer
        self._ids: list[int] = []
        self._prefix = 0  # start of the window already emitted as text
        self._read = 0  # end of the part already emitted

    def push(self, token_id: int) -> str:
        self._ids.append(int(token_id))
        prefix_text = self._tok.decode(self._ids[self._prefix:self._read])
        new_text = self._tok.decode(self._ids[self._prefix:])
        if len(new_text) > len(prefix_text) and not new_text.endswith("\ufffd"):
            piece = new_text[len(prefix_text):]
            self._prefix, self._read = self._read, len(self._ids)
            return piece
        return ""

    def flush(self) -> str:
        """The held-back rest (an incomplete sequence decodes to U+FFFD here)."""
        prefix_text = self._tok.decode(self._ids[self._prefix:self._read])
        new_text = self._tok.decode(self._ids[self._prefix:])
        self._prefix = self._read = len(self._ids)
        return new_text[len(prefix_text):]


def load_tokenizer(path: str | Path, *, gguf_metadata: Mapping[str, Any] | None = None) -> TextTokenizer:
    """The tokenizer of a GGUF file or an HF directory.

    gguf_metadata: the GGUF file's key → value metadata when already parsed (the engine's
        ``Model.metadata``), which saves reading the header twice.
    Raises: :class:`~swarm.errors.ModelFileError` naming the file and the field that is
    missing or unsupported.
    """
    path = Path(path)
    if path.is_dir():
        return _load_hf_dir(path)
    if gguf_metadata is None:
        gguf_metadata = _read_gguf_metadata(path)
    return _load_gguf(path, gguf_metadata)


def tokenizer_for(model: Any) -> TextTokenizer:
    """The tokenizer of an engine ``Model`` (``path``, ``format``, ``metadata``)."""
    if getattr(model, "format", None) == "gguf":
        return load_tokenizer(model.path, gguf_metadata=model.metadata)
    return load_tokenizer(model.path)


# --- GGUF -----------------------------------------------------------------------------------


def _read_gguf_metadata(path: Path) -> dict[str, Any]:
    if not path.is_file():
        raise ModelFileError(f"{path}: no such model file or directory")
    from swarm.compute.tensors import GGUFFile

    # the header parser the weights use (raises ModelFileError on bad bytes); gguf.GGUFReader
    # would hold a numpy view per vocabulary entry (a ~150 MiB peak for 49k tokens)
    return {name: v for name, v in GGUFFile(path).kv.items() if name.startswith("tokenizer.")}


def _load_gguf(path: Path, kv: Mapping[str, Any]) -> TextTokenizer:
    def field(name: str, default: Any = ModelFileError) -> Any:
        if name not in kv:
            if default is ModelFileError:
                raise ModelFileError(f"{path}: GGUF metadata field {name!r} is missing")
            return default
        return kv[name]

    kind = field("tokenizer.ggml.model")
    if kind not in ("gpt2", "llama"):
        raise ModelFileError(
            f"{path}: tokenizer.ggml.model {kind!r} is not supported (only byte-level BPE, 'gpt2', and "
            "SentencePiece BPE, 'llama'); use the model's Hugging Face directory with tokenizer.json instead"
        )

    def strings(name: str) -> Sequence[str]:
        value = field(name)
        if isinstance(value, str) or not isinstance(value, Sequence) or not all(isinstance(v, str) for v in value):
            raise ModelFileError(f"{path}: GGUF metadata field {name!r} is not an array of strings")
        return value

    tokens = strings("tokenizer.ggml.tokens")
    types = field("tokenizer.ggml.token_type", [1] * len(tokens))
    if len(types) != len(tokens):
        raise ModelFileError(f"{path}: tokenizer.ggml.token_type has {len(types)} entries for {len(tokens)} tokens")
    if kind == "llama":
        tok = _sentencepiece_tokenizer(path, tokens, field("tokenizer.ggml.scores"),
                                       bool(field("tokenizer.ggml.add_space_prefix", True)))
    else:
        tok = _byte_level_tokenizer(path, tokens, strings("tokenizer.ggml.merges"), types,
                                    field("tokenizer.ggml.pre", "default"))
    control = [t for t, ty in zip(tokens, types) if ty == _TOKEN_TYPE_CONTROL]
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in control])
    user = [t for t, ty in zip(tokens, types) if ty == _TOKEN_TYPE_USER_DEFINED]
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in user])

    def token_id(name: str) -> int | None:
        value = field(f"tokenizer.ggml.{name}", None)
        if value is None:
            return None
        if not isinstance(value, int) or not 0 <= value < len(tokens):
            raise ModelFileError(
                f"{path}: tokenizer.ggml.{name} = {value!r} is not a token id (0 ≤ id < {len(tokens)})"
            )
        return value

    bos, eos = token_id("bos_token_id"), token_id("eos_token_id")
    eot = token_id("eot_token_id")
    special = {
        name: tokens[i]
        for name, i in (("bos_token", bos), ("eos_token", eos), ("unk_token", token_id("unknown_token_id")),
                        ("pad_token", token_id("padding_token_id")))
        if i is not None
    }
    template = field("tokenizer.chat_template", None)
    if template is not None and not isinstance(template, str):
        raise ModelFileError(f"{path}: GGUF metadata field 'tokenizer.chat_template' is not a string")
    # llama.cpp adds BOS to a SentencePiece vocabulary unless the file says otherwise
    add_bos = bool(field("tokenizer.ggml.add_bos_token", kind == "llama"))
    return TextTokenizer(
        tokenizer=tok,
        chat_template=template,
        bos_token_id=bos,
        add_bos=add_bos and bos is not None,
        eos_token_ids=tuple(dict.fromkeys(i for i in (eos, eot) if i is not None)),
        special_tokens=special,
        source=str(path),
    )


def _sentencepiece_tokenizer(path: Path, tokens: Sequence[str], scores: Any, add_space_prefix: bool) -> Tokenizer:
    """A SentencePiece BPE vocabulary (llama.cpp ``llm_tokenizer_spm``): spaces written ``▁``,
    one ``▁`` before the text, then the adjacent pair whose merged token scores highest merged
    first, and a character outside the vocabulary spelled by its ``<0xXX>`` byte tokens. As a
    ``tokenizers`` BPE whose merges are every split of a token into two tokens, best score first
    (transformers' ``generate_merges``, which its GGUF reader uses as well)."""
    if isinstance(scores, str) or not isinstance(scores, Sequence) or len(scores) != len(tokens) \
            or not all(isinstance(x, (int, float)) for x in scores):
        raise ModelFileError(f"{path}: tokenizer.ggml.scores must be one number per token ({len(tokens)})")
    vocab = {t: i for i, t in enumerate(tokens)}
    merges = []
    for token, score in zip(tokens, scores):
        pairs = [(token[:i], token[i:]) for i in range(1, len(token)) if token[:i] in vocab and token[i:] in vocab]
        merges += [(a, b, score) for a, b in sorted(pairs, key=lambda p: (vocab[p[0]], vocab[p[1]]))]
    merges.sort(key=lambda m: (m[2], len(m[0]), len(m[1])), reverse=True)
    try:
        tok = Tokenizer(models.BPE(vocab=vocab, merges=[(a, b) for a, b, _ in merges], fuse_unk=True,
                                   byte_fallback=True, unk_token="<unk>" if "<unk>" in vocab else None))
    except Exception as exc:
        raise ModelFileError(f"{path}: tokenizer.ggml.tokens do not make a SentencePiece vocabulary ({exc})") from exc
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", split=False,
                                                 prepend_scheme="first" if add_space_prefix else "never")
    steps = [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
    tok.decoder = decoders.Sequence(steps + ([decoders.Strip(content=" ", left=1)] if add_space_prefix else []))
    return tok


def _byte_level_tokenizer(path: Path, tokens: Sequence[str], merge_lines: Sequence[str], types: Sequence[int],
                          pre: Any) -> Tokenizer:
    """A byte-level BPE vocabulary (llama.cpp ``llm_tokenizer_bpe``) with the text split of
    ``tokenizer.ggml.pre``."""
    merges = [tuple(m.split(" ", 1)) for m in merge_lines]

    # Byte-level vocabularies spell every byte with a printable stand-in (GPT-2's
    # bytes_to_unicode); a token written in raw characters is respelled in that alphabet —
    # except control and user-defined tokens, which are matched by their text as written
    # (DeepSeek-R1 distills' fullwidth "<｜User｜>"), so they keep that text and their id.
    spelling = _bytes_to_unicode()
    alphabet = set(spelling.values())
    added = {_TOKEN_TYPE_CONTROL, _TOKEN_TYPE_USER_DEFINED}
    vocab = {
        (t if ty in added or set(t) <= alphabet else "".join(spelling[b] for b in t.encode("utf-8"))): i
        for i, (t, ty) in enumerate(zip(tokens, types))
    }
    try:
        tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False))
    except Exception as exc:
        raise ModelFileError(f"{path}: tokenizer.ggml.merges do not fit tokenizer.ggml.tokens ({exc})") from exc
    tok.pre_tokenizer = _gguf_pre_tokenizer(path, pre)
    tok.decoder = decoders.ByteLevel()
    return tok


def _gguf_pre_tokenizer(path: Path, pre: Any):
    """The text split llama.cpp applies for ``tokenizer.ggml.pre`` (then the byte alphabet).
    Raises ModelFileError for a name it does not map here, rather than splitting text as some
    other tokenizer would (wrong tokens, no error)."""
    pre = pre if isinstance(pre, str) else repr(pre)
    if pre in _REGEX_SPLITS:
        return pre_tokenizers.Sequence([
            *(pre_tokenizers.Split(Regex(regex), behavior=_SPLIT_BEHAVIOR.get(regex, "isolated"))
              for regex in _REGEX_SPLITS[pre]),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ])
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)  # GPT-2's regex
    if pre in _DIGIT_SPLIT_PRES:
        return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
    if pre in _GPT2_PRES:
        return byte_level
    if pre in _NOT_BYTE_LEVEL_PRES:
        raise ModelFileError(
            f"{path}: tokenizer.ggml.pre {pre!r} is not supported in a byte-level BPE file: "
            f"{_NOT_BYTE_LEVEL_PRES[pre]}. Use the model's Hugging Face directory with tokenizer.json instead")
    known = sorted([*_REGEX_SPLITS, *_DIGIT_SPLIT_PRES, *_GPT2_PRES])
    raise ModelFileError(
        f"{path}: tokenizer.ggml.pre {pre!r} is not supported (its text split is unknown here, and another "
        f"would give wrong tokens); supported: {', '.join(known)}. Use the model's Hugging Face directory "
        "with tokenizer.json instead")


def _normalizer_only_grows(state: Mapping[str, Any]) -> bool:
    """True for a normalizer (its JSON state) that never shortens text in UTF-8 bytes:
    SentencePiece's ``Prepend("▁")`` and ``Replace(" ", "▁")``, alone or in a ``Sequence``."""
    kind = state.get("type")
    if kind == "Sequence":
        return all(_normalizer_only_grows(n) for n in state.get("normalizers", ()))
    if kind == "Prepend":
        return True
    if kind == "Replace":
        pattern = state.get("pattern", {}).get("String")
        return isinstance(pattern, str) and len(str(state.get("content", "")).encode()) >= len(pattern.encode()) > 0
    return False


_TEXT_KEEPING_PRE_TOKENIZERS = ("ByteLevel", "Metaspace", "Digits", "Punctuation", "UnicodeScripts", "Split")


def _pre_tokenizer_keeps_text(state: Mapping[str, Any]) -> bool:
    """True for a pre-tokenizer (its JSON state) that splits without dropping any text:
    byte-level, SentencePiece's Metaspace, digit, punctuation and script splits, and ``Split``
    unless its behavior removes the matches — alone or in a ``Sequence``."""
    kind = state.get("type")
    if kind == "Sequence":
        return all(_pre_tokenizer_keeps_text(p) for p in state.get("pretokenizers", ()))
    if kind == "Split":
        return state.get("behavior") != "Removed"
    return kind in _TEXT_KEEPING_PRE_TOKENIZERS


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte → printable character map (openai/gpt-2 encoder.py)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table, extra = {}, 0
    for b in range(256):
        if b in printable:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + extra)
            extra += 1
    return table


# --- HF directory ---------------------------------------------------------------------------


def _load_hf_dir(path: Path) -> TextTokenizer:
    tj = path / "tokenizer.json"
    if not tj.is_file():
        raise ModelFileError(f"{tj}: missing (the tokenizer of an HF model directory)")
    try:
        tok = Tokenizer.from_file(str(tj))
    except Exception as exc:
        raise ModelFileError(f"{tj}: not a valid tokenizers file ({exc})") from exc
    config = _read_json(path / "tokenizer_config.json")
    template = config.get("chat_template")
    if isinstance(template, list):  # [{"name": ..., "template": ...}]: take the default one
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default")
    jinja_file = path / "chat_template.jinja"  # transformers ≥ 4.43 may save it on its own
    if template is None and jinja_file.is_file():
        template = jinja_file.read_text(encoding="utf-8")
    if template is not None and not isinstance(template, str):
        raise ModelFileError(f"{path / 'tokenizer_config.json'}: field 'chat_template' is not a string")

    special: dict[str, str] = {}
    for name in ("bos_token", "eos_token", "unk_token", "pad_token"):
        value = config.get(name)
        if isinstance(value, dict):
            value = value.get("content")
        if isinstance(value, str):
            special[name] = value

    def ids_of(value: Any) -> list[int]:
        return [value] if isinstance(value, int) else [v for v in value if isinstance(v, int)] if isinstance(value, list) else []

    eos_ids: list[int] = []
    if "eos_token" in special and (i := tok.token_to_id(special["eos_token"])) is not None:
        eos_ids.append(i)
    eos_ids += ids_of(_read_json(path / "generation_config.json").get("eos_token_id"))
    eos_ids += ids_of(_read_json(path / "config.json").get("eos_token_id"))
    bos = tok.token_to_id(special["bos_token"]) if "bos_token" in special else None
    return TextTokenizer(
        tokenizer=tok,
        chat_template=template,
        bos_token_id=bos,
        eos_token_ids=tuple(dict.fromkeys(eos_ids)),
        special_tokens=special,
        source=str(path),
    )


def _read_json(file: Path) -> dict:
    if not file.is_file():
        return {}
    try:
        data = json.loads(file.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ModelFileError(f"{file}: not valid JSON ({exc})") from exc
    if not isinstance(data, dict):
        raise ModelFileError(f"{file}: expected a JSON object")
    return data


# --- chat template --------------------------------------------------------------------------


def _generation_tag():
    """transformers' ``{% generation %}…{% endgeneration %}`` (it marks the assistant's text for
    training masks): rendered as its body."""
    from jinja2 import nodes
    from jinja2.ext import Extension

    class GenerationTag(Extension):
        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return nodes.Scope(body, lineno=lineno)

    return GenerationTag


def _compile_template(source: str):
    """Compile in Jinja2's immutable sandbox, with transformers' environment and helpers."""
    import jinja2
    from jinja2.ext import loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message: str):
        raise ChatTemplateError(f"the chat template rejected the messages: {message}")

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[loopcontrols, _generation_tag()])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    try:
        return env.from_string(source)
    except jinja2.TemplateError as exc:
        raise ChatTemplateError(f"the chat template does not compile: {exc}") from exc


def messages_from(prompt: str, system: str | None = None) -> list[dict[str, str]]:
    """The chat messages for one user prompt and an optional system prompt."""
    out = [{"role": "system", "content": system}] if system is not None else []
    return [*out, {"role": "user", "content": prompt}]
