// One authenticated data-channel link from the page to a Python peer (the coordinator).
//
// Theory of operation (the Python twin is swarm/peer/net/link.py): the page always offers (Chrome
// then forms the link through peer-reflexive candidates, docs/architecture.md §7). One ordered, reliable data
// channel, negotiated with stream id 0, is created before the offer. States, in order only:
//   connecting → authenticating → greeting → open → closed
// - authenticating: ChannelAuth (auth.js) with our fingerprint from our local SDP and the remote's
//   from the raw answer SDP; nothing else is accepted before it completes.
// - greeting: both sides send Hello; another protocol version is refused.
// - open: frames split to the remote's max-message-size and reassembled with bounded buffers;
//   sends wait on bufferedAmount (backpressure); heartbeats every HEARTBEAT_S, the remote's are
//   echoed; DEAD_AFTER_S of silence closes the link.
import { ChannelAuth, sdpFingerprint, AuthenticationError, hex, randomBytes } from "./auth.js";
import { decodeMessage, encodeMessage, Fragmenter, Reassembler, maxMessageSizeFromSdp, PROTOCOL_VERSION } from "./wire.js";

export const CHANNEL_LABEL = "colibri-swarm";
export const HEARTBEAT_S = 1.0;
export const DEAD_AFTER_S = 5.0;
export const HANDSHAKE_TIMEOUT_S = 10.0;
export const ICE_GATHER_S = 2.0;  // wait this long for candidates before sending the offer anyway
const SEND_HIGH_WATER = 1 << 20;
const SEND_LOW_WATER = 256 << 10;
const now = () => performance.now() / 1000;

export class PeerLink {
  /**
   * @param {{signaling, remotePeerId: string, localPeerId: string, authKey: Uint8Array,
   *          certificate?: RTCCertificate, hello: object}} opts  hello: our Hello fields
   */
  constructor({ signaling, remotePeerId, localPeerId, authKey, certificate, hello }) {
    Object.assign(this, { signaling, remotePeerId, localPeerId, authKey, hello });
    this.state = "connecting";
    this.session = hex(randomBytes(8));
    this.remoteHello = null;
    this.closeReason = null;
    this.handlers = new Map();   // message kind → handler(msg)
    this.onclose = () => {};
    this.onopen = () => {};
    this.pc = new RTCPeerConnection({ iceServers: [], certificates: certificate ? [certificate] : undefined });
    this.channel = this.pc.createDataChannel(CHANNEL_LABEL, { negotiated: true, id: 0, ordered: true });
    this.channel.binaryType = "arraybuffer";
    this.channel.bufferedAmountLowThreshold = SEND_LOW_WATER;
    this.reassembler = new Reassembler();
    this.fragmenter = new Fragmenter();
    this.lastHeard = now();
    this.heartbeatSeq = 0;
    this.sentBeats = new Map();  // seq → sent_s of our own heartbeats awaiting their echo
    this.timers = [];
    this.pc.onicecandidate = (ev) => {
      if (ev.candidate && ev.candidate.candidate) {
        signaling.send(remotePeerId, { type: "candidate", candidate: ev.candidate.candidate, sdpMid: ev.candidate.sdpMid ?? "0", sdpMLineIndex: ev.candidate.sdpMLineIndex ?? 0, session: this.session });
      }
    };
    this.pc.onconnectionstatechange = () => {
      if (["failed", "closed"].includes(this.pc.connectionState)) this.close(`connection ${this.pc.connectionState}`);
    };
    this.channel.onopen = () => this._channelOpen().catch((e) => this.close(e.message));
    this.channel.onclose = () => this.close("the data channel closed");
    // One message at a time, in arrival order: the handshake awaits WebCrypto between messages.
    this._inbox = Promise.resolve();
    this.channel.onmessage = (ev) => {
      this._inbox = this._inbox.then(() => this._onData(ev.data)).catch((e) => this.close(e.message));
    };
    this.timers.push(setTimeout(() => { if (this.state !== "open") this.close(`no authenticated link within ${HANDSHAKE_TIMEOUT_S} s`); }, HANDSHAKE_TIMEOUT_S * 1000));
  }

  /** Make the offer and send it through signaling. */
  async offer() {
    const offer = await this.pc.createOffer();
    await this.pc.setLocalDescription(offer);
    await new Promise((resolve) => {
      if (this.pc.iceGatheringState === "complete") return resolve();
      const t = setTimeout(resolve, ICE_GATHER_S * 1000);
      this.pc.addEventListener("icegatheringstatechange", () => { if (this.pc.iceGatheringState === "complete") { clearTimeout(t); resolve(); } });
    });
    this.localSdp = this.pc.localDescription.sdp;
    this.signaling.send(this.remotePeerId, { type: "offer", sdp: this.localSdp, session: this.session });
  }

