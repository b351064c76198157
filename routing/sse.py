"""The engine's server-sent events as the relay passes them on: cut only at event boundaries,
parsed only as far as billing needs. The usage chunk is kept (and dropped again if the client
did not ask for it); the content chunks are counted (each engine streams one token per chunk:
what a cut stream is billed for); the model id is rewritten to the public name, and an event
that carries an engine's own fields is rewritten with OpenAI's alone (routing/answers.py)."""

import json
import re
from dataclasses import dataclass

from routing import answers

_EVENT_END = re.compile(rb"\r\n\r\n|\n\n")
# A chunk that carries text: a chat delta's content or a completion's text, not empty.
_CONTENT = re.compile(rb'"(?:content|text)":\s?"(?!")')


@dataclass
class StreamState:
    include_usage: bool
    model_from: tuple[bytes, bytes]
    model_to: tuple[bytes, bytes]
    buf: bytes = b""
    delivered: int = 0
    usage: dict | None = None
    done: bool = False

    def feed(self, data: bytes) -> bytes:
        buf = self.buf + data if self.buf else data
        if b"\r" in buf:  # CRLF line ends (no engine we know sends them, but SSE allows them)
            return self._feed_crlf(buf)
        end = buf.rfind(b"\n\n") + 2
        if end == 1:  # no whole event yet
            self.buf = buf
            return b""
        self.buf = buf[end:]
        if buf.find(b"\n\n") + 2 == end:  # the usual case: one event
            return self._event(buf[:end] if end < len(buf) else buf)
        out, start = [], 0
        while start < end:
            stop = buf.index(b"\n\n", start) + 2
            out.append(self._event(buf[start:stop]))
            start = stop
        return b"".join(out)

    def _feed_crlf(self, buf: bytes) -> bytes:
        out = []
        while (end := _EVENT_END.search(buf)) is not None:
            out.append(self._event(buf[:end.end()]))
            buf = buf[end.end():]
        self.buf = buf
        return b"".join(out)

    def _event(self, event: bytes) -> bytes:
        if event.startswith(b"data: [DONE]"):
            self.done = True
            return event
        if b'"choices":[]' in event or b'"choices": []' in event:
            # The usage chunk (the only one with no choices).
            try:
                usage = json.loads(event[event.index(b"{"):]).get("usage")
            except ValueError:
                usage = None
            if usage:
                self.usage = usage
                if not self.include_usage:
                    return b""
                return self._normalized(event)
        elif _CONTENT.search(event):
            self.delivered += 1
        if answers.needs_normalizing(event):
            return self._normalized(event)
        for old, new in zip(self.model_from, self.model_to, strict=True):
            event = event.replace(old, new, 1)
        return event

    def _normalized(self, event: bytes) -> bytes:
        try:
            chunk = json.loads(event[event.index(b"{"):])
        except ValueError:
            return event  # not JSON: passed on as the engine sent it
        if not isinstance(chunk, dict):
            return event
        chunk = answers.normalize(chunk)
        if "model" in chunk:
            chunk["model"] = json.loads(self.model_to[0].partition(b":")[2])
        end = b"\r\n\r\n" if event.endswith(b"\r\n\r\n") else b"\n\n"
        return b"data: " + json.dumps(chunk, separators=(",", ":")).encode() + end


def model_patterns(name: str) -> tuple[bytes, bytes]:
    quoted = json.dumps(name).encode()
    return b'"model":' + quoted, b'"model": ' + quoted
