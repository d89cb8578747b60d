"""The coordinator's side: the role that plans and dispatches while this peer coordinates (role),
the planner and its cost model, dispatch of FFN rows to workers (dispatch, stages' coordinator
side), and what it serves: the OpenAI API (api, api_tls) and the dashboard.

May import swarm.compute, swarm.peer.net, swarm.peer.plan and swarm.peer.weights; never
swarm.peer.worker.
"""
