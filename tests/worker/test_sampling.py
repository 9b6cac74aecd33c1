"""Every sampling parameter changes what a real (tiny, random) model generates, the way it should.

Each test here would fail if its parameter were ignored: it checks the parameter's effect against
an unconstrained run of the same request, or against transformers on the same weights. The model
is ``tiny_llama`` (random weights, logits spread over several units so greedy choices are not
near-ties). A few tests drive ``Sampler`` directly to pin down formulas and bookkeeping.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from pathlib import Path

import anyio
import msgspec
import pytest
import torch
from transformers import AutoModelForCausalLM

from asyncllm import Completion, Engine, SamplingParams
from asyncllm.executor._runner import SequenceInput
from asyncllm.worker._sampler import Sampler

pytestmark = pytest.mark.anyio

PROMPT = "the quick brown fox"
EOS = 2  # tiny models: <|im_end|>


@pytest.fixture
def anyio_backend() -> str:
    # The engine's concurrency is covered on both backends elsewhere; these tests are about numbers.
    return "asyncio"


def _open(model: Path, **options: object) -> Engine:
    return Engine.open(model, device="cpu", kv_cache_blocks=128, seed=0, **options)  # type: ignore[arg-type]


async def _generate(model: Path, *params: SamplingParams, prompt: str = PROMPT) -> list[Completion]:
    async with _open(model) as engine:
        return [await engine.generate(prompt, p) for p in params]


@pytest.fixture(scope="module")
def hf_model(tiny_llama: Path) -> torch.nn.Module:
    model = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32)
    model.eval()
    return model


@pytest.fixture(scope="module")
def prompt_ids(tiny_llama: Path) -> list[int]:
    from transformers import AutoTokenizer

    return list(AutoTokenizer.from_pretrained(tiny_llama).encode(PROMPT))


def _hf_greedy(
    model: torch.nn.Module,
    prompt: list[int],
    steps: int,
    process: Callable[[torch.Tensor, list[int], list[int]], torch.Tensor],
) -> list[int]:
    """Greedy decoding with transformers' logits, each step's logits passed through ``process``."""
    output: list[int] = []
    with torch.no_grad():
        for _ in range(steps):
            logits = model(torch.tensor([prompt + output])).logits[0, -1].float()
            output.append(int(process(logits, prompt, output).argmax()))
    return output


GREEDY = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
GREEDY_24 = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
SEEDED = SamplingParams(temperature=1.0, seed=11, max_tokens=16, ignore_eos=True)


async def _greedy_and_seeded(tiny_llama: Path) -> tuple[Completion, Completion]:
    greedy, seeded = await _generate(tiny_llama, GREEDY, SEEDED)
    assert greedy.token_ids != seeded.token_ids  # otherwise the tests below prove nothing
    return greedy, seeded


# ----------------------------------------------------------------------------------------------
# Filters: temperature, top_k, top_p, min_p
# ----------------------------------------------------------------------------------------------


async def test_temperature_top_k_top_p_min_p_narrow_sampling_to_greedy(tiny_llama: Path) -> None:
    greedy, _ = await _greedy_and_seeded(tiny_llama)
    narrowed = await _generate(
        tiny_llama,
        SamplingParams(temperature=1.0, top_k=1, seed=11, max_tokens=16, ignore_eos=True),
        SamplingParams(temperature=1.0, top_p=1e-6, seed=11, max_tokens=16, ignore_eos=True),
        SamplingParams(temperature=1.0, min_p=1.0, seed=11, max_tokens=16, ignore_eos=True),
        SamplingParams(temperature=1e-4, seed=11, max_tokens=16, ignore_eos=True),
    )
    for completion in narrowed:
        assert completion.token_ids == greedy.token_ids


async def test_temperature_top_k_and_min_p_change_a_seeded_draw(tiny_llama: Path) -> None:
    _, seeded = await _greedy_and_seeded(tiny_llama)
    variants = await _generate(
        tiny_llama,
        SamplingParams(temperature=3.0, seed=11, max_tokens=16, ignore_eos=True),
        SamplingParams(temperature=1.0, top_k=3, seed=11, max_tokens=16, ignore_eos=True),
        SamplingParams(temperature=1.0, top_p=0.5, seed=11, max_tokens=16, ignore_eos=True),
        SamplingParams(temperature=1.0, min_p=0.2, seed=11, max_tokens=16, ignore_eos=True),
        SEEDED,
    )
    *changed, again = variants
    assert again.token_ids == seeded.token_ids
    for completion in changed:
        assert completion.token_ids != seeded.token_ids


async def test_top_k_keeps_only_the_k_most_likely_tokens(tiny_llama: Path) -> None:
    params = SamplingParams(temperature=2.0, top_k=3, seed=5, max_tokens=24, ignore_eos=True, logprobs=3)
    (completion,) = await _generate(tiny_llama, params)
    assert completion.logprobs is not None
    for entry in completion.logprobs:
        assert entry.token.rank <= 3
        assert entry.token.token_id in [t.token_id for t in entry.top]


async def test_min_p_drops_tokens_below_the_fraction_of_the_best(tiny_llama: Path) -> None:
    params = SamplingParams(temperature=1.5, min_p=0.3, seed=5, max_tokens=24, ignore_eos=True, logprobs=1)
    (completion,) = await _generate(tiny_llama, params)
    assert completion.logprobs is not None
    for entry in completion.logprobs:
        # min_p applies after temperature: p_i / p_max = exp((l_i - l_max) / T).
        best = entry.top[0].logprob
        assert (entry.token.logprob - best) / 1.5 >= torch.log(torch.tensor(0.3)).item() - 1e-4


# ----------------------------------------------------------------------------------------------
# Masks and biases: logit_bias, allowed_token_ids, bad_words, min_tokens, ignore_eos, stop ids
# ----------------------------------------------------------------------------------------------


async def test_logit_bias_forces_and_forbids_tokens(tiny_llama: Path) -> None:
    greedy, _ = await _greedy_and_seeded(tiny_llama)
    forced, forbidden = await _generate(
        tiny_llama,
        SamplingParams(temperature=1.0, seed=1, max_tokens=8, ignore_eos=True, logit_bias={77: 100.0}),
        SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, logit_bias={greedy.token_ids[0]: -100.0}),
    )
    assert forced.token_ids == (77,) * 8
    assert forbidden.token_ids[0] != greedy.token_ids[0]
    assert greedy.token_ids[0] not in forbidden.token_ids


async def test_allowed_token_ids_restrict_every_draw(tiny_llama: Path) -> None:
    allowed = (10, 20, 30, 40, 50)
    (completion,) = await _generate(
        tiny_llama, SamplingParams(temperature=20.0, seed=3, max_tokens=24, ignore_eos=True, allowed_token_ids=allowed)
    )
    assert set(completion.token_ids) <= set(allowed)
    assert len(set(completion.token_ids)) > 1  # it still samples among them


def _contains(haystack: tuple[int, ...], needle: tuple[int, ...]) -> bool:
    return any(haystack[i : i + len(needle)] == needle for i in range(len(haystack) - len(needle) + 1))


async def test_bad_words_never_appear(tiny_llama: Path) -> None:
    sampling = SamplingParams(temperature=3.0, seed=2, max_tokens=32, ignore_eos=True)
    async with _open(tiny_llama) as engine:
        tokenizer = engine.tokenizer

        def round_trips(ids: tuple[int, ...]) -> bool:
            return tuple(tokenizer.encode(tokenizer.decode(list(ids)))) == ids

        greedy = await engine.generate(PROMPT, GREEDY)
        sampled = await engine.generate(PROMPT, sampling)
        # A one-token word from the greedy run, a two-token word from the sampled one.
        single = next(t for t in greedy.token_ids if round_trips((t,)))
        pairs = [sampled.token_ids[i : i + 2] for i in range(len(sampled.token_ids) - 1)]
        pair = next(p for p in pairs if round_trips(p) and single not in p and p[0] != p[1])
        words = (tokenizer.decode([single]), tokenizer.decode(list(pair)))
        banned_greedy = await engine.generate(PROMPT, msgspec.structs.replace(GREEDY, bad_words=words))
        banned_sampled = await engine.generate(PROMPT, msgspec.structs.replace(sampling, bad_words=words))
    for completion in (banned_greedy, banned_sampled):
        assert single not in completion.token_ids
        assert not _contains(completion.token_ids, pair)
    assert banned_sampled.token_ids[: pairs.index(pair) + 1] == sampled.token_ids[: pairs.index(pair) + 1]


async def test_min_tokens_suppresses_eos_and_stop_ids(tiny_llama: Path) -> None:
    towards_eos = {EOS: 100.0}
    free, held, stop_id = await _generate(
        tiny_llama,
        SamplingParams(temperature=1.0, seed=1, max_tokens=20, logit_bias=towards_eos),
        SamplingParams(temperature=1.0, seed=1, max_tokens=20, min_tokens=5, logit_bias=towards_eos),
        SamplingParams(
            temperature=1.0, seed=1, max_tokens=20, min_tokens=3, logit_bias={9: 100.0}, stop_token_ids=(9,)
        ),
    )
    assert free.token_ids == (EOS,) and free.finish_reason == "stop"
    assert len(held.token_ids) == 6 and EOS not in held.token_ids[:5] and held.token_ids[5] == EOS
    assert held.finish_reason == "stop" and held.stop_reason is None  # EOS is not a stop_token_ids id
    assert len(stop_id.token_ids) == 4 and stop_id.token_ids[3] == 9
    assert stop_id.finish_reason == "stop" and stop_id.stop_reason == 9


async def test_ignore_eos_and_max_tokens(tiny_llama: Path) -> None:
    stopped, ignored = await _generate(
        tiny_llama,
        SamplingParams(temperature=0.0, max_tokens=5, logit_bias={EOS: 100.0}),
        SamplingParams(temperature=0.0, max_tokens=5, logit_bias={EOS: 100.0}, ignore_eos=True),
    )
    assert stopped.token_ids == (EOS,) and stopped.finish_reason == "stop"
    assert ignored.token_ids == (EOS,) * 5 and ignored.finish_reason == "length"


async def test_skip_special_tokens_and_spaces_between_them(tiny_llama: Path) -> None:
    def forced(**options: bool) -> SamplingParams:
        return SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True, logit_bias={EOS: 100.0}, **options)

    skipped, spaced, joined = await _generate(
        tiny_llama,
        forced(),
        forced(skip_special_tokens=False),
        forced(skip_special_tokens=False, spaces_between_special_tokens=False),
    )
    assert skipped.token_ids == spaced.token_ids == (EOS,) * 3
    assert skipped.text == ""
    assert spaced.text == "<|im_end|> <|im_end|> <|im_end|>"
    assert joined.text == "<|im_end|><|im_end|><|im_end|>"


# ----------------------------------------------------------------------------------------------
# Penalties, against transformers
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("penalty", [1.3, 0.7])
async def test_repetition_penalty_matches_transformers_generate(
    tiny_llama: Path, hf_model: torch.nn.Module, prompt_ids: list[int], penalty: float
) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, repetition_penalty=penalty)
    greedy, penalised = await _generate(tiny_llama, GREEDY_24, params)
    with torch.no_grad():
        reference = hf_model.generate(
            torch.tensor([prompt_ids]),
            max_new_tokens=24,
            min_new_tokens=24,
            do_sample=False,
            repetition_penalty=penalty,
            pad_token_id=0,
        )[0, len(prompt_ids) :].tolist()
    assert list(penalised.token_ids) == reference
    assert penalised.token_ids != greedy.token_ids


@pytest.mark.parametrize(("presence", "frequency"), [(1.5, 0.0), (0.0, 1.0), (0.8, 0.6), (-1.0, -0.5)])
async def test_presence_and_frequency_penalties_follow_the_openai_definition(
    tiny_llama: Path, hf_model: torch.nn.Module, prompt_ids: list[int], presence: float, frequency: float
) -> None:
    def openai(logits: torch.Tensor, prompt: list[int], output: list[int]) -> torch.Tensor:
        counts = torch.bincount(torch.tensor(output, dtype=torch.int64), minlength=logits.shape[-1])
        return logits - frequency * counts - presence * (counts > 0)

    params = SamplingParams(
        temperature=0.0, max_tokens=24, ignore_eos=True, presence_penalty=presence, frequency_penalty=frequency
    )
    greedy, penalised = await _generate(tiny_llama, GREEDY_24, params)
    assert list(penalised.token_ids) == _hf_greedy(hf_model, prompt_ids, 24, openai)
    assert penalised.token_ids != greedy.token_ids


# ----------------------------------------------------------------------------------------------
# Seeds and shared batches
# ----------------------------------------------------------------------------------------------


def _random_params(rng: random.Random) -> SamplingParams:
    greedy = rng.random() < 0.3
    return SamplingParams(
        temperature=0.0 if greedy else rng.uniform(0.3, 2.0),
        top_k=rng.choice([0, 5, 50]),
        top_p=rng.choice([1.0, 0.9, 0.5]),
        min_p=rng.choice([0.0, 0.05]),
        repetition_penalty=rng.choice([1.0, 1.2, 0.9]),
        presence_penalty=rng.choice([0.0, 0.5]),
        frequency_penalty=rng.choice([0.0, -0.3, 0.4]),
        logit_bias=rng.choice([None, {rng.randrange(512): rng.uniform(-5, 5)}]),
        allowed_token_ids=rng.choice([None, tuple(rng.sample(range(3, 512), 40))]),
        bad_words=rng.choice([(), ("the",)]),
        min_tokens=rng.choice([0, 4]),
        seed=rng.choice([None, rng.randrange(1000)]),
        logprobs=rng.choice([None, 0, 3]),
        max_tokens=rng.randrange(8, 24),
    )


async def test_a_seeded_request_is_the_same_alone_and_among_16_random_others(tiny_llama: Path) -> None:
    target = SamplingParams(
        temperature=0.9,
        top_k=40,
        top_p=0.95,
        min_p=0.02,
        repetition_penalty=1.1,
        presence_penalty=0.2,
        frequency_penalty=0.1,
        logit_bias={50: 2.0},
        seed=1234,
        max_tokens=24,
        ignore_eos=True,
        logprobs=2,
    )
    rng = random.Random(7)
    others = [(f"noise {i} {rng.random()}", _random_params(rng)) for i in range(16)]
    async with _open(tiny_llama) as engine:
        alone = await engine.generate(PROMPT, target)
        deterministic_alone = {
            i: await engine.generate(prompt, params) for i, (prompt, params) in enumerate(others) if params.greedy
        }
        steps_before = engine.statistics().num_steps
        crowd: dict[int | str, Completion] = {}
        async with anyio.create_task_group() as tg:

            async def run(key: int | str, prompt: str, params: SamplingParams) -> None:
                crowd[key] = await engine.generate(prompt, params)

            for i, (prompt, params) in enumerate(others):
                tg.start_soon(run, i, prompt, params)
            tg.start_soon(run, "target", PROMPT, target)
        steps = engine.statistics().num_steps - steps_before
    assert steps < 30  # they really shared steps (each request alone takes 8 to 24)
    assert crowd["target"].token_ids == alone.token_ids
    assert crowd["target"].logprobs is not None and alone.logprobs is not None
    for batched, single in zip(crowd["target"].logprobs, alone.logprobs):
        assert batched.token.token_id == single.token.token_id
        assert batched.token.logprob == pytest.approx(single.token.logprob, abs=1e-4)
    assert deterministic_alone  # some greedy requests with penalties, masks and biases in the crowd
    for i, completion in deterministic_alone.items():
        assert crowd[i].token_ids == completion.token_ids


# ----------------------------------------------------------------------------------------------
# The Sampler itself: formulas and the token history
# ----------------------------------------------------------------------------------------------

VOCAB = 32


def _seq(
    request_id: int,
    prompt: list[int],
    fed: list[int],
    start: int,
    params: SamplingParams,
    *,
    sample: bool = True,
    bad_words: tuple[tuple[int, ...], ...] = (),
) -> SequenceInput:
    return SequenceInput(
        request_id=request_id,
        token_ids=fed,
        start_position=start,
        block_table=[],
        sample=sample,
        params=params,
        prompt_token_ids=prompt,
        bad_words_token_ids=bad_words,
    )


def test_penalties_on_crafted_logits() -> None:
    sampler = Sampler(torch.device("cpu"), VOCAB)
    prompt, output = [1, 2, 3], [4, 4, 5]
    params = SamplingParams(temperature=0.0, repetition_penalty=2.0, presence_penalty=0.5, frequency_penalty=0.25)
    sampler.record([_seq(0, prompt, prompt + output, 0, params)])
    logits = torch.linspace(-3.0, 3.0, VOCAB)[None, :].clone()
    logits[0, 2] = -1.0
    logits[0, 4] = 2.0
    logits[0, 5] = 0.5
    original = logits.clone()
    processed = sampler._process(logits, [_seq(0, prompt, [5], 5, params)], [sampler._states[0]])
    expected = logits.clone()
    for token in (1, 2, 3, 4, 5):  # in the prompt or the output: repetition penalty
        value = expected[0, token]
        expected[0, token] = value / 2.0 if value > 0 else value * 2.0
    expected[0, 4] -= 0.5 + 2 * 0.25  # generated twice
    expected[0, 5] -= 0.5 + 1 * 0.25  # generated once
    torch.testing.assert_close(processed, expected)
    assert torch.equal(logits, original)  # the input is left alone


def _counts(sampler: Sampler, request_id: int) -> tuple[set[int], list[int]]:
    """The request's distinct tokens (prompt and output) and its generated-token counts, from the device tables."""
    slot = sampler._states[request_id].slot
    assert slot is not None
    tables = sampler._penalties
    distinct = tables.distinct[slot, : tables.num_distinct[slot]].tolist()
    assert len(distinct) == len(set(distinct))
    return set(distinct), tables.counts[slot].tolist()


