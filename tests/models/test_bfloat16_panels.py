"""bfloat16 weights on the CPU: the bfloat16 panel GEMM, and the engine's ``dtype="bfloat16"`` built on it.

On an x86 CPU with AVX512-BF16, or else AVX2 (float32 multiply-adds on the widened bfloat16 values; AVX-512
without BF16 takes that build's kernel), the engine's bfloat16 keeps its weights' bfloat16 values and multiplies
them by inputs rounded to bfloat16, summing in float32, and keeps its KV cache in bfloat16; everything else is the
float32 path (``TorchModelRunner.bfloat16_weights``, ``kv_dtype``). The kernel is checked against float64 on
the rounded values, and the model path token for token against HF transformers computing the same way (its
weights, its linear layers' inputs, its keys and values rounded to bfloat16:
``transformers_greedy(bfloat16_products=True, bfloat16_kv=True)``).
"""

from __future__ import annotations

import platform
from pathlib import Path

import pytest
import torch

from asyncllm import Engine, SamplingParams
from asyncllm.backends.cpu import _attention as attention_cpu
from asyncllm.backends.cpu import _gemm as gemm_cpu
from asyncllm.backends.cpu import _native as native
from asyncllm.backends.torch._attention import write_kv as reference_write_kv
from asyncllm.executor._runner import SequenceInput
from asyncllm.models._linear import Linear
from asyncllm.testing.parity import chat_prompts, stream_all, transformers_greedy_margins
from asyncllm.testing.tiny_models import tiny_model_path
from asyncllm.worker._input_batch import step_inputs
from asyncllm.worker._model_runner import TorchModelRunner

needs_bfloat16_panels = pytest.mark.skipif(
    not gemm_cpu.bfloat16_available(),
    reason="needs an x86 CPU with AVX-512, or AVX2 and FMA, and a C compiler",
)

UNIT_ROUNDING = 2.0**-24
"""float32's unit roundoff: a sum of n products is within about n of these, relatively, of the exact sum."""


