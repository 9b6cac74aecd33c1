"""Greedy parity with HF transformers: the tokens transformers generates for a model folder, and the
engine's for the same prompts, gathered the same way by every family's test.

    expected = transformers_greedy(model_dir, tuple(map(tuple, prompts)), max_new_tokens=16)
    got = await stream_all(engine, prompts, SamplingParams(temperature=0.0, max_tokens=16))
    assert got == expected
"""

from __future__ import annotations

import sys
from collections.abc import Iterator, Sequence
from contextlib import contextmanager, nullcontext
from functools import cache
from pathlib import Path
from typing import TYPE_CHECKING, Any

import anyio
import torch

if TYPE_CHECKING:
    from asyncllm import Engine, SamplingParams

__all__ = ["chat_prompts", "stream_all", "transformers_greedy", "transformers_greedy_margins"]


def transformers_greedy(
    model_dir: Path,
    prompts: tuple[tuple[int, ...], ...],
    max_new_tokens: int,
    dtype: torch.dtype = torch.float32,
    bfloat16_products: bool = False,
    bfloat16_kv: bool = False,
) -> list[list[int]]:
    """The new tokens of ``generate(do_sample=False)`` for each prompt, one prompt at a time (no padding
    to change the numbers); cached per arguments, since a model's tests share their prompts.

    With ``bfloat16_products`` (float32 only) the model computes as the engine's bfloat16 weights on the
    CPU do (``TorchModelRunner.bfloat16_weights``): every weight rounded to bfloat16, every linear layer's
    input rounded to bfloat16 too, everything else float32. With ``bfloat16_kv`` the keys (after rotary) and
    values are rounded to bfloat16 as well, as a bfloat16 KV cache holds them (``TorchModelRunner.kv_dtype``).
    """
    return transformers_greedy_margins(model_dir, prompts, max_new_tokens, dtype, bfloat16_products, bfloat16_kv)[0]


@cache
def transformers_greedy_margins(
    model_dir: Path,
    prompts: tuple[tuple[int, ...], ...],
    max_new_tokens: int,
    dtype: torch.dtype = torch.float32,
    bfloat16_products: bool = False,
    bfloat16_kv: bool = False,
) -> tuple[list[list[int]], list[list[float]]]:
    """``transformers_greedy``'s tokens, and per token the gap between its logit and the runner-up's: where
    that gap is tiny, any other summation order may pick the other token (bfloat16 rounding widens such
    differences, so tests of rounded arithmetic allow a first difference only there)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).eval()
    if bfloat16_products:
        _compute_in_bfloat16_products(model)
    outputs, margins = [], []
    with torch.inference_mode(), _keys_and_values_in_bfloat16(model) if bfloat16_kv else nullcontext():
        for prompt in prompts:
            ids = torch.tensor([prompt])
            out = model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=max_new_tokens,
                do_sample=False,
                output_logits=True,
                return_dict_in_generate=True,
            )
            outputs.append(out.sequences[0, len(prompt) :].tolist())
            top = [torch.topk(logits[0].float(), 2).values for logits in out.logits]
            margins.append([float(values[0] - values[1]) for values in top])
    return outputs, margins


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


@contextmanager
def _keys_and_values_in_bfloat16(model: torch.nn.Module) -> Iterator[None]:
    """Round ``model``'s keys after rotary and its values to bfloat16 while the block runs: its family's
    ``apply_rotary_pos_emb`` wrapped (a module global, restored after), ``v_proj``'s output hooked."""
    attention = next(m for m in model.modules() if type(m).__name__.endswith("Attention"))
    family: Any = sys.modules[type(attention).__module__]
    rotate = family.apply_rotary_pos_emb

    def rotate_then_round(q: torch.Tensor, k: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        q, k = rotate(q, k, *args, **kwargs)
        return q, k.to(torch.bfloat16).to(k.dtype)

    def round_output(module: torch.nn.Module, args: Any, output: torch.Tensor) -> torch.Tensor:
        return output.to(torch.bfloat16).to(output.dtype)

    projections = [getattr(m, "v_proj", None) for m in model.modules()]
    hooks = [p.register_forward_hook(round_output) for p in projections if isinstance(p, torch.nn.Module)]
    family.apply_rotary_pos_emb = rotate_then_round
    try:
        yield
    finally:
        family.apply_rotary_pos_emb = rotate
        for hook in hooks:
            hook.remove()


def chat_prompts(model_dir: Path, questions: Sequence[str]) -> list[list[int]]:
    """Each question as one user message through ``model_dir``'s chat template, with the generation prompt: the
    token ids a chat request would send."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    prompts = []
    for question in questions:
        encoded: Any = tokenizer.apply_chat_template(
            [{"role": "user", "content": question}], add_generation_prompt=True, tokenize=True, return_dict=True
        )
        prompts.append(list(encoded["input_ids"]))
    return prompts


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
