import json


def read_events(response) -> tuple[list[dict], bool]:
    """The JSON events of an SSE response and whether it ended with `data: [DONE]`."""
    events, done = [], False
    for line in response.iter_lines():
        if not line:
            continue
        assert line.startswith("data: "), line
        payload = line[len("data: "):]
        if payload == "[DONE]":
            done = True
            continue
        assert not done, "nothing may follow [DONE]"
        events.append(json.loads(payload))
    return events, done


def stream_text(events: list[dict]) -> str:
    out = []
    for e in events:
        for choice in e["choices"]:
            out.append(choice.get("text") or (choice.get("delta") or {}).get("content") or "")
    return "".join(out)