def _exact_and_bound(x: torch.Tensor, weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The exact product of the bfloat16-rounded operands (float64) and the float32 summation's error bound."""
    xr, wr = x.bfloat16().double(), weight.bfloat16().double()
    terms = x.shape[-1] + 2  # the pair padding, and the bound's own slack
    gamma = terms * UNIT_ROUNDING / (1 - terms * UNIT_ROUNDING)
    return xr @ wr.T, gamma * (xr.abs() @ wr.abs().T)


def test_bfloat16_panels_available_on_every_avx2_or_avx512_machine() -> None:
    # CI's machines (Zen 4, Sapphire Rapids; Zen 3) have AVX512-BF16 or AVX2 alone, and AVX-512 without BF16 takes
    # the AVX2 build's: this path must run on all of them.
    flags = native.cpu_flags()
    if platform.machine() in ("x86_64", "AMD64") and gemm_cpu.bfloat16_build(flags) is not None:
        assert gemm_cpu.bfloat16_available()


@needs_bfloat16_panels
@pytest.mark.parametrize("rows", [1, 2, 7, 8, 9, 17, 64, 255, 256, 257, 600])
@pytest.mark.parametrize(
    ("out_features", "in_features"),
    # whole panels; a partial last panel; odd input widths (a padded last pair), one under a vector's 16
    [(96, 80), (1024, 512), (49, 37), (100, 15), (8, 1536)],
)
def test_bfloat16_panels_sum_the_rounded_products(rows: int, out_features: int, in_features: int) -> None:
    generator = torch.Generator().manual_seed(rows * 11 + out_features)
    weight = torch.randn(out_features, in_features, generator=generator)
    x = torch.randn(rows, in_features, generator=generator)
    panels = gemm_cpu.PanelWeight(weight, bfloat16=True)
    assert panels.buffer.dtype == torch.bfloat16
    got = panels.linear(x).double()
    exact, bound = _exact_and_bound(x, weight)
    assert bool(((got - exact).abs() <= bound).all())
    # Not the float32 product: the rounding of the operands shows (the check above is not vacuous).
    assert not torch.allclose(got, (x.double() @ weight.double().T), rtol=1e-5, atol=1e-5)


@needs_bfloat16_panels
def test_bfloat16_panels_take_batched_strided_inputs_and_a_bias() -> None:
    weight, bias = torch.randn(64, 32), torch.randn(64)
    panels = gemm_cpu.PanelWeight(weight, bfloat16=True)
    for x in (torch.randn(3, 5, 32), torch.randn(11, 40)[:, 4:36], torch.randn(32, 9).t()):
        exact, bound = _exact_and_bound(x.reshape(-1, 32), weight)
        got = panels.linear(x, bias)
        assert got.shape == (*x.shape[:-1], 64)
        difference = (got.reshape(-1, 64).double() - bias.double() - exact).abs()
        assert bool((difference <= bound + 1e-6).all())  # + the bias's own float32 addition


@needs_bfloat16_panels
def test_bfloat16_panels_keep_non_finite_values() -> None:
    weight = torch.randn(48, 32)
    panels = gemm_cpu.PanelWeight(weight, bfloat16=True)
    x = torch.randn(3, 32)
    x[1, 5], x[2, 7] = float("nan"), float("inf")
    got = panels.linear(x)
    assert bool(got[1].isnan().all()) and not bool(got[2].isfinite().any())
    assert bool(got[0].isfinite().all())


@needs_bfloat16_panels
def test_linear_packs_bfloat16_panels_only_as_panels() -> None:
    layer = Linear(48, 40, bias=True)
    with torch.no_grad():
        layer.weight.copy_(layer.weight.bfloat16())  # bfloat16 values: packing them is exact
        x = torch.randn(5, 48)
        expected, bound = _exact_and_bound(x, layer.weight)
        assert not Linear(48, 40).pack(release=True, packed_format="mkl", bfloat16=True)
        assert layer.pack(release=True, bfloat16=True)
        assert layer.packed_format == "panels" and layer.panel_weight is not None
        assert layer.panel_weight.dtype == torch.bfloat16 and layer.weight.numel() == 0
        difference = (layer(x).double() - layer.bias.double() - expected).abs()
        assert bool((difference <= bound + 1e-6).all())


@needs_bfloat16_panels
def test_runner_loads_bfloat16_weights_on_panels(tiny_cache: Path) -> None:
    runner = TorchModelRunner(tiny_model_path(tiny_cache, "qwen2"), device="cpu", dtype="bfloat16", kv_cache_blocks=8)
    info = runner.load()
    try:
        model = runner.model
        assert model is not None and runner.bfloat16_weights
        assert runner.dtype == torch.float32 and runner.attention_backend == "cpu"
        assert model.lean is not None and isinstance(model.greedy_head, gemm_cpu.PanelArgmaxHead)
        layers = [m for m in model.modules() if isinstance(m, Linear)]
        assert runner.num_packed_layers == len(layers) == 4 * model.spec.num_layers + 1
        assert all(m.panel_weight is not None and m.panel_weight.dtype == torch.bfloat16 for m in layers)
        # every parameter holds a bfloat16 value (norms, biases and the embedding included)
        for name, param in model.named_parameters():
            if param.numel():
                assert torch.equal(param, param.bfloat16().float()), name
        assert "bfloat16 weights and KV cache, float32 activations" in info.description
        assert runner.kv_dtype == torch.bfloat16
        assert all(cache.dtype == torch.bfloat16 for pair in runner.kv_caches for cache in pair)
    finally:
        runner.close()


@pytest.mark.parametrize("bfloat16", [True, False])
@pytest.mark.parametrize("rows", [1, 7, 8, 9, 33, 257])
@pytest.mark.parametrize(("out_features", "valid"), [(96, 96), (1000, 1000), (1000, 990), (49, 3)])
def test_panel_argmax_is_the_argmax_of_the_panel_outputs(
    bfloat16: bool, rows: int, out_features: int, valid: int
) -> None:
    """The fused argmax (nothing stored) gives ``linear(x)[:, :valid].argmax(-1)`` of the same panels: padding
    columns past ``valid`` never count, even where they would win."""
    if not (gemm_cpu.bfloat16_available() if bfloat16 else gemm_cpu.available()):
        pytest.skip("needs the panel GEMM (x86 with AVX-512 or AVX2 and FMA)")
    generator = torch.Generator().manual_seed(rows * out_features + valid)
    weight = torch.randn(out_features, 40, generator=generator)
    weight[valid:] *= 100  # padding that would win if it counted
    panels = gemm_cpu.PanelWeight(weight, bfloat16=bfloat16)
    x = torch.randn(rows, 40, generator=generator)
    expected = panels.linear(x)[:, :valid].argmax(-1)
    assert torch.equal(panels.argmax(x, valid), expected)
    assert torch.equal(gemm_cpu.PanelArgmaxHead(panels.buffer, out_features, valid).argmax(x), expected)


@pytest.mark.parametrize("bfloat16", [True, False])
def test_panel_argmax_takes_the_first_of_equal_values_and_leaves_nan_rows(bfloat16: bool) -> None:
    """Ties go to the first column, within a panel and across panels (as torch.argmax); -0 equals +0; an
    infinite output wins; a row with a NaN output comes back -1 (the logits path decides it)."""
    if not (gemm_cpu.bfloat16_available() if bfloat16 else gemm_cpu.available()):
        pytest.skip("needs the panel GEMM (x86 with AVX-512 or AVX2 and FMA)")
    generator = torch.Generator().manual_seed(3)
    weight = torch.randn(200, 16, generator=generator) * 0.01
    best = torch.ones(16)
    for column in (150, 7, 20, 100):  # equal winners: within panel 0, and in panels 2 and 3
        weight[column] = best
    panels = gemm_cpu.PanelWeight(weight, bfloat16=bfloat16)
    x = torch.ones(5, 16)
    x[1] *= 1e38  # outputs overflow to +inf in the winners (and to +-inf elsewhere): the first +inf wins
    x[2] = 0.0  # every output +0 or -0 (all equal): column 0
    x[3, 4] = float("nan")
    x[4] = -x[4]  # the winners are now the smallest
    tokens = panels.argmax(x)
    logits = panels.linear(x)
    assert tokens[0] == 7 == logits[0].argmax()
    assert tokens[1] == 7 == logits[1].argmax()
    assert tokens[2] == 0 == logits[2].argmax()
    assert tokens[3] == -1 and bool(logits[3].isnan().any())
    assert tokens[4] == logits[4].argmax()
    with pytest.raises(ValueError, match="valid"):
        panels.argmax(x, 0)
    with pytest.raises(ValueError, match="input"):
        panels.argmax(x[:, :8])


@pytest.mark.parametrize("bfloat16", [True, False])
def test_panel_argmax_leaves_a_row_with_one_nan_output_and_ignores_nan_padding(bfloat16: bool) -> None:
    """One NaN among larger outputs (0 * inf in one column) sends the row to the logits path, where torch takes
    the NaN's column; a NaN past ``valid`` (padding) does not count. The NaN would otherwise be lost in the
    maximum (AVX-512's max returns its second operand beside a NaN)."""
    if not (gemm_cpu.bfloat16_available() if bfloat16 else gemm_cpu.available()):
        pytest.skip("needs the panel GEMM (x86 with AVX-512 or AVX2 and FMA)")
    generator = torch.Generator().manual_seed(5)
    weight = torch.rand(200, 16, generator=generator) + 1.0  # positive: an infinite input gives +inf outputs
    weight[37, 5] = 0.0  # column 37: 0 * inf, NaN (in the middle vector of panel 0)
    weight[195, 6] = 0.0  # column 195: past valid
    panels = gemm_cpu.PanelWeight(weight, bfloat16=bfloat16)
    x = torch.ones(3, 16)
    x[0, 5] = float("inf")  # +inf everywhere but column 37: NaN
    x[1, 6] = float("inf")  # +inf everywhere but padding column 195: NaN
    logits = panels.linear(x)[:, :190]
    assert logits[0].isnan().nonzero().flatten().tolist() == [37] and not logits[1].isnan().any()
    assert panels.argmax(x, 190).tolist() == [-1, 0, int(logits[2].argmax())]
    assert logits[0].argmax() == 37 and logits[1].argmax() == 0


@needs_bfloat16_panels
def test_panel_argmax_checks_the_input_width_bfloat16_pairs_hide() -> None:
    """bfloat16 panels of an even width hold as many pairs as one less: the width is checked, as ``linear`` does."""
    panels = gemm_cpu.PanelWeight(torch.randn(100, 40), bfloat16=True)
    x = torch.randn(3, 39)
    with pytest.raises(ValueError, match="input"):
        panels.linear(x)
    with pytest.raises(ValueError, match="input"):
        panels.argmax(x)
    with pytest.raises(ValueError, match="input"):
        gemm_cpu.PanelArgmaxHead(panels.buffer, 100, 100, 40).argmax(x)


@needs_bfloat16_panels
def test_bfloat16_greedy_head_gives_the_argmax_of_the_logits(tiny_cache: Path) -> None:
    """Beside bfloat16 panels the greedy head is the output projection's fused argmax: for any hidden states,
    the argmax of the model's logits; ``greedy_head=False`` leaves every row to the logits."""
    model_dir = tiny_model_path(tiny_cache, "llama")
    runner = TorchModelRunner(model_dir, device="cpu", dtype="bfloat16", kv_cache_blocks=8)
    runner.load()
    try:
        model = runner.model
        assert model is not None and model.greedy_head is not None
        hidden = torch.randn(70, model.spec.hidden_size, generator=torch.Generator().manual_seed(0)) * 3
        assert torch.equal(model.greedy_head.argmax(hidden), model.logits(hidden).argmax(-1))
    finally:
        runner.close()
    runner = TorchModelRunner(model_dir, device="cpu", dtype="bfloat16", kv_cache_blocks=8, greedy_head=False)
    runner.load()
    try:
        assert runner.model is not None and runner.model.greedy_head is None
    finally:
        runner.close()


def test_float32_without_the_bounded_head_takes_the_fused_argmax(
    tiny_cache: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On AVX-512 without AVX512-BF16 or AMX (the bounded head's units) float32's greedy rows take the fused
    argmax; the output projection keeps its panels alone, so rows past 64 get their logits from them too."""
    if not gemm_cpu.available():
        pytest.skip("needs the panel GEMM (AVX-512)")
    from asyncllm.backends.cpu import _greedy_head as greedy_head_cpu

    monkeypatch.setattr(greedy_head_cpu, "available", lambda: False)
    runner = TorchModelRunner(tiny_model_path(tiny_cache, "llama"), device="cpu", kv_cache_blocks=8)
    runner.load()
    try:
        model = runner.model
        assert model is not None and isinstance(model.greedy_head, gemm_cpu.PanelArgmaxHead)
        assert model.lm_head.packed_format == "panels"
        hidden = torch.randn(70, model.spec.hidden_size, generator=torch.Generator().manual_seed(1)) * 3
        assert torch.equal(model.greedy_head.argmax(hidden), model.logits(hidden).argmax(-1))
    finally:
        runner.close()


def test_the_fused_head_leaves_every_row_undecided_without_scratch_memory(monkeypatch: pytest.MonkeyPatch) -> None:
    """No scratch memory: every row -1, for the logits path to decide (as the bounded head does), not a failed step."""
    if not gemm_cpu.available():
        pytest.skip("needs the panel GEMM (AVX-512)")
    panels = gemm_cpu.PanelWeight(torch.randn(100, 16))

    def no_memory(*args: object, **kwargs: object) -> torch.Tensor:
        raise MemoryError("no memory for the argmax of 3 rows")

    monkeypatch.setattr(gemm_cpu, "panel_argmax", no_memory)
    head = gemm_cpu.PanelArgmaxHead(panels.buffer, 100, 100, in_features=16)
    assert head.argmax(torch.randn(3, 16)).tolist() == [-1, -1, -1]


def test_runner_keeps_torch_bfloat16_without_panels(tiny_cache: Path) -> None:
    runner = TorchModelRunner(
        tiny_model_path(tiny_cache, "llama"), device="cpu", dtype="bfloat16", kv_cache_blocks=8, packed_gemm=False
    )
    runner.load()
    try:
        assert runner.model is not None and not runner.bfloat16_weights
        assert runner.dtype == torch.bfloat16 and runner.model.lm_head.weight.dtype == torch.bfloat16
    finally:
        runner.close()


@needs_bfloat16_panels
@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral"])
def test_moe_model_keeps_its_experts_in_bfloat16(tiny_cache: Path, family: str) -> None:
    # The stacked experts (most of a MoE model's weights) are no Linear: beside bfloat16 panels they would become
    # float32, twice the memory dtype="bfloat16" asks for. Such a model stays on torch's bfloat16.
    runner = TorchModelRunner(tiny_model_path(tiny_cache, family), device="cpu", dtype="bfloat16", kv_cache_blocks=8)
    runner.load()
    try:
        assert runner.model is not None and not runner.bfloat16_weights
        experts = [param for name, param in runner.model.named_parameters() if ".experts." in name]
        assert experts and all(param.dtype == torch.bfloat16 for param in experts)
    finally:
        runner.close()


PROMPT_LENGTHS = (1, 3, 7, 12, 20, 33, 48, 70)


def _prompts(vocab_size: int, eos_ids: frozenset[int]) -> list[list[int]]:
    generator = torch.Generator().manual_seed(4321)
    allowed = torch.tensor([t for t in range(3, vocab_size) if t not in eos_ids])
    return [allowed[torch.randint(len(allowed), (n,), generator=generator)].tolist() for n in PROMPT_LENGTHS]


NEAR_TIE = 0.02
"""A logit gap below which another summation order may pick the runner-up token (see ``_assert_same_or_near_tie``)."""

DEFAULT_MODEL_NEAR_TIE = 0.2
"""``NEAR_TIE`` for SmolLM2, whose logits are larger than a tiny model's: in the reference itself (bfloat16 products
and KV), summing each linear layer exactly (float64) or in reverse order instead of MKL's order moved the top-two
gap of the three chat prompts' 72 tokens by 0.02 at the median and up to 0.18 (docs/performance-log.md,
"Twenty-eighth session")."""


def _assert_same_or_near_tie(
    got: list[list[int]], expected: list[list[int]], margins: list[list[float]], near_tie: float = NEAR_TIE
) -> None:
    """Each prompt's tokens equal transformers', or first differ where its top two logits were within ``near_tie``.

    Both sides round to bfloat16 at the same points, but sum in float32 in different orders: a sum a last bit
    apart can round to neighbouring bfloat16 values, a difference of 2**-8 relative, which a near tie turns into
    the other token (past that token the sequences are different prompts). Anything else is a wrong result.
    """
    for index, (ours, theirs, gaps) in enumerate(zip(got, expected, margins, strict=True)):
        first = next((i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b), None)
        if first is None:
            assert len(ours) == len(theirs), f"prompt {index}: {len(ours)} tokens against {len(theirs)}"
            continue
        assert gaps[first] < near_tie, f"prompt {index} differs at token {first}, where the gap was {gaps[first]:.4f}"


@needs_bfloat16_panels
@pytest.mark.anyio
@pytest.mark.parametrize("family", ["llama", "mistral", "qwen2", "qwen3"])
@pytest.mark.parametrize("variant", [{}, {"max_num_batched_tokens": 16}])
async def test_bfloat16_weights_match_transformers(tiny_cache: Path, family: str, variant: dict[str, int]) -> None:
    model_dir = tiny_model_path(tiny_cache, family)
    async with Engine.open(model_dir, device="cpu", dtype="bfloat16", **variant) as engine:
        assert engine._info is not None and "bfloat16 weights and KV cache" in engine._info.description
        prompts = _prompts(engine._info.vocab_size, engine._info.eos_token_ids)
        expected, margins = transformers_greedy_margins(
            model_dir, tuple(map(tuple, prompts)), 16, bfloat16_products=True, bfloat16_kv=True
        )
        got = await stream_all(engine, prompts, SamplingParams(temperature=0.0, max_tokens=16))
        stats = engine.statistics()
    exact = sum(ours == theirs for ours, theirs in zip(got, expected))
    print(f"{family} {variant}: {exact} of {len(prompts)} prompts token for token")
    _assert_same_or_near_tie(got, expected, margins)
    assert exact >= len(prompts) - 2
    assert stats.kv_blocks_free == stats.kv_blocks_total


@needs_bfloat16_panels
@pytest.mark.anyio
@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_default_model_in_bfloat16_matches_transformers() -> None:
    from asyncllm.default_model import default_model_path

    model_dir = default_model_path()
    questions = ("What is the capital of France?", "Write a haiku about the sea.", "List three prime numbers.")
    prompts = chat_prompts(model_dir, questions)
    expected, margins = transformers_greedy_margins(
        model_dir, tuple(map(tuple, prompts)), 24, bfloat16_products=True, bfloat16_kv=True
    )
    async with Engine.open(device="cpu", dtype="bfloat16", kv_cache_blocks=256) as engine:
        got = await stream_all(engine, prompts, SamplingParams(temperature=0.0, max_tokens=24))
        texts = [engine.tokenizer.decode(ids, skip_special_tokens=True) for ids in got]
    same = [ours == theirs for ours, theirs in zip(got, expected)]
    print("SmolLM2 in bfloat16, token for token:", same)
    _assert_same_or_near_tie(got, expected, margins, DEFAULT_MODEL_NEAR_TIE)
    assert sum(same) >= len(prompts) - 1
    assert "Paris" in texts[0]


@pytest.mark.skipif(not attention_cpu.bfloat16_kv_available(64), reason="no C compiler: no cpu attention kernels")
@pytest.mark.parametrize(("heads", "kv_heads", "head_dim"), [(9, 3, 64), (8, 2, 128), (6, 2, 24)])
def test_bfloat16_kv_kernels_equal_the_float32_ones_on_the_rounded_cache(
    heads: int, kv_heads: int, head_dim: int
) -> None:
    # Decodes, fresh prompts and chunks after cached history in one step: the bfloat16 cache's kernels read each
    # value as the float32 it rounds to, so they give the float32 kernels' bits on a cache of those values. The
    # step's own keys and values are rounded as they are written (in the cache and in place).
    generator = torch.Generator().manual_seed(head_dim)
    block_size, blocks = 16, 64
    cases = [(0, 17), (26, 34), (40, 1), (7, 1), (100, 1), (16, 5)]  # (history, new tokens)
    free = torch.randperm(blocks, generator=generator).tolist()
    cache32 = [torch.randn(blocks * block_size, kv_heads, head_dim, generator=generator) for _ in range(2)]
    cache32 = [c.bfloat16().float() for c in cache32]
    cache16 = [c.bfloat16() for c in cache32]
    tokens = sum(new for _, new in cases)
    q = torch.randn(tokens, heads, head_dim, generator=generator) * 3
    k, v = (torch.randn(tokens, kv_heads, head_dim, generator=generator) for _ in range(2))
    sequences = []
    for request_id, (history, new) in enumerate(cases):
        table = [free.pop() for _ in range(-(-(history + new) // block_size))]
        sequences.append(SequenceInput(request_id, [3] * new, history, table, True, SamplingParams()))
    meta = attention_cpu.build_metadata(step_inputs(sequences, block_size), sliding_window=None)
    k16, v16 = k.clone(), v.clone()
    reference_write_kv(*cache16, k16, v16, meta.slot_mapping)  # rounds k16 and v16 in place
    assert torch.equal(k16, k.bfloat16().float()) and torch.equal(v16, v.bfloat16().float())
    reference_write_kv(*cache32, k16, v16, meta.slot_mapping)
    assert torch.equal(cache16[0].float(), cache32[0]) and torch.equal(cache16[1].float(), cache32[1])
    got = attention_cpu.paged_attention(q, k16, v16, *cache16, meta, head_dim**-0.5)
    expected = attention_cpu.paged_attention(q, k16, v16, *cache32, meta, head_dim**-0.5)
    assert torch.equal(got, expected)
    assert not torch.equal(got, attention_cpu.paged_attention(q, k, v, *cache32, meta, head_dim**-0.5))


@needs_bfloat16_panels
def test_bfloat16_kv_cache_holds_twice_the_blocks(tiny_cache: Path) -> None:
    counts = {}
    for dtype in ("float32", "bfloat16"):
        model_dir = tiny_model_path(tiny_cache, "llama")
        runner = TorchModelRunner(model_dir, device="cpu", dtype=dtype, kv_cache_memory=1 << 24)
        try:
            counts[dtype] = runner.load().num_kv_blocks
        finally:
            runner.close()
    assert counts["bfloat16"] == 2 * counts["float32"]
