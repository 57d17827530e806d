"""TRL's ``vllm_mode: server``: rollouts from a vLLM server started apart from training, spoken to over HTTP.

The server is vLLM's own OpenAI-compatible one with its development endpoints on (``VLLM_SERVER_DEV_MODE=1``): what
``trl vllm-serve`` runs since TRL 1.16 (``vllm serve`` with ``--logprobs-mode processed_logprobs`` and an NCCL
weight-transfer engine), so a server started for TRL serves lit_align as it is. ``ServerEngine`` waits for the
server's ``/health`` (up to ``vllm_server_timeout``), samples through ``/v1/completions`` (token ids in, token ids and
the sampled tokens' log-probs out; one request per prompt, each with its own seed as under ``colocate``) and, before a
generation, pushes the policy's weights when their version changed since its last push, then resets the server's
prefix cache and has it report the version (``/weight_info``).

Weights travel one of two ways, picked per server:

- ``nccl``, when the policy is on a GPU and the server has a weight-transfer engine (``trl vllm-serve``'s): vLLM's
  NCCL weight transfer, the trainer joining the server's workers as rank 0 of a group on ``vllm_group_port``
  (``/init_weight_transfer_engine``, then per push ``/start_weight_update``, ``/update_weights`` beside the
  broadcasts, ``/finish_weight_update``). NCCL needs a GPU on both sides.
- ``file``, everywhere else (a CPU trainer or server): one safetensors file in a directory under the trainer's
  temporary directory, which the server reloads in place (``/collective_rpc`` ``reload_weights`` with its
  ``weights_path``). The server must read that directory: the same machine, or ``TMPDIR`` on a shared file system.
  A head tied to the embedding is written as ``lm_head.weight`` too, so that a CPU server prepares its head again.

Left out: several trainer ranks on one server (TRL pools the ranks' prompts on rank 0; here each rank would push);
a server with several workers (``tensor_parallel_size`` or ``data_parallel_size`` > 1) over the ``file`` path.
"""

from __future__ import annotations

import json
import shutil
import tempfile
import time
import urllib.error
import urllib.parse
import urllib.request
import weakref
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from lit_align.errors import LitAlignError
from lit_align.generation.weights import policy_weights

REQUEST_TIMEOUT = 3600.0  # seconds one request may take (a generation of long completions, a push of a large model)
MAX_CONCURRENT_REQUESTS = 32  # one request per prompt; this many in flight


@dataclass(frozen=True)
class ServerSettings:
    """Where the server is and how long to wait for it (TRL's ``vllm_server_*`` and ``vllm_group_port``)."""

    base_url: str
    timeout: float = 240.0
    group_port: int = 51216

    @classmethod
    def from_options(cls, base_url: str | None, host: str, port: int, timeout: float, group_port: int):
        """TRL's rule: ``base_url`` when given, else ``http://host:port``."""
        url = base_url.rstrip("/") if base_url else f"http://{host}:{port}"
        return cls(url, timeout, group_port)


class ServerError(LitAlignError):
    """The server refused a request or could not be reached (its answer in one line)."""


