"""Tokenizer and chat template from the checkpoint, against transformers as the oracle."""

from __future__ import annotations

import json

import pytest

from swarm.compute.tokenizer import load_tokenizer, messages_from
from swarm.errors import ChatTemplateError, ModelFileError

TEXTS = [
    "Hello world",
    "Why is the sky blue?",
    "  leading  spaces,\ttabs\n\nand blank lines\r\n",
    "日本語のテキストと中文字符",
    "emoji 🤗🎉👩‍👩‍👧 and flags 🇫🇷",
    "café naïve Ünïcödé ß",
    "price: 12345 dollars, π≈3.14159, 2024-11-30",
    "I'm sure they'll say we've done it",
    "def f(x):\n    return x ** 2  # square\n",
    "<|im_start|>user\nspecial tokens inline<|im_end|>",
    "x" * 300,
    "",
]

CHATS = [
    messages_from("What is the capital of France?"),
    messages_from("Write a haiku about 🌧️ rain.", system="You answer in verse."),
    [
        {"role": "user", "content": "Hi!"},
        {"role": "assistant", "content": "Hello! How can I help?"},
        {"role": "user", "content": "Count to 3 in 日本語."},
    ],
]


@pytest.fixture(scope="module")
def ours(smollm2_path):
    return load_tokenizer(smollm2_path)


@pytest.fixture(scope="module")
def oracle(smollm2_path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(smollm2_path.parent, gguf_file=smollm2_path.name)


@pytest.mark.parametrize("text", TEXTS)
def test_gguf_ids_match_transformers(ours, oracle, text):
    assert ours.encode(text, add_special_tokens=False) == oracle.encode(text, add_special_tokens=False)
    assert ours.encode(text) == oracle.encode(text)  # SmolLM2 says add_bos_token = false
    ids = ours.encode(text, add_special_tokens=False)
    assert ours.decode(ids) == oracle.decode(ids, skip_special_tokens=True)


def test_gguf_special_tokens_come_from_the_file(ours, oracle):
    assert ours.vocab_size == len(oracle) == 49152
    assert ours.bos_token_id == oracle.bos_token_id == 1
    assert ours.eos_token_ids == (oracle.eos_token_id,) == (2,)
    assert ours.encode("<|im_end|>", add_special_tokens=False) == [2]


@pytest.mark.parametrize("messages", CHATS)
def test_chat_template_matches_transformers(ours, oracle, messages):
    want = oracle.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert ours.apply_chat_template(messages) == want
    assert ours.encode_chat(messages) == oracle.encode(want, add_special_tokens=False)
    no_prompt = oracle.apply_chat_template(messages, tokenize=False, add_generation_prompt=False)
    assert ours.apply_chat_template(messages, add_generation_prompt=False) == no_prompt


def test_hf_directory_matches_transformers(tmp_path, oracle, ours):
    """The same tokenizer saved as an HF directory (tokenizer.json + template) loads to the same ids."""
    oracle.save_pretrained(tmp_path)
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 0]}))
    hf = load_tokenizer(tmp_path)
    for text in TEXTS:
        assert hf.encode(text, add_special_tokens=False) == ours.encode(text, add_special_tokens=False)
    for messages in CHATS:
        assert hf.apply_chat_template(messages) == ours.apply_chat_template(messages)
    assert hf.eos_token_ids == (2, 0)
    assert hf.bos_token_id == 1


@pytest.mark.parametrize("text", TEXTS)
def test_stream_decoder_yields_only_whole_characters(ours, text):
    ids = ours.encode(text, add_special_tokens=False)
    decoder = ours.stream_decoder()
    pieces = [decoder.push(i) for i in ids] + [decoder.flush()]
    assert "".join(pieces) == ours.decode(ids)
    for piece in pieces:
        assert "\ufffd" not in piece
        piece.encode("utf-8")  # a lone surrogate would raise here


