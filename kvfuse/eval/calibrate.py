"""`kvfuse calibrate`: each fuser's fidelity against cost on one model, measured on a calibration set
generated for the purpose (`eval make-crosschunk` with a seed of its own, never the eval data).

Each case is laid out as the eval lays out its cases (`harness.retrieve`: its passages packed into
chunks of at most `EvalSettings.chunk_tokens` tokens, the top `top_k` by distance to the question),
so a curve measures what the eval's fidelity columns measure. Per case, full prefill's greedy answer
(at most `answer_tokens`, by default the eval's answer length, its stop token included) is the
reference; each fuser at each ratio is teacher-forced on it from its own fused cache, which gives the
mean KL(full || fused) over the answer's tokens and the first-token agreement; TTFT is the engine's,
as a ratio to full's within the case (caches precomputed, in memory). The curves are kept under the
model's fingerprint; the controller's floor for `ratio: auto` becomes each fuser's smallest ratio that
reaches the target KL (`policy.Calibration`).
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence

from kvfuse.engine.core import Engine, Mode
from kvfuse.engine.sampling import SamplingParams
from kvfuse.eval.data import Case
from kvfuse.eval.harness import EvalSettings, retrieve
from kvfuse.eval.metrics import fidelity
from kvfuse.fuse import fuser_key
from kvfuse.policy import DEFAULT_TARGET_KL, Calibration, CurvePoint
from kvfuse.text import Prompt, Tokenizer

DEFAULT_RATIOS = (0.05, 0.1, 0.15, 0.2, 0.3, 0.5)
DEFAULT_SEED = 1234  # the calibration set's own seed (the eval's generated sets use others)


def calibrate(engine: Engine, tok: Tokenizer, cases: Sequence[Case], fusers: Sequence[Mode],
              ratios: Sequence[float] = DEFAULT_RATIOS, target_kl: float = DEFAULT_TARGET_KL,
              answer_tokens: int | None = None, seed: int = 0, progress: bool = False,
              layout: EvalSettings | None = None) -> Calibration:
    """Measure every fuser at every ratio on the cases; see the module docstring."""
    from tqdm import tqdm

    layout = layout or EvalSettings()
    answer_tokens = layout.max_tokens if answer_tokens is None else answer_tokens

    made = [engine.fuser(f) for f in fusers]  # model-dependent options settled: curves name what ran
    if not all(f.takes_ratio for f in made):
        raise ValueError("only fusers that take a ratio have a curve: " + ", ".join(f.name for f in made
                                                                                  if not f.takes_ratio))
    kls: dict[tuple[str, float], list[float]] = {}
    agree: dict[tuple[str, float], list[float]] = {}
    ttft: dict[tuple[str, float], list[float]] = {}
    ref_params = SamplingParams(max_tokens=answer_tokens)
    one = SamplingParams(max_tokens=1)
    bar = tqdm(total=len(cases), desc="calibrating", unit="case", disable=not progress)
    for case in cases:
        chunks = retrieve(case, tok, layout.top_k, layout.chunk_tokens)
        req = Prompt(chunks=chunks, question=case.question).request(tok)
        for f in made:  # each fuser's chunk caches (they differ by preamble), stored before the timed runs
            engine.precompute(req, f)
        full = engine.generate(req, "full", params=ref_params, record_logits=True)
        assert full.step_logits is not None
        ref = [int(t) for t in full.step_logits.argmax(-1)]  # greedy: the tokens chosen, the stop token too
        for f in made:
            for r in ratios:
                g = engine.generate(req, f, r, params=one, score=ref)
                assert g.scored_logits is not None
                fid = fidelity(full.step_logits, g.scored_logits, ref)
                key = (fuser_key(f), r)
                kls.setdefault(key, []).append(fid.kl)
                agree.setdefault(key, []).append(fid.first_token_agreement)
                ttft.setdefault(key, []).append(g.ttft_s / full.ttft_s)
        bar.update(1)
    bar.close()
    keys = [fuser_key(f) for f in made]
    curves = {f: tuple(CurvePoint(r, statistics.mean(kls[f, r]), statistics.mean(agree[f, r]),
                                  statistics.median(ttft[f, r]), _sem(kls[f, r]))
                       for r in sorted(ratios)) for f in keys}
    return Calibration(engine.fingerprint, target_kl, curves, len(cases), seed)


def _sem(xs: list[float]) -> float:
    """The standard error of the mean of xs (0 for a single case)."""
    return statistics.stdev(xs) / len(xs) ** 0.5 if len(xs) > 1 else 0.0
