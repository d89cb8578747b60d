"""GGUF tokenizers beyond byte-level BPE: a SentencePiece vocabulary (``tokenizer.ggml.model =
"llama"``, as Llama-2, Mistral-7B and Mixtral-8x7B files carry) against transformers' GGUF reader
on multilingual, code and emoji text, and an unknown ``tokenizer.ggml.pre`` refused by name."""

from __future__ import annotations

import pytest

from swarm.compute.tokenizer import load_tokenizer
from swarm.errors import ModelFileError
from tests.compute.test_tokenizer import TEXTS, _tiny_gguf

CORPUS = [
    "The quick brown fox jumps over the lazy dog. I'm sure they'll say we've done it.",
    "def f(x):\n    return x ** 2  # square\n\nfor i in range(10):\n    print(i, f(i))\n",
    "Le café est très bon, naïve Ünïcödé straße. Привет, как дела? Γειά σου κόσμε.",
    "日本語のテキストと中文字符。今日はいい天気ですね。",
    "price: 12345 dollars, 3.14159, 2024-11-30, 100% done!",
]
SPECIALS = ["<unk>", "<s>", "</s>"]


def _sentencepiece_vocab(size: int = 420) -> tuple[list[str], list[float], list[int]]:
    """A Llama-style SentencePiece BPE vocabulary: ``<unk>``, ``<s>``, ``</s>``, the 256 byte
    tokens ``<0x00>``…``<0xFF>``, then pieces learned on :data:`CORPUS`, scored by merge order
    (``-rank``, as SentencePiece's BPE trainer writes them); llama.cpp token types 2 unknown,
    3 control, 6 byte, 1 normal."""
    from tokenizers import SentencePieceBPETokenizer

    trainer = SentencePieceBPETokenizer()
    trainer.train_from_iterator(CORPUS * 4, vocab_size=size, min_frequency=2, special_tokens=SPECIALS,
                                show_progress=False)
    learned = [t for t, _ in sorted(trainer.get_vocab().items(), key=lambda kv: kv[1]) if t not in SPECIALS]
    tokens = SPECIALS + [f"<0x{b:02X}>" for b in range(256)] + learned
    scores = [0.0] * (3 + 256) + [-float(i) for i in range(len(learned))]
    types = [2, 3, 3] + [6] * 256 + [1] * len(learned)
    return tokens, scores, types


def _write(path, model: str, **fields):
    """A GGUF file with ``tokenizer.ggml.model = model`` and ``tokenizer.ggml.<name>`` fields."""
    return _tiny_gguf(path, tokenizer__ggml__model=model, **{f"tokenizer__ggml__{k}": v for k, v in fields.items()})


@pytest.fixture(scope="module")
def sentencepiece_gguf(tmp_path_factory):
    tokens, scores, types = _sentencepiece_vocab()
    path = tmp_path_factory.mktemp("spm") / "spm.gguf"
    return _write(path, "llama", tokens=tokens, scores=scores, token_type=types, bos_token_id=1, eos_token_id=2,
                  unknown_token_id=0)


@pytest.fixture(scope="module")
def sentencepiece_pair(sentencepiece_gguf):
    from transformers import AutoTokenizer

    oracle = AutoTokenizer.from_pretrained(sentencepiece_gguf.parent, gguf_file=sentencepiece_gguf.name)
    return load_tokenizer(sentencepiece_gguf), oracle


@pytest.mark.parametrize("text", TEXTS + CORPUS)
def test_sentencepiece_gguf_ids_match_transformers(sentencepiece_pair, text):
    ours, oracle = sentencepiece_pair
    ids = ours.encode(text)
    assert ids == oracle.encode(text)
    assert ours.decode(ids) == oracle.decode(ids, skip_special_tokens=True)


