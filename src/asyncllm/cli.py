"""The ``asyncllm`` command: ``asyncllm generate PROMPT`` streams a completion to the terminal."""

from __future__ import annotations

import argparse
import logging
import sys
import time
from collections.abc import Sequence

import anyio

from asyncllm.engine import Engine
from asyncllm.sampling_params import SamplingParams


def _add_engine_options(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("engine")
    group.add_argument("--model", default=None, help="local HF-format folder (default: SmolLM2-135M-Instruct)")
    group.add_argument("--device", default="auto", help="auto, cpu, cuda, cuda:N")
    group.add_argument("--dtype", default="auto", choices=["auto", "float32", "float16", "bfloat16"])
    group.add_argument("--block-size", type=int, default=16)
    group.add_argument("--max-num-seqs", type=int, default=256)
    group.add_argument("--max-num-batched-tokens", type=int, default=2048)
    group.add_argument("--max-model-len", type=int, default=None)
    group.add_argument("--kv-cache-blocks", type=int, default=None)
    group.add_argument("--backend", default="asyncio", choices=["asyncio", "trio"], help="event loop to run on")


def _open_engine(args: argparse.Namespace) -> Engine:
    return Engine.open(
        args.model,
        device=args.device,
        dtype=args.dtype,
        block_size=args.block_size,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_model_len=args.max_model_len,
        kv_cache_blocks=args.kv_cache_blocks,
    )


async def _generate(args: argparse.Namespace) -> None:
    params = SamplingParams(
        max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, seed=args.seed
    )
    async with _open_engine(args) as engine:
        prompt: str | list[int] = args.prompt
        if args.chat:
            prompt = _chat_prompt(engine, args.prompt)
        start = time.perf_counter()
        first_token_at = None
        num_tokens = 0
        async for chunk in engine.stream(prompt, params):
            if first_token_at is None:
                first_token_at = time.perf_counter()
            num_tokens += len(chunk.token_ids)
            sys.stdout.write(chunk.text)
            sys.stdout.flush()
        elapsed = time.perf_counter() - start
    sys.stdout.write("\n")
    decode_time = elapsed - ((first_token_at or start) - start)
    rate = (num_tokens - 1) / decode_time if num_tokens > 1 and decode_time > 0 else 0.0
    print(
        f"[{num_tokens} tokens in {elapsed:.2f} s; first token after {(first_token_at or start) - start:.3f} s; "
        f"{rate:.1f} tokens/s after it]",
        file=sys.stderr,
    )


def _chat_prompt(engine: Engine, text: str) -> list[int]:
    template = getattr(engine.tokenizer, "apply_chat_template", None)
    if template is None or not getattr(engine.tokenizer, "chat_template", None):
        raise SystemExit("this model's tokenizer has no chat template; drop --chat")
    encoded = template([{"role": "user", "content": text}], add_generation_prompt=True, tokenize=True, return_dict=True)
    return list(encoded["input_ids"])


def build_parser() -> argparse.ArgumentParser:
    """The command-line parser (exposed for tests and docs)."""
    parser = argparse.ArgumentParser(prog="asyncllm", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    generate = commands.add_parser("generate", help="stream a completion of PROMPT to the terminal")
    generate.add_argument("prompt")
    generate.add_argument("--max-tokens", type=int, default=128)
    generate.add_argument("--temperature", type=float, default=0.0)
    generate.add_argument("--top-p", type=float, default=1.0)
    generate.add_argument("--top-k", type=int, default=0)
    generate.add_argument("--seed", type=int, default=None)
    generate.add_argument("--chat", action="store_true", help="wrap PROMPT in the model's chat template")
    _add_engine_options(generate)
    return parser


def main(argv: Sequence[str] | None = None) -> None:
    """Entry point of the ``asyncllm`` command."""
    args = build_parser().parse_args(argv)
    # Progress (model conversion, loading) goes to stderr; the completion alone goes to stdout.
    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stderr)
    if args.command == "generate":
        anyio.run(_generate, args, backend=args.backend)


if __name__ == "__main__":
    main()
