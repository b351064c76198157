"""Rigshare node agent: runs next to a provider's engine and reports to the platform.

It imports only the standard library, httpx and pynvml, so a provider installs it with
`pip install .[agent]` and nothing of the platform. The verification probes load torch lazily
when the platform asks for them (a provider installs a CUDA build of torch for that); without
it they answer "no GPU". See docs/agent-protocol.md.
"""

__version__ = "0.1.0"
