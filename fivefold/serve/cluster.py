"""Serving beyond one engine: N engine replicas on Ray Serve behind one routing front.

``fivefold serve --replicas N`` starts (or joins, with ``--ray-address``) a Ray cluster
and deploys each replica as its own Ray Serve application (``fivefold-replica-0`` ...),
each one deployment with one replica. One application per engine is what lets our
router pick the replica: Ray Serve's own router balances within a deployment by queue
length and knows nothing of prompts. Ray Serve still does what it is good at: placing
the replicas on the cluster's nodes, health-checking them, and restarting one that dies.

The front is the process that ran the command: a FastAPI app with the same guard,
errors, ``/health``, ``/metrics`` and ``/v1/models`` as the single-engine server. For
``/v1/completions`` and ``/v1/chat/completions`` it picks a replica (round-robin,
least-loaded or prefix-aware; fivefold/serve/routing.py) and forwards the HTTP request
to it over a Ray Serve handle; the replica runs the single-engine app (replica.py), so
validation, queue limits, the result cache and streaming behave exactly as with one
engine. Load, for least-loaded and for the prefix-aware fallback, is what this front has
in flight on each replica (exact, and known without asking the replicas).

Failures: a replica whose process dies fails the requests it had in flight with 503
(``replica_unavailable``; a stream that had started ends with an error event carrying
the same message) and leaves routing at once; the others keep serving. Ray Serve starts
a new process for it, and the health watch (every ``health_check_period`` seconds) puts
it back in routing when it answers. A replica that dies idle has no request to tell us:
the watch takes it out when Ray Serve's status no longer shows it running or a probe
goes unanswered for ``health_check_timeout``. ``/health`` is 503 only while no replica
is healthy.

``/metrics`` is the front's own counters (requests routed to and failed on each
replica, restarts, health) followed by every replica's metrics twice: summed over the
replicas under their usual names and labels (``kv_cache_usage_perc`` averaged), and
per replica with a ``replica`` label. Select ``{replica=""}`` for the totals.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
import time
from contextlib import asynccontextmanager
from dataclasses import dataclass, replace

from fastapi import Request

from fivefold.errors import FivefoldError, ReplicaUnavailableError
from fivefold.serve.config import ServerConfig
from fivefold.serve.replica import EngineReplica
from fivefold.serve.routing import ROUTING_POLICIES, PrefixAwareRouter, ReplicaLoad, make_router

CLUSTER_HINT = "pip install 'fivefold[cluster]'"
# Not forwarded: the front answers for the connection and has checked the key already.
HOP_HEADERS = {"host", "content-length", "connection", "authorization", "transfer-encoding", "keep-alive"}


@dataclass(frozen=True)
class ClusterConfig:
    """How many replicas, where, and how requests are spread over them.

    num_cpus_per_replica: Ray CPUs reserved by each replica (and its torch threads); None
    means this machine's cores divided among the replicas when Ray is local, 1 on a cluster.
    """

    num_replicas: int = 2
    routing: str = "prefix-aware"
    ray_address: str | None = None
    num_cpus_per_replica: float | None = None
    health_check_period: float = 1.0
    health_check_timeout: float = 2.0
    start_timeout: float = 900.0
    shutdown_grace: float = 30.0
    app_prefix: str = "fivefold-replica"

    def __post_init__(self) -> None:
        if self.num_replicas < 1:
            raise FivefoldError(f"--replicas must be >= 1, got {self.num_replicas}")
        if self.routing not in ROUTING_POLICIES:
            raise FivefoldError(f"--routing must be one of {', '.join(ROUTING_POLICIES)}, got '{self.routing}'")
        if self.num_cpus_per_replica is not None and self.num_cpus_per_replica <= 0:
            raise FivefoldError(f"--replica-cpus must be > 0, got {self.num_cpus_per_replica}")
        if self.health_check_period <= 0 or self.health_check_timeout <= 0 or self.start_timeout <= 0:
            raise FivefoldError("health-check period/timeout and start timeout must be > 0")

    @property
    def cpus_per_replica(self) -> float:
        if self.num_cpus_per_replica is not None:
            return self.num_cpus_per_replica
        return 1.0 if self.ray_address else float(max(1, (os.cpu_count() or 1) // self.num_replicas))


def aggregate_metrics(texts: dict[str, str]) -> str:
    """Prometheus text of several replicas, each sample once per replica (``replica``
    label) and once summed over them (gauges named ``*_perc`` averaged). ``_created``
    samples are dropped: a sum of creation times means nothing."""
    from prometheus_client import CollectorRegistry, generate_latest
    from prometheus_client.metrics_core import Metric
    from prometheus_client.parser import text_string_to_metric_families

    families: dict[str, Metric] = {}
    totals: dict[str, dict[tuple, list[float]]] = {}
    for replica_id in sorted(texts):
        for family in text_string_to_metric_families(texts[replica_id]):
            out = families.setdefault(family.name, Metric(family.name, family.documentation, family.type))
            for s in family.samples:
                if s.name.endswith("_created"):
                    continue
                out.add_sample(s.name, {**s.labels, "replica": replica_id}, s.value)
                key = (s.name, tuple(sorted(s.labels.items())))
                totals.setdefault(family.name, {}).setdefault(key, []).append(s.value)
    for name, family in families.items():
        is_mean = family.type == "gauge" and name.endswith("_perc")
        for (sample_name, labels), values in totals.get(name, {}).items():
            family.add_sample(sample_name, dict(labels), sum(values) / len(values) if is_mean else sum(values))

    class Static:
        def collect(self):
            return list(families.values())

    registry = CollectorRegistry(auto_describe=False)
    registry.register(Static())
    return generate_latest(registry).decode()


def metric_by_replica(metrics_text: str, name: str) -> dict[str, float]:
    """A sample's value summed per ``replica`` label (other labels summed over), from the
    front's /metrics text; e.g. ``fivefold:prefix_cache_hits_total``."""
    from prometheus_client.parser import text_string_to_metric_families

    values: dict[str, float] = {}
    for family in text_string_to_metric_families(metrics_text):
        for s in family.samples:
            if s.name == name and "replica" in s.labels:
                values[s.labels["replica"]] = values.get(s.labels["replica"], 0.0) + s.value
    return values


