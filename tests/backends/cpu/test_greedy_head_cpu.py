"""The greedy head (``asyncllm.backends.cpu._greedy_head``): the argmax of the float32 logits, exactly, without them.

The head bounds every logit in bfloat16 (on AMX or AVX512-BF16: each unit the machine has) and recomputes the
few columns that could be the largest the way the panel GEMM computes them, so its token must be the first
maximum of the panel GEMM's logits on every row it decides: random shapes (partial tiles, several 64-row
groups), exact and near ties that bfloat16 cannot separate, and rows it must leave undecided (-1). In the
runner, plain greedy rows take its tokens and every other row goes through the sampler, and the outputs equal
the runner's without it.
"""

from __future__ import annotations

import random
from pathlib import Path

import msgspec
import pytest
import torch

from asyncllm.backends.cpu import _gemm as gemm_cpu
from asyncllm.backends.cpu import _greedy_head as greedy_head_cpu
from asyncllm.backends.cpu._greedy_head import GreedyHead, ProductUnit, rounding_gamma
from asyncllm.executor._runner import SequenceInput, StepBatch
from asyncllm.sampling_params import SamplingParams
from asyncllm.testing.tiny_models import tiny_model_path
from asyncllm.worker._model_runner import TorchModelRunner
from asyncllm.worker._sampler import Sampler

pytestmark = pytest.mark.skipif(
    not greedy_head_cpu.available(),
    reason="needs x86 with AMX-BF16 (and Linux's permission for it) or AVX512-BF16, and a C compiler",
)

UNITS = [unit for unit in greedy_head_cpu.product_units() if greedy_head_cpu.available(unit)]
"""Every product unit that runs here (a Sapphire Rapids has both): each kernel test runs on each."""


@pytest.fixture(params=UNITS or ["none"])
def unit(request: pytest.FixtureRequest) -> ProductUnit:
    return request.param  # type: ignore[no-any-return]


def _head(weight: torch.Tensor, unit: ProductUnit) -> tuple[GreedyHead, gemm_cpu.PanelWeight]:
    return GreedyHead(weight, unit), gemm_cpu.PanelWeight(weight)


@pytest.mark.parametrize(
    ("vocab", "hidden", "rows", "scale"),
    [
        (50, 32, 3, 1.0),  # fewer columns than one tile pair
        (1000, 70, 1, 0.05),  # a partial last tile and a partial input slice
        (4099, 64, 17, 0.3),  # two row tiles, the last one nearly empty
        (32000, 512, 64, 0.02),  # the benchmark model's head, a full 64-row group
        (777, 576, 130, 1.0),  # SmolLM2's width, three 64-row groups
    ],
)
def test_tokens_equal_the_argmax_of_the_panel_logits(
    vocab: int, hidden: int, rows: int, scale: float, unit: ProductUnit
) -> None:
    generator = torch.Generator().manual_seed(vocab + rows)
    weight = torch.randn(vocab, hidden, generator=generator) * scale
    head, panels = _head(weight, unit)
    x = torch.randn(rows, hidden, generator=generator) * 2
    expected = panels.linear(x).argmax(dim=-1)
    tokens = head.argmax(x)
    assert torch.equal(tokens, expected)
    strided = torch.randn(rows, hidden + 5, generator=generator)[:, 2 : 2 + hidden]  # rows apart in memory
    assert torch.equal(head.argmax(strided), panels.linear(strided.contiguous()).argmax(dim=-1))


def test_ties_and_near_ties_bfloat16_cannot_tell_apart_are_decided_in_float32(unit: ProductUnit) -> None:
    generator = torch.Generator().manual_seed(3)
    hidden, vocab = 96, 3000
    x = torch.randn(8, hidden, generator=generator)
    weight = torch.randn(vocab, hidden, generator=generator) * 0.01
    direction = x.mean(dim=0)
    weight[2000] = direction  # the best column for most rows
    weight[2500] = direction  # an exact tie later on: the first must win
    head, panels = _head(weight, unit)
    expected = panels.linear(x).argmax(dim=-1)
    assert 2000 in expected.tolist()
    assert torch.equal(head.argmax(x), expected)

    weight[1500] = direction * (1 + 2.0**-22)  # larger by a few float32 steps only
    weight[10] = direction * (1 - 2.0**-22)  # smaller by as little
    head, panels = _head(weight, unit)
    expected = panels.linear(x).argmax(dim=-1)
    assert 1500 in expected.tolist()
    assert torch.equal(head.argmax(x), expected)
    # bfloat16 rounds all four to the same weights: only the float32 stage can order them.
    rounded = weight.bfloat16()
    assert all(torch.equal(rounded[2000], rounded[j]) for j in (2500, 1500, 10))