class ServerClient:
    """The HTTP requests lit_align makes to a vLLM server (JSON in, JSON out)."""

    def __init__(self, base_url: str):
        self.base_url = base_url

    def request(self, path: str, body: dict | None = None, query: dict | None = None,
                timeout: float = REQUEST_TIMEOUT) -> Any:
        """GET ``path`` (``body`` None) or POST ``body`` as JSON; the decoded answer (None when empty)."""
        url = self.base_url + path + (f"?{urllib.parse.urlencode(query)}" if query else "")
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(url, data, {"Content-Type": "application/json"} if data else {})
        try:
            with urllib.request.urlopen(req, timeout=timeout) as response:
                text = response.read()
        except urllib.error.HTTPError as exc:
            detail = " ".join(exc.read().decode(errors="replace").split())[:400]
            raise ServerError(f"model.vllm_mode 'server': the vLLM server at {self.base_url} answered {path} with "
                              f"{exc.code}: {detail}") from None
        except (urllib.error.URLError, OSError) as exc:
            raise ServerError(f"model.vllm_mode 'server': no answer from the vLLM server at {self.base_url} to {path} "
                              f"({getattr(exc, 'reason', exc)})") from None
        return json.loads(text) if text.strip() else None

    def wait_until_healthy(self, timeout: float, interval: float = 1.0) -> None:
        """Return once ``/health`` answers, or raise after ``timeout`` seconds."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                self.request("/health", timeout=max(1.0, min(10.0, timeout)))
                return
            except ServerError:
                if time.monotonic() >= deadline:
                    raise ServerError(
                        f"model.vllm_mode 'server': no vLLM server answered at {self.base_url}/health within "
                        f"{timeout:g} s (model.vllm_server_timeout); start one first (docs/grpo.md, `engine: vllm`), "
                        "or point model.vllm_server_base_url / vllm_server_host / vllm_server_port at it") from None
            time.sleep(interval)


def server_weights(weights: Iterable[tuple[str, torch.Tensor]], tied_head: bool) -> dict[str, torch.Tensor]:
    """The checkpoint-format weights to write, on the CPU; a tied head also as ``lm_head.weight`` (see the module)."""
    tensors = {name: tensor.detach().to("cpu").contiguous() for name, tensor in weights}
    if tied_head and "lm_head.weight" not in tensors and "model.embed_tokens.weight" in tensors:
        tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"].clone()  # safetensors refuses shared ones
    return tensors


class FilePush:
    """Weights through a file the server reloads in place (any device)."""

    name = "file"

    def __init__(self, client: ServerClient):
        self.client = client
        self.directory = Path(tempfile.mkdtemp(prefix="lit_align_vllm_weights_"))
        weakref.finalize(self, shutil.rmtree, str(self.directory), True)

    def push(self, weights: dict[str, torch.Tensor], version: str) -> None:
        from safetensors.torch import save_file

        save_file(weights, str(self.directory / "model.safetensors"))
        self.client.request("/collective_rpc", {"method": "reload_weights",
                                                "kwargs": {"weights_path": str(self.directory)}})
        self.client.request("/update_weight_version", {"new_version": version})


class NCCLPush:
    """Weights through vLLM's NCCL weight transfer (the policy and the server on GPUs)."""

    name = "nccl"

    def __init__(self, client: ServerClient, group_port: int, device: torch.device):
        from vllm.distributed.weight_transfer.nccl_common import (NCCLWeightTransferInitInfo, trainer_init,
                                                                   worker_init_payload)
        from vllm.utils.network_utils import get_ip

        self.client = client
        workers = client.request("/get_world_size")["world_size"]
        host = urllib.parse.urlparse(client.base_url).hostname
        address = "127.0.0.1" if host in ("localhost", "127.0.0.1") else get_ip()
        info = NCCLWeightTransferInitInfo(master_address=address, master_port=group_port, rank_offset=1,
                                          world_size=workers + 1)
        if device.index is not None:
            torch.cuda.set_device(device)
        # the server's workers wait in the rendezvous while answering: the request runs beside the trainer's side
        with ThreadPoolExecutor(max_workers=1) as pool:
            answer = pool.submit(client.request, "/init_weight_transfer_engine",
                                 {"init_info": worker_init_payload(info)})
            self.group = trainer_init({"master_address": address, "master_port": group_port,
                                       "world_size": workers + 1})
            answer.result()

    def push(self, weights: dict[str, torch.Tensor], version: str) -> None:
        names = list(weights)
        update = {"names": names, "dtype_names": [str(weights[n].dtype).removeprefix("torch.") for n in names],
                  "shapes": [list(weights[n].shape) for n in names]}
        self.client.request("/start_weight_update", {})
        with ThreadPoolExecutor(max_workers=1) as pool:  # the workers receive while the request is answered
            answer = pool.submit(self.client.request, "/update_weights", {"update_info": update})
            stream = torch.cuda.current_stream()
            for name in names:
                self.group.broadcast(weights[name].contiguous(), src=0, stream=stream)
            answer.result()
        self.client.request("/finish_weight_update", {"weight_version": version})


