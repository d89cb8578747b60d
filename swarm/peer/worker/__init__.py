"""The worker's side: the role that accepts plans and serves requests (role), and the answers to
FFN requests for the experts and dense-MLP ranges a plan gives it (ffn).

May import swarm.compute, swarm.peer.net, swarm.peer.weights, the plan types of
swarm.peer.coordinator.planner and the stage types of swarm.peer.coordinator.stages; never the
coordinator's dispatch, API or role.
"""
