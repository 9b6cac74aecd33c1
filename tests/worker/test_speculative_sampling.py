"""``Sampler.verify``: speculative drafts are verified without changing what is sampled.

The statistical tests draw thousands of verifications of one draft over a small vocabulary with fixed
logits, with a seeded generator (so they are deterministic), and compare the emitted tokens with the
target distributions by a chi-square test: the first token must follow the first position's target
distribution, the second (given the first was the draft's) the second position's, and so on. A
verifier that accepted drafts too often (or removed nothing on a rejection) fails them by far.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence

import numpy as np
import pytest
import torch
from scipy.stats import chisquare

from asyncllm.executor._runner import SequenceInput
from asyncllm.sampling_params import SamplingParams
from asyncllm.worker._sampler import Sampler

VOCAB = 6
PROMPT = [0, 1]
# Three positions (after the newest token, after draft token 1, after draft token 2), each with its own
# distribution (no ties, so top_k is unambiguous); the draft [2, 3] has probability 0.3, then 0.5.
LOGITS = torch.log(
    torch.tensor(
        [
            [0.10, 0.25, 0.30, 0.14, 0.05, 0.16],
            [0.05, 0.09, 0.15, 0.50, 0.10, 0.11],
            [0.40, 0.04, 0.06, 0.21, 0.19, 0.10],
        ]
    )
)
DRAFT = [2, 3]
DRAWS = 6000
P_VALUE = 1e-3  # deterministic (seeded); a verifier that resamples without removing the draft token fails


def drafted(request_id: int, params: SamplingParams, draft: Sequence[int] = DRAFT, newest: int = 5) -> SequenceInput:
    """A sequence in decode whose newest token (position 2) is followed by ``draft``."""
    return SequenceInput(
        request_id=request_id,
        token_ids=[newest, *draft],
        start_position=len(PROMPT),
        block_table=[],
        sample=True,
        params=params,
        num_generated=1,
        prompt_token_ids=PROMPT,
        num_draft=len(draft),
    )


def verify_many(params: SamplingParams, logits: torch.Tensor = LOGITS, draws: int = DRAWS) -> list[list[int]]:
    """Verify the same draft ``draws`` times (one request each, all in one batch, as a step would)."""
    sampler = Sampler(torch.device("cpu"), VOCAB, seed=1234)
    sequences = [drafted(i, params) for i in range(draws)]
    # What the runner records: the tokens up to the draft, not the draft itself.
    sampler.record(
        [SequenceInput(i, [*PROMPT, 5], 0, [], True, params, prompt_token_ids=PROMPT) for i in range(draws)]
    )
    results = sampler.verify(logits.repeat(draws, 1), sequences)
    return [result.token_ids for result in results]


def target(logits: torch.Tensor, temperature: float = 1.0, top_k: int = 0) -> np.ndarray:
    scaled = logits / temperature
    if top_k:
        kth = scaled.topk(top_k).values[-1]
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    return torch.softmax(scaled.double(), dim=-1).numpy()


def check_position(samples: list[int], expected: np.ndarray) -> None:
    """Chi-square of ``samples`` against ``expected`` (tokens of probability 0 must never appear)."""
    counts = Counter(samples)
    support = [t for t in range(VOCAB) if expected[t] > 0]
    assert set(counts) <= set(support), f"drew {sorted(set(counts) - set(support))}, outside the target's support"
    observed = [counts.get(t, 0) for t in support]
    probs = expected[support] / expected[support].sum()
    result = chisquare(observed, probs * len(samples))
    assert result.pvalue > P_VALUE, (observed, (probs * len(samples)).round(1).tolist(), result)


def check_chain(outputs: list[list[int]], targets: list[np.ndarray]) -> None:
    """Each emitted position follows its target distribution, given that the tokens before it were the draft."""
    check_position([tokens[0] for tokens in outputs], targets[0])
    after_first = [tokens for tokens in outputs if tokens[0] == DRAFT[0]]
    assert len(after_first) > len(outputs) * 0.2
    assert all(len(tokens) >= 2 for tokens in after_first)  # an accepted token is always followed by another
    check_position([tokens[1] for tokens in after_first], targets[1])
    after_second = [tokens for tokens in after_first if tokens[1] == DRAFT[1]]
    assert all(len(tokens) == 3 for tokens in after_second)
    check_position([tokens[2] for tokens in after_second], targets[2])
    for tokens in outputs:  # nothing after a token that is not the draft's
        for index, token in enumerate(tokens[:-1]):
            assert token == DRAFT[index]


def test_rejection_sampling_keeps_the_target_distribution() -> None:
    outputs = verify_many(SamplingParams(temperature=1.0))
    check_chain(outputs, [target(row) for row in LOGITS])
    # The draft was accepted about as often as its probability says (0.3, then 0.5).
    accepted_first = sum(tokens[0] == DRAFT[0] for tokens in outputs) / DRAWS
    assert abs(accepted_first - 0.3) < 0.03


def test_rejection_sampling_with_temperature_and_top_k() -> None:
    params = SamplingParams(temperature=0.7, top_k=4)
    outputs = verify_many(params)
    check_chain(outputs, [target(row, 0.7, 4) for row in LOGITS])


def test_a_draft_token_outside_top_k_is_always_rejected() -> None:
    # top_k=2 at the first position keeps tokens 2 (0.30) and 1 (0.25): a draft of 4 never passes.
    sampler = Sampler(torch.device("cpu"), VOCAB, seed=0)
    params = SamplingParams(top_k=2)
    sequences = [drafted(i, params, draft=[4, 3]) for i in range(500)]
    results = sampler.verify(LOGITS.repeat(500, 1), sequences)
    assert {tuple(r.token_ids[:1]) for r in results} <= {(1,), (2,)}
    assert all(len(r.token_ids) == 1 for r in results)


def test_penalties_apply_per_position_with_the_accepted_tokens_counted() -> None:
    # A presence penalty of 1.5 on tokens generated so far: the newest token (5), then each accepted
    # draft token in turn. The second position's target counts the first draft token, the third both.
    params = SamplingParams(temperature=1.0, presence_penalty=1.5)
    outputs = verify_many(params, draws=3000)  # verified one by one (penalties read the history): fewer
    penalty = torch.zeros(3, VOCAB)
    penalty[:, 5] = 1.5
    penalty[1:, DRAFT[0]] += 1.5
    penalty[2:, DRAFT[1]] += 1.5
    check_chain(outputs, [target(row) for row in LOGITS - penalty])


def test_greedy_accepts_while_the_draft_is_the_argmax() -> None:
    sampler = Sampler(torch.device("cpu"), VOCAB)
    params = SamplingParams(temperature=0.0, logprobs=1)
    # Argmax per position: 2, 3, 0.
    cases = {(2, 3): [2, 3, 0], (2, 4): [2, 3], (1, 3): [2], (2,): [2, 3]}
    for request_id, (draft, expected) in enumerate(cases.items()):
        (result,) = sampler.verify(LOGITS[: len(draft) + 1], [drafted(request_id, params, draft)])
        assert result.token_ids == expected
        assert result.logprobs is not None and len(result.logprobs) == len(expected)
        for position, entry in enumerate(result.logprobs):  # the raw logits' logprob of each emitted token
            assert entry.token_id == expected[position]
            assert math.isclose(entry.logprob, float(LOGITS[position, expected[position]]), abs_tol=1e-5)
            assert entry.rank == 1


def test_min_tokens_masks_stop_ids_per_position() -> None:
    # min_tokens=3 with one token generated: stop id 2 is masked at the first position (the second
    # token) and the second (the third token), allowed at the third position.
    sampler = Sampler(torch.device("cpu"), VOCAB, eos_token_ids=frozenset({2}))
    params = SamplingParams(temperature=0.0, min_tokens=3, max_tokens=10)
    logits = torch.zeros(3, VOCAB)
    logits[:, 2] = 5.0
    logits[:, 4] = 1.0
    (result,) = sampler.verify(logits, [drafted(0, params, draft=[4, 4])])
    assert result.token_ids == [4, 4, 2]


def test_mixed_batch_keeps_each_sequence_apart() -> None:
    # Greedy, random and penalised sequences verified together: each one's result is its own.
    sampler = Sampler(torch.device("cpu"), VOCAB, seed=0)
    greedy = SamplingParams(temperature=0.0)
    sequences = [
        drafted(0, greedy, draft=[2, 3]),
        drafted(1, SamplingParams(temperature=1.0, repetition_penalty=1.2, seed=3), draft=[2]),
        drafted(2, greedy, draft=[1]),
    ]
    sampler.record([SequenceInput(1, [*PROMPT, 5], 0, [], True, sequences[1].params, prompt_token_ids=PROMPT)])
    logits = torch.cat([LOGITS, LOGITS[:2], LOGITS[:2]])
    results = sampler.verify(logits, sequences)
    assert results[0].token_ids == [2, 3, 0]
    assert 1 <= len(results[1].token_ids) <= 2
    assert results[2].token_ids == [2]


class _RefuseToken:
    """A grammar that refuses one token id, always; its matcher records what it consumed."""

    name = "refuse"

    def __init__(self, refused: int) -> None:
        self.refused = refused
        self.consumed: list[int] = []

    @property
    def backend(self) -> _RefuseToken:
        return self

    def matcher(self) -> _RefuseToken:
        return self

    def consume(self, token_ids: Sequence[int]) -> bool:
        self.consumed += token_ids
        return self.refused not in token_ids

    def rollback(self, num_tokens: int) -> None:
        del self.consumed[len(self.consumed) - num_tokens :]

    def error(self) -> str | None:
        return None

    def fill_bitmasks(self, matchers: Sequence[object], bitmask: np.ndarray) -> None:
        bitmask[:] = -1
        bitmask[:, self.refused // 32] &= ~(1 << (self.refused % 32))


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_the_grammar_rejects_a_draft_at_the_first_token_it_refuses(temperature: float) -> None:
    grammar = _RefuseToken(refused=3)
    sampler = Sampler(torch.device("cpu"), VOCAB, seed=0)
    params = SamplingParams(temperature=temperature, structured_output={"regex": "x"})
    base = drafted(0, params, draft=[2, 3])
    seq = SequenceInput(**{**{f: getattr(base, f) for f in base.__dataclass_fields__}, "grammar": grammar})  # type: ignore[arg-type]
    sampler.record([SequenceInput(0, [*PROMPT, 5], 0, [], True, params, prompt_token_ids=PROMPT, grammar=grammar)])  # type: ignore[arg-type]
    logits = LOGITS.clone()
    logits[0, 2] = 10.0  # the first draft token is all but certain
    logits[1, 3] = 10.0  # the second is the argmax too, but the grammar refuses it
    (result,) = sampler.verify(logits, [seq])
    assert result.token_ids[0] == 2 and result.token_ids[1] != 3 and len(result.token_ids) == 2
    assert grammar.consumed == [5, 2]  # the newest token and the accepted draft token, nothing refused
    assert sampler.failed == {}
