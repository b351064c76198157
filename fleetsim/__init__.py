"""Simulated GPU machines with profiles measured on real cards (demo fleet, tests, benchmarks).

- fleetsim.profiles: the measured profiles, the planted-fault profiles (liars) of the
  verification benchmark, and the hardware facts and probe results a simulated machine
  reports (standard library and the agent only, so a simulated agent stays as light as one).
- fleetsim.server: a vLLM- or llama.cpp-shaped OpenAI engine server following a profile.
- fleetsim.fleet: `up`, a whole fleet of engine servers, each with the real node agent.
- fleetsim.machine: a simulated machine handed to the real agent (`agent`): the agent never
  imports fleetsim.

    python -m fleetsim list
    python -m fleetsim serve --profile h200 --port 8101
    python -m fleetsim up --platform http://127.0.0.1:8000 --profiles h200,2x-rtx-4090 \\
        --tokens rse_...,rse_...
    python -m fleetsim up --platform http://127.0.0.1:8000 --planted --tokens rse_...(x14)
    python -m fleetsim agent --profile h200 --machine-id h200-1 facts
"""
