# train_fp8: LLaMA-2 pretraining in FP8 with plain CUDA C++.
#   make                    build train_fp8 and test_fp8 (PRECISION=FP8, Hopper)
#   make PRECISION=BF16     the BF16 baseline build (same program, BF16 GEMMs, FP32 moments)
#   make GPU_ARCH=sm_89     another GPU (FP8 GEMMs need sm_89 or newer)
#   make test               build and run the numerics test
#   make sanitize           the GPU tests under compute-sanitizer: memcheck, and racecheck for shared-memory kernels
#   make bench              GEMM and cast-kernel throughput tables (needs a GPU)
#   make results            every figure of the README's Results, ours and PyTorch's, measured in one run on this GPU into
#                           results/<GPU>.md (scripts/results.sh --help; RESULTS_FLAGS adds options)
#   make data               prepare the default corpus (King James Bible, bytes) under data/
#   make train              build, prepare data, train the default preset into out/default (refused if it holds a run
#                           already: the message gives the command that continues it)
#   make study              the recipe lab: seeds x configurations of both builds on one GPU (scripts/study.sh, README "Recipe lab";
#                           STUDY_FLAGS="--preset 1b": BF16 against FP8 at 1.1B's shape, time to quality)
#   make soak               kill-and-resume soak: a run killed (SIGKILL) and resumed 5 times ends as an uninterrupted one (scripts/soak.sh)
#   make mutants            mutation testing: each bug of mutants.txt built and tested in scratch-mutants/ (scripts/mutate.sh --help)
#   make clean
PRECISION ?= FP8
GPU_ARCH  ?= sm_90a
NVCC      ?= nvcc

ifeq ($(filter $(PRECISION),FP8 BF16),)
$(error PRECISION must be FP8 or BF16, not '$(PRECISION)')
endif