class ReplicaSet:
    """Owns the Ray connection, the replicas' Serve applications and their handles,
    their health and this front's in-flight count on each (one owner per resource)."""

    def __init__(self, server: ServerConfig, config: ClusterConfig, log=None) -> None:
        try:
            import ray  # noqa: F401
            from ray import serve  # noqa: F401
        except ImportError:
            raise FivefoldError(f"--replicas needs Ray Serve: {CLUSTER_HINT}") from None
        from prometheus_client import CollectorRegistry, Counter, Gauge

        self.server, self.config = server, config
        self.log = log or (lambda text: print(text, file=sys.stderr))
        self.replica_ids = [f"replica-{i}" for i in range(config.num_replicas)]
        self.router = make_router(config.routing, server.engine_options.get("block_size", 16))
        self._handles: dict[str, object] = {}
        self._pids: dict[str, int] = {}
        self._capacity: dict[str, int] = {}
        self._is_healthy = {rid: False for rid in self.replica_ids}
        self._in_flight = {rid: 0 for rid in self.replica_ids}
        self._started_ray = False
        self.registry = CollectorRegistry()
        labels = ["model_name", "replica"]

        def per_replica(kind, name, doc):
            metric = kind(f"fivefold:{name}", doc, labels, registry=self.registry)
            return {rid: metric.labels(server.served_model_name, rid) for rid in self.replica_ids}

        self.m_routed = per_replica(Counter, "replica_requests", "Requests the front routed to each replica.")
        self.m_failed = per_replica(Counter, "replica_failed_requests",
                                    "In-flight requests failed (503) because their replica died.")
        self.m_restarts = per_replica(Counter, "replica_restarts", "Replica processes replaced after a failure.")
        # Read from the front's own state at scrape time, never kept twice.
        for rid, gauge in per_replica(Gauge, "replica_healthy", "1 while the replica is in routing.").items():
            gauge.set_function(lambda rid=rid: float(self._is_healthy[rid]))
        for rid, gauge in per_replica(Gauge, "replica_in_flight",
                                      "Requests the front has in flight on the replica.").items():
            gauge.set_function(lambda rid=rid: float(self._in_flight[rid]))

    # -- lifecycle -------------------------------------------------------------------

    def app_name(self, replica_id: str) -> str:
        return f"{self.config.app_prefix}-{replica_id.removeprefix('replica-')}"

    def start(self) -> None:
        """Connect to (or start) Ray, deploy the replicas and wait until every one answers."""
        import logging

        import ray
        from ray import serve

        cfg = self.config
        cpus = cfg.cpus_per_replica
        if cfg.ray_address:
            try:
                ray.init(address=cfg.ray_address, logging_level=logging.WARNING, log_to_driver=False)
            except Exception as exc:
                hint = ("; a cluster with token authentication needs RAY_AUTH_MODE=token and its token "
                        "(~/.ray/auth_token or RAY_AUTH_TOKEN)" if "uthentication" in str(exc) or
                        "Failed to connect" in str(exc) else "")
                raise FivefoldError(f"cannot join the Ray cluster at {cfg.ray_address}: "
                                    f"{str(exc).splitlines()[0]}{hint}") from None
        else:
            num_cpus = max(os.cpu_count() or 1, int(cpus * cfg.num_replicas + 0.999))
            # address="local": a new Ray of our own, even when another one runs on this machine.
            ray.init(address="local", num_cpus=num_cpus, include_dashboard=False, logging_level=logging.WARNING,
                     log_to_driver=False)
            self._started_ray = True
        serve.start(proxy_location="Disabled", logging_config={"log_level": "WARNING"})
        server = replace(self.server, num_threads=max(1, int(cpus)))
        deployment = serve.deployment(
            EngineReplica, name="engine", num_replicas=1,
            # The engine batches and queues by itself (with its own limits): Serve must not.
            max_ongoing_requests=100_000, ray_actor_options={"num_cpus": cpus},
            health_check_period_s=1, health_check_timeout_s=30,
            graceful_shutdown_timeout_s=cfg.shutdown_grace, graceful_shutdown_wait_loop_s=0.5)
        targets = [serve.RunTarget(deployment.bind(server, rid), name=self.app_name(rid), route_prefix=None)
                   for rid in self.replica_ids]
        serve.run_many(targets, wait_for_applications_running=False)
        self._wait_running()
        for rid in self.replica_ids:
            self._handles[rid] = serve.get_app_handle(self.app_name(rid))
            info = self._handles[rid].info.remote().result(timeout_s=cfg.start_timeout)
            self._pids[rid], self._capacity[rid] = info["pid"], info["max_num_seqs"]
            self._set_healthy(rid, True)

    def _wait_running(self) -> None:
        from ray import serve
        from rich.progress import Progress

        names = {self.app_name(rid) for rid in self.replica_ids}
        deadline = time.monotonic() + self.config.start_timeout
        with Progress(transient=True) as progress:
            task = progress.add_task(f"starting {len(names)} replicas", total=len(names))
            while True:
                apps = serve.status().applications
                states = {n: apps[n].status.value if n in apps else "NOT_STARTED" for n in names}
                failed = [n for n, s in states.items() if s in ("DEPLOY_FAILED", "UNHEALTHY")]
                if failed:
                    message = apps[failed[0]].message.strip().splitlines()
                    raise FivefoldError(f"replica {failed[0]} failed to start: "
                                        f"{message[-1] if message else states[failed[0]]}")
                progress.update(task, completed=sum(s == "RUNNING" for s in states.values()))
                if all(s == "RUNNING" for s in states.values()):
                    return
                if time.monotonic() > deadline:
                    raise FivefoldError(f"replicas not running after {self.config.start_timeout:.0f} s: {states}")
                time.sleep(0.5)

    def shutdown(self) -> None:
        """Delete this front's applications (letting in-flight requests finish within the
        grace period); stop Ray too when this process started it."""
        import ray
        from ray import serve

        if not ray.is_initialized():
            return
        try:
            if self._started_ray:
                serve.shutdown()
            else:
                for rid in self.replica_ids:
                    serve.delete(self.app_name(rid))
        finally:
            ray.shutdown()

    # -- routing and health ----------------------------------------------------------

    @property
    def needs_prompt_ids(self) -> bool:
        return isinstance(self.router, PrefixAwareRouter)

    def has_healthy(self) -> bool:
        return any(self._is_healthy.values())

    def _set_healthy(self, replica_id: str, is_healthy: bool) -> None:
        if self._is_healthy[replica_id] != is_healthy:
            self.log(f"fivefold: {replica_id} {'in routing' if is_healthy else 'out of routing'}")
        self._is_healthy[replica_id] = is_healthy

    def loads(self) -> list[ReplicaLoad]:
        return [ReplicaLoad(rid, num_running=self._in_flight[rid], capacity=self._capacity.get(rid, 64),
                            is_healthy=self._is_healthy[rid]) for rid in self.replica_ids]

    def choose(self, prompt_ids: list[int]) -> str:
        """The replica for a request (raises ReplicaUnavailableError when none is healthy)."""
        return self.router.choose(prompt_ids, self.loads())

    async def _call(self, replica_id: str, method: str, *args):
        """One unary call on a replica, bounded by the health-check timeout: Ray Serve queues a
        call for a replica that died a moment ago instead of failing it, and no probe or
        scrape may wait on that."""
        response = getattr(self._handles[replica_id], method).remote(*args)
        try:
            return await asyncio.wait_for(_awaited(response), self.config.health_check_timeout)
        except BaseException:
            response.cancel()
            raise

    async def probe(self, replica_id: str) -> None:
        """Ask a replica who it is: a new process means Ray restarted it; no answer in
        time takes it out of routing; an answer puts it (back) in."""
        try:
            info = await self._call(replica_id, "info")
        except Exception:
            self._set_healthy(replica_id, False)
            return
        if info["pid"] != self._pids.get(replica_id):
            self.log(f"fivefold: {replica_id} restarted (pid {self._pids.get(replica_id)} -> {info['pid']})")
            self.m_restarts[replica_id].inc()
            self._pids[replica_id] = info["pid"]
        self._capacity[replica_id] = info["max_num_seqs"]
        self._set_healthy(replica_id, True)

    def _running_apps(self) -> set[str]:
        """Applications whose replica Ray Serve reports RUNNING (a dead one drops out at once)."""
        from ray import serve

        running = set()
        for name, app in serve.status().applications.items():
            if any(d.replica_states.get("RUNNING", 0) > 0 for d in app.deployments.values()):
                running.add(name)
        return running

    async def watch(self) -> None:
        """Every ``health_check_period`` seconds, until cancelled: a replica Ray Serve no
        longer runs leaves routing (an idle replica that died has no request to fail and
        tell us); the others are probed."""
        probes: dict[str, asyncio.Future] = {}
        try:
            while True:
                await asyncio.sleep(self.config.health_check_period)
                try:
                    running = await asyncio.to_thread(self._running_apps)
                except Exception:  # the controller is busy or restarting: rely on the probes
                    running = {self.app_name(rid) for rid in self.replica_ids}
                for rid in self.replica_ids:
                    if self.app_name(rid) not in running:
                        self._set_healthy(rid, False)
                    elif rid not in probes or probes[rid].done():  # a slow probe never holds up the loop
                        probes[rid] = asyncio.ensure_future(self.probe(rid))
        finally:
            for probe in probes.values():
                probe.cancel()

    async def stream(self, replica_id: str, method: str, path: str, headers: list[tuple[str, str]], body: bytes):
        """Forward one HTTP request to a replica: yield ``(status, headers)``, then body
        chunks. A replica that dies meanwhile raises ReplicaUnavailableError (and leaves
        routing); leaving early cancels the request on the replica."""
        from ray.exceptions import ActorUnavailableError, RayActorError

        self.m_routed[replica_id].inc()
        self._in_flight[replica_id] += 1
        response = self._handles[replica_id].options(stream=True).handle.remote(method, path, headers, body)
        is_done = False
        try:
            async for item in response:
                yield item
            is_done = True
        except (RayActorError, ActorUnavailableError) as exc:
            is_done = True
            self._set_healthy(replica_id, False)
            self.m_failed[replica_id].inc()
            raise ReplicaUnavailableError(
                f"{replica_id} failed while serving this request ({type(exc).__name__}); it is out of routing "
                f"until it restarts and the other replicas keep serving: retry") from None
        finally:
            self._in_flight[replica_id] -= 1
            if not is_done:
                response.cancel()

    async def metrics_text(self) -> str:
        """The front's counters, then every answering replica's metrics, summed and labelled."""
        from prometheus_client import generate_latest

        ids = [rid for rid in self.replica_ids if self._is_healthy[rid]]
        answers = await asyncio.gather(*(self._call(rid, "metrics_text") for rid in ids), return_exceptions=True)
        texts = {rid: text for rid, text in zip(ids, answers) if isinstance(text, str)}
        return generate_latest(self.registry).decode() + aggregate_metrics(texts)


