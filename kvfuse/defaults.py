"""Names and defaults that the CLI's parsers (`--help`) read without importing torch or the model.
Each is defined here once and imported by the module it belongs to."""

from pathlib import Path

# the built-in fusers, in registration order (`kvfuse/fuse/__init__.py`; `fuse.registry` checks it)
BUILTIN_MODES = ("full", "prefix", "reuse", "blend", "legolink", "queryaware")
# The mode a request with chunks gets when it names none: `generate`, `ask --index`, the server, and the
# eval's `default` method. Query-aware selection over chunks computed behind a copy of themselves
# (queryaware@0.2:behind=self), chosen on the calibration sets of both packaged models and confirmed on
# the MuSiQue dev cases (docs/benchmarks.md, issue G); blend stays the paper baseline.
DEFAULT_MODE = "queryaware"
# the store's tier budgets in bytes (`store.open_store`)
DEFAULT_CAPACITY = {"memory": 4 << 30, "disk": 20 << 30}
# a knowledge-base answer's default length: fits a sentence with a number (docs/benchmarks.md, issue L)
ANSWER_TOKENS = 48


def cpu_name() -> str:
    """The first CPU's model name in /proc/cpuinfo ("" where there is none)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return ""
    return next((ln.split(":", 1)[1].strip() for ln in text.splitlines() if ln.startswith("model name")), "")


def cpu_flags() -> frozenset[str]:
    """The first CPU's flags in /proc/cpuinfo (empty where there is none): what code paths and defaults
    are chosen by, at run time, since the machines vary."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return frozenset()
    return frozenset(next((ln.split(":", 1)[1].split() for ln in text.splitlines() if ln.startswith("flags")), []))
