"""Batched sampling: one pass over the whole batch, per-request parameters as tensors.

``Sampler.sample`` turns a step's [batch, vocab] logits into one token per row. Requests with
different parameters share the pass: each stage runs once for the rows that use it, on tensors
(row and column index lists for the sparse stages, [rows, 1] parameter columns for the dense ones);
the only Python loops are over requests, gathering their parameters, never over the vocabulary.
The stages, in vLLM's order:

1. log-probabilities of the raw logits, kept for ``logprobs`` (before anything changes them);
2. ``allowed_token_ids``, ``bad_words``, ``min_tokens`` (EOS and stop ids masked), ``logit_bias``;
3. repetition (HF), presence and frequency (OpenAI) penalties;
   then the grammar of ``structured_output``: one bitmask for every constrained row, filled by the
   grammar engine in one call (in parallel), applied in one masked fill; a row the earlier stages
   left with nothing the grammar allows takes the grammar's mask alone;
4. greedy rows take the argmax; the others: ``temperature``, ``min_p``, ``top_k``/``top_p``, then a
   draw by the exponential race (``argmax(p / E)``, ``E ~ Exp(1)``).

``top_k``/``top_p`` never sort the vocabulary when they can avoid it: a row's candidates are its
``top_k`` best tokens (one ``topk`` for the batch), or, for ``top_p`` alone, its best 1,024 when
they hold at least ``top_p`` of the probability (otherwise the full sort). The draw then runs over
the candidates only.

A seeded request draws its noise from its own ``torch.Generator``, as many values per step as it
has candidates (its own ``top_k``, 1,024 or the vocabulary, decided from its own logits), so its
tokens do not depend on which other requests share the batch; unseeded requests share the
sampler's generator.

Penalties and multi-token bad words need each request's tokens so far. ``record`` keeps them by
position from what each step feeds: a step that starts at position ``p`` first drops whatever the
history holds from ``p`` on (recompute after preemption starts again at 0), then writes the fed
tokens; positions never fed (a prefix-cache hit) are taken from the prompt. A penalised request
also owns a slot in two tables kept on the device with one scatter per step for the whole batch:
its generated-token counts ([slots, vocab]) and its distinct tokens, prompt and output
([slots, width]); the penalties then touch only those tokens' logits (a gather and a scatter),
not the whole vocabulary.

A constrained request's matcher follows the same history: before its mask is computed it consumes
the output tokens it has not seen (or rolls back those the history no longer holds), so it is right
after preemption, recompute and prefix-cache hits, and with async scheduling (the device thread
knows the previous step's token when the next step starts).

``Sampler.verify`` checks speculative drafts. Each draft position's logits go through the same stages
as a plain step's would at that position: a request whose stages read its history (penalties, bad words
of several tokens, a grammar) is verified position by position, each accepted draft token recorded
before the next position is processed (so its penalties count it and its grammar has consumed it); the
others, all positions at once. Greedy accepts a draft token while it is the argmax. Otherwise each
draft token ``d`` (a deterministic proposal: all its probability on ``d``) is accepted with probability
``p(d)`` under the target distribution ``p`` at its position (after temperature, min_p, top_k/top_p);
at the first rejection the token is drawn from ``p`` with ``d`` removed and renormalised, and after a
fully accepted draft one more token is drawn from the next position's ``p``. Each emitted token then
has exactly the distribution plain sampling gives it (the standard speculative sampling argument with a
point-mass draft), so only the speed changes.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from asyncllm.executor._runner import PositionLogprobs, SequenceInput, VerifiedDraft
from asyncllm.sampling_params import SamplingParams
from asyncllm.structured import GrammarBackend, GrammarMatcher
from asyncllm.worker._device_ops import DeviceOps, device_ops

_NEG_INF = float("-inf")
_PROMPT_LOGPROBS_CHUNK = 512  # rows of [rows, vocab] logits computed at once for prompt_logprobs
_TOP_P_CANDIDATES = 1024  # a top_p-only row draws from its best 1,024 tokens when they hold top_p


@dataclass(frozen=True, slots=True)
class SamplerOutput:
    """One step's samples."""

    token_ids: torch.Tensor
    """[batch] int64 token ids, on the sampler's device."""
    logprobs: list[PositionLogprobs | None] | None
    """Per row, when some row asked for logprobs (None for the rows that did not)."""


def num_prompt_tokens(seq: SequenceInput) -> int:
    """The length of ``seq``'s prompt (inferred from ``num_generated`` when the prompt is not given)."""
    if seq.prompt_token_ids:
        return len(seq.prompt_token_ids)
    end = seq.start_position + len(seq.token_ids)
    return end - seq.num_generated if seq.sample else end


@dataclass(slots=True)
class _RequestState:
    """What the sampler keeps for one request between steps (built on first sight, dropped by ``forget``)."""

    params: SamplingParams
    num_prompt: int
    stop_ids: torch.Tensor | None  # masked until min_tokens are generated
    bias_ids: torch.Tensor | None
    bias_values: torch.Tensor | None
    mask_row: int | None  # in the allowed_token_ids mask table
    banned_ids: torch.Tensor | None  # one-token bad words
    long_bad_words: tuple[tuple[int, ...], ...]  # bad words of several tokens
    tokens: list[int] | None  # by position; kept only when penalties or long bad words need it
    slot: int | None  # in the penalty tables (penalised requests only)
    generator: torch.Generator | None
    matcher: GrammarMatcher | None = None  # structured output
    num_matched: int = 0  # output tokens the matcher has consumed
    grammar_failed: bool = False  # the matcher refused a token: the row goes unconstrained, the request ends
    prompt_logprobs: list[PositionLogprobs | None] | None = None
    prompt_logprobs_sent: bool = False


class _PenaltyTables:
    """Per penalised request (a slot): generated-token counts and distinct tokens, on the device."""

    def __init__(self, vocab_size: int, ops: DeviceOps) -> None:
        self.vocab_size = vocab_size
        self.device = device = ops.device
        self.ops = ops
        self.counts = torch.zeros(0, vocab_size, dtype=torch.int32, device=device)
        self.distinct = torch.zeros(0, 64, dtype=torch.int64, device=device)
        self.num_distinct: list[int] = []
        self.seen: list[set[int]] = []
        self._free: list[int] = []

    def acquire(self) -> int:
        if not self._free:
            old = self.counts.shape[0]
            new = max(16, 2 * old)
            self.counts = torch.cat([self.counts, self.counts.new_zeros(new - old, self.vocab_size)])
            self.distinct = torch.cat([self.distinct, self.distinct.new_zeros(new - old, self.distinct.shape[1])])
            self.num_distinct.extend([0] * (new - old))
            self.seen.extend(set() for _ in range(new - old))
            self._free.extend(range(new - 1, old - 1, -1))
        slot = self._free.pop()
        self.counts[slot] = 0
        self.num_distinct[slot] = 0
        self.seen[slot] = set()
        return slot

    def release(self, slot: int) -> None:
        self._free.append(slot)