# ---- find the CUDA toolkit, cuBLASLt and NCCL; say clearly what is missing (not for make clean, which needs none)
ifneq ($(filter-out clean,$(or $(MAKECMDGOALS),all)),)
NVCC_PATH := $(shell command -v $(NVCC) 2>/dev/null)
ifeq ($(NVCC_PATH),)
$(error $(NVCC) not found on PATH. Install the CUDA toolkit (12.x or 13.x, https://developer.nvidia.com/cuda-downloads) and add its bin/ to PATH, or run make NVCC=/path/to/nvcc)
endif
CUDA_HOME ?= $(patsubst %/bin/,%,$(dir $(realpath $(NVCC_PATH))))
first_file = $(firstword $(wildcard $(1)))
CUBLASLT_LIB := $(call first_file,$(CUDA_HOME)/lib64/libcublasLt.so $(CUDA_HOME)/lib/libcublasLt.so $(CUDA_HOME)/targets/x86_64-linux/lib/libcublasLt.so /usr/lib/x86_64-linux-gnu/libcublasLt.so)
ifeq ($(CUBLASLT_LIB),)
$(error libcublasLt.so not found under $(CUDA_HOME). It ships with the CUDA toolkit (package libcublas-dev / cuda-libraries-dev); set CUDA_HOME to the toolkit's folder)
endif
NCCL_HOME ?=
NCCL_H   := $(call first_file,$(if $(NCCL_HOME),$(NCCL_HOME)/include/nccl.h) /usr/include/nccl.h /usr/local/include/nccl.h $(CUDA_HOME)/include/nccl.h)
NCCL_LIB := $(call first_file,$(if $(NCCL_HOME),$(NCCL_HOME)/lib/libnccl.so) /usr/lib/x86_64-linux-gnu/libnccl.so $(CUDA_HOME)/lib/libnccl.so $(CUDA_HOME)/lib64/libnccl.so /usr/local/lib/libnccl.so)
ifeq ($(NCCL_H)$(NCCL_LIB),)
$(error NCCL not found (nccl.h and libnccl.so). Install libnccl-dev (apt-get install libnccl2 libnccl-dev) or set NCCL_HOME to a folder with include/nccl.h and lib/libnccl.so)
endif
ifeq ($(NCCL_H),)
$(error nccl.h not found (libnccl.so is at $(NCCL_LIB)). Install libnccl-dev or set NCCL_HOME)
endif
ifeq ($(NCCL_LIB),)
$(error libnccl.so not found (nccl.h is at $(NCCL_H)). Install libnccl-dev or set NCCL_HOME)
endif
endif

ARCH_NUM := $(patsubst sm_%,%,$(GPU_ARCH))
ifeq ($(shell echo '$(GPU_ARCH)' | grep -xE 'sm_[0-9]+a?'),)
$(error GPU_ARCH must be sm_NN (nvcc's name of a GPU architecture, e.g. sm_90a for the H100/H200, sm_89 for the L40S), not '$(GPU_ARCH)')
endif
# The FP8 GEMMs (cuBLASLt's E4M3/E5M2 matmuls) need Ada or Hopper; the BF16 build runs on Ampere (sm_80) too.
ifeq ($(PRECISION),FP8)
ifeq ($(shell test $(subst a,,$(ARCH_NUM)) -ge 89 && echo yes),)
$(error GPU_ARCH=$(GPU_ARCH) with PRECISION=FP8: the FP8 matmuls need sm_89 or newer (Ada, Hopper: sm_90a); for an older GPU build the BF16 baseline: make PRECISION=BF16 GPU_ARCH=$(GPU_ARCH))
endif
endif
NVCCFLAGS := -O3 -std=c++17 -lineinfo --expt-relaxed-constexpr \
	-gencode arch=compute_$(ARCH_NUM),code=$(GPU_ARCH) \
	-Xcompiler -Wall,-Wextra,-Wno-unused-parameter -Werror all-warnings \
	-DPRECISION_$(PRECISION) -I$(dir $(NCCL_H))
# The Hopper attention kernels (wgmma, TMA) need the arch-specific sm_90a target.
ifeq ($(GPU_ARCH),sm_90a)
NVCCFLAGS += -DATTENTION_HOPPER
endif
LDFLAGS := -L$(dir $(CUBLASLT_LIB)) -L$(dir $(NCCL_LIB)) -Xlinker -rpath,$(dir $(NCCL_LIB)) -lcublasLt -lnccl

HEADERS := common.cuh fp8_kernels.cuh llama2.cuh attention.cuh adamw_fp8.cuh dataloader.h tokenizer.h checkpoint.h
# A change of PRECISION or GPU_ARCH must rebuild: the stamp holds the last build's settings, and is rewritten (by its
# recipe, so that make -n only shows it) when they differ.
STAMP := .build-settings
BUILD_SETTINGS := $(PRECISION) $(GPU_ARCH)
ifneq ($(shell cat $(STAMP) 2>/dev/null),$(BUILD_SETTINGS))
.PHONY: $(STAMP)
endif
$(STAMP):
	echo "$(BUILD_SETTINGS)" > $@

all: train_fp8 test_fp8

train_fp8: train_fp8.cu $(HEADERS) $(STAMP) Makefile
	$(NVCC) $(NVCCFLAGS) -o $@ $< $(LDFLAGS)

test_fp8: test_fp8.cu train_fp8.cu $(HEADERS) $(STAMP) Makefile
	$(NVCC) $(NVCCFLAGS) -o $@ $< $(LDFLAGS)

# The BF16 build as a second binary beside train_fp8 (whatever PRECISION is), for scripts/study.sh to run both builds at once.
train_fp8_bf16: train_fp8.cu $(HEADERS) $(STAMP) Makefile
	$(NVCC) $(subst -DPRECISION_$(PRECISION),-DPRECISION_BF16,$(NVCCFLAGS)) -o $@ $< $(LDFLAGS)

# (the tests run ./train_fp8 too: a resume refused by the program itself); scripts/study.sh's table maker on fixed logs,
# scripts/plot_fp8_stats.py on synthetic CSVs and scripts/tokenizer.py on small texts first (host only; they report SKIP
# without numpy and matplotlib, or sentencepiece)
test: test_fp8 train_fp8
	python3 scripts/results.py test
	python3 scripts/results.py check README.md
	scripts/study.sh test
	python3 scripts/plot_fp8_stats.py test
	python3 scripts/tokenizer.py test
	./test_fp8

# compute-sanitizer (CUDA toolkit) over the tests, on a GPU: memcheck over every test (out-of-bounds and misaligned
# accesses, in our kernels and in the libraries'), racecheck over the tests of the kernels that use shared memory
# (attention, the embedding backward, RMSNorm, cross-entropy, amax and the FP8 casts, block scaling's casts, AdamW's
# reductions, the loss mean).
SANITIZER ?= $(firstword $(wildcard $(CUDA_HOME)/bin/compute-sanitizer $(CUDA_HOME)/compute-sanitizer/compute-sanitizer) \
                         $(shell command -v compute-sanitizer 2>/dev/null))
# API errors are not reported: NCCL's communicator set-up probes its kernels with cudaFuncGetAttributes and handles
# the "no kernel image" answers itself (memcheck would count them as errors), and every call of ours is checked
# by cudaCheck anyway. TESTS (default: all) narrows memcheck to the tests whose names contain one of its words.
TESTS ?=
RACECHECK_TESTS ?= attention embedding rmsnorm cross_entropy fp8_amax fp8_quantize fp8_cast_transpose adamw model_matches_reference fp8_block_cast
sanitize: test_fp8 train_fp8
	@test -n "$(SANITIZER)" || { echo "compute-sanitizer not found next to nvcc ($(CUDA_HOME)/bin) or on PATH: it ships with the CUDA toolkit (package cuda-sanitizer-<version>); or run make sanitize SANITIZER=/path/to/compute-sanitizer"; exit 1; }
	$(SANITIZER) --tool memcheck --report-api-errors no --error-exitcode 1 ./test_fp8 $(TESTS)
	$(SANITIZER) --tool racecheck --error-exitcode 1 ./test_fp8 $(RACECHECK_TESTS)

data: train_fp8
	scripts/data.sh

# The default run: the default preset on the King James Bible in the tokens of an 8192-piece tokenizer trained on it,
# 200 steps (README "Data and tokenizers" says why; TRAIN_FLAGS adds or overrides flags). Into a folder that holds a run already,
# train_fp8 refuses to start and prints the command that resumes it (make train TRAIN_FLAGS="--resume out/default" does
# the same); remove the folder to start over.
TRAIN_FLAGS ?=
train: train_fp8 data
	./train_fp8 --out out/default --data data/kjv8192_train.bin --val-data data/kjv8192_val.bin --steps 200 --warmup 20 $(TRAIN_FLAGS)

bench: test_fp8
	./test_fp8 --bench

# make results builds what it runs itself (both precisions); RESULTS_FLAGS: e.g. "--reps 5" or "--only step,attention".
RESULTS_FLAGS ?=
results:
	scripts/results.sh $(RESULTS_FLAGS)

# The recipe lab (scripts/study.sh --help; STUDY_FLAGS adds flags, e.g. STUDY_FLAGS="--seeds 5 --only bf16,fp8"; BF16 against
# FP8 at 1.1B's shape, one run at a time, for the time to quality: STUDY_FLAGS="--preset 1b").
# make -j2 study builds the two binaries side by side.
STUDY_FLAGS ?=
study: train_fp8 train_fp8_bf16 data
	scripts/study.sh $(STUDY_FLAGS)

# The kill-and-resume soak (scripts/soak.sh --help): the default preset straight through, and again killed with SIGKILL at 5
# seeded moments (mid-step, mid-checkpoint) and resumed each time; the final checkpoints must be byte-identical and the
# logs equal but for their timing columns. Needs a GPU. SOAK_FLAGS adds flags (e.g. --seed 2 --kills 8).
SOAK_FLAGS ?=
soak: train_fp8 data
	scripts/soak.sh $(SOAK_FLAGS)

# Mutation testing: the tests must catch every mutant of mutants.txt, in each build it names (MUTATE_FLAGS adds
# options, e.g. MUTATE_FLAGS="--host-only" on a machine without a GPU, or "--jobs 8 --parallel 4" on a GPU machine).
MUTATE_FLAGS ?=
mutants:
	scripts/mutate.sh $(MUTATE_FLAGS)

.PHONY: all test sanitize bench results data train study soak mutants clean
clean:
	rm -f train_fp8 train_fp8_bf16 test_fp8 $(STAMP)
	rm -rf scratch-mutants
