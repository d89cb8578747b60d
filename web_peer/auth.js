// Swarm key, sub-keys and the two proofs of the key, with WebCrypto (needs a secure context).
//
// - The swarm key arrives in the page URL's fragment (`#…`, never sent to a server) as its
//   typeable code (56 Crockford base32 symbols with a 3-byte check) or as 64 hex digits.
// - Sub-keys: HKDF-SHA256, empty salt, info "colibri-swarm v1 <label>" (swarm/keys/swarmkey.py).
// - Signaling proof (swarm/signaling/auth.py): HMAC over label ‖ 0x00 ‖ nonces ‖ peer id.
// - Channel authentication (docs/protocol.md §6, swarm/peer/net/auth.py): a sans-I/O state machine,
//   AuthHello → AuthProof, MACs over a transcript that binds both DTLS fingerprints, ordered by
//   offer/answer role. Frames in, frames out; `await` only for WebCrypto.
import { encodeMessage, decodeMessage, PROTOCOL_VERSION } from "./wire.js";

/** The other side could not prove the swarm key, or a transcript was altered. */
export class AuthenticationError extends Error {
  constructor(message) { super(message); this.name = "AuthenticationError"; }
}

/** The swarm key code in the URL is malformed or mistyped. */
export class KeyCodeError extends Error {
  constructor(message) { super(message); this.name = "KeyCodeError"; }
}

const ascii = new TextEncoder();
export const hex = (u8) => Array.from(u8, (b) => b.toString(16).padStart(2, "0")).join("");
export function unhex(s) {
  if (typeof s !== "string" || s.length % 2 || /[^0-9a-fA-F]/.test(s)) throw new TypeError("expected hex digits");
  return Uint8Array.from(s.match(/../g) ?? [], (h) => parseInt(h, 16));
}
const concat = (...parts) => {
  const out = new Uint8Array(parts.reduce((s, p) => s + p.length, 0));
  let at = 0;
  for (const p of parts) { out.set(p, at); at += p.length; }
  return out;
};
export const randomBytes = (n) => crypto.getRandomValues(new Uint8Array(n));
export async function sha256(bytes) { return new Uint8Array(await crypto.subtle.digest("SHA-256", bytes)); }

// ---- swarm key ---------------------------------------------------------------------------------

const ALPHABET = "0123456789ABCDEFGHJKMNPQRSTVWXYZ";  // Crockford base32
const VALUE = Object.fromEntries([...ALPHABET].map((c, i) => [c, i]).concat([["I", 1], ["L", 1], ["O", 0]]));

/**
 * The 32-byte swarm key from a URL fragment: the typeable code (case, dashes and spaces ignored;
 * I/L read as 1, O as 0; 3-byte check) or 64 hex digits. Throws KeyCodeError naming the problem.
 */
