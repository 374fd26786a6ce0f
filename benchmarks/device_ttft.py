"""The engine on an accelerator (CUDA): is it the same computation there, what do full, prefix, reuse,
blend and the default fuser cost in TTFT, and does loading chunk caches behind the recompute hide the
copies from host memory and from disk. One run, methods interleaved, medians.

    # on a machine with the model and a GPU
    .venv/bin/python benchmarks/device_ttft.py --device cuda --model smollm2-135m-instruct
    # where the checkpoint cannot travel (the lent GPU machine takes 64 MiB): here, write the model's
    # config and MuSiQue case 0's token ids; there, run the same architecture with random weights
    .venv/bin/python benchmarks/device_ttft.py --model smollm2-135m-instruct --dump-request req.json
    python3 benchmarks/device_ttft.py --device cuda --random-weights req.json --out results.json

Timings do not depend on the weights' values (every method computes the same shapes; the picks of a
query-aware fuser differ, their number does not), so random weights give the architecture's TTFT;
they say nothing about fidelity, which is measured on the CPU with the real checkpoints
(docs/benchmarks.md). What is checked on the device: the load-time self-check, blend at 1.0 and
prefix against full prefill, full prefill against the naive forward, and the device's full prefill
against the CPU's for the same weights.

Chunk caches live in the store's host memory (or on disk) whatever computes, so every fusing request
copies its chunks' layers to the device; `pipelined` runs those copies (and disk reads) on the loader's
thread one layer ahead of the recompute. `copy only` moves every layer of every chunk from host memory
to the device with no compute, the bound pipelining is measured against.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import platform
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).parent))
from common import interleaved, median_ratio, medians  # noqa: E402

ONE_TOKEN = 1


def dump_request(model: str | None, passages: int, out: Path) -> None:
    """The model's config.json and MuSiQue case 0's request as token ids, for --random-weights."""
    from common import musique_cases, musique_prompt

    from kvfuse.checkpoints import resolve_model_path
    from kvfuse.text import Tokenizer

    path = resolve_model_path(model)
    req = musique_prompt(musique_cases()[0], passages).request(Tokenizer(path))
    out.write_text(json.dumps({"model": path.name, "config": json.loads((path / "config.json").read_text()),
                               "prefix": req.prefix, "suffix": req.suffix, "chunks": req.chunks}))
    print(f"wrote {out}: {path.name}, {len(req)} tokens in {len(req.chunks)} chunks")


def random_model(cfg_json: dict[str, Any], precision: str, device: torch.device, seed: int = 0):  # type: ignore[no-untyped-def]
    """The config's architecture with torch's default initialisation (seeded), converted to the precision
    part by part on the device, as `weights.load_model` converts a checkpoint."""
    from kvfuse.config import ModelConfig
    from kvfuse.model import Decoder
    from kvfuse.precision import convert, parts

    cfg = ModelConfig.from_hf_config(cfg_json)
    torch.manual_seed(seed)
    model = Decoder(cfg)
    for part in parts(cfg):
        model.get_submodule(part).to(device)
        convert(model, part, precision)
    return model.eval().requires_grad_(False)


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |a - b| relative to max |b|."""
    a, b = a.float().cpu(), b.float().cpu()
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-6))


def stage(results: dict[str, Any], name: str, fn: Callable[[], Any]) -> Any:
    """Run one part of the benchmark; a failure is recorded with its traceback and the rest goes on."""
    print(f"\n== {name}", flush=True)
    try:
        out = fn()
        results[name] = out
        print(json.dumps(out, indent=1, default=str), flush=True)
        return out
    except Exception:
        results[name] = {"error": traceback.format_exc()}
        print(results[name]["error"], flush=True)
        return None


