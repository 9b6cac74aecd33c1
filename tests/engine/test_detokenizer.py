"""Tests of asyncllm.engine._detokenizer: text deltas never split a character and add up to ``decode``."""

from __future__ import annotations

import subprocess
import sys

# Another test module of the same session may already have imported torch; then the module-level
# check below cannot see anything, and test_imports_without_torch checks in a fresh interpreter.
_TORCH_PRELOADED = "torch" in sys.modules

import pytest  # noqa: E402
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from tokenizers import Tokenizer, decoders, models, normalizers  # noqa: E402
from transformers import PreTrainedTokenizerFast  # noqa: E402

from asyncllm.engine._detokenizer import IncrementalDetokenizer, decoder_for  # noqa: E402
from asyncllm.testing.scripted import EOS_ID, ByteTokenizer  # noqa: E402

assert _TORCH_PRELOADED or "torch" not in sys.modules, "detokenizing must not import torch"

TEXT = "héllo wörld 你好 🙂 ok"


def test_imports_without_torch() -> None:
    # transformers is left out to keep this fast; the module-level check covers it when this
    # file runs on its own (python -m pytest --noconftest tests/engine/test_detokenizer.py).
    code = (
        "import sys, asyncllm.engine._detokenizer, asyncllm.testing.scripted, tokenizers; "
        "assert 'torch' not in sys.modules, sorted(sys.modules)"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


def stream(detokenizer: IncrementalDetokenizer, ids: list[int], chunk: int = 1) -> list[str]:
    """Push ``ids`` ``chunk`` at a time; return every delta, flush() last."""
    deltas = [detokenizer.push(ids[i : i + chunk]) for i in range(0, len(ids), chunk)]
    return [*deltas, detokenizer.flush()]


# ----------------------------------------------------------------------------------------------
# Byte tokenizer: every multi-byte character spans several tokens
# ----------------------------------------------------------------------------------------------


def test_byte_tokens_one_at_a_time() -> None:
    tokenizer = ByteTokenizer()
    ids = tokenizer.encode(TEXT)
    assert len(ids) > len(TEXT)  # the text really has multi-byte characters
    deltas = stream(IncrementalDetokenizer(tokenizer), ids)
    assert not any("\ufffd" in d for d in deltas)
    assert "".join(deltas) == TEXT
    assert deltas[-1] == ""  # nothing was left to flush
    # Every character comes out whole, as soon as its last byte arrives.
    assert [d for d in deltas if d] == list(TEXT)


def test_byte_tokens_hold_back_an_incomplete_character() -> None:
    detokenizer = IncrementalDetokenizer(ByteTokenizer())
    emoji = list("🙂".encode())
    assert detokenizer.push([ord("a")]) == "a"
    assert [detokenizer.push([b]) for b in emoji[:3]] == ["", "", ""]
    assert detokenizer.push(emoji[3:]) == "🙂"
    assert detokenizer.push([ord("b")]) == "b"
    assert detokenizer.flush() == ""


@pytest.mark.parametrize("chunk", [2, 3, 4, 5, 7, 100])
def test_byte_tokens_several_at_once(chunk: int) -> None:
    tokenizer = ByteTokenizer()
    ids = tokenizer.encode(TEXT)
    deltas = stream(IncrementalDetokenizer(tokenizer), ids, chunk)
    assert not any("\ufffd" in d for d in deltas)
    assert "".join(deltas) == TEXT


@pytest.mark.parametrize("deferred", [1, 5, 13])
def test_deferred_ids_come_out_with_the_next_push_or_flush(deferred: int) -> None:
    # Engine.generate defers decoding to the request's end: the same text, decoded once.
    tokenizer = ByteTokenizer()
    ids = tokenizer.encode(TEXT)
    detokenizer = IncrementalDetokenizer(tokenizer)
    detokenizer.defer(ids[:deferred])
    text = detokenizer.push(ids[deferred : deferred + 1])
    detokenizer.defer(ids[deferred + 1 :])
    assert text + detokenizer.flush() == TEXT
    assert "\ufffd" not in text and TEXT.startswith(text)
    assert text or tokenizer.decode(ids[: deferred + 1]).endswith("\ufffd")  # held back only mid-character


def test_byte_tokens_special_tokens() -> None:
    tokenizer = ByteTokenizer()
    ids = [*tokenizer.encode("hi"), EOS_ID]
    skipped = stream(IncrementalDetokenizer(tokenizer), ids)
    assert "".join(skipped) == "hi"
    kept = stream(IncrementalDetokenizer(tokenizer, skip_special_tokens=False), ids)
    assert "".join(kept) == "hi</s>"


def test_flush_of_a_truncated_character_gives_the_replacement_character() -> None:
    tokenizer = ByteTokenizer()
    ids = tokenizer.encode("ok 你")[:-1]  # last character cut after 2 of its 3 bytes
    detokenizer = IncrementalDetokenizer(tokenizer)
    deltas = [detokenizer.push([i]) for i in ids]
    assert "".join(deltas) == "ok "
    tail = detokenizer.flush()
    assert tail == "\ufffd"
    assert "".join(deltas) + tail == tokenizer.decode(ids)
    assert detokenizer.flush() == ""  # flushing again adds nothing


def test_invalid_byte_in_the_middle_comes_out_like_decode() -> None:
    tokenizer = ByteTokenizer()
    ids = [*tokenizer.encode("a"), 0xFF, *tokenizer.encode("b")]  # 0xFF is never valid UTF-8
    deltas = stream(IncrementalDetokenizer(tokenizer), ids)
    assert "".join(deltas) == tokenizer.decode(ids) == "a\ufffdb"


@settings(max_examples=100, deadline=None)
@given(
    text=st.text(st.characters(exclude_characters="\ufffd", exclude_categories=("Cs",)), max_size=40),
    chunks=st.lists(st.integers(1, 6), min_size=1, max_size=20),
)
def test_byte_tokens_random_text_and_chunking(text: str, chunks: list[int]) -> None:
    tokenizer = ByteTokenizer()
    ids = tokenizer.encode(text)
    detokenizer = IncrementalDetokenizer(tokenizer)
    deltas = []
    pos = 0
    index = 0
    while pos < len(ids):
        size = chunks[index % len(chunks)]
        deltas.append(detokenizer.push(ids[pos : pos + size]))
        pos += size
        index += 1
    deltas.append(detokenizer.flush())
    assert not any("\ufffd" in d for d in deltas)
    assert "".join(deltas) == text


# ----------------------------------------------------------------------------------------------
# SentencePiece-style tokenizer with byte fallback (the way Llama 2 / Mistral tokenizers work)
# ----------------------------------------------------------------------------------------------

_WORDS = ["hello", "world", "the", "caf", "na", "ok", "ve", "wor", "ld"]


def _llama_style_tokenizer() -> PreTrainedTokenizerFast:
    """A BPE tokenizer with byte fallback: characters outside the vocab become ``<0xXX>`` tokens."""
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    for byte in range(256):
        vocab[f"<0x{byte:02X}>"] = len(vocab)
    for char in "▁abcdefghijklmnopqrstuvwxyz.,!?":
        vocab.setdefault(char, len(vocab))
    merges = []
    for word in _WORDS:
        piece = "▁"
        for char in word:
            merged = piece + char
            if merged not in vocab:
                vocab[merged] = len(vocab)
                merges.append((piece, char))
            piece = merged
    model = models.BPE(vocab=vocab, merges=merges, unk_token="<unk>", byte_fallback=True, fuse_unk=True)
    tokenizer = Tokenizer(model)
    tokenizer.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tokenizer.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        bos_token="<s>",
        eos_token="</s>",
        unk_token="<unk>",
        clean_up_tokenization_spaces=False,
    )


