"""A deterministic stand-in tokenizer and the filler text the simulated engine "generates".

A token is a word or one punctuation mark. Real BPE tokenizers give ~1.3 tokens per English
word, so counts here run a little low, which does not matter: what matters is that the engine,
its usage numbers and its prefix cache all count the same way, and that a client sending a
reply back in the next turn produces the same tokens the engine emitted (so a follow-up turn
hits the prefix cache, as it does on a real engine).
"""

from __future__ import annotations

import re

_TOKEN_RE = re.compile(r"\w+|[^\w\s]")

# Chat template markers, shaped like ChatML, each one token.
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"

_FILLER = (
    "The simulated engine answers with steady filler text , one word per token , so that "
    "usage numbers , stream chunks and timings can be checked exactly . It follows a measured "
    "profile : throughput grows with the batch until the card saturates , and a repeated "
    "prompt skips most of its prefill when the prefix cache holds it ."
).split()


def tokenize(text: str) -> list[str]:
    return _TOKEN_RE.findall(text)


def filler_tokens(n: int) -> list[str]:
    return [_FILLER[i % len(_FILLER)] for i in range(n)]


def detokenize_piece(token: str, first: bool) -> str:
    """The text a token adds to the output: words are space-separated, punctuation is not,
    so tokenize(detokenized text) gives the tokens back."""
    if first or not token[0].isalnum():
        return token
    return " " + token




def chat_prompt_tokens(messages: list[dict]) -> list[str]:
    """Tokens of a ChatML-rendered conversation plus the assistant generation prompt.

    The prompt of turn 1 followed by its answer is a prefix of the prompt of turn 2, exactly
    as with a real chat template, which is what makes follow-up turns cheap on the worker
    that answered the first one.
    """
    tokens: list[str] = []
    for message in messages:
        tokens += [IM_START, message["role"]]
        tokens += tokenize(message_text(message.get("content")))
        tokens.append(IM_END)
    return tokens + [IM_START, "assistant"]


def message_text(content) -> str:
    """A message's text: a string, or the text parts of an OpenAI content-parts list."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    return " ".join(part.get("text", "") for part in content if part.get("type") == "text")
