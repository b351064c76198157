"""The answer-fingerprint arithmetic (verification/fingerprint.py), with plain values."""

from verification import fingerprint as fp


def answer(prompt: str, tokens: list[str], logprobs: list[float] | None = None) -> dict:
    return {"prompt": prompt, "text": "".join(tokens), "tokens": tokens,
            "logprobs": logprobs if logprobs is not None else [-0.1] * len(tokens)}


BASE = [answer(p, [f"{i}-{k}" for k in range(12)]) for i, p in enumerate(fp.CANARIES)]


def test_the_same_answers_agree_and_a_late_flip_is_forgiven():
    assert fp.match(BASE, BASE) == fp.Match(True, len(fp.CANARIES), len(fp.CANARIES))
    # An honest machine whose kernels flip a token near the end of every answer.
    late = [answer(a["prompt"], a["tokens"][:9] + ["other"] * 3) for a in BASE]
    assert fp.match(late, BASE).matches


def test_other_weights_answer_otherwise_from_the_start_or_in_their_confidence():
    other = [answer(a["prompt"], ["x"] + a["tokens"][1:]) for a in BASE]
    assert not fp.match(other, BASE).matches
    # The same words, said with other confidence: another model's logits.
    unsure = [answer(a["prompt"], a["tokens"], [-2.5] * 12) for a in BASE]
    assert not fp.match(unsure, BASE).matches
    assert fp.agreement(unsure[0], BASE[0]).logprob_gap == 2.4


def test_text_alone_where_the_engine_gives_no_tokens():
    said = [{"prompt": a["prompt"], "text": "Paris is the capital.", "tokens": [],
             "logprobs": []} for a in BASE]
    other = [{**a, "text": "Lyon, of course."} for a in said]
    assert fp.match(said, said).matches and not fp.match(other, said).matches


def test_the_verdict_against_peers():
    other = [answer(a["prompt"], ["x"] * 12) for a in BASE]
    assert fp.judge(BASE, [BASE, BASE]).severity == "ok"
    assert fp.judge(other, [BASE, BASE]) == fp.Verdict("mismatch", 0, 2)
    assert fp.judge(BASE, [BASE, other, other]).severity == "warning"
    assert fp.judge(BASE, []).severity == "not_measured"
    assert fp.judge([], [BASE]).severity == "not_measured"


def test_answers_are_read_from_openais_shape():
    data = {"choices": [{"message": {"content": "Paris"}, "logprobs": {"content": [
        {"token": "Par", "logprob": -0.01, "top_logprobs": []},
        {"token": "is", "logprob": -0.2, "top_logprobs": []}]}}]}
    assert fp.answer_from("q", data) == {"prompt": "q", "text": "Paris",
                                         "tokens": ["Par", "is"], "logprobs": [-0.01, -0.2]}
    assert fp.answer_from("q", {"choices": [{"message": {"content": "Hi"}}]})["tokens"] == []
    body = fp.request_body("m", "q")
    assert (body["temperature"], body["logprobs"], body["stream"]) == (0, True, False)