def test_sentencepiece_gguf_adds_bos_spells_unknown_characters_in_bytes_and_streams(sentencepiece_pair):
    ours, _ = sentencepiece_pair
    ids = ours.encode("hi 🤗")
    assert ids[0] == ours.bos_token_id == 1 and ours.add_bos  # llama.cpp's default for SentencePiece
    assert [ours.tokenizer.id_to_token(i) for i in ids[-4:]] == ["<0xF0>", "<0x9F>", "<0xA4>", "<0x97>"]
    stream = ours.stream_decoder()
    pieces = [stream.push(i) for i in ids[1:]] + [stream.flush()]
    assert "".join(pieces) == "hi 🤗" and "\ufffd" not in "".join(pieces)
    assert ours.encode("</s>", add_special_tokens=False) == [2]  # control tokens stay whole


def test_sentencepiece_without_a_space_prefix(tmp_path):
    tokens, scores, types = _sentencepiece_vocab()
    plain = load_tokenizer(_write(tmp_path / "a.gguf", "llama", tokens=tokens, scores=scores, token_type=types))
    bare = load_tokenizer(_write(tmp_path / "b.gguf", "llama", tokens=tokens, scores=scores, token_type=types,
                                 add_space_prefix=False))
    assert plain.tokenizer.id_to_token(plain.encode("The", add_special_tokens=False)[0]).startswith("▁")
    assert not bare.tokenizer.id_to_token(bare.encode("The", add_special_tokens=False)[0]).startswith("▁")
    assert bare.decode(bare.encode("The fox", add_special_tokens=False)) == "The fox"


def test_sentencepiece_needs_scores(tmp_path):
    tokens, _, types = _sentencepiece_vocab()
    with pytest.raises(ModelFileError, match=r"'tokenizer\.ggml\.scores' is missing"):
        load_tokenizer(_write(tmp_path / "s.gguf", "llama", tokens=tokens, token_type=types))


def test_unknown_pre_tokenizer_is_refused_by_name(tmp_path):
    path = _write(tmp_path / "p.gguf", "gpt2", tokens=["a", "b", "ab"], merges=["a b"], pre="no-such-split")
    with pytest.raises(ModelFileError, match=r"tokenizer\.ggml\.pre 'no-such-split' is not supported .*deepseek-v3"):
        load_tokenizer(path)


@pytest.mark.parametrize("pre", ["deepseek-v3", "glm4", "gpt-4o", "tekken", "falcon", "viking", "deepseek-coder",
                                 "afmoe", "superbpe", "chameleon"])
def test_known_pre_tokenizers_keep_every_character(tmp_path, pre):
    """Each split llama.cpp maps compiles and loses no text (the pieces join to the text)."""
    path = _write(tmp_path / "k.gguf", "gpt2", tokens=["a", "b", "ab"], merges=["a b"], pre=pre)
    split = load_tokenizer(path).tokenizer.pre_tokenizer
    for text in TEXTS:
        assert "".join(w for w, _ in split.pre_tokenize_str(text)) == _byte_spelled(text)


def _byte_spelled(text: str) -> str:
    from swarm.compute.tokenizer import _bytes_to_unicode

    spelling = _bytes_to_unicode()
    return "".join(spelling[b] for b in text.encode("utf-8"))


def test_deepseek_v3_split_groups_digits_in_threes_and_keeps_kana_apart(tmp_path):
    tok = load_tokenizer(_write(tmp_path / "d.gguf", "gpt2", tokens=["a", "b", "ab"], merges=["a b"],
                                pre="deepseek-v3"))
    pieces = [w for w, _ in tok.tokenizer.pre_tokenizer.pre_tokenize_str("x1234567 日本語のtext")]
    spelled = [_byte_spelled(p) for p in ("x", "123", "456", "7", " ", "日本語の", "text")]
    assert pieces == spelled


