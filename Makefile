# The two commands of the README: `make run` and `make test`. Both install what is missing first.
BUILD ?= build
JOBS ?= 2
MODEL ?= models/mini
PROMPT ?= The quick brown fox
N ?= 32

.PHONY: all deps test-deps build run test asan fuzz clean $(foreach t,$(FUZZ_TARGETS),fuzz-run-$(t))

all: build

deps:
	@bash scripts/install-deps.sh

# What only the tests need on top (headless Chromium for the web page's browser test).
test-deps:
	@bash scripts/install-deps.sh --test

$(BUILD)/CMakeCache.txt:
	cmake -S . -B $(BUILD) -DCMAKE_BUILD_TYPE=Release

build: deps $(BUILD)/CMakeCache.txt
	cmake --build $(BUILD) -j$(JOBS)

$(MODEL)/config.json: | build
	$(BUILD)/moex gen-model --preset mini --seed 1 --out $(MODEL)

run: build $(MODEL)/config.json
	$(BUILD)/moex generate --model $(MODEL) --prompt "$(PROMPT)" -n $(N)

# MOEX_COMM_TUNING=none: a table that `moex tune-comm` left in ~/.cache/moex must not change what tests run.
# The PyTorch reference tests (each a python and a moex process, not timing-sensitive) run $(JOBS) at a time;
# the rest (MPI ranks, timeouts, servers) one at a time. Both halves run; either failing fails the target.
test: test-deps build
	@cd $(BUILD) || exit 1; export MOEX_COMM_TUNING=none; \
	  ctest --output-on-failure -j$(JOBS) -L reference; ref=$$?; \
	  ctest --output-on-failure -j1 -LE reference; rest=$$?; \
	  [ $$ref -eq 0 ] && [ $$rest -eq 0 ] || { echo "make test: failures above (reference: $$ref, others: $$rest)"; exit 1; }

# Unit and bad-input tests once more under AddressSanitizer + UndefinedBehaviorSanitizer (CI runs this too).
# A unity build (files compiled 8 to a translation unit): CI builds this tree from scratch, and the shared
# templates (json, GoogleTest) compile once per batch, not per file (docs/DESIGN.md section 6).
asan: deps
	cmake -S . -B build-asan -DCMAKE_BUILD_TYPE=Debug "-DCMAKE_CXX_FLAGS_DEBUG=-O1 -g1" -DMOEX_SANITIZE=ON \
	  -DCMAKE_UNITY_BUILD=ON
	cmake --build build-asan -j$(JOBS) --target moex_unit_tests moex
	cd build-asan && MOEX_COMM_TUNING=none ctest --output-on-failure -L 'unit|cli'

# libFuzzer (clang from Debian) on the parsers of untrusted files: safetensors headers, config.json,
# model.safetensors.index.json, GGUF files and tokenizer.json. Each runs FUZZ_SECONDS from its seeds (tests/fuzz/seeds/<name>)
# plus the corpus it grew before (build-fuzz/corpus-<name>); a crash leaves its input in build-fuzz/ and fails the target.
# Each source compiles once into build-fuzz/obj (several targets share config.cc, gguf.cc, ...), $(JOBS) at a time.
FUZZ_SECONDS ?= 30
FUZZ_TARGETS = safetensors config index gguf tokenizer_json
FUZZ_CXX = clang++ -std=c++20 -g -O1 -fsanitize=address,undefined -fno-sanitize-recover=undefined -Isrc
FUZZ_BASE = src/moex/base/error.cc src/moex/base/small_file.cc
FUZZ_CONFIG = src/moex/model/config.cc src/moex/model/quantization.cc
# WeightStore hands a .gguf path to the GGUF loader, so the safetensors reader links the GGUF sources too.
FUZZ_SRC_safetensors = src/moex/model/safetensors.cc src/moex/model/safetensors_index.cc src/moex/base/dtype.cc \
  src/moex/base/tensor.cc src/moex/base/mapped_file.cc src/moex/model/gguf.cc src/moex/model/gguf_checkpoint.cc \
  $(FUZZ_CONFIG) src/moex/base/system_memory.cc
FUZZ_SRC_config = $(FUZZ_CONFIG)
FUZZ_SRC_index = src/moex/model/safetensors_index.cc
FUZZ_SRC_gguf = src/moex/model/gguf.cc src/moex/model/gguf_checkpoint.cc $(FUZZ_CONFIG) src/moex/base/dtype.cc \
  src/moex/base/mapped_file.cc src/moex/base/system_memory.cc
FUZZ_SRC_tokenizer_json = src/moex/text/tokenizer_json.cc
FUZZ_LIBS_tokenizer_json = -lpcre2-8 -lutf8proc
FUZZ_OPTS_safetensors =
FUZZ_OPTS_config = -dict=../tests/fuzz/config.dict
FUZZ_OPTS_index = -dict=../tests/fuzz/index.dict
FUZZ_OPTS_gguf = -dict=../tests/fuzz/gguf.dict
FUZZ_OPTS_tokenizer_json = -dict=../tests/fuzz/tokenizer_json.dict
fuzz_obj = $(patsubst %.cc,build-fuzz/obj/%.o,$(1))

build-fuzz/obj/%.o: %.cc
	@mkdir -p $(dir $@)
	$(FUZZ_CXX) -fsanitize=fuzzer-no-link -MMD -MP -c $< -o $@
-include $(shell find build-fuzz/obj -name '*.d' 2>/dev/null)

define fuzz_target
build-fuzz/$(1)_fuzz: $(call fuzz_obj,tests/fuzz/$(1)_fuzz.cc $(FUZZ_SRC_$(1)) $(FUZZ_BASE))
	$(FUZZ_CXX) -fsanitize=fuzzer $$^ $(FUZZ_LIBS_$(1)) -o $$@
endef
$(foreach t,$(FUZZ_TARGETS),$(eval $(call fuzz_target,$(t))))

define fuzz_run
fuzz-run-$(1): build-fuzz/$(1)_fuzz
	mkdir -p build-fuzz/corpus-$(1)
	cd build-fuzz && ./$(1)_fuzz -max_total_time=$(FUZZ_SECONDS) -max_len=4096 $(FUZZ_OPTS_$(1)) corpus-$(1) \
	  ../tests/fuzz/seeds/$(1)
endef
$(foreach t,$(FUZZ_TARGETS),$(eval $(call fuzz_run,$(t))))

# The targets build, then run, $(JOBS) at a time (a fuzzer is one process on one core).
fuzz: deps
	$(MAKE) -j$(JOBS) $(foreach t,$(FUZZ_TARGETS),build-fuzz/$(t)_fuzz)
	$(MAKE) -j$(JOBS) --output-sync=target $(foreach t,$(FUZZ_TARGETS),fuzz-run-$(t))

clean:
	rm -rf $(BUILD) build-asan