def _expected_counts(prompt: list[int], output: list[int]) -> tuple[set[int], list[int]]:
    return set(prompt) | set(output), torch.bincount(torch.tensor(output, dtype=torch.int64), minlength=VOCAB).tolist()


def test_history_follows_positions_through_chunks_rewinds_and_prefix_hits() -> None:
    params = SamplingParams(frequency_penalty=1.0)
    sampler = Sampler(torch.device("cpu"), VOCAB)
    prompt = [1, 2, 3, 4, 5, 6]
    # Chunked prefill: two chunks, then decode steps.
    sampler.record([_seq(0, prompt, prompt[:4], 0, params, sample=False)])
    sampler.record([_seq(0, prompt, prompt[4:], 4, params)])
    sampler.record([_seq(0, prompt, [7], 6, params)])
    sampler.record([_seq(0, prompt, [8], 7, params)])
    assert sampler._states[0].tokens == [*prompt, 7, 8]
    assert _counts(sampler, 0) == _expected_counts(prompt, [7, 8])
    # A step that feeds position 7 again with another token (lookahead scheduling's correction).
    sampler.record([_seq(0, prompt, [9, 10], 7, params)])
    assert sampler._states[0].tokens == [*prompt, 7, 9, 10]
    assert _counts(sampler, 0) == _expected_counts(prompt, [7, 9, 10])
    # Preemption: everything is fed again from position 0.
    sampler.record([_seq(0, prompt, [*prompt, 7, 9, 10], 0, params)])
    assert _counts(sampler, 0) == _expected_counts(prompt, [7, 9, 10])
    # A new request whose first 4 prompt tokens came from the prefix cache.
    sampler.record([_seq(1, prompt, prompt[4:], 4, params)])
    assert sampler._states[1].tokens == prompt
    assert _counts(sampler, 1) == _expected_counts(prompt, [])
    # Finished requests give their rows back; a new request gets a clean one.
    sampler.forget([0, 1])
    sampler.record([_seq(2, [3], [3], 0, params)])
    assert _counts(sampler, 2) == _expected_counts([3], [])


