"""swarm.compute"""
