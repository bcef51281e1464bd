# The two commands: `make demo` and `make test`. Both install what is missing first.
BUILD_DIR ?= build
JOBS      ?= 2
BUILD_TYPE ?= Release
DEMO_METRICS_PORT ?= 9464
DEMO_ARGS ?= --steps 300 --inject nan_grad@100 --inject inf_grad@180 --inject nan_loss@240 \
             --metrics-port $(DEMO_METRICS_PORT) \
             --summary-json $(BUILD_DIR)/demo-summary.json --trace $(BUILD_DIR)/demo-trace.jsonl

.PHONY: all deps configure build test demo format clean

all: build

deps:
	scripts/install-deps

configure: deps
	cmake -S . -B $(BUILD_DIR) -DCMAKE_BUILD_TYPE=$(BUILD_TYPE)

build: configure
	cmake --build $(BUILD_DIR) -j$(JOBS)

test: build
	cd $(BUILD_DIR) && ctest --output-on-failure --timeout 1200

demo: build
	$(BUILD_DIR)/bin/stepguard demo $(DEMO_ARGS)

format:
	clang-format -i $$(git ls-files '*.h' '*.cpp' '*.cu' '*.cuh')

clean:
	rm -rf $(BUILD_DIR)
