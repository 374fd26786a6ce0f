import pytest
from conftest import rand_ids

from kvfuse.control.policy import Controller, Profile, TierProfile
from kvfuse.engine import Engine, Request, RequestError
from kvfuse.weights import load_model

GB = 1e9


def _profile() -> Profile:
    # 1 ms per token of full prefill; 100 kB of KV per token
    return Profile(
        model="m", machine="x", kv_bytes_per_token=100_000,
        prefill_s_per_token={256: 0.001, 2048: 0.001},
        tiers={
            "memory": TierProfile(read_bytes_per_s=10 * GB, cost_per_gb=4.0),
            "ssd": TierProfile(read_bytes_per_s=1 * GB, cost_per_gb=0.5),
            "hdd": TierProfile(read_bytes_per_s=0.2 * GB, cost_per_gb=0.05),
        },
    )


def test_ratio_is_the_balance_point_or_the_floor() -> None:
    ctl = Controller(_profile(), floor=0.15)
    n = 1000  # full prefill 1 s; loads: memory 0.01 s, ssd 0.1 s, hdd 0.5 s
    assert ctl.decide(n, "memory").ratio == 0.15  # loading is fast: the quality floor decides
    hdd = ctl.decide(n, "hdd")
    assert hdd.ratio == pytest.approx(0.5) and hdd.predicted_load_s == pytest.approx(0.5)
    assert hdd.predicted_recompute_s == pytest.approx(hdd.predicted_load_s)  # recompute hides behind the load
    assert ctl.ratio_by_tier(n) == {"memory": 0.15, "ssd": 0.15, "hdd": 0.5}
    fixed = ctl.decide(n, "ssd", ratio=0.3)
    assert fixed.ratio == 0.3 and fixed.predicted_recompute_s == pytest.approx(0.3)


def test_recommends_the_cheapest_tier_that_loads_in_the_shadow_of_the_recompute() -> None:
    ctl = Controller(_profile(), floor=0.15)
    assert ctl.recommend_tier(1000) == "ssd"  # 0.1 s load <= 0.15 s recompute; hdd's 0.5 s is not
    assert Controller(_profile(), floor=0.6).recommend_tier(1000) == "hdd"
    assert Controller(_profile(), floor=0.001).recommend_tier(1000) == "memory"  # none hides: the fastest


def test_profile_interpolates_and_round_trips() -> None:
    p = Profile("m", "x", 10, {100: 0.002, 300: 0.001, 500: 0.0012}, {"memory": TierProfile(1.0, 1.0)})
    assert p.prefill_cost(200) == pytest.approx(0.0015) and p.prefill_cost(50) == 0.002
    assert p.prefill_cost(10**7) > 0
    assert Profile.from_json(p.to_json()) == p
    with pytest.raises(ValueError, match="unknown tier 'tape'"):
        Controller(p).decide(10, "tape")


def test_engine_ratio_auto(tiny_models) -> None:
    lm = load_model(tiny_models["llama"][0])
    e = Engine(lm.model, lm.fingerprint)
    req = Request(prefix=(1, 5, 6), chunks=(rand_ids(30, 90), rand_ids(30, 91)), suffix=rand_ids(3, 92))
    with pytest.raises(RequestError, match="kvfuse profile"):
        e.prefill(req, "blend", "auto")
    with pytest.raises(RequestError, match="or 'auto'"):
        e.prefill(req, "blend", "fast")
    slow_memory = Profile("m", "x", 100_000, {64: 0.001}, {"memory": TierProfile(6e6 / (0.6 * 0.06), 1.0)})
    e.controller = Controller(slow_memory, floor=0.15)  # loading 60 tokens takes 60% of their prefill
    out = e.generate(req, "blend", "auto")
    assert out.controller is not None and out.controller.tier == "memory"
    assert out.controller.ratio == pytest.approx(0.6) and out.ratio == out.controller.ratio
    fixed = e.generate(req, "blend", 0.2)
    assert fixed.controller is not None and fixed.controller.ratio == 0.2