export async function parseSwarmKey(text) {
  const s = decodeURIComponent(String(text ?? "")).replace(/^#/, "").replace(/^key=/, "").trim();
  if (/^[0-9a-fA-F]{64}$/.test(s)) return unhex(s);
  const symbols = s.toUpperCase().replace(/[-\s]/g, "");
  if (!symbols) throw new KeyCodeError("the page address has no swarm key after '#': open the link or QR code that `colibri-swarm join` prints");
  if (symbols.length !== 56) throw new KeyCodeError(`the swarm key code has ${symbols.length} symbols, expected 56: check the link`);
  let acc = 0n;
  for (const c of symbols) {
    if (!(c in VALUE)) throw new KeyCodeError(`the swarm key code holds '${c}', which is not a code symbol: check the link`);
    acc = (acc << 5n) | BigInt(VALUE[c]);
  }
  const bytes = new Uint8Array(35);
  for (let i = 34; i >= 0; i--) { bytes[i] = Number(acc & 0xffn); acc >>= 8n; }
  const key = bytes.subarray(0, 32);
  const check = (await sha256(concat(ascii.encode("colibri-swarm key check v1"), key))).subarray(0, 3);
  if (hex(check) !== hex(bytes.subarray(32))) throw new KeyCodeError("the swarm key code fails its check (a symbol is mistyped): copy the link again");
  return new Uint8Array(key);
}

/** HKDF-SHA256 sub-key of the swarm key for `label` (RFC 5869; empty salt). */
export async function deriveKey(swarmKey, label, length = 32) {
  const base = await crypto.subtle.importKey("raw", swarmKey, "HKDF", false, ["deriveBits"]);
  const bits = await crypto.subtle.deriveBits(
    { name: "HKDF", hash: "SHA-256", salt: new Uint8Array(), info: ascii.encode(`colibri-swarm v1 ${label}`) }, base, 8 * length);
  return new Uint8Array(bits);
}

async function hmac(keyBytes, data) {
  const key = await crypto.subtle.importKey("raw", keyBytes, { name: "HMAC", hash: "SHA-256" }, false, ["sign"]);
  return new Uint8Array(await crypto.subtle.sign("HMAC", key, data));
}

/** Constant-time comparison of two equal-length strings (MACs in hex). */
function sameText(a, b) {
  if (a.length !== b.length) return false;
  let d = 0;
  for (let i = 0; i < a.length; i++) d |= a.charCodeAt(i) ^ b.charCodeAt(i);
  return d === 0;
}

// ---- signaling proof ---------------------------------------------------------------------------

/** The client's proof to the signaling server (32 bytes). */
export function signalingClientMac(kSig, serverNonce, clientNonce, peerId) {
  return hmac(kSig, concat(ascii.encode("colibri-swarm signaling client v1"), new Uint8Array([0]), serverNonce, clientNonce, ascii.encode(peerId)));
}

/** The server's proof back to the client (32 bytes). */
export function signalingServerMac(kSig, serverNonce, clientNonce, peerId) {
  return hmac(kSig, concat(ascii.encode("colibri-swarm signaling server v1"), new Uint8Array([0]), clientNonce, serverNonce, ascii.encode(peerId)));
}

// ---- channel authentication --------------------------------------------------------------------

/** "sha-256 AB:CD:…" (SDP form: algorithm lower case, hex upper case); AuthenticationError otherwise. */
export function normalizeFingerprint(fp) {
  let text = String(fp).trim();
  if (text.toLowerCase().startsWith("a=fingerprint:")) text = text.slice("a=fingerprint:".length);
  const parts = text.split(/\s+/);
  if (parts.length !== 2 || parts[0].toLowerCase() !== "sha-256" || !/^[0-9A-F]{2}(:[0-9A-F]{2}){31}$/.test(parts[1].toUpperCase())) {
    throw new AuthenticationError(`DTLS fingerprint ${JSON.stringify(fp).slice(0, 120)} is not 'sha-256' and 32 hex bytes with colons`);
  }
  return `sha-256 ${parts[1].toUpperCase()}`;
}

/**
 * The one sha-256 DTLS fingerprint of an SDP. The page reads its own from its local SDP and the
 * remote one from the raw remote SDP it received (Chrome's remoteDescription keeps only sha-512).
 */
export function sdpFingerprint(sdp) {
  const found = new Set([...String(sdp).matchAll(/^a=fingerprint:sha-256 ([0-9A-Fa-f:]{95})\s*$/gm)].map((m) => m[1].toUpperCase()));
  if (found.size !== 1) throw new AuthenticationError(`the SDP carries ${found.size} distinct sha-256 fingerprints; exactly one is required`);
  return `sha-256 ${[...found][0]}`;
}

/** The transcript MAC (lower-case hex) for `proof` ("key" | "channel") sent by `role`. */
export async function channelMac(authKey, proof, role, t) {
  const lines = [
    "colibri-swarm channel-auth v1", `proof=${proof}`, `role=${role}`, `protocol-version=${PROTOCOL_VERSION}`,
    `offer-peer-id=${t.offerPeerId}`, `answer-peer-id=${t.answerPeerId}`, `offer-nonce=${t.offerNonce}`, `answer-nonce=${t.answerNonce}`,
  ];
  if (proof === "channel") lines.push(`offer-fingerprint=${t.offerFingerprint}`, `answer-fingerprint=${t.answerFingerprint}`);
  return hex(await hmac(authKey, ascii.encode(lines.map((l) => l + "\n").join(""))));
}

/**
 * One side of the channel handshake. role: "offerer" | "answerer"; authKey: the channel-auth
 * sub-key (32 bytes); fingerprints as in SDP. `start()` gives the first frame; `await receive(f)`
 * gives frames to send and throws AuthenticationError on any failure (then close the channel).
 */
export class ChannelAuth {
  constructor({ role, authKey, localPeerId, localFingerprint, remoteFingerprint, nonce = randomBytes(32), expectedPeerId = null }) {
    if (role !== "offerer" && role !== "answerer") throw new TypeError(`role must be offerer or answerer, not ${role}`);
    Object.assign(this, { role, authKey, localPeerId, expectedPeerId });
    this.localFingerprint = normalizeFingerprint(localFingerprint);
    this.remoteFingerprint = normalizeFingerprint(remoteFingerprint);
    this.localNonce = hex(nonce);
    this.remotePeerId = null;
    this.remoteNonce = null;
    this.state = "hello-sent";
  }

  get authenticated() { return this.state === "done"; }

  start() { return [encodeMessage({ kind: "AuthHello", peer_id: this.localPeerId, nonce: this.localNonce })]; }

  async receive(frame) {
    if (this.state === "done" || this.state === "failed") throw new AuthenticationError(`channel authentication is ${this.state}`);
    try {
      return await this._receive(decodeMessage(frame));
    } catch (e) {
      this.state = "failed";
      throw e;
    }
  }

  async _receive(m) {
    if (m.kind === "AuthHello" && this.remoteNonce === null) {
      if (m.peer_id === this.localPeerId || m.nonce === this.localNonce) throw new AuthenticationError("the remote hello echoes our own peer id or nonce (a reflected handshake)");
      if (this.expectedPeerId !== null && m.peer_id !== this.expectedPeerId) {
        throw new AuthenticationError(`the remote claims peer id ${m.peer_id} but signaling announced ${this.expectedPeerId}`);
      }
      this.remotePeerId = m.peer_id;
      this.remoteNonce = m.nonce;
      this.state = "proof-sent";
      const [keyMac, chanMac] = await Promise.all([this._mac("key", this.role), this._mac("channel", this.role)]);
      return [encodeMessage({ kind: "AuthProof", key_mac: keyMac, channel_mac: chanMac })];
    }
    if (m.kind === "AuthProof" && this.remoteNonce !== null) {
      const remoteRole = this.role === "offerer" ? "answerer" : "offerer";
      const [keyMac, chanMac] = await Promise.all([this._mac("key", remoteRole), this._mac("channel", remoteRole)]);
      if (!sameText(m.key_mac, keyMac)) throw new AuthenticationError(`the swarm's peer ${this.remotePeerId} holds another swarm key: this page's key is wrong or old`);
      if (!sameText(m.channel_mac, chanMac)) throw new AuthenticationError(`peer ${this.remotePeerId} failed the DTLS fingerprint check: the two ends saw different certificates (a relay substituted one)`);
      this.state = "done";
      return [];
    }
    throw new AuthenticationError(`${m.kind} arrived in state ${this.state} of channel authentication; only AuthHello then AuthProof are allowed before it completes`);
  }

  _mac(proof, role) {
    const local = [this.localPeerId, this.localNonce, this.localFingerprint];
    const remote = [this.remotePeerId, this.remoteNonce, this.remoteFingerprint];
    const [offer, answer] = this.role === "offerer" ? [local, remote] : [remote, local];
    return channelMac(this.authKey, proof, role, {
      offerPeerId: offer[0], answerPeerId: answer[0], offerNonce: offer[1], answerNonce: answer[1],
      offerFingerprint: offer[2], answerFingerprint: answer[2],
    });
  }
}

/** Peer id of a public key: base32(SHA-256(SPKI DER)[:16]), lower case, no padding (26 chars). */
export async function peerIdOfSpki(spki) {
  const d = (await sha256(spki)).subarray(0, 16);
  const abc = "abcdefghijklmnopqrstuvwxyz234567";
  let bits = 0, value = 0, out = "";
  for (const b of d) {
    value = (value << 8) | b;
    bits += 8;
    while (bits >= 5) { out += abc[(value >>> (bits - 5)) & 31]; bits -= 5; }
  }
  if (bits > 0) out += abc[(value << (5 - bits)) & 31];
  return out;
}
