"""web_peer/auth.js in Chromium against the Python implementation's golden vectors: the swarm key
code, HKDF sub-keys, the signaling proof, the channel-authentication frames byte for byte, and
refusal of a wrong key or a substituted DTLS fingerprint."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec

from swarm.keys import identity

pytestmark = pytest.mark.browser

VECTORS = Path(__file__).resolve().parents[1] / "vectors"


def test_swarm_key_code_and_subkeys(page):
    v = json.loads((VECTORS / "swarm_key.json").read_text())
    code = v["code"]
    typo = code[:5] + ("1" if code[5] != "1" else "2") + code[6:]
    got = page.evaluate("""async ({code, typo}) => {
      const a = await import("/auth.js");
      const key = await a.parseSwarmKey("#" + code);
      const loose = await a.parseSwarmKey(code.toLowerCase().replaceAll("-", " "));
      const errs = [];
      for (const bad of [typo, "", code.slice(4), code.replace(/.$/, "U")]) {
        try { await a.parseSwarmKey(bad); errs.push("accepted"); } catch (e) { errs.push(`${e.name}: ${e.message}`); }
      }
      return { key: a.hex(key), loose: a.hex(loose), hexkey: a.hex(await a.parseSwarmKey(a.hex(key))), errs,
               sig: a.hex(await a.deriveKey(key, "signaling")), chan: a.hex(await a.deriveKey(key, "channel-auth")),
               id: a.hex(await a.deriveKey(key, "swarm-id", 8)), api: a.hex(await a.deriveKey(key, "api-token")) };
    }""", {"code": code, "typo": typo})
    assert got["key"] == got["loose"] == got["hexkey"] == v["key_hex"]
    assert (got["sig"], got["chan"], got["id"], got["api"]) == (
        v["signaling_key_hex"], v["channel_auth_key_hex"], v["swarm_id"], v["api_token"])
    assert all(e.startswith("KeyCodeError") for e in got["errs"]), got["errs"]
    assert "check" in got["errs"][0] and "no swarm key" in got["errs"][1]


def test_signaling_proof(page):
    v = json.loads((VECTORS / "signaling_auth.json").read_text())
    got = page.evaluate("""async (v) => {
      const a = await import("/auth.js");
      const k = a.unhex(v.signaling_key), s = a.unhex(v.server_nonce), c = a.unhex(v.client_nonce);
      return [a.hex(await a.signalingClientMac(k, s, c, v.peer_id)), a.hex(await a.signalingServerMac(k, s, c, v.peer_id))];
    }""", v)
    assert got == [v["client_mac"], v["server_mac"]]


HANDSHAKE = """async ({v, keyB, fpB}) => {
  const a = await import("/auth.js");
  const side = (role, key, fpRemote) => new a.ChannelAuth({ role, authKey: a.unhex(key),
    localPeerId: v[role].peer_id, nonce: a.unhex(v[role].nonce), localFingerprint: v[role].fingerprint,
    remoteFingerprint: fpRemote ?? v[role === "offerer" ? "answerer" : "offerer"].fingerprint });
  const off = side("offerer", v.channel_auth_key_hex), ans = side("answerer", keyB ?? v.channel_auth_key_hex, fpB);
  const frames = {};
  const [oh] = off.start(), [ah] = ans.start();
  frames.offerer_hello = a.hex(oh); frames.answerer_hello = a.hex(ah);
  const [op] = await off.receive(ah), [ap] = await ans.receive(oh);
  frames.offerer_proof = a.hex(op); frames.answerer_proof = a.hex(ap);
  const errors = [];
  for (const [me, f] of [[off, ap], [ans, op]]) {
    try { await me.receive(f); } catch (e) { errors.push(`${e.name}: ${e.message}`); }
  }
  return { frames, done: [off.authenticated, ans.authenticated], errors };
}"""


def test_channel_auth_frames_match_python(page):
    v = json.loads((VECTORS / "channel_auth.json").read_text())
    got = page.evaluate(HANDSHAKE, {"v": v})
    assert got["frames"] == v["frames_hex"]
    assert got["done"] == [True, True] and got["errors"] == []


def test_channel_auth_refuses_wrong_key_and_substituted_fingerprint(page):
    v = json.loads((VECTORS / "channel_auth.json").read_text())
    wrong = page.evaluate(HANDSHAKE, {"v": v, "keyB": "11" * 32})
    assert wrong["done"] == [False, False]
    assert all(e.startswith("AuthenticationError") and "another swarm key" in e for e in wrong["errors"])
    # The answerer saw another offerer certificate than the real one (a relay swapped it).
    fake = "sha-256 " + ":".join(["AB"] * 32)
    swapped = page.evaluate(HANDSHAKE, {"v": v, "fpB": fake})
    assert swapped["done"] == [False, False]
    assert all("fingerprint check" in e for e in swapped["errors"]), swapped["errors"]


def test_peer_id_of_public_key_matches_python(page):
    key = ec.generate_private_key(ec.SECP256R1()).public_key()
    spki = key.public_bytes(serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo)
    got = page.evaluate("""async (h) => (await import("/auth.js")).peerIdOfSpki((await import("/auth.js")).unhex(h))""", spki.hex())
    assert got == identity.peer_id_of_public_key(key)