class _MaskTable:
    """[rows, vocab] bool, True outside a request's ``allowed_token_ids``; a row per such request.

    Rows of one table, gathered by index, beat stacking per-request tensors (slow for bools on the CPU).
    """

    def __init__(self, vocab_size: int, ops: DeviceOps) -> None:
        self.ops = ops
        self.masks = torch.zeros(0, vocab_size, dtype=torch.bool, device=ops.device)
        self._free: list[int] = []

    def acquire(self, allowed: Sequence[int]) -> int:
        if not self._free:
            old = self.masks.shape[0]
            new = max(16, 2 * old)
            self.masks = torch.cat([self.masks, self.masks.new_zeros(new - old, self.masks.shape[1])])
            self._free.extend(range(new - 1, old - 1, -1))
        row = self._free.pop()
        self.masks[row] = True
        self.masks[row, self.ops.tensor(list(allowed), torch.int64)] = False
        return row

    def release(self, row: int) -> None:
        self._free.append(row)


class _PenaltyUpdates:
    """Writes to the penalty tables, gathered over a step and applied at once."""

    def __init__(self, tables: _PenaltyTables) -> None:
        self.tables = tables
        self.resets: list[int] = []
        self.count_slots: list[int] = []
        self.count_ids: list[int] = []
        self.count_deltas: list[int] = []
        self.distinct_slots: list[int] = []
        self.distinct_columns: list[int] = []
        self.distinct_ids: list[int] = []

    def count(self, slot: int, token_ids: Sequence[int], delta: int) -> None:
        self.count_slots.extend([slot] * len(token_ids))
        self.count_ids.extend(token_ids)
        self.count_deltas.extend([delta] * len(token_ids))

    def see(self, slot: int, token_ids: Sequence[int], *, rebuild: bool) -> None:
        """Add tokens to the slot's distinct set (or, on ``rebuild``, make the set exactly those)."""
        tables = self.tables
        if rebuild:
            tables.seen[slot] = set()
            tables.num_distinct[slot] = 0
        seen = tables.seen[slot]
        for token_id in token_ids:
            if token_id not in seen:
                seen.add(token_id)
                self.distinct_slots.append(slot)
                self.distinct_columns.append(tables.num_distinct[slot])
                self.distinct_ids.append(token_id)
                tables.num_distinct[slot] += 1

    def apply(self) -> None:
        tables, ops = self.tables, self.tables.ops
        if self.resets:
            tables.counts[ops.tensor(self.resets, torch.int64)] = 0
        if self.count_slots:
            tables.counts.index_put_(
                (ops.tensor(self.count_slots, torch.int64), ops.tensor(self.count_ids, torch.int64)),
                ops.tensor(self.count_deltas, torch.int32),
                accumulate=True,
            )
        if self.distinct_slots:
            width = tables.distinct.shape[1]
            needed = max(self.distinct_columns) + 1
            if needed > width:
                grown = tables.distinct.new_zeros(tables.distinct.shape[0], max(needed, 2 * width))
                grown[:, :width] = tables.distinct
                tables.distinct = grown
            tables.distinct.index_put_(
                (
                    ops.tensor(self.distinct_slots, torch.int64),
                    ops.tensor(self.distinct_columns, torch.int64),
                ),
                ops.tensor(self.distinct_ids, torch.int64),
            )


def row_argmax(x: torch.Tensor) -> torch.Tensor:
    """``x.argmax(dim=-1)`` of a 2-D tensor (int64; the first maximum wins ties, as in torch).

    On the CPU it goes through numpy, whose vectorized argmax reads float32 rows many times faster
    than torch's CPU kernel; it is the whole of greedy sampling, once per step.
    """
    if x.device.type == "cpu" and x.dim() == 2 and x.dtype in (torch.float32, torch.float64):
        return torch.from_numpy(x.numpy().argmax(axis=-1).astype(np.int64, copy=False))
    return x.argmax(dim=-1)


