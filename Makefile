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

# libFuzzer (clang from Debian) on the parsers of untrusted files: safetensors headers, config.json,
# model.safetensors.index.json, GGUF files and tokenizer.json. Each runs FUZZ_SECONDS from its seeds (tests/fuzz/seeds/<name>)
# plus the corpus it grew before (build-fuzz/corpus-<name>); a crash leaves its input in build-fuzz/ and fails the target.
FUZZ_SECONDS ?= 30
FUZZ_CXX = clang++ -std=c++20 -g -O1 -fsanitize=fuzzer,address,undefined -fno-sanitize-recover=undefined -Isrc
FUZZ_BASE = src/moex/base/error.cc src/moex/base/small_file.cc
FUZZ_CONFIG = src/moex/model/config.cc src/moex/model/quantization.cc
# WeightStore hands a .gguf path to the GGUF loader, so the safetensors reader links the GGUF sources too.
FUZZ_SAFETENSORS = src/moex/model/safetensors.cc src/moex/model/safetensors_index.cc src/moex/base/dtype.cc \
  src/moex/base/tensor.cc src/moex/base/mapped_file.cc src/moex/model/gguf.cc src/moex/model/gguf_checkpoint.cc \
  $(FUZZ_CONFIG) src/moex/base/system_memory.cc
FUZZ_GGUF = src/moex/model/gguf.cc src/moex/model/gguf_checkpoint.cc $(FUZZ_CONFIG) src/moex/base/dtype.cc \
  src/moex/base/mapped_file.cc src/moex/base/system_memory.cc
fuzz: deps
	mkdir -p build-fuzz/corpus-safetensors build-fuzz/corpus-config build-fuzz/corpus-index build-fuzz/corpus-gguf build-fuzz/corpus-tokenizer_json
	$(FUZZ_CXX) tests/fuzz/safetensors_fuzz.cc $(FUZZ_SAFETENSORS) $(FUZZ_BASE) -o build-fuzz/safetensors_fuzz
	$(FUZZ_CXX) tests/fuzz/config_fuzz.cc $(FUZZ_CONFIG) $(FUZZ_BASE) -o build-fuzz/config_fuzz
	$(FUZZ_CXX) tests/fuzz/index_fuzz.cc src/moex/model/safetensors_index.cc $(FUZZ_BASE) -o build-fuzz/index_fuzz
	$(FUZZ_CXX) tests/fuzz/gguf_fuzz.cc $(FUZZ_GGUF) $(FUZZ_BASE) -o build-fuzz/gguf_fuzz
	$(FUZZ_CXX) tests/fuzz/tokenizer_json_fuzz.cc src/moex/runtime/tokenizer_json.cc $(FUZZ_BASE) -lpcre2-8 -lutf8proc \
	  -o build-fuzz/tokenizer_json_fuzz
	cd build-fuzz && ./safetensors_fuzz -max_total_time=$(FUZZ_SECONDS) -max_len=4096 corpus-safetensors \
	  ../tests/fuzz/seeds/safetensors
	cd build-fuzz && ./config_fuzz -max_total_time=$(FUZZ_SECONDS) -max_len=4096 -dict=../tests/fuzz/config.dict \
	  corpus-config ../tests/fuzz/seeds/config
	cd build-fuzz && ./index_fuzz -max_total_time=$(FUZZ_SECONDS) -max_len=4096 -dict=../tests/fuzz/index.dict \
	  corpus-index ../tests/fuzz/seeds/index
	cd build-fuzz && ./gguf_fuzz -max_total_time=$(FUZZ_SECONDS) -max_len=4096 -dict=../tests/fuzz/gguf.dict \
	  corpus-gguf ../tests/fuzz/seeds/gguf
	cd build-fuzz && ./tokenizer_json_fuzz -max_total_time=$(FUZZ_SECONDS) -max_len=4096 -dict=../tests/fuzz/tokenizer_json.dict \
	  corpus-tokenizer_json ../tests/fuzz/seeds/tokenizer_json

clean:
	rm -rf $(BUILD) build-asan
