"""A reward with a checkable answer: is the first number in the response the sum the prompt asks for?

Use it with the prompts beside it:

    ppo train --run sums --set reward=python:examples/arithmetic/reward.py:exact_sum \
        --set prompts_path=examples/arithmetic/prompts.jsonl --set eval_prompts_path=examples/arithmetic/eval_prompts.jsonl

The contract of a ``python:`` reward: called once per batch with every prompt
and its response (text, without the end-of-sequence token); returns one
finite float per response, higher is better. Exceptions, a wrong length or a
non-finite score fail the phase with a message naming the function.
"""

from __future__ import annotations

import re

QUESTION = re.compile(r"What is (-?\d+) \+ (-?\d+)\?")
NUMBER = re.compile(r"-?\d[\d,]*")


def expected_sum(prompt: str) -> int | None:
    m = QUESTION.search(prompt)
    return int(m[1]) + int(m[2]) if m else None


def exact_sum(prompts: list[str], responses: list[str]) -> list[float]:
    """1 for the right sum as the response's first number, 0.2 for a wrong number (it answered), 0 for none."""
    scores = []
    for prompt, response in zip(prompts, responses):
        want, got = expected_sum(prompt), NUMBER.search(response)
        if want is None:
            raise ValueError(f"prompt {prompt!r} does not ask 'What is A + B?'")
        if got is None:
            scores.append(0.0)
        else:
            scores.append(1.0 if int(got[0].replace(",", "")) == want else 0.2)
    return scores
