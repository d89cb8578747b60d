"""Weight slices and their transfer, used by both roles: cutting a model file into the ranges
a plan assigns (slices, repack), the chunked, hashed transfer protocol (shipping) and its
transports over a data channel (shipping_aio) or HTTPS (slice_http).

May import swarm.compute, swarm.peer.net, swarm.peer.memory and the model shape of
swarm.peer.coordinator.planner; nothing else of either role.
"""
