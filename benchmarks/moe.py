"""The MoE layer against a dense MLP of the same active parameters, and against transformers' block.

    python benchmarks/moe.py [--hidden 1024] [--experts 32] [--top-k 4] [--intermediate 512]
                             [--tokens 1 16 256 2048] [--repeats 20] [--threads N] [--device cpu]
                             [--fused]

The MoE layer is ``asyncllm.models._moe.SparseMoeBlock`` (router, top-k, experts grouped by id); the
dense peer is ``asyncllm.models._llama.MLP`` with ``top_k * intermediate`` columns, so each token
multiplies by as many weights in both. Transformers' ``Qwen3MoeSparseMoeBlock`` (its default experts
implementation) on the same weights is the third column. Printed per token count: the median forward
time of each, and the MoE layer over the dense one. Takes about a minute on a few CPU cores.

``--fused`` adds a column: the same block running its experts in the fused-MoE Triton kernels
(``SparseMoeBlock.fused``, what the triton backend runs), checked against the torch path first. It
needs triton, and a GPU (``--device cuda``) to mean anything: on a CPU the kernels run only in
triton's interpreter (``TRITON_INTERPRET=1``), slowly.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch

from asyncllm.models._llama import MLP, DecoderSpec
from asyncllm.models._moe import MoeSpec, SparseMoeBlock


def _median_seconds(run: Callable[[], torch.Tensor], repeats: int, device: torch.device) -> float:
    run()  # warm-up
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        run()
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--experts", type=int, default=32)
    parser.add_argument("--top-k", type=int, default=4)
    parser.add_argument("--intermediate", type=int, default=512, help="each expert's width")
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 16, 256, 2048])
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--fused", action="store_true", help="also time the fused-MoE Triton kernels")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    from transformers import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

    moe_spec = MoeSpec(
        num_experts=args.experts,
        top_k=args.top_k,
        intermediate_size=args.intermediate,
        norm_topk_prob=True,
        sparse_layers=(True,),
        weights_in_router_dtype=True,
        checkpoint_style="qwen3_moe",
    )
    dense_spec = DecoderSpec(
        architecture="bench", vocab_size=1, hidden_size=args.hidden, intermediate_size=args.top_k * args.intermediate,
        num_layers=1, num_heads=1, num_kv_heads=1, head_dim=args.hidden, rms_norm_eps=1e-6, rope={},
        attention_bias=False, qk_norm=False, sliding_window=None, tie_word_embeddings=False, hidden_act="silu",
    )  # fmt: skip
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        moe = SparseMoeBlock(moe_spec, args.hidden, "silu")
        dense = MLP(dense_spec)
        for module in (moe, dense):
            for param in module.parameters():
                param.copy_(torch.randn(param.shape, generator=generator) / param.shape[-1] ** 0.5)
        config = Qwen3MoeConfig(
            hidden_size=args.hidden, num_experts=args.experts, num_experts_per_tok=args.top_k,
            moe_intermediate_size=args.intermediate, norm_topk_prob=True,
        )  # fmt: skip
        reference = Qwen3MoeSparseMoeBlock(config)
        reference.gate.weight.copy_(moe.gate.weight)
        reference.experts.gate_up_proj.copy_(moe.experts.gate_up_proj)
        reference.experts.down_proj.copy_(moe.experts.down_proj)
        moe, dense, reference = moe.to(device).eval(), dense.to(device).eval(), reference.to(device).eval()
        print(
            f"hidden {args.hidden}, {args.experts} experts of {args.intermediate}, top-{args.top_k}; "
            f"dense MLP of {args.top_k * args.intermediate}; {torch.get_num_threads()} threads, {device}"
        )
        fused_header = f" {'fused ms':>9}" if args.fused else ""
        print(f"{'tokens':>7} {'moe ms':>9} {'dense ms':>9} {'hf moe ms':>10} {'moe/dense':>10}{fused_header}")
        for tokens in args.tokens:
            x = torch.randn(tokens, args.hidden, generator=generator).to(device)
            expected = reference(x[None])[0]
            torch.testing.assert_close(moe(x), expected, rtol=1e-4, atol=1e-4)
            moe_s = _median_seconds(lambda x=x: moe(x), args.repeats, device)
            dense_s = _median_seconds(lambda x=x: dense(x), args.repeats, device)
            hf_s = _median_seconds(lambda x=x: reference(x[None]), args.repeats, device)
            fused = ""
            if args.fused:
                moe.fused = True
                torch.testing.assert_close(moe(x), expected, rtol=1e-4, atol=1e-4)
                fused = f" {_median_seconds(lambda x=x: moe(x), args.repeats, device) * 1e3:>9.3f}"
                moe.fused = False
            print(f"{tokens:>7} {moe_s * 1e3:>9.3f} {dense_s * 1e3:>9.3f} {hf_s * 1e3:>10.3f} {moe_s / dense_s:>10.2f}"
                  f"{fused}")  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
