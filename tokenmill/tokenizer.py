"""Tokenizer loading, chat templates, and incremental (streaming) detokenization.

The tokenizer comes from a Hugging Face directory or from a GGUF file's
metadata (transformers converts it), so a GGUF file is self-contained.
"""

from __future__ import annotations

import functools
import json
import os
from collections.abc import Mapping, Sequence
from typing import Any

# Chat messages as OpenAI and vLLM take them: {"role": ..., "content": ...}.
ChatMessage = dict[str, Any]


class Tokenizer:
    def __init__(self, hf_tokenizer: Any) -> None:
        self.hf = hf_tokenizer
        self.eos_token_id: int | None = hf_tokenizer.eos_token_id
        self.bos_token_id: int | None = hf_tokenizer.bos_token_id
        self.vocab_size: int = len(hf_tokenizer)
        self.all_special_ids: set[int] = set(hf_tokenizer.all_special_ids)
        # Added tokens (special or not) decode as themselves, between text segments;
        # skip_special_tokens drops those the tokenizer marks special (which can be
        # more than all_special_ids lists), as its own decode does.
        self.added_tokens: dict[int, str] = {
            i: t for t, i in hf_tokenizer.get_added_vocab().items()
        }
        self.skipped_ids: set[int] = self.all_special_ids | {
            i for i, t in getattr(hf_tokenizer, "added_tokens_decoder", {}).items()
            if getattr(t, "special", False)
        }
        self._token_strings: dict[int, str] = {}
        self._backend_decode = _backend_decode(hf_tokenizer)

    @classmethod
    def load(cls, path: str) -> Tokenizer:
        """`path` is a Hugging Face directory or a .gguf file."""
        from transformers import AutoTokenizer

        if path.endswith(".gguf"):
            return cls(_gguf_tokenizer(path))
        try:
            return cls(AutoTokenizer.from_pretrained(path))
        except Exception as e:
            if os.path.isdir(path):  # (not a hub id) say which file is wrong
                _check_tokenizer_files(path, e)
            raise

    @property
    def has_chat_template(self) -> bool:
        return bool(getattr(self.hf, "chat_template", None))

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        try:
            return list(self.hf.encode(text, add_special_tokens=add_special_tokens))
        except TypeError:
            try:  # JSON can carry lone surrogates ("\ud800"); the tokenizer cannot
                text.encode("utf-8")
            except UnicodeEncodeError as e:
                raise ValueError(
                    f"the text is not valid Unicode: {e.reason} at character {e.start}; "
                    "send UTF-8 text (surrogates only in pairs)"
                ) from e
            raise

    def encode_pair(self, text: str, text_pair: str) -> tuple[list[int], list[int] | None]:
        """A text pair as the tokenizer joins it (BERT: [CLS] a [SEP] b [SEP]), a
        cross-encoder's input: its token ids, and its token types (0 for the first
        text's tokens, 1 for the second's) where the tokenizer makes them."""
        for t in (text, text_pair):
            self.encode(t, add_special_tokens=False)  # (the Unicode check's error, if any)
        encoded = self.hf(text, text_pair, add_special_tokens=True)
        types = encoded.get("token_type_ids")
        return list(encoded["input_ids"]), None if types is None else list(types)

    @functools.cached_property
    def max_token_bytes(self) -> int | None:
        """The most bytes of text one token can stand for, where that is proven:
        a byte-level BPE (no normalizer, a ByteLevel pre-tokenizer: each token is
        a vocabulary entry covering exactly its own bytes; Split and Digits steps
        only cut the text) whose added tokens strip
        no whitespace around them. Then text of N UTF-8 bytes encodes to at least
        N / this many tokens (fewer only where the vocabulary lacks a byte, e.g. a
        control character, which the tokenizer drops), so the server refuses text
        far over the context without tokenizing it. None for any other tokenizer
        (SentencePiece's normalizers change the text's length)."""
        backend: Any = getattr(self.hf, "backend_tokenizer", None)
        try:
            pre = json.loads(backend.pre_tokenizer.__getstate__()) if backend.pre_tokenizer else {}
            if (backend.normalizer is not None or backend.truncation is not None
                    or type(backend.model).__name__ != "BPE"):
                return None
            vocab = backend.get_vocab(with_added_tokens=False)
            added = list(backend.get_added_tokens_decoder().values())
        except Exception:  # (not a tokenizers backend)
            return None
        steps = pre.get("pretokenizers", []) if pre.get("type") == "Sequence" else [pre]
        if (not any(p.get("type") == "ByteLevel" for p in steps)
                or any(p.get("type") not in ("ByteLevel", "Split", "Digits") for p in steps)
                or any(a.lstrip or a.rstrip for a in added)):
            return None
        return max([len(t) for t in vocab] + [len(a.content.encode()) for a in added])

    def decode(
        self,
        token_ids: Sequence[int],
        skip_special_tokens: bool = True,
        spaces_between_special_tokens: bool = False,
    ) -> str:
        """With spaces_between_special_tokens, text runs and added tokens are
        joined with a space, as transformers' slow tokenizers (and vLLM) do."""
        if not spaces_between_special_tokens or self.added_tokens.keys().isdisjoint(token_ids):
            if self._backend_decode is not None:
                return str(self._backend_decode(list(token_ids), skip_special_tokens=skip_special_tokens))
            return str(self.hf.decode(list(token_ids), skip_special_tokens=skip_special_tokens))
        pieces: list[str] = []
        run: list[int] = []
        for token_id in token_ids:
            if token_id not in self.added_tokens:
                run.append(token_id)
                continue
            if skip_special_tokens and token_id in self.skipped_ids:
                continue
            if run:
                pieces.append(str(self.hf.decode(run)))
                run = []
            pieces.append(self.added_tokens[token_id])
        if run:
            pieces.append(str(self.hf.decode(run)))
        return " ".join(pieces)

    def token_string(self, token_id: int) -> str:
        """One token's own text, as vLLM shows it in logprobs (a token holding
        part of a UTF-8 character shows as U+FFFD)."""
        text = self._token_strings.get(token_id)
        if text is None:
            token = self.hf.convert_ids_to_tokens(token_id)
            text = str(self.hf.convert_tokens_to_string([token])) if token is not None else ""
            self._token_strings[token_id] = text
        return text

    def bad_words_token_ids(self, words: Sequence[str]) -> list[list[int]]:
        """Each bad word as token ids, alone and after a space when that is a
        different token sequence of the same length (vLLM's rule)."""
        sequences: list[list[int]] = []
        for word in words:
            plain = self.encode(word.lstrip(), add_special_tokens=False)
            sequences.append(plain)
            spaced = self.encode(" " + word.lstrip(), add_special_tokens=False)
            if spaced and spaced[0] != plain[0] and len(spaced) == len(plain):
                sequences.append(spaced)
        return [seq for seq in sequences if seq]

    def chat_template_source(self, chat_template: str | None = None,
                             tools: list[dict[str, Any]] | None = None) -> str | None:
        """The template's text that renders these messages (a model with several
        picks by name, or its "tool_use" one for tools), or None without one."""
        if chat_template is None and not self.has_chat_template:
            return None
        return str(self.hf.get_chat_template(chat_template, tools))

    def apply_chat_template(
        self,
        messages: list[ChatMessage],
        add_generation_prompt: bool = True,
        chat_template: str | None = None,
        tools: list[dict[str, Any]] | None = None,
        chat_template_kwargs: Mapping[str, Any] | None = None,
    ) -> str:
        """`tools` (OpenAI's function tools) reach the template as its `tools`,
        as transformers' apply_chat_template(tools=...) passes them;
        `chat_template_kwargs` as variables of their names (vLLM's field:
        Qwen3's enable_thinking)."""
        if chat_template is None and not self.has_chat_template:
            raise ValueError(
                "this model's tokenizer has no chat template; send a plain prompt "
                "(completions, or --raw) or pass chat_template"
            )
        kwargs = check_chat_template_kwargs(chat_template_kwargs)
        import jinja2  # (transformers renders templates with it)

        try:
            text = self.hf.apply_chat_template(
                plain_chat_messages(messages),
                tokenize=False,
                add_generation_prompt=add_generation_prompt,
                chat_template=chat_template,
                tools=tools,
                **kwargs,
            )
        except jinja2.TemplateError as e:  # a template that fails on these messages
            raise ValueError(f"the chat template failed on these messages: {e}") from e
        return str(text)

    def chat_template_inputs(
        self, messages: list[ChatMessage], chat_template_kwargs: Mapping[str, Any] | None = None,
    ) -> tuple[list[dict[str, Any]], dict[str, Any]]:
        """What a chat template rendered elsewhere (the server's template worker)
        sees: the messages as apply_chat_template passes them, and the special
        tokens (bos_token, eos_token, ...) as the tokenizer's own rendering does,
        with `chat_template_kwargs` (checked as apply_chat_template checks them)."""
        variables = dict(getattr(self.hf, "special_tokens_map", {}) or {})
        variables.update(check_chat_template_kwargs(chat_template_kwargs))
        return plain_chat_messages(messages), variables

    def encode_chat(
        self,
        messages: list[ChatMessage],
        add_generation_prompt: bool = True,
        chat_template: str | None = None,
    ) -> list[int]:
        text = self.apply_chat_template(messages, add_generation_prompt, chat_template)
        # The template writes the special tokens itself.
        return self.encode(text, add_special_tokens=False)


