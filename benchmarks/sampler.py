"""The sampler at batch 256 x vocab 49,152 on the CPU: every feature on, against greedy.

    python benchmarks/sampler.py [--batch 256] [--vocab 49152] [--steps 5] [--threads N]

One step is what the runner asks of the sampler: ``record`` the tokens fed (one decode token per
request, after a 128-token prompt and 64 generated tokens) and ``sample`` the [batch, vocab]
logits. "All features" gives every request temperature, top_k, top_p, min_p, the three
penalties, a logit bias, allowed_token_ids, bad words (one- and two-token), min_tokens (EOS and
stop ids masked), its own seed and 5 logprobs. The peer is the same batch with greedy params.
Printed: the median step time of each and their ratio. Takes well under a minute.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

import torch

from asyncllm.executor._runner import SequenceInput
from asyncllm.sampling_params import SamplingParams
from asyncllm.worker._sampler import Sampler

PROMPT_LEN = 128
GENERATED = 64


def _all_features(rng: random.Random, vocab: int, index: int) -> SamplingParams:
    return SamplingParams(
        max_tokens=4096,
        min_tokens=GENERATED + 100,
        temperature=0.8,
        top_k=50,
        top_p=0.9,
        min_p=0.05,
        repetition_penalty=1.1,
        presence_penalty=0.5,
        frequency_penalty=0.3,
        logit_bias={rng.randrange(vocab): rng.uniform(-5, 5) for _ in range(10)},
        allowed_token_ids=tuple(rng.sample(range(vocab), vocab // 2)),
        stop_token_ids=(5, 6),
        seed=index,
        logprobs=5,
    )


def _sequences(
    params: list[SamplingParams], histories: list[list[int]], fed: list[int], start: int, vocab: int
) -> list[SequenceInput]:
    bad_words = ((7,), (8, 9), (vocab - 1, vocab - 2))
    return [
        SequenceInput(
            request_id=i,
            token_ids=[token],
            start_position=start,
            block_table=[],
            sample=True,
            params=p,
            prompt_token_ids=history[:PROMPT_LEN],
            bad_words_token_ids=bad_words if p.temperature > 0 else (),
        )
        for i, (p, history, token) in enumerate(zip(params, histories, fed))
    ]


def _run(params: list[SamplingParams], vocab: int, steps: int, seed: int) -> list[float]:
    """Median-ready step times (seconds) for ``steps`` steps after one warm-up."""
    rng = random.Random(seed)
    sampler = Sampler(torch.device("cpu"), vocab, frozenset({2}), seed=seed)
    histories = [[rng.randrange(vocab) for _ in range(PROMPT_LEN + GENERATED)] for _ in params]
    # Everything before the current step was fed by earlier steps (prefill, then decodes).
    sampler.record(
        [
            SequenceInput(i, h[:-1], 0, [], False, p, prompt_token_ids=h[:PROMPT_LEN])
            for i, (p, h) in enumerate(zip(params, histories))
        ]
    )
    logits = torch.randn(len(params), vocab, generator=torch.Generator().manual_seed(seed)) * 4.0
    times = []
    for step in range(steps + 1):
        start = PROMPT_LEN + GENERATED - 1 + step
        sequences = _sequences(params, histories, [h[-1] for h in histories], start, vocab)
        began = time.perf_counter()
        sampler.record(sequences)
        out = sampler.sample(logits, sequences)
        tokens = out.token_ids.tolist()  # the runner's host sync is part of the step
        elapsed = time.perf_counter() - began
        for history, token in zip(histories, tokens):
            history.append(token)
        if step:  # the first is warm-up
            times.append(elapsed)
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--vocab", type=int, default=49_152)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    rng = random.Random(0)
    featured = [_all_features(rng, args.vocab, i) for i in range(args.batch)]
    greedy = [SamplingParams(temperature=0.0, max_tokens=4096) for _ in range(args.batch)]
    with torch.inference_mode():
        greedy_times = _run(greedy, args.vocab, args.steps, seed=1)
        featured_times = _run(featured, args.vocab, args.steps, seed=1)
    greedy_s, featured_s = statistics.median(greedy_times), statistics.median(featured_times)
    print(
        f"sampler, batch {args.batch} x vocab {args.vocab:,} on CPU ({torch.get_num_threads()} threads), "
        f"median of {args.steps} steps"
    )
    print(f"  greedy:        {greedy_s * 1e3:8.2f} ms/step")
    print(f"  all features:  {featured_s * 1e3:8.2f} ms/step")
    print(f"  ratio (all features / greedy): {featured_s / greedy_s:.1f}x")


if __name__ == "__main__":
    main()
