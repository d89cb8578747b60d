"""The worker's side: answering FFN requests for the experts and dense-MLP ranges a plan gives
it (ffn).

May import swarm.compute, swarm.peer.net, swarm.peer.weights and the plan types of
swarm.peer.coordinator.planner; never the coordinator's dispatch or API.
"""