@pytest.fixture(scope="module")
def sp_tokenizer() -> PreTrainedTokenizerFast:
    return _llama_style_tokenizer()


SP_TEXT = "hello café naïve wörld, the 你好 🙂 ok!  world"


def test_sp_tokenizer_falls_back_to_bytes(sp_tokenizer: PreTrainedTokenizerFast) -> None:
    ids = sp_tokenizer.encode(SP_TEXT, add_special_tokens=False)
    tokens = sp_tokenizer.convert_ids_to_tokens(ids)
    assert "▁hello" in tokens and "▁ok" in tokens
    assert {"<0xE4>", "<0xF0>", "<0xC3>"} <= set(tokens)  # 你, 🙂 and é/ï/ö are byte tokens
    assert sp_tokenizer.decode(ids, skip_special_tokens=True) == SP_TEXT


@pytest.mark.parametrize("chunk", [1, 2, 3, 5])
def test_sp_tokens_stream(sp_tokenizer: PreTrainedTokenizerFast, chunk: int) -> None:
    ids = sp_tokenizer.encode(SP_TEXT, add_special_tokens=False)
    deltas = stream(IncrementalDetokenizer(sp_tokenizer), ids, chunk)
    assert not any("\ufffd" in d for d in deltas)
    assert "".join(deltas) == sp_tokenizer.decode(ids, skip_special_tokens=True) == SP_TEXT


