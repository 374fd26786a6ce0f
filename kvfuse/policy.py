"""The loading controller: pick blend's recompute ratio and the storage tier from measured costs.

The policy only: it needs a measured `Profile` (`profile` measures one with the engine). Profile
once per model and machine (kept in the cache dir): the prefill cost per token at a few
lengths, each tier's read throughput, and the KV bytes per token. Then, per request of n reused tokens:

    load_s(tier)  = kv_bytes_per_token * n / read_bytes_per_s(tier)
    full_s        = prefill_s_per_token(n) * n
    recompute_s   = r * full_s
    r             = max(r_balance, floor),  r_balance = load_s / full_s  (recompute hides behind the load)

and the recommended tier is the cheapest one whose load is no slower than recomputing at the floor
ratio: storing there costs nothing in TTFT. The seed's paper leaves these two questions to a controller
that neither LMCache nor the CacheBlend code implements.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

DEFAULT_FLOOR = 0.15
DEFAULT_COST_PER_GB = {"memory": 4.0, "disk": 0.1, "redis": 1.0}  # relative storage cost per GB; configurable


@dataclass(frozen=True, slots=True)
class TierProfile:
    read_bytes_per_s: float
    cost_per_gb: float


@dataclass(frozen=True, slots=True)
class Profile:
    model: str  # fingerprint
    machine: str
    kv_bytes_per_token: int
    prefill_s_per_token: dict[int, float]  # by prompt length (full prefill time / length)
    tiers: dict[str, TierProfile] = field(default_factory=dict)

    def prefill_cost(self, n: int) -> float:
        """Seconds per token of a full prefill of n tokens, interpolated between the profiled lengths."""
        pts = sorted(self.prefill_s_per_token.items())
        if n <= pts[0][0]:
            return pts[0][1]
        for (a, sa), (b, sb) in zip(pts, pts[1:], strict=False):
            if n <= b:
                return sa + (sb - sa) * (n - a) / (b - a)
        (a, sa), (b, sb) = pts[-2], pts[-1]  # extrapolate the last segment, never below half the cheapest
        return max(sb + (sb - sa) * (n - b) / (b - a), 0.5 * min(v for _, v in pts))

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        d["prefill_s_per_token"] = {str(k): v for k, v in self.prefill_s_per_token.items()}
        return d

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> Profile:
        return cls(
            model=d["model"],
            machine=d["machine"],
            kv_bytes_per_token=int(d["kv_bytes_per_token"]),
            prefill_s_per_token={int(k): float(v) for k, v in d["prefill_s_per_token"].items()},
            tiers={k: TierProfile(**v) for k, v in d["tiers"].items()},
        )


DEFAULT_TARGET_KL = 0.02  # the fidelity a calibrated floor must reach: teacher-forced KL(full || fused)
CONFIDENCE_Z = 1.645  # a floor's mean KL must reach the target by this many standard errors (one-sided 95%)


@dataclass(frozen=True, slots=True)
class CurvePoint:
    """One fuser at one ratio on the calibration set: mean teacher-forced KL to full, first-token
    agreement, the median TTFT ratio to full, and the standard error of the mean KL over the cases."""

    ratio: float
    kl: float
    first_token_agreement: float
    ttft_ratio: float
    kl_sem: float = 0.0

    @property
    def kl_bound(self) -> float:
        """The KL this ratio reaches with about 95% confidence: the mean plus `CONFIDENCE_Z` standard errors
        (a few calibration cases leave the mean uncertain; the floor must hold on cases it never saw)."""
        return self.kl + CONFIDENCE_Z * self.kl_sem


@dataclass(frozen=True, slots=True)
class Calibration:
    """Each fuser's fidelity-against-cost curve on one model, measured by `kvfuse calibrate` on a
    calibration set generated for it (never the eval data). A fuser's floor is the smallest ratio
    whose KL reaches the target with confidence (`CurvePoint.kl_bound`), or its highest measured ratio
    when none does."""

    model: str  # fingerprint
    target_kl: float
    curves: dict[str, tuple[CurvePoint, ...]]  # by `fuse.fuser_key` (name and every option), ascending ratio
    cases: int = 0
    seed: int = 0

    def floor(self, fuser: str) -> float | None:
        """The calibrated floor of that fuser (None: not calibrated)."""
        curve = self.curves.get(fuser)
        if not curve:
            return None
        return next((p.ratio for p in curve if p.kl_bound <= self.target_kl), curve[-1].ratio)

    def reaches_target(self, fuser: str) -> bool:
        return any(p.kl_bound <= self.target_kl for p in self.curves.get(fuser, ()))

    def predicted_kl(self, fuser: str, ratio: float) -> float | None:
        """The mean KL the curve predicts at that ratio (linear between measured ratios, clamped at the ends)."""
        return self._interpolate(fuser, ratio, lambda p: p.kl)

    def predicted_bound(self, fuser: str, ratio: float) -> float | None:
        """The KL the curve predicts at that ratio with confidence (`CurvePoint.kl_bound`, interpolated)."""
        return self._interpolate(fuser, ratio, lambda p: p.kl_bound)

    def _interpolate(self, fuser: str, ratio: float, value: Callable[[CurvePoint], float]) -> float | None:
        curve = self.curves.get(fuser)
        if not curve:
            return None
        if ratio <= curve[0].ratio:
            return value(curve[0])
        for a, b in zip(curve, curve[1:], strict=False):
            if ratio <= b.ratio:
                return value(a) + (value(b) - value(a)) * (ratio - a.ratio) / (b.ratio - a.ratio)
        return value(curve[-1])

    def keeping(self, earlier: Calibration | None) -> tuple[Calibration, list[str]]:
        """This calibration plus the curves of `earlier` it did not measure again, when both were measured
        on the same set (cases, seed) for the same target; and the fusers kept from it."""
        same_set = earlier is not None and (earlier.target_kl, earlier.cases, earlier.seed) == (
            self.target_kl, self.cases, self.seed)
        if earlier is None or not same_set:
            return self, []
        kept = sorted(set(earlier.curves) - set(self.curves))
        return replace(self, curves={**{f: earlier.curves[f] for f in kept}, **self.curves}), kept

    def to_json(self) -> dict[str, Any]:
        return {"model": self.model, "target_kl": self.target_kl, "cases": self.cases, "seed": self.seed,
                "curves": {f: [asdict(p) for p in c] for f, c in self.curves.items()},
                "floors": {f: self.floor(f) for f in self.curves}}

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> Calibration:
        curves = {f: tuple(sorted((CurvePoint(**p) for p in c), key=lambda p: p.ratio)) for f, c in d["curves"].items()}
        return cls(d["model"], float(d["target_kl"]), curves, int(d.get("cases", 0)), int(d.get("seed", 0)))


def calibration_path(cache_dir: Path, model_fp: str) -> Path:
    return cache_dir / "calibration" / f"{model_fp[:16]}.json"


@dataclass(frozen=True, slots=True)
class Decision:
    ratio: float
    tier: str
    predicted_load_s: float
    predicted_recompute_s: float
    fuser: str = "blend"
    floor: float = DEFAULT_FLOOR  # the quality floor the ratio was kept above (calibrated, or the default)
    predicted_kl: float | None = None  # the calibration's predicted fidelity at this ratio, if calibrated
    target_kl: float | None = None  # the calibration's fidelity target, if calibrated
    predicted_kl_bound: float | None = None  # the predicted KL with confidence (`CurvePoint.kl_bound`)

    @property
    def meets_target(self) -> bool | None:
        """Whether the calibration predicts, with confidence, that this ratio reaches its target (None: not
        calibrated). False says the answer is the best the fuser's calibrated ratios offer (or the ratio
        asked for), not the target's fidelity."""
        if self.predicted_kl_bound is None or self.target_kl is None:
            return None
        return self.predicted_kl_bound <= self.target_kl

    def as_dict(self) -> dict[str, Any]:
        return {"ratio": round(self.ratio, 4), "tier": self.tier, "predicted_load_s": round(self.predicted_load_s, 6),
                "predicted_recompute_s": round(self.predicted_recompute_s, 6), "fuser": self.fuser,
                "floor": round(self.floor, 4),
                "predicted_kl": _round(self.predicted_kl), "predicted_kl_bound": _round(self.predicted_kl_bound),
                "target_kl": self.target_kl, "meets_target": self.meets_target}


