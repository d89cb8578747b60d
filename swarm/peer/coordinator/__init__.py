"""The coordinator's side: the role's life cycle and membership while this peer coordinates
(role); the next plan (planning: layout and the cost model's inputs; planner and costmodel:
placement and prices) and its hand-out (announce); dispatch of work to workers (dispatch: FFN
ranges, stages: layer stages, both on the request tracker's rule, tracker; stage_verify:
--verify on stage answers; handoff: the token-loop thread to the event loop); and what it
serves: the OpenAI API (api, api_request, api_engine, api_tls, api_host) and the dashboard.

May import swarm.compute, swarm.peer.net, swarm.peer.plan and swarm.peer.weights; never
swarm.peer.worker.
"""
