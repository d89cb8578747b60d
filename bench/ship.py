"""Slice shipping speed: HTTPS range requests against the data channel and plain TCP, in one run.

Prints one JSON object. Python ↔ Python runs on a namespace LAN (two network namespaces on
one bridge, a shipper process in one and a fetcher process in the other, as on two machines):

- ``tcp``: the blob's bytes over one plain TCP connection (asyncio streams), nothing checked:
  the ceiling of this machine.
- ``https``: :func:`swarm.peer.weights.slice_http.fetch_https` into the slice cache, every chunk and
  the whole slice checked by SHA-256, the certificate pinned (what a worker does).
- ``channel``: :class:`swarm.peer.weights.shipping_aio.SliceFetcher` over an authenticated aiortc data
  channel (the fallback path, and the only one before).

To the page (``--page``): headless Chromium opens the peer page from a signaling server in this
namespace and receives two slices of the same size, one over HTTPS and one over the data
channel; the time runs from the offer to the last chunk checked (before decoding and the upload
to the GPU). Needs root (namespaces), Chromium and a non-loopback address (WebRTC).

    python3 bench/ship.py [--mib 256] [--channel-mib 64] [--repeat 1] [--page] [--page-mib 48]

MiB/s = MiB moved / seconds from the first request to the last byte checked (cache writes and
hashes included for ``https`` and ``channel``). On a shared machine the wall-clock rate says
how much CPU the other processes left; the CPU seconds per GiB on each side (``https_runs``:
fetcher user and system time, all its threads; the shipper process's time over the same
interval) say what one core of its own would reach: 1024 / (CPU-s/GiB) MiB/s.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

MODEL_HASH = "ab" * 32
KEY_HEX = "00" * 31 + "01"  # both processes hold this swarm key (a benchmark, not a secret)
CHUNK = 1 << 20


def _key():
    from swarm.keys.swarmkey import SwarmKey

    return SwarmKey(bytes.fromhex(KEY_HEX))


def _emit(**obj) -> None:
    print(json.dumps(obj), flush=True)


def _make_link(offerer: bool):
    import numpy as np

    from swarm.peer.net import wire
    from swarm.keys.identity import Identity
    from swarm.peer.net.link import Link, new_peer_connection
    from swarm.peer.net.messages import Hello, NumericBuild

    ident = Identity.generate()
    cert = ident.rtc_certificate()
    pc, channel = new_peer_connection(cert)
    build = NumericBuild(package="bench", numpy=np.__version__, blas="?", arch="?", kernel_dtype="f32")
    hello = Hello(peer_id=ident.peer_id, protocol_version=wire.PROTOCOL_VERSION, build=build, model_hash=None,
                  memory_budget=0, ffn_gflops=0.0, peer_kind="python", adapter_limits={}, adapter_features=(),
                  name="bench")
    return Link(pc, channel, certificate=cert, auth_key=_key().channel_auth_key, local_hello=hello, offerer=offerer)


# -- shipper (namespace 0) ---------------------------------------------------------------------

async def _serve(address: str, mib: int, channel_mib: int) -> None:
    from swarm import paths
    from swarm.peer.weights.shipping import SliceSource
    from swarm.peer.weights.shipping_aio import SliceServer
    from swarm.peer.weights.slice_http import SliceHttpServer
    from swarm.signaling import tls

    blob = os.urandom(mib << 20)
    source = SliceSource()
    manifest = source.offer(blob, {"bench": "https"}, CHUNK)
    small = source.offer(blob[: channel_mib << 20], {"bench": "channel"}, CHUNK)
    cert = tls.load_or_create(paths.config_dir())
    http = SliceHttpServer(source, _key().slice_token_key, cert.ssl_context(), cert.sha256, host=address,
                           addresses=[address])
    await http.start()

    async def tcp_send(reader, writer):
        view = memoryview(blob)
        for at in range(0, len(view), CHUNK):
            writer.write(view[at:at + CHUNK])
            await writer.drain()
        writer.close()

    tcp = await asyncio.start_server(tcp_send, address, 0)
    links = []

    async def control(reader, writer):  # one SDP offer in, the answer out, then the channel ships
        link = _make_link(offerer=False)
        links.append(link)
        offer = json.loads(await reader.readline())["offer"]
        writer.write((json.dumps({"answer": await link.accept_offer(offer)}) + "\n").encode())
        await writer.drain()
        await link.established()
        await link.packets_settled()  # jumbo packets probed
        server = SliceServer(source, MODEL_HASH)
        server.attach(link)
        await server.offer(link, small)

    ctl = await asyncio.start_server(control, address, 0)
    _emit(event="ready", pid=os.getpid(), manifest=manifest.to_json(), https=dataclasses.asdict(http.source_for(manifest)),
          tcp_port=tcp.sockets[0].getsockname()[1], control_port=ctl.sockets[0].getsockname()[1])
    await asyncio.sleep(3600)  # killed by the parent when the fetcher is done


# -- fetcher (namespace 1) ---------------------------------------------------------------------

async def _fetch(ready: dict, address: str, channel: bool = True, repeat: int = 1) -> dict:
    import shutil

    import psutil

    from swarm.peer.net.messages import HttpsSource
    from swarm.peer.weights.shipping import Manifest, SliceCache
    from swarm.peer.weights.shipping_aio import SliceFetcher
    from swarm.peer.weights.slice_http import fetch_https

    manifest = Manifest.from_json(ready["manifest"])
    https = HttpsSource(tuple(ready["https"]["urls"]), ready["https"]["cert_sha256"], ready["https"]["token"])
    out: dict = {"mib": manifest.size / 2**20}
    tmp = Path(tempfile.mkdtemp())

    t = time.perf_counter()
    reader, writer = await asyncio.open_connection(address, ready["tcp_port"])
    got = 0
    while data := await reader.read(1 << 20):
        got += len(data)
    writer.close()
    assert got == manifest.size, (got, manifest.size)
    out["tcp_mib_s"] = round(got / 2**20 / (time.perf_counter() - t), 1)

    shipper = psutil.Process(ready["pid"])  # another network namespace, the same process table
    gib = manifest.size / 2**30
    out["https_runs"] = []
    for _ in range(repeat):
        cache = SliceCache(tmp / "https")
        t, mine, theirs = time.perf_counter(), os.times(), shipper.cpu_times()
        dl = cache.open_download(manifest)
        await fetch_https(dl, https)
        cache.finish(dl)
        wall = time.perf_counter() - t
        mine2, theirs2 = os.times(), shipper.cpu_times()
        out["https_runs"].append({
            "mib_s": round(manifest.size / 2**20 / wall, 1),
            "fetcher_user_s_per_gib": round((mine2.user - mine.user) / gib, 2),
            "fetcher_sys_s_per_gib": round((mine2.system - mine.system) / gib, 2),
            "shipper_cpu_s_per_gib": round((theirs2.user + theirs2.system - theirs.user - theirs.system) / gib, 2),
        })
        shutil.rmtree(cache.root)  # the next run writes a fresh file
    runs = out["https_runs"]
    out["https_mib_s"] = max(r["mib_s"] for r in runs)
    # What the fetcher would reach with a core of its own (this machine may be shared).
    best = min(r["fetcher_user_s_per_gib"] + r["fetcher_sys_s_per_gib"] for r in runs)
    out["https_fetcher_cpu_s_per_gib"] = round(best, 2)
    out["https_mib_per_fetcher_cpu_s"] = round(1024 / best, 1)
    if not channel:
        return out

    link = _make_link(offerer=True)
    reader, writer = await asyncio.open_connection(address, ready["control_port"])
    writer.write((json.dumps({"offer": await link.create_offer()}) + "\n").encode())
    await writer.drain()
    await link.accept_answer(json.loads(await reader.readline())["answer"])
    await link.established()
    await link.packets_settled()  # jumbo packets probed
    fetcher = SliceFetcher(link, MODEL_HASH, SliceCache(tmp / "channel"), use_https=False)
    small = await asyncio.wait_for(fetcher.offers.get(), 30)
    t = time.perf_counter()
    await fetcher.fetch(small)
    out["channel_mib"] = small.size / 2**20
    out["channel_mib_s"] = round(small.size / 2**20 / (time.perf_counter() - t), 1)
    await link.close()
    writer.close()
    return out


# -- parent: the namespace LAN and the page ------------------------------------------------------

def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True)


def python_to_python(mib: int, channel_mib: int, lan: bool = True, repeat: int = 1) -> dict:
    """Shipper and fetcher in two network namespaces joined by a veth pair (a two-machine LAN);
    with ``lan`` False, two processes on 127.0.0.1 (where iproute2 or root is missing)."""
    tag = f"csship-{os.getpid()}"
    ns, addresses = [f"{tag}-a", f"{tag}-b"], ["10.79.0.1", "10.79.0.2"]
    if not lan:
        ns, addresses = [], ["127.0.0.1", "127.0.0.1"]
    def inside(i: int) -> list[str]:
        return ["ip", "netns", "exec", ns[i]] if ns else []

    try:
        for name in ns:
            _ip("netns", "add", name)
        if ns:
            _ip("-n", ns[0], "link", "add", "eth0", "type", "veth", "peer", "name", "eth0", "netns", ns[1])
        for name, address in zip(ns, addresses):
            _ip("-n", name, "addr", "add", f"{address}/24", "dev", "eth0")
            _ip("-n", name, "link", "set", "eth0", "up")
            _ip("-n", name, "link", "set", "lo", "up")
        with tempfile.TemporaryDirectory() as tmp:
            env = {**os.environ, "COLIBRI_SWARM_CONFIG_DIR": tmp, "PYTHONUNBUFFERED": "1"}
            shipper = subprocess.Popen([*inside(0), sys.executable, __file__, "--serve", addresses[0],
                                        "--mib", str(mib), "--channel-mib", str(channel_mib)],
                                       stdout=subprocess.PIPE, text=True, env=env)
            try:
                ready = shipper.stdout.readline()
                if not ready:
                    raise SystemExit("the shipper process ended before it was ready (see its error above)")
                fetched = subprocess.run([*inside(1), sys.executable, __file__, "--fetch", ready, "--address",
                                          addresses[0], "--repeat", str(repeat)]
                                         + (["--no-channel"] if channel_mib == 0 else []),
                                         stdout=subprocess.PIPE, text=True, env=env, check=True, timeout=900)
            finally:
                shipper.terminate()
                shipper.wait(10)
        return json.loads(fetched.stdout)
    finally:
        for name in ns:
            subprocess.run(["ip", "netns", "del", name], capture_output=True)


def to_page(mib: int) -> dict:
    """Two slices of ``mib`` MiB to the page: one over HTTPS, one over the data channel."""
    import numpy as np
    from playwright.sync_api import sync_playwright

    from swarm.peer.weights.slice_http import SliceHttpServer
    from swarm.keys.swarmkey import SwarmKey
    from swarm.signaling import tls
    from tests.browser.conftest import CHROMIUM
    from tests.browser.test_page_e2e import E2E_ARGS, PythonSwarm, _page_url, _wait_state, lan_address

    def q8_slice(seed: int) -> tuple[bytes, dict]:
        # A dense slice of Q8_0 blocks the page keeps as blocks (no decode), ~mib MiB in all.
        h = 4096
        r = max(32, int(mib * 2**20 / 3 / (h / 32 * 34)) // 32 * 32)
        rng = np.random.default_rng(seed)
        tensors, parts, offset = [], [], 0
        for role, shape in (("gate", [r, h]), ("up", [r, h]), ("down", [h, r])):
            blocks = rng.integers(-127, 128, (shape[0] * shape[1] // 32, 34), dtype=np.int8).view(np.uint8)
            blocks[:, :2] = np.frombuffer(np.float16(0.01).tobytes(), np.uint8)  # a finite scale per block
            parts.append(blocks.tobytes())
            tensors.append({"role": role, "encoding": "Q8_0", "shape": shape, "offset": offset, "nbytes": len(parts[-1])})
            offset += len(parts[-1])
        meta = {"version": 1, "format": "gguf", "spec": {"layer": seed, "kind": "dense", "start": 0, "stop": r},
                "tensors": tensors}
        return b"".join(parts), meta

    with tempfile.TemporaryDirectory() as tmp:
        swarm = PythonSwarm(Path(tmp), SwarmKey(os.urandom(32)), lan_address())
        cert = tls.load_or_create(Path(tmp))

        async def start_http():
            http = SliceHttpServer(swarm.source, swarm.key.slice_token_key, cert.ssl_context(), cert.sha256,
                                   host=swarm.address, addresses=[swarm.address])
            await http.start()
            return http

        http = swarm.call(start_http())
        out: dict = {}
        try:
            with sync_playwright() as p:
                browser = p.chromium.launch(executable_path=CHROMIUM, args=E2E_ARGS)
                page = browser.new_context(ignore_https_errors=True).new_page()
                page.goto(_page_url(swarm, swarm.key.code, "bench"))
                _wait_state(page, "authenticated")
                while (link := swarm.browser_link()) is None:  # the page may know before this side does
                    time.sleep(0.05)
                for path, seed in (("https", 1), ("channel", 2)):
                    blob, meta = q8_slice(seed)
                    manifest = swarm.source.offer(blob, meta, chunk_size=CHUNK)
                    offer = http.source_for(manifest) if path == "https" else None
                    t = time.perf_counter()
                    swarm.call(swarm.slices.offer(link, manifest, offer))
                    page.wait_for_function(f"""(() => {{ const d = window.colibri.worker.downloads.get("{manifest.hex_id}");
                        return d && d.done === d.total; }})()""", polling=20, timeout=600_000)
                    dt = time.perf_counter() - t
                    out[f"page_{path}_mib_s"] = round(len(blob) / 2**20 / dt, 1)
                    out["page_mib"] = round(len(blob) / 2**20, 1)
                stats = page.evaluate("window.colibri.worker.stats")
                assert stats["httpsBytes"] > 0 and stats["channelFallbacks"] == 0, stats
                browser.close()
        finally:
            swarm.call(http.close())
            swarm.stop()
        return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--mib", type=int, default=256, help="slice size for tcp and https (MiB)")
    ap.add_argument("--channel-mib", type=int, default=64, help="slice size for the data channel (MiB; 0: skip it)")
    ap.add_argument("--repeat", type=int, default=1, help="HTTPS transfers of the slice, one after another")
    ap.add_argument("--loopback", action="store_true", help="two processes on 127.0.0.1 instead of namespaces")
    ap.add_argument("--page", action="store_true", help="also measure to the page in headless Chromium")
    ap.add_argument("--page-mib", type=int, default=48, help="slice size to the page (MiB)")
    ap.add_argument("--serve", metavar="ADDRESS", help=argparse.SUPPRESS)
    ap.add_argument("--fetch", metavar="READY_JSON", help=argparse.SUPPRESS)
    ap.add_argument("--address", help=argparse.SUPPRESS)
    ap.add_argument("--no-channel", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.serve:
        asyncio.run(_serve(args.serve, args.mib, args.channel_mib))
        return
    if args.fetch:
        print(json.dumps(asyncio.run(_fetch(json.loads(args.fetch), args.address, not args.no_channel, args.repeat))))
        return
    result = {"cpus": os.cpu_count(), "load_1min": round(os.getloadavg()[0], 2),
              "python_to_python": python_to_python(args.mib, args.channel_mib, not args.loopback, args.repeat),
              "between": "127.0.0.1, two processes" if args.loopback else "two network namespaces, veth"}
    if args.page:
        result["to_page"] = to_page(args.page_mib)
    result["load_1min_after"] = round(os.getloadavg()[0], 2)
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
