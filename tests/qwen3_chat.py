"""A tiny random Qwen3 that chats as Qwen3 does, for the reasoning and Messages
API tests: the default model's tokenizer (ChatML's <|im_start|> / <|im_end|>,
as Qwen's) with Qwen3's chat template rules, saved beside a random Qwen3Config
model. Nothing is downloaded.

With `think_tokens`, <think> and </think> are added tokens, one id each, as in
Qwen3's vocabulary; without, the tokenizer writes each tag in several BPE
pieces, so a tag falls across tokens and stream chunks."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import transformers

from tests.hf_models import COMMON
from tests.server_harness import ServerThread
from tokenmill import LLM
from tokenmill.config import ServerConfig
from tokenmill.engine.async_engine import AsyncEngine
from tokenmill.model.source import resolve_model_source
from tokenmill.server import build_app
from tokenmill.tokenizer import Tokenizer

# Qwen3's chat template rules, written for these tests: ChatML turns; tools listed
# in the system turn inside <tools>, calls written as <tool_call>{json}</tool_call>,
# tool results as <tool_response> in a user turn; an assistant turn's
# reasoning_content shown in <think> only after the last user query; and for the
# generation prompt, enable_thinking=false writes an empty think block (the model
# answers at once). `open_think=true` opens a <think> in the generation prompt, as
# the Qwen3 "Thinking-2507" templates do.
QWEN3_TEMPLATE = (
    "{%- if tools %}"
    "{{- '<|im_start|>system\n' }}"
    "{%- if messages[0].role == 'system' %}{{- messages[0].content + '\n\n' }}{%- endif %}"
    "{{- '# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>' }}"
    "{%- for tool in tools %}{{- '\n' + (tool | tojson) }}{%- endfor %}"
    "{{- '\n</tools>\n\nFor each function call, return a json object with function name and "
    "arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": "
    "<function-name>, \"arguments\": <args-json-object>}\n</tool_call><|im_end|>\n' }}"
    "{%- elif messages[0].role == 'system' %}"
    "{{- '<|im_start|>system\n' + messages[0].content + '<|im_end|>\n' }}"
    "{%- endif %}"
    "{%- set ns = namespace(last_query=0) %}"
    "{%- for message in messages %}{%- if message.role == 'user' %}{%- set ns.last_query = loop.index0 %}"
    "{%- endif %}{%- endfor %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'system' and loop.first %}"
    "{%- elif message.role == 'user' or message.role == 'system' %}"
    "{{- '<|im_start|>' + message.role + '\n' + message.content + '<|im_end|>\n' }}"
    "{%- elif message.role == 'assistant' %}"
    "{{- '<|im_start|>assistant\n' }}"
    "{%- if message.reasoning_content and loop.index0 > ns.last_query %}"
    "{{- '<think>\n' + message.reasoning_content + '\n</think>\n\n' }}"
    "{%- endif %}"
    "{{- message.content }}"
    "{%- for call in message.tool_calls or [] %}"
    "{{- '\n<tool_call>\n{\"name\": \"' + call.function.name + '\", \"arguments\": ' "
    "+ (call.function.arguments | tojson) + '}\n</tool_call>' }}"
    "{%- endfor %}"
    "{{- '<|im_end|>\n' }}"
    "{%- elif message.role == 'tool' %}"
    "{%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}"
    "{{- '\n<tool_response>\n' + message.content + '\n</tool_response>' }}"
    "{%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}{{- '<|im_end|>\n' }}{%- endif %}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}"
    "{{- '<|im_start|>assistant\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\n\n</think>\n\n' }}"
    "{%- elif open_think is defined and open_think %}{{- '<think>\n' }}"
    "{%- endif %}"
    "{%- endif %}"
)


def save_qwen3_chat_model(directory: Path, think_tokens: bool, seed: int = 0) -> str:
    """A random Qwen3 and its tokenizer (QWEN3_TEMPLATE) saved in `directory`."""
    hf = Tokenizer.load(resolve_model_source(None).path).hf
    if think_tokens:
        hf.add_tokens(["<think>", "</think>"])
    hf.chat_template = QWEN3_TEMPLATE
    config = transformers.Qwen3Config(**{**COMMON, "vocab_size": len(hf), "head_dim": 32,
                                         "bos_token_id": hf.bos_token_id,
                                         "eos_token_id": hf.eos_token_id})
    torch.manual_seed(seed)
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(directory)
    hf.save_pretrained(directory)
    return str(directory)


@dataclass
class Qwen3Served:
    llm: LLM
    engine: AsyncEngine
    server: ServerThread  # --reasoning-parser qwen3 --enable-auto-tool-choice --tool-call-parser hermes
    plain: ServerThread  # no reasoning parser: the raw text

    def stop(self) -> None:
        self.server.stop()
        self.plain.stop()
        self.engine.shutdown()


def serve_qwen3(directory: Path, think_tokens: bool, **config: Any) -> Qwen3Served:
    """The model of save_qwen3_chat_model served twice on one engine: with
    --reasoning-parser qwen3 (and `config`), and without."""
    llm = LLM(model=save_qwen3_chat_model(directory, think_tokens), dtype="float32",
              kv_cache_memory_bytes=64 << 20)
    engine = AsyncEngine(llm.engine)
    server = ServerThread(build_app(engine, ServerConfig(
        reasoning_parser="qwen3", enable_auto_tool_choice=True, tool_call_parser="hermes",
        **config))).start()
    plain = ServerThread(build_app(engine, ServerConfig())).start()
    return Qwen3Served(llm, engine, server, plain)
