"""A reasoning model's thinking out of its text, as it streams (vLLM's
--reasoning-parser): `<think>...</think>` becomes `reasoning_content`, the
rest `content`.

    qwen3         the thinking is the text between <think> and </think> at the start of the
                  answer (or, where the prompt left a <think> open, up to </think>); an answer
                  that does not open with <think> is content
    deepseek_r1   the answer starts in thinking (DeepSeek-R1's template opens <think> in the
                  prompt), up to </think>; a leading <think> is dropped

The parser works on text, not token ids, so a tag split over tokens or over
stream chunks is found all the same: text that may be the start of a tag is
held back until the next delta says what it is. A whole answer is fed as one
delta through the same code, so streamed and whole answers agree. Thinking cut
short (no </think> before the end) stays thinking.
"""

from __future__ import annotations

from dataclasses import dataclass

THINK_START, THINK_END = "<think>", "</think>"
REASONING_PARSERS = ("qwen3", "deepseek_r1")


def check_reasoning_parser(name: str | None) -> None:
    """ValueError for a --reasoning-parser this server does not have."""
    if name is not None and name not in REASONING_PARSERS:
        raise ValueError(f"--reasoning-parser {name!r} is not one of {', '.join(REASONING_PARSERS)}")


def prompt_opens_reasoning(prompt_text: str | None) -> bool:
    """Whether a rendered prompt ends inside a think block (its last tag is an
    open <think>): the answer then starts in thinking."""
    if not prompt_text:
        return False
    return prompt_text.rfind(THINK_START) > prompt_text.rfind(THINK_END)


def prompt_closes_reasoning(prompt_text: str | None) -> bool:
    """Whether a rendered prompt's last think tag is </think> (Qwen3 with
    enable_thinking=false writes an empty think block): the answer is all content."""
    if not prompt_text:
        return False
    return prompt_text.rfind(THINK_END) > prompt_text.rfind(THINK_START)


@dataclass
class ReasoningDelta:
    reasoning: str = ""
    content: str = ""


def _held(text: str, tag: str) -> int:
    """How many characters at the end of `text` could begin `tag`."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0


class ReasoningParser:
    """One choice's text -> (reasoning, content) deltas: feed() each delta,
    finish() at the end."""

    def __init__(self, name: str, prompt_text: str | None = None) -> None:
        check_reasoning_parser(name)
        self.name = name
        if prompt_opens_reasoning(prompt_text):
            self.state = "thinking"
        elif prompt_closes_reasoning(prompt_text):
            self.state = "content"
        else:
            # (qwen3 decides from the answer's first characters; deepseek_r1 thinks)
            self.state = "start"
        self.buffer = ""  # text held back: it may be (the start of) a tag
        self.num_reasoning_chars = 0

    @property
    def reasoning_ended(self) -> bool:
        return self.state == "content"

    def feed(self, text: str) -> ReasoningDelta:
        self.buffer += text
        out = ReasoningDelta()
        while self.buffer:
            if self.state == "start":
                head = self.buffer.lstrip()
                if head.startswith(THINK_START):
                    self.buffer, self.state = head[len(THINK_START):], "thinking"
                elif not head or THINK_START.startswith(head):
                    break  # (whitespace, or maybe the tag: wait)
                else:
                    self.state = "thinking" if self.name == "deepseek_r1" else "content"
            elif self.state == "thinking":
                at = self.buffer.find(THINK_END)
                if at >= 0:
                    out.reasoning += self.buffer[:at]
                    self.buffer, self.state = self.buffer[at + len(THINK_END):], "content"
                    continue
                cut = len(self.buffer) - _held(self.buffer, THINK_END)
                out.reasoning += self.buffer[:cut]
                self.buffer = self.buffer[cut:]
                break
            else:
                out.content += self.buffer
                self.buffer = ""
        self.num_reasoning_chars += len(out.reasoning)
        return out

    def finish(self) -> ReasoningDelta:
        """What is still held at the end of the answer."""
        out = ReasoningDelta()
        if self.state == "thinking" or (self.state == "start" and self.name == "deepseek_r1"):
            out.reasoning = self.buffer
        else:
            out.content = self.buffer
        self.buffer = ""
        return out

    def parse(self, text: str) -> ReasoningDelta:
        """A whole answer (the same code as streaming)."""
        first, last = self.feed(text), self.finish()
        return ReasoningDelta(first.reasoning + last.reasoning, first.content + last.content)
