"""The load-time self-check's answer is kept per model, software and machine: a second load of the same
checkpoint does not run it again, and a failure is never kept (its message is the model's own)."""

from __future__ import annotations

from kvfuse.engine import Engine


def test_a_passed_self_check_is_kept_and_a_failed_one_is_not(tiny_models, tmp_path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    monkeypatch.setenv("KVFUSE_CACHE_DIR", str(tmp_path / "cache"))
    root = tiny_models["llama"][0]
    runs: list[str] = []
    real = Engine._self_check

    def counted(self: Engine) -> str | None:
        runs.append(self.fingerprint)
        return real(self)

    monkeypatch.setattr(Engine, "_self_check", counted)
    first, second = Engine.load(root, decodes="none"), Engine.load(root, decodes="none")
    assert first.blend_error is None and second.blend_error is None
    assert len(runs) == 1  # kept after the first load
    Engine.load(root, precision="int8", decodes="none")
    assert len(runs) == 2  # another precision is another model

    def broken(self: Engine) -> str | None:
        runs.append(self.fingerprint)
        return "blend at 1.0 differs from full"

    monkeypatch.setattr(Engine, "_self_check", broken)
    a, b = Engine.load(root, precision="bf16", decodes="none"), Engine.load(root, precision="bf16", decodes="none")
    assert a.blend_error == b.blend_error == "blend at 1.0 differs from full" and len(runs) == 4