async def _awaited(response):
    return await response


def routing_prompt_ids(tokenizer, path: str, body: bytes) -> list[int]:
    """The prompt's token ids as the replica will see them, for prefix-aware routing;
    [] when the body is not a valid request (the replica answers it with its 400/422)."""
    try:
        request = json.loads(body)
        if path.endswith("/chat/completions"):
            return list(tokenizer.apply_chat_template(request["messages"], add_generation_prompt=True))
        prompt = request["prompt"]
        return tokenizer.encode(prompt) if isinstance(prompt, str) else [int(t) for t in prompt]
    except Exception:
        return []


class ForwardAPI:
    """The front's ``/v1/completions`` and ``/v1/chat/completions``: each request forwarded to
    the replica the router picks (``X-Fivefold-Replica`` says which), with the current prompt
    version, which this front owns (``--prompt-version``, then ``POST /admin/prompt-version``)."""

    def __init__(self, replicas: ReplicaSet, tokenizer) -> None:
        self.replicas, self.tokenizer = replicas, tokenizer
        self.version = replicas.server.prompt_version

    def current_version(self) -> str:
        return self.version

    async def change_version(self, version: str) -> dict:
        self.version = version
        return {}

    def register(self, app) -> None:
        app.add_api_route("/v1/completions", self.forward, methods=["POST"])
        app.add_api_route("/v1/chat/completions", self.forward, methods=["POST"])

    async def forward(self, request: Request):
        from fastapi.responses import Response, StreamingResponse

        from fivefold.serve.http_base import FRONT_VERSION_HEADER, await_unless_disconnected

        replicas, body = self.replicas, await request.body()
        # Tokenizing a large prompt takes a while: off the event loop, so /health and the other requests
        # keep their answers coming meanwhile.
        prompt_ids = await asyncio.to_thread(routing_prompt_ids, self.tokenizer, request.url.path, body) \
            if replicas.needs_prompt_ids else []
        replica_id = replicas.choose(prompt_ids)
        path = request.url.path + (f"?{request.url.query}" if request.url.query else "")
        headers = [(k, v) for k, v in request.headers.items() if k.lower() not in HOP_HEADERS | {FRONT_VERSION_HEADER}]
        headers.append((FRONT_VERSION_HEADER, self.version))
        stream = replicas.stream(replica_id, request.method, path, headers, body)
        try:
            ((status, reply_headers),) = await await_unless_disconnected(request,
                                                                         [asyncio.ensure_future(anext(stream))])
        except ReplicaUnavailableError as exc:
            await stream.aclose()
            return _unavailable(exc, replica_id)
        except BaseException:
            await stream.aclose()
            raise
        reply_headers = {k: v for k, v in reply_headers if k.lower() not in HOP_HEADERS}
        reply_headers["X-Fivefold-Replica"] = replica_id
        media_type = reply_headers.pop("content-type", "application/json")
        if media_type.startswith("text/event-stream"):
            return StreamingResponse(_relay(stream), status_code=status, headers=reply_headers, media_type=media_type)

        async def read_all() -> bytes:
            return b"".join([chunk async for chunk in stream])

        try:
            (content,) = await await_unless_disconnected(request, [asyncio.ensure_future(read_all())])
        except ReplicaUnavailableError as exc:
            return _unavailable(exc, replica_id)
        finally:
            await stream.aclose()
        return Response(content, status_code=status, headers=reply_headers, media_type=media_type)


