"""Structured outputs: each distinct constraint compiled once, off the step loop.

A request's StructuredOutputsParams is parsed into an xgrammar Grammar when the
request is added (on the engine thread: milliseconds, and a bad schema, regex or
grammar is a ParamError naming the problem, so the server answers 400). The
expensive part, compiling the grammar against the vocabulary (which tokens each
grammar state allows), runs on a background thread; the request waits unscheduled
(`Request.grammar_ready`) until it is done, and everyone else keeps running.
Compiled grammars are kept in an LRU cache keyed by the constraint, so a schema
that comes back costs nothing.

The compiled grammar goes to the model runner (worker/grammar.py), which keeps one
matcher per request and masks that request's logits in the batched sampler.
"""

from __future__ import annotations

import json
import logging
import re
import threading
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import xgrammar as xgr

from tokenmill.sampling_params import ParamError, StructuredOutputsParams
from tokenmill.tokenizer import Tokenizer

logger = logging.getLogger("tokenmill")

# Distinct constraints whose compiled grammar is kept (vLLM's xgrammar cache is
# bounded by bytes; a count is enough here: a compiled grammar is a few MB at most).
GRAMMAR_CACHE_SIZE = 256
# xgrammar prefixes its messages with "[time] /path/file.cc:line: "; users need the rest.
_XGR_PREFIX = re.compile(r"^\[[^\]]*\]\s*\S+:\d+:\s*")

# JSON's free whitespace between tokens is capped at this many characters per gap:
# enough for pretty-printed JSON (a newline and 19 spaces of indent), while a
# model that would emit newlines forever (small models do) is moved on.
MAX_JSON_WHITESPACE = 20

GrammarKey = tuple[str, str, bool]


def grammar_key(params: StructuredOutputsParams) -> GrammarKey:
    """The cache key: the kind, the constraint as canonical text, the whitespace flag."""
    kind = params.kind
    value: Any = getattr(params, kind)
    if kind == "json":
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as e:
                raise ParamError(f"structured_outputs.json is not valid JSON: {e}",
                                 "structured_outputs") from e
        if not isinstance(value, dict | bool):
            raise ParamError(f"structured_outputs.json must be a JSON schema (an object), got "
                             f"{type(value).__name__}", "structured_outputs")
        # Key order kept: properties are generated in the schema's order.
        try:
            text = json.dumps(value, ensure_ascii=False)
        except (TypeError, ValueError) as e:  # (an offline caller's dict holding non-JSON)
            raise ParamError(f"structured_outputs.json is not JSON: {e}",
                             "structured_outputs") from e
    elif kind == "choice":
        text = json.dumps(value, ensure_ascii=False)
    elif kind == "json_object":
        text = ""
    else:
        text = value
    return kind, text, bool(params.disable_any_whitespace)


def build_grammar(key: GrammarKey) -> xgr.Grammar:
    """Parse a constraint into an xgrammar Grammar (no vocabulary yet); a
    ParamError that says what is wrong if it cannot be parsed."""
    kind, text, no_whitespace = key
    try:
        if kind in ("json", "json_object"):
            # json_object: any JSON object (vLLM compiles the schema {"type": "object"}).
            schema = text if kind == "json" else '{"type": "object"}'
            if no_whitespace:  # json.dumps' separators, nothing else
                return xgr.Grammar.from_json_schema(schema, any_whitespace=False)
            return xgr.Grammar.from_json_schema(schema, any_whitespace=True,
                                                max_whitespace_cnt=MAX_JSON_WHITESPACE)
        if kind == "regex":
            return xgr.Grammar.from_regex(text)
        if kind == "choice":
            # One alternative per string, as EBNF string literals (JSON escapes suit them).
            choices = json.loads(text)
            return xgr.Grammar.from_ebnf(
                "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)
            )
        if kind == "grammar":
            return xgr.Grammar.from_ebnf(text)
    except (RuntimeError, ValueError, TypeError) as e:
        message = _XGR_PREFIX.sub("", str(e)).strip()
        raise ParamError(f"structured_outputs.{kind} cannot be compiled: {message}",
                         "structured_outputs") from e
    raise AssertionError(f"unknown structured output kind {kind!r}")


class GrammarCompiler:
    """Compiles constraints against one tokenizer's vocabulary, in the background,
    with an LRU cache of the results (futures, so two requests with the same
    schema share one compile)."""

    def __init__(self, tokenizer: Tokenizer, vocab_size: int, eos_token_ids: tuple[int, ...],
                 cache_size: int = GRAMMAR_CACHE_SIZE) -> None:
        # The vocabulary as xgrammar reads it from the tokenizer: token strings,
        # their byte decoding (byte-level, byte-fallback or raw), and the stop
        # tokens, which the matcher allows only where the grammar may end.
        self.tokenizer_info = xgr.TokenizerInfo.from_huggingface(
            tokenizer.hf, vocab_size=vocab_size, stop_token_ids=list(eos_token_ids)
        )
        self.vocab_size = vocab_size
        self._compiler = xgr.GrammarCompiler(self.tokenizer_info, max_threads=1,
                                             cache_enabled=False)
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tokenmill-grammar")
        self._cache: OrderedDict[GrammarKey, Future[xgr.CompiledGrammar]] = OrderedDict()
        self._lock = threading.Lock()
        self.cache_size = cache_size

    def compile(self, params: StructuredOutputsParams) -> Future[xgr.CompiledGrammar]:
        """The compiled grammar of `params` (a future: done at once on a cache hit).
        Raises ParamError at once if the constraint cannot be parsed."""
        key = grammar_key(params)
        with self._lock:
            future = self._cache.get(key)
            if future is not None:
                self._cache.move_to_end(key)
                return future
        grammar = build_grammar(key)
        future = self._executor.submit(self._compiler.compile_grammar, grammar)
        with self._lock:
            self._cache[key] = future
            while len(self._cache) > self.cache_size:
                self._cache.popitem(last=False)

        def forget_failed(done: Future[xgr.CompiledGrammar]) -> None:
            # A compile that failed leaves no entry: the next request tries again.
            if not done.cancelled() and done.exception() is not None:
                with self._lock:
                    if self._cache.get(key) is done:
                        del self._cache[key]

        future.add_done_callback(forget_failed)
        return future

    def shutdown(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)