  /** A relayed signal from the remote peer (answer or candidate of our session). */
  async handleSignal(data) {
    if (data.session !== this.session) return;  // another attempt's
    if (data.type === "answer" && typeof data.sdp === "string" && !this.remoteSdp) {
      this.remoteSdp = data.sdp;  // the raw SDP: the fingerprint must come from it (Chrome keeps only sha-512)
      this.fragmenter = new Fragmenter(maxMessageSizeFromSdp(data.sdp));
      await this.pc.setRemoteDescription({ type: "answer", sdp: data.sdp });
    } else if (data.type === "candidate" && typeof data.candidate === "string" && data.candidate) {
      // Not awaited: a candidate the browser must resolve (mDNS) would hold up every signal after it.
      this.pc.addIceCandidate({ candidate: data.candidate, sdpMid: data.sdpMid ?? "0", sdpMLineIndex: data.sdpMLineIndex ?? 0 }).catch(() => {});
    }
  }

  async _channelOpen() {
    this.state = "authenticating";
    this.auth = new ChannelAuth({
      role: "offerer", authKey: this.authKey, localPeerId: this.localPeerId, expectedPeerId: this.remotePeerId,
      localFingerprint: sdpFingerprint(this.localSdp), remoteFingerprint: sdpFingerprint(this.remoteSdp),
    });
    for (const f of this.auth.start()) this.channel.send(f);
  }

  async _onData(data) {
    if (this.state === "closed") return;
    this.lastHeard = now();
    if (this.state === "authenticating") {
      const frame = new Uint8Array(data);
      if (frame.length > 4096) throw new AuthenticationError("a large frame arrived before channel authentication completed");
      let out;
      try { out = await this.auth.receive(frame); } catch (e) { this.authError = e; throw e; }
      for (const f of out) this.channel.send(f);
      if (this.auth.authenticated) {
        this.state = "greeting";
        await this.send({ kind: "Hello", ...this.hello });
      }
      return;
    }
    const frame = this.reassembler.feed(new Uint8Array(data), now());
    if (!frame) return;
    const msg = decodeMessage(frame);
    if (this.state === "greeting") {
      if (msg.kind !== "Hello") throw new Error(`${msg.kind} arrived before the Hello`);
      if (msg.peer_id !== this.remotePeerId) throw new AuthenticationError(`Hello names peer ${msg.peer_id}, but the channel proved ${this.remotePeerId}`);
      if (msg.protocol_version !== PROTOCOL_VERSION) throw new Error(`peer ${msg.peer_id} speaks protocol version ${msg.protocol_version}, this page ${PROTOCOL_VERSION}`);
      this.remoteHello = msg;
      this.state = "open";
      this._startHeartbeats();
      this.onopen(this);
      return;
    }
    if (msg.kind === "LinkHeartbeat") {
      if (this.sentBeats.get(msg.seq) === msg.sent_s) { this.sentBeats.delete(msg.seq); this.rttS = now() - msg.sent_s; } else await this.send(msg);  // echo theirs unchanged
      return;
    }
    // Handlers run concurrently with later messages (a weight pull waits for chunks that arrive
    // after it); a handler's failure is logged, the link stays up.
    const handler = this.handlers.get(msg.kind);
    if (handler) Promise.resolve().then(() => handler(msg, this)).catch((e) => console.error(`handler of ${msg.kind} failed:`, e));
  }

  _startHeartbeats() {
    this.timers.push(setInterval(() => {
      if (now() - this.lastHeard > DEAD_AFTER_S) { this.close(`no word from ${this.remotePeerId} for ${DEAD_AFTER_S} s`); return; }
      const seq = this.heartbeatSeq++, sent = now();
      this.sentBeats.set(seq, sent);
      if (this.sentBeats.size > 16) this.sentBeats.delete(this.sentBeats.keys().next().value);
      this.send({ kind: "LinkHeartbeat", seq, sent_s: sent }).catch(() => {});
    }, HEARTBEAT_S * 1000));
  }

  /** Handle messages of `kind` with handler(msg, link) (sync or async). */
  on(kind, handler) { this.handlers.set(kind, handler); }

  /** Encode, fragment and send one message, waiting while the channel's buffer is full. */
  async send(msg) {
    if (this.state === "closed") throw new Error(`link to ${this.remotePeerId} is closed: ${this.closeReason}`);
    for (const part of this.fragmenter.split(encodeMessage(msg))) {
      while (this.channel.bufferedAmount > SEND_HIGH_WATER && this.channel.readyState === "open") {
        await new Promise((r) => this.channel.addEventListener("bufferedamountlow", r, { once: true }));
      }
      this.channel.send(part);
    }
  }

  close(reason) {
    if (this.state === "closed") return;
    this.state = "closed";
    this.closeReason = reason;
    for (const t of this.timers) { clearTimeout(t); clearInterval(t); }
    try { this.channel.close(); } catch { /* gone */ }
    try { this.pc.close(); } catch { /* gone */ }
    this.onclose(reason, this);
  }
}
