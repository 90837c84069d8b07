import random

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from engine.detokenizer import IncrementalDetokenizer, find_stop_string, streamable_len

CORPUS = [
    "Café naïve résumé déjà vu, señor. Ça va très bien!",
    "中文字符测试 你好世界 日本語のテキスト",
    "emoji 😀🎉👍🏽 party 🇫🇷 and 👩‍👩‍👧",
    "The quick brown fox jumps over the lazy dog.",
] * 3
SAMPLE = "Héllo wörld! 中文 😀👍🏽 🇫🇷 done — ça va?"


@pytest.fixture(scope="module")
def bpe() -> PreTrainedTokenizerFast:
    """Byte-level BPE with a vocab small enough that CJK and emoji stay split over several tokens."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300,
        special_tokens=["<|endoftext|>", "<|im_start|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>")


@pytest.fixture(scope="module")
def metaspace() -> PreTrainedTokenizerFast:
    """SentencePiece-style: '▁' marks a word start and decoding drops the leading space."""
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Metaspace()
    trainer = trainers.BpeTrainer(vocab_size=200, special_tokens=["<unk>", "<s>", "</s>"], show_progress=False)
    tok.train_from_iterator(CORPUS, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>")


def stream(tokenizer, prompt_ids, output_ids, skip_special_tokens=True) -> tuple[IncrementalDetokenizer, list[str]]:
    det = IncrementalDetokenizer(tokenizer, prompt_ids, skip_special_tokens=skip_special_tokens)
    deltas = [det.add_token(t) for t in output_ids]
    return det, deltas


def encode(tok, text: str) -> list[int]:
    return tok.encode(text, add_special_tokens=False)


# ---- incremental detokenization ----


def test_multibyte_chars_are_split_across_tokens(bpe):
    # guards the premise of the tests below
    assert any("\ufffd" in bpe.decode([t]) for t in encode(bpe, SAMPLE))


@pytest.mark.parametrize("prompt", ["", "Say something: ", "中文"])
def test_streaming_matches_full_decode(bpe, prompt):
    out_ids = encode(bpe, SAMPLE)
    det, deltas = stream(bpe, encode(bpe, prompt), out_ids)
    assert "".join(deltas) == det.text == bpe.decode(out_ids) == SAMPLE
    assert not any("\ufffd" in d for d in deltas)
    assert "" in deltas  # some tokens only completed a character later


def test_random_token_sequences_match_full_decode(bpe):
    rng = random.Random(0)
    chars = sorted(set("".join(CORPUS)))
    for _ in range(50):
        # concatenated encodings of random pieces: arbitrary token boundaries, ends on a full char
        pieces = ["".join(rng.choice(chars) for _ in range(rng.randint(1, 6))) for _ in range(rng.randint(1, 8))]
        ids = [t for p in pieces for t in encode(bpe, p)]
        prompt = [rng.randrange(len(bpe)) for _ in range(rng.randint(0, 8))]
        det, deltas = stream(bpe, prompt, ids)
        assert det.text == bpe.decode(ids)
        assert not any("\ufffd" in d for d in deltas)


@pytest.mark.parametrize("cleanup", [False, True])
def test_text_equals_the_wrappers_decode_with_or_without_space_cleanup(cleanup):
    """The detokenizer may call the Rust tokenizer directly, but only where the transformers wrapper
    would return the same text: with its clean-up of spaces before punctuation on, it must match that."""
    vocab = {w: i for i, w in enumerate(["[UNK]", "hello", ",", "world", ".", "don", "'t", "?", "a", "b", "c"])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(cleanup=False)
    wrapped = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]", clean_up_tokenization_spaces=cleanup)
    rng = random.Random(1)
    for _ in range(20):
        ids = [rng.randrange(1, len(vocab)) for _ in range(rng.randint(1, 12))]
        det, deltas = stream(wrapped, [], ids)
        assert det.text == "".join(deltas) == wrapped.decode(ids, skip_special_tokens=True)
    assert (wrapped.decode([1, 2, 3]) == "hello, world") == cleanup  # the premise: the wrapper's clean-up runs


def test_window_stays_small(bpe):
    det, _ = stream(bpe, encode(bpe, "prompt"), encode(bpe, SAMPLE * 20))
    assert len(det._ids) < 10


@pytest.mark.parametrize("skip", [True, False])
def test_skip_special_tokens(bpe, skip):
    im_start, eos = bpe.convert_tokens_to_ids(["<|im_start|>", "<|endoftext|>"])
    out_ids = encode(bpe, "中文 ") + [im_start] + encode(bpe, "😀 ok") + [eos]
    det, deltas = stream(bpe, [im_start] + encode(bpe, "user"), out_ids, skip_special_tokens=skip)
    assert det.text == bpe.decode(out_ids, skip_special_tokens=skip)
    if skip:
        assert det.text == "中文 😀 ok"
    else:
        assert det.text == "中文 <|im_start|>😀 ok<|endoftext|>"
    assert not any("\ufffd" in d for d in deltas)


def test_incomplete_tail_is_held_back_until_flush(bpe):
    ids = encode(bpe, "ok 😀")
    det, deltas = stream(bpe, [], ids[:-1])  # the emoji's last byte is missing
    assert det.text.startswith("ok") and "\ufffd" not in det.text
    rest = det.flush()
    assert "\ufffd" in rest
    assert det.text == bpe.decode(ids[:-1])
    assert det.flush() == ""


def test_metaspace_keeps_word_spaces(metaspace):
    prompt = encode(metaspace, "The quick brown")
    out_ids = encode(metaspace, "fox jumps over 你好世界")
    det, deltas = stream(metaspace, prompt, out_ids)
    full = metaspace.decode(prompt + out_ids)
    # the output's first word gets its leading space from the prompt context, as in vLLM
    assert metaspace.decode(prompt) + det.text == full
    assert det.text == " fox jumps over 你好世界"
    assert "".join(deltas) == det.text


def test_metaspace_without_prompt_matches_decode(metaspace):
    out_ids = encode(metaspace, "fox jumps over the lazy dog")
    det, _ = stream(metaspace, [], out_ids)
    assert det.text == metaspace.decode(out_ids) == "fox jumps over the lazy dog"


# ---- stop strings ----


def test_stop_string_spanning_token_boundary():
    # previous text "Hello wor", the new token added "ld!"
    assert find_stop_string("Hello world!", 3, ["world"], include_stop_str=False) == ("world", 6)
    assert find_stop_string("Hello world!", 3, ["world"], include_stop_str=True) == ("world", 11)


def test_stop_string_only_checked_against_new_tail():
    assert find_stop_string("STOP and more", 3, ["STOP"], False) is None  # found (and handled) earlier
    assert find_stop_string("abcSTOP", 1, ["STOP"], False) == ("STOP", 3)
    assert find_stop_string("abc", 0, ["abc"], False) is None
    assert find_stop_string("abc", 3, ["x"], False) is None
    assert find_stop_string("ab", 2, ["abc"], False) is None


def test_earliest_stop_string_wins():
    text = "ok END then STOP"
    assert find_stop_string(text, len(text), ["STOP", "END"], False) == ("END", 3)
    assert find_stop_string(text, len(text), ["STOP", "END"], True) == ("END", 6)
    # same start: the shorter one completed first
    assert find_stop_string("xxabc", 3, ["abc", "ab"], True) == ("ab", 4)
    # a stop string inside the new tail, earlier than one straddling the boundary
    assert find_stop_string("a#b<eos>", 7, ["<eos>", "#"], False) == ("#", 1)


def test_streamable_len_holds_back_possible_stop_prefix():
    assert streamable_len("0123456789", ["abc", "x"], finished=False) == 8
    assert streamable_len("0123456789", ["abc"], finished=True) == 10
    assert streamable_len("0123456789", [], finished=False) == 10
    assert streamable_len("ab", ["abcdef"], finished=False) == 0
    assert streamable_len("ab", ["x"], finished=False) == 2


@pytest.mark.parametrize("include", [False, True])
def test_streaming_with_stop_strings_end_to_end(bpe, include):
    """What the engine does each step; the client must never see text that is later cut."""
    stop = ["中文 😀", "never"]
    text_in = "Héllo 中文 😀 after the stop"
    det = IncrementalDetokenizer(bpe, encode(bpe, "prompt: "))
    text, sent, hit = "", "", None
    for tid in encode(bpe, text_in):
        delta = det.add_token(tid)
        text += delta
        hit = find_stop_string(text, len(delta), stop, include)
        if hit:
            text = text[: hit[1]]
        n = streamable_len(text, stop, finished=hit is not None)
        assert n >= len(sent) and text.startswith(sent)
        sent = text[:n]
        if hit:
            break
    assert hit is not None and hit[0] == "中文 😀"
    assert sent == ("Héllo 中文 😀" if include else "Héllo ")
