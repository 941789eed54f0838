"""One choice's generated text split into what the APIs show: thinking
(--reasoning-parser), content, and tool calls (--tool-call-parser, or the
constraint of tool_choice "required" / a named function). The tool-call parser
reads only the answer after the thinking, as vLLM's does.

Chat (OpenAI's deltas), Responses (reasoning and message items) and Messages
(Anthropic's content blocks) all read a choice through this: streamed, one
`AnswerStream` per choice; whole, `whole_answer` over the full text (the same
parsers, fed once), so a streamed and a whole answer are the same answer."""

from __future__ import annotations

from dataclasses import dataclass

from tokenmill.server.protocol import ChatResponseMessage, DeltaToolCall
from tokenmill.server.reasoning import ReasoningParser
from tokenmill.server.tools import ToolPlan, ToolStream, whole_message


@dataclass
class AnswerDelta:
    reasoning: str | None = None
    content: str | None = None
    tool_calls: list[DeltaToolCall] | None = None


class AnswerStream:
    """One streamed choice: text deltas in, (reasoning, content, tool calls) out."""

    def __init__(self, plan: ToolPlan | None, reasoning: ReasoningParser | None) -> None:
        self.reasoning = reasoning
        self.tools = ToolStream(plan) if plan is not None else None
        self.num_reasoning_tokens = 0

    @property
    def called(self) -> bool:
        """Whether a tool call has begun."""
        return self.tools is not None and self.tools.called

    def feed(self, text: str, final: bool, num_tokens: int = 0) -> AnswerDelta:
        """The delta's parts; `final` at the choice's last delta (what parsers
        held back comes out). `num_tokens`, the delta's tokens, count as
        reasoning tokens while the thinking has not ended by the delta's end."""
        reasoning, content = "", text
        if self.reasoning is not None:
            split = self.reasoning.feed(text)
            if final:
                rest = self.reasoning.finish()
                split.reasoning += rest.reasoning
                split.content += rest.content
            reasoning, content = split.reasoning, split.content
            if reasoning or not self.reasoning.reasoning_ended:
                self.num_reasoning_tokens += num_tokens
        if self.tools is None:
            return AnswerDelta(reasoning or None, content or None)
        shown, calls = self.tools.feed(content, final)
        return AnswerDelta(reasoning or None, shown, calls)


def whole_answer(plan: ToolPlan | None, reasoning: ReasoningParser | None,
                 text: str) -> ChatResponseMessage:
    """A whole choice's message: reasoning_content, content and tool calls."""
    thinking = None
    if reasoning is not None:
        split = reasoning.parse(text)
        thinking, text = split.reasoning or None, split.content
    message = whole_message(plan, text) if plan is not None else ChatResponseMessage(content=text)
    message.reasoning_content = thinking
    return message