def _afmoe_digit_spans(text: str, a: int, b: int) -> list[tuple[int, int]]:
    """llama.cpp's custom AFMoE digit split of ``text[a:b]`` (unicode_regex_split_custom_afmoe), line
    for line: each run of numbers in threes from the right, the first piece also taking whatever
    text came since the previous piece ended; the text after the last run one piece."""
    import unicodedata

    def is_number(i: int) -> bool:
        return i < b and unicodedata.category(text[i]).startswith("N")

    out, prev, pos = [], a, a
    while pos < b:
        if not is_number(pos):
            pos += 1
            continue
        start = pos
        while is_number(pos):
            pos += 1
        current = start + (pos - start) % 3
        if current > start:
            out.append((prev, current))
            prev = current
        while current < pos:
            out.append((prev, current + 3))
            prev = current = current + 3
    if prev < b:
        out.append((prev, b))
    return out


# llama.cpp's regexes for tokenizer.ggml.pre names (src/llama-vocab.cpp, its case-folded forms),
# applied one after the other; Kimi-K2's is tokenization_kimi.py's, which llama.cpp runs as custom code,
# and AFMoE's digit split is llama.cpp's custom code itself.
_CONTRACTIONS = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])"
_GPT4O = (r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+" + _CONTRACTIONS + "?"
          r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*" + _CONTRACTIONS + "?"
          r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")
LLAMA_CPP_SPLITS = {
    "seed-coder": (_CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1}| ?[^\s\p{L}\p{N}\r\n]+|\s*[\r\n]+"
                   r"|\s+(?!\S)|\s+",),
    "bailingmoe": (r"'(?:[sSdDmMtT]|[lL][lL]|[vV][eE]|[rR][eE])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
                   r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]|\s+(?!\S)|\s+",),
    "ufakzeka": (r"[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",),
    "jais-2": (_CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
               r"|\s{512}(?!\S)|\s{256}(?!\S)|\s{128}(?!\S)|\s{64}(?!\S)|\s{32}(?!\S)|\s{16}(?!\S)|\s{8}(?!\S)"
               r"|\s{4}(?!\S)|\s{1,2}(?!\S)|\s{1}",),
    "tiny_aya": (r"\d{1,3}(?=(?:\d{3})*\b)", _GPT4O),
    "minicpm5": (r"\p{N}{1,3}", _CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}+| ?[^\s\p{L}\p{N}]+[\r\n]*"
                 r"|\s*[\r\n]+|\s+(?!\S)|\s+"),
    "kanana2": (_GPT4O,),
    "exaone-moe": (_CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?(?:\p{L}\p{M}*(?: \p{L}\p{M}*)*)+|\p{N}"
                   r"| ?[^\s\p{L}\p{N}]+[\r\n/]?|\s*[\r\n]|\s+(?!\S)|\s+",),
    "spark2_5": (r"\p{N}{1,3}", r"[一-龥぀-ゟ゠-ヿ]+",
                 r"""[!"#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~][A-Za-z]+|[^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+"""
                 r"| ?[\p{P}\p{S}]+|[\r\n]|\s+(?!\S)|\s+", r"\p{N}"),
    "laguna": (r"[^\n]+|[\n]+", _CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
               r"|\s+(?!\S)|\s+"),
    "kimi-k2": (r"[\p{Han}]+"
                r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+"
                r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+"
                r"[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?|\p{N}{1,3}"
                r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",),
    "deepseek-llm": (
        r"[" "\u000d\u000a" r"]",
        r"\s?[A-Za-z" "\u00b5" r"À-ÖØ-öø-ƺƼ-ƿ" "\u01c4" r"-ʓʕ-ʯͰ-ͳͶͷͻ-ͽͿΆΈ-ΊΌΎ-ΡΣ-" "\u03f5"
        r"Ϸ-ҁҊ-ԯԱ-ՖႠ-ჅᎠ-Ᏽᏸ-ᏽᲐ-ᲺᲽ-Ჿᴀ-ᴫᵫ-ᵷᵹ-ᶚḀ-ἕἘ-Ἕἠ-ὅὈ-Ὅὐ-ὗὙὛὝὟ-" "\u1f7d" r"ᾀ-ᾴᾶ-ᾼ" "\u1fbe" r"ῂ-ῄῆ-ῌῐ-"
        "\u1fd3" r"ῖ-" "\u1fdb" r"ῠ-Ῥῲ-ῴῶ-ῼ" "\u2102\u2107\u210a" r"-" "\u2113\u2115\u2119" r"-"
        "\u211d\u2124\u2126\u2128\u212a" r"-" "\u212d\u212f" r"-" "\u2134\u2139\u213c" r"-" "\u213f\u2145" r"-"
        "\u2149" r"ⅎↃↄⰀ-ⱻⱾ-ⳤⳫ-ⳮⳲⳳꙀ-ꙭꚀ-ꚛꜢ-ꝯꝱ-ꞇꞋ-ꞎꭰ-ꮿ" "\ufb00" r"-" "\ufb06\ufb13" r"-" "\ufb17\uff21" r"-"
        "\uff3a\uff41" r"-" "\uff5a" r"𐐀-𐑏𐒰-𐓓𐓘-𐓻𐲀-𐲲𐳀-𐳲𑢠-𑣟𞤀-𞥃]+",
        r"\s?[!-/:-~" "\uff01" r"-" "\uff0f\uff1a" r"-" "\uff5e" r"‘-‟" "\u3000" r"-。]+",
        r"\s+$",
        r"[一-龥ࠀ-一가-" "\ud7ff" r"]+",
        r"\p{N}+",
    ),
    "youtu": (
        r"[가-힣" "\u3131" r"-" "\u318e" r"]+|[" "\uff01\u2026" r"“”‘’—" "\uff1a\uff1b\uff0c" r"、-〿" "\ufe30" r"-"
        "\ufe4f" r"]+|[ㄅ-ㄯ]+|[一-龥" "\u3040" r"-" "\u309f" r"゠-" "\u30ff" r"]+",
        r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?:'[sS]|'[tT]|'[rR][eE]|"
        r"'[vV][eE]|'[mM]|'[lL][lL]|'[dD])?|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}"
        r"\p{Lo}\p{M}]*(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])?|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n"
        r"/]*|\s*[\r\n]+|\s+(?!\S)|\s+",
    ),
    "chameleon": (
        r"<sentinel:[0-9]+>",
        r"(IMGIMG)((A|B|C|D|E|F|G|H|I){1,4})Z",
        r"([\t\n]|    |  )",
        r"\p{N}",
        r"[\p{P}!-/:-@\[-`{-~]",
        r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)",
    ),
    "granite-embed-multi-97m": (
        r"[^\r\n\p{L}\p{N}]?((?=[\p{L}\p{M}])([^a-z]))*((?=[\p{L}\p{M}])([^A-Z]))+(?:'[sS]|'[tT]|'[rR][eE]|'[vV"
        r"][eE]|'[mM]|'[lL][lL]|'[dD])?|[^\r\n\p{L}\p{N}]?((?=[\p{L}\p{M}])([^a-z]))+((?=[\p{L}\p{M}])([^A-Z]))"
        r"*(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])?|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*"
        r"[\r\n]+|\s+(?!\S)|\s+",
    ),
    "superbpe": (
        r"\p{N}+",
        r"(?=(\d{3})+(?!\d))",
    ),
    "afmoe": (
        _afmoe_digit_spans,
        r"[一-鿿㐀-䶿豈-" "\ufaff\u3040" r"-" "\u309f" r"゠-" "\u30ff\uff65" r"-" "\uff9f\u2f00" r"-" "\u2fdf" r"เ-"
        "\u0e7f\u0e80" r"-" "\u0eff" r"ក-" "\u17ff" r"က-႟ꩠ-ꩿꧠ-" "\ua9ff" r"가-" "\ud7af" r"ᄀ-ᇿ]+",
        r"[!" "\u0022"
        r"#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~][A-Za-z]+|[^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+| ?[\p{P}\p{S}]+[\r"
        r"\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
    ),
}
SPLIT_TEXTS = [*TEXTS, *CORPUS, "你好world 日本語のtext 汉字ABC你好Def", "1234567 12 123456 x1 9.99",
               "I'M sure WE'LL 'D've", "#include <stdio.h>\n\nint main() { return a.b->c; } // x\r\n",
               "a" + " " * 40 + "b\n\n   \tc", "ক্ষ हिन्दी ไทย é e\u0301",
               "a  12 x1234 (5)  \t 123456789, end   ", "ÉCOLE naïveÉTÉ aÉb ǅungla ſ", "한국어 ㄱㄴ ㄅㄆ！，“引用”。、ｶﾀｶﾅ",
               "<sentinel:12>IMGIMGABZ IMGIMGJZ  x    y\t\n", "١٢٣٤٥ ２０２４ ⅫⅢ", "ａｂｃ Ｘ 𐐀𐐨 K Ω"]


