"""Chat templates sent in requests, rendered under limits in a worker process.

A template is code: Jinja's sandbox stops it reaching the host, not
`{{ 'x' * 10**10 }}` allocating gigabytes nor nested loops running for hours.
So a request's template (with --trust-request-chat-template) renders in a small
child process that holds no model, with an address-space limit (a huge string is
a MemoryError there, not the kernel's OOM killer choosing a victim), a wall-clock
limit (past it the child is killed), and a cap on the rendered text; the caller
waits on a pipe, off the event loop. The model's own template is trusted with the
model and renders in the server process.

This module imports only the standard library at the top: it is also the
worker's script (`python -P templates.py`), started without the tokenmill
package (whose import pulls in torch) so it starts in well under a second.
"""

from __future__ import annotations

import contextlib
import json
import os
import select
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from typing import Any

DEFAULT_TIME_LIMIT_S = 5.0
DEFAULT_MEMORY_LIMIT_BYTES = 192 << 20  # address space the worker may add for one render
DEFAULT_MAX_OUTPUT_CHARS = 4 << 20
WORKER_START_TIMEOUT_S = 120.0  # (a cold start imports transformers on a busy machine)

_HEADER = struct.Struct(">Q")  # each message: its byte length, then JSON


class ChatTemplateError(ValueError):
    """The request's template failed on these messages (a Jinja error)."""


class ChatTemplateLimitError(ValueError):
    """The request's template ran past a limit (time, memory or output size)."""


class TemplateRenderer:
    """Renders request-supplied chat templates in one worker process, one
    render at a time (thread-safe: callers queue on a lock). A render that
    breaks a limit costs the worker; the next render starts a fresh one."""

    def __init__(
        self,
        time_limit_s: float = DEFAULT_TIME_LIMIT_S,
        memory_limit_bytes: int = DEFAULT_MEMORY_LIMIT_BYTES,
        max_output_chars: int = DEFAULT_MAX_OUTPUT_CHARS,
    ) -> None:
        self.time_limit_s = time_limit_s
        self.memory_limit_bytes = memory_limit_bytes
        self.max_output_chars = max_output_chars
        self._lock = threading.Lock()
        self._worker: subprocess.Popen[bytes] | None = None

    def render(
        self,
        template: str,
        messages: Sequence[Mapping[str, Any]],
        add_generation_prompt: bool,
        variables: Mapping[str, Any],
    ) -> str:
        """The rendered prompt. Raises ChatTemplateLimitError past a limit and
        ChatTemplateError when the template fails on these messages."""
        job = {"template": template, "messages": list(messages),
               "add_generation_prompt": add_generation_prompt, "variables": dict(variables)}
        with self._lock:
            worker = self._start()
            deadline = time.monotonic() + self.time_limit_s
            try:
                _send(worker, job)
                reply = _receive(worker, deadline)
            except TimeoutError:
                self._stop()
                raise ChatTemplateLimitError(
                    f"the chat_template did not finish rendering within the time limit of "
                    f"{self.time_limit_s:g} s; it was stopped"
                ) from None
            except (OSError, EOFError):  # the worker died (e.g. killed for memory)
                self._stop()
                raise ChatTemplateLimitError(
                    "the chat_template stopped the renderer before it finished (memory limit of "
                    f"{self.memory_limit_bytes >> 20} MiB)"
                ) from None
            if "text" in reply:
                return str(reply["text"])
            if reply.get("limit"):
                self._stop()  # a worker that hit its limit may keep what it allocated
                raise ChatTemplateLimitError(str(reply["error"]))
        raise ChatTemplateError(str(reply["error"]))

    def close(self) -> None:
        with self._lock:
            self._stop()

    def _start(self) -> subprocess.Popen[bytes]:
        if self._worker is not None and self._worker.poll() is None:
            return self._worker
        self._stop()
        limits = {"memory_limit_bytes": self.memory_limit_bytes,
                  "max_output_chars": self.max_output_chars}
        env = {**os.environ, "OMP_NUM_THREADS": "1", "TRANSFORMERS_VERBOSITY": "error"}
        worker = subprocess.Popen(
            [sys.executable, "-P", os.path.abspath(__file__), json.dumps(limits)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env,
        )
        self._worker = worker
        try:
            ready = _receive(worker, time.monotonic() + WORKER_START_TIMEOUT_S)
        except (TimeoutError, OSError, EOFError) as e:
            self._stop()
            raise RuntimeError("the chat template worker did not start") from e
        if not ready.get("ready"):
            self._stop()
            raise RuntimeError(f"the chat template worker did not start: {ready}")
        return worker

    def _stop(self) -> None:
        worker, self._worker = self._worker, None
        if worker is None:
            return
        if worker.poll() is None:
            worker.kill()
        worker.wait()
        for pipe in (worker.stdin, worker.stdout):
            if pipe is not None:
                pipe.close()


def _send(worker: subprocess.Popen[bytes], message: Mapping[str, Any]) -> None:
    assert worker.stdin is not None
    data = json.dumps(message).encode()
    worker.stdin.write(_HEADER.pack(len(data)) + data)
    worker.stdin.flush()


def _receive(worker: subprocess.Popen[bytes], deadline: float) -> dict[str, Any]:
    assert worker.stdout is not None
    fd = worker.stdout.fileno()
    (size,) = _HEADER.unpack(_read_exact(fd, _HEADER.size, deadline))
    reply = json.loads(_read_exact(fd, size, deadline))
    assert isinstance(reply, dict)
    return reply


def _read_exact(fd: int, size: int, deadline: float | None) -> bytes:
    """`size` bytes from `fd`; TimeoutError past `deadline`, EOFError at its end."""
    chunks: list[bytes] = []
    while size:
        if deadline is not None:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([fd], [], [], left)[0]:
                raise TimeoutError()
        chunk = os.read(fd, min(size, 1 << 20))
        if not chunk:
            raise EOFError()
        chunks.append(chunk)
        size -= len(chunk)
    return b"".join(chunks)


# ---- the worker process ------------------------------------------------------------------


def _limit_address_space(extra_bytes: int) -> None:
    """Let this process map at most `extra_bytes` more than it has now."""
    try:
        import resource
    except ImportError:  # (not a POSIX system: the time limit still holds)
        return
    with open("/proc/self/status") as f:
        vm_kb = next(int(line.split()[1]) for line in f if line.startswith("VmSize:"))
    limit = vm_kb * 1024 + extra_bytes
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))