# apply_chat_template's own arguments and the variables it sets: not for
# chat_template_kwargs to override.
RESERVED_TEMPLATE_VARIABLES = frozenset({
    "messages", "conversation", "tools", "documents", "add_generation_prompt", "chat_template",
    "tokenize", "padding", "truncation", "max_length", "return_tensors", "return_dict",
    "return_assistant_tokens_mask", "continue_final_message", "tokenizer_kwargs",
})


def check_chat_template_kwargs(kwargs: Mapping[str, Any] | None) -> dict[str, Any]:
    """chat_template_kwargs as template variables; ValueError for a name the
    template call sets itself (messages, tools, add_generation_prompt, ...)."""
    if not kwargs:
        return {}
    for name in kwargs:
        if not isinstance(name, str) or not name.isidentifier():
            raise ValueError(f"chat_template_kwargs: {name!r} is not a template variable name")
        if name in RESERVED_TEMPLATE_VARIABLES or name in {"bos_token", "eos_token"}:
            raise ValueError(f"chat_template_kwargs: {name!r} is set by the server itself; "
                             "send it as its own request field or drop it")
    return dict(kwargs)


def plain_chat_messages(messages: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Messages as chat templates take them: each a dict with a string role;
    content None as "", and OpenAI's content parts (text only) joined into one
    string, as vLLM does. ValueError naming the message otherwise."""
    plain = []
    for i, m in enumerate(messages):
        if not isinstance(m, Mapping) or not isinstance(m.get("role"), str):
            raise ValueError(f"messages[{i}] must be a dict with a string 'role', got {m!r:.80}")
        message = dict(m)
        content = message.get("content")
        if content is None:
            message["content"] = ""
        elif isinstance(content, list):
            if not all(isinstance(p, Mapping) and p.get("type") == "text" and isinstance(p.get("text"), str)
                       for p in content):
                raise ValueError(f"messages[{i}].content: only text content parts are supported")
            message["content"] = "".join(p["text"] for p in content)
        elif not isinstance(content, str):
            raise ValueError(f"messages[{i}].content must be a string or a list of text parts")
        if message.get("tool_calls") is not None:
            message["tool_calls"] = _template_tool_calls(message["tool_calls"], i)
        plain.append(message)
    return plain


def _template_tool_calls(calls: Any, i: int) -> list[dict[str, Any]]:
    """An assistant message's tool_calls as templates take them: each call's
    arguments (OpenAI sends JSON text) parsed into an object, as vLLM does."""
    if not isinstance(calls, list):
        raise ValueError(f"messages[{i}].tool_calls must be a list")
    out = []
    for j, call in enumerate(calls):
        function = call.get("function") if isinstance(call, Mapping) else None
        if not isinstance(function, Mapping) or not isinstance(function.get("name"), str):
            raise ValueError(f"messages[{i}].tool_calls[{j}] must have a function with a string name")
        arguments = function.get("arguments")
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments) if arguments.strip() else {}
            except json.JSONDecodeError as e:
                raise ValueError(f"messages[{i}].tool_calls[{j}].function.arguments is not valid JSON: "
                                 f"{e}") from e
        out.append({**call, "function": {**function, "arguments": arguments}})
    return out


def _backend_decode(hf: Any) -> Any:
    """The Rust tokenizer's own decode where transformers' decode is exactly it
    (a fast tokenizer with the stock _decode and no clean-up of spaces), else
    None. It skips transformers' Python layers, about a third of a call: the
    detokenizer calls it twice per token of every running request each step."""
    try:
        from transformers.tokenization_utils_tokenizers import TokenizersBackend
    except ImportError:
        return None
    if (not isinstance(hf, TokenizersBackend) or type(hf)._decode is not TokenizersBackend._decode
            or hf.clean_up_tokenization_spaces):
        return None
    return hf.backend_tokenizer.decode


# How many prompt tokens to keep as left context when decoding the first output
# tokens: enough for tokenizers whose decoding depends on the previous token.
INITIAL_CONTEXT_TOKENS = 5


class IncrementalDetokenizer:
    """Turns a growing list of token ids into text deltas.

    It decodes a short window [prefix_offset, end) and emits the text beyond
    what [prefix_offset, read_offset) decodes to, so leading-space rules come
    out right; a window ending inside a multi-byte UTF-8 character decodes to
    U+FFFD and is held back until the character is complete:

        tokens:  ... | 'Ġh' 'i' | 'ĠðŁĺ' 'Ģ'      (the emoji is split in two)
        offsets:     prefix    read
        add 'ĠðŁĺ' -> window decodes to "hi �": ends in U+FFFD, emit nothing
        add 'Ģ'    -> window decodes to "hi 😀": emit " 😀", move both offsets
    """

    def __init__(
        self,
        tokenizer: Tokenizer,
        prompt_token_ids: Sequence[int],
        skip_special_tokens: bool = True,
        spaces_between_special_tokens: bool = True,
    ) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.spaces_between_special_tokens = spaces_between_special_tokens
        self.token_ids = list(prompt_token_ids[-INITIAL_CONTEXT_TOKENS:])
        self.prefix_offset = 0
        self.read_offset = len(self.token_ids)

    def _decode(self, token_ids: Sequence[int]) -> str:
        return self.tokenizer.decode(
            token_ids, self.skip_special_tokens, self.spaces_between_special_tokens
        )

    def add_tokens(self, new_token_ids: Sequence[int], final: bool = False) -> str:
        """The text the new tokens complete; with `final`, also whatever is held back."""
        self.token_ids.extend(new_token_ids)
        prefix_text = self._decode(self.token_ids[self.prefix_offset : self.read_offset])
        full_text = self._decode(self.token_ids[self.prefix_offset :])
        if len(full_text) > len(prefix_text) and (final or not full_text.endswith("\ufffd")):
            delta = full_text[len(prefix_text) :]
            self.prefix_offset = self.read_offset
            self.read_offset = len(self.token_ids)
            return delta
        return ""


# Files a Hugging Face tokenizer is built from: tokenizer.json (fast), or the
# slow tokenizers' vocabularies.
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "tiktoken.model")
_JSON_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "config.json",
               "vocab.json", "added_tokens.json")


def _check_tokenizer_files(directory: str, error: Exception) -> None:
    """After transformers failed to load the tokenizer in `directory`: a
    ValueError naming the missing or corrupt file, when that is the cause."""
    if not any(os.path.isfile(os.path.join(directory, f)) for f in _TOKENIZER_FILES):
        raise ValueError(
            f"{directory} has no tokenizer.json (nor {', '.join(_TOKENIZER_FILES[1:])}); a "
            "Hugging Face model directory needs its tokenizer.json, or pass --tokenizer"
        ) from error
    for name in _JSON_FILES:
        file = os.path.join(directory, name)
        if not os.path.isfile(file):
            continue
        try:
            with open(file, encoding="utf-8") as f:
                data = json.load(f)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ValueError(f"{file} is not valid JSON ({e}); the file is corrupt") from error
        if not isinstance(data, dict):
            raise ValueError(
                f"{file} must hold a JSON object, got a {type(data).__name__}"
            ) from error


def _gguf_tokenizer(path: str) -> Any:
    """transformers' tokenizer for a GGUF file, its pre-tokenizer chosen by the
    file's `tokenizer.ggml.pre` (GGUF_PRE_TOKENIZERS). A byte-level BPE file
    (`tokenizer.ggml.model` "gpt2"), a SentencePiece one ("llama": Gemma's, of
    any architecture; 4 s against AutoTokenizer's 18 s for Gemma 3's 262,144
    tokens) or a llama-architecture one is built the way AutoTokenizer builds it, minus AutoTokenizer's first
    step: to pick the tokenizer class that step reads the file's whole metadata
    through the gguf package's reader (most of AutoTokenizer's time:
    docs/perf-notes.md, start-up), and the class it picks for those is
    TokenizersBackend (the vocabulary, merges and special tokens come from the
    file whatever the class). Other files, folders with a tokenizer_config.json
    of their own (which can name another class), and transformers versions
    without the fast metadata reader (where the file's pre-tokenizer name is not
    read either) still go through AutoTokenizer."""
    from transformers import AutoTokenizer

    directory, filename = os.path.split(os.path.abspath(path))
    builder: Any = AutoTokenizer
    pre_tokenizer = None
    try:
        from transformers.integrations.gguf.reader import read_gguf_metadata
        from transformers.tokenization_utils_tokenizers import TokenizersBackend
    except ImportError:
        pass
    else:
        metadata, _ = read_gguf_metadata(path)  # (arrays as counts: 0.02 s)
        _check_gguf_token_ids(path, metadata)
        byte_level = metadata.get("tokenizer.ggml.model") == "gpt2"
        if byte_level:
            pre_tokenizer = gguf_pre_tokenizer(path, metadata.get("tokenizer.ggml.pre"))
        sentencepiece = metadata.get("tokenizer.ggml.model") == "llama"  # (Llama 2's, Gemma's: any architecture)
        if (byte_level or sentencepiece or metadata.get("general.architecture") == "llama") and not os.path.exists(
            os.path.join(directory, "tokenizer_config.json")
        ):
            builder = TokenizersBackend
    tokenizer = builder.from_pretrained(directory, gguf_file=filename)
    if pre_tokenizer is not None:
        tokenizer.backend_tokenizer.pre_tokenizer = pre_tokenizer
    return tokenizer


# A byte-level BPE file's `tokenizer.ggml.pre` -> how llama.cpp splits text
# before the merges (llama-vocab.cpp): a regex ("gpt2": byte-level BPE's own),
# and whether each digit is split off first. The merges were learned on that
# split, so another gives other tokens. A name not here is refused.
_GPT2 = "gpt2"
_LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                 r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
                r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
# tiktoken's o200k_base (GPT-4o; Phi-4-mini): case-aware words (an upper-case run
# may start a lower-case word), contractions kept on the word, digits in threes.
_UPPER, _LOWER = r"[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]", r"[\p{Ll}\p{Lm}\p{Lo}\p{M}]"
_CONTRACTION = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
_GPT4O_SPLIT = (rf"[^\r\n\p{{L}}\p{{N}}]?{_UPPER}*{_LOWER}+{_CONTRACTION}"
                rf"|[^\r\n\p{{L}}\p{{N}}]?{_UPPER}+{_LOWER}*{_CONTRACTION}"
                r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")
GGUF_PRE_TOKENIZERS: dict[str, tuple[str, bool]] = {
    "gpt-2": (_GPT2, False),
    "smollm": (_GPT2, True),  # SmolLM and SmolLM2 (the default model)
    "refact": (_GPT2, True),
    "llama-bpe": (_LLAMA3_SPLIT, False),  # Llama 3
    "llama3": (_LLAMA3_SPLIT, False),
    "llama-v3": (_LLAMA3_SPLIT, False),
    "qwen2": (_QWEN2_SPLIT, False),  # Qwen2, Qwen2.5, Qwen3
    "deepseek-r1-qwen": (_QWEN2_SPLIT, False),
    "gpt-4o": (_GPT4O_SPLIT, False),  # Phi-4-mini
}


def gguf_pre_tokenizer(path: str, name: Any) -> Any:
    """The `tokenizers` pre-tokenizer for a byte-level BPE file's
    `tokenizer.ggml.pre` (None: the file names none, byte-level BPE's own split,
    as llama.cpp's converter writes none only for it); a ValueError naming the
    field and the value for a name not in GGUF_PRE_TOKENIZERS."""
    from tokenizers import Regex, pre_tokenizers

    if name is None:
        return None
    if name not in GGUF_PRE_TOKENIZERS:
        raise ValueError(
            f"{path}: tokenizer.ggml.pre={name!r} is not a supported pre-tokenizer; supported: "
            f"{', '.join(GGUF_PRE_TOKENIZERS)}. The text would be split other than the merges "
            "were learned on; use the model's Hugging Face directory instead"
        )
    split, digits = GGUF_PRE_TOKENIZERS[name]
    steps: list[Any] = [pre_tokenizers.Digits(individual_digits=True)] if digits else []
    if split == _GPT2:
        steps.append(pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True))
    else:
        steps += [pre_tokenizers.Split(Regex(split), behavior="isolated"),
                  pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]
    return pre_tokenizers.Sequence(steps)


def _check_gguf_token_ids(path: str, metadata: Mapping[str, Any]) -> None:
    """Special token ids (bos, eos, ...) inside the vocabulary, so that a corrupt
    id is a ValueError naming its key rather than an IndexError in transformers."""
    tokens = metadata.get("tokenizer.ggml.tokens")
    vocab_size = tokens if isinstance(tokens, int) else len(tokens) if isinstance(tokens, list) else None
    if vocab_size is None:
        return
    for key, value in metadata.items():
        if key.startswith("tokenizer.ggml.") and key.endswith("_token_id") and (
            isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < vocab_size
        ):
            raise ValueError(
                f"{path}: {key}={value!r} is invalid; it must be a token id (an integer in "
                f"[0, {vocab_size}), the vocabulary's size)"
            )
