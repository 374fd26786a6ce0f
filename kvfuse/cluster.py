"""Replicas of `kvfuse serve` on one machine behind SMG (the `smg` router), sharing one Redis tier:
what `kvfuse cluster up` runs, and what the cluster tests start.

Routing: SMG's `consistent_hashing` policy. A request that carries `X-SMG-Routing-Key` (a knowledge-base
client sends `kb/<name>/<group>`) lands on the replica that key hashes to, so one kb group's questions
always meet the replica that holds its prefix in memory; a request without it is hashed by its
`Authorization` header, so one tenant's questions (and its salted chunk caches) stay on one replica.
When a replica fails its health checks, SMG walks the hash ring to the next healthy one, and retries a
request whose connection failed on another replica; a replica that answers again rejoins. Whatever
replica a request lands on, chunk caches and kb prefix blocks written by any replica are found through
Redis, and a kb prefix is built once (the build lock in `store/redis.py`). docs/deploy.md says why.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from kvfuse.server.process import free_port, start_serve, stop, wait_healthy

ROUTING_HEADER = "X-SMG-Routing-Key"
ROUTER_POLICY = "consistent_hashing"


def routing_key(kb: str, group: str) -> str:
    """The routing key of a knowledge-base group's questions (sent as X-SMG-Routing-Key)."""
    return f"kb/{kb}/{group}"


def _executable(name: str) -> str:
    """A program beside this Python (a venv's bin) or on PATH."""
    beside = Path(sys.executable).parent / name
    if beside.is_file():
        return str(beside)
    found = shutil.which(name)
    if found is None:
        raise RuntimeError(f"{name} was not found beside {sys.executable} or on PATH"
                           + (" (Debian: apt-get install redis-server)" if name == "redis-server" else
                              " (pip install smg)" if name == "smg" else ""))
    return found


@contextmanager
def redis_server(port: int | None = None, maxmemory: str = "1gb") -> Iterator[str]:
    """A throwaway redis-server on loopback, with the settings docs/deploy.md recommends (LRU over all
    keys, no persistence); yields its URL and stops it on exit."""
    port = port or free_port()
    proc = subprocess.Popen([_executable("redis-server"), "--port", str(port), "--bind", "127.0.0.1",
                             "--save", "", "--appendonly", "no", "--maxmemory", maxmemory,
                             "--maxmemory-policy", "allkeys-lru"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"redis://127.0.0.1:{port}/0"
    try:
        import redis

        deadline = time.monotonic() + 20
        while True:
            try:
                redis.Redis(port=port, socket_timeout=1).ping()
                break
            except redis.ConnectionError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"redis-server did not start on port {port}") from None
                time.sleep(0.05)
        yield url
    finally:
        stop(proc, 10)


@dataclass
class Replica:
    """One `kvfuse serve` process of the cluster; it can be killed and started again on its port."""

    args: list[str]
    port: int
    log: Path | None = None
    proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, startup_s: float = 300.0) -> None:
        log = os.open(self.log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644) if self.log else None
        try:
            self.proc = start_serve(self.args, self.port, log)
        finally:
            if log is not None:
                os.close(log)
        wait_healthy(self.proc, self.url, startup_s)

    def kill(self) -> None:
        """SIGKILL, as a crash would."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()

    def stop(self) -> None:
        if self.proc is not None:
            stop(self.proc)


@dataclass
class Cluster:
    url: str  # the router's base URL (OpenAI API at url + "/v1")
    redis_url: str
    replicas: list[Replica] = field(default_factory=list)
    router: subprocess.Popen[bytes] | None = None
    metrics_url: str = ""  # SMG's Prometheus endpoint


def router_command(worker_urls: Sequence[str], port: int, prometheus_port: int, host: str = "127.0.0.1",
                   health_interval_s: int = 1) -> list[str]:
    """The `smg launch` command that fronts the replicas (see the module docstring for the policy)."""
    return [_executable("smg"), "launch", "--host", host, "--port", str(port), "--worker-urls", *worker_urls,
            "--policy", ROUTER_POLICY, "--prometheus-host", "127.0.0.1", "--prometheus-port", str(prometheus_port),
            "--health-check-interval-secs", str(health_interval_s), "--health-failure-threshold", "2",
            "--health-success-threshold", "1", "--worker-startup-check-interval", "1"]


def wait_ready(router: subprocess.Popen[bytes], url: str, workers: int, timeout_s: float = 120.0) -> None:
    """Wait until the router reports every worker healthy (GET /readiness)."""
    import httpx

    deadline = time.monotonic() + timeout_s
    while True:
        if router.poll() is not None:
            raise RuntimeError(f"smg exited with status {router.returncode} before its workers were ready")
        try:
            r = httpx.get(url + "/readiness", timeout=2)
            if r.status_code == 200 and r.json().get("healthy_workers", 0) >= workers:
                return
        except (httpx.HTTPError, ValueError):
            pass
        if time.monotonic() > deadline:
            raise RuntimeError(f"smg on {url} did not see {workers} healthy workers within {timeout_s:.0f} s")
        time.sleep(0.25)


@contextmanager
def cluster(replicas: int, serve_args: Sequence[str], redis_url: str | None = None, port: int | None = None,
            store_root: Path | None = None, logs: Path | None = None, host: str = "127.0.0.1",
            replica_ports: Sequence[int] | None = None) -> Iterator[Cluster]:
    """Redis (started here when redis_url is None), N replicas each with its own store directory under
    store_root, and SMG in front on `port`; yields once the router sees every replica healthy."""
    if replicas < 1:
        raise ValueError("a cluster needs at least one replica")
    with ExitStack() as stack:
        url = redis_url or stack.enter_context(redis_server())
        ports = list(replica_ports) if replica_ports else [free_port() for _ in range(replicas)]
        members = []
        for i, p in enumerate(ports[:replicas]):
            args = [*serve_args, "--redis", url]
            if store_root is not None:
                args += ["--store", str(store_root / f"replica-{i}")]
            member = Replica(args, p, logs / f"replica-{i}.log" if logs else None)
            stack.callback(member.stop)
            members.append(member)
        for member in members:
            member.start()
        router_port, prom = port or free_port(), free_port()
        out = subprocess.DEVNULL if logs is None else open(logs / "smg.log", "ab")  # noqa: SIM115
        if logs is not None:
            stack.callback(out.close)  # type: ignore[union-attr]
        router = subprocess.Popen(router_command([m.url for m in members], router_port, prom, host),
                                  stdout=out, stderr=out)
        stack.callback(stop, router, 10)
        router_url = f"http://127.0.0.1:{router_port}"
        wait_ready(router, router_url, len(members))
        yield Cluster(router_url, url, members, router, f"http://127.0.0.1:{prom}/metrics")
