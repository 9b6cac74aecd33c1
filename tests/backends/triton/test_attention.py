"""The paged-attention kernels (``paged_attention``, ``split_kv_decode``) against the torch backend.

Each case is a flat mixed batch of (query length, context length) pairs over a paged cache whose
blocks are handed out in random order. Cache slots that no sequence owns hold NaN, and so does the
output before the kernel runs: a kernel that reads a slot it should not, or leaves a row unwritten,
fails the comparison. The reference is ``asyncllm.backends.torch._attention.paged_attention`` with the
``AttentionMetadata`` the runner would build. On the CPU the kernels run in triton's interpreter
(slow, so shapes are small and key tiles are 16 wide, to cross tile and block boundaries); on a GPU
the same tests run with longer contexts and the launchers' own tile shapes.
"""

from __future__ import annotations

import pytest

pytest.importorskip("triton", reason="triton is not installed (pip install -e '.[gpu]')")

import torch

from asyncllm.backends.torch._attention import AttentionMetadata, PrefillChunk
from asyncllm.backends.torch._attention import paged_attention as torch_paged_attention
from asyncllm.backends.triton._kernels.paged_attention import paged_attention
from asyncllm.backends.triton._kernels.split_kv_decode import num_kv_splits, split_kv_attention

GPU = torch.cuda.is_available()
DEVICE = torch.device("cuda" if GPU else "cpu")
BLOCK_SIZE = 16
# The interpreter runs one program at a time in Python: narrow key tiles keep arrays small and make
# even short contexts cross several tiles. On a GPU the launchers pick their own tiles.
TILES: dict[str, int | None] = {"block_m": None, "tile_n": None} if GPU else {"block_m": None, "tile_n": 16}

# (query_len, seq_len) per sequence: block boundaries (1, bs-1, bs, bs+1), decode rows, prefill
# chunks with and without cached context.
CASES: dict[str, list[tuple[int, int]]] = {
    "decode": [(1, 1), (1, 15), (1, 16), (1, 17), (1, 33)],
    "prefill": [(15, 15), (16, 16), (17, 17), (2, 2)],
    "mixed": [(5, 20), (1, 16), (17, 17), (3, 35), (1, 1), (16, 32)],
}
if GPU:
    CASES["long"] = [(1, 4097), (300, 2000), (1, 513), (129, 129), *[(1, 1000 + 37 * i) for i in range(40)]]
GQA = {"mha": (4, 4), "gqa2": (4, 2), "gqa4": (8, 2), "mqa": (4, 1)}
TOLERANCE = {
    torch.float32: {"atol": 2e-5, "rtol": 1e-4},
    torch.float16: {"atol": 2e-3, "rtol": 1e-2},
    torch.bfloat16: {"atol": 2e-2, "rtol": 2e-2},
}