def _midpoints(shape: tuple[int, ...], generator: torch.Generator) -> torch.Tensor:
    """Values halfway between two bfloat16 numbers: the largest rounding error bfloat16 can make."""
    base = torch.randn(shape, generator=generator).bfloat16().float()
    step = base.abs() * 2.0**-8  # about half a bfloat16 step: the rounding goes the furthest it can
    return base + torch.where(torch.rand(shape, generator=generator) < 0.5, step, -step)


def _hard_cases() -> list[tuple[str, torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(7)
    cases = []
    x = torch.randn(9, 256, generator=generator)
    x[:, 5] *= 1000  # an outlier channel, as trained models have
    cases.append(("outlier channel", x, torch.randn(700, 256, generator=generator) * 0.05))
    cases.append(("bfloat16 midpoints", _midpoints((9, 256), generator), _midpoints((700, 256), generator)))
    w = torch.randn(700, 256, generator=generator)
    x = torch.randn(9, 256, generator=generator)
    w -= (w @ x[0]).unsqueeze(1) * x[0] / x[0].dot(x[0])  # logits of row 0 cancel to about zero
    cases.append(("cancellation", x, w))
    x = torch.randn(9, 128, generator=generator) * 1e-39  # subnormal in float32 and in bfloat16
    x[:, :4] = torch.randn(9, 4, generator=generator)
    cases.append(("subnormal inputs", x, torch.randn(300, 128, generator=generator)))
    cases.append(("wide", torch.randn(5, 4096, generator=generator), torch.randn(64, 4096, generator=generator)))
    return cases


@pytest.mark.parametrize("name", [name for name, _, _ in _hard_cases()])
def test_the_bound_holds_on_inputs_that_stress_it(name: str, unit: ProductUnit) -> None:
    _, x, weight = next(case for case in _hard_cases() if case[0] == name)
    head, panels = _head(weight, unit)
    logits = panels.linear(x)
    approx, bound = head.bounds(x)
    assert ((approx - logits).abs() <= bound).all()
    assert (bound > 0).all()
    assert torch.equal(head.argmax(x), logits.argmax(dim=-1))


def test_the_bound_is_tight_enough_to_matter(unit: ProductUnit) -> None:
    # Row i of x is the sign of column i's bfloat16 rounding error (exact in bfloat16 itself): those errors add
    # up, and Cauchy-Schwarz is nearly an equality. So the error reaches a good share of the bound, and a
    # bound missing a factor of two would not hold.
    generator = torch.Generator().manual_seed(8)
    weight = torch.randn(2000, 512, generator=generator)
    x = torch.sign(weight[:16] - weight[:16].bfloat16().float())
    head, panels = _head(weight, unit)
    approx, bound = head.bounds(x)
    ratio = ((approx - panels.linear(x)).abs() / bound).max().item()
    assert 0.5 < ratio <= 1.0

    # The same for the hidden states' rounding: weights exact in bfloat16, and each row's values just short of
    # halfway to the next bfloat16 number, rounded away in the direction of column i's signs.
    weight = weight.bfloat16().float()
    base = torch.randn(16, 512, generator=generator).bfloat16().float()
    half_step = base.abs() * 2.0**-9 * 0.99  # just under half of bfloat16's relative step at these values
    x = base + half_step * torch.sign(weight[:16])
    head, panels = _head(weight, unit)
    approx, bound = head.bounds(x)
    ratio = ((approx - panels.linear(x)).abs() / bound).max().item()
    assert 0.5 < ratio <= 1.0


def test_an_exact_tie_across_the_threads_goes_to_the_first_column(unit: ProductUnit) -> None:
    generator = torch.Generator().manual_seed(9)
    weight = torch.randn(5000, 64, generator=generator) * 0.01
    x = torch.randn(4, 64, generator=generator)
    weight[0] = weight[4999] = x.mean(dim=0) * 3  # first and last column: different threads' shares
    head, panels = _head(weight, unit)
    expected = panels.linear(x).argmax(dim=-1)
    assert 0 in expected.tolist()
    assert torch.equal(head.argmax(x), expected)


def test_rows_it_cannot_decide_come_back_as_minus_one(unit: ProductUnit) -> None:
    generator = torch.Generator().manual_seed(4)
    weight = torch.randn(500, 64, generator=generator)
    head, panels = _head(weight, unit)
    x = torch.randn(5, 64, generator=generator)
    x[1, 3] = float("nan")
    x[2, 0] = float("inf")
    x[3, 7] = 2.0**60  # beyond the range the bound's slack covers
    tokens = head.argmax(x)
    assert tokens[1:4].tolist() == [-1, -1, -1]
    expected = panels.linear(x).argmax(dim=-1)
    assert tokens[0] == expected[0] and tokens[4] == expected[4]


def test_too_many_columns_within_the_bound_leave_the_row_undecided(unit: ProductUnit) -> None:
    row = torch.randn(1, 64, generator=torch.Generator().manual_seed(5))
    # Every column ties: more than the kernel keeps per row (1,024) on every thread.
    weight = row.repeat(2048 * max(2, torch.get_num_threads()), 1)
    head, _ = _head(weight, unit)
    assert head.argmax(torch.randn(3, 64)).tolist() == [-1, -1, -1]


def test_weights_out_of_range_and_bad_inputs_are_refused(unit: ProductUnit) -> None:
    weight = torch.randn(100, 64)
    huge = weight.clone()
    huge[5, 5] = float("inf")
    with pytest.raises(ValueError, match="finite weights"):
        GreedyHead(huge, unit)
    with pytest.raises(ValueError, match="2-D float32"):
        GreedyHead(weight.double(), unit)
    head = GreedyHead(weight, unit)
    with pytest.raises(ValueError, match="float32"):
        head.argmax(torch.randn(2, 63))
    with pytest.raises(ValueError, match="float32"):
        head.argmax(torch.randn(2, 64, dtype=torch.float64))
    with pytest.raises(ValueError, match="rows"):
        head.argmax(torch.randn(2, 2, 64))
    assert head.argmax(torch.empty(0, 64)).shape == (0,)


def test_the_sums_rounding_bound_grows_with_the_terms() -> None:
    assert rounding_gamma(512) == pytest.approx(512 * 2.0**-24 * 1.01, rel=1e-4)
    assert rounding_gamma(32) < rounding_gamma(512) < rounding_gamma(4096)


# -- in the runner ---------------------------------------------------------------------------------------


@pytest.fixture(scope="module", params=[True, False], ids=["tied", "untied"])
def tiny_head_model(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("greedy-head")
    return tiny_model_path(folder, vocab_size=3000, hidden_size=96, tie_word_embeddings=request.param)


def _runner(model: Path, greedy_head: bool) -> TorchModelRunner:
    runner = TorchModelRunner(model, device="cpu", kv_cache_blocks=128, block_size=4, seed=0, greedy_head=greedy_head)
    runner.load()
    return runner


GREEDY = SamplingParams(max_tokens=8, temperature=0.0)
MIXED = [
    GREEDY,  # plain greedy: the head
    msgspec.structs.replace(GREEDY, logprobs=3),  # greedy, but its logits are read
    msgspec.structs.replace(GREEDY, repetition_penalty=1.3),
    msgspec.structs.replace(GREEDY, logit_bias={7: 5.0}),
    msgspec.structs.replace(GREEDY, min_tokens=3),  # a ban on EOS for three steps, then plain
    SamplingParams(max_tokens=8, temperature=0.8, seed=11),
    msgspec.structs.replace(GREEDY, allowed_token_ids=(5, 6, 7, 8)),
    SamplingParams(max_tokens=8, top_k=1),  # greedy by top_k
]


def _generate(runner: TorchModelRunner, params: list[SamplingParams], steps: int) -> list[tuple[object, ...]]:
    """A prompt step then ``steps`` decode steps; every step's sampled ids and logprobs."""
    rng = random.Random(0)
    prompts = [[rng.randrange(3, 3000) for _ in range(rng.randrange(3, 12))] for _ in params]
    tables = [list(range(16 * i, 16 * (i + 1))) for i in range(len(params))]
    fed = [list(p) for p in prompts]
    starts = [0] * len(params)
    outputs = []
    for step in range(steps + 1):
        batch = [
            SequenceInput(i, fed[i], starts[i], tables[i], True, p, num_generated=step, prompt_token_ids=prompts[i])
            for i, p in enumerate(params)
        ]
        out = runner.execute(StepBatch(batch, []))
        outputs.append((tuple(out.sampled_token_ids), out.logprobs))
        for i, token in enumerate(out.sampled_token_ids):
            starts[i] += len(fed[i])
            fed[i] = [token]
    return outputs


def test_runner_outputs_equal_the_logits_path_and_the_head_serves_the_plain_greedy_rows(tiny_head_model: Path) -> None:
    with_head, without = _runner(tiny_head_model, True), _runner(tiny_head_model, False)
    assert with_head.model is not None and without.model is not None
    head = with_head.model.greedy_head
    assert head is not None
    # The head reads the float32 output weight: kept beside it, tied to the input embedding or not.
    assert with_head.model.lm_head.weight.shape == (3000, 96)
    assert without.model.lm_head.weight.numel() == (3000 * 96 if without.model.spec.tie_word_embeddings else 0)
    served: list[int] = []
    argmax = head.argmax

    def counting(hidden: torch.Tensor) -> torch.Tensor:
        served.append(hidden.shape[0])
        tokens = argmax(hidden)
        assert (tokens >= 0).all()  # decided: not served by the fallback
        return tokens

    head.argmax = counting  # type: ignore[method-assign]
    assert _generate(with_head, MIXED, 6) == _generate(without, MIXED, 6)
    # Rows 0 and 7 every step; row 4 once its min_tokens ban is over (steps 3 to 6 of 0 to 6).
    assert served == [2, 2, 2, 3, 3, 3, 3]
    with_head.close()
    without.close()


def test_rows_the_head_leaves_undecided_go_through_the_logits(tiny_head_model: Path) -> None:
    runner, reference = _runner(tiny_head_model, True), _runner(tiny_head_model, False)
    assert runner.model is not None and runner.model.greedy_head is not None
    head = runner.model.greedy_head
    argmax = head.argmax

    def undecided_first(hidden: torch.Tensor) -> torch.Tensor:
        tokens = argmax(hidden)
        tokens[0] = -1
        return tokens

    head.argmax = undecided_first  # type: ignore[method-assign]
    params = [GREEDY, msgspec.structs.replace(GREEDY, logprobs=2), GREEDY]
    assert _generate(runner, params, 4) == _generate(reference, params, 4)
    runner.close()
    reference.close()


def test_plain_greedy_rows_are_the_rows_whose_logits_nothing_else_reads() -> None:
    sampler = Sampler(torch.device("cpu"), vocab_size=100, eos_token_ids=frozenset({2}))
    greedy = SamplingParams(temperature=0.0)
    params = [
        greedy,
        msgspec.structs.replace(greedy, logprobs=1),
        SamplingParams(temperature=0.7),
        SamplingParams(top_k=1),  # greedy too
        msgspec.structs.replace(greedy, min_tokens=2),  # banned EOS while fewer than 2 generated
        msgspec.structs.replace(greedy, min_tokens=2),
        msgspec.structs.replace(greedy, presence_penalty=0.5),
        msgspec.structs.replace(greedy, logit_bias={3: 1.0}),
        msgspec.structs.replace(greedy, allowed_token_ids=(4, 5)),
        msgspec.structs.replace(greedy, bad_words=["x"]),
    ]
    generated = [0, 0, 0, 0, 1, 2, 0, 0, 0, 0]  # the fed token is the last one generated (or of the prompt)
    prompt = [5] * 4
    sequences = [
        SequenceInput(i, [9], 3 + generated[i], [0, 1], True, p, num_generated=generated[i], prompt_token_ids=prompt)
        for i, p in enumerate(params)
    ]
    sequences[9] = SequenceInput(
        9, [9], 3, [0, 1], True, params[9], prompt_token_ids=prompt, bad_words_token_ids=((8,),)
    )
    sampler.record(sequences)
    assert sampler.plain_greedy_rows(sequences) == [0, 3, 5]
