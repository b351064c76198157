"""The relay's event parser (routing/sse.py): whole events out, however the engine's bytes
were cut, with the usage chunk taken (and dropped unless asked for), content chunks counted and
the engine's model id replaced by the public name."""

import json

import pytest

from routing.sse import StreamState, model_patterns


def _chunk(content, model="Qwen/Qwen3-27B", sep=b"\n\n"):
    body = {"id": "c1", "object": "chat.completion.chunk", "model": model,
            "choices": [{"index": 0, "delta": {"content": content}, "finish_reason": None}]}
    return b"data: " + json.dumps(body).encode() + sep


def _usage(sep=b"\n\n"):
    body = {"id": "c1", "object": "chat.completion.chunk", "model": "Qwen/Qwen3-27B",
            "choices": [], "usage": {"prompt_tokens": 11, "completion_tokens": 3,
                                     "total_tokens": 14}}
    return b"data: " + json.dumps(body).encode() + sep


def _stream(sep=b"\n\n"):
    return (_chunk("", sep=sep) + _chunk("Hel", sep=sep) + _chunk("lo", sep=sep)
            + _chunk("!", sep=sep) + _usage(sep) + b"data: [DONE]" + sep)


def _state(include_usage):
    return StreamState(include_usage, model_patterns("Qwen/Qwen3-27B"),
                        model_patterns("qwen3-27b"))


def _events(out: bytes, sep=b"\n\n"):
    return [e for e in out.split(sep) if e]


@pytest.mark.parametrize("sep", [b"\n\n", b"\r\n\r\n"])
@pytest.mark.parametrize("include_usage", [True, False])
def test_every_cut_of_the_stream_gives_the_same_events(sep, include_usage):
    raw = _stream(sep)
    whole = _state(include_usage)
    expected = whole.feed(raw)
    assert whole.done and whole.delivered == 3 and whole.buf == b""
    assert whole.usage == {"prompt_tokens": 11, "completion_tokens": 3, "total_tokens": 14}
    events = _events(expected, sep)
    assert len(events) == (6 if include_usage else 5)
    assert all(json.loads(e[6:])["model"] == "qwen3-27b" for e in events[:-1])
    assert b"Qwen/Qwen3-27B" not in expected
    for cut in range(1, len(raw)):
        for second_cut in (cut, min(len(raw), cut + 7), min(len(raw), cut + 150)):
            state = _state(include_usage)
            out = state.feed(raw[:cut]) + state.feed(raw[cut:second_cut]) \
                + state.feed(raw[second_cut:])
            assert out == expected, (cut, second_cut)
            assert (state.delivered, state.done) == (3, True)


def test_a_partial_event_waits_for_its_end():
    state = _state(True)
    first = _chunk("Hi")
    assert state.feed(first[:-1]) == b""
    assert state.delivered == 0
    assert state.feed(first[-1:]).startswith(b"data: ")
    assert state.delivered == 1


def test_the_public_model_name_replaces_only_the_model_field():
    state = _state(True)
    out = state.feed(_chunk('about "model": "Qwen/Qwen3-27B" in text'))
    assert out.count(b"qwen3-27b") == 1
    assert b'\\"model\\": \\"Qwen/Qwen3-27B\\"' in out  # the text itself is left alone
