"""The worker's side: the role that accepts plans and serves requests (role), the answers to FFN
requests for the experts and dense-MLP ranges a plan gives it (ffn), and the layer stages it runs
(stages).

May import swarm.compute, swarm.peer.net, swarm.peer.plan and swarm.peer.weights; never
swarm.peer.coordinator.
"""
