"""A simulated machine handed to the real node agent.

`python -m fleetsim agent --profile KEY --machine-id ID COMMAND ...` runs the agent's COMMAND
(`run`, `facts`, `probe`, `enroll`) with a `SimulatedMachine` in place of this computer: the
heartbeat's hardware facts and the probe results come from the profile, faults included;
everything else (engine status, heartbeats, jobs) is the agent's own code. The agent never
imports fleetsim: fleetsim imports the agent and hands it the machine.
"""

from agent import hardware
from fleetsim.profiles import get_profile, simulated_facts, simulated_probe_results


class SimulatedMachine:
    """`agent.hardware.Machine` for one simulated machine. Raises KeyError (naming the known
    profiles) for an unknown profile."""

    def __init__(self, profile_key: str, machine_id: str):
        self.profile = get_profile(profile_key)
        self.machine_id = machine_id

    def hostname(self) -> str:
        return self.machine_id  # simulated machines share one host: ids tell them apart

    def facts(self) -> tuple[dict, str | None]:
        facts = simulated_facts(self.profile.key, self.machine_id)
        return {"os": hardware.host_os(), **facts, "simulated": True}, None

    def probes(self, params: dict, *, device: str | None = None, log=None) -> dict:
        return simulated_probe_results(self.profile.key, self.machine_id, params or {})
