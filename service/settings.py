"""One settings object for the service, built once at start-up and passed in (never read at import).

Sources, later ones winning: the defaults below (models from `models.spec.DEFAULT_SPECS`); the
application `args` of the Serve config (deploy/serve_config.yaml) or of `build_app(args)`; then
environment variables `TS_<FIELD>`, `__` between nesting levels, a value read as JSON when it parses
(e.g. `TS_DEPLOYMENTS__ENCODER__BATCHING__MAX_WAIT_MS=2`), else as a string. `deployments` maps a
deployment name to what it serves: given in `args`, it is the whole set, and a deployment without
`model` serves `DEFAULT_SPECS[<its name>]`; its kind follows from the model's tasks (`ModelSpec.kind`).
Each concern has one torch-free type, validated here as it is: `ModelSpec`, `BatchLimits`
(service/replica/config.py), `EngineConfig` (service/engine/config.py).
"""

from __future__ import annotations

import dataclasses
import json
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    SecretStr,
    ValidationError,
    field_validator,
    model_validator,
)

from models.spec import DEFAULT_SPECS, ModelSpec

from .engine.config import EngineConfig, TranslationConfig
from .replica.config import BatchLimits

ENV_PREFIX = "TS_"
DTYPES = ("auto", "auto-bf16", "float32", "bfloat16", "float16")
_DEVICE = re.compile(r"^(auto|cpu|mps|cuda(:\d+)?)$")
# What `make serve` runs when the config names no deployments.
DEFAULT_DEPLOYMENTS = ("encoder", "translator", "generator")


class _Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class RoutingSettings(_Frozen):
    """How the ingress picks a generator replica for a request (service/fleet/router.py): by the
    prefix of its prompt (a conversation goes where its history is cached, while load stays balanced;
    a new one where it hashes), or Serve's power of two choices."""

    policy: Literal["prefix", "power_of_two"] = "prefix"
    chunk_chars: int = Field(128, ge=16)  # a prompt's prefix is matched in chunks of this many characters
    min_match_chars: int = Field(256, ge=0)  # shorter matches are no affinity (a shared "You are" is no history)
    # a replica with this many more ongoing requests than the least loaded one gets no affinity requests
    max_imbalance: int = Field(8, ge=0)
    session_affinity: bool = True  # `x-session-id` header or the OpenAI `user` field: stick to one replica
    max_chunks: int = Field(200_000, ge=1)  # prefix chunks remembered per router (least recently used go)
    key_chars: int = Field(1024, ge=1)  # a prompt (not a chat) is hashed to a replica by its first characters


class DeploymentSettings(_Frozen):
    """One model deployment: what it serves and how it scales."""

    model: ModelSpec | None = None  # None: DEFAULT_SPECS[<deployment name>]
    batching: BatchLimits = BatchLimits()  # encoder and translator deployments (service/replica/batcher.py)
    engine: EngineConfig = EngineConfig()  # generator deployments (service/engine/)
    translation: TranslationConfig = TranslationConfig()  # translator deployments (service/engine/translation.py)
    num_replicas: int = Field(1, ge=1)
    autoscaling_config: dict[str, Any] | None = None  # Ray Serve's; replaces num_replicas when set
    routing: RoutingSettings | None = None  # generators; None: prefix-aware for generators, else power of two
    # a stopping replica (downscale, update, shutdown) finishes what it runs for at most this long
    drain_grace_s: float = Field(60.0, gt=0)
    num_cpus: float = Field(1.0, ge=0)
    num_gpus: float | None = Field(None, ge=0)  # None: 1 when the device may be CUDA and Ray has a GPU
    device: str | None = None  # None: Settings.device
    dtype: str | None = None  # None: Settings.dtype
    torch_threads: int | None = Field(None, ge=1)  # None: max(1, num_cpus)
    # glibc malloc_trim after a batch or engine step at most this often (service/replica/heap.py); 0: never
    heap_trim_interval_s: float = Field(1.0, ge=0)
    max_ongoing_requests: int = Field(256, ge=1)  # requests in one replica at once (they batch there)
    max_queued_requests: int = Field(1024, ge=1)  # requests each caller queues for this deployment
    # 1: at most one replica per node, so losing a node leaves the model served (with num_replicas >= 2)
    max_replicas_per_node: int | None = Field(None, ge=1)
    startup_gate: str | None = None  # tests only: the replica waits for this file before loading

    @model_validator(mode="after")
    def _check(self) -> DeploymentSettings:
        _check_device(self.device, self.dtype)
        if self.autoscaling_config is not None:
            _check_autoscaling(self.autoscaling_config)
        if self.routing is not None and self.routing.policy == "prefix" and self.model is not None \
                and self.model.kind != "generator":
            raise ValueError(f"routing.policy prefix is for generator deployments; this one serves "
                             f"{list(self.model.tasks)} (use power_of_two)")
        return self

    def routing_policy(self) -> RoutingSettings:
        """The routing in effect: the configured one, else prefix-aware for generators."""
        if self.routing is not None:
            return self.routing
        generator = self.model is not None and self.model.kind == "generator"
        return RoutingSettings(policy="prefix" if generator else "power_of_two")

    def threads(self) -> int:
        return self.torch_threads or max(1, int(self.num_cpus))


