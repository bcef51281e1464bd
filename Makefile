# The two commands: `make demo` and `make test`. Both install what is missing first.
BUILD_DIR ?= build
JOBS      ?= 2
BUILD_TYPE ?= Release
PYTHON    ?= $(CURDIR)/.venv/bin/python
DEMO_METRICS_PORT ?= 9464
DEMO_ARGS ?= --steps 300 --inject nan_grad@100 --inject inf_grad@180 --inject nan_loss@240 \
             --metrics-port $(DEMO_METRICS_PORT) \
             --summary-json $(BUILD_DIR)/demo-summary.json --trace $(BUILD_DIR)/demo-trace.jsonl

.PHONY: all deps configure build test demo test-torch format clean

all: build

# Debian's packages (the C++ side), then the pinned Python environment (.venv, with torch).
deps:
	scripts/install-deps
	scripts/python-env

# Everything builds against the environment's torch: its LibTorch for the C++ library, the CLI and
# the tests, and its Python for stepguard._C.
configure: deps
	cmake -S . -B $(BUILD_DIR) -DCMAKE_BUILD_TYPE=$(BUILD_TYPE) \
	  -DCMAKE_PREFIX_PATH="$$($(PYTHON) -c 'import torch; print(torch.utils.cmake_prefix_path)')" \
	  -DSTEPGUARD_PYTHON=$(PYTHON)

build: configure
	cmake --build $(BUILD_DIR) -j$(JOBS)

test: build
	cd $(BUILD_DIR) && ctest --output-on-failure --timeout 1200

demo: build
	$(BUILD_DIR)/bin/stepguard demo $(DEMO_ARGS)

# The oldest torch the build accepts (README "Supported versions"), checked when that boundary
# changes, not in every CI run: a second environment (.venv-torch$(TORCH): the pins, then that
# torch) and build (build-torch$(TORCH): the library, the CLI and stepguard._C against it), then
# the Python unit tests and the framework tests. `make test-torch TORCH=2.11`.
TORCH ?= 2.11
TORCH_VENV = .venv-torch$(TORCH)
TORCH_BUILD = build-torch$(TORCH)
test-torch:
	scripts/install-deps
	scripts/python-env --torch $(TORCH) $(TORCH_VENV)
	cmake -S . -B $(TORCH_BUILD) -DCMAKE_BUILD_TYPE=$(BUILD_TYPE) -DSTEPGUARD_BUILD_BENCHMARKS=OFF \
	  -DCMAKE_PREFIX_PATH="$$($(TORCH_VENV)/bin/python -c 'import torch; print(torch.utils.cmake_prefix_path)')" \
	  -DSTEPGUARD_PYTHON=$(CURDIR)/$(TORCH_VENV)/bin/python
	cmake --build $(TORCH_BUILD) -j$(JOBS) --target stepguard_python stepguard_cli
	cd $(TORCH_BUILD) && ctest --output-on-failure -R '^(python_tests|framework_tests)$$'

format:
	clang-format -i $$(git ls-files '*.h' '*.cpp' '*.cu' '*.cuh')

clean:
	rm -rf $(BUILD_DIR)
