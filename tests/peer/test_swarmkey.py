"""Swarm key (swarm.keys.swarmkey) and ``colibri-swarm key`` (swarm.cli.key)."""

from __future__ import annotations

import hashlib
import hmac
import io
import stat

import pytest

from swarm.cli import main
from swarm.errors import KeyCodeError
from swarm.keys import swarmkey
from swarm.keys.swarmkey import ALPHABET, SwarmKey, decode_code, encode_code

KEY = bytes(range(32))


@pytest.fixture
def config(tmp_path, monkeypatch):
    monkeypatch.setenv("COLIBRI_SWARM_CONFIG_DIR", str(tmp_path / "cfg"))
    return tmp_path / "cfg"


def _crockford(data: bytes) -> str:
    """Reference encoder: bits MSB first, 5 at a time (Crockford's spec, written out)."""
    bits = "".join(f"{b:08b}" for b in data)
    return "".join(ALPHABET[int(bits[i : i + 5], 2)] for i in range(0, len(bits), 5))


def test_code_layout_against_a_reference_encoder() -> None:
    check = hashlib.sha256(b"colibri-swarm key check v1" + KEY).digest()[:3]
    symbols = _crockford(KEY + check)
    assert len(symbols) == 56
    assert encode_code(KEY) == "-".join(symbols[i : i + 4] for i in range(0, 56, 4))
    assert decode_code(encode_code(KEY)) == KEY


def test_decoding_forgives_case_dashes_spaces_and_confusables() -> None:
    code = encode_code(KEY)
    assert decode_code(code.lower()) == KEY
    assert decode_code(" ".join(code.split("-"))) == KEY
    assert decode_code(code.replace("-", "")) == KEY
    assert decode_code(code.replace("1", "l").replace("0", "O")) == KEY


def test_every_single_symbol_typo_is_caught() -> None:
    symbols = encode_code(KEY).replace("-", "")
    for i in range(len(symbols)):
        for c in ALPHABET:
            if c == symbols[i]:
                continue
            with pytest.raises(KeyCodeError, match="checksum does not match"):
                decode_code(symbols[:i] + c + symbols[i + 1 :])


def test_adjacent_swaps_are_caught() -> None:
    symbols = encode_code(KEY).replace("-", "")
    for i in range(len(symbols) - 1):
        if symbols[i] != symbols[i + 1]:
            swapped = symbols[:i] + symbols[i + 1] + symbols[i] + symbols[i + 2 :]
            with pytest.raises(KeyCodeError, match="checksum"):
                decode_code(swapped)


@pytest.mark.parametrize(
    ("code", "needle"),
    [
        ("ABCD", "has 4 symbols; a code has 56"),
        (encode_code(KEY) + "-0", "has 57 symbols"),
        (encode_code(KEY)[:-1] + "U", r"'U' \(symbol 56\) is not a code symbol"),
        ("", "has 0 symbols"),
        ("https://x/#abc", "is not a code symbol"),
    ],
)
def test_bad_codes_name_the_problem(code: str, needle: str) -> None:
    with pytest.raises(KeyCodeError, match=needle):
        decode_code(code)


def test_sub_keys_are_rfc5869_hkdf_with_distinct_labels() -> None:
    key = SwarmKey(KEY)

    def hkdf(info: bytes, n: int = 32) -> bytes:  # RFC 5869 with an empty salt, one block
        prk = hmac.new(b"", KEY, hashlib.sha256).digest()
        return hmac.new(prk, info + b"\x01", hashlib.sha256).digest()[:n]

    assert key.channel_auth_key == hkdf(b"colibri-swarm v1 channel-auth")
    assert key.signaling_key == hkdf(b"colibri-swarm v1 signaling")
    assert key.api_token == hkdf(b"colibri-swarm v1 api-token").hex()
    assert key.swarm_id == hkdf(b"colibri-swarm v1 swarm-id", 8).hex()
    subs = {key.channel_auth_key, key.signaling_key, bytes.fromhex(key.api_token), KEY}
    assert len(subs) == 4
    assert KEY.hex() not in repr(key) and key.code not in repr(key)


def test_load_or_create_stores_once_with_0600(config) -> None:
    assert swarmkey.load() is None
    first = swarmkey.load_or_create()
    path = config / "swarm.key"
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert path.read_text().strip() == first.code
    assert swarmkey.load_or_create() == first
    assert swarmkey.store(encode_code(KEY).lower()) == SwarmKey(KEY)
    assert swarmkey.load() == SwarmKey(KEY)


def test_loose_permissions_are_tightened_and_damage_is_named(config) -> None:
    swarmkey.store(encode_code(KEY))
    path = config / "swarm.key"
    path.chmod(0o644)
    assert swarmkey.load() == SwarmKey(KEY)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    path.write_text("not a code")
    with pytest.raises(KeyCodeError, match=r"swarm\.key: .*join --key"):
        swarmkey.load()


def test_key_command_shows_the_stored_code_and_new_replaces_it(config, capsys) -> None:
    assert main(["key"]) == 0
    out = capsys.readouterr().out
    stored = swarmkey.load()
    assert stored is not None and stored.code in out and stored.swarm_id in out
    assert "█" in out or "▀" in out  # the QR code
    assert main(["key"]) == 0
    assert stored.code in capsys.readouterr().out
    assert main(["key", "--new"]) == 0
    out = capsys.readouterr().out
    new = swarmkey.load()
    assert new != stored and new.code in out and stored.code not in out


def test_qr_matrix_encodes_the_code() -> None:
    import qrcode

    from swarm.terminal import render_qr

    code = encode_code(KEY)
    qr = qrcode.QRCode(border=2, error_correction=qrcode.constants.ERROR_CORRECT_M)
    qr.add_data(code)
    matrix = qr.get_matrix()
    lines = render_qr(code).splitlines()
    # two matrix rows per text line (half blocks); one column per module
    assert len(lines) == (len(matrix) + 1) // 2 and all(len(line) == len(matrix) for line in lines)


def test_join_key_bad_code_is_one_clear_line(config, capsys) -> None:
    with pytest.raises(KeyCodeError):
        swarmkey.store("ABCD-EFGH")
    assert not (config / "swarm.key").exists()
