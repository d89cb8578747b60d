"""Keys: the swarm key and the sub-keys derived from it (swarmkey), and this device's long-term
key, DTLS certificate and peer id (identity).

Imports only swarm.errors, swarm.paths and cryptography; signaling, the peer and the peer
page's helpers all build on it.
"""