class Sampler:
    """Turns a [batch, vocab] float logits tensor into one token id per row (see the module docstring).

    Args:
        device: Where generators, penalty tables and noise live.
        vocab_size: Width of the logits.
        eos_token_ids: The model's end-of-sequence ids (masked for ``min_tokens`` unless ``ignore_eos``).
        seed: Seed of the generator shared by unseeded requests (None: nondeterministic).
        ops: How lists reach the device (``DeviceOps``; pinned and non-blocking on CUDA), and so the
            runner's: default ``device_ops(device)``.
    """

    def __init__(
        self,
        device: torch.device,
        vocab_size: int,
        eos_token_ids: frozenset[int] = frozenset(),
        seed: int | None = None,
        ops: DeviceOps | None = None,
    ) -> None:
        self.device = device
        self.ops = ops if ops is not None else device_ops(device)
        self.vocab_size = vocab_size
        self.eos_token_ids = eos_token_ids
        self._shared = torch.Generator(device=device)
        if seed is None:
            self._shared.seed()
        else:
            self._shared.manual_seed(seed)
        self._states: dict[int, _RequestState] = {}
        self._penalties = _PenaltyTables(vocab_size, self.ops)
        self._masks = _MaskTable(vocab_size, self.ops)
        self.failed: dict[int, str] = {}
        """Requests whose grammar stopped matching, with why; the runner reports and clears them each step."""

    # -- per-request state -----------------------------------------------------------------------

    def forget(self, request_ids: Sequence[int]) -> None:
        """Drop the state of finished requests (generators, histories, penalty slots)."""
        for request_id in request_ids:
            state = self._states.pop(request_id, None)
            if state is not None and state.slot is not None:
                self._penalties.release(state.slot)
            if state is not None and state.mask_row is not None:
                self._masks.release(state.mask_row)

    def _state(self, seq: SequenceInput) -> _RequestState:
        state = self._states.get(seq.request_id)
        if state is None:
            state = self._states[seq.request_id] = self._new_state(seq)
        return state

    def _new_state(self, seq: SequenceInput) -> _RequestState:
        p = seq.params
        device, ops = self.device, self.ops

        def ids(values: Sequence[int]) -> torch.Tensor | None:
            return ops.tensor(list(values), torch.int64).unique() if values else None

        stop_ids = None
        if p.min_tokens > 0:
            stop_ids = ids([*p.stop_token_ids, *(() if p.ignore_eos else self.eos_token_ids)])
        bias_ids = bias_values = None
        if p.logit_bias:
            bias_ids = ops.tensor(list(p.logit_bias), torch.int64)
            bias_values = ops.tensor(list(p.logit_bias.values()), torch.float32)
        long_bad_words = tuple(w for w in seq.bad_words_token_ids if len(w) > 1)
        generator = None
        if p.seed is not None and not p.greedy:
            generator = torch.Generator(device=device)
            generator.manual_seed(p.seed)
        matcher = seq.grammar.matcher() if seq.grammar is not None else None
        return _RequestState(
            params=p,
            num_prompt=num_prompt_tokens(seq),
            stop_ids=stop_ids,
            bias_ids=bias_ids,
            bias_values=bias_values,
            mask_row=self._masks.acquire(p.allowed_token_ids) if p.allowed_token_ids is not None else None,
            banned_ids=ids([w[0] for w in seq.bad_words_token_ids if len(w) == 1]),
            long_bad_words=long_bad_words,
            tokens=[] if p.has_penalties or long_bad_words or matcher is not None else None,
            slot=self._penalties.acquire() if p.has_penalties else None,
            generator=generator,
            matcher=matcher,
        )

    def record(self, sequences: Sequence[SequenceInput]) -> None:
        """Fold a step's fed tokens into the histories of the requests that need them.

        Call it once per step with every sequence of the batch (sampling or not), before ``sample``.
        """
        updates = _PenaltyUpdates(self._penalties)
        for seq in sequences:
            state = self._state(seq)
            tokens = state.tokens
            if tokens is None:
                continue
            start, slot, num_prompt = seq.start_position, state.slot, state.num_prompt
            new = list(seq.token_ids)
            # A recompute after preemption feeds known positions again, with the same tokens: the
            # history keeps them (and what follows). Cut back to this chunk, it would miss the
            # positions between the chunk's end and a later recompute's prefix-cache hit, which may
            # cover output tokens (blocks this request, or an identical one, computed before).
            known = tokens[start : start + len(new)]
            if known and known == new[: len(known)]:
                if len(known) == len(new):
                    continue
                start, new = len(tokens), new[len(known) :]
            rewound = start < len(tokens)
            if rewound:  # positions fed again with other tokens: rewind first
                if slot is not None:
                    if start <= num_prompt:
                        updates.resets.append(slot)  # every generated token goes
                    else:
                        updates.count(slot, tokens[start:], -1)
                del tokens[start:]
            if start > len(tokens):  # positions whose KV came from elsewhere: the prompt holds them
                gap = list(seq.prompt_token_ids[len(tokens) : start])
                if len(tokens) + len(gap) != start:
                    raise RuntimeError(f"request {seq.request_id}: positions before {start} were never fed")
                new = gap + new
            first = len(tokens)
            tokens.extend(new)
            if slot is not None:
                updates.count(slot, new[max(0, num_prompt - first) :], 1)
                if rewound:
                    updates.see(slot, tokens, rebuild=True)
                else:
                    updates.see(slot, new, rebuild=False)
        updates.apply()

    # -- sampling --------------------------------------------------------------------------------

    def sample(self, logits: torch.Tensor, sequences: Sequence[SequenceInput]) -> SamplerOutput:
        """Sample one token per row.

        Args:
            logits: [batch, vocab] logits (any float dtype; computed in float32). Not modified.
            sequences: The sequence of each row (``record`` has seen this step's tokens).

        Returns:
            The sampled ids, and logprobs for the rows that asked for them.
        """
        states = [self._state(seq) for seq in sequences]
        params = [state.params for state in states]
        logits = logits.float()
        logprob_rows = [row for row, p in enumerate(params) if p.logprobs is not None]
        raw_logprobs = None
        if logprob_rows:
            raw_logprobs = torch.log_softmax(self._rows(logits, logprob_rows), dim=-1)
        logits = self._process(logits, sequences, states)
        random_rows = [row for row, p in enumerate(params) if not p.greedy]
        if len(random_rows) < len(params):
            token_ids = row_argmax(logits)
        else:
            token_ids = torch.empty(len(params), dtype=torch.int64, device=self.device)
        if random_rows:
            drawn = self._draw(self._rows(logits, random_rows), [states[row] for row in random_rows])
            if len(random_rows) == len(params):
                token_ids = drawn
            else:
                token_ids[self._index(random_rows)] = drawn
        logprobs: list[PositionLogprobs | None] | None = None
        if raw_logprobs is not None:
            chosen = compute_logprobs(
                raw_logprobs,
                token_ids[self._index(logprob_rows)],
                [params[row].logprobs or 0 for row in logprob_rows],
            )
            logprobs = [None] * len(params)
            for row, entry in zip(logprob_rows, chosen):
                logprobs[row] = entry
        return SamplerOutput(token_ids, logprobs)

    def needs_history(self, seq: SequenceInput) -> bool:
        """Whether sampling ``seq`` reads its tokens so far (penalties, bad words of several tokens, a
        grammar): its fed tokens must then be real ids when ``record`` sees them, never placeholders."""
        state = self._states.get(seq.request_id)
        if state is not None:
            return state.tokens is not None
        return seq.params.has_penalties or seq.grammar is not None or any(len(w) > 1 for w in seq.bad_words_token_ids)

    def plain_greedy_rows(self, sequences: Sequence[SequenceInput]) -> list[int]:
        """The rows whose token is the first maximum of their raw logits, and nothing else of them is read.

        Greedy, no ``logprobs``, and no mask, banned word, ``min_tokens`` ban, bias or penalty applies
        this step. A head that finds the argmax without the full logits (``backends.cpu._greedy_head``)
        may serve these rows; ``sample`` serves the others. Call it after ``record``.
        """
        rows = []
        for row, seq in enumerate(sequences):
            state = self._state(seq)
            if state.params.greedy and state.params.logprobs is None and not _changes_logits(seq, state):
                rows.append(row)
        return rows

    def _index(self, rows: Sequence[int]) -> torch.Tensor:
        return self.ops.tensor(list(rows), torch.int64)

    def _rows(self, tensor: torch.Tensor, rows: list[int]) -> torch.Tensor:
        """``tensor[rows]``, without the copy when the rows are all of them, in order."""
        if len(rows) == tensor.shape[0]:
            return tensor
        return tensor[self._index(rows)]

    def _process(
        self, logits: torch.Tensor, sequences: Sequence[SequenceInput], states: list[_RequestState]
    ) -> torch.Tensor:
        """Masks, biases and penalties (stages 2 and 3); returns a new tensor when anything applies."""
        masked: list[tuple[int, int]] = []  # row, mask table row
        banned: list[tuple[int, torch.Tensor]] = []
        bias: list[tuple[int, torch.Tensor, torch.Tensor]] = []
        penalised: list[int] = []
        constrained: list[int] = []
        for row, (seq, state) in enumerate(zip(sequences, states)):
            if not _changes_logits(seq, state):
                continue
            if state.matcher is not None and self._sync_matcher(seq.request_id, state):
                constrained.append(row)
            if state.mask_row is not None:
                masked.append((row, state.mask_row))
            if state.banned_ids is not None:
                banned.append((row, state.banned_ids))
            if state.long_bad_words:
                matched = _completing_bad_words(state)
                if matched:
                    banned.append((row, self.ops.tensor(matched, torch.int64)))
            if state.stop_ids is not None and _num_generated(seq, state) < state.params.min_tokens:
                banned.append((row, state.stop_ids))
            if state.bias_ids is not None and state.bias_values is not None:
                bias.append((row, state.bias_ids, state.bias_values))
            if state.slot is not None:
                penalised.append(row)
        if not (masked or banned or bias or penalised or constrained):
            return logits
        raw = logits
        logits = logits.clone()
        if masked:
            mask = self._masks.masks[self._index([mask_row for _, mask_row in masked])]
            if len(masked) == len(states):
                logits.masked_fill_(mask, _NEG_INF)
            else:
                index = self._index([row for row, _ in masked])
                logits[index] = logits[index].masked_fill(mask, _NEG_INF)
        if banned:
            rows, columns = self._rows_and_columns(banned)
            logits[rows, columns] = _NEG_INF
        if bias:
            rows, columns = self._rows_and_columns([(row, ids) for row, ids, _ in bias])
            logits.index_put_((rows, columns), torch.cat([values for _, _, values in bias]), accumulate=True)
        if penalised:
            self._penalise(logits, penalised, [states[row] for row in penalised])
        if constrained:
            narrowed = {row for row, _ in masked} | {row for row, _ in banned}
            self._apply_grammars(raw, logits, constrained, [states[row] for row in constrained], narrowed)
        return logits

    def _sync_matcher(self, request_id: int, state: _RequestState) -> bool:
        """Bring the matcher level with the request's output so far; False once it has failed."""
        matcher, tokens = state.matcher, state.tokens
        assert matcher is not None and tokens is not None
        if state.grammar_failed:
            return False
        num_output = len(tokens) - state.num_prompt
        if state.num_matched > num_output:  # the history was rewound past tokens the matcher consumed
            matcher.rollback(state.num_matched - num_output)
            state.num_matched = num_output
        if state.num_matched < num_output:
            new = tokens[state.num_prompt + state.num_matched :]
            state.num_matched = num_output
            if not matcher.consume(new):
                state.grammar_failed = True
                self.failed[request_id] = f"the output left its structured_output grammar: {matcher.error()}"
                return False
        return True

    def _apply_grammars(
        self,
        raw: torch.Tensor,
        logits: torch.Tensor,
        rows: list[int],
        states: list[_RequestState],
        narrowed: set[int],
    ) -> None:
        """Mask the constrained rows of ``logits`` by their grammars (one bitmask for all of them).

        ``narrowed`` holds the rows an earlier stage masked (allowed ids, bans): only those can be
        left with no token at all, and only they are checked for it.
        """
        bitmask = np.zeros((len(rows), (self.vocab_size + 31) // 32), dtype=np.int32)
        by_backend: dict[int, tuple[GrammarBackend, list[int]]] = {}
        for position, state in enumerate(states):
            assert state.matcher is not None
            backend = state.matcher.backend
            by_backend.setdefault(id(backend), (backend, []))[1].append(position)
        for backend, positions in by_backend.values():
            if len(positions) == len(states):
                backend.fill_bitmasks([state.matcher for state in states], bitmask)  # type: ignore[misc]
            else:
                part = np.zeros((len(positions), bitmask.shape[1]), dtype=np.int32)
                backend.fill_bitmasks([states[p].matcher for p in positions], part)  # type: ignore[misc]
                bitmask[positions] = part
        bits = np.unpackbits(bitmask.view(np.uint8), axis=1, count=self.vocab_size, bitorder="little")
        refused = self.ops.to_device(np.logical_not(bits.view(np.bool_)))
        if len(rows) == logits.shape[0]:
            logits.masked_fill_(refused, _NEG_INF)
        else:
            index = self._index(rows)
            logits[index] = logits[index].masked_fill_(refused, _NEG_INF)
        # Where allowed_token_ids, bad words or min_tokens leave nothing the grammar allows (a grammar
        # that can only end, before min_tokens), the grammar wins: its mask alone applies.
        for position, row in enumerate(rows):
            if row in narrowed and bool(torch.isneginf(logits[row]).all()):
                logits[row] = raw[row].masked_fill(refused[position], _NEG_INF)

    def _rows_and_columns(self, pairs: list[tuple[int, torch.Tensor]]) -> tuple[torch.Tensor, torch.Tensor]:
        """Flatten (row, column ids) pairs into two index tensors, in one concatenation."""
        columns = torch.cat([ids for _, ids in pairs])
        lengths = self.ops.tensor([len(ids) for _, ids in pairs], torch.int64)
        rows = self._index([row for row, _ in pairs]).repeat_interleave(lengths)
        return rows, columns

    def _penalise(self, logits: torch.Tensor, rows: list[int], states: list[_RequestState]) -> None:
        """Penalties on the logits of each row's distinct tokens only: one gather, one scatter."""
        tables = self._penalties
        params = [state.params for state in states]
        slots = [state.slot for state in states if state.slot is not None]
        num_distinct = [tables.num_distinct[slot] for slot in slots]
        width = max(num_distinct)
        slot_index = self._index(slots)
        token_ids = tables.distinct[slot_index, :width]
        # Rows with fewer distinct tokens repeat their first one: the same value is written twice.
        valid = torch.arange(width, device=self.device)[None, :] < self._index(num_distinct)[:, None]
        token_ids = torch.where(valid, token_ids, token_ids[:, :1])
        row_index = self._index(rows)[:, None].expand(-1, width)
        values = logits[row_index, token_ids]
        counts = tables.counts[slot_index[:, None].expand(-1, width), token_ids]
        if any(p.repetition_penalty != 1.0 for p in params):
            penalty = self.ops.tensor([p.repetition_penalty for p in params], torch.float32)[:, None]
            values = torch.where(values > 0, values / penalty, values * penalty)
        if any(p.frequency_penalty != 0.0 for p in params):
            frequency = self.ops.tensor([p.frequency_penalty for p in params], torch.float32)[:, None]
            values = values - frequency * counts
        if any(p.presence_penalty != 0.0 for p in params):
            presence = self.ops.tensor([p.presence_penalty for p in params], torch.float32)[:, None]
            values = values - presence * (counts > 0)
        logits[row_index, token_ids] = values

    def _draw(self, logits: torch.Tensor, states: list[_RequestState]) -> torch.Tensor:
        """Temperature, min_p, top_k/top_p and the random draw, for the non-greedy rows.

        Rows with top_k/top_p apply temperature and min_p to their candidates only: the order of the
        logits does not change with temperature, and min_p is relative to the best token, always a
        candidate.
        """
        params = [state.params for state in states]
        device, ops = self.device, self.ops
        temperature = ops.tensor([p.temperature for p in params], torch.float32)[:, None]
        # p_i < min_p * p_max  <=>  l_i < l_max + log(min_p): no softmax needed (log 0 = -inf keeps all).
        log_min_p = None
        if any(p.min_p > 0.0 for p in params):
            log_min_p = ops.tensor([math.log(p.min_p) if p.min_p > 0 else _NEG_INF for p in params], torch.float32)
            log_min_p = log_min_p[:, None]
        token_ids = torch.empty(len(params), dtype=torch.int64, device=device)
        filtered = [row for row, p in enumerate(params) if p.top_k > 0 or p.top_p < 1.0]
        plain = [row for row, p in enumerate(params) if not (p.top_k > 0 or p.top_p < 1.0)]
        if plain:
            index = self._index(plain)
            scaled = _scale(
                self._rows(logits, plain), temperature[index], None if log_min_p is None else log_min_p[index]
            )
            drawn = self._race(scaled, [states[row] for row in plain], None)
            if len(plain) == len(params):
                return drawn
            token_ids[index] = drawn
        if filtered:
            index = self._index(filtered)
            values, order, counts = _candidates(
                ops,
                self._rows(logits, filtered),
                [params[row] for row in filtered],
                temperature[index],
                None if log_min_p is None else log_min_p[index],
            )
            choice = self._race(values, [states[row] for row in filtered], counts)
            drawn = order.gather(1, choice[:, None])[:, 0]
            if len(filtered) == len(params):
                return drawn
            token_ids[index] = drawn
        return token_ids

    def _race(self, scores: torch.Tensor, states: list[_RequestState], counts: list[int] | None) -> torch.Tensor:
        """Draw a column of each row of ``scores`` (logits, -inf dropped): ``argmax(p / E)``, ``E ~ Exp(1)``.

        A seeded row's noise comes from its generator, ``counts[row]`` values (its candidates, best
        first) or the whole row; the shared generator fills the rest.
        """
        probs = torch.softmax(scores, dim=-1)
        uniform = torch.rand(scores.shape, generator=self._shared, device=self.device)
        for row, state in enumerate(states):
            if state.generator is not None:
                size = scores.shape[-1] if counts is None else counts[row]
                uniform[row, :size] = torch.rand(size, generator=state.generator, device=self.device)
        # -log(U) ~ Exp(1); torch.rand is several times faster than exponential_ on the CPU. U < 1,
        # so the noise is never 0; U = 0 gives infinite noise, which never wins.
        return row_argmax(probs / uniform.log_().neg_())

    # -- speculative decoding --------------------------------------------------------------------

    def verify(
        self,
        logits: torch.Tensor,
        sequences: Sequence[SequenceInput],
        draft_probs: Sequence[torch.Tensor | None] | None = None,
    ) -> list[VerifiedDraft]:
        """Verify the drafts of a step's drafted sequences (see the module docstring).

        Args:
            logits: [sum of (num_draft + 1), vocab]: for each sequence in order, the logits after its
                newest token and after each of its draft tokens. Not modified.
            sequences: The sequences with ``num_draft`` > 0; ``record`` has seen their tokens up to the
                draft (not the draft itself).
            draft_probs: Per sequence, None for a draft that was not drawn at random (an n-gram's, a
                greedy draft model's: a point mass, the default), or the [num_draft, vocab] distributions
                q the draft tokens were drawn from (a draft model sampling). A token d drawn from q is
                accepted with probability min(1, p(d) / q(d)); at a rejection the token is drawn from
                max(0, p - q), normalised: the emitted tokens follow p either way.

        Returns:
            Per sequence, the accepted draft tokens and the token sampled after them, with logprobs
            (of the raw logits) when the request asked for them.
        """
        results: list[VerifiedDraft | None] = [None] * len(sequences)
        together: list[tuple[int, int]] = []  # (sequence, first row) of those verified in one pass
        qs: Sequence[torch.Tensor | None] = draft_probs if draft_probs is not None else [None] * len(sequences)
        offset = 0
        for index, seq in enumerate(sequences):
            state = self._state(seq)
            rows = logits[offset : offset + seq.num_draft + 1]
            q = None if state.params.greedy else qs[index]
            if state.tokens is not None:
                results[index] = self._verify_in_order(rows.float(), seq, state, q)
            else:
                together.append((index, offset))
            offset += seq.num_draft + 1
        if together:
            drafted = [sequences[index] for index, _ in together]
            together_qs = [None if self._state(sequences[i]).params.greedy else qs[i] for i, _ in together]
            verified = self._verify_together(logits, drafted, [offset for _, offset in together], together_qs)
            for (index, _), result in zip(together, verified):
                results[index] = result
        return [result for result in results if result is not None]

    def propose(
        self, logits: torch.Tensor, sequences: Sequence[SequenceInput]
    ) -> tuple[list[int], list[torch.Tensor | None]]:
        """A draft model's next proposed token per row, and the distribution it was drawn from.

        Greedy requests propose the argmax of the draft's logits (a point mass: ``verify``'s plain rule).
        The others draw from q, the draft's logits with the request's temperature, ``min_p`` and
        ``top_k``/``top_p``; masks, biases, penalties and grammars are left to verification (q may be
        any distribution: the target's rules reject what they forbid), so q is cheap to compute.

        Args:
            logits: [rows, vocab] the draft model's logits.
            sequences: The sequence of each row (requests the sampler knows: they sampled this step).

        Returns:
            The proposed ids, and per row q as a [vocab] probability tensor (None for greedy rows).
        """
        states = [self._state(seq) for seq in sequences]
        scores = self._target_scores(logits.float(), states)
        token_ids = self.ops.tolist(row_argmax(scores))
        qs: list[torch.Tensor | None] = [None] * len(states)
        random_rows = [row for row, state in enumerate(states) if not state.params.greedy]
        if random_rows:
            rows = self._rows(scores, random_rows)
            drawn = self.ops.tolist(self._race(rows, [states[row] for row in random_rows], None))
            probs = torch.softmax(rows, dim=-1)
            for index, row in enumerate(random_rows):
                token_ids[row] = int(drawn[index])
                qs[row] = probs[index]
        return [int(token) for token in token_ids], qs

    def _verify_together(
        self,
        logits: torch.Tensor,
        sequences: list[SequenceInput],
        offsets: list[int],
        qs: list[torch.Tensor | None],
    ) -> list[VerifiedDraft]:
        """Verify drafts whose stages do not read the history: every position of every draft in one pass."""
        # One row per position: the sequence as plain decoding would have fed it up to that position.
        flat: list[int] = []
        positions: list[SequenceInput] = []
        states: list[_RequestState] = []
        for seq, offset in zip(sequences, offsets):
            fed = len(seq.token_ids) - seq.num_draft
            state = self._state(seq)
            for position in range(seq.num_draft + 1):
                flat.append(offset + position)
                positions.append(dataclasses.replace(seq, token_ids=seq.token_ids[: fed + position], num_draft=0))
                states.append(state)
        raw = self._rows(logits, flat).float()
        processed = self._process(raw, positions, states)
        scores = self._target_scores(processed, states)
        drafts = [seq.token_ids[len(seq.token_ids) - seq.num_draft :] for seq in sequences]
        firsts = self._firsts(sequences)
        argmax = self.ops.tolist(row_argmax(processed))
        p_draft: list[float] = []
        if not all(state.params.greedy for state in states):  # p(d) of every draft token, read back at once
            draft_rows = [first + j for first, draft in zip(firsts, drafts) for j in range(len(draft))]
            draft_ids = [token for draft in drafts for token in draft]
            probs = torch.softmax(scores[self._index(draft_rows)], dim=-1)
            p_draft = self.ops.tolist(probs[torch.arange(len(draft_rows), device=self.device), self._index(draft_ids)])
        results: list[VerifiedDraft] = []
        finals: list[tuple[int, int | None]] = []  # per sequence: the row it samples at, the id it excludes
        residuals: dict[int, torch.Tensor] = {}  # per sequence rejecting a drawn draft: q at the rejection
        cursor = 0
        for index, (first, draft, q) in enumerate(zip(firsts, drafts, qs)):
            state = states[first]
            if state.params.greedy:
                accepted = _greedy_run(draft, argmax[first : first + len(draft)])
            else:
                uniform = self.ops.tolist(self._uniform(state, len(draft)))
                ratios = p_draft[cursor : cursor + len(draft)]
                if q is not None:  # accepted with probability min(1, p(d) / q(d))
                    q_draft = self.ops.tolist(q[torch.arange(len(draft), device=q.device), self._index(draft)])
                    ratios = [p / qd if qd > 0 else (1.0 if p > 0 else 0.0) for p, qd in zip(ratios, q_draft)]
                accepted = _accepted_run(uniform, ratios)
                if q is not None and accepted < len(draft):
                    residuals[index] = q[accepted]
            cursor += len(draft)
            finals.append((first + accepted, draft[accepted] if accepted < len(draft) else None))
        drawn = self._draw_excluding(scores, states, finals, argmax, residuals)
        for seq, first, draft, (row, _), token in zip(sequences, firsts, drafts, finals, drawn):
            tokens = [*draft[: row - first], token]
            logprobs = None
            if seq.params.logprobs is not None:
                logprobs = compute_logprobs(
                    torch.log_softmax(raw[first : row + 1], dim=-1),
                    self._index(tokens),
                    [seq.params.logprobs] * len(tokens),
                )
            results.append(VerifiedDraft(tokens, logprobs))
        return results

    @staticmethod
    def _firsts(sequences: Sequence[SequenceInput]) -> list[int]:
        """Each sequence's first row among the rows of ``_verify_together`` (num_draft + 1 each)."""
        firsts, row = [], 0
        for seq in sequences:
            firsts.append(row)
            row += seq.num_draft + 1
        return firsts

    def _verify_in_order(
        self, logits: torch.Tensor, seq: SequenceInput, state: _RequestState, q: torch.Tensor | None = None
    ) -> VerifiedDraft:
        """Verify one draft position by position, recording each accepted token before the next position's
        stages run (penalties count it, a grammar consumes it; a token the grammar refuses has p = 0).
        ``q``: the distributions the draft was drawn from (see ``verify``), or None."""
        fed = len(seq.token_ids) - seq.num_draft
        draft = list(seq.token_ids[fed:])
        tokens: list[int] = []
        uniform = [] if state.params.greedy else self.ops.tolist(self._uniform(state, len(draft)))
        for position in range(len(draft) + 1):
            if position:  # the draft token just accepted is now history, as if fed
                at = seq.start_position + fed - 1 + position
                self.record([dataclasses.replace(seq, token_ids=[draft[position - 1]], start_position=at, num_draft=0)])
            plain = dataclasses.replace(seq, token_ids=seq.token_ids[: fed + position], num_draft=0)
            processed = self._process(logits[position : position + 1], [plain], [state])
            last = position == len(draft)
            if state.params.greedy:
                best = int(self.ops.tolist(row_argmax(processed))[0])
                if last or best != draft[position]:
                    tokens.append(best)
                    break
            else:
                scores = self._target_scores(processed, [state])
                if not last:
                    p_draft = float(torch.softmax(scores, dim=-1)[0, draft[position]])
                    ratio = p_draft
                    if q is not None:
                        q_draft = float(q[position, draft[position]])
                        ratio = p_draft / q_draft if q_draft > 0 else (1.0 if p_draft > 0 else 0.0)
                    if uniform[position] < ratio:
                        tokens.append(draft[position])
                        continue
                    if q is not None:
                        scores = _residual(scores, q[position : position + 1], draft[position])
                    else:
                        scores[0, draft[position]] = _NEG_INF
                tokens.append(int(self.ops.tolist(self._race(scores, [state], None))[0]))
                break
            tokens.append(draft[position])
        logprobs = None
        if seq.params.logprobs is not None:
            logprobs = compute_logprobs(
                torch.log_softmax(logits[: len(tokens)], dim=-1),
                self._index(tokens),
                [seq.params.logprobs] * len(tokens),
            )
        return VerifiedDraft(tokens, logprobs)

    def _uniform(self, state: _RequestState, count: int) -> torch.Tensor:
        """``count`` uniforms in [0, 1) for acceptance tests, from the request's generator when it has one."""
        generator = state.generator if state.generator is not None else self._shared
        return torch.rand(count, generator=generator, device=self.device)

    def _target_scores(self, logits: torch.Tensor, states: list[_RequestState]) -> torch.Tensor:
        """[rows, vocab] log-scores of the distribution a draw samples from (temperature, min_p, top_k/top_p
        applied; -inf for tokens it never draws). Greedy rows are left as they are (their argmax decides)."""
        params = [state.params for state in states]
        random_rows = [row for row, p in enumerate(params) if not p.greedy]
        if not random_rows:
            return logits
        scores = logits.clone()
        ops = self.ops
        temperature = ops.tensor([params[row].temperature for row in random_rows], torch.float32)[:, None]
        log_min_p = None
        if any(params[row].min_p > 0.0 for row in random_rows):
            log_min_p = ops.tensor(
                [math.log(params[row].min_p) if params[row].min_p > 0 else _NEG_INF for row in random_rows],
                torch.float32,
            )[:, None]
        filtered = [i for i, row in enumerate(random_rows) if params[row].top_k > 0 or params[row].top_p < 1.0]
        plain = [i for i, row in enumerate(random_rows) if not (params[row].top_k > 0 or params[row].top_p < 1.0)]
        if plain:
            index = self._index(plain)
            rows = self._index([random_rows[i] for i in plain])
            scores[rows] = _scale(logits[rows], temperature[index], None if log_min_p is None else log_min_p[index])
        if filtered:
            index = self._index(filtered)
            rows = self._index([random_rows[i] for i in filtered])
            values, order, _ = _candidates(
                ops,
                logits[rows],
                [params[random_rows[i]] for i in filtered],
                temperature[index],
                None if log_min_p is None else log_min_p[index],
            )
            dense = torch.full((len(filtered), logits.shape[-1]), _NEG_INF, device=logits.device)
            scores[rows] = dense.scatter_(1, order, values)
        return scores

    def _draw_excluding(
        self,
        scores: torch.Tensor,
        states: list[_RequestState],
        finals: list[tuple[int, int | None]],
        argmax: list[int],
        residuals: dict[int, torch.Tensor] | None = None,
    ) -> list[int]:
        """Each sequence's token after its accepted run: the argmax (greedy), else a draw from its row of
        ``scores`` without the rejected draft token, if any; for a sequence in ``residuals`` (its draft
        was drawn from q, given at the rejected position), from max(0, p - q) normalised."""
        tokens = [0] * len(finals)
        draws: list[tuple[int, int, int | None]] = []  # position in finals, row, excluded id
        for position, (row, excluded) in enumerate(finals):
            if states[row].params.greedy:
                tokens[position] = argmax[row]
            else:
                draws.append((position, row, excluded))
        if draws:
            rows = scores[self._index([row for _, row, _ in draws])]
            for index, (position, _, excluded) in enumerate(draws):
                residual = None if residuals is None else residuals.get(position)
                if residual is not None and excluded is not None:
                    rows[index : index + 1] = _residual(rows[index : index + 1], residual[None, :], excluded)
                elif excluded is not None:
                    rows[index, excluded] = _NEG_INF
            drawn = self.ops.tolist(self._race(rows, [states[row] for _, row, _ in draws], None))
            for (position, _, _), token in zip(draws, drawn):
                tokens[position] = int(token)
        return tokens

    # -- prompt logprobs -------------------------------------------------------------------------

    def prompt_logprobs(
        self,
        sequences: Sequence[SequenceInput],
        offsets: Sequence[int],
        logits_at: Callable[[torch.Tensor], torch.Tensor],
    ) -> dict[int, list[PositionLogprobs | None]] | None:
        """Compute the prompt logprobs of this step's chunks; return the prompts completed by it.

        Args:
            sequences: The step's sequences.
            offsets: Where each sequence's first fed token sits in the step's flat token order.
            logits_at: Logits of the given flat token rows (the runner runs the LM head).

        Returns:
            Per request that asked for them and whose prompt this step completes (it samples, or it
            is a ``max_tokens=0`` request's last chunk), its prompt logprobs aligned
            with the prompt (None first); None when no request of the step asked.
        """
        if not any(seq.params.prompt_logprobs is not None for seq in sequences):
            return None
        rows: list[int] = []
        targets: list[int] = []
        nums: list[int] = []
        owners: list[tuple[_RequestState, int, int]] = []  # state, first target position, count
        for seq, offset in zip(sequences, offsets):
            num_top = seq.params.prompt_logprobs
            if num_top is None:
                continue
            state = self._state(seq)
            if state.prompt_logprobs_sent:
                continue  # a recompute after preemption: they were delivered already
            prompt = seq.prompt_token_ids
            if state.prompt_logprobs is None:
                state.prompt_logprobs = [None] * len(prompt)
            start = seq.start_position
            end = min(start + len(seq.token_ids), len(prompt) - 1)  # position q predicts token q + 1
            if end > start:
                rows.extend(range(offset, offset + end - start))
                targets.extend(prompt[start + 1 : end + 1])
                nums.extend([num_top] * (end - start))
                owners.append((state, start + 1, end - start))
        entries: list[PositionLogprobs] = []
        for first in range(0, len(rows), _PROMPT_LOGPROBS_CHUNK):
            chunk = slice(first, first + _PROMPT_LOGPROBS_CHUNK)
            logprobs = torch.log_softmax(logits_at(self._index(rows[chunk])).float(), dim=-1)
            entries.extend(compute_logprobs(logprobs, self._index(targets[chunk]), nums[chunk]))
        position = 0
        for state, first_target, count in owners:
            assert state.prompt_logprobs is not None
            state.prompt_logprobs[first_target : first_target + count] = entries[position : position + count]
            position += count
        done: dict[int, list[PositionLogprobs | None]] = {}
        for seq in sequences:
            finished = self._states.get(seq.request_id)
            # The chunk that completes the prompt delivers them: it samples, or (max_tokens=0) it is the last.
            completes = seq.sample or seq.start_position + len(seq.token_ids) >= len(seq.prompt_token_ids)
            if completes and finished is not None and finished.prompt_logprobs is not None:
                done[seq.request_id] = finished.prompt_logprobs
                finished.prompt_logprobs = None
                finished.prompt_logprobs_sent = True
        return done


def compute_logprobs(logprobs: torch.Tensor, token_ids: torch.Tensor, nums: Sequence[int]) -> list[PositionLogprobs]:
    """The logprob and rank of ``token_ids`` in each row of ``logprobs``, with the row's top alternatives.

    Args:
        logprobs: [rows, vocab] log-probabilities.
        token_ids: [rows] the token of each row.
        nums: How many top alternatives each row wants.

    Returns:
        One ``PositionLogprobs`` per row.
    """
    chosen = logprobs.gather(1, token_ids[:, None])
    ranks = (logprobs > chosen).sum(dim=-1) + 1
    num_top = min(max(nums, default=0), logprobs.shape[-1])
    top_values: list[list[float]] = [[] for _ in nums]
    top_ids: list[list[int]] = [[] for _ in nums]
    if num_top:
        values, ids = logprobs.topk(num_top, dim=-1)
        top_values, top_ids = values.tolist(), ids.tolist()
    return [
        PositionLogprobs(token, logprob, rank, tuple(ids[:n]), tuple(values[:n]))
        for token, logprob, rank, ids, values, n in zip(
            token_ids.tolist(), chosen[:, 0].tolist(), ranks.tolist(), top_ids, top_values, nums
        )
    ]


def _residual(scores: torch.Tensor, q: torch.Tensor, excluded: int) -> torch.Tensor:
    """[1, vocab] log-scores of max(0, p - q), p = softmax(scores): what a rejected draft token drawn from
    q is replaced from. Where rounding leaves nothing (p == q, so a rejection was all but impossible),
    p without the rejected token."""
    residual = (torch.softmax(scores, dim=-1) - q.to(scores.dtype)).clamp_(min=0.0)
    if float(residual.sum()) <= 0.0:
        fallback = scores.clone()
        fallback[0, excluded] = _NEG_INF
        return fallback
    return residual.log()


def _greedy_run(draft: Sequence[int], argmax: Sequence[int]) -> int:
    """How many leading draft tokens are the argmax at their position."""
    accepted = 0
    while accepted < len(draft) and argmax[accepted] == draft[accepted]:
        accepted += 1
    return accepted


def _accepted_run(uniform: Sequence[float], p_draft: Sequence[float]) -> int:
    """How many leading draft tokens pass their acceptance test (``u < p(d)``, so with probability ``p(d)``)."""
    accepted = 0
    while accepted < len(p_draft) and uniform[accepted] < p_draft[accepted]:
        accepted += 1
    return accepted


def _changes_logits(seq: SequenceInput, state: _RequestState) -> bool:
    """Whether any of ``Sampler._process``'s stages (masks, bans, biases, penalties) may apply to this row now.

    ``_process`` skips the rows where this is False, so a stage it does not cover never runs: the two
    cannot drift apart, and ``plain_greedy_rows`` may trust it.
    """
    return (
        state.mask_row is not None
        or state.banned_ids is not None
        or bool(state.long_bad_words)
        or (state.stop_ids is not None and _num_generated(seq, state) < state.params.min_tokens)
        or (state.bias_ids is not None and state.bias_values is not None)
        or state.slot is not None
        or state.matcher is not None
    )


def _num_generated(seq: SequenceInput, state: _RequestState) -> int:
    """Tokens generated before the one this step samples (from positions, so it never lags)."""
    return seq.start_position + len(seq.token_ids) - state.num_prompt


def _completing_bad_words(state: _RequestState) -> list[int]:
    """Last tokens of the long bad words whose other tokens end the output so far."""
    tokens = state.tokens
    assert tokens is not None
    num_output = len(tokens) - state.num_prompt
    matched = []
    for word in state.long_bad_words:
        prefix = len(word) - 1
        if prefix <= num_output and tuple(tokens[len(tokens) - prefix :]) == word[:-1]:
            matched.append(word[-1])
    return matched


def _scale(logits: torch.Tensor, temperature: torch.Tensor, log_min_p: torch.Tensor | None) -> torch.Tensor:
    """Logits divided by the temperature, and the tokens below min_p (relative to the best) dropped."""
    scaled = logits / temperature
    if log_min_p is not None:
        scaled = scaled.masked_fill(scaled < scaled.amax(dim=-1, keepdim=True) + log_min_p, _NEG_INF)
    return scaled


def _candidates(
    ops: DeviceOps,
    logits: torch.Tensor, params: list[SamplingParams], temperature: torch.Tensor, log_min_p: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
    """The tokens ``top_k``/``top_p`` keep, per row, best first: without sorting the vocabulary if possible.

    Args:
        ops: How lists reach the device.
        logits: [rows, vocab] logits before temperature.
        params: Each row's parameters (each has top_k or top_p).
        temperature: [rows, 1].
        log_min_p: [rows, 1] log(min_p) (-inf where unset), or None.

    Returns:
        [rows, width] scaled logits of the candidates (-inf where dropped), [rows, width] their
        token ids, and each row's own candidate count (its ``top_k``; for ``top_p`` alone 1,024, or
        the vocabulary when its best 1,024 tokens hold less than ``top_p``), which depends on the
        row only.
    """
    vocab = logits.shape[-1]
    device = logits.device
    top_k = [min(p.top_k, vocab) if p.top_k > 0 else 0 for p in params]
    open_rows = [row for row, k in enumerate(top_k) if k == 0]  # top_p alone
    first_try = min(_TOP_P_CANDIDATES, vocab)
    width = max(max(top_k), first_try if open_rows else 0)
    values, order = logits.topk(width, dim=-1)
    counts = [k or first_try for k in top_k]
    if not any(p.top_p < 1.0 for p in params):
        kept, order, _ = _filter(ops, values, order, counts, temperature, log_min_p, None, None)
        return kept, order, counts
    lse: torch.Tensor | None = None
    if open_rows:  # top_p alone is over the probabilities of the whole vocabulary (after min_p)
        open_index = ops.tensor(open_rows, torch.int64)
        open_min_p = None if log_min_p is None else log_min_p[open_index]
        lse = torch.full((len(params),), _NEG_INF, device=device)
        lse[open_index] = _scale(logits[open_index], temperature[open_index], open_min_p).logsumexp(dim=-1)
    # top_p = 1 must never drop anything, even where the cumulative sum rounds up to 1 early.
    top_p = ops.tensor([p.top_p if p.top_p < 1.0 else 2.0 for p in params], torch.float32)[:, None]
    kept, order, cumulative = _filter(ops, values, order, counts, temperature, log_min_p, lse, top_p)
    if open_rows and first_try < vocab:
        assert cumulative is not None
        covered = ops.tolist(cumulative[open_index, first_try - 1] >= top_p[open_index, 0])
        if not all(covered):
            for row, ok in zip(open_rows, covered):
                if not ok:
                    counts[row] = vocab
            values, order = logits.sort(dim=-1, descending=True)
            kept, order, _ = _filter(ops, values, order, counts, temperature, log_min_p, lse, top_p)
    return kept, order, counts


def _filter(
    ops: DeviceOps,
    values: torch.Tensor,
    order: torch.Tensor,
    counts: list[int],
    temperature: torch.Tensor,
    log_min_p: torch.Tensor | None,
    lse: torch.Tensor | None,
    top_p: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Scale the sorted candidate logits, drop beyond each row's count, below min_p and past top_p.

    ``lse`` holds, for top_p-only rows, the log of the whole vocabulary's normaliser (-inf for the
    others, which normalise over their own candidates). Returns the kept logits (-inf elsewhere),
    the token ids and, with top_p, the cumulative probabilities.
    """
    device = values.device
    values = values / temperature
    drop = torch.arange(values.shape[-1], device=device)[None, :] >= ops.tensor(counts, torch.int64)[:, None]
    if log_min_p is not None:
        drop |= values < values[:, :1] + log_min_p  # the first candidate is the best token
    if top_p is None:
        return values.masked_fill(drop, _NEG_INF), order, None
    masked = values.masked_fill(drop, _NEG_INF)
    normaliser = masked.logsumexp(dim=-1)
    if lse is not None:
        normaliser = torch.where(lse > _NEG_INF, lse, normaliser)
    probs = (masked - normaliser[:, None]).exp()
    cumulative = probs.cumsum(dim=-1)
    drop |= (cumulative - probs) >= top_p  # the tokens ranked above already reach top_p
    return values.masked_fill(drop, _NEG_INF), order, cumulative
