"""The greedy head's int8 screen on each kernel (`lmhead.SCREENS`): time per call and rows that pass it.

    .venv/bin/python benchmarks/greedy_screen.py [--steps 24] [--rounds 7]

Gemma 3 270M (fp32): MuSiQue dev case 0 (6 passages) is prefilled and decoded greedily for `--steps`
tokens; the final-normed hidden states of those steps are the inputs. For 1, 2, 4 and 8 rows, each
kernel's `argmax_rows` (screen, bound, exact float32 logits of the rows that pass) is timed, interleaved,
median of `--rounds`; the candidates per row are counted over every step. Both must give the float32
head's argmax on every row (checked).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).parent))
from common import musique_cases, musique_prompt  # noqa: E402

from kvfuse.checkpoints import resolve_model_path  # noqa: E402
from kvfuse.engine import Engine  # noqa: E402
from kvfuse.engine.lmhead import SCREENS, GreedyHead  # noqa: E402
from kvfuse.engine.sampling import SamplingParams  # noqa: E402
from kvfuse.text import Tokenizer  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=24)
    ap.add_argument("--rounds", type=int, default=7)
    args = ap.parse_args()
    torch.set_num_threads(2)
    path = resolve_model_path(None)
    engine = Engine.load(path, greedy_screen=False)
    req = musique_prompt(musique_cases()[0], 6).request(Tokenizer(path))
    g = engine.generate(req, "full", params=SamplingParams(max_tokens=args.steps + 1, ignore_eos=True),
                        record_logits=True)
    with torch.inference_mode():  # the normed hidden states of the steps, from a teacher-forced pass
        ids = torch.tensor(list(engine.preamble) + list(req.ids) + g.tokens[:-1])
        h = engine.model.norm(_last_hidden(engine, ids)[-args.steps :])
    weight = engine.model.head_weight()
    want = [int(r.argmax()) for r in F.linear(h, weight)]
    heads = {k: GreedyHead(weight, k) for k in SCREENS}
    for k, head in heads.items():
        assert head.argmax_rows(h) == want, k
        cands = [len(c) for c in head.candidates_rows(h)]
        print(f"{k}: candidates per row median {statistics.median(cands)}, max {max(cands)}")
    for rows in (1, 2, 4, 8):
        times: dict[str, list[float]] = {k: [] for k in heads}
        for _ in range(args.rounds):
            for k, head in heads.items():
                t = time.perf_counter()
                head.argmax_rows(h[:rows])
                times[k].append(time.perf_counter() - t)
        print(f"{rows} rows: " + ", ".join(f"{k} {1000 * statistics.median(v):.2f} ms" for k, v in times.items()))


def _last_hidden(engine: Engine, ids: torch.Tensor) -> torch.Tensor:
    """Every position's last hidden state (before the final norm) of a full forward pass."""
    model = engine.model
    pos = torch.arange(ids.shape[0])
    x = model.embed(ids)
    for i in range(model.cfg.num_layers):
        q, k, v = model.project(i, x, pos)
        x = model.finish(i, x, model.attend(i, q, pos, k, v, pos))
    return x


if __name__ == "__main__":
    main()
