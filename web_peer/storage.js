// What the page keeps across reloads: its identity (IndexedDB) and shipped weight slices
// (Cache Storage, keyed by the slice's SHA-256, re-verified on every read).
import { peerIdOfSpki, sha256, hex } from "./auth.js";

const DB = "colibri-swarm";
const CACHE = "colibri-swarm-slices";

function db() {
  return new Promise((resolve, reject) => {
    const req = indexedDB.open(DB, 1);
    req.onupgradeneeded = () => req.result.createObjectStore("kv");
    req.onsuccess = () => resolve(req.result);
    req.onerror = () => reject(req.error);
  });
}

async function kv(mode, fn) {
  const d = await db();
  return new Promise((resolve, reject) => {
    const tx = d.transaction("kv", mode);
    const req = fn(tx.objectStore("kv"));
    tx.oncomplete = () => { d.close(); resolve(req?.result); };
    tx.onerror = () => { d.close(); reject(tx.error); };
  });
}

/**
 * This browser's long-term identity: an ECDSA P-256 key pair (private key not extractable) and
 * a DTLS certificate, made once and kept in IndexedDB. peerId = base32(SHA-256(SPKI)[:16]).
 * Falls back to a fresh in-memory identity where storage is unavailable (private windows).
 */
export async function loadIdentity() {
  let id = null;
  try { id = await kv("readonly", (s) => s.get("identity")); } catch { /* no storage */ }
  if (!id || id.certificate.expires < Date.now() + 86400e3) {
    const keys = await crypto.subtle.generateKey({ name: "ECDSA", namedCurve: "P-256" }, false, ["sign", "verify"]);
    const certificate = await RTCPeerConnection.generateCertificate({ name: "ECDSA", namedCurve: "P-256", expires: 3650 * 86400e3 });
    id = { keys, certificate, spki: new Uint8Array(await crypto.subtle.exportKey("spki", keys.publicKey)) };
    try { await kv("readwrite", (s) => s.put(id, "identity")); } catch { /* not kept: a new id next time */ }
  }
  return { peerId: await peerIdOfSpki(id.spki), certificate: id.certificate };
}

/** A cached slice blob (Uint8Array) whose SHA-256 is `sliceId` (hex), or null. */
export async function getSlice(sliceId) {
  try {
    const cache = await caches.open(CACHE);
    const res = await cache.match(`/__slices/${sliceId}`);
    if (!res) return null;
    const blob = new Uint8Array(await res.arrayBuffer());
    if (hex(await sha256(blob)) !== sliceId) { await cache.delete(`/__slices/${sliceId}`); return null; }  // corrupted: fetch again
    return blob;
  } catch {
    return null;
  }
}

/** Keep a verified slice blob under its SHA-256 (hex). Storage full → not kept, no error. */
export async function putSlice(sliceId, blob) {
  try {
    const cache = await caches.open(CACHE);
    await cache.put(`/__slices/${sliceId}`, new Response(blob, { headers: { "Content-Type": "application/octet-stream" } }));
    return true;
  } catch {
    return false;
  }
}

/** Forget every cached slice (the page's "clear weights" button). */
export async function clearSlices() {
  try { await caches.delete(CACHE); } catch { /* nothing kept */ }
}
