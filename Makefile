# The two commands of the README: `make run` and `make test`. Both install what is missing first.
BUILD ?= build
JOBS ?= 2
MODEL ?= models/mini
PROMPT ?= The quick brown fox
N ?= 32

.PHONY: all deps build run test asan fuzz clean

all: build

deps:
	@bash scripts/install-deps.sh

$(BUILD)/CMakeCache.txt:
	cmake -S . -B $(BUILD) -DCMAKE_BUILD_TYPE=Release

build: deps $(BUILD)/CMakeCache.txt
	cmake --build $(BUILD) -j$(JOBS)

$(MODEL)/config.json: | build
	$(BUILD)/moex gen-model --preset mini --seed 1 --out $(MODEL)

run: build $(MODEL)/config.json
	$(BUILD)/moex generate --model $(MODEL) --prompt "$(PROMPT)" -n $(N)

# MOEX_COMM_TUNING=none: a table that `moex tune-comm` left in ~/.cache/moex must not change what tests run.
test: build
	cd $(BUILD) && MOEX_COMM_TUNING=none ctest --output-on-failure -j1

# Unit and bad-input tests once more under AddressSanitizer + UndefinedBehaviorSanitizer (CI runs this too).
asan: deps
	cmake -S . -B build-asan -DCMAKE_BUILD_TYPE=Debug "-DCMAKE_CXX_FLAGS_DEBUG=-O1 -g" -DMOEX_SANITIZE=ON
	cmake --build build-asan -j$(JOBS) --target moex_unit_tests moex
	cd build-asan && MOEX_COMM_TUNING=none ctest --output-on-failure -L 'unit|cli'

# libFuzzer on the safetensors reader (clang from Debian); FUZZ_SECONDS bounds the run.
FUZZ_SECONDS ?= 30
fuzz: deps
	mkdir -p build-fuzz/corpus
	clang++ -std=c++20 -g -O1 -fsanitize=fuzzer,address,undefined -Isrc tests/fuzz/safetensors_fuzz.cc \
	  src/moex/model/safetensors.cc src/moex/base/error.cc src/moex/base/dtype.cc src/moex/base/tensor.cc \
	  src/moex/base/mapped_file.cc -o build-fuzz/safetensors_fuzz
	build-fuzz/safetensors_fuzz -max_total_time=$(FUZZ_SECONDS) -max_len=4096 build-fuzz/corpus tests/fuzz/seeds

clean:
	rm -rf $(BUILD) build-asan
