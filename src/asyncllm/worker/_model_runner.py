"""``TorchModelRunner``: the real runner. Flat mixed batches in, sampled token ids out.

It runs on the engine's device thread only. Each step it turns the scheduler's per-request slices
into flat tensors (input ids, positions, slot mapping, attention metadata) through a persistent
``InputBatch`` (block tables kept across steps; a step writes only what changed), runs the model once
on the whole mixed prefill/decode batch, computes logits only at the positions that sample, and samples.
Pooling (embedding) sequences ride in the same batch: their rows of the final hidden states (after the
final norm, before the LM head) are pooled instead of sampled.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
import os
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from msgspec import to_builtins

from asyncllm.backends import AttentionBackend, TritonAttentionBackend, create_backend, resolve_attention_backend

# The torch backend's metadata builder, under the name tests and benchmarks have imported it by.
from asyncllm.engine._options import EngineOptions
from asyncllm.errors import DeviceOutOfMemoryError
from asyncllm.executor._lookahead import PLACEHOLDER
from asyncllm.executor._runner import (
    PooledVector,
    PositionLogprobs,
    RunnerInfo,
    RunnerTimings,
    SequenceInput,
    StepBatch,
    StepOutput,
    VerifiedDraft,
)
from asyncllm.models import DecoderForCausalLM, DecoderSpec, model_spec
from asyncllm.models._linear import Linear, PackedFormat
from asyncllm.models._parallel import SINGLE, TensorParallel
from asyncllm.sampling_params import SamplingParams
from asyncllm.worker._device_ops import CpuOps, DeviceOps, device_ops
from asyncllm.worker._graphs import DecodeGraphs, capture_sizes
from asyncllm.worker._input_batch import InputBatch, StepInputs
from asyncllm.worker._memory import (
    DEFAULT_CUDA_FRACTION,
    PREFAULT_QUIET_SECONDS,
    PREFAULT_ROUND_BYTES,
    KVCacheSizing,
    Prefault,
    cuda_memory,
    host_available_bytes,
    mapped_tensor,
    peak_resident_bytes,
    plan_kv_blocks,
    reset_peak_rss,
    resident_bytes,
    size_kv_cache,
    split_hybrid_blocks,
)
from asyncllm.worker._sampler import Sampler
from asyncllm.worker._weights import checkpoint_tensors, load_config, load_eos_token_ids, load_model

if TYPE_CHECKING:
    from asyncllm.backends.cpu._pool import KernelPool
    from asyncllm.executor._ranks import RankProcesses, TableSync
    from asyncllm.worker._cpu_threads import ThreadGovernor
    from asyncllm.worker._parallel import ProcessGroupCollectives

logger = logging.getLogger("asyncllm")

KERNEL_POOL_SPIN = 30_000
"""Spins a kernel pool helper waits for the next job before it sleeps (``KernelPool``): OpenMP's spin count as the
engine sets it (``worker._cpu_threads.OPENMP_SPIN_COUNT``), which covers the gaps between a step's kernels."""

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def resolve_device(device: str) -> torch.device:
    """``"auto"`` is CUDA when available, else the CPU; anything else is passed to torch."""
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def resolve_dtype(dtype: str, device: torch.device) -> torch.dtype:
    """``"auto"`` is bfloat16 on CUDA and float32 on the CPU."""
    if dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if dtype not in _DTYPES:
        raise ValueError(f"dtype must be 'auto' or one of {sorted(_DTYPES)}, got {dtype!r}")
    return _DTYPES[dtype]


@dataclass(frozen=True, slots=True)
class ForwardSwitches:
    """The CPU forward's fast paths, each on by default.

    Not engine options: every user should run the defaults; benchmarks and tests turn one off to
    measure or check it against the plain path.

    Attributes:
        fuse_projections: Run q/k/v and gate/up as one matmul each (``fuse_projections()`` after
            loading). False keeps HF's separate projections (for comparisons).
        packed_gemm: On the CPU in float32, pack every linear weight once for a packed GEMM
            (``asyncllm.models._linear``; compiled graphs call it too). True takes the best this
            machine has: with the panels (AVX-512, or AVX2 with FMA) and MKL's exported packed GEMM
            on an Intel CPU, both copies (decode-sized inputs on ``gemm_cpu``'s column panels,
            prefill-sized ones on MKL's layout) while the second copy takes at most a quarter of the
            available memory, else the panels alone; MKL's alone without AVX-512 or AVX2. "both",
            "panels" or "mkl" asks for one (for comparisons; a format the machine lacks leaves the
            weights unpacked). False keeps ``F.linear``.
        fused_norm: On the triton and cpu backends with eager layers, fuse each residual add into
            the RMSNorm after it and rotate q/k in place, one kernel each
            (``DecoderForCausalLM.fused_norm``). False keeps torch's element-wise ops (for comparisons).
        greedy_head: With packed panels on a CPU with AMX or AVX512-BF16, greedy rows take their token from
            ``backends.cpu._greedy_head`` (the argmax of the float32 logits, exactly, without computing
            them all); beside bfloat16 panels, and in float32 on AVX-512 or AVX2 without those units, from the
            output projection's GEMM with the argmax fused in (``gemm_cpu.PanelArgmaxHead``: no logits
            stored). False computes every row's logits (for comparisons).
    """

    fuse_projections: bool = True
    packed_gemm: bool | PackedFormat = True
    fused_norm: bool = True
    greedy_head: bool = True