def test_count_tables_grow_past_their_first_rows() -> None:
    params = SamplingParams(presence_penalty=1.0)
    sampler = Sampler(torch.device("cpu"), VOCAB)
    sequences = [_seq(i, [i % VOCAB], [i % VOCAB], 0, params) for i in range(40)]
    sampler.record(sequences)
    for i in range(40):
        assert _counts(sampler, i) == _expected_counts([i % VOCAB], [])


def test_long_bad_words_mask_their_last_token_only_after_the_rest() -> None:
    params = SamplingParams(temperature=0.0)
    sampler = Sampler(torch.device("cpu"), VOCAB)
    bad = ((5, 7), (9,))
    logits = torch.zeros(1, VOCAB)
    sampler.record([_seq(0, [1, 2], [1, 2], 0, params, bad_words=bad)])
    first = sampler._process(logits, [_seq(0, [1, 2], [2], 1, params, bad_words=bad)], [sampler._states[0]])
    assert first[0, 9] == float("-inf") and first[0, 7] == 0.0  # 5 has not been generated yet
    sampler.record([_seq(0, [1, 2], [5], 2, params, bad_words=bad)])
    after = sampler._process(logits, [_seq(0, [1, 2], [5], 2, params, bad_words=bad)], [sampler._states[0]])
    assert after[0, 9] == float("-inf") and after[0, 7] == float("-inf")