def _llama_cpp_spans(regexes: tuple, text: str) -> list[tuple[int, int]]:
    """Each regex splits every piece left by the ones before into its matches and the gaps
    between them, an empty match cutting the piece where it is (llama.cpp's unicode_regex_split
    and its offsets, empty ones dropped); a function instead of a regex splits a piece itself."""
    import regex

    pieces = [(0, len(text))]
    for rx in regexes:
        if callable(rx):
            pieces = [span for a, b in pieces for span in rx(text, a, b)]
            continue
        pattern, out = regex.compile(rx, regex.V1), []
        for a, b in pieces:
            pos = a
            for m in pattern.finditer(text[a:b]):
                if m.end() == m.start():
                    if a + m.start() > pos:
                        out.append((pos, a + m.start()))
                        pos = a + m.start()
                    continue
                if a + m.start() > pos:
                    out.append((pos, a + m.start()))
                out.append((a + m.start(), a + m.end()))
                pos = a + m.end()
            if pos < b:
                out.append((pos, b))
        pieces = out
    return pieces


@pytest.mark.parametrize("pre", list(LLAMA_CPP_SPLITS))
def test_pre_tokenizer_splits_as_llama_cpp(tmp_path, pre):
    from swarm.compute.tokenizer import _gguf_pre_tokenizer

    split = _gguf_pre_tokenizer(tmp_path / "m.gguf", pre)
    for text in SPLIT_TEXTS:
        assert [span for _, span in split.pre_tokenize_str(text)] == _llama_cpp_spans(LLAMA_CPP_SPLITS[pre], text), text


