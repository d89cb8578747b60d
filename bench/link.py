"""Benchmark one authenticated data-channel link against plain TCP, on this machine.

Prints one JSON object: connection set-up ms (ICE + DTLS + SCTP + channel auth + hello),
round-trip ms for 4 KiB and 64 KiB messages (median, p99), bulk MiB/s over one data channel,
the same RTTs and bulk over plain TCP (asyncio streams), the ratio, and a profile of the
sending side during bulk (where the time goes).

Two processes: this one and an echo/sink peer started with multiprocessing, so each side has
its own core, as on two machines. aioice skips 127.0.0.1: run it where another local address
exists (any LAN address; or inside a network namespace with an extra /32 on ``lo``).

    python3 bench/link.py [--bulk-mib 64] [--rounds 200] [--setups 5]

The message-size sweep (``rtt_by_size``: 1 KiB to 18 KiB; 2.25 KiB is one 576-float32 row)
gives the median round trip of an echoed message and the CPU milliseconds both processes spent
per round trip, the number a loaded machine distorts least.

Where the time goes: aiortc's SCTP is pure Python, with a fixed cost per packet on both sides
(``_transmit`` → serialize → pyOpenSSL DTLS → sendto; recvfrom → DTLS → parse → SACK). The
link runs with swarm.peer.net.rtc's tuning: both ends are Python peers, so jumbo packets of
16356 bytes of user data (one DTLS record and UDP datagram each, IP-fragmented on the LAN; with
a browser, 1356 bytes within the MTU), a SACK for every second jumbo packet, and a whole message
sent at once within the congestion window. The JSON reports µs per packet and the
sender's top functions by own time.
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import io
import json
import multiprocessing as mp
import os
import pstats
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import hashlib  # noqa: E402

import numpy as np  # noqa: E402

from swarm.peer.net import rtc, wire  # noqa: E402
from swarm.keys.identity import Identity  # noqa: E402
from swarm.peer.net.link import Link, new_peer_connection  # noqa: E402
from swarm.peer.net.messages import Hello, NumericBuild, WeightChunk  # noqa: E402
from swarm.keys.swarmkey import SwarmKey  # noqa: E402

KEY = SwarmKey(bytes(range(32)))  # both processes must hold the same swarm key
RAW_CHANNEL_ID = 2
CHUNK = 256 << 10  # bytes per bulk message: the aiortc max-message-size, one frame each


def _make_link(offerer: bool) -> Link:
    identity = Identity.generate()  # a Python peer's id is the hash of its certificate key
    cert = identity.rtc_certificate()
    pc, channel = new_peer_connection(cert)
    build = NumericBuild(package="bench", numpy=np.__version__, blas="?", arch="?", kernel_dtype="f32")
    hello = Hello(peer_id=identity.peer_id, protocol_version=wire.PROTOCOL_VERSION, build=build, model_hash=None,
                  memory_budget=0, ffn_gflops=0.0, peer_kind="python", adapter_limits={}, adapter_features=(),
                  name="bench")
    link = Link(pc, channel, certificate=cert, auth_key=KEY.channel_auth_key, local_hello=hello, offerer=offerer)
    # a second, raw channel on the same connection: RTT without the wire codec, to split the cost
    link.raw = pc.createDataChannel("raw", negotiated=True, id=RAW_CHANNEL_ID)  # type: ignore[attr-defined]
    return link


def _blob(data: bytes) -> WeightChunk:
    """Bytes in a wire message (a weight chunk is what bulk transfers carry in the swarm)."""
    return WeightChunk(request_id=1, model_hash="0" * 64, name="bench", offset=0,
                       sha256=hashlib.sha256(data).hexdigest(), data=np.frombuffer(data, np.uint8))


# -- the remote side (child process) -----------------------------------------------------------

def _remote_main(conn, tcp_port_q, cpu: int | None) -> None:
    if cpu is not None:
        os.sched_setaffinity(0, {cpu})
    asyncio.run(_remote(conn, tcp_port_q))


async def _remote(conn, tcp_port_q) -> None:
    loop = asyncio.get_running_loop()
    server = await asyncio.start_server(_tcp_echo, "127.0.0.1", 0)
    tcp_port_q.put(server.sockets[0].getsockname()[1])
    while True:
        offer = await loop.run_in_executor(None, conn.recv)
        if offer is None:
            break
        link = _make_link(offerer=False)
        answer = await link.accept_offer(offer)
        conn.send(answer)
        await link.established()
        await link.packets_settled()  # jumbo packets probed

        async def echo(lk, message):
            tag = bytes(message.data[:1])
            if tag == b"E":
                await lk.send(message)
            elif tag == b"C":  # this process's CPU seconds so far, for CPU per message
                await lk.send(_blob(b"C" + repr(time.process_time()).encode()))
            elif tag == b"D":  # end of bulk: report bytes received
                await lk.send(_blob(b"R" + str(received[0]).encode()))
                received[0] = 0
            else:
                received[0] += len(message.data)

        received = [0]
        link.on(WeightChunk, echo)
        link.raw.on("message", lambda data, raw=link.raw: raw.send(data))
        await loop.run_in_executor(None, conn.recv)  # "done with this link"
        await link.close()
    server.close()


async def _tcp_echo(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        while True:
            head = await reader.readexactly(5)
            n = int.from_bytes(head[1:], "little")
            body = await reader.readexactly(n)
            if head[:1] == b"E":
                writer.write(head + body)
            elif head[:1] == b"D":
                writer.write(b"R" + (0).to_bytes(4, "little"))
            await writer.drain()
    except asyncio.IncompleteReadError:
        writer.close()
    except asyncio.CancelledError:
        # Shutdown while a connection is still open: end quietly (Python 3.11's stream callback
        # logs a traceback for a handler task that ends cancelled).
        writer.close()


# -- measurements ------------------------------------------------------------------------------

def _ms_stats(samples: list[float]) -> dict:
    s = sorted(samples)
    return {"median_ms": round(statistics.median(s) * 1e3, 3), "p99_ms": round(s[int(0.99 * (len(s) - 1))] * 1e3, 3)}


async def _connect(conn) -> tuple[Link, float]:
    loop = asyncio.get_running_loop()
    t0 = time.perf_counter()
    link = _make_link(offerer=True)
    conn.send(await link.create_offer())
    await link.accept_answer(await loop.run_in_executor(None, conn.recv))
    await link.established()
    await link.packets_settled()  # jumbo packets probed
    return link, time.perf_counter() - t0


async def _link_rtt(link: Link, size: int, rounds: int) -> list[float]:
    message = _blob(b"E" + os.urandom(size - 1))
    out = []
    for _ in range(rounds):
        t = time.perf_counter()
        await link.send(message)
        await link.receive()
        out.append(time.perf_counter() - t)
    return out


async def _remote_cpu(link: Link) -> float:
    await link.send(_blob(b"C"))
    return float(bytes((await link.receive()).data[1:]))


async def _size_sweep(link: Link, sizes_kib: list[float], rounds: int) -> list[dict]:
    """Round trip and CPU per echoed message (both processes) by message size."""
    packet = _sctp_user_data(link)
    rows = []
    for kib in sizes_kib:
        size = int(kib * 1024)
        await _link_rtt(link, size, 5)  # warm the congestion window
        cpu_remote, cpu_local = await _remote_cpu(link), time.process_time()
        samples = await _link_rtt(link, size, rounds)
        cpu_local = time.process_time() - cpu_local
        cpu_remote = await _remote_cpu(link) - cpu_remote
        rows.append({"kib": kib, **_ms_stats(samples),
                     "data_packets_each_way": -(-(size + 200) // packet),  # + frame header and metadata
                     "cpu_ms_per_round_trip_local": round(cpu_local / rounds * 1e3, 3),
                     "cpu_ms_per_round_trip_remote": round(cpu_remote / rounds * 1e3, 3)})
    return rows


def _sctp_user_data(link: Link) -> int:
    """User data bytes in one SCTP packet of this link (jumbo between Python peers: rtc.py)."""
    return rtc.userdata_length(link.sctp_packet_length)


async def _raw_rtt(channel, size: int, rounds: int) -> list[float]:
    replies: asyncio.Queue[bytes] = asyncio.Queue()
    channel.on("message", replies.put_nowait)
    payload = os.urandom(size)
    out = []
    for _ in range(rounds):
        t = time.perf_counter()
        channel.send(payload)
        await replies.get()
        out.append(time.perf_counter() - t)
    return out


async def _link_bulk(link: Link, total: int, profile: bool) -> tuple[float, str]:
    payload = b"B" + os.urandom(CHUNK - 1 - 512)  # leaves room for the frame header and metadata
    message = _blob(payload)
    prof = cProfile.Profile() if profile else None
    t = time.perf_counter()
    if prof:
        prof.enable()
    for _ in range(total // len(payload)):
        await link.send(message)
    await link.send(_blob(b"D"))
    reply = await link.receive()
    if prof:
        prof.disable()
    dt = time.perf_counter() - t
    sent = total // len(payload) * len(payload)
    assert int(bytes(reply.data[1:])) == sent, (reply.data, sent)
    text = ""
    if prof:
        buf = io.StringIO()
        pstats.Stats(prof, stream=buf).sort_stats("tottime").print_stats(12)
        text = buf.getvalue()
    return sent / dt / 2**20, text


async def _tcp(port: int, rounds: int, total: int) -> dict:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)

    async def rtt(size: int) -> list[float]:
        body = os.urandom(size)
        out = []
        for _ in range(rounds):
            t = time.perf_counter()
            writer.write(b"E" + size.to_bytes(4, "little") + body)
            await writer.drain()
            await reader.readexactly(5 + size)
            out.append(time.perf_counter() - t)
        return out

    r4, r64 = await rtt(4096), await rtt(65536)
    body = os.urandom(CHUNK)
    t = time.perf_counter()
    for _ in range(total // CHUNK):
        writer.write(b"B" + CHUNK.to_bytes(4, "little") + body)
        await writer.drain()
    writer.write(b"D" + (0).to_bytes(4, "little"))
    await writer.drain()
    await reader.readexactly(5)
    mib_s = total // CHUNK * CHUNK / (time.perf_counter() - t) / 2**20
    writer.close()
    return {"rtt_4k": _ms_stats(r4), "rtt_64k": _ms_stats(r64), "bulk_mib_s": round(mib_s, 1)}


async def _main(args, conn, tcp_port: int) -> dict:
    setups = []
    for _ in range(args.setups - 1):
        link, dt = await _connect(conn)
        setups.append(dt)
        await link.close()
        conn.send("next")
    link, dt = await _connect(conn)
    setups.append(dt)
    sweep = await _size_sweep(link, args.sizes_kib, args.rounds)
    if args.sweep_only:
        await link.close()
        conn.send("next")
        conn.send(None)
        return {"rtt_by_size": sweep, "sctp_user_data_per_packet": _sctp_user_data(link)}
    r4 = await _link_rtt(link, 4096, args.rounds)
    r4_raw = await _raw_rtt(link.raw, 4096, args.rounds)
    r64 = await _link_rtt(link, 65536, args.rounds)
    bulk, _ = await _link_bulk(link, args.bulk_mib << 20, profile=False)
    _, profile = await _link_bulk(link, min(args.bulk_mib, 16) << 20, profile=True)
    packet = _sctp_user_data(link)
    await link.close()
    conn.send("next")
    tcp = await _tcp(tcp_port, args.rounds, args.bulk_mib << 20)
    conn.send(None)
    return {
        "datachannel": {
            "setup_ms": {"median_ms": round(statistics.median(setups) * 1e3, 1), "runs": len(setups)},
            "rtt_4k": _ms_stats(r4), "rtt_4k_raw_channel_no_codec": _ms_stats(r4_raw),
            "rtt_64k": _ms_stats(r64), "rtt_by_size": sweep, "bulk_mib_s": round(bulk, 1),
            "sctp_user_data_per_packet": packet,
            "us_per_sctp_packet": round(1e6 / (bulk * 2**20 / packet), 1),
        },
        "tcp": tcp,
        "bulk_ratio_to_tcp": round(bulk / tcp["bulk_mib_s"], 4),
        "sender_profile_top": [ln for ln in profile.splitlines() if ln.strip()][:24],
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--bulk-mib", type=int, default=64)
    p.add_argument("--rounds", type=int, default=200)
    p.add_argument("--setups", type=int, default=5)
    p.add_argument("--sizes-kib", type=float, nargs="+", default=[1, 2.25, 4.5, 9, 18],
                   help="message sizes for the round-trip sweep (KiB; 2.25 = one 576-float32 row)")
    p.add_argument("--sweep-only", action="store_true", help="only the message-size sweep")
    p.add_argument("--pin", action="store_true",
                   help="pin this process to the first CPU and the remote to the second, as on two machines")
    args = p.parse_args()
    cpus = sorted(os.sched_getaffinity(0))[:2] if args.pin else None
    if cpus is not None:
        if len(cpus) < 2:
            p.error("--pin needs two CPUs")
        os.sched_setaffinity(0, {cpus[0]})
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    port_q = ctx.Queue()
    proc = ctx.Process(target=_remote_main, args=(child, port_q, cpus[1] if cpus else None), daemon=True)
    proc.start()
    try:
        result = asyncio.run(_main(args, parent, port_q.get(timeout=30)))
    finally:
        proc.join(timeout=10)
        if proc.is_alive():
            proc.terminate()
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
