"""swarm.peer"""