class Batch:
    """A random flat batch over a paged cache, with both backends' metadata."""

    def __init__(
        self, case: list[tuple[int, int]], heads: int, kv_heads: int, head_dim: int, dtype: torch.dtype, seed: int = 0
    ) -> None:
        gen = torch.Generator().manual_seed(seed)
        self.case = case
        blocks_per_seq = [-(-seq_len // BLOCK_SIZE) for _, seq_len in case]
        num_blocks = sum(blocks_per_seq) + 3  # a few blocks nobody owns
        order = torch.randperm(num_blocks, generator=gen).tolist()
        self.tables: list[list[int]] = []
        for n in blocks_per_seq:
            self.tables.append(order[:n])
            order = order[n:]
        slots = num_blocks * BLOCK_SIZE
        self.k_cache = torch.full((slots, kv_heads, head_dim), float("nan"), dtype=dtype)
        self.v_cache = torch.full((slots, kv_heads, head_dim), float("nan"), dtype=dtype)
        for table, (_, seq_len) in zip(self.tables, case):
            owned = self.slots(table, torch.arange(seq_len))
            self.k_cache[owned] = torch.randn(seq_len, kv_heads, head_dim, generator=gen).to(dtype)
            self.v_cache[owned] = torch.randn(seq_len, kv_heads, head_dim, generator=gen).to(dtype)
        num_tokens = sum(q for q, _ in case)
        self.q = torch.randn(num_tokens, heads, head_dim, generator=gen).to(dtype)
        self.scale = head_dim**-0.5
        max_blocks = max(blocks_per_seq)
        self.query_start_loc = torch.tensor([0] + [sum(q for q, _ in case[: i + 1]) for i in range(len(case))])
        self.seq_lens = torch.tensor([s for _, s in case])
        self.block_tables = torch.tensor([t + [0] * (max_blocks - len(t)) for t in self.tables])
        self.max_query_len = max(q for q, _ in case)

    @staticmethod
    def slots(table: list[int], positions: torch.Tensor) -> torch.Tensor:
        return torch.tensor(table)[positions // BLOCK_SIZE] * BLOCK_SIZE + positions % BLOCK_SIZE

    def reference(self, sliding_window: int | None = None, softcap: float | None = None) -> torch.Tensor:
        """The torch backend's output (on a NaN-free copy of the cache: SDPA multiplies masked NaN by 0)."""
        decode_rows, decode_slots, decode_masks, prefills = [], [], [], []
        max_len = max((s for q, s in self.case if q == 1), default=0)
        offset = 0
        for table, (q_len, seq_len) in zip(self.tables, self.case):
            kv_pos = torch.arange(seq_len)
            q_pos = torch.arange(seq_len - q_len, seq_len)
            mask = kv_pos[None, :] <= q_pos[:, None]
            if sliding_window is not None:
                mask &= kv_pos[None, :] > q_pos[:, None] - sliding_window
            if q_len == 1:
                decode_rows.append(offset)
                decode_slots.append(torch.nn.functional.pad(self.slots(table, kv_pos), (0, max_len - seq_len)))
                decode_masks.append(torch.nn.functional.pad(mask[0], (0, max_len - seq_len)))
            else:
                prefills.append(PrefillChunk(offset, offset + q_len, self.slots(table, kv_pos), mask))
            offset += q_len
        meta = AttentionMetadata(
            slot_mapping=torch.empty(0, dtype=torch.int64),
            decode_token_index=torch.tensor(decode_rows, dtype=torch.int64),
            decode_kv_slots=torch.stack(decode_slots) if decode_slots else torch.zeros(0, 0, dtype=torch.int64),
            decode_mask=(torch.stack(decode_masks) if decode_masks else torch.zeros(0, 0, dtype=torch.bool))[
                :, None, None, :
            ],
            prefills=tuple(prefills),
        )
        k, v = self.k_cache.nan_to_num(0.0).float(), self.v_cache.nan_to_num(0.0).float()
        return torch_paged_attention(self.q.float(), k, v, meta, self.scale, softcap=softcap)

    def device_args(self) -> tuple[torch.Tensor, ...]:
        as_int = [self.query_start_loc, self.seq_lens, self.block_tables]
        return (
            self.q.to(DEVICE),
            self.k_cache.to(DEVICE),
            self.v_cache.to(DEVICE),
            *(t.to(DEVICE, torch.int32) for t in as_int),
        )

    def poisoned_out(self) -> torch.Tensor:
        return torch.full(self.q.shape, float("nan"), dtype=self.q.dtype, device=DEVICE)


def _check(out: torch.Tensor, batch: Batch, sliding_window: int | None = None, softcap: float | None = None) -> None:
    expected = batch.reference(sliding_window, softcap)
    assert not out.isnan().any(), "the kernel left rows unwritten or read a slot it does not own"
    torch.testing.assert_close(out.float().cpu(), expected, **TOLERANCE[batch.q.dtype])


def _run(
    batch: Batch, sliding_window: int | None = None, softcap: float | None = None, **tiles: int | None
) -> torch.Tensor:
    return paged_attention(
        *batch.device_args(),
        block_size=BLOCK_SIZE,
        max_query_len=batch.max_query_len,
        scale=batch.scale,
        sliding_window=sliding_window,
        softcap=softcap,
        out=batch.poisoned_out(),
        **(tiles or TILES),
    )


@pytest.mark.parametrize("gqa", list(GQA))
@pytest.mark.parametrize("case", list(CASES))
def test_paged_attention_ragged_batches(case: str, gqa: str) -> None:
    heads, kv_heads = GQA[gqa]
    batch = Batch(CASES[case], heads, kv_heads, 64, torch.float32)
    _check(_run(batch), batch)


@pytest.mark.parametrize("head_dim", [64, 80, 96, 128, 256])
def test_paged_attention_head_sizes(head_dim: int) -> None:
    batch = Batch(CASES["mixed"], 8, 2, head_dim, torch.float32, seed=head_dim)
    _check(_run(batch), batch)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_paged_attention_half_precision(dtype: torch.dtype) -> None:
    batch = Batch(CASES["mixed"], 4, 2, 128, dtype, seed=1)
    _check(_run(batch), batch)


@pytest.mark.parametrize("window", [1, 7, 16])
def test_paged_attention_sliding_window(window: int) -> None:
    batch = Batch(CASES["mixed"], 4, 2, 64, torch.float32, seed=window)
    _check(_run(batch, sliding_window=window), batch, sliding_window=window)


def test_paged_attention_default_tiles_and_one_sequence() -> None:
    # The launcher's own tile shapes (one key tile covers a short context), and a 1-sequence batch.
    batch = Batch([(17, 40)], 8, 2, 80, torch.float32, seed=3)
    _check(_run(batch, block_m=None, tile_n=None), batch)


@pytest.mark.parametrize(("case", "gqa", "splits"), [("decode", "gqa2", 2), ("decode", "mqa", 5), ("mixed", "gqa4", 3)])
def test_split_kv_matches_torch(case: str, gqa: str, splits: int) -> None:
    heads, kv_heads = GQA[gqa]
    batch = Batch(CASES[case], heads, kv_heads, 80, torch.float32, seed=splits)
    out = split_kv_attention(
        *batch.device_args(),
        block_size=BLOCK_SIZE,
        max_query_len=batch.max_query_len,
        scale=batch.scale,
        num_splits=splits,
        out=batch.poisoned_out(),
        **TILES,
    )
    _check(out, batch)


def test_split_kv_sliding_window_half_precision() -> None:
    batch = Batch(CASES["decode"], 4, 2, 64, torch.float16, seed=9)
    out = split_kv_attention(
        *batch.device_args(),
        block_size=BLOCK_SIZE,
        max_query_len=1,
        scale=batch.scale,
        num_splits=3,
        sliding_window=20,
        out=batch.poisoned_out(),
        **TILES,
    )
    _check(out, batch, sliding_window=20)


def test_num_kv_splits_policy() -> None:
    assert num_kv_splits(num_seqs=256, num_kv_heads=8, max_seq_len=4096, num_sms=132) == 1  # fills the device
    assert num_kv_splits(num_seqs=1, num_kv_heads=8, max_seq_len=300, num_sms=132) == 1  # short context
    splits = num_kv_splits(num_seqs=1, num_kv_heads=8, max_seq_len=4096, num_sms=132)
    assert 1 < splits <= 4096 // 256


# Soft-capping (gemma2): caps of the order of the scores (randn q and k of head size 64 scaled by 1/8
# give scores of about 1, up to 4), so tanh bends most of them and saturates the largest; 50 is
# gemma2's own cap (nearly linear here), and 0.5 saturates nearly every score.
@pytest.mark.parametrize("softcap", [0.5, 1.5, 50.0])
def test_paged_attention_softcap(softcap: float) -> None:
    batch = Batch(CASES["mixed"], 4, 2, 64, torch.float32, seed=21)
    out = _run(batch, softcap=softcap)
    _check(out, batch, softcap=softcap)
    # The cap is applied: even gemma2's nearly linear 50 moves the result far more than the tolerance.
    assert (out.float().cpu() - batch.reference()).abs().max() > 1e-3


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_paged_attention_softcap_half_precision_with_a_window(dtype: torch.dtype) -> None:
    batch = Batch(CASES["mixed"], 4, 2, 64, dtype, seed=22)
    _check(_run(batch, sliding_window=7, softcap=1.5), batch, sliding_window=7, softcap=1.5)


@pytest.mark.parametrize(("dtype", "window"), [(torch.float32, None), (torch.float16, 20)], ids=["fp32", "fp16-window"])
def test_split_kv_softcap(dtype: torch.dtype, window: int | None) -> None:
    batch = Batch(CASES["decode"], 4, 1, 64, dtype, seed=23)
    out = split_kv_attention(
        *batch.device_args(),
        block_size=BLOCK_SIZE,
        max_query_len=1,
        scale=batch.scale,
        num_splits=3,
        sliding_window=window,
        softcap=1.5,
        out=batch.poisoned_out(),
        **TILES,
    )
    _check(out, batch, sliding_window=window, softcap=1.5)


@pytest.mark.parametrize("softcap", [0.0, -1.0, float("inf"), float("nan")])
def test_softcap_must_be_positive_and_finite(softcap: float) -> None:
    batch = Batch(CASES["decode"][:1], 4, 2, 64, torch.float32)
    with pytest.raises(ValueError, match="softcap"):
        _run(batch, softcap=softcap)
    with pytest.raises(ValueError, match="softcap"):
        split_kv_attention(*batch.device_args(), block_size=BLOCK_SIZE, max_query_len=1, scale=batch.scale,
                           num_splits=2, softcap=softcap)  # fmt: skip
