"""OpenAI's logit adjustments (logit_bias, presence_penalty, frequency_penalty) against a naive oracle:
each token a greedy request generates is the argmax of its step's logits adjusted by hand."""

import pytest
import torch
from conftest import rand_ids

from kvfuse.engine import Request
from kvfuse.engine.sampling import SamplingParams, sample


def _by_hand(logits: torch.Tensor, bias: dict[int, float], presence: float, frequency: float,
             before: list[int]) -> int:
    out = logits.float().clone()
    for t, b in bias.items():
        out[t] += b
    for t in set(before):
        out[t] -= before.count(t) * frequency + presence
    return int(out.argmax())


@pytest.mark.parametrize("family", ["gemma3", "llama"])
def test_adjusted_greedy_tokens_match_the_oracle(tiny_engines, family: str) -> None:
    e = tiny_engines[family]
    req = Request(prefix=(1,) + rand_ids(12, 4), suffix=rand_ids(4, 5))
    plain = e.generate(req, "full", None, SamplingParams(max_tokens=10, ignore_eos=True), record_logits=True)
    banned = plain.tokens[0]  # the token greedy picks first, banned; another pushed up
    assert plain.step_logits is not None
    third = int(plain.step_logits[0].topk(3).indices[2])
    bias = {banned: -100.0, third: 0.5}
    for presence, frequency in ((0.0, 0.0), (0.0, 2.0), (1.5, 0.0), (-2.0, 1.0)):
        params = SamplingParams(max_tokens=10, ignore_eos=True, logit_bias=tuple(bias.items()),
                                presence_penalty=presence, frequency_penalty=frequency)
        g = e.generate(req, "full", None, params, record_logits=True)
        assert g.step_logits is not None and banned not in g.tokens
        for i, tok in enumerate(g.tokens):
            assert tok == _by_hand(g.step_logits[i], bias, presence, frequency, g.tokens[:i])
        # and without recording (the decode path that screens the head for plain greedy requests)
        assert e.generate(req, "full", None, params).tokens == g.tokens
    repeat = SamplingParams(max_tokens=10, ignore_eos=True, frequency_penalty=2.0)
    penalised = e.generate(req, "full", None, repeat).tokens
    assert len(set(penalised)) >= len(set(plain.tokens))  # a frequency penalty never adds repeats here


def test_sample_adjusts_before_choosing() -> None:
    logits = torch.tensor([0.0, 5.0, 4.0, 1.0])
    assert sample(logits, SamplingParams()) == 1
    assert sample(logits, SamplingParams(logit_bias=((1, -100.0),))) == 2
    assert sample(logits, SamplingParams(frequency_penalty=1.0), generated=[1, 1]) == 2  # 5 - 2 < 4
    assert sample(logits, SamplingParams(presence_penalty=0.5), generated=[1, 1]) == 1  # 5 - 0.5 > 4
    with pytest.raises(ValueError, match="presence_penalty"):
        SamplingParams(presence_penalty=2.5)
    with pytest.raises(ValueError, match="logit_bias"):
        SamplingParams(logit_bias=((3, 101.0),))