def test_top_k_top_p_and_min_p_draws_stay_inside_their_sets() -> None:
    sampler = Sampler(torch.device("cpu"), VOCAB, seed=0)
    probs = torch.tensor([0.4, 0.3, 0.2, 0.06, 0.04] + [0.0] * (VOCAB - 5))
    logits = torch.log(probs.clamp_min(1e-12))[None, :].repeat(4, 1)
    params = [
        SamplingParams(top_k=2),
        SamplingParams(top_p=0.75),  # 0.4 + 0.3 < 0.75: the third token is needed too
        SamplingParams(min_p=0.6),  # >= 0.24: the first two
        SamplingParams(),
    ]
    sequences = [_seq(i, [0], [0], 0, p) for i, p in enumerate(params)]
    sampler.record(sequences)
    seen: list[set[int]] = [set() for _ in params]
    for _ in range(300):
        for row, token in enumerate(sampler.sample(logits, sequences).token_ids.tolist()):
            seen[row].add(token)
    assert seen[0] == {0, 1}
    assert seen[1] == {0, 1, 2}
    assert seen[2] == {0, 1}
    assert seen[3] == {0, 1, 2, 3, 4}


def test_top_p_alone_draws_from_the_best_tokens_or_the_whole_sorted_vocabulary() -> None:
    vocab = 4096
    sampler = Sampler(torch.device("cpu"), vocab, seed=0)
    peaked = torch.full((vocab,), -30.0)
    peaked[[7, 9, 11, 13]] = torch.log(torch.tensor([0.4, 0.3, 0.2, 0.1]))
    flat = torch.zeros(vocab)
    rows = 3000
    logits = torch.stack([peaked] * rows + [flat] * rows)
    params = SamplingParams(top_p=0.75)
    sequences = [_seq(i, [0], [0], 0, params) for i in range(2 * rows)]
    sampler.record(sequences)
    tokens = sampler.sample(logits, sequences).token_ids.tolist()
    assert set(tokens[:rows]) == {7, 9, 11}  # 0.4 + 0.3 < 0.75: the third is needed, not the fourth
    # Flat: 75% of the vocabulary (3072 tokens) stays, more than the first 1,024 candidates
    # (3000 draws from 3072 tokens give about 1,900 distinct ones).
    assert 1500 < len(set(tokens[rows:])) <= 3072


