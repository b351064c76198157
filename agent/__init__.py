"""Rigshare node agent: runs next to a provider's engine and reports to the platform.

It imports only the standard library, httpx and pynvml (and cryptography, to make the
engine's TLS certificate), so a provider installs it and nothing of the platform: the platform
serves it as a wheel (marketplace/agent_wheel.py, the command is on the Add-machine page). The verification probes load torch lazily
when the platform asks for them (a provider installs a CUDA build of torch for that); without
it they answer "no GPU". See docs/agent-protocol.md.
"""

__version__ = "0.1.0"
