"""Peer-to-peer transport: frames (wire), typed messages (schema, messages), key proofs (auth),
one authenticated WebRTC link (link_protocol, link, rtc, eager) and the set of links to every
peer (mesh).

Imports only swarm.errors, swarm.paths, swarm.keys, swarm.signaling and the libraries below
them; nothing here knows about roles, plans or weights.
"""
