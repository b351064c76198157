"""The node agent's protocol (docs/agent-protocol.md): enrolment, heartbeats and job results.

It sits above the apps it calls and calls them in plain sight: marketplace records what the
agent reports, verification says which jobs the node has and judges its runs again when a GPU
UUID conflict opens or closes, routing syncs the node's deployments. No signal carries any of
it.
"""