def test_sp_tokens_spaces_survive_one_at_a_time(sp_tokenizer: PreTrainedTokenizerFast) -> None:
    # Each "▁word" token's space is stripped when it starts a decode, so the delta logic must
    # keep it when the word follows earlier text.
    ids = sp_tokenizer.encode("hello world the ok", add_special_tokens=False)
    assert sp_tokenizer.convert_ids_to_tokens(ids) == ["▁hello", "▁world", "▁the", "▁ok"]
    deltas = stream(IncrementalDetokenizer(sp_tokenizer), ids)
    assert deltas == ["hello", " world", " the", " ok", ""]


def test_sp_tokens_special_tokens_skipped(sp_tokenizer: PreTrainedTokenizerFast) -> None:
    ids = [*sp_tokenizer.encode("ok 你好", add_special_tokens=False), sp_tokenizer.eos_token_id]
    deltas = stream(IncrementalDetokenizer(sp_tokenizer), ids)
    assert "".join(deltas) == sp_tokenizer.decode(ids, skip_special_tokens=True) == "ok 你好"


def test_sp_special_tokens_kept_with_spaces_between(sp_tokenizer: PreTrainedTokenizerFast) -> None:
    eos = sp_tokenizer.eos_token_id
    ids = [
        *sp_tokenizer.encode("ok 你好", add_special_tokens=False),
        eos,
        *sp_tokenizer.encode("hello", add_special_tokens=False),
    ]
    spaced = stream(IncrementalDetokenizer(sp_tokenizer, skip_special_tokens=False), ids)
    assert not any("\ufffd" in d for d in spaced)
    assert "".join(spaced) == "ok 你好 </s> hello"
    plain = stream(
        IncrementalDetokenizer(sp_tokenizer, skip_special_tokens=False, spaces_between_special_tokens=False), ids
    )
    assert "".join(plain) == sp_tokenizer.decode(ids, skip_special_tokens=False) == "ok 你好</s> hello"


def test_sp_flush_of_a_truncated_character_matches_decode(sp_tokenizer: PreTrainedTokenizerFast) -> None:
    ids = sp_tokenizer.encode("ok 🙂", add_special_tokens=False)[:-2]  # 2 of the emoji's 4 bytes
    detokenizer = IncrementalDetokenizer(sp_tokenizer)
    deltas = [detokenizer.push([i]) for i in ids]
    assert not any("\ufffd" in d for d in deltas)
    tail = detokenizer.flush()
    assert "\ufffd" in tail
    assert "".join(deltas) + tail == sp_tokenizer.decode(ids, skip_special_tokens=True)


