"""`kvfuse ask --json-schema FILE`: a bad file is a one-line error before any model loads."""

from __future__ import annotations

import pytest

from kvfuse.cli import main


@pytest.mark.parametrize(("text", "words"), [('{"type": "objectx"}', "schema is invalid"), ("[1", "Expecting"),
                                             ("[1, 2]", "must hold a JSON object")])
def test_a_bad_schema_file_is_refused_in_one_line(tmp_path, monkeypatch, text: str, words: str) -> None:
    import kvfuse.cli.kb as cli_kb

    monkeypatch.setattr(cli_kb, "open_kb", lambda *a, **k: pytest.fail("the model was loaded"))
    f = tmp_path / "schema.json"
    f.write_text(text)
    with pytest.raises(SystemExit, match=words):
        main(["ask", "--kb", "albaran", "--json-schema", str(f), "How long?"])
    with pytest.raises(SystemExit, match="cannot read --json-schema"):
        main(["ask", "--kb", "albaran", "--json-schema", str(tmp_path / "missing.json"), "How long?"])
