"""swarm.discovery"""