def run_precision(args: argparse.Namespace, precision: str, device: torch.device, results: dict[str, Any]) -> None:
    from kvfuse.checkpoints import resolve_model_path
    from kvfuse.engine import Engine
    from kvfuse.engine.sampling import SamplingParams
    from kvfuse.fuse import DEFAULT_MODE
    from kvfuse.request import Request
    from kvfuse.store import open_store
    from kvfuse.weights import load_model

    one = SamplingParams(max_tokens=ONE_TOKEN)
    tmp = Path(tempfile.mkdtemp(prefix=f"kvfuse-device-{precision}-"))
    if args.random_weights:
        spec = json.loads(Path(args.random_weights).read_text())
        model = random_model(spec["config"], precision, device)
        fp = "random-" + hashlib.sha256(json.dumps(spec["config"], sort_keys=True).encode()).hexdigest()[:16]
        fp += "-" + precision
        req = Request(suffix=tuple(spec["suffix"]), prefix=tuple(spec["prefix"]),
                      chunks=tuple(tuple(c) for c in spec["chunks"]))
        name = spec["model"] + " (random weights)"
    else:
        from common import musique_cases, musique_prompt

        from kvfuse.text import Tokenizer

        path = resolve_model_path(args.model)
        lm = load_model(path, precision, device)
        model, fp, name = lm.model, lm.fingerprint, path.name
        req = musique_prompt(musique_cases()[0], args.passages).request(Tokenizer(path))
    key = f"{name}, {precision}"
    out: dict[str, Any] = {"model": name, "precision": precision, "prompt_tokens": len(req),
                           "chunks": len(req.chunks)}
    results[key] = out
    t0 = time.perf_counter()
    engine = Engine(model, fp, store=open_store(tmp / "store", fp))
    if device.type == "cuda":
        torch.cuda.synchronize()
    out["self_check_s"] = time.perf_counter() - t0
    out["self_check"] = engine.blend_error or "passed"
    print(f"{key}: {len(req)} tokens; self-check {out['self_check']} ({out['self_check_s']:.2f} s)", flush=True)

    def exactness() -> dict[str, Any]:
        full = engine.prefill(req, "full").fused.logits
        naive = model(torch.tensor(req.ids, device=device))[-1]
        engine.precompute(req, "prefix")
        prefix = engine.prefill(req, "prefix").fused.logits
        engine.precompute(req, "blend")
        blend1 = engine.prefill(req, "blend", 1.0).fused.logits
        return {"full_vs_naive": rel_err(full, naive), "prefix_vs_full": rel_err(prefix, full),
                "prefix_equal_full": bool(torch.equal(prefix, full)), "blend1_vs_full": rel_err(blend1, full),
                "same_first_token": bool(full.argmax() == prefix.argmax() == blend1.argmax())}

    stage(out, "exactness on the device", exactness)

    if precision == "fp32" and args.cpu_check and args.random_weights:
        def cpu_agreement() -> dict[str, Any]:
            from kvfuse import fuse

            spec = json.loads(Path(args.random_weights).read_text())
            cpu_model = random_model(spec["config"], "fp32", torch.device("cpu"))
            with torch.inference_mode():
                cpu = fuse.prefill(cpu_model, torch.tensor(req.ids)).logits
            dev = engine.prefill(req, "full").fused.logits
            return {"device_vs_cpu": rel_err(dev, cpu), "same_first_token": bool(dev.cpu().argmax() == cpu.argmax())}

        stage(out, "the device against the CPU (same weights)", cpu_agreement)

    default = engine.fuser(DEFAULT_MODE)
    engine.precompute(req, default)

    def ttft(mode: str, ratio: float | None = None) -> Callable[[], float]:
        return lambda: engine.generate(req, mode, ratio, one).ttft_s

    def disk(pipelined: bool) -> float:
        e = Engine(model, fp, store=open_store(tmp / "store", fp), self_check=False)  # empty memory tier
        e.pipelined = pipelined
        from store_load import drop_page_cache

        drop_page_cache(tmp / "store")
        return e.generate(req, DEFAULT_MODE, None, one).ttft_s

    def copy_only() -> float:
        store = engine.store
        keys = [engine.cache.chunk_key(c, None, p) for c, p in zip(req.chunks, engine.cache.chunk_preambles(
            default, req), strict=True)]
        entries = [store.open(k) for k in keys]
        t = time.perf_counter()
        for i in range(model.cfg.num_layers):
            for e in entries:
                assert e is not None
                k, v = e.source.layer(i)
                k.to(device), v.to(device)
        if device.type == "cuda":
            torch.cuda.synchronize()
        return time.perf_counter() - t

    engine.store.flush()

    def timings() -> dict[str, Any]:
        methods = {"full": ttft("full"), "prefix (cached)": ttft("prefix"), "reuse": ttft("reuse"),
                   "blend@0.15": ttft("blend", 0.15), f"default ({DEFAULT_MODE})": ttft(DEFAULT_MODE),
                   "default, disk cold, pipelined": lambda: disk(True),
                   "default, disk cold, sequential": lambda: disk(False), "copy only (host memory)": copy_only}
        times = interleaved(methods, args.runs)
        med = medians(times)
        full = times["full"]
        return {"median_s": med, "ratio_to_full": {k: median_ratio(v, full) for k, v in times.items()},
                "rounds": times}

    stage(out, "TTFT", timings)

    def decode() -> dict[str, Any]:
        params = SamplingParams(max_tokens=args.decode_tokens, ignore_eos=True)
        per = []
        for _ in range(3):
            g = engine.generate(req, "full", None, params)
            per.append((g.total_s - g.ttft_s) / max(1, len(g.tokens) - 1))
        return {"ms_per_token_median": 1000 * sorted(per)[1], "tokens": args.decode_tokens,
                "batch_limit": engine.decode_batch_limit()}

    stage(out, "decode", decode)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--model", default=None, help="a packaged model's name or a checkpoint dir")
    ap.add_argument("--precisions", default="fp32,bf16")
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--passages", type=int, default=6)
    ap.add_argument("--decode-tokens", type=int, default=64)
    ap.add_argument("--random-weights", default=None, help="a --dump-request file: its config, random weights")
    ap.add_argument("--dump-request", default=None, help="write the model's config and case 0's ids, and stop")
    ap.add_argument("--no-cpu-check", dest="cpu_check", action="store_false")
    ap.add_argument("--out", default=None, help="write the results as JSON here")
    args = ap.parse_args()
    if args.dump_request:
        dump_request(args.model, args.passages, Path(args.dump_request))
        return
    device = torch.device(args.device)
    results: dict[str, Any] = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
                               "torch": torch.__version__, "host": platform.processor() or platform.machine(),
                               "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
    print(json.dumps(results), flush=True)
    for precision in args.precisions.split(","):
        try:
            run_precision(args, precision, device, results)
        except Exception:
            results[f"{precision} failed"] = traceback.format_exc()
            print(results[f"{precision} failed"], flush=True)
        if args.out:
            Path(args.out).write_text(json.dumps(results, indent=1, default=str))


if __name__ == "__main__":
    main()