def test_stream_decoder_holds_back_a_split_character(ours):
    # "🤗" is 4 UTF-8 bytes; in a byte-level vocabulary each byte is its own token.
    byte_ids = [ours.tokenizer.token_to_id(ch) for ch in "ðŁ¤Ĺ"]
    assert None not in byte_ids
    decoder = ours.stream_decoder()
    assert [decoder.push(i) for i in byte_ids] == ["", "", "", "🤗"]
    # An incomplete tail is only released by flush, as U+FFFD.
    decoder = ours.stream_decoder()
    assert decoder.push(byte_ids[0]) == ""
    assert decoder.flush() == "\ufffd"


def test_special_tokens_are_not_streamed(ours):
    decoder = ours.stream_decoder()
    ids = ours.encode("Hi<|im_end|>", add_special_tokens=False)
    assert "".join([decoder.push(i) for i in ids] + [decoder.flush()]) == "Hi"


def test_template_raise_exception_is_a_clear_error(tmp_path, oracle):
    oracle.save_pretrained(tmp_path)
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    config["chat_template"] = (
        "{% for m in messages %}{% if m['role'] == 'system' %}"
        "{{ raise_exception('System role not supported') }}{% endif %}{{ m['content'] }}{% endfor %}"
    )
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    (tmp_path / "chat_template.jinja").unlink(missing_ok=True)
    tok = load_tokenizer(tmp_path)
    assert tok.apply_chat_template(messages_from("hi")) == "hi"
    with pytest.raises(ChatTemplateError, match="System role not supported"):
        tok.apply_chat_template(messages_from("hi", system="be nice"))


def test_template_sandbox_blocks_attribute_escape(tmp_path, oracle):
    oracle.save_pretrained(tmp_path)
    (tmp_path / "chat_template.jinja").write_text("{{ messages.__class__.__mro__ }}")
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    with pytest.raises(ChatTemplateError):
        load_tokenizer(tmp_path).apply_chat_template(messages_from("hi"))


def test_bad_tokenizer_files(tmp_path):
    with pytest.raises(ModelFileError, match="tokenizer.json: missing"):
        load_tokenizer(tmp_path)
    (tmp_path / "tokenizer.json").write_text("{not json")
    with pytest.raises(ModelFileError, match="tokenizer.json: not a valid tokenizers file"):
        load_tokenizer(tmp_path)
    with pytest.raises(ModelFileError, match="no such model file"):
        load_tokenizer(tmp_path / "absent.gguf")


