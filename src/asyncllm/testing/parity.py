"""Greedy parity with HF transformers: the tokens transformers generates for a model folder, and the
engine's for the same prompts, gathered the same way by every family's test.

    expected = transformers_greedy(model_dir, tuple(map(tuple, prompts)), max_new_tokens=16)
    got = await stream_all(engine, prompts, SamplingParams(temperature=0.0, max_tokens=16))
    assert got == expected
"""

from __future__ import annotations

from functools import cache
from pathlib import Path
from typing import TYPE_CHECKING

import anyio
import torch

if TYPE_CHECKING:
    from asyncllm import Engine, SamplingParams

__all__ = ["stream_all", "transformers_greedy"]


@cache
def transformers_greedy(
    model_dir: Path,
    prompts: tuple[tuple[int, ...], ...],
    max_new_tokens: int,
    dtype: torch.dtype = torch.float32,
    bfloat16_products: bool = False,
) -> list[list[int]]:
    """The new tokens of ``generate(do_sample=False)`` for each prompt, one prompt at a time (no padding
    to change the numbers); cached per arguments, since a model's tests share their prompts.

    With ``bfloat16_products`` (float32 only) the model computes as the engine's bfloat16 weights on the
    CPU do (``TorchModelRunner.bfloat16_weights``): every weight rounded to bfloat16, every linear layer's
    input rounded to bfloat16 too, everything else float32.
    """
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).eval()
    if bfloat16_products:
        _compute_in_bfloat16_products(model)
    outputs = []
    with torch.inference_mode():
        for prompt in prompts:
            ids = torch.tensor([prompt])
            out = model.generate(
                ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens, do_sample=False
            )
            outputs.append(out[0, len(prompt) :].tolist())
    return outputs


def _compute_in_bfloat16_products(model: torch.nn.Module) -> None:
    """Round ``model``'s float32 weights to bfloat16 values and each linear layer's input likewise (a hook)."""

    def round_input(module: torch.nn.Module, args: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
        return (args[0].to(torch.bfloat16).to(args[0].dtype), *args[1:])

    with torch.no_grad():
        for param in model.parameters():
            param.copy_(param.to(torch.bfloat16))
    for module in model.modules():
        if isinstance(module, torch.nn.Linear):
            module.register_forward_pre_hook(round_input)


async def stream_all(engine: Engine, prompts: list[list[int]], params: SamplingParams) -> list[list[int]]:
    """Every prompt's generated tokens, the requests added in prompt order before any is consumed.

    The order matters: the scheduler then sees the same arrivals on asyncio and on trio (which runs
    ready tasks in a random order), so a test whose cache must overflow really preempts on both.
    """
    streams = [engine.stream(prompt, params) for prompt in prompts]
    results: list[list[int]] = [[] for _ in prompts]

    async def consume(index: int) -> None:
        async with streams[index] as stream:
            async for chunk in stream:
                results[index].extend(chunk.token_ids)

    async with anyio.create_task_group() as task_group:
        for index in range(len(prompts)):
            task_group.start_soon(consume, index)
    return results