class ServerEngine:
    """A vLLM server, and which policy weights it holds (``pushes`` counts the pushes); ``ColocatedEngine``'s
    interface."""

    def __init__(self, settings: ServerSettings):
        self.settings = settings
        self.client = ServerClient(settings.base_url)
        self.client.wait_until_healthy(settings.timeout)
        self.model_name = self.client.request("/v1/models")["data"][0]["id"]
        self.config = self.server_config()
        self.pushes = 0
        self.transfer: FilePush | NCCLPush | None = None
        self._pushed: tuple[weakref.ref, int] | None = None  # (policy, weights_version) of the last push

    def server_config(self) -> dict:
        """The server's resolved configuration (``/server_info``), checked for what lit_align needs of it."""
        try:
            config = self.client.request("/server_info", query={"config_format": "json"})["vllm_config"]
        except ServerError as exc:
            if " 404:" not in str(exc):
                raise
            raise LitAlignError(f"model.vllm_mode 'server': the vLLM server at {self.settings.base_url} has no "
                                "development endpoints, which lit_align pushes the weights through: restart it with "
                                "VLLM_SERVER_DEV_MODE=1 in its environment (trl vllm-serve sets it)") from None
        mode = config["model_config"].get("logprobs_mode")
        if mode != "processed_logprobs":
            raise LitAlignError(f"model.vllm_mode 'server': the vLLM server at {self.settings.base_url} returns "
                                f"{mode!r} log-probs; the trainer's are the sampled distribution's: restart it with "
                                "--logprobs-mode processed_logprobs (trl vllm-serve sets it)")
        return config

    def transfer_for(self, device: torch.device) -> FilePush | NCCLPush:
        """``nccl`` for a policy on a GPU and a server with a weight-transfer engine, else ``file``."""
        transfer = self.config.get("weight_transfer_config") or {}
        if device.type == "cuda" and transfer.get("backend") == "nccl":
            return NCCLPush(self.client, self.settings.group_port, device)
        return FilePush(self.client)

    def sync(self, model: torch.nn.Module, version: int | None) -> None:
        """Push ``model``'s weights unless the server holds them already (same model, same ``version``; None: push).
        The first push of a run always goes: the server may hold another run's weights."""
        if version is not None and self._pushed is not None and self._pushed[0]() is model \
                and self._pushed[1] == version:
            return
        network = model.get_base_model() if hasattr(model, "get_base_model") else model
        if self.transfer is None:
            self.transfer = self.transfer_for(network.device)
        tied = bool(getattr(network.config, "tie_word_embeddings", False))
        weights = server_weights(policy_weights(model), tied) if self.transfer.name == "file" \
            else dict(policy_weights(model))
        self.transfer.push(weights, str(version))
        self.client.request("/reset_prefix_cache", {})  # cached prompt KV came from the old weights
        self._pushed = (weakref.ref(model), version)
        self.pushes += 1

    def weight_version(self) -> str:
        """The weights' version the server reports (the optimizer step of the last push)."""
        return self.client.request("/weight_info")["weight_version"]

    def generate(self, prompts: list[list[int]], params: list[dict]) -> list[list[tuple[list[int], list | None]]]:
        """Per prompt its samples, each ``(token ids, log-probs of the sampled tokens or None)``."""
        def one(prompt: list[int], kwargs: dict) -> list[tuple[list[int], list | None]]:
            body = {"model": self.model_name, "prompt": prompt, "return_token_ids": True,
                    "return_tokens_as_token_ids": True, **kwargs}
            body.pop("detokenize", None)
            choices = sorted(self.client.request("/v1/completions", body)["choices"], key=lambda c: c["index"])
            return [(c["token_ids"], None if c.get("logprobs") is None else c["logprobs"]["token_logprobs"])
                    for c in choices]

        with ThreadPoolExecutor(max_workers=min(MAX_CONCURRENT_REQUESTS, max(1, len(prompts)))) as pool:
            return list(pool.map(one, prompts, params))


_SERVERS: dict[ServerSettings, ServerEngine] = {}  # this process's servers: the sampling and greedy engines share one


def server_engine(settings: ServerSettings) -> ServerEngine:
    if settings not in _SERVERS:
        _SERVERS[settings] = ServerEngine(settings)
    return _SERVERS[settings]