def _worker_main(limits: Mapping[str, int]) -> None:
    from transformers.utils.chat_template_utils import render_jinja_template

    stdin, stdout = sys.stdin.buffer, sys.stdout.buffer
    sys.stdout = sys.stderr  # nothing but replies on the pipe

    def reply(message: Mapping[str, Any]) -> None:
        data = json.dumps(message).encode()
        stdout.write(_HEADER.pack(len(data)) + data)
        stdout.flush()

    # (Without /proc the time limit still holds.)
    with contextlib.suppress(OSError, StopIteration, ValueError):
        _limit_address_space(limits["memory_limit_bytes"])
    max_chars = limits["max_output_chars"]
    reply({"ready": True})
    while True:
        header = stdin.read(_HEADER.size)
        if len(header) < _HEADER.size:
            return  # the server closed the pipe (or is gone)
        job = json.loads(stdin.read(_HEADER.unpack(header)[0]))
        try:
            # (rendered conversations, generation indices), whatever its annotation says
            result: Any = render_jinja_template(
                conversations=[job["messages"]], chat_template=job["template"],
                add_generation_prompt=job["add_generation_prompt"], **job["variables"],
            )
            text = str(result[0][0])
        except MemoryError:
            reply({"error": "the chat_template needed more than the memory limit of "
                            f"{limits['memory_limit_bytes'] >> 20} MiB", "limit": True})
            continue
        except RecursionError:
            reply({"error": "the chat_template recursed past the recursion limit", "limit": True})
            continue
        except Exception as e:  # a template that fails on these messages
            reply({"error": f"the chat template failed on these messages: {e}"})
            continue
        if len(text) > max_chars:
            reply({"error": f"the chat_template rendered {len(text)} characters, over the limit "
                            f"of {max_chars}", "limit": True})
        else:
            reply({"text": text})


if __name__ == "__main__":
    _worker_main(json.loads(sys.argv[1]))
