"""Coordinator election: Raft's leader election over the mesh's links (core, sans-I/O: imports
only swarm.errors and the standard library) and the driver that feeds it the links' messages,
liveness and timers (driver).
"""