@pytest.mark.parametrize("seeded", [True, False])
def test_a_seeded_row_draws_the_same_alone_and_in_any_batch(seeded: bool) -> None:
    vocab = 2048
    configs = [
        SamplingParams(temperature=0.8),
        SamplingParams(top_k=20),
        SamplingParams(top_k=1500, top_p=0.9),
        SamplingParams(top_p=0.9),  # peaked rows: 1,024 candidates; flat rows: the full sort
        SamplingParams(min_p=0.1, top_k=50, temperature=1.3),
        SamplingParams(top_p=0.5, min_p=0.05),
        SamplingParams(temperature=0.0),
    ]
    generator = torch.Generator().manual_seed(0)
    steps = [
        torch.randn(len(configs) * 2, vocab, generator=generator)
        * torch.tensor([[4.0], [0.01]]).repeat(len(configs), 1)
        for _ in range(4)
    ]

    def run(rows: list[int]) -> dict[int, list[int]]:
        sampler = Sampler(torch.device("cpu"), vocab, seed=1)
        params = [msgspec.structs.replace(configs[r // 2], seed=100 + r if seeded else None) for r in rows]
        sequences = [_seq(r, [0], [0], 0, p) for r, p in zip(rows, params)]
        sampler.record(sequences)
        drawn: dict[int, list[int]] = {r: [] for r in rows}
        for logits in steps:
            for r, token in zip(rows, sampler.sample(logits[rows], sequences).token_ids.tolist()):
                drawn[r].append(token)
        return drawn

    everything = list(range(len(configs) * 2))
    together = run(everything)
    for row in everything:
        alone = run([row])
        if seeded or configs[row // 2].greedy:
            assert alone[row] == together[row], configs[row // 2]
    reversed_batch = run(everything[::-1])
    if seeded:
        assert reversed_batch == together


async def test_penalties_survive_preemption_and_prefix_cache_hits(tiny_llama: Path) -> None:
    # The sampler's token history is rebuilt when a preempted request is fed again from position 0,
    # and filled from the prompt when a prefix-cache hit skips the first positions.
    params = SamplingParams(
        temperature=0.0, max_tokens=40, ignore_eos=True, repetition_penalty=1.3, frequency_penalty=0.4, min_tokens=5
    )
    prompts = [f"{word} the quick brown fox jumps over the lazy dog again and again" for word in ("one", "two", "six")]
    async with _open(tiny_llama) as engine:
        alone = [await engine.generate(prompt, params) for prompt in prompts]
        hits_before = engine.statistics().prefix_cache_hits
        cached = await engine.generate(prompts[0], params)  # the prompt's full blocks are cached now
        hits = engine.statistics().prefix_cache_hits - hits_before
    async with Engine.open(tiny_llama, device="cpu", kv_cache_blocks=10, block_size=8, seed=0) as engine:
        crowd: dict[int, Completion] = {}
        async with anyio.create_task_group() as tg:

            async def run(i: int) -> None:
                crowd[i] = await engine.generate(prompts[i], params)

            for i in range(len(prompts)):
                tg.start_soon(run, i)
        preemptions = engine.statistics().num_preemptions
    assert cached.token_ids == alone[0].token_ids
    assert hits > 0
    assert preemptions > 0
    for i, completion in enumerate(alone):
        assert crowd[i].token_ids == completion.token_ids


def test_spaces_between_special_tokens_stream_adds_up(tiny_llama: Path) -> None:
    from transformers import AutoTokenizer

    from asyncllm.engine._detokenizer import IncrementalDetokenizer
    tokenizer = AutoTokenizer.from_pretrained(tiny_llama)
    rng = random.Random(0)
    text_ids = tokenizer.encode("héllo wörld, the end")
    for _ in range(30):
        ids = [rng.choice([*text_ids, 0, 1, 2]) for _ in range(rng.randrange(1, 20))]
        for spaced in (True, False):
            detokenizer = IncrementalDetokenizer(tokenizer, False, spaced)
            deltas = [detokenizer.push([i]) for i in ids] + [detokenizer.flush()]
            # The reference: special tokens and the runs of text between them, joined by spaces or not.
            parts: list[str] = []
            run: list[int] = []
            for i in [*ids, None]:
                if i is None or i in (0, 1, 2):
                    if run:
                        parts.append(tokenizer.decode(run))
                        run = []
                    if i is not None:
                        parts.append(tokenizer.decode([i]))
                else:
                    run.append(i)
            expected = (" " if spaced else "").join(part for part in parts if part)
            assert "".join(deltas) == expected


def test_row_argmax_matches_torch_including_ties_and_infinities() -> None:
    from asyncllm.worker._sampler import row_argmax
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(33, 1000, generator=generator)
    x[3, 10] = x[3, 500] = 100.0  # a tie: the first maximum wins
    x[4] = float("-inf")
    x[4, 7] = 0.0
    x[5] = float("-inf")  # every column masked: index 0, as torch
    x[6, 999] = float("inf")
    for rows in (x, x[::2], x.double()):
        got = row_argmax(rows)
        assert got.dtype == torch.int64
        assert torch.equal(got, rows.argmax(dim=-1))
    assert row_argmax(x)[3] == 10
