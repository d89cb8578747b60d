"""Coordinator election: Raft's leader election over the mesh's links (core).

Imports only swarm.errors and the standard library; the role driver that feeds it messages and
timers lives in swarm.peer.roles.
"""