class IngressSettings(_Frozen):
    """The FastAPI ingress deployment: it validates, routes and converts, so it needs little CPU."""

    num_replicas: int = Field(1, ge=1)
    num_cpus: float = Field(0.0, ge=0)
    max_ongoing_requests: int = Field(1024, ge=1)
    max_queued_requests: int = Field(4096, ge=1)  # at each proxy; past it the proxy answers 503
    # 1 with num_replicas = nodes: an ingress on every node, so each node's /metrics is its own (README)
    max_replicas_per_node: int | None = Field(None, ge=1)


class TenantSettings(_Frozen):
    """A tenant: a group of API keys sharing quotas (service/http/quotas.py), each a token bucket of
    this ingress's share (the rates divided by the ingress's num_replicas). None: no limit."""

    keys: tuple[SecretStr, ...] = Field(min_length=1)
    requests_per_s: float | None = Field(None, gt=0)
    request_burst: int | None = Field(None, ge=1)  # requests at once after a quiet spell; default max(1, rate)
    tokens_per_min: int | None = Field(None, ge=1)  # prompt + output tokens of generations and embeddings
    share_prefix_cache: bool = False  # false: its requests reuse only its own cached prefixes
    # its requests' priority (lower is sooner, vLLM's): every task's queue; for generations the default and
    # the soonest a request may ask for
    priority: int = Field(0, ge=-1000, le=1000)

    @field_validator("keys", mode="before")
    @classmethod
    def _split(cls, value: Any) -> Any:
        return tuple(k.strip() for k in value.split(",") if k.strip()) if isinstance(value, str) else value


