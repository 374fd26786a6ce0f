"""A soak test of `kvfuse serve` (issue K): ten minutes of mixed traffic, with a corrupted store file,
a filled disk budget and one SIGKILL and restart on the same store along the way.

    .venv/bin/python benchmarks/soak.py [--minutes 10] [--clients 3] [--disk-bytes 1200M]

The server serves a copy of the bundled Albarán knowledge base with four keys (two support tenants, a
leads admin, one key for documents). The clients draw requests from a fixed mix:
  - kb questions from either support tenant (greedy, 12 tokens),
  - completions with two documents fused in (the default mode), new documents now and then, so chunk
    caches fill the disk budget,
  - streams cancelled after three chunks,
  - bad input (a lone surrogate, a body past the limit, malformed JSON, an unknown group),
  - knowledge-base edits by the admin, to a leads-only document (so the support answers must not move).
At a quarter of the run a stored file gets a flipped byte; at half the server is SIGKILLed and started
again on the same store (requests in flight then fail: they are counted as "killed"). Afterwards a
fresh server on a fresh store answers every distinct question and documents request once, one by one:
no answer of the soak may differ from it. Reports requests served, errors by kind, p50/p99 client TTFT
(from `kvfuse.client_ttft_s`), store metrics and answer mismatches.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from importlib import resources
from pathlib import Path

import httpx

from kvfuse.server.process import free_port

KEYS = """
[[keys]]
key = "sk-acme-0000"
tenant = "acme"
[keys.kb]
albaran = ["support"]

[[keys]]
key = "sk-beta-0000"
tenant = "beta"
[keys.kb]
albaran = ["support"]

