"""`python -m service` (= `make serve`): a local Ray, the app from deploy/serve_config.yaml, HTTP on :8000.

    python -m service [--config deploy/serve_config.yaml] [--host 0.0.0.0] [--port 8000] [--front auto]

No cluster is needed: Ray starts in this process and stops with it (Ctrl-C or SIGTERM: the front
stops listening, the requests in flight, streams included, finish within the ingress's grace, the
longest `drain_grace_s` + 5 s, then Serve's replicas stop). The settings are built once, here, from
the config's application `args` and TS_* variables.

The front (service/front/): with nginx installed (the default `auto`), nginx listens on the port and
forwards to the ingress replicas' own ports, Serve's proxy (on a free 127.0.0.1 port) behind it as
the backup; `--front serve` (or TS_FRONT=serve) puts Serve's proxy on the port itself.
"""

from __future__ import annotations

import argparse
import logging
import math
import os
import shutil
import signal
import sys
import time
from collections.abc import Sequence
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import yaml

from models import zoo
from models.catalog import resolve_dir

from .front.config import Address
from .front.launch import CHOICES, INTERNAL_HOST, choose_front, serve_front
from .front.ports import free_port
from .ray_env import DRAIN, FRONT_DRAIN_S, use_fast_path
from .settings import Settings
from .telemetry.logs import configure_logging, serve_logging_config
from .telemetry.metrics import default_metrics_dir

log = logging.getLogger("service")
ROOT = Path(__file__).resolve().parent.parent
DEFAULT_CONFIG = ROOT / "deploy" / "serve_config.yaml"
OUR_APP = "service.app:build_app"


def missing_weights(settings: Settings) -> list[str]:
    """Problems with the weights each deployment needs, found before any replica starts."""
    problems = []
    for name, dep in settings.deployments.items():
        assert dep.model is not None
        for uri in (dep.model.source, dep.model.head):
            if uri is not None and uri.startswith("gguf:zoo:"):  # a pinned GGUF file (the generator's)
                try:
                    zoo.resolve(uri.removeprefix("gguf:zoo:"), settings.cache_path())
                except (zoo.WeightsMissingError, KeyError, ValueError) as e:
                    problems.append(f"{name} ({dep.model.name}): {uri}: {e}")
                continue
            if uri is None or uri.split(":", 1)[0] not in ("zoo", "builtin", "dir", "hf"):
                continue
            try:
                path = resolve_dir(uri, settings.cache_path())
                needed = path / ("head.json" if uri == dep.model.head else "config.json")
                if not needed.is_file():
                    raise FileNotFoundError(f"{needed} does not exist")
            except (zoo.WeightsMissingError, FileNotFoundError, KeyError, ValueError) as e:
                problems.append(f"{name} ({dep.model.name}): {uri}: {e}")
    return problems


def cpus_needed(settings: Settings) -> float:
    total = settings.ingress.num_cpus * settings.ingress.num_replicas
    for dep in settings.deployments.values():
        replicas = dep.num_replicas
        if dep.autoscaling_config is not None:
            replicas = int(dep.autoscaling_config.get("min_replicas", 1))
        total += dep.num_cpus * replicas
    return total