def _tiny_gguf(path, **fields):
    import gguf
    import numpy as np

    w = gguf.GGUFWriter(str(path), "llama")
    for key, value in fields.items():
        name = key.replace("__", ".")
        if isinstance(value, str):
            w.add_string(name, value)
        elif isinstance(value, list):
            w.add_array(name, value)
        else:
            w.add_uint32(name, value)
    w.add_tensor("token_embd.weight", np.zeros((4, 8), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_bad_gguf_tokenizer_fields(tmp_path):
    wpm = _tiny_gguf(tmp_path / "wpm.gguf", tokenizer__ggml__model="bert", tokenizer__ggml__tokens=["a", "b"])
    with pytest.raises(ModelFileError, match=r"wpm\.gguf: tokenizer\.ggml\.model 'bert' is not supported"):
        load_tokenizer(wpm)
    no_merges = _tiny_gguf(tmp_path / "nm.gguf", tokenizer__ggml__model="gpt2", tokenizer__ggml__tokens=["a", "b"])
    with pytest.raises(ModelFileError, match=r"nm\.gguf: GGUF metadata field 'tokenizer\.ggml\.merges' is missing"):
        load_tokenizer(no_merges)
    bad_eos = _tiny_gguf(
        tmp_path / "eos.gguf", tokenizer__ggml__model="gpt2", tokenizer__ggml__tokens=["a", "b", "ab"],
        tokenizer__ggml__merges=["a b"], tokenizer__ggml__eos_token_id=7,
    )
    with pytest.raises(ModelFileError, match=r"eos\.gguf: tokenizer\.ggml\.eos_token_id = 7 is not a token id \(0 ≤ id < 3\)"):
        load_tokenizer(bad_eos)
    junk = tmp_path / "junk.gguf"
    junk.write_bytes(b"GGUF\x03\x00\x00\x00" + b"\xff" * 10)
    with pytest.raises(ModelFileError, match=r"junk\.gguf: not a readable GGUF file"):
        load_tokenizer(junk)


def test_gguf_add_bos_token_prepends_bos(smollm2_model):
    """A GGUF that says add_bos_token = true gets its BOS first on plain encodes, never on chat prompts."""
    metadata = dict(smollm2_model.metadata, **{"tokenizer.ggml.add_bos_token": True})
    tok = load_tokenizer(smollm2_model.path, gguf_metadata=metadata)
    plain = tok.encode("Hello world", add_special_tokens=False)
    assert tok.encode("Hello world") == [1, *plain]
    messages = messages_from("hi")
    assert tok.encode_chat(messages) == tok.encode(tok.apply_chat_template(messages), add_special_tokens=False)
    assert tok.encode_chat(messages)[0] == 1  # <|im_start|> from the template itself, once


def test_gguf_field_of_the_wrong_type_is_named(smollm2_model):
    bad = dict(smollm2_model.metadata, **{"tokenizer.ggml.eos_token_id": "two"})
    with pytest.raises(ModelFileError, match=r"tokenizer\.ggml\.eos_token_id = 'two' is not a token id"):
        load_tokenizer(smollm2_model.path, gguf_metadata=bad)
    bad = dict(smollm2_model.metadata, **{"tokenizer.ggml.tokens": [1, 2, 3]})
    with pytest.raises(ModelFileError, match=r"'tokenizer\.ggml\.tokens' is not an array of strings"):
        load_tokenizer(smollm2_model.path, gguf_metadata=bad)


def _vocab_gguf(path, pre, tokens, merges, types, *, bos):
    """A GGUF file holding a byte-level BPE vocabulary (EOS id 2) and one placeholder tensor."""
    return _tiny_gguf(path, tokenizer__ggml__model="gpt2", tokenizer__ggml__pre=pre,
                      tokenizer__ggml__tokens=list(tokens), tokenizer__ggml__merges=list(merges),
                      tokenizer__ggml__token_type=[int(t) for t in types], tokenizer__ggml__bos_token_id=bos,
                      tokenizer__ggml__eos_token_id=2)


PRE_TEXTS = [
    "  leading  spaces,\ttabs\n\nand blank lines\r\n",
    "def f(x):\n    return x ** 2\n",
    "I'M sure they'll say we've done it",
    "日本語 🤗!!!\n\n\n",
]


@pytest.mark.slow
@pytest.mark.parametrize("pre", ["llama-bpe", "qwen2", "gpt2", "gpt-4o", "tekken"])
def test_gguf_pre_tokenizers_match_transformers(tmp_path, smollm2_model, pre):
    """The same vocabulary under other ``tokenizer.ggml.pre`` names splits text as transformers does."""
    from transformers import AutoTokenizer

    kv = smollm2_model.metadata
    path = _vocab_gguf(tmp_path / f"{pre}.gguf", pre, kv["tokenizer.ggml.tokens"], kv["tokenizer.ggml.merges"],
                       kv["tokenizer.ggml.token_type"], bos=1)
    ours = load_tokenizer(path)
    oracle = AutoTokenizer.from_pretrained(tmp_path, gguf_file=path.name)
    for text in PRE_TEXTS:
        assert ours.encode(text, add_special_tokens=False) == oracle.encode(text, add_special_tokens=False)


ADDED = [  # (text, llama.cpp token type): control = 3, user-defined = 4
    ("<｜begin▁of▁sentence｜>", 3), ("<｜User｜>", 3), ("<｜Assistant｜>", 3), ("<|fim_pad|>", 3),
    ("<think>", 4), ("<｜tool▁sep｜>", 4), ("ｘｙ", 4),
]


def test_gguf_control_and_user_defined_tokens_encode_to_their_own_id(tmp_path, smollm2_model):
    """Every control/user-defined token encodes to its own id, also when its text has characters
    outside GPT-2's byte alphabet (DeepSeek-R1 distills' fullwidth bars), as llama.cpp does."""
    kv = smollm2_model.metadata
    base = len(kv["tokenizer.ggml.tokens"])
    types = [*kv["tokenizer.ggml.token_type"], *(ty for _, ty in ADDED)]
    texts = [*kv["tokenizer.ggml.tokens"], *(t for t, _ in ADDED)]
    tok = load_tokenizer(_vocab_gguf(tmp_path / "added.gguf", "qwen2", texts, kv["tokenizer.ggml.merges"], types,
                                     bos=base))
    for i, (text, ty) in enumerate(zip(texts, types)):
        if ty in (3, 4):
            assert tok.encode(text, add_special_tokens=False) == [i], text
            assert tok.decode([i], skip_special_tokens=False) == text
    user, assistant = base + 1, base + 2
    hi = tok.encode("hi", add_special_tokens=False)
    assert tok.encode("<｜User｜>hi<｜Assistant｜><think>", add_special_tokens=False) == [user, *hi, assistant, base + 4]
    assert tok.vocab_size == base + len(ADDED)  # no id was added beside the file's


def test_no_byte_bound_where_a_tokenizer_may_drop_or_fold_text():
    """The bytes → fewest-tokens bound holds only where no text is dropped or folded: a
    whitespace-splitting pre-tokenizer drops spaces, an unknown token without byte fallback
    covers any run of unknown characters, an added token with lstrip swallows whitespace."""
    from tokenizers import AddedToken, Tokenizer, models, pre_tokenizers

    from swarm.compute.tokenizer import TextTokenizer

    def bound(tok: Tokenizer):
        return TextTokenizer(tokenizer=tok, chat_template=None, bos_token_id=None, eos_token_ids=(),
                             special_tokens={}, source="test").max_token_bytes

    vocab = {"ab": 0, "a": 1, "b": 2, " ": 3}
    plain = Tokenizer(models.BPE(vocab, [("a", "b")]))
    assert bound(plain) == 2
    dropping = Tokenizer(models.BPE(vocab, [("a", "b")]))
    dropping.pre_tokenizer = pre_tokenizers.Whitespace()
    assert bound(dropping) is None and len(dropping.encode("a" + " " * 50 + "b").ids) == 2  # 52 bytes, 2 tokens
    removed = Tokenizer(models.BPE(vocab, [("a", "b")]))
    removed.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Digits(), pre_tokenizers.Split(" ", "removed")])
    assert bound(removed) is None
    kept = Tokenizer(models.BPE(vocab, [("a", "b")]))
    kept.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Digits(), pre_tokenizers.Split(" ", "isolated")])
    assert bound(kept) == 2
    unk = Tokenizer(models.WordLevel({"ab": 0, "[UNK]": 1}, unk_token="[UNK]"))
    assert bound(unk) is None and unk.encode("zzzzzzzzzz").ids == [1]  # 10 bytes, 1 token
    fallback = Tokenizer(models.BPE({**vocab, "<unk>": 4, **{f"<0x{b:02X}>": 5 + b for b in range(256)}}, [("a", "b")],
                                    unk_token="<unk>", byte_fallback=True))
    assert bound(fallback) == len("<0x00>")
    stripping = Tokenizer(models.BPE(vocab, [("a", "b")]))
    stripping.add_special_tokens([AddedToken("<s>", lstrip=True)])
    assert bound(stripping) is None
