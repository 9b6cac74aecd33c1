"""``Sampler.verify`` with drafts drawn from a draft model's distribution q (``draft_probs``).

A draft token d drawn from q is accepted with probability min(1, p(d) / q(d)), and a rejected one is
replaced by a draw from max(0, p - q), normalised: every emitted token then follows the target p,
whatever q is. The tests draw thousands of drafts from a q far from p (seeded: deterministic), verify
them all in one batch as a step would, and compare each emitted position with its target by a
chi-square test, in the batched path and in the position-by-position one (a request whose stages read
its history). The same drafts verified as point masses (the n-gram rule, wrong for drafts drawn at
random) fail the same test by far: the test can tell.
"""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest
import torch
from scipy.stats import chisquare

from asyncllm.executor._runner import SequenceInput
from asyncllm.sampling_params import SamplingParams
from asyncllm.worker._sampler import Sampler

VOCAB = 6
PROMPT = [0, 1]
NEWEST = 5
LOGITS = torch.log(
    torch.tensor(
        [
            [0.10, 0.25, 0.30, 0.14, 0.05, 0.16],
            [0.05, 0.09, 0.15, 0.50, 0.10, 0.11],
            [0.40, 0.04, 0.06, 0.21, 0.19, 0.10],
        ]
    )
)
# The draft model's distributions at the two draft positions: far from the target's, never token 0.
Q = torch.tensor(
    [
        [0.00, 0.05, 0.15, 0.20, 0.50, 0.10],
        [0.00, 0.40, 0.30, 0.05, 0.05, 0.20],
    ]
)
DRAWS = 3000
P_VALUE = 1e-3
# A bad word that never completes (no draft holds token 0, and an emitted 0 ends the run): it only sends
# the request down the position-by-position path, which keeps each request's history.
IN_ORDER = ((0, 0, 0),)


def drafts(seed: int = 7) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    q = Q.double().numpy()
    q = q / q.sum(axis=1, keepdims=True)
    return [[int(rng.choice(VOCAB, p=q[0])), int(rng.choice(VOCAB, p=q[1]))] for _ in range(DRAWS)]


def verify_many(
    params: SamplingParams, drawn: list[list[int]], *, with_q: bool = True, bad_words: tuple[tuple[int, ...], ...] = ()
) -> list[list[int]]:
    sampler = Sampler(torch.device("cpu"), VOCAB, seed=4321)
    sampler.record(
        [
            SequenceInput(
                i, [*PROMPT, NEWEST], 0, [], True, params, prompt_token_ids=PROMPT, bad_words_token_ids=bad_words
            )
            for i in range(len(drawn))
        ]
    )
    sequences = [
        SequenceInput(
            request_id=i,
            token_ids=[NEWEST, *draft],
            start_position=len(PROMPT),
            block_table=[],
            sample=True,
            params=params,
            num_generated=1,
            prompt_token_ids=PROMPT,
            bad_words_token_ids=bad_words,
            num_draft=len(draft),
        )
        for i, draft in enumerate(drawn)
    ]
    probs = [Q.clone() for _ in drawn] if with_q else None
    results = sampler.verify(LOGITS.repeat(len(drawn), 1), sequences, probs)
    return [result.token_ids for result in results]


def target(logits: torch.Tensor, temperature: float = 1.0, top_k: int = 0) -> np.ndarray:
    scaled = logits / temperature
    if top_k:
        kth = scaled.topk(top_k).values[-1]
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    return torch.softmax(scaled.double(), dim=-1).numpy()


def pvalue(samples: list[int], expected: np.ndarray) -> float:
    counts = Counter(samples)
    support = [t for t in range(VOCAB) if expected[t] > 0]
    assert set(counts) <= set(support), f"drew {sorted(set(counts) - set(support))}, outside the target's support"
    probs = expected[support] / expected[support].sum()
    return float(chisquare([counts.get(t, 0) for t in support], probs * len(samples)).pvalue)


def check_chain(outputs: list[list[int]], drawn: list[list[int]], targets: list[np.ndarray]) -> None:
    """Each emitted position follows its target, given the draft tokens before it were accepted."""
    for tokens, draft in zip(outputs, drawn):
        assert 1 <= len(tokens) <= 3 and tokens[:-1] == draft[: len(tokens) - 1]
    assert pvalue([tokens[0] for tokens in outputs], targets[0]) > P_VALUE
    second = [tokens[1] for tokens in outputs if len(tokens) >= 2]
    assert len(second) > DRAWS * 0.2
    assert pvalue(second, targets[1]) > P_VALUE
    third = [tokens[2] for tokens in outputs if len(tokens) == 3]
    assert len(third) > DRAWS * 0.05
    assert pvalue(third, targets[2]) > P_VALUE


@pytest.mark.parametrize("bad_words", [(), IN_ORDER], ids=["batched", "in-order"])
def test_drafts_drawn_from_q_keep_the_target_distribution(bad_words: tuple[tuple[int, ...], ...]) -> None:
    drawn = drafts()
    outputs = verify_many(SamplingParams(temperature=1.0), drawn, bad_words=bad_words)
    check_chain(outputs, drawn, [target(row) for row in LOGITS])
    # Acceptance at the first position is sum over d of min(q(d), p(d)).
    expected = float(torch.minimum(Q[0], torch.softmax(LOGITS[0], dim=-1)).sum())
    accepted = sum(len(tokens) >= 2 for tokens in outputs) / DRAWS
    assert abs(accepted - expected) < 0.03


def test_with_temperature_and_top_k() -> None:
    drawn = drafts(11)
    outputs = verify_many(SamplingParams(temperature=0.7, top_k=4), drawn)
    check_chain(outputs, drawn, [target(row, 0.7, 4) for row in LOGITS])


def test_a_wrong_q_is_detected_and_the_point_mass_rule_accepts_less() -> None:
    drawn = drafts()
    # The test's power: verifying against another q than the one the drafts came from (uniform) is wrong.
    uniform = torch.full((2, VOCAB), 1.0 / VOCAB)
    sampler = Sampler(torch.device("cpu"), VOCAB, seed=4321)
    params = SamplingParams(temperature=1.0)
    sampler.record(
        [SequenceInput(i, [*PROMPT, NEWEST], 0, [], True, params, prompt_token_ids=PROMPT) for i in range(DRAWS)]
    )
    sequences = [
        SequenceInput(i, [NEWEST, *d], len(PROMPT), [], True, params, 1, PROMPT, num_draft=2)
        for i, d in enumerate(drawn)
    ]
    wrong = sampler.verify(LOGITS.repeat(DRAWS, 1), sequences, [uniform] * DRAWS)
    assert pvalue([r.token_ids[0] for r in wrong], target(LOGITS[0])) < 1e-6
    # Accepting with p(d) and excluding d on rejection (the n-gram rule) keeps p for any draft that does
    # not depend on the acceptance draw, so it is exact here too, but accepts less: sum q p < sum min(p, q).
    plain = verify_many(params, drawn, with_q=False)
    assert pvalue([tokens[0] for tokens in plain], target(LOGITS[0])) > P_VALUE
    with_q = verify_many(params, drawn)
    assert sum(len(t) >= 2 for t in with_q) > 1.5 * sum(len(t) >= 2 for t in plain)