def _round(x: float | None) -> float | None:
    return None if x is None else round(x, 5)


class Controller:
    """ratio = max(load / full prefill, floor): the floor is the fuser's calibrated one when a
    calibration of this model has that fuser, else the fixed `floor`."""

    def __init__(self, profile: Profile, floor: float = DEFAULT_FLOOR, calibration: Calibration | None = None) -> None:
        if not 0.0 <= floor <= 1.0:
            raise ValueError(f"the ratio floor must be between 0 and 1, got {floor}")
        self.profile, self.floor, self.calibration = profile, floor, calibration

    def floor_for(self, fuser: str) -> float:
        calibrated = self.calibration.floor(fuser) if self.calibration is not None else None
        return self.floor if calibrated is None else calibrated

    def _tier(self, tier: str) -> TierProfile:
        """A tier's measured profile. A tier the profile never measured (a Redis tier added after the profile
        was saved; `kvfuse profile --refresh` measures it) is predicted as the slowest tier measured."""
        if tier in self.profile.tiers:
            return self.profile.tiers[tier]
        if not self.profile.tiers:
            raise ValueError(f"unknown tier {tier!r}: the profile measured no tier")
        return min(self.profile.tiers.values(), key=lambda t: t.read_bytes_per_s)

    def decide(self, n_tokens: int, tier: str, ratio: float | None = None, fuser: str = "blend") -> Decision:
        """The ratio for n reused tokens loaded from `tier` (or the predictions for a fixed ratio)."""
        full = self.profile.prefill_cost(n_tokens) * n_tokens
        load = self.profile.kv_bytes_per_token * n_tokens / self._tier(tier).read_bytes_per_s
        floor = self.floor_for(fuser)
        if ratio is None:
            ratio = min(1.0, max(load / full if full > 0 else 1.0, floor))
        cal = self.calibration
        kl = cal.predicted_kl(fuser, ratio) if cal is not None else None
        target = cal.target_kl if kl is not None and cal is not None else None
        bound = cal.predicted_bound(fuser, ratio) if cal is not None else None
        return Decision(ratio, tier, load, ratio * full, fuser, floor, kl, target, bound)

    def ratio_by_tier(self, n_tokens: int) -> dict[str, float]:
        return {t: round(self.decide(n_tokens, t).ratio, 4) for t in self.profile.tiers}

    def recommend_tier(self, n_tokens: int) -> str:
        """The cheapest tier whose load hides behind a recompute at the floor ratio (else the fastest)."""
        full = self.profile.prefill_cost(n_tokens) * n_tokens
        fits = [t for t in self.profile.tiers if self.decide(n_tokens, t).predicted_load_s <= self.floor * full]
        if fits:
            return min(fits, key=lambda t: self.profile.tiers[t].cost_per_gb)
        return max(self.profile.tiers, key=lambda t: self.profile.tiers[t].read_bytes_per_s)
