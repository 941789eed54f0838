"""SamplingParams: vLLM's fields and defaults; bad values are ValueErrors naming the field."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest

from tokenmill.sampling_params import ParamError, RequestOutputKind, SamplingParams


def test_defaults_are_vllms() -> None:
    p = SamplingParams()
    assert (p.n, p.temperature, p.top_p, p.top_k, p.min_p) == (1, 1.0, 1.0, 0, 0.0)
    assert (p.presence_penalty, p.frequency_penalty, p.repetition_penalty) == (0.0, 0.0, 1.0)
    assert (p.max_tokens, p.min_tokens, p.seed) == (16, 0, None)
    assert p.stop == [] and p.stop_token_ids == []
    assert not p.include_stop_str_in_output and not p.ignore_eos
    assert p.logprobs is None and p.prompt_logprobs is None
    assert p.logit_bias is None and p.allowed_token_ids is None and p.bad_words is None
    assert p.detokenize and p.skip_special_tokens and p.spaces_between_special_tokens
    assert p.output_kind is RequestOutputKind.CUMULATIVE


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"n": 0}, "n"),
        ({"presence_penalty": 2.5}, "presence_penalty"),
        ({"frequency_penalty": -2.1}, "frequency_penalty"),
        ({"repetition_penalty": 0.0}, "repetition_penalty"),
        ({"temperature": -0.1}, "temperature"),
        ({"temperature": float("inf")}, "temperature"),
        ({"temperature": "0.5"}, "temperature"),
        ({"logprobs": True}, "logprobs"),
        ({"logprobs": 2.5}, "logprobs"),
        ({"prompt_logprobs": 1.5}, "prompt_logprobs"),
        ({"seed": 1.5}, "seed"),
        ({"n": 2.0}, "n"),
        ({"max_tokens": "3"}, "max_tokens"),
        ({"top_k": 2.5}, "top_k"),
        ({"min_tokens": 1.5}, "min_tokens"),
        ({"logit_bias": [(28, 100)]}, "logit_bias"),
        ({"temperature": float("nan")}, "temperature"),
        ({"seed": 2**63}, "seed"),
        ({"seed": -(2**63) - 1}, "seed"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_k": -2}, "top_k"),
        ({"min_p": 1.5}, "min_p"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"min_tokens": -1}, "min_tokens"),
        ({"min_tokens": 5, "max_tokens": 4}, "min_tokens"),
        ({"logprobs": 21}, "logprobs"),
        ({"logprobs": -1}, "logprobs"),
        ({"prompt_logprobs": 21}, "prompt_logprobs"),
        ({"stop": [""]}, "stop"),
        ({"stop_token_ids": [-1]}, "stop_token_ids"),
        ({"logit_bias": {3: 101.0}}, "logit_bias"),
        ({"logit_bias": {-3: 1.0}}, "logit_bias"),
        ({"logit_bias": {"x": 1.0}}, "logit_bias"),
        ({"allowed_token_ids": []}, "allowed_token_ids"),
        ({"bad_words": [" "]}, "bad_words"),
        ({"bad_words": ["a\ud800"]}, "bad_words"),
        ({"stop": ["\udfff"]}, "stop"),
        ({"n": 2, "temperature": 0.0}, "n"),
        ({"stop": ["x"], "detokenize": False}, "stop"),
    ],
)
def test_bad_values_name_the_field(kwargs: dict[str, Any], field: str) -> None:
    with pytest.raises(ParamError, match=field) as info:
        SamplingParams(**kwargs)
    assert info.value.param == field  # a field of the error: the server reads it from there
    assert isinstance(info.value, ValueError)


def test_one_bad_word_or_stop_string_may_come_as_a_string() -> None:
    assert SamplingParams(bad_words="Alex").bad_words == ["Alex"]
    assert SamplingParams(stop="Alex").stop == ["Alex"]


def test_seed_takes_the_signed_64_bit_range() -> None:
    assert SamplingParams(seed=2**63 - 1).seed == 2**63 - 1
    assert SamplingParams(seed=-(2**63)).seed == -(2**63)


def test_normalization() -> None:
    p = SamplingParams(stop="x", top_k=-1, logit_bias={"5": 2})  # type: ignore[arg-type,dict-item]
    assert p.stop == ["x"] and p.top_k == 0 and p.logit_bias == {5: 2.0}
    assert p.output_text_buffer_length == 0
    assert SamplingParams(stop=["abc", "de"]).output_text_buffer_length == 2
    assert SamplingParams(stop=["abc"], include_stop_str_in_output=True).output_text_buffer_length == 0
    # A tiny temperature is clamped (logits / t must not overflow); 0 is greedy and
    # resets the filters, as vLLM does.
    assert SamplingParams(temperature=1e-3).temperature == 1e-2
    g = SamplingParams(temperature=0.0, top_p=0.5, top_k=3, min_p=0.2)
    assert g.greedy and (g.top_p, g.top_k, g.min_p) == (1.0, 0, 0.0)
    assert SamplingParams(repetition_penalty=1.1).has_penalties
    assert not SamplingParams().has_penalties


def test_replace_keeps_validating() -> None:
    p = SamplingParams(n=3, seed=1)
    with pytest.raises(ValueError, match="top_p"):
        dataclasses.replace(p, top_p=0.0)