[[keys]]
key = "sk-admin-000"
tenant = "acme"
admin = true
[keys.kb]
albaran = ["leads", "support"]
"""
QUESTIONS = ["How long do I have to return an annual charge?", "How many seats does the Team plan include?",
             "Can I change plans mid-cycle?", "What does the free trial include?", "Who can approve invoices?",
             "Is there an API rate limit?"]
DOCS = [("The depot in Vigo opens at 7.", "The Lugo depot closes at 19."),
        ("Orders ship within 2 days.", "Returns are collected on Fridays."),
        ("Our support line is 900 100 200.", "Email answers come within a day.")]
TENANT = {"acme": "sk-acme-0000", "beta": "sk-beta-0000"}


class Server:
    def __init__(self, kb: Path, store: Path, keys: Path, disk_bytes: str) -> None:
        self.args = ["--kb", str(kb), "--store", str(store), "--keys", str(keys), "--disk-bytes", disk_bytes,
                     "--metrics-public", "--log-level", "warning"]
        self.proc: subprocess.Popen[bytes] | None = None
        self.url = ""

    def start(self) -> None:
        port = free_port()
        self.url = f"http://127.0.0.1:{port}"
        self.proc = subprocess.Popen([sys.executable, "-m", "kvfuse", "serve", "--port", str(port), *self.args],
                                     env={**os.environ, "TOKENIZERS_PARALLELISM": "false"})
        deadline = time.time() + 600
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"kvfuse serve exited with status {self.proc.returncode}")
            try:
                if httpx.get(self.url + "/health", timeout=1).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        raise RuntimeError("the server did not start")

    def kill(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait()

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(timeout=60)


def question(tenant: str, q: str) -> tuple[str, dict, dict]:  # type: ignore[type-arg]
    return (f"kb:{tenant}:{q}", {"Authorization": f"Bearer {TENANT[tenant]}"},
            {"kb": "albaran", "messages": [{"role": "user", "content": q}], "max_tokens": 12, "temperature": 0})


def documents(i: int, fresh: int | None = None) -> tuple[str, dict, dict]:  # type: ignore[type-arg]
    docs = list(DOCS[i])
    if fresh is not None:  # a new document: a new chunk cache for the disk budget
        docs.append(f"Note {fresh}: " + " ".join(f"item{fresh}-{j}" for j in range(300)))
    key = f"docs:{i}" if fresh is None else f"docs:{i}:{fresh}"
    return (key, {"Authorization": "Bearer sk-acme-0000"},
            {"prompt": "Answer briefly. When does the depot open?", "documents": [{"text": d} for d in docs],
             "max_tokens": 8, "temperature": 0})


def send(url: str, kind: str, rng: random.Random, results: list[dict], counter: list[int]) -> None:  # type: ignore[type-arg]
    t0 = time.perf_counter()
    try:
        if kind in ("kb", "docs"):
            if kind == "kb":
                key, headers, body = question(rng.choice(["acme", "beta"]), rng.choice(QUESTIONS))
                path = "/v1/chat/completions"
            else:
                counter[0] += 1
                key, headers, body = documents(rng.randrange(3), counter[0] if rng.random() < 0.5 else None)
                path = "/v1/completions"
            r = httpx.post(url + path, json=body, headers=headers, timeout=600)
            out = {"kind": kind, "status": r.status_code, "key": key}
            if r.status_code == 200:
                j = r.json()
                c = j["choices"][0]
                out["text"] = c["message"]["content"] if "message" in c else c["text"]
                out["client_ttft_s"] = j["kvfuse"]["client_ttft_s"]
        elif kind == "cancel":
            _, headers, body = question(rng.choice(["acme", "beta"]), rng.choice(QUESTIONS))
            body = {**body, "stream": True, "max_tokens": 40}
            with httpx.stream("POST", url + "/v1/chat/completions", json=body, headers=headers, timeout=600) as r:
                n = 0
                for line in r.iter_lines():
                    n += line.startswith("data: {")
                    if n >= 3:
                        break
            out = {"kind": kind, "status": r.status_code}
        elif kind == "bad":
            which = rng.randrange(4)
            h = {"Authorization": "Bearer sk-acme-0000", "Content-Type": "application/json"}
            content = [b'{"prompt": "abc\\ud800", "max_tokens": 1}', b'{"prompt": "x", ',
                       json.dumps({"prompt": "y" * 3_000_000}).encode(),
                       b'{"kb": "albaran", "prompt": "hi", "kvfuse": {"group": "leads"}}'][which]
            r = httpx.post(url + "/v1/completions", content=content, headers=h, timeout=600)
            out = {"kind": kind, "status": r.status_code, "expected_4xx": 400 <= r.status_code < 500}
        else:  # an edit of a leads-only document
            body = {"id": "soak-note", "text": f"Lead note {rng.randrange(10**6)}.", "groups": ["leads"]}
            admin = {"Authorization": "Bearer sk-admin-000"}
            r = httpx.post(url + "/v1/kb/albaran/documents", json=body, headers=admin, timeout=600)
            out = {"kind": kind, "status": r.status_code}
    except httpx.HTTPError as e:
        out = {"kind": kind, "status": -1, "error": f"{type(e).__name__}: {e}"[:200]}
    out["t"] = time.time()
    out["s"] = time.perf_counter() - t0
    results.append(out)


MIX = ["kb"] * 8 + ["docs"] * 4 + ["cancel"] * 2 + ["bad"] * 3 + ["edit"]


def corrupt_one(store: Path) -> str | None:
    files = sorted(store.glob("*/*.safetensors"))
    if not files:
        return None
    path = files[len(files) // 2]
    data = bytearray(path.read_bytes())
    data[-64] ^= 0xFF
    path.write_bytes(bytes(data))
    return path.name


def quiet(kb: Path, keys: Path, keys_seen: set[str], disk_bytes: str) -> dict[str, str]:
    store = Path(tempfile.mkdtemp(prefix="soak-quiet-"))
    srv = Server(kb, store, keys, disk_bytes)
    srv.start()
    answers = {}
    try:
        for key in sorted(keys_seen):
            parts = key.split(":")
            if parts[0] == "kb":
                _, headers, body = question(parts[1], ":".join(parts[2:]))
                path = "/v1/chat/completions"
            else:
                _, headers, body = documents(int(parts[1]), int(parts[2]) if len(parts) > 2 else None)
                path = "/v1/completions"
            j = httpx.post(srv.url + path, json=body, headers=headers, timeout=600).json()
            c = j["choices"][0]
            answers[key] = c["message"]["content"] if "message" in c else c["text"]
    finally:
        srv.stop()
        shutil.rmtree(store, ignore_errors=True)
    return answers


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--minutes", type=float, default=10.0)
    ap.add_argument("--clients", type=int, default=3)
    ap.add_argument("--disk-bytes", default="1200M")  # the two tenants' pinned prefixes take about 750 MB
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="soak-"))
    kb = work / "albaran"
    shutil.copytree(str(resources.files("kvfuse") / "data" / "albaran"), kb)
    keys = work / "keys.toml"
    keys.write_text(KEYS)
    store = work / "store"
    srv = Server(kb, store, keys, args.disk_bytes)
    srv.start()
    results: list[dict] = []  # type: ignore[type-arg]
    events: list[str] = []
    for tenant in TENANT:  # each tenant's prefix built before the clock starts (about 30 s each)
        _, headers, body = question(tenant, QUESTIONS[0])
        httpx.post(srv.url + "/v1/chat/completions", json=body, headers=headers, timeout=900).raise_for_status()
    start = time.time()
    end = start + args.minutes * 60
    counter = [0]
    live = {"url": srv.url}

    def client(seed: int) -> None:
        rng = random.Random(seed)
        while time.time() < end:
            send(live["url"], rng.choice(MIX), rng, results, counter)
            if results[-1]["status"] == -1:  # the server is down (the kill): retry calmly
                time.sleep(1.0)

    threads = [threading.Thread(target=client, args=(i,)) for i in range(args.clients)]
    for t in threads:
        t.start()
    corrupted = killed = False
    killed_at = back_at = 0.0
    while time.time() < end:
        time.sleep(1)
        if not corrupted and time.time() > start + args.minutes * 15:
            events.append(f"{time.time() - start:.0f}s: corrupted {corrupt_one(store)}")
            corrupted = True
        if not killed and time.time() > start + args.minutes * 30:
            metrics_before = httpx.get(live["url"] + "/metrics", timeout=60).text
            srv.kill()
            killed_at = time.time()
            events.append(f"{time.time() - start:.0f}s: SIGKILL")
            srv.start()
            back_at = time.time()
            live["url"] = srv.url
            events.append(f"{time.time() - start:.0f}s: restarted on the same store")
            killed = True
    for t in threads:
        t.join()
    metrics = httpx.get(live["url"] + "/metrics", timeout=60).text
    srv.stop()
    seen = {r["key"] for r in results if r.get("status") == 200 and "key" in r}
    ref = quiet(kb, keys, seen, args.disk_bytes)
    mismatches = [(r["key"], r["text"], ref[r["key"]]) for r in results
                  if r.get("status") == 200 and "text" in r and r["text"] != ref[r["key"]]]
    ttft = sorted(r["client_ttft_s"] for r in results if "client_ttft_s" in r)
    kinds = Counter((r["kind"], r["status"]) for r in results)

    def metric(text: str, prefix: str) -> list[str]:
        return [line for line in text.splitlines() if line.startswith(prefix)]

    report = {
        "minutes": args.minutes, "clients": args.clients, "requests": len(results),
        "served_200": sum(1 for r in results if r["status"] == 200),
        "by_kind_and_status": {f"{k}:{s}": n for (k, s), n in sorted(kinds.items())},
        "bad_input_not_4xx": sum(1 for r in results if r["kind"] == "bad" and not r.get("expected_4xx")),
        "server_errors_5xx": sum(1 for r in results if r["status"] >= 500),
        "connection_errors": sum(1 for r in results if r["status"] == -1),
        "connection_errors_outside_the_kill": sum(1 for r in results if r["status"] == -1 and not
                                                  killed_at - 1 <= r["t"] <= back_at + 1),
        "connection_errors_by_kind": dict(Counter(r["error"][:60] for r in results if r["status"] == -1)),
        "ttft_p50_s": round(statistics.median(ttft), 3) if ttft else None,
        "ttft_p99_s": round(ttft[min(len(ttft) - 1, int(0.99 * len(ttft)))], 3) if ttft else None,
        "distinct_answers_checked": len(seen), "answer_mismatches": len(mismatches),
        "events": events,
        "store_metrics_before_kill": metric(metrics_before, "kvfuse_store_") if killed else [],
        "store_metrics_end": metric(metrics, "kvfuse_store_"),
    }
    print(json.dumps(report, indent=1))
    for m in mismatches[:5]:
        print("MISMATCH", json.dumps(m))
    shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
