# specpage: set-up, tests and the daemon. Everything lives in .venv.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
# The CPU build of torch lies on this machine's disk; a plain `torch`
# requirement would pull a multi-GB CUDA build.
TORCH_PIN ?= torch==2.13.0

.PHONY: install test lint typecheck clean protos serve bench llama-server

$(PY):
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip

$(STAMP): pyproject.toml | $(PY)
	$(PY) -m pip install --quiet "$(TORCH_PIN)"
	$(PY) -m pip install --quiet -e ".[dev]"
	touch $(STAMP)

install: $(STAMP)

lint: $(STAMP)
	$(VENV)/bin/ruff check specpage tests bench loadgen draft
	$(VENV)/bin/mypy

test: lint
	$(VENV)/bin/pytest -q

# Every benchmark in its short form, then docs/BENCHMARKS.md from the results.
# vllm_cpu goes first: it sets up vLLM's own venv (.venv-vllm, once, ~3.4 GB).
BENCHES := vllm_cpu block_pool model_runner engine speculation adaptive memory overhead quantization compile serving kernels_gpu
bench: $(STAMP)
	$(VENV)/bin/specpage models fetch smollm2-135m
	for b in $(BENCHES); do $(PY) bench/$$b.py --quick || exit 1; done
	$(PY) bench/report.py

# llama.cpp as a benchmark peer: its own llama-server and llama-bench, built
# once into .llama-cpp/ from the llama.cpp that PyPI's llama-cpp-python source
# package vendors (about 5 min on 2 cores). bench/serving.py adds it as a
# system once it is built; bench/model_free_peers.py runs its speculation.
llama-server:
	bench/build_llama_server.sh

# The daemon on the default model, 127.0.0.1 only: SmolLM2-135M-Instruct
# (fetched once, then offline), speculating with the proposers that need no
# model (bench/model_free.py: they pay more without a draft model beside
# them). `make serve DRAFT=models/smollm2-draft` (or models/smollm2-head)
# adds one. The call to make is printed once the daemon answers (it loads
# the model first); Ctrl-C or a TERM drains it, and make waits for it to exit.
DRAFT :=
PORT := 50051
serve: $(STAMP)
	$(VENV)/bin/specpage models fetch smollm2-135m
	@$(VENV)/bin/specpage serve --model smollm2-135m $(if $(DRAFT),--draft $(DRAFT)) --port $(PORT) & \
	pid=$$!; trap 'kill -TERM $$pid 2>/dev/null' INT TERM; \
	until $(VENV)/bin/specpage info --server 127.0.0.1:$(PORT) >/dev/null 2>&1; do \
		kill -0 $$pid 2>/dev/null || break; sleep 1; \
	done; \
	if kill -0 $$pid 2>/dev/null; then \
		echo "specpage: serving on 127.0.0.1:$(PORT)$(if $(DRAFT), (draft $(DRAFT))); call it with:"; \
		echo '  .venv/bin/specpage generate --server 127.0.0.1:$(PORT) "What is the capital of France?"'; \
	fi; \
	wait $$pid; status=$$?; \
	while kill -0 $$pid 2>/dev/null; do wait $$pid; status=$$?; done; \
	exit $$status

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache .hypothesis

# Regenerate the committed gRPC stubs (tests fail when they are stale).
protos: $(STAMP)
	$(PY) protos/generate.py
