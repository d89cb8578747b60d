// The page's signaling client: WSS to the host peer's server, proof of the swarm key, presence,
// relayed signals (docs/protocol.md §10; the Python twin is swarm/signaling/client.py).
//
//   const sig = await SignalingClient.connect(url, swarmKey, peerId, name);
//   sig.peers                    // Map peer id → {peer, name, kind, joined}, kept current
//   sig.onsignal = (from, data) => …;  sig.onpresence = () => …;  sig.onclose = (code, reason) => …
//   sig.send(to, data);  sig.close();
import { deriveKey, hex, unhex, randomBytes, signalingClientMac, signalingServerMac, AuthenticationError } from "./auth.js";

export const SIGNALING_VERSION = 1;
export const CONNECT_TIMEOUT_S = 10;
// Random per page load, sent with every auth: a reconnect of this page replaces its old
// connection, while another tab or browser with the same stored identity is refused (4011).
export const PAGE_INSTANCE = hex(randomBytes(8));

/** Close codes of the signaling server (docs/protocol.md §10.3) and what to tell the user. */
export const CLOSE_REASONS = {
  4000: "the signaling server refused a message (protocol error)",
  4001: "the swarm refused this page's key: it is not the key of this swarm. Open the link or QR code that `colibri-swarm join` prints now",
  4002: "the swarm key was not proven in time",
  4003: "this page speaks another signaling protocol version than the swarm; reload it from the swarm's server",
  4009: "a message was too large for the signaling server",
  4010: "this peer connected again from elsewhere (a newer connection replaced this one)",
  4011: "this browser already serves the swarm from another tab or window (one peer identity, one page): close this one",
  4029: "too many messages: the signaling server rate-limited this page",
  4050: "the signaling server is stopping",
};

export class SignalingClient {
  constructor(ws, peerId) {
    this.ws = ws;
    this.peerId = peerId;
    this.peers = new Map();
    this.host = null;
    this.onsignal = () => {};
    this.onpresence = () => {};
    this.onclose = () => {};
  }

  /**
   * Connect and authenticate. Resolves once the server has proven the key too; rejects with
   * AuthenticationError (wrong key: the server closes with 4001, or a server that cannot prove
   * the key) or Error (unreachable, timeout) whose message says what to do.
   */
  static connect(url, swarmKey, peerId, name, { timeoutS = CONNECT_TIMEOUT_S } = {}) {
    return new Promise((resolve, reject) => {
      let ws;
      try { ws = new WebSocket(url); } catch (e) { reject(new Error(`cannot open ${url}: ${e.message}`)); return; }
      const client = new SignalingClient(ws, peerId);
      let settled = false, clientNonce = null, serverNonce = null, kSig = null;
      const done = (err) => {
        if (settled) return;
        settled = true;
        clearTimeout(timer);
        if (err) { reject(err); try { ws.close(); } catch { /* already closed */ } } else resolve(client);
      };
      const timer = setTimeout(() => done(new Error(`the signaling server at ${url} did not answer within ${timeoutS} s`)), timeoutS * 1000);
      ws.onerror = () => done(new Error(`cannot reach the signaling server at ${url}`));
      ws.onclose = (ev) => {
        const why = CLOSE_REASONS[ev.code] ?? `the signaling connection closed (${ev.code} ${ev.reason})`;
        if (!settled) done(ev.code === 4001 ? new AuthenticationError(why) : new Error(why));
        else client.onclose(ev.code, why);
      };
      ws.onmessage = async (ev) => {
        let m;
        try {
          if (typeof ev.data !== "string") throw new Error("binary frame");
          m = JSON.parse(ev.data);
          if (typeof m !== "object" || m === null) throw new Error("not an object");
        } catch (e) {
          if (!settled) done(new Error(`the signaling server sent a malformed frame (${e.message})`));
          return;
        }
        try {
          if (!settled) {
            if (m.type === "challenge" && serverNonce === null) {
              if (m.version !== SIGNALING_VERSION) throw new Error(`the signaling server speaks version ${m.version}, this page ${SIGNALING_VERSION}: reload the page`);
              serverNonce = unhex(m.nonce);
              if (serverNonce.length !== 32) throw new Error("the server nonce is not 32 bytes");
              client.host = m.host;
              clientNonce = randomBytes(32);
              kSig = await deriveKey(swarmKey, "signaling");
              const mac = await signalingClientMac(kSig, serverNonce, clientNonce, peerId);
              ws.send(JSON.stringify({ type: "auth", version: SIGNALING_VERSION, peer: peerId, kind: "browser", name, nonce: hex(clientNonce), mac: hex(mac), instance: PAGE_INSTANCE }));
            } else if (m.type === "welcome" && clientNonce !== null) {
              const want = hex(await signalingServerMac(kSig, serverNonce, clientNonce, peerId));
              if (typeof m.mac !== "string" || m.mac !== want) throw new AuthenticationError("the signaling server could not prove the swarm key: it is not this swarm's server");
              if (!Array.isArray(m.peers)) throw new Error("welcome without a peer list");
              for (const p of m.peers) client._present(p);
              done(null);
              client.onpresence();
            } else {
              throw new Error(`unexpected ${m.type} before the server proved the key`);
            }
            return;
          }
          switch (m.type) {
            case "joined": client._present(m.peer); client.onpresence(); break;
            case "left": client.peers.delete(m.peer); client.onpresence(); break;
            case "signal":
              if (typeof m.from === "string" && typeof m.data === "object" && m.data !== null) client.onsignal(m.from, m.data);
              break;
            default: break;  // "error" notices (unknown-peer) are not fatal
          }
        } catch (e) {
          done(e);
        }
      };
    });
  }

  _present(p) {
    if (p && typeof p.peer === "string" && (p.kind === "python" || p.kind === "browser")) {
      this.peers.set(p.peer, { peer: p.peer, name: String(p.name ?? ""), kind: p.kind, joined: Number(p.joined) || 0 });
    }
  }

  /** Relay `data` (a JSON object) to peer `to`. */
  send(to, data) {
    if (this.ws.readyState === WebSocket.OPEN) this.ws.send(JSON.stringify({ type: "signal", to, data }));
  }

  close() { try { this.ws.close(1000, "page closed"); } catch { /* gone */ } }
}

/** The WSS URL of the server that served this page. */
export function signalingUrl(loc = globalThis.location) {
  return `${loc.protocol === "https:" ? "wss" : "ws"}://${loc.host}/ws`;
}