class TorchModelRunner:
    """Runs one of ``asyncllm.models`` over a paged KV cache.

    Args:
        model_path: A local HF-format folder (config.json, *.safetensors).
        options: The engine's options (``EngineOptions``): the runner reads the device, dtype, KV
            cache, batch, backend, graph, compile and thread options from them.
        switches: The forward's fast paths (``ForwardSwitches``), all on unless a comparison turns
            one off.
        ranks: With ``tensor_parallel_size`` > 1, on rank 0 (the engine's device thread): the other ranks'
            processes, which this runner drives (each step is sent to them before its forward).
        rank: This runner's rank; ranks other than 0 run in the rank processes
            (``asyncllm.worker._rank``), load with ``load_rank`` and follow rank 0's messages.
        store_port: Ranks other than 0: the port of rank 0's ``torch.distributed`` store.
        spec: Ranks other than 0: the model's ``DecoderSpec``, read off its config by rank 0.
        **option_overrides: ``EngineOptions`` fields that replace those of ``options`` (or build
            them, with ``options`` None), and ``ForwardSwitches`` fields that replace those of
            ``switches``: how tests and benchmarks construct runners.
    """

    def __init__(
        self,
        model_path: Path,
        options: EngineOptions | None = None,
        *,
        switches: ForwardSwitches | None = None,
        ranks: RankProcesses | None = None,
        rank: int = 0,
        store_port: int | None = None,
        spec: DecoderSpec | None = None,
        **option_overrides: Any,
    ) -> None:
        switch_names = {f.name for f in dataclasses.fields(ForwardSwitches)}
        switched = {k: option_overrides.pop(k) for k in list(option_overrides) if k in switch_names}
        if options is None:
            options = EngineOptions.from_keywords(**option_overrides)
        elif option_overrides:
            options = dataclasses.replace(options, **option_overrides)
        self.options = options
        self.switches = dataclasses.replace(switches if switches is not None else ForwardSwitches(), **switched)
        self.model_path = Path(model_path)
        self.block_size = options.block_size
        # The cache is never sized beyond what max_num_seqs sequences of max_model_len can hold.
        self.max_tokens_in_cache = options.max_num_seqs * (options.max_model_len or 1 << 20)
        self.kv_sizing: KVCacheSizing | None = None
        self.attention_backend = options.attention_backend
        """The attention backend's name: the option, then what it resolved to at load."""
        self.num_threads = options.num_threads
        """torch's threads on the CPU: the option, then the count set at load (the governor's most)."""
        self.thread_governor: ThreadGovernor | None = None
        """On the CPU with the automatic thread count: fewer threads while other work holds the CPUs, set before
        each step (an explicit ``num_threads`` or ``OMP_NUM_THREADS`` is kept as it is, and so is the count of
        compiled layers, ``compile=True``)."""
        self.num_packed_layers = 0
        """Linear layers running from packed weights (0: all on ``F.linear``)."""
        self.packed_format: PackedFormat | None = None
        """The packed weights the linear layers run from ("both", "panels" or "mkl"), once loaded; None:
        ``F.linear``."""
        self.bfloat16_weights = False
        """On the CPU with ``dtype="bfloat16"``: the weights hold bfloat16 values and the linear layers run on
        bfloat16 panels, while activations, the KV cache and the rest of the arithmetic stay float32
        (``self.dtype``); decided at load (``_bfloat16_on_panels``)."""
        self.kv_dtype: torch.dtype | None = None
        """The KV cache's dtype, once loaded: the model's, but bfloat16 beside bfloat16 weights on the cpu
        attention backend (its kernels read bfloat16 keys and values into float32 arithmetic: half the
        bytes a decode step streams, twice the tokens a cache holds)."""
        self.timings = RunnerTimings()
        """Seconds spent preparing inputs, in the forward and sampling, over all steps."""
        self.compile_seconds = 0.0
        self.graphs: DecodeGraphs | None = None
        self.kernel_pool: KernelPool | None = None
        """The lean forward's pool for decode-sized steps on the CPU (``_start_kernel_pool``), joined by ``close``."""
        self._pooled_heads: list[Linear] = []
        """The heads whose logits run on the kernel pool during its steps (``_on_kernel_pool``)."""
        self._step_threads: int | None = None
        """torch's thread count outside the kernel pool's step now running, None outside one."""
        self.backend: AttentionBackend[Any] | None = None
        """The attention backend object picked at load (``asyncllm.backends``), which the model calls and
        the graphs build their metadata with; ``attention_backend`` is then its name."""
        self.model: DecoderForCausalLM | None = None
        self.kv_caches: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.kv_prefault: Prefault | None = None
        """On the CPU: the thread faulting in the serving KV cache (``EngineOptions.kv_cache_prefault``)."""
        self._resident_waits = 0
        """Serving caches waited for so far (``kv_cache_prefault_wait``): each rank counts the same allocations,
        in the same order, so the count names the barrier where the ranks meet once theirs are resident."""
        self.last_step_started = -math.inf
        """``time.monotonic()`` when ``launch`` (``forward_step`` on other ranks) last began a step."""
        self.last_step_ended = -math.inf
        """``time.monotonic()`` when the last step's ``launch`` (``forward_step``) returned or raised: the
        prefault holds off while a step runs and for ``PREFAULT_QUIET_SECONDS`` after one."""
        self.sampler: Sampler | None = None
        self.input_batch = InputBatch(options.block_size, max_num_seqs=options.max_num_seqs)
        self.sliding_batch: InputBatch | None = None
        """With a sliding group (``RunnerInfo.sliding_group``), the sliding layers' block tables."""
        self.sliding_group: tuple[int, int] | None = None
        """``(window, blocks)`` of the sliding layers' pool, once loaded, where the model has one."""
        self.ops: DeviceOps = CpuOps()
        """Host-device copies and synchronisation (``DeviceOps``), set for the device at load."""
        self._pool_sums: dict[int, tuple[torch.Tensor, int]] = {}
        """Mean-pooling requests part-way through their prompt: the float32 sum of their rows so far and
        how many rows it holds."""
        if options.tensor_parallel_size > 1 and rank == 0 and ranks is None:
            raise ValueError("rank 0 of a tensor-parallel runner needs the other ranks' processes (ranks=)")
        self.ranks = ranks
        self.rank = rank
        self._store_port = store_port
        self._spec = spec
        self.parallel: TensorParallel = SINGLE
        """This rank's place in the model (``models._parallel``), once loaded."""
        self.collectives: ProcessGroupCollectives | None = None
        """The ranks' collectives (with the time spent in them), once loaded; None with one rank."""
        self.draft: DraftModel | None = None
        """``speculative_method="draft_model"``: the draft model beside the target, once loaded."""
        self._tables: TableSync | None = None  # rank 0: what the other ranks hold of the block tables
        self._hidden: torch.Tensor | None = None  # other ranks: the last step's final hidden states

    def _load_model(self) -> tuple[Any, DecoderForCausalLM]:
        """Everything every rank does at load: device, threads, the ranks' group, the model (the rank's
        shard of it), its attention backend and packed weights.

        Returns:
            The HF config (None on ranks other than 0: they get the model's spec from rank 0) and the model.
        """
        size = self.options.tensor_parallel_size
        device = resolve_device(self.options.device)
        if size > 1:
            from asyncllm.worker._parallel import rank_device

            device = rank_device(device, self.rank)
        dtype = resolve_dtype(self.options.dtype, device)
        requested_backend = self.attention_backend
        backend_name = resolve_attention_backend(requested_backend, device, cpu_kernel=True)
        if device.type == "cpu":
            from asyncllm.worker._cpu_threads import ThreadGovernor, configure_cpu_threads, default_cpu_threads

            threads = self.options.num_threads
            automatic = threads is None and not os.environ.get("OMP_NUM_THREADS")
            if automatic and size > 1:
                threads = max(1, default_cpu_threads() // size)  # the ranks share the host's CPUs
            self.num_threads = configure_cpu_threads(threads)
            # Not under compile: inductor's kernels split one long row's reduction over the threads of the call
            # (other bits at another count) or fix the count they were compiled with (out of the governor's reach).
            automatic = automatic and not self.options.compile
            if automatic and self.num_threads > 1:
                self.thread_governor = ThreadGovernor(self.num_threads)
        if device.type == "cuda":
            # This runs on the device thread, and torch's current stream is per thread: every later
            # call of this runner (all on the same thread) issues its work to this one stream.
            torch.cuda.set_device(device)
            torch.cuda.set_stream(torch.cuda.Stream(device))
        config = load_config(self.model_path) if self._spec is None else None
        spec = self._spec if config is None else model_spec(config)
        assert spec is not None  # rank 0 reads its config, the other ranks get rank 0's spec
        self.bfloat16_weights = self._bfloat16_on_panels(device, dtype, spec)
        if self.bfloat16_weights:
            dtype = torch.float32  # the computation's: the weights load in bfloat16, packing converts the rest
        if size > 1:
            from asyncllm.executor._ranks import TableSync
            from asyncllm.worker._parallel import open_group

            ranks = self.ranks
            self.collectives = open_group(
                rank=self.rank,
                size=size,
                device=device,
                timeout=self.options.step_timeout,
                store_port=self._store_port,
                announce=None if ranks is None else lambda host, port: ranks.start_group(host, port, to_builtins(spec)),
                abandon=None if ranks is None else ranks.failure,
            )
            self.parallel = TensorParallel(self.rank, size, self.collectives)
            self._tables = TableSync(self.block_size)
        # Weights are allocated once, in their dtype and fused layout, and filled a slice at a time: the
        # load's peak is the weights' size (see ``_weights.load_model``). A rank loads its shard alone.
        model = load_model(
            spec,
            checkpoint_tensors(self.model_path),
            device=device,
            dtype=torch.bfloat16 if self.bfloat16_weights else dtype,
            fuse_projections=self.switches.fuse_projections,
            parallel=self.parallel,
        )
        model.fused_norm = self.switches.fused_norm  # before any CUDA graph is captured: graphs keep their path
        spec = model.spec
        backend = self.backend = model.backend = create_backend(
            backend_name,
            device=device,
            dtype=dtype,
            head_dim=spec.head_dim,
            num_kv_heads=model.local_heads[1],
            sliding_window=spec.sliding_window,
            requested=requested_backend == backend_name,
            attn_softcap=spec.attn_softcap,
        )
        self.attention_backend = backend.name
        self.kv_dtype = dtype
        if self.bfloat16_weights and backend.name == "cpu":
            from asyncllm.backends.cpu import _attention as attention_cpu

            if attention_cpu.bfloat16_kv_available(spec.head_dim):
                self.kv_dtype = torch.bfloat16
        packed = self.switches.packed_gemm
        if packed is not False and device.type == "cpu" and dtype == torch.float32:
            self.num_packed_layers = model.pack_weights(
                None if packed is True else packed,
                greedy_head=self.switches.greedy_head,
                bfloat16=self.bfloat16_weights,
            )
            # The layers' format (the output projection keeps the panels alone beside a greedy head).
            formats = {m.packed_format for m in model.model.modules() if isinstance(m, Linear) and m.packed_format}
            self.packed_format = formats.pop() if len(formats) == 1 else None
        self.model = model
        self.device, self.dtype = device, dtype
        if self.ops.device != device:  # a seam set before load (tests) is kept
            self.ops = device_ops(device)
        if self.collectives is not None:  # every rank holds its shard before the engine is ready
            self.collectives.barrier("loaded", None if self.ranks is None else self.ranks.failure)
        return config, model

    def load(self) -> RunnerInfo:
        """Build the model, load its weights and allocate the KV cache (on the device thread); with
        ``kv_cache_prefault_wait``, return once the cache is resident (seconds per GiB where the host backs
        memory on first touch, and not interruptible: the device thread is busy with it).

        With ``tensor_parallel_size`` > 1 this is rank 0: it meets the other ranks, loads its shard,
        and drives them through the KV cache's sizing and allocation.

        Raises:
            WorkerDiedError: Another rank exited during the load.
        """
        try:
            return self._load()
        except BaseException as exc:
            # The engine never closes a runner whose load failed: a prefault started with the cache ends here.
            self._stop_kv_prefault()
            if self.ranks is None or not isinstance(exc, RuntimeError):
                raise
            failure = self.ranks.explain(exc)  # a collective or pipe that failed: say which rank died, if one did
            if failure is exc:
                raise
            raise failure from exc

    def _load(self) -> RunnerInfo:
        config, model = self._load_model()
        assert config is not None
        device, dtype, spec, backend = self.device, self.dtype, model.spec, self.backend
        assert backend is not None
        eos_token_ids = load_eos_token_ids(self.model_path, config)
        self.sampler = Sampler(device, model.spec.vocab_size, eos_token_ids, self.options.seed, self.ops)
        if self.options.speculative_method == "draft_model":
            self.draft = self._load_draft(config, model, backend.name)
        hybrid = self._frees_hybrid(spec)
        if hybrid:  # the probe's table covers both groups
            self.sliding_batch = InputBatch(self.block_size, max_num_seqs=self.options.max_num_seqs)
        assert self.kv_dtype is not None
        num_blocks = self.options.kv_cache_blocks or self._size_kv_cache(model, device, self.kv_dtype)
        sliding_blocks = None
        if hybrid:
            assert spec.sliding_window is not None
            num_sliding = sum(spec.layer_is_sliding(i) for i in range(spec.num_layers))
            num_blocks, sliding_blocks = split_hybrid_blocks(
                num_blocks,
                num_global_layers=spec.num_layers - num_sliding,
                num_sliding_layers=num_sliding,
                sliding_window=spec.sliding_window,
                block_size=self.block_size,
                max_num_seqs=self.options.max_num_seqs,
                max_num_batched_tokens=self.options.max_num_batched_tokens,
            )
            self.sliding_group = (spec.sliding_window, sliding_blocks)
            logger.info(
                "hybrid KV cache: %d blocks for the global layers, %d for the sliding ones (window %d)",
                num_blocks,
                sliding_blocks,
                spec.sliding_window,
            )
        slots = num_blocks * self.block_size
        self.kv_caches = self._allocate_kv_cache(num_blocks, sliding_blocks, prefault=True)
        max_model_len = int(getattr(config, "max_position_embeddings", 2048))
        # Fresh rows (the sizing probe is gone), as wide as the longest table the cache can hold.
        longest = min(max_model_len, self.options.max_model_len or max_model_len, slots)
        self.input_batch = InputBatch(
            self.block_size, max_num_seqs=self.options.max_num_seqs, max_blocks_per_seq=-(-longest // self.block_size)
        )
        if hybrid:
            self.sliding_batch = InputBatch(
                self.block_size,
                max_num_seqs=self.options.max_num_seqs,
                max_blocks_per_seq=-(-longest // self.block_size),
            )
        if self.draft is not None:  # fresh rows, as wide as the target's
            self.draft.batch, self.draft.pass_batch = (
                InputBatch(
                    self.block_size,
                    max_num_seqs=self.options.max_num_seqs,
                    max_blocks_per_seq=-(-longest // self.block_size),
                )
                for _ in range(2)
            )
        if device.type == "cuda" and isinstance(backend, TritonAttentionBackend):  # every kernel variant, now
            global_layers = spec.sliding_window is not None and spec.uniform_sliding_window is None
            backend.warm_up(num_heads=model.local_heads[0], head_dim=spec.head_dim, dtype=dtype,
                            block_size=self.block_size, max_model_len=longest,
                            max_num_seqs=self.options.max_num_seqs, global_layers=global_layers)  # fmt: skip
        if device.type == "cuda" and isinstance(backend, TritonAttentionBackend) and spec.moe is not None:
            backend.warm_up_moe(num_experts=spec.moe.num_experts, top_k=spec.moe.top_k, hidden_size=spec.hidden_size,
                                intermediate_size=spec.moe.intermediate_size, dtype=dtype)  # fmt: skip
        if self.options.compile:
            from asyncllm.worker._compile import compile_dense_parts

            self.compile_seconds = compile_dense_parts(model)
        # The torch MoE path reads its per-expert token counts on the host (``models._moe``), which a CUDA
        # graph cannot capture; the fused kernels' layout reads nothing back, so on their backend a MoE
        # model decodes in graphs too. A tensor-parallel model decodes eagerly (its collectives are not
        # captured).
        capturable = (spec.moe is None or backend.runs_fused_moe) and not self.parallel.sharded
        if device.type == "cuda" and backend.captures_graphs and not self.options.enforce_eager and capturable:
            longest = min(max_model_len, self.options.max_model_len or max_model_len, slots)
            self.graphs = self._capture_graphs(model, longest)
        self._start_kernel_pool(model, -(-longest // self.block_size))
        return RunnerInfo(
            num_kv_blocks=num_blocks,
            block_size=self.block_size,
            vocab_size=spec.vocab_size,
            max_model_len=int(getattr(config, "max_position_embeddings", 2048)),
            eos_token_ids=eos_token_ids,
            description=f"{spec.architecture} on {device} ({self._dtype_description()}, "
            f"{self.attention_backend} attention, {'compiled' if self.options.compile else 'eager'}"
            f"{f', {self.packed_format} GEMM' if self.packed_format else ''}"
            f"{f', {self.num_threads} threads' if device.type == 'cpu' else ''}"
            f"{f', tensor-parallel over {self.parallel.size} ranks' if self.parallel.sharded else ''})",
            structured_output=True,
            hidden_size=spec.hidden_size,
            sliding_window=spec.uniform_sliding_window,
            sliding_group=self.sliding_group,
            long_rope_length=spec.rotary.long_from_position if spec.rotary and spec.rotary.long_inv_freq else None,
            speculative=True,
            draft_model=self.draft is not None,
            block_copies=self.ranks is None,  # the ranks' step messages carry no copies
        )

    def _start_kernel_pool(self, model: DecoderForCausalLM, max_blocks: int) -> None:
        """Start the kernel pool the lean forward's decode-sized steps run on (``backends.cpu._pool``): on the CPU,
        where the lean forward is built, with a helper per thread beyond the device thread's. Sized for
        ``POOL_MAX_TOKENS`` rows of the model's widest matmul input, its head's panels and its attention."""
        from asyncllm.backends.cpu import _pool as kernel_pool
        from asyncllm.backends.cpu._gemm import PANEL_COLUMNS, PanelArgmaxHead
        from asyncllm.backends.cpu._lean_forward import POOL_MAX_TOKENS

        models = [model] if self.draft is None else [model, self.draft.model]
        helpers = torch.get_num_threads() - 1
        assert self.backend is not None
        if self.device.type != "cpu" or helpers < 1 or not all(m.runs_lean(self.backend) for m in models):
            return
        if self.sliding_batch is not None:  # a hybrid model's steps carry a sliding group: the modules run them
            return
        if not self.options.cpu_kernel_pool:
            return
        if not kernel_pool.available():
            return
        rows, floats = POOL_MAX_TOKENS, 4
        specs = [m.spec for m in models]
        widest = max(max(spec.hidden_size, spec.intermediate_size, spec.num_heads * spec.head_dim) for spec in specs)
        queries = max(spec.num_heads * spec.head_dim for spec in specs)
        heads = max(spec.num_heads for spec in specs)
        # Panels: the head's (the vocabulary, padded or not), or the widest fused projection's; attention: a
        # task per sequence and KV head at most.
        panels = max(max(spec.vocab_size, 3 * widest) for spec in specs) // PANEL_COLUMNS + 2
        decode_tasks = rows * max(spec.num_kv_heads for spec in specs)
        padded = -(-self.block_size // 16) * 16
        attention_input = rows * queries * floats + 64 + (2 * rows + rows * max_blocks) * 8
        attention_scratch = (3 * queries + (2 + padded) * heads) * floats  # per task: ``decode_scratch_floats``
        try:
            pool = kernel_pool.KernelPool(
                helpers,
                max_tasks=max(panels, decode_tasks),
                scratch_bytes=max(rows * PANEL_COLUMNS * floats, attention_scratch, widest * floats),
                input_bytes=max(rows * widest * floats, attention_input),
                spin=KERNEL_POOL_SPIN,
            )
        except RuntimeError as exc:  # threads or memory refused: OpenMP's threads do the work
            logger.warning("the CPU kernel pool did not start (%s): the kernels run on OpenMP's threads", exc)
            return
        self.kernel_pool = pool
        for m in models:
            assert m.lean is not None
            m.lean.pool = self.kernel_pool
            if isinstance(m.greedy_head, PanelArgmaxHead):
                m.greedy_head.pool = self.kernel_pool
        self._pooled_heads = [m.lm_head for m in models if m.lm_head.panel_weight is not None]

    @contextlib.contextmanager
    def _on_kernel_pool(self, tokens: int) -> Iterator[None]:
        """A step whose kernels run on the kernel pool (at most ``POOL_MAX_TOKENS`` tokens): the pool at the step's
        compute thread count, torch's own small ops (the embedding's gather, the rotary tables, the sampled rows'
        gather) on this thread alone meanwhile, from the forward to the sampled ids, so that no OpenMP worker
        wakes and then spins, as it does for a while after each of its regions, on the CPU the pool's helper
        needs; what is worth OpenMP's threads gets them back inside the step (``_on_step_threads``)."""
        from asyncllm.backends.cpu._lean_forward import POOL_MAX_TOKENS

        pool = self.kernel_pool
        if pool is None or tokens > POOL_MAX_TOKENS:
            yield
            return
        threads = torch.get_num_threads()
        pool.threads = min(threads, pool.helpers + 1)
        torch.set_num_threads(1)
        self._step_threads = threads
        for head in self._pooled_heads:  # the sampled rows' logits, where the sampler needs them
            head.pool = pool
        try:
            yield
        finally:
            for head in self._pooled_heads:
                head.pool = None
            self._step_threads = None
            torch.set_num_threads(threads)

    @contextlib.contextmanager
    def _on_step_threads(self) -> Iterator[None]:
        """Inside a step on the kernel pool, torch's ops at the step's thread count again, for work that is not
        on the pool and is worth OpenMP's threads (the sampler's passes over the vocabulary, float32's greedy
        head, a draft model's step); elsewhere nothing changes."""
        threads = self._step_threads
        if threads is None or threads == 1:
            yield
            return
        torch.set_num_threads(threads)
        try:
            yield
        finally:
            torch.set_num_threads(1)

    def _bfloat16_on_panels(self, device: torch.device, dtype: torch.dtype, spec: DecoderSpec) -> bool:
        """Whether ``dtype`` bfloat16 runs as bfloat16 weights on bfloat16 panels here (``bfloat16_weights``).

        On a CPU with AVX512-BF16 (the products at twice float32's rate) or with AVX2 and no AVX-512 (float32's
        rate on half the weight bytes), with the panels packed (the default ``packed_gemm``, or "panels"):
        torch's bfloat16 path pays for bfloat16 element-wise work and has no paged attention kernel. Elsewhere
        bfloat16 stays torch's, and so does a MoE model: its stacked experts (most of its weights) are no
        ``Linear`` and would become float32 beside the panels, twice the memory of its bfloat16 weights.
        """
        packed = self.switches.packed_gemm
        if device.type != "cpu" or dtype != torch.bfloat16 or packed not in (True, "panels") or spec.moe is not None:
            return False
        from asyncllm.backends.cpu import _gemm as gemm_cpu

        return gemm_cpu.bfloat16_available()

    def _dtype_description(self) -> str:
        if self.bfloat16_weights:
            kv = " and KV cache" if self.kv_dtype == torch.bfloat16 else ""
            return f"bfloat16 weights{kv}, float32 activations"
        return str(self.dtype).removeprefix("torch.")

    def _load_draft(self, config: Any, model: DecoderForCausalLM, backend_name: str) -> DraftModel:
        """Load ``speculative_model`` beside the target, after checking it can draft for it.

        Raises:
            ValueError: The folder is not a model, its family is not one the engine runs, its vocabulary
                or tokenizer differs from the target's, either model has a sliding window or LongRoPE,
                or the target is split over ranks.
        """
        path = Path(str(self.options.speculative_model))
        if not (path / "config.json").is_file():
            raise ValueError(f"speculative_model {str(path)!r} is not a local model folder (no config.json)")
        if self.parallel.sharded:
            raise ValueError('speculative_method="draft_model" does not run with tensor_parallel_size > 1')
        draft_config = load_config(path)
        try:
            spec = model_spec(draft_config)
        except (NotImplementedError, ValueError, KeyError) as exc:
            raise ValueError(f"speculative_model {str(path)!r}: an unsupported draft model ({exc})") from exc
        target = model.spec
        if spec.vocab_size != target.vocab_size:
            raise ValueError(
                f"speculative_model {str(path)!r} has a vocabulary of {spec.vocab_size} tokens, the target "
                f"{target.vocab_size}: a draft model must share the target's tokenizer"
            )
        check_same_tokenizer(self.model_path, path)
        for name, checked in (("the target", target), ("the draft model", spec)):
            if checked.sliding_window is not None:
                raise ValueError(
                    f'speculative_method="draft_model": {name} has a sliding window (not supported: the draft '
                    "attends to the whole context through the target's block tables)"
                )
            if checked.rotary is not None and checked.rotary.long_inv_freq is not None:
                raise ValueError(f'speculative_method="draft_model": {name} uses LongRoPE (not supported)')
        draft = load_model(
            spec,
            checkpoint_tensors(path),
            device=self.device,
            dtype=torch.bfloat16 if self.bfloat16_weights else self.dtype,
            fuse_projections=self.switches.fuse_projections,
        )
        draft.fused_norm = self.switches.fused_norm
        draft.backend = backend = create_backend(
            backend_name,
            device=self.device,
            dtype=self.dtype,
            head_dim=spec.head_dim,
            num_kv_heads=draft.local_heads[1],
            sliding_window=None,
            requested=True,
            attn_softcap=spec.attn_softcap,
        )
        packed = self.switches.packed_gemm
        if packed is not False and self.device.type == "cpu" and self.dtype == torch.float32:
            draft.pack_weights(None if packed is True else packed, greedy_head=False, bfloat16=self.bfloat16_weights)
        logger.info("draft model %s: %s, %d layers", path, spec.architecture, spec.num_layers)
        return DraftModel(draft, backend, InputBatch(self.block_size, max_num_seqs=self.options.max_num_seqs))

    def _capture_graphs(self, model: DecoderForCausalLM, max_seq_len: int) -> DecodeGraphs:
        assert self.backend is not None
        # Split graphs are captured for the batch sizes that leave the GPU idle at a 4k context.
        context = min(max_seq_len, 4096)
        split_kv = {b: self.backend.kv_splits(b, context) for b in capture_sizes(self.options.max_num_seqs)}
        graphs = DecodeGraphs(
            model,
            self.kv_caches,
            block_size=self.block_size,
            max_seq_len=max_seq_len,
            max_batch=self.options.max_num_seqs,
            device=self.device,
            split_kv={b: s for b, s in split_kv.items() if s > 1},
            ops=self.ops,
            sliding_group=self.sliding_batch is not None,
        )
        graphs.capture()
        return graphs

    def _kv_bytes_per_block(self, model: DecoderForCausalLM, dtype: torch.dtype) -> int:
        element = torch.tensor([], dtype=dtype).element_size()
        # A draft model's KV lives in the same blocks: a block costs both.
        models = [model] if self.draft is None else [model, self.draft.model]
        return sum(
            2 * m.spec.num_layers * self.block_size * m.local_heads[1] * m.spec.head_dim * element for m in models
        )

    def _frees_hybrid(self, spec: DecoderSpec) -> bool:
        """Whether the sliding layers of a hybrid model get a pool of their own that frees: always, for a
        model with sliding and global layers.

        Every backend builds each group's metadata from its own tables (triton's CUDA graphs keep static
        buffers for both), and tensor-parallel ranks receive both tables' changes with each step.
        """
        return spec.sliding_window is not None and spec.uniform_sliding_window is None

    def _allocate_kv_cache(
        self, num_blocks: int, sliding_blocks: int | None = None, *, prefault: bool = False
    ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """A KV cache of ``num_blocks`` blocks for this rank's KV heads (``sliding_blocks`` for the sliding
        layers of a hybrid model with a sliding group); rank 0 has the other ranks allocate theirs too
        (every rank holds the same blocks, of its own heads). With ``prefault`` (the serving cache, not the
        sizing probe's), a CPU cache starts being faulted in (``kv_prefault``); with ``kv_cache_prefault_wait``
        too, this returns once it is resident, and once every rank's is (a barrier), so that no rank's first
        step waits on another's pages."""
        assert self.model is not None
        if self.kernel_pool is not None:  # a late helper may still read the cache this one replaces
            self.kernel_pool.quiesce()
        if self.ranks is not None:
            from asyncllm.executor._ranks import AllocateMessage

            self.ranks.send(AllocateMessage(num_blocks, sliding_blocks, prefault))
        spec = self.model.spec
        heads = (self.model.local_heads[1], spec.head_dim)
        self._stop_kv_prefault()
        self.kv_caches = []  # the old cache goes before the new one is allocated
        caches = []
        for index in range(spec.num_layers):
            blocks = sliding_blocks if sliding_blocks is not None and spec.layer_is_sliding(index) else num_blocks
            shape = (blocks * self.block_size, *heads)
            caches.append((self._zeros(shape), self._zeros(shape)))
        if self.draft is not None:  # the draft's KV, indexed by the same slots
            draft, self.draft.kv_caches = self.draft.model, []
            shape = (num_blocks * self.block_size, draft.local_heads[1], draft.spec.head_dim)
            self.draft.kv_caches = [(self._zeros(shape), self._zeros(shape)) for _ in range(draft.spec.num_layers)]
        tensors = [t for pair in caches for t in pair]
        if self.draft is not None:
            tensors += [t for pair in self.draft.kv_caches for t in pair]
        if prefault and tensors and self.device.type == "cpu" and self.options.kv_cache_prefault:
            widest = max(t.stride(0) * t.element_size() for t in tensors)
            # Whole blocks per round, about one huge page of the widest tensor: rows come in block order.
            rows = max(1, PREFAULT_ROUND_BYTES // widest // self.block_size) * self.block_size
            if self.options.kv_cache_prefault_wait:  # resident before the load returns: no step runs meanwhile
                self._wait_until_resident(tensors, rows)
            else:
                self.kv_prefault = Prefault(tensors, rows, busy=self.device_busy)
        return caches

    def _wait_until_resident(self, tensors: list[torch.Tensor], rows: int) -> None:
        """Fault the serving cache in now and wait (``kv_cache_prefault_wait``), then meet the other ranks."""
        started = time.monotonic()
        self.kv_prefault = prefault = Prefault(tensors, rows)
        prefault.wait()
        # Partly: the memory reserve or a refusal stopped it (logged by the thread); the rest comes on use.
        extent = "resident" if prefault.completed else "partly resident"
        logger.info(
            "KV cache %s: %d MiB faulted in, %.1f s", extent, prefault.faulted_bytes >> 20, time.monotonic() - started
        )
        self._resident_waits += 1
        if self.collectives is not None:
            name = f"kv-resident-{self._resident_waits}"
            self.collectives.barrier(name, None if self.ranks is None else self.ranks.failure)

    @contextlib.contextmanager
    def _stamped_step(self) -> Iterator[None]:
        """Stamp ``last_step_started`` on entry and ``last_step_ended`` on the way out, however it ends."""
        self.last_step_started = time.monotonic()
        try:
            yield
        finally:
            self.last_step_ended = time.monotonic()

    def device_busy(self) -> bool:
        """A step is running, or one ended less than ``PREFAULT_QUIET_SECONDS`` ago (the prefault's ``busy``)."""
        running = self.last_step_started > self.last_step_ended
        return running or time.monotonic() - self.last_step_ended < PREFAULT_QUIET_SECONDS

    def _stop_kv_prefault(self) -> None:
        if self.kv_prefault is not None:
            self.kv_prefault.stop()
            self.kv_prefault = None

    def _zeros(self, shape: tuple[int, int, int]) -> torch.Tensor:
        dtype = self.kv_dtype or self.dtype
        if self.device.type != "cpu":
            return torch.zeros(shape, device=self.device, dtype=dtype)
        # On the CPU each KV tensor gets its own anonymous mapping (huge pages where possible; see
        # ``anonymous_mapping``): no memset of a large cache at start-up (``kv_prefault`` faults the
        # serving cache in on its own thread), and dropping the tensor unmaps it.
        return mapped_tensor(shape[0] * shape[1] * shape[2], dtype).view(shape)

    def _size_kv_cache(self, model: DecoderForCausalLM, device: torch.device, dtype: torch.dtype) -> int:
        bytes_per_block = self._kv_bytes_per_block(model, dtype)
        max_blocks = None
        if self.max_tokens_in_cache is not None:
            max_blocks = -(-self.max_tokens_in_cache // self.block_size)
        kv_cache_memory = self.options.kv_cache_memory
        cuda = device.type == "cuda"
        weight_bytes = torch.cuda.memory_allocated(device) if cuda else 0  # before the probe allocates anything
        peak = self._measure_activation_peak()
        if cuda and not isinstance(kv_cache_memory, int):
            total, non_torch = cuda_memory(device)  # empties the cache the probe left
            utilization = kv_cache_memory if isinstance(kv_cache_memory, float) else DEFAULT_CUDA_FRACTION
            num_blocks = plan_kv_blocks(
                total_bytes=total,
                non_torch_bytes=non_torch,
                weight_bytes=weight_bytes,
                activation_peak_bytes=peak,
                bytes_per_block=bytes_per_block,
                utilization=utilization,
            )
            if max_blocks is not None:
                num_blocks = min(num_blocks, max_blocks)
            available = int(utilization * total) - non_torch - weight_bytes
            sizing = KVCacheSizing(num_blocks * bytes_per_block, available, peak, bytes_per_block, num_blocks)
        else:
            available = torch.cuda.mem_get_info(device)[0] if cuda else host_available_bytes()
            # On the CPU every rank's cache and activations share the host's memory: a block costs every
            # rank's share of it, and kv_cache_memory (bytes, a fraction, the default's cap) is of the whole.
            ranks = 1 if cuda else self.parallel.size
            sizing = size_kv_cache(
                kv_cache_memory,
                device_type=device.type,
                available_bytes=available,
                activation_peak_bytes=peak * ranks,
                bytes_per_block=bytes_per_block * ranks,
                max_blocks=max_blocks,
            )
        self.kv_sizing = sizing
        logger.info(
            "KV cache sized from memory: %d blocks (%.0f MiB) of %.0f MiB available after the weights, "
            "activation peak %.0f MiB at %d tokens",
            sizing.num_blocks,
            sizing.num_blocks * sizing.bytes_per_block / 2**20,
            sizing.available_bytes / 2**20,
            sizing.activation_peak_bytes / 2**20,
            self.options.max_num_batched_tokens,
        )
        return sizing.num_blocks

    def _measure_activation_peak(self) -> int:
        """Extra memory of the largest step the engine runs, measured on throwaway requests.

        One forward at ``max_num_batched_tokens`` (one long prompt: the forward's activations). With
        ``speculative_method`` also a full step of drafting requests (``_probe_drafting``): its logits
        and verification take (``num_speculative_tokens`` + 1) rows per request, and a draft model's
        passes and the distributions it keeps between steps, all of which grow with the vocabulary
        and which the long prompt (one sampled row) never shows. The peak of both is the step's.
        """
        assert self.sampler is not None
        tokens = self.options.max_num_batched_tokens
        span = self._drafting_span()
        num_blocks = -(-max(tokens, span) // self.block_size)
        self.kv_caches = self._allocate_kv_cache(num_blocks)
        probe = SequenceInput(
            request_id=-1,
            token_ids=[0] * tokens,
            start_position=0,
            block_table=list(range(-(-tokens // self.block_size))),
            sliding_block_table=list(range(-(-tokens // self.block_size))) if self.sliding_batch is not None else None,
            sample=True,
            params=SamplingParams(temperature=0.0, max_tokens=1),
            prompt_token_ids=[0] * tokens,
        )
        cuda = self.device.type == "cuda"
        if cuda:
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            baseline = torch.cuda.memory_allocated(self.device)
        else:
            reset_peak_rss()
            baseline = resident_bytes()
        with torch.inference_mode():
            self._execute([probe]).result()
            self.sampler.forget([-1])
            if span:
                self._probe_drafting(list(range(-(-span // self.block_size))))
        peak = torch.cuda.max_memory_allocated(self.device) if cuda else peak_resident_bytes()
        self.kv_caches = []
        return max(0, peak - baseline)

    def _drafting_span(self) -> int:
        """Positions one request of ``_probe_drafting`` writes (0: no drafting probe). Not under tensor
        parallelism: the other ranks would keep the probe's requests (their steps are rank 0's)."""
        if self.options.speculative_method is None or self.ranks is not None:
            return 0
        num_draft = min(self.options.num_speculative_tokens, self.options.max_num_batched_tokens - 1)
        # Two steps of a draft and a proposal each, after one prompt token, and a block's slack.
        return 0 if num_draft < 1 else 4 * num_draft + 2 + self.block_size

    def _probe_drafting(self, block_table: list[int]) -> None:
        """Run the busiest drafting step: ``max_num_seqs`` requests (fewer if ``max_num_batched_tokens``
        holds fewer drafts) each feeding its newest token and a draft of ``num_speculative_tokens``,
        sampled at random with ``top_p`` (verification's heaviest path: the target's filtered
        distributions, residuals). With a draft model each request proposes ``num_speculative_tokens``
        tokens, and a second step verifies those proposals while their distributions (q, kept between
        steps) are held. The requests share ``block_table``: their KV is scratch."""
        assert self.sampler is not None
        tokens = self.options.max_num_batched_tokens
        num_draft = min(self.options.num_speculative_tokens, tokens - 1)
        count = min(self.options.max_num_seqs, tokens // (num_draft + 1))
        propose = num_draft if self.draft is not None else 0
        params = SamplingParams(temperature=1.0, top_p=0.9, max_tokens=4 * num_draft + 2)
        sequences = [
            SequenceInput(
                request_id=-2 - index,
                token_ids=[0] * (num_draft + 1),
                start_position=1,
                block_table=block_table,
                sliding_block_table=block_table if self.sliding_batch is not None else None,
                sample=True,
                params=params,
                num_generated=1,
                prompt_token_ids=[0],
                num_draft=num_draft,
                num_propose=propose,
            )
            for index in range(count)
        ]
        request_ids = [seq.request_id for seq in sequences]
        self._execute(sequences).result()
        if self.draft is not None:  # the next step: each request's proposal as its draft, q held meanwhile
            again = []
            for seq in sequences:
                held = self.draft.pending.get(seq.request_id)
                if held is not None and held[1]:
                    position, proposed, _ = held
                    again.append(
                        dataclasses.replace(
                            seq, token_ids=[0, *proposed], start_position=position - 1, num_draft=len(proposed)
                        )
                    )
            if again:
                self._execute(again).result()
            self.draft.forget(request_ids)
        self.sampler.forget(request_ids)

    @property
    def overlaps(self) -> bool:
        """Whether ``launch`` returns before the device has finished the step (CUDA): the executor may
        then launch step N+1 before it collects step N (``executor.LookaheadExecutor``). Not with
        tensor parallelism: a step is sent to the other ranks with its tokens known."""
        return self.ops.asynchronous and not self.parallel.sharded

    def execute(self, batch: StepBatch) -> StepOutput:
        """Run one step on the flat batch; return the sampled ids (see ``ModelRunner.execute``)."""
        return self.launch(batch).result()

    def launch(self, batch: StepBatch, after: PendingStep | None = None) -> PendingStep:
        """Prepare the step, queue its forward and sampling on the device, and return without waiting.

        Args:
            batch: The step. A sequence whose last fed token is ``PLACEHOLDER`` feeds the token that
                ``after`` samples for its request.
            after: The step launched just before, not necessarily collected: its sampled ids are
                gathered into this step's inputs on the device, so the host need not wait for them
                (unless the sampler needs a placeholder request's history, when it waits first).

        Returns:
            The step in flight; its ``result()`` waits for the sampled ids (the step's one host
            synchronisation) and returns the ``StepOutput``.

        Raises:
            DeviceOutOfMemoryError: torch ran out of device memory.
            RuntimeError: A placeholder for a request ``after`` did not sample.
        """
        assert self.model is not None and self.sampler is not None, "load() first"
        with self._stamped_step():
            return self._launch(batch, after)

    def _launch(self, batch: StepBatch, after: PendingStep | None) -> PendingStep:
        assert self.model is not None and self.sampler is not None
        if self.thread_governor is not None:
            threads = self.thread_governor.threads()
            if torch.get_num_threads() != threads:
                torch.set_num_threads(threads)
        self.sampler.forget(batch.finished_request_ids)
        self.input_batch.remove(batch.finished_request_ids)
        if self.sliding_batch is not None:
            self.sliding_batch.remove(batch.finished_request_ids)
        for request_id in batch.finished_request_ids:
            self._pool_sums.pop(request_id, None)
        if self.draft is not None:
            self.draft.forget(batch.finished_request_ids)
        if not batch.sequences:
            return PendingStep.done(StepOutput([]))
        try:
            with torch.inference_mode():
                if batch.block_copies:
                    self._copy_blocks(batch.block_copies)
                return self._execute(batch.sequences, after)
        except torch.OutOfMemoryError as exc:
            raise DeviceOutOfMemoryError(f"the device ran out of memory during a step: {exc}") from exc
        except RuntimeError as exc:  # a collective or pipe that failed: say which rank died, if one did
            failure = exc if self.ranks is None else self.ranks.explain(exc)
            if failure is exc:
                raise
            raise failure from exc

    def _copy_blocks(self, copies: tuple[tuple[int, int, int], ...]) -> None:
        """Copy KV rows between blocks in every layer, the draft model's too (``StepBatch.block_copies``).

        Queued on the device's stream ahead of the step's forward, so it reads the source rows before
        anything this step or a later one writes there.
        """
        if self.ranks is not None:  # the scheduler finds partial-block hits only without ranks
            raise RuntimeError("block copies are not sent to tensor-parallel ranks")
        caches = [*self.kv_caches, *(self.draft.kv_caches if self.draft is not None else ())]
        size = self.block_size
        sources: list[int] = []
        targets: list[int] = []
        for source, target, rows in copies:
            sources += range(source * size, source * size + rows)
            targets += range(target * size, target * size + rows)
        if len(set(targets)) < len(targets):  # a target written twice: in order, one copy at a time
            for source, target, rows in copies:
                for keys, values in caches:
                    keys[target * size : target * size + rows] = keys[source * size : source * size + rows]
                    values[target * size : target * size + rows] = values[source * size : source * size + rows]
            return
        # One gather and one scatter per tensor for all of the step's copies.
        source_slots = torch.tensor(sources, dtype=torch.int64, device=self.device)
        target_slots = torch.tensor(targets, dtype=torch.int64, device=self.device)
        for keys, values in caches:
            keys.index_copy_(0, target_slots, keys.index_select(0, source_slots))
            values.index_copy_(0, target_slots, values.index_select(0, source_slots))

    def _placeholders(
        self, sequences: list[SequenceInput], after: PendingStep | None
    ) -> tuple[list[SequenceInput], list[tuple[int, int]]]:
        """Resolve the placeholders: on the host when ``after``'s ids are (or must be) read, else a plan
        of (sequence index, row of ``after``'s samples) for the device to gather."""
        if after is None or not any(seq.token_ids[-1] == PLACEHOLDER for seq in sequences):
            return sequences, []
        assert self.sampler is not None
        plan: list[tuple[int, int]] = []
        for index, seq in enumerate(sequences):
            if seq.token_ids[-1] != PLACEHOLDER:
                continue
            row = after.sample_rows.get(seq.request_id)
            if row is None:  # a scheduling bug; computing on a made-up token would be worse
                raise RuntimeError(f"request {seq.request_id} feeds a token the previous step did not sample")
            plan.append((index, row))
        history = any(self.sampler.needs_history(sequences[index]) for index, _ in plan)
        if after.device_ids is not None and not history:
            return sequences, plan
        # The sampler reads these requests' tokens (or the ids never went to the device): wait for them.
        sampled = after.result().sampled_token_ids
        sequences = list(sequences)
        for index, row in plan:
            seq = sequences[index]
            sequences[index] = dataclasses.replace(seq, token_ids=[*seq.token_ids[:-1], sampled[row]])
        return sequences, []

    def _execute(self, sequences: list[SequenceInput], after: PendingStep | None = None) -> PendingStep:
        with self._on_kernel_pool(sum(len(seq.token_ids) for seq in sequences)):
            return self._execute_on_threads(sequences, after)

    def _execute_on_threads(self, sequences: list[SequenceInput], after: PendingStep | None) -> PendingStep:
        """``_execute`` once the step's threads are chosen (``_on_kernel_pool``)."""
        assert self.model is not None and self.sampler is not None
        ops = self.ops
        clock = _StepClock(self.device)
        sequences, plan = self._placeholders(sequences, after)
        if self.ranks is not None:  # the step's one broadcast: the other ranks run its forward with this one
            from asyncllm.executor._ranks import StepMessage

            assert self._tables is not None
            self.ranks.send(StepMessage(self._tables.deltas(sequences), time.perf_counter()))
        step = self.input_batch.prepare(sequences)
        sliding_step = None if self.sliding_batch is None else self._sliding_step(sequences)
        fill = None
        if plan:
            assert after is not None and after.device_ids is not None
            # The flat row of each placeholder (a sequence's last fed token) and the id it stands for.
            flat = step.query_start_loc[1:][np.array([index for index, _ in plan])] - 1
            fill = (ops.to_device(flat), after.device_ids[ops.tensor([row for _, row in plan], torch.int64)])
        replay = self.graphs is not None and self.graphs.fits(step)
        meta = None if replay else self._metadata(step)
        sliding_meta = None if replay or sliding_step is None else self._metadata(sliding_step)
        clock.mark()
        if meta is None:
            hidden = self._replay(step, fill, sliding_step)
        else:
            hidden = self._forward(step, meta, fill, sliding_meta)
        clock.mark()
        model = self.model
        rows = hidden[ops.to_device(step.sample_index)] if len(step.sample_index) else None
        pooling = any(s.pooling is not None for s in sequences)
        drafting = any(s.num_draft for s in sequences)
        # Split over ranks, every rank gathers the sampled rows' logits right after the forward, a draft's
        # rows included (the other ranks know the rows from the step); prompt logprobs' rows are sent
        # after it, one message each.
        sample_logits = None
        if rows is not None and self.parallel.sharded:
            gathered = hidden[ops.to_device(logit_rows(step.sample_index, sequences))] if drafting else rows
            sample_logits = model.logits(gathered)
        # Pooling sequences never sample: the sampler keeps no state for them. A draft is not history
        # (yet): verification records the tokens it accepts.
        fed = [_without_draft(s) for s in sequences] if drafting else sequences
        self.sampler.record([s for s in fed if s.pooling is None] if pooling else fed)
        offsets = step.query_start_loc[:-1].tolist()
        prompt_logprobs = self.sampler.prompt_logprobs(sequences, offsets, lambda at: self._logits_at(hidden, at))
        pooled, failed = self._pool(sequences, offsets, hidden) if pooling else (None, {})
        sampling = [s for s in sequences if s.sample]
        token_ids: torch.Tensor | list[int] = []
        logprobs = None
        verified = None
        if drafting:
            with self._on_step_threads():
                token_ids, logprobs, verified = self._sample_and_verify(
                    model, hidden, step.sample_index, sampling, sample_logits
                )
        elif rows is not None:
            token_ids, logprobs = self._sample(model, rows, sampling, sample_logits)
        proposals = None
        if self.draft is not None:
            with self._on_step_threads():
                token_ids, proposals = self._run_draft(sequences, plan, fill, sampling, token_ids, verified)
        host_ids = ops.to_host(token_ids) if isinstance(token_ids, torch.Tensor) else token_ids
        clock.mark()
        event = ops.record()  # after the clock's last mark: once it is complete, so are the clock's events
        if self.sampler.failed:
            failed.update(self.sampler.failed)
            self.sampler.failed = {}
        return PendingStep(
            self,
            sample_rows={seq.request_id: row for row, seq in enumerate(sampling)},
            device_ids=token_ids if isinstance(token_ids, torch.Tensor) else None,
            host_ids=host_ids,
            event=event,
            clock=clock,
            rest=(logprobs, prompt_logprobs, failed or None, pooled, verified, proposals),
        )

    def _pool(
        self, sequences: list[SequenceInput], offsets: list[int], hidden: torch.Tensor
    ) -> tuple[dict[int, PooledVector] | None, dict[int, str]]:
        """The pooled vectors of the pooling sequences whose prompt this step completes, and failures.

        "last" takes the prompt's last row (its final chunk's last); "mean" sums each chunk's rows in
        float32 and divides at the final chunk. A mean chunk that does not continue the rows summed so
        far (a prefix-cache hit, which the scheduler never gives such a request) fails the request
        rather than return a mean over part of its prompt.
        """
        finals: list[tuple[int, torch.Tensor]] = []
        failed: dict[int, str] = {}
        for seq, offset in zip(sequences, offsets):
            if seq.pooling is None:
                continue
            count = len(seq.token_ids)
            last = seq.start_position + count == len(seq.prompt_token_ids)
            if seq.pooling == "last":
                if last:
                    finals.append((seq.request_id, hidden[offset + count - 1].float()))
                continue
            total = hidden[offset : offset + count].sum(dim=0, dtype=torch.float32)
            if seq.start_position > 0:  # 0 starts over: a first chunk, or a recompute after preemption
                held = self._pool_sums.pop(seq.request_id, None)
                if held is None or held[1] != seq.start_position:
                    failed[seq.request_id] = (
                        f"mean pooling got prompt tokens from position {seq.start_position} on, "
                        "without the hidden states of those before (an engine bug)"
                    )
                    continue
                total, count = held[0] + total, held[1] + count
            if last:
                self._pool_sums.pop(seq.request_id, None)
                finals.append((seq.request_id, total / count))
            else:
                self._pool_sums[seq.request_id] = (total, count)
        if not finals:
            return None, failed
        vectors = torch.stack([vector for _, vector in finals]).cpu().numpy()
        return {request_id: vectors[index] for index, (request_id, _) in enumerate(finals)}, failed

    def _logits_at(self, hidden: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        """The logits of some rows of the step's hidden states (split over ranks: the other ranks are
        told the rows, and gather their vocabulary slices with rank 0's)."""
        assert self.model is not None
        if self.ranks is not None:
            from asyncllm.executor._ranks import LogitsMessage

            self.ranks.send(LogitsMessage(rows.tolist()))
        return self.model.logits(hidden[rows])

    def _sample_and_verify(
        self,
        model: DecoderForCausalLM,
        hidden: torch.Tensor,
        sample_index: np.ndarray[Any, Any],
        sampling: list[SequenceInput],
        logits: torch.Tensor | None = None,
    ) -> tuple[list[int], list[PositionLogprobs | None] | None, dict[int, VerifiedDraft]]:
        """A step with drafts: plain sampling rows as usual, and each drafted sequence's draft verified
        from the logits of its last ``num_draft + 1`` positions (``Sampler.verify``). The ids come back
        to the host here: a drafted sequence's tokens are known only after verification. ``logits``:
        those of every row of ``logit_rows``, computed already (tensor parallelism).

        Returns:
            One id per sampling sequence (a drafted one's last token), their logprobs if asked, and
            the drafted sequences' results by request id.
        """
        assert self.sampler is not None
        ops = self.ops
        token_ids = [0] * len(sampling)
        logprobs: list[PositionLogprobs | None] = [None] * len(sampling)
        plain = [row for row, seq in enumerate(sampling) if not seq.num_draft]
        drafted = [row for row, seq in enumerate(sampling) if seq.num_draft]
        # Where each sampling sequence's rows start among ``logit_rows``' (its draft's, then its newest token's).
        starts = np.cumsum([0] + [seq.num_draft + 1 for seq in sampling])
        if plain:
            rows = hidden[ops.to_device(sample_index[plain])]
            plain_logits = None if logits is None else logits[ops.to_device(starts[plain])]
            sampled, plain_logprobs = self._sample(model, rows, [sampling[row] for row in plain], plain_logits)
            ids = ops.tolist(sampled) if isinstance(sampled, torch.Tensor) else sampled
            for index, row in enumerate(plain):
                token_ids[row] = int(ids[index])
                if plain_logprobs is not None:
                    logprobs[row] = plain_logprobs[index]
        # The rows of the newest token and of each draft token: the last num_draft + 1 of the sequence.
        if logits is None:
            flat = np.concatenate(
                [np.arange(sample_index[row] - sampling[row].num_draft, sample_index[row] + 1) for row in drafted]
            )
            draft_logits = model.logits(hidden[ops.to_device(flat)])
        else:
            own = np.concatenate([np.arange(starts[row], starts[row + 1]) for row in drafted])
            draft_logits = logits[ops.to_device(own)]
        drafted_seqs = [sampling[row] for row in drafted]
        draft_probs = None if self.draft is None else [self.draft.probs_of(seq) for seq in drafted_seqs]
        results = self.sampler.verify(draft_logits, drafted_seqs, draft_probs)
        verified: dict[int, VerifiedDraft] = {}
        for row, result in zip(drafted, results):
            verified[sampling[row].request_id] = result
            token_ids[row] = result.token_ids[-1]
            if result.logprobs is not None:
                logprobs[row] = result.logprobs[-1]
        return token_ids, logprobs if any(entry is not None for entry in logprobs) else None, verified

    def _draft_forward(self, step: StepInputs, fill: IdFill | None = None) -> torch.Tensor:
        draft = self.draft
        assert draft is not None
        n = step.num_tokens
        ids_positions = self.ops.to_device(np.concatenate((step.input_ids, step.positions)))
        if fill is not None:  # placeholders: the previous step's samples, gathered on the device
            ids_positions[fill[0]] = fill[1]
        meta = draft.backend.build_metadata(step)
        hidden: torch.Tensor = draft.model(ids_positions[:n], ids_positions[n : 2 * n], draft.kv_caches, meta)
        return hidden

    def _run_draft(
        self,
        sequences: list[SequenceInput],
        plan: list[tuple[int, int]],
        fill: IdFill | None,
        sampling: list[SequenceInput],
        token_ids: torch.Tensor | list[int],
        verified: dict[int, VerifiedDraft] | None,
    ) -> tuple[torch.Tensor | list[int], dict[int, list[int]] | None]:
        """The draft model's share of a step: its KV for every token the target keeps, then its proposals.

        The first pass feeds each sequence's tokens as the target was fed them, without the draft
        tokens it rejected (their positions are fed again later), in the same slots: the draft's KV is
        as complete as the target's at every position the target keeps, so the same block tables,
        prefix-cache hits, preemptions and trims cover both. A sequence with ``num_propose`` also feeds
        the token the step produced, whose logits give the first proposed token; ``num_propose - 1``
        more single-token passes each feed the previous proposal (``Sampler.propose`` picks each).
        What those passes write lies at positions the next step feeds again: scratch.

        Returns:
            The step's sampled ids (brought to the host when a sequence proposes: the passes feed
            them) and the proposals by request id (None when no sequence proposes).
        """
        draft = self.draft
        assert draft is not None and self.sampler is not None
        proposing = [row for row, seq in enumerate(sampling) if seq.num_propose > 0]
        host: list[int] = []
        if proposing:
            host = self.ops.tolist(token_ids) if isinstance(token_ids, torch.Tensor) else list(token_ids)
        new_token = {sampling[row].request_id: int(host[row]) for row in proposing}
        first: list[SequenceInput] = []
        own_lengths: list[int] = []
        for seq in sequences:
            own = len(seq.token_ids) - seq.num_draft
            result = None if verified is None or not seq.num_draft else verified.get(seq.request_id)
            kept = list(seq.token_ids[: own + (0 if result is None else len(result.token_ids) - 1)])
            proposes = seq.request_id in new_token and seq.sample
            if proposes:
                kept.append(new_token[seq.request_id])
            own_lengths.append(own)
            first.append(dataclasses.replace(seq, token_ids=kept, num_draft=0, sample=proposes, pooling=None))
        step = draft.batch.prepare(first)
        draft_fill = None
        if plan and fill is not None:  # the placeholder is each such sequence's last own token
            rows = step.query_start_loc[np.array([index for index, _ in plan])] + np.array(
                [own_lengths[index] - 1 for index, _ in plan]
            )
            draft_fill = (self.ops.to_device(rows), fill[1])
        hidden = self._draft_forward(step, draft_fill)
        if not proposing:
            return token_ids, None
        active = [seq for seq in first if seq.sample]
        proposals: dict[int, list[int]] = {seq.request_id: [] for seq in active}
        probs: dict[int, list[torch.Tensor]] = {seq.request_id: [] for seq in active}
        positions = {seq.request_id: seq.start_position + len(seq.token_ids) - 1 for seq in active}
        depth = 0
        while True:
            logits = draft.model.logits(hidden[self.ops.to_device(step.sample_index)])
            chosen, qs = self.sampler.propose(logits, active)
            for seq, token, q in zip(active, chosen, qs):
                proposals[seq.request_id].append(token)
                if q is not None:
                    probs[seq.request_id].append(q)
            depth += 1
            active = [seq for seq in active if seq.num_propose > depth]
            if not active:
                break
            passes = [
                dataclasses.replace(
                    seq,
                    token_ids=[proposals[seq.request_id][-1]],
                    start_position=positions[seq.request_id] + depth,
                )
                for seq in active
            ]
            step = draft.pass_batch.prepare(passes)
            hidden = self._draft_forward(step)
        for rid, tokens in proposals.items():
            draft.pending[rid] = (positions[rid] + 1, tokens, torch.stack(probs[rid]) if probs[rid] else None)
        return host, proposals

    def _sample(
        self,
        model: DecoderForCausalLM,
        rows: torch.Tensor,
        sequences: list[SequenceInput],
        logits: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor | list[int], list[PositionLogprobs | None] | None]:
        """One token per row of ``rows`` (the sampling positions' hidden states), and logprobs where asked.

        The ids stay on the device (a tensor) unless the greedy head picked some: plain greedy rows go to
        the model's greedy head where it has one (the CPU's; the same tokens as the argmax of their
        logits), which gives host ids; the sampler takes the rest, and any row the head could not
        decide, from logits. ``logits``: the rows' logits, computed already (tensor parallelism).
        """
        from asyncllm.backends.cpu._gemm import PanelArgmaxHead

        assert self.sampler is not None
        if logits is not None:
            with self._on_step_threads():
                sampled = self.sampler.sample(logits, sequences)
            return sampled.token_ids, sampled.logprobs
        head = model.greedy_head if self.switches.greedy_head else None
        plain = self.sampler.plain_greedy_rows(sequences) if head is not None else []
        if head is None or not plain:
            all_logits = model.logits(rows)  # on the kernel pool in its steps
            with self._on_step_threads():
                sampled = self.sampler.sample(all_logits, sequences)
            return sampled.token_ids, sampled.logprobs
        token_ids = [-1] * len(sequences)
        greedy_rows = rows if len(plain) == len(sequences) else rows[plain]
        if isinstance(head, PanelArgmaxHead):  # on the kernel pool in its steps
            decided = head.argmax(greedy_rows).tolist()
        else:
            with self._on_step_threads():
                decided = head.argmax(greedy_rows).tolist()
        for row, token in zip(plain, decided):
            token_ids[row] = token
        rest = [row for row, token in enumerate(token_ids) if token < 0]
        if not rest:
            return token_ids, None
        rest_logits = model.logits(rows[rest])
        with self._on_step_threads():
            sampled = self.sampler.sample(rest_logits, [sequences[row] for row in rest])
        for row, token in zip(rest, sampled.token_ids.tolist()):
            token_ids[row] = token
        logprobs: list[PositionLogprobs | None] | None = None
        if sampled.logprobs is not None:
            logprobs = [None] * len(sequences)
            for row, entry in zip(rest, sampled.logprobs):
                logprobs[row] = entry
        return token_ids, logprobs

    def _metadata(self, step: StepInputs) -> Any:
        assert self.backend is not None
        return self.backend.build_metadata(step)

    def _sliding_step(self, sequences: list[SequenceInput]) -> StepInputs:
        """The step's arrays over the sliding layers' tables (``SequenceInput.sliding_block_table``).

        Raises:
            ValueError: A sequence has no sliding table.
        """
        assert self.sliding_batch is not None
        sliding = []
        for seq in sequences:
            if seq.sliding_block_table is None:
                raise ValueError(f"request {seq.request_id} of a hybrid model's step has no sliding_block_table")
            sliding.append(
                dataclasses.replace(seq, block_table=seq.sliding_block_table, block_offset=seq.sliding_block_offset)
            )
        return self.sliding_batch.prepare(sliding)

    def _forward(
        self, step: StepInputs, meta: Any = None, fill: IdFill | None = None, sliding_meta: Any = None
    ) -> torch.Tensor:
        assert self.model is not None
        if meta is None:
            meta = self._metadata(step)
        # One pinned, non-blocking copy for ids and positions (and LongRoPE's per-token choice, where a
        # sequence is long): the host does not wait for the device.
        parts = (step.input_ids, step.positions) if step.long_rope is None else (
            step.input_ids, step.positions, step.long_rope.astype(np.int64)
        )
        ids_positions = self.ops.to_device(np.concatenate(parts))
        if fill is not None:  # placeholders: the previous step's samples, gathered on the device
            ids_positions[fill[0]] = fill[1]
        n = step.num_tokens
        long_rope = None if step.long_rope is None else ids_positions[2 * n :] != 0
        hidden: torch.Tensor = self.model(
            ids_positions[:n],
            ids_positions[n : 2 * n],
            self.kv_caches,
            meta,
            long_rope=long_rope,
            sliding_meta=sliding_meta,
        )
        return hidden

    def _replay(
        self, step: StepInputs, fill: IdFill | None = None, sliding_step: StepInputs | None = None
    ) -> torch.Tensor:
        assert self.graphs is not None and self.backend is not None
        splits = self.backend.kv_splits(step.num_seqs, step.max_seq_len)
        return self.graphs.run(step, splits, fill, sliding_step=sliding_step)

    # -- ranks other than 0 (``asyncllm.worker._rank``) ----------------------------------------------

    def load_rank(self) -> None:
        """Meet the other ranks and load this rank's shard (no KV cache: rank 0 says its size)."""
        self._load_model()

    def allocate(self, num_blocks: int, sliding_blocks: int | None = None, *, prefault: bool = False) -> None:
        """Replace the KV cache by one of ``num_blocks`` blocks of this rank's KV heads (``sliding_blocks``
        for a hybrid model's sliding layers, which then read each step's sliding tables); ``prefault``: the
        serving cache (``_allocate_kv_cache``)."""
        self.kv_caches = self._allocate_kv_cache(num_blocks, sliding_blocks, prefault=prefault)
        self.sliding_batch = None
        if sliding_blocks is not None:
            self.sliding_batch = InputBatch(self.block_size, max_num_seqs=self.options.max_num_seqs)

    def forward_step(self, sequences: list[SequenceInput]) -> None:
        """Run a step's forward as rank 0 does (its collectives with it); gather the sampled rows' logits.

        Raises:
            ValueError: This rank's cache has a sliding group and a sequence has no sliding table.
        """
        assert self.model is not None
        with self._stamped_step():
            self._forward_step(sequences)

    def _forward_step(self, sequences: list[SequenceInput]) -> None:
        assert self.model is not None
        with torch.inference_mode():
            step = self.input_batch.prepare(sequences)
            sliding_meta = None if self.sliding_batch is None else self._metadata(self._sliding_step(sequences))
            self._hidden = hidden = self._forward(step, sliding_meta=sliding_meta)
            if len(step.sample_index):
                self.model.logits(hidden[self.ops.to_device(logit_rows(step.sample_index, sequences))])

    def gather_logits(self, rows: list[int]) -> None:
        """Contribute this rank's slice of the logits of ``rows`` of the last step's hidden states."""
        assert self.model is not None and self._hidden is not None
        with torch.inference_mode():
            self.model.logits(self._hidden[self.ops.to_device(np.array(rows, dtype=np.int64))])

    def close(self) -> None:
        """Drop weights and KV tensors so their memory can be returned (rank 0 stops the other ranks first)."""
        if self.ranks is not None:
            from asyncllm.errors import WorkerDiedError
            from asyncllm.executor._ranks import StopMessage

            with contextlib.suppress(WorkerDiedError, OSError):  # already gone: the engine ends it
                self.ranks.send(StopMessage())
        self._stop_kv_prefault()
        if self.kernel_pool is not None:  # its helpers read the weights and the KV cache: joined first
            self.kernel_pool.close()
            self.kernel_pool = None
            from asyncllm.backends.cpu._gemm import PanelArgmaxHead

            for model in (self.model, self.draft.model if self.draft is not None else None):
                if model is not None and model.lean is not None:
                    model.lean.pool = None
                if model is not None and isinstance(model.greedy_head, PanelArgmaxHead):
                    model.greedy_head.pool = None
            self._pooled_heads = []
        self._hidden = None
        self._tables = None
        self.collectives = None
        self.parallel = SINGLE  # the process group (its sockets) goes with the last reference to it
        self.graphs = None
        self.model = None
        self.kv_caches = []
        self.sampler = None
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


class DraftModel:
    """A draft model beside the target (``speculative_method="draft_model"``), on the device thread.

    Its KV tensors are indexed by the target's slots (the same block tables); its passes have their
    own ``InputBatch`` rows.

    Args:
        model: The loaded draft model.
        backend: Its attention backend (its own heads).
        batch: Rows for its passes until the cache is sized (the activation probe's step).
    """

    def __init__(self, model: DecoderForCausalLM, backend: AttentionBackend[Any], batch: InputBatch) -> None:
        self.model = model
        self.backend = backend
        self.kv_caches: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.batch = batch
        """The rows of each step's first draft pass (every sequence of the step)."""
        self.pass_batch = batch
        """The rows of the later proposal passes (replaced by a batch of its own after the KV sizing)."""
        self.pending: dict[int, tuple[int, list[int], torch.Tensor | None]] = {}
        """Per request, its latest proposal: the position of its first token, the tokens, and the
        [tokens, vocab] distributions they were drawn from (None when greedy)."""

    def forget(self, request_ids: list[int]) -> None:
        """Drop finished requests' proposals and proposal rows."""
        for request_id in request_ids:
            self.pending.pop(request_id, None)
        self.batch.remove(request_ids)
        if self.pass_batch is not self.batch:
            self.pass_batch.remove(request_ids)

    def probs_of(self, seq: SequenceInput) -> torch.Tensor | None:
        """The distributions ``seq``'s draft was drawn from, when it is this model's latest sampled proposal.

        A draft that is not (another position, other tokens: never, as the scheduler feeds the latest
        proposal) is verified as a point mass.
        """
        held = self.pending.pop(seq.request_id, None)
        if held is None:
            return None
        position, tokens, probs = held
        if probs is None:
            return None
        draft = list(seq.token_ids[len(seq.token_ids) - seq.num_draft :])
        start = seq.start_position + len(seq.token_ids) - seq.num_draft
        if position != start or tokens[: len(draft)] != draft:
            return None
        return probs[: len(draft)]


def check_same_tokenizer(target: Path, draft: Path) -> None:
    """Refuse a draft model whose tokenizer is not the target's (the same token for every id).

    Raises:
        ValueError: Either folder has no ``tokenizer.json``, or their vocabularies (added tokens
            included) differ.
    """
    from tokenizers import Tokenizer

    vocabularies = []
    for folder in (target, draft):
        file = folder / "tokenizer.json"
        if not file.is_file():
            raise ValueError(
                f'speculative_method="draft_model" compares the tokenizers of the target and the draft: '
                f"{str(folder)!r} has no tokenizer.json"
            )
        vocabularies.append(Tokenizer.from_file(str(file)).get_vocab(with_added_tokens=True))
    if vocabularies[0] != vocabularies[1]:
        differing = sorted(set(vocabularies[0].items()) ^ set(vocabularies[1].items()))[:3]
        raise ValueError(
            f"speculative_model {str(draft)!r} has another tokenizer than the target's (e.g. {differing}): "
            "a draft model must share the target's vocabulary"
        )


def logit_rows(sample_index: np.ndarray[Any, Any], sequences: list[SequenceInput]) -> np.ndarray[Any, Any]:
    """The rows of a step's hidden states whose logits its sampling needs: each sampling sequence's
    newest token's row (``sample_index``), preceded by its draft's rows where it fed one. Every rank of
    a tensor-parallel model gathers these same rows, in this order, after the forward."""
    drafts = [seq.num_draft for seq in sequences if seq.sample]
    if not any(drafts):
        return sample_index
    return np.concatenate([np.arange(index - draft, index + 1) for index, draft in zip(sample_index, drafts)])


def _without_draft(seq: SequenceInput) -> SequenceInput:
    """``seq`` with its draft tokens left out (the tokens that are the request's own)."""
    if not seq.num_draft:
        return seq
    return dataclasses.replace(seq, token_ids=seq.token_ids[: len(seq.token_ids) - seq.num_draft], num_draft=0)


IdFill = tuple[torch.Tensor, torch.Tensor]
"""Placeholder ids filled on the device: (flat rows of the step's input ids, the ids they take)."""


class PendingStep:
    """A launched step: its sampled ids on their way to the host (``TorchModelRunner.launch``).

    Args:
        runner: The runner that launched it (its ops and timings).
        sample_rows: Each sampling request's row in the step's samples.
        device_ids: The sampled ids on the device (None when the host picked them: the CPU's greedy head).
        host_ids: Where the ids arrive on the host (a list when already there).
        event: Recorded after the step's last launch; complete once ``host_ids`` holds the ids.
        clock: The step's timings, added when the step completes.
        rest: The logprobs, prompt logprobs, failures, pooled vectors, verified drafts and draft-model
            proposals of the ``StepOutput``.
    """

    def __init__(
        self,
        runner: TorchModelRunner | None,
        *,
        sample_rows: dict[int, int],
        device_ids: torch.Tensor | None,
        host_ids: torch.Tensor | list[int],
        event: Any,
        clock: _StepClock | None,
        rest: tuple[
            list[PositionLogprobs | None] | None,
            dict[int, list[PositionLogprobs | None]] | None,
            dict[int, str] | None,
            dict[int, PooledVector] | None,
            dict[int, VerifiedDraft] | None,
            dict[int, list[int]] | None,
        ],
    ) -> None:
        self._runner = runner
        self.sample_rows = sample_rows
        self.device_ids = device_ids
        self._host_ids = host_ids
        self._event = event
        self._clock = clock
        self._rest = rest
        self._output: StepOutput | None = None

    @classmethod
    def done(cls, output: StepOutput) -> PendingStep:
        """A step whose output is known already (an empty batch)."""
        pending = cls(None, sample_rows={}, device_ids=None, host_ids=[], event=None, clock=None, rest=(None,) * 6)
        pending._output = output
        return pending

    def result(self) -> StepOutput:
        """Wait for the step's sampled ids (once; later calls return the same output).

        Raises:
            DeviceOutOfMemoryError: torch ran out of device memory.
        """
        if self._output is None:
            runner = self._runner
            assert runner is not None
            try:
                runner.ops.wait(self._event)
                host = self._host_ids
                token_ids = runner.ops.tolist(host) if isinstance(host, torch.Tensor) else host
            except torch.OutOfMemoryError as exc:
                raise DeviceOutOfMemoryError(f"the device ran out of memory during a step: {exc}") from exc
            if self._clock is not None:
                self._clock.add_to(runner.timings)
            self._output = StepOutput(token_ids, *self._rest)
        return self._output


class _StepClock:
    """Splits one step's time into input preparation, forward and sampling (``RunnerTimings``).

    Preparation is host work, timed on the host. On CUDA the forward and sampling are queued
    asynchronously, so host timestamps would measure launches: events recorded on the runner's
    stream time them on the device instead, read after the step's one synchronization (the wait for
    the event recorded after the clock's last mark), so the clock adds no synchronization of its own.
    A step launched while its predecessor still computes starts its forward's clock behind it: with
    the overlap, ``forward`` includes that queueing.
    """

    def __init__(self, device: torch.device) -> None:
        self._cuda = device.type == "cuda"
        self._host = [time.perf_counter()]
        self._events: list[torch.cuda.Event] = []

    def mark(self) -> None:
        """End the current part (call after preparation, after the forward, after sampling)."""
        self._host.append(time.perf_counter())
        if self._cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            self._events.append(event)

    def add_to(self, timings: RunnerTimings) -> None:
        """Add the three parts to ``timings``, once all three marks are made."""
        host = self._host
        timings.prepare += host[1] - host[0]
        if self._cuda:
            start, forwarded, sampled = self._events  # complete: the step's event came after them
            timings.forward += start.elapsed_time(forwarded) / 1000.0
            timings.sample += forwarded.elapsed_time(sampled) / 1000.0
        else:
            timings.forward += host[2] - host[1]
            timings.sample += host[3] - host[2]