def _interrupt(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt


def _parse(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m service", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", type=Path, default=DEFAULT_CONFIG, help="a Serve config file")
    p.add_argument("--host", help="default: the config's http_options.host")
    p.add_argument("--port", type=int, help="default: the config's http_options.port")
    p.add_argument("--num-cpus", type=float, help="CPUs Ray may hand out (default: all, or what the config needs)")
    p.add_argument("--dashboard", action="store_true", help="also start the Ray dashboard")
    p.add_argument("--front", choices=CHOICES, default=os.environ.get("TS_FRONT", "auto"),
                   help="what listens on the port: nginx in front of the ingress replicas (auto: when installed) "
                        "or Serve's own proxy (default: $TS_FRONT, else auto)")
    return p.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = _parse(argv)
    configure_logging(json_logs=False)  # until the settings say otherwise
    config: dict[str, Any] = yaml.safe_load(args.config.read_text())
    apps = config.get("applications") or []
    if len(apps) != 1 or apps[0].get("import_path") != OUR_APP:
        log.error("%s: python -m service runs one application with import_path %s; use `serve run` "
                  "for anything else", args.config, OUR_APP)
        return 2
    app_config = apps[0]
    settings = Settings.build(app_config.get("args"), os.environ)
    configure_logging(settings.log_json)
    own_metrics_dir = settings.metrics_dir is None  # one node: this process removes it at the end
    if own_metrics_dir:
        settings = settings.model_copy(update={"metrics_dir": default_metrics_dir()})
    problems = missing_weights(settings)
    if problems:
        log.error("weights missing, nothing started:\n  %s\n`make weights` fetches the pinned ones; "
                  "builtin weights are produced by their training scripts (models/train/).", "\n  ".join(problems))
        return 1

    try:
        nginx = choose_front(args.front, os.environ)
    except ValueError as e:
        log.error("%s", e)
        return 2
    if nginx is not None:  # the front takes a stopping ingress replica out within a second (service/ray_env.py)
        os.environ.setdefault(DRAIN, FRONT_DRAIN_S)
    log.info("Ray Serve request path: %s (service/ray_env.py)", use_fast_path(os.environ))
    import ray
    from ray import serve

    from .app import build_app_from_settings, ingress_grace_s

    http = dict(config.get("http_options") or {})
    http["host"] = args.host or http.get("host", "0.0.0.0")
    http["port"] = args.port or http.get("port", 8000)
    listen = Address(http["host"], http["port"])
    if nginx is not None:  # Serve's own servers on loopback only, behind nginx
        http["host"], http["port"] = INTERNAL_HOST, free_port()
    num_cpus = args.num_cpus or max(float(os.cpu_count() or 1), cpus_needed(settings))
    pythonpath = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)
    ray.init(address="local", num_cpus=num_cpus, include_dashboard=args.dashboard,
             runtime_env={"env_vars": {"PYTHONPATH": pythonpath}})
    for sig in (signal.SIGINT, signal.SIGTERM):  # also when started with SIGINT ignored (a background job)
        signal.signal(sig, _interrupt)
    try:
        with ExitStack() as front:
            serve.start(http_options=http, proxy_location=config.get("proxy_location", "EveryNode"),
                        logging_config=serve_logging_config(settings.log_json, settings.access_log))  # the proxies
            prefix = app_config.get("route_prefix", "/")
            nginx_front = None
            if nginx is not None:
                nginx_front = front.enter_context(serve_front(
                    nginx, listen, Address(http["host"], http["port"]), settings.max_body_bytes,
                    max(1, math.ceil(settings.retry_after_s)), route_prefix=prefix,
                    metrics_dir=settings.metrics_dir, grace_s=ingress_grace_s(settings),
                    body_timeout_s=max(1, math.ceil(settings.body_timeout_s))))
            serve.run(build_app_from_settings(settings), name=app_config.get("name", "default"), route_prefix=prefix)
            log.info("serving on http://%s (OpenAPI at /docs) through %s; Ctrl-C stops", listen,
                     "nginx" if nginx else "Serve's proxy")
            while nginx_front is None or nginx_front.failed is None:
                time.sleep(1.0)
            log.error("the front failed, stopping: %s", nginx_front.failed)
            return 1
    except KeyboardInterrupt:
        for sig in (signal.SIGINT, signal.SIGTERM):  # a second Ctrl-C must not cut the orderly stop short
            signal.signal(sig, signal.SIG_IGN)
        log.info("stopping")
    except RuntimeError as e:  # a deployment failed to start (the replica logs above say why), or nginx did not
        log.error("%s", e)
        for name, reason in _failed_deployments():
            log.error("%s: %s", name, reason)
        return 1
    finally:
        serve.shutdown()
        ray.shutdown()
        if own_metrics_dir and settings.metrics_dir is not None:
            shutil.rmtree(settings.metrics_dir, ignore_errors=True)
    return 0


FAILED = ("UNHEALTHY", "DEPLOY_FAILED")  # Serve's statuses of a deployment whose replicas cannot start


def _failed_deployments() -> list[tuple[str, str]]:
    """(deployment, the last line of its error) of every deployment Serve reports unhealthy, e.g. a
    replica whose model's execution plan named a backend this machine cannot run."""
    from ray import serve

    try:
        apps = serve.status().applications
    except Exception:  # noqa: BLE001 - Serve itself is gone: the error above is all there is
        return []
    return [(name, (dep.message.strip().splitlines() or [""])[-1]) for app in apps.values()
            for name, dep in app.deployments.items() if dep.status in FAILED and dep.message]


if __name__ == "__main__":
    sys.exit(main())
