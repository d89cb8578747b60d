// What the page keeps across reloads: its identity (IndexedDB) and shipped weight slices
// (Cache Storage, keyed by the slice's SHA-256, re-verified on every read); and how slices come
// in bulk: HTTPS range requests to the shipper's slice server (fetchSliceHttps).
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

// ---- bulk fetch over HTTPS (the Python twin is swarm/peer/weights/slice_http.py) ------------------------

export const MAX_CHUNK_TRIES = 4;  // a chunk that fails its SHA-256 this often ends the fetch

export class SliceFetchError extends Error {
  constructor(message) { super(message); this.name = "SliceFetchError"; }
}

/** The offer's URLs, this page's own host first: its certificate is the one the user accepted. */
export function orderUrls(urls, host = globalThis.location?.hostname) {
  return [...urls].sort((a, b) => (new URL(b).hostname === host) - (new URL(a).hostname === host));
}

function runs(indices) {
  const out = [];
  for (const i of indices) {
    const last = out.at(-1);
    if (last && last[0] + last[1] === i) last[1] += 1; else out.push([i, 1]);
  }
  return out;
}

/**
 * Fetch the slice a WeightManifest `m` offers over its HTTPS path (`m.https`: {urls, cert_sha256,
 * token}): one `Range` request per run of missing chunks with the bearer token, every chunk
 * checked against `m.chunk_sha256` as it streams in, a chunk that fails asked for again (at most
 * MAX_CHUNK_TRIES times in all), the whole against the slice id `m.name`. The bytes land in one
 * Uint8Array of `m.total_bytes` (the only copy held). `progress` ({done, total} in bytes) is
 * updated as chunks pass; `onprogress()` is called then.
 *
 * A browser cannot pin `cert_sha256`: the certificate must be one it accepts for that host (the
 * signaling host's, which the user accepted to open this page, when the coordinator hosts
 * signaling); every byte is checked against the manifest, which came over the authenticated link.
 *
 * Throws SliceFetchError naming the cause: no URL answered (certificate not accepted, another
 * network, CORS), the token was refused (401/403), an answer of the wrong range or size, or a chunk
 * that kept failing its hash. The caller may then use the data channel.
 */
export async function fetchSliceHttps(m, { progress = { done: 0, total: m.total_bytes }, onprogress = () => {} } = {}) {
  const n = m.chunk_sha256.length;
  const blob = new Uint8Array(m.total_bytes);
  const have = new Uint8Array(n);
  const tries = new Uint8Array(n);
  const span = (i) => [i * m.chunk_bytes, Math.min((i + 1) * m.chunk_bytes, m.total_bytes)];
  const urls = orderUrls(m.https.urls);
  const failures = [];
  let base = null;
  for (;;) {
    const missing = [];
    for (let i = 0; i < n; i++) if (!have[i]) missing.push(i);
    if (!missing.length) break;
    for (const [first, count] of runs(missing)) {
      const [start] = span(first), [, stop] = span(first + count - 1);
      let res = null;
      for (const url of base ? [base] : urls) {
        try {
          res = await fetch(`${url}/slices/${m.name}`, {
            headers: { Authorization: `Bearer ${m.https.token}`, Range: `bytes=${start}-${stop - 1}` }, cache: "no-store", mode: "cors",
          });
          base = url;
          break;
        } catch (e) {  // TypeError: unreachable, certificate not accepted, CORS
          if (base) throw new SliceFetchError(`slice server ${url} broke off: ${e.message}`);
          failures.push(`${url}: ${e.message}`);
        }
      }
      if (!res) throw new SliceFetchError(`no slice server URL answered (${failures.join("; ")})`);
      if (res.status === 401 || res.status === 403) throw new SliceFetchError(`slice server ${base} refused the token (${res.status}: ${(await res.text()).trim().slice(0, 200)})`);
      const want = `bytes ${start}-${stop - 1}/${m.total_bytes}`;
      if (res.status !== 206 || res.headers.get("Content-Range") !== want) {
        throw new SliceFetchError(`slice server ${base} answered ${res.status} with Content-Range ${res.headers.get("Content-Range")} for ${want}`);
      }
      // Stream into place; hash each chunk as soon as its last byte is in (hashes overlap reading).
      const reader = res.body.getReader();
      let at = start, next = first;
      const checks = [];
      let failed = null;
      const check = (i) => {
        const [a, b] = span(i);
        checks.push(crypto.subtle.digest("SHA-256", blob.subarray(a, b)).then((d) => {
          if (hex(new Uint8Array(d)) === m.chunk_sha256[i]) {
            have[i] = 1;
            progress.done += b - a;
            onprogress();
          } else if (++tries[i] >= MAX_CHUNK_TRIES) {
            throw new SliceFetchError(`chunk ${i} failed its SHA-256 ${tries[i]} times; giving up on this server`);
          } else {
            console.warn(`slice ${m.name.slice(0, 12)} chunk ${i} refused (SHA-256 mismatch); fetching it again`);
          }
        }).catch((e) => { failed ??= e; }));
      };
      for (;;) {
        let part;
        try {
          part = await reader.read();
        } catch (e) {
          throw new SliceFetchError(`slice server ${base} broke off: ${e.message}`);
        }
        if (part.done) break;
        if (at + part.value.length > stop) throw new SliceFetchError(`slice server ${base} sent more than ${want}`);
        blob.set(part.value, at);
        at += part.value.length;
        while (next < first + count && span(next)[1] <= at) check(next++);
      }
      if (at !== stop) throw new SliceFetchError(`slice server ${base} sent ${at - start} of ${stop - start} bytes`);
      await Promise.all(checks);
      if (failed) throw failed;
    }
  }
  if (hex(await sha256(blob)) !== m.name) throw new SliceFetchError("the whole slice does not match its SHA-256");
  return blob;
}
