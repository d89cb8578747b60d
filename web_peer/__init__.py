"""The browser peer: static ES modules, WGSL kernels and the peer page, served by the signaling server.

This file only makes the folder importable so ``importlib.resources.files("web_peer")`` finds the
assets in an installed package.
"""
