"""A scripted ``ModelRunner`` and a byte tokenizer: a real Engine with no weights.

The runner emits tokens from a script instead of running a model, so applications (and asyncllm's
own tests of the layers above the model) can exercise streaming, cancellation and scheduling in
milliseconds. It is never a substitute for the model in a test of the model path.
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from asyncllm.executor._runner import RunnerInfo, SequenceInput, StepBatch, StepOutput, VerifiedDraft

EOS_ID = 256
"""The ``ByteTokenizer``'s end-of-sequence id."""


class ByteTokenizer:
    """Token ids 0-255 are UTF-8 bytes; 256 is EOS. Decoding an incomplete character yields U+FFFD,
    just as a byte-level BPE tokenizer does, which makes it a good test of incremental decoding."""

    vocab_size = 257
    eos_token_id = EOS_ID

    def encode(self, text: str) -> list[int]:
        """The UTF-8 bytes of ``text``."""
        return list(text.encode("utf-8"))

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        """The text of ``token_ids``; EOS is dropped when ``skip_special_tokens``, else written ``</s>`` where
        it stands (as a real tokenizer does: the text of a prefix is a prefix of the text)."""
        if skip_special_tokens:
            return bytes(t for t in token_ids if t != EOS_ID).decode("utf-8", errors="replace")
        parts: list[str] = []
        run: list[int] = []
        for token_id in token_ids:
            if token_id == EOS_ID:
                parts += [bytes(run).decode("utf-8", errors="replace"), "</s>"]
                run = []
            else:
                run.append(token_id)
        parts.append(bytes(run).decode("utf-8", errors="replace"))
        return "".join(parts)


@dataclass(frozen=True, slots=True)
class RecordedStep:
    """What one step asked of the scripted runner."""

    sequences: tuple[SequenceInput, ...]
    finished_request_ids: tuple[int, ...]


Script = Callable[[SequenceInput], int]


def cycle(tokens: Sequence[int]) -> Script:
    """A script that emits ``tokens`` in order (and round again), for every request."""
    frozen = tuple(tokens)
    if not frozen:
        raise ValueError("cycle() needs at least one token")
    return lambda seq: frozen[seq.num_generated % len(frozen)]


class ScriptedRunner:
    """A ``ModelRunner`` that samples from a script. KV blocks are only counted, never stored.

    It verifies speculative drafts as a greedy model would: a draft token is accepted while it is the
    script's token at its position, and the script's token follows the accepted ones.

    Args:
        script: Picks each sampled token from the sequence's step input; or a list of token
            ids that every request emits in order.
        num_kv_blocks: Blocks the engine's KV manager gets.
        block_size: Tokens per block.
        vocab_size: Prompt ids must be below this.
        max_model_len: The model's context length.
        eos_token_ids: Ids that end a request unless ``ignore_eos``.
        fail_at_step: Raise ``RuntimeError`` in that step (0-based), to test fault handling.
    """

    def __init__(
        self,
        script: Script | Sequence[int],
        *,
        num_kv_blocks: int = 256,
        block_size: int = 16,
        vocab_size: int = ByteTokenizer.vocab_size,
        max_model_len: int = 2048,
        eos_token_ids: frozenset[int] = frozenset((EOS_ID,)),
        fail_at_step: int | None = None,
    ) -> None:
        self.script: Script = script if callable(script) else cycle(script)
        self.info = RunnerInfo(
            num_kv_blocks, block_size, vocab_size, max_model_len, eos_token_ids, "scripted runner", speculative=True
        )
        self.fail_at_step = fail_at_step
        self.steps: list[RecordedStep] = []
        self.thread_ids: set[int] = set()
        self.closed = False

    def load(self) -> RunnerInfo:
        """Report the scripted model's shape."""
        self.thread_ids.add(threading.get_ident())
        return self.info

    def execute(self, batch: StepBatch) -> StepOutput:
        """Record the step and return the script's tokens for the sampling sequences."""
        self.thread_ids.add(threading.get_ident())
        if self.fail_at_step is not None and len(self.steps) == self.fail_at_step:
            raise RuntimeError(f"scripted failure at step {self.fail_at_step}")
        self.steps.append(RecordedStep(tuple(batch.sequences), tuple(batch.finished_request_ids)))
        verified: dict[int, VerifiedDraft] = {}
        for seq in batch.sequences:
            if seq.num_draft:
                verified[seq.request_id] = VerifiedDraft(self._verify(seq))
        sampled = [
            verified[seq.request_id].token_ids[-1] if seq.num_draft else self.script(seq)
            for seq in batch.sequences
            if seq.sample
        ]
        return StepOutput(sampled, verified=verified or None)

    def _verify(self, seq: SequenceInput) -> list[int]:
        """The draft tokens the script agrees with, then the script's own next token."""
        fed = len(seq.token_ids) - seq.num_draft
        tokens: list[int] = []
        for position in range(seq.num_draft + 1):
            # The sequence as plain decoding would have fed it, up to this position.
            plain = dataclasses.replace(
                seq, token_ids=seq.token_ids[: fed + position], num_generated=seq.num_generated + position, num_draft=0
            )
            token = self.script(plain)
            tokens.append(token)
            if position == seq.num_draft or token != seq.token_ids[fed + position]:
                break
        return tokens

    def close(self) -> None:
        """Mark the runner closed."""
        self.thread_ids.add(threading.get_ident())
        self.closed = True
