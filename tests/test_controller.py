import pytest
from conftest import rand_ids

from kvfuse import fuse
from kvfuse.engine import Engine, Request, RequestError
from kvfuse.policy import Controller, Profile, TierProfile
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
        Controller(Profile("m", "x", 10, {100: 0.002}, {})).decide(10, "tape")


def test_a_tier_the_profile_lacks_is_predicted_as_the_slowest_measured() -> None:
    tiers = {"memory": TierProfile(1e10, 4.0), "disk": TierProfile(1e8, 0.1)}
    c = Controller(Profile("m", "x", 1000, {100: 0.002, 300: 0.001}, tiers))
    assert c.decide(300, "redis").predicted_load_s == c.decide(300, "disk").predicted_load_s
    assert c.decide(300, "redis").predicted_load_s > c.decide(300, "memory").predicted_load_s


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


def test_a_calibrated_floor_is_the_smallest_ratio_that_reaches_the_target() -> None:
    from kvfuse.policy import Calibration, CurvePoint

    pts = (CurvePoint(0.05, 0.09, 0.6, 0.1), CurvePoint(0.15, 0.04, 0.8, 0.2), CurvePoint(0.3, 0.015, 0.9, 0.35),
           CurvePoint(0.5, 0.01, 1.0, 0.55))
    never = (CurvePoint(0.1, 0.2, 0.5, 0.1), CurvePoint(0.5, 0.05, 0.8, 0.5))
    cal = Calibration("m", 0.02, {"blend": never, "queryaware": pts})
    assert cal.floor("queryaware") == 0.3 and cal.reaches_target("queryaware")
    assert cal.floor("blend") == 0.5 and not cal.reaches_target("blend")  # none reaches it: the highest ratio
    assert cal.floor("legolink") is None
    assert cal.predicted_kl("queryaware", 0.1) == pytest.approx(0.065) and cal.predicted_kl("queryaware", 0.9) == 0.01
    assert Calibration.from_json(cal.to_json()) == cal
    ctl = Controller(_profile(), floor=0.15, calibration=cal)
    d = ctl.decide(1000, "memory", fuser="queryaware")  # loading is fast: the calibrated floor decides
    assert d.ratio == 0.3 and d.floor == 0.3 and d.predicted_kl == pytest.approx(0.015) and d.fuser == "queryaware"
    assert ctl.decide(1000, "memory", fuser="legolink").ratio == 0.15  # not calibrated: the fixed floor
    assert set(d.as_dict()) >= {"ratio", "tier", "fuser", "floor", "predicted_kl", "target_kl", "meets_target"}
    assert d.meets_target is (d.predicted_kl_bound <= cal.target_kl)  # type: ignore[operator]
    low = ctl.decide(1000, "memory", 0.05, "queryaware")  # a fixed ratio under the floor: predicted to miss
    assert low.meets_target is False and low.target_kl == cal.target_kl
    assert ctl.decide(1000, "memory", fuser="blend").meets_target is False  # no ratio reaches it: said so
    # a mean under the target with a wide spread over the cases is not a floor: the next ratio is
    unsure = (CurvePoint(0.2, 0.018, 0.8, 0.3, kl_sem=0.004), CurvePoint(0.4, 0.012, 0.9, 0.5, kl_sem=0.004))
    wide = Calibration("m", 0.02, {"queryaware": unsure})
    assert unsure[0].kl_bound == pytest.approx(0.018 + 1.645 * 0.004) and wide.floor("queryaware") == 0.4
    assert Calibration.from_json(wide.to_json()) == wide
    sure = Controller(_profile(), floor=0.15, calibration=wide)
    at = sure.decide(1000, "memory", fuser="queryaware")
    assert at.ratio == 0.4 and at.meets_target and at.predicted_kl_bound == pytest.approx(unsure[1].kl_bound)
    assert sure.decide(1000, "memory", 0.2, "queryaware").meets_target is False  # its mean alone would pass


def test_calibrate_measures_curves_and_ratio_auto_uses_them(tiny_models, tmp_path) -> None:
    """`eval.calibrate` on a tiny model: at ratio 1.0 every fuser equals full (KL 0); the floor it
    stores is what ratio 'auto' then keeps above, and the answer reports it."""
    from chartok import CharTokenizer

    from kvfuse.eval.calibrate import calibrate
    from kvfuse.eval.data import cases_from
    from kvfuse.profile import load_calibration, save_calibration

    root, _ = tiny_models["llama"]
    lm = load_model(root)
    e = Engine(lm.model, lm.fingerprint)
    raw = [{"question": f"Who is number {i}?", "answers": ["x"],
            "ctxs": [{"title": "A", "text": "Ada lives at number 4 on the hill."},
                     {"title": "B", "text": f"The person at number {i} is Ada."}]} for i in range(2)]
    tok = CharTokenizer()
    cal = calibrate(e, tok, cases_from(raw, "test"), ["blend", "queryaware"], (0.0, 0.5, 1.0), 0.01,  # type: ignore[arg-type]
                    answer_tokens=3)
    keys = [fuse.fuser_key(e.fuser(f)) for f in ("blend", "queryaware")]  # options settled for the model
    assert set(cal.curves) == set(keys) and keys[0].startswith("blend:") and ":behind=" in keys[1]
    for f in keys:
        curve = cal.curves[f]
        assert [p.ratio for p in curve] == [0.0, 0.5, 1.0]
        assert curve[-1].kl < 1e-6 and curve[-1].first_token_agreement == 1
        assert curve[0].kl > curve[-1].kl and cal.floor(f) == next(p.ratio for p in curve if p.kl <= 0.01)
    assert load_calibration(tmp_path, e.fingerprint) is None
    save_calibration(cal, tmp_path)
    assert load_calibration(tmp_path, e.fingerprint) == cal
    e.controller = Controller(_profile(), floor=0.0, calibration=cal)
    req = Request(prefix=(1,) + rand_ids(4, 50), chunks=(rand_ids(20, 51), rand_ids(15, 52)), suffix=rand_ids(4, 53))
    from kvfuse.engine.sampling import SamplingParams

    g = e.generate(req, "queryaware", "auto", SamplingParams(max_tokens=1))
    assert g.controller is not None and g.controller.fuser == keys[1]
    assert g.ratio == g.controller.ratio >= cal.floor(keys[1]) == g.controller.floor  # type: ignore[operator]
    other = fuse.QueryAware(layers="all")  # other options: another fuser, with no curve of its own
    g2 = e.generate(req, other, "auto", SamplingParams(max_tokens=1))
    assert g2.controller is not None and g2.controller.floor == 0.0 and g2.controller.predicted_kl is None
