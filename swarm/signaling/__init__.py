"""swarm.signaling"""
