"""Simulated GPU machines with profiles measured on real cards (demo fleet, tests, benchmarks).

- fleetsim.profiles: the measured profiles, the planted-fault profiles (liars) of the
  verification benchmark, and the hardware facts and probe results a simulated agent reports
  (standard library only: the node agent imports it).
- fleetsim.server: a vLLM- or llama.cpp-shaped OpenAI engine server following a profile.
- fleetsim.fleet: `up`, a whole fleet of engine servers, each with the real node agent.

    python -m fleetsim list
    python -m fleetsim serve --profile h200 --port 8101
    python -m fleetsim up --platform http://127.0.0.1:8000 --profiles h200,2x-rtx-4090 \\
        --tokens rse_...,rse_...
    python -m fleetsim up --platform http://127.0.0.1:8000 --planted --tokens rse_...(x14)
"""
