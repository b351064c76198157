"""Rigshare node agent: runs next to a provider's engine and reports to the platform.

It imports only the standard library, httpx and pynvml, so a provider installs it with
`pip install .[agent]` and nothing of the platform. See docs/agent-protocol.md.
"""

__version__ = "0.1.0"
