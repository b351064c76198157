"""Answer fingerprints: does an engine serve the model it names? Pure: plain values.

A model's weights decide its answers. Asked the same canary prompts greedily (temperature 0,
a fixed seed), two engines that serve the same model at the same weights on the same engine
answer the same tokens, with the same log-probabilities up to the last digits of float
arithmetic; a smaller model, another fine-tune, or weights changed in any way answer otherwise
within a few tokens. So each verification run asks the provider's engine the CANARIES, through
the same path and engine key as a renter's request, and compares the answers with those of the
machines verified serving the same model at the same quantization on the same engine (their
peers): matching none of them is "serves a different model than it names".

Late tokens may differ between honest machines (batching and kernels change the last bits of
a logit, and greedy decoding follows a flip), so an answer is compared by the share of its
tokens it has in common with the other's from the start, and by the mean gap between their
log-probabilities over that common start where the engine gives them.
"""

import os
from dataclasses import dataclass

CANARIES = (
    "Complete the sentence: The capital of France is",
    "List the first five prime numbers, separated by commas.",
    "Translate into German: good morning, my friend.",
    "What is 17 times 23? Answer with the number only.",
    "Write one sentence about the ocean.",
)
MAX_TOKENS = 16
TOP_LOGPROBS = 5
# Two answers agree when they share at least this share of their tokens from the start, and
# their log-probabilities over it differ by at most LOGPROB_GAP on average.
AGREE_SHARE = 0.5
LOGPROB_GAP = 0.5
# A fingerprint matches another when most of its canaries agree.
MATCH_SHARE = 0.6


def request_body(model: str, prompt: str) -> dict:
    return {"model": model, "messages": [{"role": "user", "content": prompt}],
            "max_tokens": MAX_TOKENS, "temperature": 0, "seed": 0, "stream": False,
            "logprobs": True, "top_logprobs": TOP_LOGPROBS}


def answer_from(prompt: str, data: dict) -> dict:
    """One canary's answer as kept: its text and, where the engine gave them, its tokens and
    their log-probabilities (OpenAI's `choices[0].logprobs.content`)."""
    choice = (data.get("choices") or [{}])[0]
    text = ((choice.get("message") or {}).get("content") or choice.get("text") or "")
    content = ((choice.get("logprobs") or {}).get("content")) or []
    tokens = [str(item.get("token", "")) for item in content if isinstance(item, dict)]
    logprobs = [float(item["logprob"]) for item in content
                if isinstance(item, dict) and isinstance(item.get("logprob"), int | float)]
    if len(logprobs) != len(tokens):
        logprobs = []
    return {"prompt": prompt, "text": text[:400], "tokens": tokens[:MAX_TOKENS],
            "logprobs": [round(x, 4) for x in logprobs[:MAX_TOKENS]]}


def _common_start(a, b) -> int:
    """How many items two sequences share from the start."""
    return len(os.path.commonprefix([list(a), list(b)]))


@dataclass(frozen=True)
class Agreement:
    share: float  # of the shorter answer's tokens (or characters) shared from the start
    logprob_gap: float | None  # mean |difference| over the common start; None: not given

    @property
    def agrees(self) -> bool:
        return self.share >= AGREE_SHARE and (self.logprob_gap is None
                                              or self.logprob_gap <= LOGPROB_GAP)


def agreement(ours: dict, theirs: dict) -> Agreement:
    if ours.get("tokens") and theirs.get("tokens"):
        a, b = ours["tokens"], theirs["tokens"]
        common = _common_start(a, b)
        share = common / max(1, min(len(a), len(b)))
        gap = None
        if ours.get("logprobs") and theirs.get("logprobs") and common:
            gap = sum(abs(x - y) for x, y in zip(ours["logprobs"][:common],
                                                 theirs["logprobs"][:common],
                                                 strict=False)) / common
        return Agreement(round(share, 3), None if gap is None else round(gap, 3))
    a, b = ours.get("text", ""), theirs.get("text", "")
    if not a or not b:
        return Agreement(1.0 if a == b else 0.0, None)
    return Agreement(round(_common_start(list(a), list(b)) / min(len(a), len(b)), 3), None)


@dataclass(frozen=True)
class Match:
    matches: bool
    agreed: int  # canaries that agree
    compared: int  # canaries both answered


def match(ours: list[dict], theirs: list[dict]) -> Match:
    by_prompt = {a["prompt"]: a for a in theirs}
    pairs = [(a, by_prompt[a["prompt"]]) for a in ours if a["prompt"] in by_prompt]
    agreed = sum(agreement(a, b).agrees for a, b in pairs)
    return Match(bool(pairs) and agreed >= MATCH_SHARE * len(pairs), agreed, len(pairs))


@dataclass(frozen=True)
class Verdict:
    severity: str  # "ok", "warning", "mismatch" or "not_measured"
    matched: int  # peers whose fingerprint it matches
    peers: int


def judge(ours: list[dict], peers: list[list[dict]]) -> Verdict:
    """Against the fingerprints of the machines verified serving the same model, quantization and
    engine: ok when it matches at least half of them, a mismatch when it matches none, a
    warning between (its peers disagree among themselves)."""
    if not ours:
        return Verdict("not_measured", 0, len(peers))
    peers = [p for p in peers if p]
    if not peers:
        return Verdict("not_measured", 0, 0)
    matched = sum(match(ours, p).matches for p in peers)
    severity = ("ok" if 2 * matched >= len(peers) else "mismatch" if matched == 0
                else "warning")
    return Verdict(severity, matched, len(peers))