def _unavailable(exc: ReplicaUnavailableError, replica_id: str):
    """The 503 of a replica that died before its reply was whole (errors name their replica too)."""
    from fivefold.serve.http_base import replica_unavailable_response

    response = replica_unavailable_response(exc)
    response.headers["X-Fivefold-Replica"] = replica_id
    return response


def build_cluster_app(replicas: ReplicaSet, tokenizer, model_name: str, api_key: str | None = None,
                      max_body_bytes: int = 1 << 20, admin_key: str | None = None):
    """The front's FastAPI app: the base app's endpoints, plus the two generation
    endpoints forwarded to the replica the router picks (``X-Fivefold-Replica`` says which).

    The front owns the result cache's prompt version (``--prompt-version``, then
    ``POST /admin/prompt-version`` here) and sends it with every forwarded request, so
    every replica, a restarted one included, answers under the current version; each
    replica's cache purges the old version's entries the first time it sees the new one."""
    from fivefold.serve.http_base import PromptVersionAdmin, build_base_app

    @asynccontextmanager
    async def lifespan(_):
        watch = asyncio.ensure_future(replicas.watch())
        try:
            yield
        finally:
            watch.cancel()

    app = build_base_app(model_name, replicas.metrics_text, api_key, max_body_bytes,
                         is_healthy=replicas.has_healthy, lifespan=lifespan)
    forwarding = ForwardAPI(replicas, tokenizer)
    PromptVersionAdmin(admin_key, forwarding.current_version, forwarding.change_version).register(app)
    forwarding.register(app)
    return app


async def _relay(stream):
    """Pass a replica's SSE bytes through; if it dies mid-stream, end with an error event
    (the status line has gone out already) carrying the 503's message."""
    try:
        async for chunk in stream:
            yield chunk
    except ReplicaUnavailableError as exc:
        error = {"error": {"message": str(exc), "type": "server_error", "code": 503}}
        yield f"data: {json.dumps(error)}\n\n".encode()
    finally:
        await stream.aclose()