# tokenizer.ggml.pre names llama.cpp's converter writes that the engine refuses, each saying why: vocabularies
# that are not byte-level (SentencePiece-style BPE over raw UTF-8, whitespace, SentencePiece, WordPiece).
NOT_MAPPED = {"bert-bge", "bert-bge-large", "chatglm-spm", "gemma4", "granite-embed-multi-311m", "jina-v2-en",
              "sarvam-moe", "whitespace"}


def test_every_pre_name_of_llama_cpps_converter_is_mapped_or_refused_by_name(tmp_path):
    import re

    from swarm.compute.tokenizer import _gguf_pre_tokenizer
    from tests.compute.llama_converter import converter_script

    conversion = converter_script().parent / "conversion"
    names = set()
    for source in conversion.glob("*.py"):
        text = source.read_text(encoding="utf-8")
        names |= set(re.findall(r'res = "([^"]+)"', text)) | set(re.findall(r'add_tokenizer_pre\("([^"]+)"\)', text))
    assert {"smollm", "kimi-k2", "qwen35", "deepseek-v3", "glm4", "minimax-m2"} <= names
    for name in sorted(names - NOT_MAPPED):
        _gguf_pre_tokenizer(tmp_path / "m.gguf", name)
    for name in sorted(names & NOT_MAPPED):
        with pytest.raises(ModelFileError, match=f"tokenizer\\.ggml\\.pre '{re.escape(name)}' is not supported in a "
                                                 "byte-level BPE file: (llama.cpp runs|its vocabulary|it names)"):
            _gguf_pre_tokenizer(tmp_path / "m.gguf", name)
