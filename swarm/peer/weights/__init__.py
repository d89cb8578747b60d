"""Weight slices and their transfer, used by both roles: cutting a model file into the ranges
a plan assigns (slices, repack), a model file's sizes for the planner (sizes), the chunked, hashed
transfer protocol (shipping) and its transports over a data channel (shipping_aio) or HTTPS
(slice_http).

May import swarm.compute, swarm.peer.net, swarm.peer.memory and swarm.peer.plan; nothing of either
role.
"""
