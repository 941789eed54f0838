"""Incremental detokenization and stop strings, with the default model's real
tokenizer (SmolLM2, byte-level BPE: emoji and CJK characters split over tokens).

Tokens are fed one at a time to the OutputProcessor, as the engine does; no
model runs. A streamed text must never show a broken character or any part of
a stop string, and must add up to the final text.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

from tokenmill.core.contracts import EngineCoreOutput
from tokenmill.engine.output_processor import OutputProcessor
from tokenmill.model.source import default_model_path
from tokenmill.outputs import RequestOutput
from tokenmill.sampling_params import RequestOutputKind, SamplingParams
from tokenmill.tokenizer import IncrementalDetokenizer, Tokenizer, gguf_pre_tokenizer

EOS = 2  # <|im_end|>
DELTA = RequestOutputKind.DELTA
PROMPT = "Tell me something."


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return Tokenizer.load(default_model_path())


def stream(
    tok: Tokenizer,
    token_ids: list[int],
    params: SamplingParams,
    finish: tuple[str, int | None] = ("length", None),
    top: list[dict[int, float] | None] | None = None,
) -> tuple[list[RequestOutput], bool]:
    """Feed tokens one per step; the last one finishes the request with `finish`
    unless a stop string does first. Returns the outputs and whether a stop
    string finished it."""
    processor = OutputProcessor(tok)
    processor.add_request("r", PROMPT, tok.encode(PROMPT), params, 0.0)
    outputs: list[RequestOutput] = []
    for i, token_id in enumerate(token_ids):
        last = i == len(token_ids) - 1
        core = EngineCoreOutput(
            request_id="r",
            new_token_ids=[token_id],
            new_logprobs=[-0.5],
            new_top_logprobs=[top[i] if top else None],
            new_token_ranks=[1],
            finish_reason=finish[0] if last else None,
            stop_reason=finish[1] if last else None,
        )
        results, stopped = processor.process([core])
        outputs.extend(results)
        if stopped:
            assert stopped == ["r"] and not processor.states
            return outputs, True
    assert not processor.states
    return outputs, False


def deltas(outputs: list[RequestOutput]) -> list[str]:
    return [o.outputs[0].text for o in outputs]


def assert_clean_stream(outputs: list[RequestOutput], final: str) -> None:
    """Every delta is whole characters, and what was streamed so far is always a
    prefix of the final text (nothing leaked that was later taken back)."""
    streamed = ""
    for text in deltas(outputs):
        assert "\ufffd" not in text
        streamed += text
        assert final.startswith(streamed), (streamed, final)
    assert streamed == final
    assert outputs[-1].finished


# ---- multi-byte characters -------------------------------------------------------------

MULTIBYTE = "Hi 😀 你好, café! 🎉🎉 ok 日本語のテキスト ✓"


def test_characters_split_across_tokens_stream_whole(tok: Tokenizer) -> None:
    ids = tok.encode(MULTIBYTE, add_special_tokens=False)
    assert any("\ufffd" in tok.token_string(t) for t in ids), "expected split characters"
    outputs, _ = stream(tok, ids, SamplingParams(output_kind=DELTA, max_tokens=None))
    assert_clean_stream(outputs, MULTIBYTE)
    # Cumulative outputs: each a prefix of the next, never a broken character.
    outputs, _ = stream(tok, ids, SamplingParams(max_tokens=None))
    texts = deltas(outputs)
    assert texts[-1] == MULTIBYTE
    assert all("\ufffd" not in t and MULTIBYTE.startswith(t) for t in texts)


@pytest.mark.parametrize(
    "text",
    [
        "  Leading spaces, trailing tab\t and\nnew lines\n\n",
        "Ünïcödé — “quotes” and ‘more’ — ½ ∑ ∞ ≠ 🙂👍🏽 👨‍👩‍👧",
        "def f(x):\n    return x ** 2  # 한국어 주석\n",
    ],
)
def test_incremental_text_equals_one_decode(tok: Tokenizer, text: str) -> None:
    ids = tok.encode(text, add_special_tokens=False)
    detok = IncrementalDetokenizer(tok, tok.encode(PROMPT))
    pieces = [detok.add_tokens([t], final=i == len(ids) - 1) for i, t in enumerate(ids)]
    assert "".join(pieces) == tok.decode(ids) == text


def test_a_broken_character_at_the_very_end_is_flushed(tok: Tokenizer) -> None:
    ids = tok.encode(" 😀", add_special_tokens=False)
    assert len(ids) == 2
    outputs, _ = stream(tok, ids[:1], SamplingParams(output_kind=DELTA))
    assert deltas(outputs) == [" \ufffd"]  # the final output shows what there is


# ---- stop strings -------------------------------------------------------------------------

SENTENCE = "The answer is forty-two, my friend, and that is final."


@pytest.mark.parametrize("kind", [DELTA, RequestOutputKind.CUMULATIVE])
def test_stop_string_spanning_tokens_never_leaks(tok: Tokenizer, kind: RequestOutputKind) -> None:
    ids = tok.encode(SENTENCE, add_special_tokens=False)
    stop = "forty-two"
    start = SENTENCE.index(stop)
    # It does span several tokens.
    spans = [tok.decode(ids[:i]) for i in range(len(ids) + 1)]
    assert sum(start < len(s) < start + len(stop) for s in spans) >= 2
    params = SamplingParams(stop=[stop], output_kind=kind, max_tokens=None)
    outputs, by_string = stream(tok, ids, params)
    assert by_string
    final = outputs[-1].outputs[0]
    assert (final.finish_reason, final.stop_reason) == ("stop", stop)
    if kind is DELTA:
        assert_clean_stream(outputs, SENTENCE[:start])
    else:
        assert final.text == SENTENCE[:start]
        assert all(SENTENCE[:start].startswith(t) for t in deltas(outputs))


def test_stop_string_kept_with_include_stop_str_in_output(tok: Tokenizer) -> None:
    ids = tok.encode(SENTENCE, add_special_tokens=False)
    params = SamplingParams(stop=["forty-two"], include_stop_str_in_output=True,
                            output_kind=DELTA, max_tokens=None)
    outputs, _ = stream(tok, ids, params)
    assert_clean_stream(outputs, "The answer is forty-two")


@pytest.mark.parametrize(
    ("stops", "expected"),
    [
        (["swer"], "The an"),  # inside one token
        (["friend", "is"], "The answer "),  # the earliest match wins
        (["that is", "my"], "The answer is forty-two, "),
        (["nowhere"], SENTENCE),
    ],
)
def test_stop_strings_cut_exactly(tok: Tokenizer, stops: list[str], expected: str) -> None:
    ids = tok.encode(SENTENCE, add_special_tokens=False)
    outputs, by_string = stream(tok, ids, SamplingParams(stop=stops, output_kind=DELTA,
                                                         max_tokens=None))
    assert_clean_stream(outputs, expected)
    assert by_string == (expected != SENTENCE)
    final = outputs[-1].outputs[0]
    assert final.finish_reason == ("stop" if by_string else "length")


def test_stop_string_inside_a_split_character(tok: Tokenizer) -> None:
    text = "Hello 你好 world"
    ids = tok.encode(text, add_special_tokens=False)
    outputs, by_string = stream(tok, ids, SamplingParams(stop=["好"], output_kind=DELTA))
    assert by_string
    assert_clean_stream(outputs, "Hello 你")


def test_stop_strings_wait_for_min_tokens(tok: Tokenizer) -> None:
    ids = tok.encode(" a b a b a b", add_special_tokens=False)
    assert len(ids) == 6
    # Tokens 1-2 are within min_tokens: their " a" does not count; token 3's does.
    outputs, by_string = stream(tok, ids, SamplingParams(stop=["a"], min_tokens=2))
    assert by_string and outputs[-1].outputs[0].text == " a b "
    assert len(outputs[-1].outputs[0].token_ids) == 3


# ---- EOS, stop tokens, special tokens ---------------------------------------------------------


def test_eos_and_stop_token_text_is_hidden_unless_asked(tok: Tokenizer) -> None:
    ids = [*tok.encode("Hello world", add_special_tokens=False), EOS]
    for skip in (True, False):
        params = SamplingParams(skip_special_tokens=skip, output_kind=DELTA)
        outputs, _ = stream(tok, ids, params, finish=("stop", None))
        assert_clean_stream(outputs, "Hello world")
        final = outputs[-1].outputs[0]
        assert (final.finish_reason, final.stop_reason) == ("stop", None)
        assert final.token_ids[-1] == EOS
    params = SamplingParams(skip_special_tokens=False, include_stop_str_in_output=True,
                            spaces_between_special_tokens=False)
    outputs, _ = stream(tok, ids, params, finish=("stop", None))
    assert outputs[-1].outputs[0].text == "Hello world<|im_end|>"

    period = tok.encode(".", add_special_tokens=False)
    assert len(period) == 1
    ids = tok.encode("Hello world.", add_special_tokens=False)
    assert ids[-1] == period[0]
    params = SamplingParams(stop_token_ids=period)
    outputs, _ = stream(tok, ids, params, finish=("stop", period[0]))
    final = outputs[-1].outputs[0]
    assert (final.text, final.stop_reason) == ("Hello world", period[0])
    params = SamplingParams(stop_token_ids=period, include_stop_str_in_output=True)
    outputs, _ = stream(tok, ids, params, finish=("stop", period[0]))
    assert outputs[-1].outputs[0].text == "Hello world."


@pytest.mark.parametrize(
    ("options", "expected"),
    [
        ({"skip_special_tokens": True, "spaces_between_special_tokens": False}, "Hello world x"),
        ({"skip_special_tokens": True, "spaces_between_special_tokens": True}, "Hello world x"),
        ({"skip_special_tokens": False, "spaces_between_special_tokens": False},
         "Hello<|im_end|> world<file_sep> x"),
        # As transformers' slow tokenizers (and vLLM's detokenizer for them) do:
        # text runs and added tokens joined by a space.
        ({"skip_special_tokens": False, "spaces_between_special_tokens": True},
         "Hello <|im_end|>  world <file_sep>  x"),
    ],
)
def test_special_tokens_options(tok: Tokenizer, options: dict[str, Any], expected: str) -> None:
    # <file_sep> is an added token outside all_special_ids that the tokenizer
    # nevertheless marks special: skip_special_tokens drops it too.
    file_sep = tok.encode("<file_sep>", add_special_tokens=False)
    assert len(file_sep) == 1 and file_sep[0] not in tok.all_special_ids
    ids = [*tok.encode("Hello", add_special_tokens=False), EOS,
           *tok.encode(" world", add_special_tokens=False), *file_sep,
           *tok.encode(" x", add_special_tokens=False)]
    params = SamplingParams(output_kind=DELTA, **options)
    outputs, _ = stream(tok, ids, params)
    assert_clean_stream(outputs, expected)
    assert tok.decode(ids, params.skip_special_tokens, params.spaces_between_special_tokens) == expected


# ---- logprobs text, bad words ---------------------------------------------------------------


def test_logprobs_carry_each_tokens_text(tok: Tokenizer) -> None:
    ids = tok.encode(" 😀 ok", add_special_tokens=False)
    top = [{ids[0]: -0.1, 17: -3.0} for _ in ids]
    outputs, _ = stream(tok, ids, SamplingParams(logprobs=2, max_tokens=None), top=top)
    logprobs = outputs[-1].outputs[0].logprobs
    assert logprobs is not None and len(logprobs) == len(ids)
    for entry, token_id in zip(logprobs, ids, strict=True):
        assert next(iter(entry)) == token_id  # the actual token first
        assert entry[token_id].decoded_token == tok.token_string(token_id)
        assert entry[17].rank == 2 and entry[17].decoded_token == tok.token_string(17)
    assert logprobs[0][ids[0]].decoded_token == " \ufffd"  # half an emoji, as vLLM shows it
    assert logprobs[-1][ids[-1]].decoded_token == " ok"


def test_bad_words_become_token_sequences(tok: Tokenizer) -> None:
    seqs = tok.bad_words_token_ids(["Paris", " forty-two"])
    assert tok.encode("Paris", add_special_tokens=False) in seqs
    assert tok.encode(" Paris", add_special_tokens=False) in seqs
    assert tok.encode("forty-two", add_special_tokens=False) in seqs


@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_fast_decode_is_transformers_decode(tok: Tokenizer, skip_special_tokens: bool) -> None:
    # The default model's tokenizer takes the Rust decode directly (tokenizer._backend_decode);
    # its text must be transformers' for any ids: words, specials, pieces of characters.
    assert tok._backend_decode is not None
    ids = tok.encode("Hello 😀 world<|im_end|>, ünïcode\n\n  x", add_special_tokens=False)
    windows = [ids, ids[1:4], ids[2:3], [EOS, *ids[:3]], list(range(0, 4000, 37))]
    for window in windows:
        expected = tok.hf.decode(window, skip_special_tokens=skip_special_tokens)
        assert tok.decode(window, skip_special_tokens, False) == expected


def _same_hf_tokenizer(ours: Any, ref: Any) -> None:
    assert type(ours) is type(ref)
    assert ours.backend_tokenizer.to_str() == ref.backend_tokenizer.to_str()
    assert ours.chat_template == ref.chat_template
    assert ours.special_tokens_map == ref.special_tokens_map
    assert ours.get_added_vocab() == ref.get_added_vocab()
    assert ours.init_kwargs == ref.init_kwargs


def test_gguf_tokenizer_is_the_one_auto_tokenizer_builds(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Tokenizer.load skips AutoTokenizer's slow class lookup for a llama GGUF;
    what it builds must be what AutoTokenizer builds, but for the pre-tokenizer,
    chosen by the file's tokenizer.ggml.pre ("smollm": digits one by one, which
    transformers' conversion leaves out). A folder with its own
    tokenizer_config.json still goes through AutoTokenizer."""
    from transformers import AutoTokenizer

    path = default_model_path()
    directory, filename = os.path.split(path)
    calls: list[str] = []
    real = AutoTokenizer.from_pretrained.__func__  # type: ignore[attr-defined]

    def spy(cls: Any, *args: Any, **kwargs: Any) -> Any:
        calls.append(str(args[0]))
        return real(cls, *args, **kwargs)

    monkeypatch.setattr(AutoTokenizer, "from_pretrained", classmethod(spy))
    ours = Tokenizer.load(path).hf
    assert calls == []
    ref = AutoTokenizer.from_pretrained(directory, gguf_file=filename)
    ref.backend_tokenizer.pre_tokenizer = gguf_pre_tokenizer(path, "smollm")
    _same_hf_tokenizer(ours, ref)
    text = "Hello <|im_start|>user\nwörld  ✓ 123 🙂 日本"
    assert ours.encode(text) == ref.encode(text)

    (tmp_path / filename).symlink_to(path)
    (tmp_path / "tokenizer_config.json").write_text("{}")
    calls.clear()
    Tokenizer.load(str(tmp_path / filename))
    assert calls == [str(tmp_path)]


def test_chat_messages_are_checked_and_text_parts_joined(tok: Tokenizer) -> None:
    plain = [{"role": "user", "content": "What is 2 + 2?"}]
    parts = [{"role": "user", "content": [{"type": "text", "text": "What is "}, {"type": "text", "text": "2 + 2?"}]}]
    assert tok.apply_chat_template(parts) == tok.apply_chat_template(plain)
    assert tok.apply_chat_template([{"role": "user", "content": None}]) == tok.apply_chat_template(
        [{"role": "user", "content": ""}])
    for bad, match in [
        ([{"content": "no role"}], r"messages\[0\] must be a dict with a string 'role'"),
        ([plain[0], "text"], r"messages\[1\]"),
        ([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}], "only text"),
        ([{"role": "user", "content": 7}], "must be a string or a list of text parts"),
    ]:
        with pytest.raises(ValueError, match=match):
            tok.apply_chat_template(bad)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="the chat template failed"):
        tok.apply_chat_template(plain, chat_template="{{ raise_exception('no') }}{% if %}")
    with pytest.raises(ValueError, match="not valid Unicode"):
        tok.encode("a lone surrogate \ud800")