class Settings(_Frozen):
    device: str = "auto"  # auto: cuda when the replica sees a GPU, else cpu
    dtype: str = "auto"  # auto: bfloat16 on cuda, float32 on cpu; auto-bf16: also bfloat16 on cpus that multiply it
    cache_dir: str | None = None  # pinned weights; None: models.zoo.default_cache_dir()
    request_timeout_s: float = Field(30.0, gt=0)  # deadline per request (504); X-Request-Timeout lowers it
    max_body_bytes: int = Field(1 << 20, ge=64)  # 413 past this
    body_timeout_s: float = Field(10.0, gt=0)  # a body not whole this long after its request began: 408
    max_inputs: int = Field(64, ge=1)  # texts per request
    # /v1/translate: characters per text when it is cut into sentences (service/common/documents.py)
    max_document_chars: int = Field(20_000, ge=1)
    retry_after_s: float = Field(1.0, gt=0)  # Retry-After on 503
    readiness_timeout_s: float = Field(2.0, gt=0)  # how long /readyz waits for each deployment
    # API keys (service/http/auth.py); none here nor in the file: no auth. TS_API_KEYS=key1,key2
    api_keys: tuple[SecretStr, ...] = ()
    api_keys_file: str | None = None  # one key per line, read by the ingress at start-up
    # with keys: /metrics needs one too (its counters tell whether a prompt is cached, and each tenant's
    # use: not for tenants to read); false opens it to scrapers without a key
    protect_metrics: bool = True
    protect_docs: bool = False  # with keys: /docs, /redoc and /openapi.json need one too
    # tenants: name -> their keys (valid API keys too) and quotas (service/http/quotas.py)
    tenants: dict[str, TenantSettings] = Field(default_factory=dict)
    cors_origins: tuple[str, ...] = ()  # origins browsers may call from ("*": any); empty: CORS off
    # POST /v1/load_lora_adapter and /v1/unload_lora_adapter (vLLM's): adapters from any directory this
    # machine reads, named at run time; off unless set (configured adapters and adapter_dir need neither)
    runtime_adapters: bool = False
    # logs and metrics (docs/observability.md)
    log_json: bool = True  # JSON log lines with the request id; false: plain text
    access_log: bool = False  # one log line per request (ingress and Serve's proxy and replicas)
    metrics_dir: str | None = None  # per-node directory of the replicas' metric files; None: fresh per app
    ingress: IngressSettings = IngressSettings()
    deployments: dict[str, DeploymentSettings] = Field(
        default_factory=lambda: {name: DeploymentSettings(model=DEFAULT_SPECS[name]) for name in DEFAULT_DEPLOYMENTS})

    @field_validator("api_keys", "cors_origins", mode="before")
    @classmethod
    def _split_commas(cls, value: Any) -> Any:
        """A comma-separated string (as in TS_API_KEYS=k1,k2) is a list; a lone number (TS_* values
        parse as JSON) is its digits."""
        if isinstance(value, int) and not isinstance(value, bool):
            value = str(value)
        return [part.strip() for part in value.split(",") if part.strip()] if isinstance(value, str) else value

    @model_validator(mode="before")
    @classmethod
    def _fill_default_models(cls, data: Any) -> Any:
        """A deployment without `model` serves the default model of the same name; a `model` without a
        `source` (serving options only, e.g. TS_DEPLOYMENTS__GENERATOR__MODEL__QUANTIZE=int8) changes
        those fields of that default model."""
        if not isinstance(data, dict) or not isinstance(data.get("deployments"), dict):
            return data
        filled: dict[str, Any] = {}
        for name, dep in data["deployments"].items():
            if isinstance(dep, DeploymentSettings) and dep.model is None and name in DEFAULT_SPECS:
                dep = dep.model_copy(update={"model": DEFAULT_SPECS[name]})
            elif isinstance(dep, dict) and dep.get("model") is None and name in DEFAULT_SPECS:
                dep = {**dep, "model": DEFAULT_SPECS[name]}
            elif (isinstance(dep, dict) and isinstance(dep.get("model"), dict) and "source" not in dep["model"]
                  and name in DEFAULT_SPECS):
                dep = {**dep, "model": {**dataclasses.asdict(DEFAULT_SPECS[name]), **dep["model"]}}
            filled[name] = dep
        return {**data, "deployments": filled}

    @model_validator(mode="after")
    def _check(self) -> Settings:
        _check_device(self.device, self.dtype)
        if not self.deployments:
            raise ValueError("no model deployments configured")
        seen: dict[tuple[str, str], str] = {}
        for name, dep in self.deployments.items():
            if not re.fullmatch(r"[A-Za-z0-9_-]+", name):
                raise ValueError(f"deployment name {name!r} may use only letters, digits, '_' and '-'")
            if dep.model is None:
                raise ValueError(f"deployment {name!r} needs a model (no default model has that name; "
                                 f"defaults: {sorted(DEFAULT_SPECS)})")
            for task in dep.model.tasks:
                other = seen.setdefault((task, dep.model.name), name)
                if other != name:
                    raise ValueError(f"deployments {other!r} and {name!r} both serve model "
                                     f"{dep.model.name!r} for {task!r}")
            if dep.model.kind != "generator" and dep.batching.max_queued < self.max_inputs:
                raise ValueError(f"deployment {name!r}: batching.max_queued ({dep.batching.max_queued}) "
                                 f"must be >= max_inputs ({self.max_inputs}), or a full request never fits")
        return self

    @classmethod
    def build(cls, args: Mapping[str, Any] | None, env: Mapping[str, str]) -> Settings:
        """Defaults < args < TS_* environment variables. Raises pydantic.ValidationError naming the field."""
        data = json.loads(json.dumps(dict(args or {})))  # a deep, plain copy
        data.setdefault("deployments", {name: {} for name in DEFAULT_DEPLOYMENTS})
        for key, raw in sorted(env.items()):
            if key.startswith(ENV_PREFIX) and len(key) > len(ENV_PREFIX):
                _set_path(data, key[len(ENV_PREFIX):].lower().split("__"), _env_value(raw))
        settings = cls.model_validate(data)
        if settings.cache_dir is None:  # resolved once, here (models.zoo reads its variable only there)
            from models.zoo import default_cache_dir

            settings = settings.model_copy(update={"cache_dir": str(default_cache_dir())})
        return settings

    def device_for(self, dep: DeploymentSettings) -> tuple[str, str]:
        return dep.device or self.device, dep.dtype or self.dtype

    def cache_path(self) -> Path:
        from models.zoo import default_cache_dir

        return Path(self.cache_dir).expanduser() if self.cache_dir else default_cache_dir()


def _check_device(device: str | None, dtype: str | None) -> None:
    if device is not None and not _DEVICE.match(device):
        raise ValueError(f"device must be auto, cpu, mps, cuda or cuda:N, got {device!r}")
    if dtype is not None and dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {DTYPES}, got {dtype!r}")


def _check_autoscaling(config: Mapping[str, Any]) -> None:
    """Ray Serve silently ignores unknown autoscaling keys, so a misspelt one would quietly keep the
    default (e.g. a 600 s downscale delay): name it here, then let Ray check the values."""
    from ray.serve.config import AutoscalingConfig

    known = AutoscalingConfig.model_fields
    unknown = sorted(set(config) - set(known))
    if unknown:
        raise ValueError(f"autoscaling_config: unknown keys {unknown}; Ray Serve knows {sorted(known)}")
    try:
        AutoscalingConfig(**config)
    except ValidationError as e:
        problems = "; ".join(": ".join([*map(str, err["loc"]), str(err["msg"]).removeprefix("Value error, ")])
                             for err in e.errors())
        raise ValueError(f"autoscaling_config {dict(config)}: {problems}") from None


def _env_value(raw: str) -> Any:
    try:
        return json.loads(raw)
    except json.JSONDecodeError:
        return raw


def _set_path(data: dict[str, Any], path: list[str], value: Any) -> None:
    for part in path[:-1]:
        node = data.get(part)
        if not isinstance(node, dict):
            node = data[part] = {}
        data = node
    data[path[-1]] = value