@settings(max_examples=60, deadline=None)
@given(
    words=st.lists(
        st.sampled_from(["hello", "world", "the", "café", "naïve", "wörld", "你好", "🙂", "ok", "x", "!", "é你🙂"]),
        min_size=1,
        max_size=12,
    ),
    separators=st.lists(st.sampled_from([" ", "  ", ""]), min_size=1, max_size=12),
    chunk=st.integers(1, 4),
)
def test_sp_tokens_random_text(
    sp_tokenizer: PreTrainedTokenizerFast, words: list[str], separators: list[str], chunk: int
) -> None:
    text = "".join(w + separators[i % len(separators)] for i, w in enumerate(words))
    ids = sp_tokenizer.encode(text, add_special_tokens=False)
    deltas = stream(IncrementalDetokenizer(sp_tokenizer), ids, chunk)
    assert not any("\ufffd" in d for d in deltas)
    assert "".join(deltas) == sp_tokenizer.decode(ids, skip_special_tokens=True)


@settings(max_examples=60, deadline=None)
@given(
    pieces=st.lists(st.sampled_from(["hello", " world", "é", " 你好", "🙂", " ok", "<eos>", "<bos>"]), max_size=10),
    chunk=st.integers(1, 4),
    skip_special_tokens=st.booleans(),
    spaces_between_special_tokens=st.booleans(),
)
def test_sp_streaming_equals_one_shot(
    sp_tokenizer: PreTrainedTokenizerFast,
    pieces: list[str],
    chunk: int,
    skip_special_tokens: bool,
    spaces_between_special_tokens: bool,
) -> None:
    ids: list[int] = []
    for piece in pieces:
        if piece == "<eos>":
            ids.append(sp_tokenizer.eos_token_id)
        elif piece == "<bos>":
            ids.append(sp_tokenizer.bos_token_id)
        else:
            ids += sp_tokenizer.encode(piece, add_special_tokens=False)
    options = {
        "skip_special_tokens": skip_special_tokens,
        "spaces_between_special_tokens": spaces_between_special_tokens,
    }
    one_shot = stream(IncrementalDetokenizer(sp_tokenizer, **options), ids, chunk=max(len(ids), 1))
    streamed = stream(IncrementalDetokenizer(sp_tokenizer, **options), ids, chunk)
    assert not any("\ufffd" in d for d in streamed)
    assert "".join(streamed) == "".join(one_shot)
    if skip_special_tokens or not spaces_between_special_tokens:
        assert "".join(streamed) == sp_tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)


def test_fast_tokenizer_decodes_through_its_rust_tokenizer(sp_tokenizer: PreTrainedTokenizerFast) -> None:
    decode = decoder_for(sp_tokenizer)
    assert decode == sp_tokenizer.backend_tokenizer.decode  # the Python wrapper is skipped
    ids = [*sp_tokenizer.encode(SP_TEXT, add_special_tokens=False), sp_tokenizer.eos_token_id]
    for skip in (True, False):
        assert decode(ids, skip) == sp_tokenizer.decode(ids, skip_special_tokens=skip)


def test_tokenizer_with_its_own_decode_keeps_it(sp_tokenizer: PreTrainedTokenizerFast) -> None:
    class Shouting(PreTrainedTokenizerFast):
        def _decode(self, token_ids, skip_special_tokens=False, **kwargs):  # type: ignore[no-untyped-def]
            return super()._decode(token_ids, skip_special_tokens=skip_special_tokens, **kwargs).upper()

    shouting = Shouting(tokenizer_object=sp_tokenizer.backend_tokenizer, clean_up_tokenization_spaces=False)
    ids = shouting.encode("hello world", add_special_tokens=False)
    assert "".join(stream(IncrementalDetokenizer(shouting), ids)) == "HELLO WORLD"

    backend = sp_tokenizer.backend_tokenizer
    cleaning = PreTrainedTokenizerFast(tokenizer_object=backend, clean_up_tokenization_spaces=True)
    assert decoder_for(cleaning) != cleaning.backend_tokenizer.decode
    assert decoder_for(ByteTokenizer())([104, 105], True) == ByteTokenizer().decode([104, 105])
