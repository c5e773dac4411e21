"""Incremental detokenisation (engine.sequence.TextState): a window of the last tokens per step
gives the text that decoding every committed token gives."""
import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from hispec.engine.sequence import TextState

TEXT = ("Les élèves ont mangé des crêpes à Noël 🎄 — naïve café déjà vu; 東京で寿司を食べた。"
        "Ünïcödé   spaces\tand\nnew lines, emoji 👩‍👩‍👧 and 12345 numbers. ") * 3


def byte_level() -> Tokenizer:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator([TEXT[:80]], trainers.BpeTrainer(vocab_size=300, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    return tok


def metaspace() -> Tokenizer:  # SentencePiece-style: a word's leading space is part of its token
    tok = Tokenizer(models.BPE(unk_token="<unk>", byte_fallback=True))
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Sequence([decoders.ByteFallback(), decoders.Fuse(), decoders.Metaspace()])
    bytes_ = [f"<0x{i:02X}>" for i in range(256)]
    tok.train_from_iterator([TEXT[:60]], trainers.BpeTrainer(vocab_size=400, special_tokens=["<unk>"] + bytes_))
    return tok


@pytest.mark.parametrize("make", [byte_level, metaspace])
@pytest.mark.parametrize("step", [1, 3])
def test_incremental_text_equals_decoding_everything(make, step):
    tok = make()
    ids = tok.encode(TEXT).ids
    decode = lambda t: tok.decode(t)  # noqa: E731
    assert decode(ids) == TEXT or make is metaspace  # (Metaspace drops the leading space only)
    state, streamed = TextState(decode, ()), ""
    for n in range(step, len(ids) + step, step):
        n = min(n, len(ids))
        state.update(ids[:n], final=n == len(ids))
        full = decode(ids[:n])
        assert full.startswith(state.text.rstrip("\ufffd")), n  # never text that decoding all would not give
        assert len(full.rstrip("\ufffd")) - len(state.text) <= 8, n  # and behind by at most a character's tokens
        streamed += state.delta()
    assert streamed == state.text == decode(ids)


def test_stop_string_found_by_the_window():
    tok = byte_level()
    ids = tok.encode(TEXT).ids
    state = TextState(lambda t: tok.decode(t), ("寿司",))
    for n in range(1, len(ids) + 1):
        if state.update(ids[:n], final=False):
            break
    assert state.text == TEXT[:TEXT.index("寿司")]
