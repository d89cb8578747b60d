"""Fixtures for browser tests: web_peer/ served on http://localhost (a secure context, so WebGPU and
WebCrypto exist) and Debian's headless Chromium with a SwiftShader WebGPU adapter, via Playwright."""

from __future__ import annotations

import base64
import functools
import http.server
import os
import threading
from pathlib import Path

import numpy as np
import pytest

from tests.conftest import require

WEB_PEER = Path(__file__).resolve().parents[2] / "web_peer"
CHROMIUM = "/usr/bin/chromium"
# Headless WebGPU on a machine without a GPU: Vulkan through SwiftShader (no shader-f16; every weight format).
CHROMIUM_ARGS = [
    "--enable-unsafe-webgpu", "--enable-features=Vulkan", "--use-vulkan=swiftshader",
    "--use-webgpu-adapter=swiftshader", "--use-angle=swiftshader", "--disable-vulkan-surface",
    "--no-sandbox",
]


BLANK = "/__test__.html"  # an empty document of the web_peer origin (not the peer page, which would join)


class _Quiet(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args):
        pass

    def do_GET(self):
        if self.path == BLANK:
            body = b"<!doctype html><meta charset=utf-8><title>web_peer test</title>"
            self.send_response(200)
            self.send_header("Content-Type", "text/html; charset=utf-8")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)
            return
        super().do_GET()


@pytest.fixture(scope="session")
def web_peer_url():
    """http://localhost:PORT/ serving web_peer/ (static files only)."""
    handler = functools.partial(_Quiet, directory=str(WEB_PEER))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://localhost:{server.server_address[1]}/"
    server.shutdown()
    server.server_close()
    thread.join()


@pytest.fixture(scope="package")
def playwright():
    """The one Playwright driver of tests/browser (two sync drivers cannot run in one thread).

    Package scope, not session: the sync driver keeps an asyncio loop marked running on this
    thread, which would break every pytest-asyncio test collected after tests/browser."""
    require(os.path.exists(CHROMIUM), "Debian's Chromium at /usr/bin/chromium (apt install chromium)")
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        require(False, "playwright (pip install -e '.[test]')")
    with sync_playwright() as p:
        yield p


@pytest.fixture(scope="package")
def chromium(playwright):
    """A headless Chromium (Debian's, never a downloaded one) with a SwiftShader WebGPU adapter."""
    browser = playwright.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
    yield browser
    browser.close()


@pytest.fixture
def page(chromium, web_peer_url):
    """A fresh page on the web_peer origin, with the kernel modules importable by path."""
    ctx = chromium.new_context()
    pg = ctx.new_page()
    errors: list[str] = []
    pg.on("pageerror", lambda e: errors.append(str(e)))
    pg.goto(web_peer_url.rstrip("/") + BLANK)
    yield pg
    ctx.close()
    assert not errors, f"uncaught errors in the page: {errors}"


def b64(a: np.ndarray) -> str:
    """Little-endian bytes of an array as base64, for page.evaluate arguments."""
    return base64.b64encode(np.ascontiguousarray(a).tobytes()).decode()


def unb64(s: str, dtype) -> np.ndarray:
    return np.frombuffer(base64.b64decode(s), dtype)


def ffn_block(rng, t, h, f):
    """A random SwiGLU FFN block: ``x`` [t, h], ``wg``/``wu`` [f, h], ``wd`` [h, f], float32, fan-in scaled."""
    x = rng.standard_normal((t, h)).astype(np.float32)
    wg = (rng.standard_normal((f, h)) / np.sqrt(h)).astype(np.float32)
    wu = (rng.standard_normal((f, h)) / np.sqrt(h)).astype(np.float32)
    wd = (rng.standard_normal((h, f)) / np.sqrt(f)).astype(np.float32)
    return x, wg, wu, wd


def rel_error(got, ref):
    """max |got - ref| / max |ref|, in float64."""
    return float(np.abs(np.asarray(got, np.float64) - ref).max() / np.abs(ref).max())
