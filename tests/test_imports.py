"""The package's import graph: no cycles, no back-edges across layers, no private names across packages.

Read with `ast` from the source, so it sees imports inside functions too (a lazy import is still a
dependency). Imports under `if TYPE_CHECKING:` are annotations only, but they count as any import: for
the layers and for cycles (a circle of types is a circle a reader follows). docs/design.md draws the
same layers."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1] / "kvfuse"

# Lowest first. A module may import modules of its own layer or below, never above.
LAYERS: list[tuple[str, ...]] = [
    ("kvfuse.defaults", "kvfuse.config", "kvfuse.heap", "kvfuse.jsonfile", "kvfuse.rope", "kvfuse.kv", "kvfuse.loader",
     "kvfuse.metrics",
     "kvfuse.quant", "kvfuse.groups", "kvfuse.lowbit", "kvfuse.w8a8", "kvfuse.packed", "kvfuse.model", "kvfuse.drafts",
     "kvfuse.precision", "kvfuse.gguffile", "kvfuse.checkpoints", "kvfuse.mapped", "kvfuse.converted", "kvfuse.weights",
     "kvfuse.store"),
    ("kvfuse.request", "kvfuse.policy"),
    ("kvfuse.fuse",),
    ("kvfuse.engine.sampling", "kvfuse.engine.lmhead"),
    ("kvfuse.engine.decode", "kvfuse.engine.scheduler", "kvfuse.engine.cache", "kvfuse.engine.selfcheck"),
    ("kvfuse.engine",),
    ("kvfuse.text",),
    ("kvfuse.rag",),
    ("kvfuse.kb",),
    ("kvfuse.eval",),
    ("kvfuse.runtime", "kvfuse.profile", "kvfuse.demo"),
    ("kvfuse.server", "kvfuse.cluster"),
    ("kvfuse.cli", "kvfuse.__main__"),
]


def module_name(path: Path) -> str:
    rel = path.relative_to(ROOT.parent).with_suffix("")
    parts = rel.parts[:-1] if rel.name == "__init__" else rel.parts
    return ".".join(parts)


def layer_of(module: str) -> int:
    best, best_len = None, -1
    for i, names in enumerate(LAYERS):
        for n in names:
            if (module == n or module.startswith(n + ".")) and len(n) > best_len:
                best, best_len = i, len(n)
    if module == "kvfuse":
        return 0
    assert best is not None, f"{module} is in no layer: add it to LAYERS (and to docs/design.md)"
    return best


def _type_checking(node: ast.If) -> bool:
    t = node.test
    return (isinstance(t, ast.Name) and t.id == "TYPE_CHECKING") or (
        isinstance(t, ast.Attribute) and t.attr == "TYPE_CHECKING")


def imports(path: Path) -> list[tuple[str, list[str], bool]]:
    """(imported module, names, only for type checking) for every kvfuse import in the file."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    out: list[tuple[str, list[str], bool]] = []
    me = module_name(path)
    package = me if path.name == "__init__.py" else me.rpartition(".")[0]

    def visit(node: ast.AST, typing_only: bool) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and _type_checking(child):
                for sub in child.body:
                    visit_one(sub, True)
                for sub in child.orelse:
                    visit_one(sub, typing_only)
                continue
            visit_one(child, typing_only)

    def visit_one(child: ast.AST, typing_only: bool) -> None:
        if isinstance(child, ast.Import):
            out.extend((a.name, [], typing_only) for a in child.names if a.name.startswith("kvfuse"))
        elif isinstance(child, ast.ImportFrom):
            base = child.module or ""
            if child.level:
                base = ".".join(package.split(".")[: len(package.split(".")) - child.level + 1] + ([base] if base
                                                                                                   else []))
            if base.startswith("kvfuse"):
                names = [a.name for a in child.names]
                subs = [f"{base}.{n}" for n in names if (ROOT.parent / f"{base}.{n}".replace(".", "/")).exists()
                        or (ROOT.parent / (f"{base}.{n}".replace(".", "/") + ".py")).exists()]
                out.extend((s, [], typing_only) for s in subs)  # `from kvfuse import fuse` imports a module
                rest = [n for n in names if f"{base}.{n}" not in subs]
                if rest or not subs:
                    out.append((base, rest, typing_only))
        visit(child, typing_only)

    visit(tree, False)
    return out


FILES = sorted(ROOT.rglob("*.py"))
GRAPH = {module_name(f): imports(f) for f in FILES}


def test_every_module_has_a_layer() -> None:
    for m in GRAPH:
        layer_of(m)


@pytest.mark.parametrize("module", sorted(GRAPH))
def test_no_back_edges(module: str) -> None:
    mine = layer_of(module)
    for target, _, _ in GRAPH[module]:
        assert layer_of(target) <= mine, (
            f"{module} (layer {mine}) imports {target} (layer {layer_of(target)}): dependencies point one way")


def test_no_private_names_across_packages() -> None:
    bad = []
    for module, edges in GRAPH.items():
        pkg = module.rsplit(".", 1)[0] if module.count(".") > 1 else module
        for target, names, _ in edges:
            tpkg = target.rsplit(".", 1)[0] if target.count(".") > 1 else target
            for n in names:
                if n.startswith("_") and not n.startswith("__") and tpkg != pkg:
                    bad.append(f"{module} imports {target}.{n}")
    assert not bad, bad


def find_cycle(edges: dict[str, set[str]]) -> list[str] | None:
    """A cycle in the graph, as a path that ends where it starts, or None."""
    state: dict[str, int] = {}
    stack: list[str] = []

    def dfs(m: str) -> list[str] | None:
        state[m] = 1
        stack.append(m)
        for t in sorted(edges.get(m, ())):
            if state.get(t) == 1:
                return stack[stack.index(t):] + [t]
            if state.get(t) is None and (found := dfs(t)):
                return found
        stack.pop()
        state[m] = 2
        return None

    for m in sorted(edges):
        if m not in state and (found := dfs(m)):
            return found
    return None


def test_no_import_cycles() -> None:
    # a submodule importing its own package's __init__ (a registry filling itself) is not a cycle back
    edges = {m: {t for t, _, _ in e if t in GRAPH and t != m and not m.startswith(t + ".")}
             for m, e in GRAPH.items()}
    cycle = find_cycle(edges)
    assert cycle is None, "import cycle: " + " -> ".join(cycle or [])


def test_the_checker_catches_a_cycle_and_a_back_edge(tmp_path: Path) -> None:
    """The checks above can fail: a fake engine importing the server is a back edge."""
    assert layer_of("kvfuse.server.app") > layer_of("kvfuse.engine")
    fake = tmp_path / "kvfuse" / "engine.py"
    fake.parent.mkdir()
    fake.write_text("from kvfuse.server.app import create_app\n")
    global ROOT
    saved, ROOT = ROOT, tmp_path / "kvfuse"
    try:
        found = imports(fake)
    finally:
        ROOT = saved
    assert ("kvfuse.server.app", ["create_app"], False) in found
    assert layer_of(found[0][0]) > layer_of("kvfuse.engine")
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_the_parsers_import_no_torch() -> None:
    """`kvfuse --help` and every command's `--help` answer without torch (or the model's other heavy
    dependencies): the parsers read their defaults from `kvfuse.defaults`."""
    import subprocess
    import sys

    heavy = "('torch', 'transformers', 'fastapi', 'sentence_transformers')"
    code = (f"import sys; from kvfuse.cli.main import build_parser; build_parser(); "
            f"print([m for m in {heavy} if m in sys.modules])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
    for args in (["--help"], ["ask", "--help"], ["generate", "--help"]):
        r = subprocess.run([sys.executable, "-m", "kvfuse", *args], capture_output=True, text=True)
        assert r.returncode == 0 and "usage:" in r.stdout


def test_the_light_defaults_agree_with_the_registry() -> None:
    from kvfuse import defaults, fuse

    assert fuse.modes()[: len(defaults.BUILTIN_MODES)] == defaults.BUILTIN_MODES
    assert fuse.DEFAULT_MODE == defaults.DEFAULT_MODE in fuse.modes()


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_loading_an_engine_and_its_tokenizer_imports_neither_dynamo_nor_transformers(  # type: ignore[no-untyped-def]
        tiny_models, tmp_path, precision) -> None:
    """An engine's start reads weights into a model built on the meta device: arithmetic on meta tensors
    goes through torch's reference decompositions, whose first use imports torch._dynamo (1.6 s of every
    process's start). And the tokenizer is read by `tokenizers` itself, not through transformers (3 s)."""
    import shutil
    import subprocess
    import sys

    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel

    root = tmp_path / "ckpt"
    shutil.copytree(tiny_models["gemma3"][0], root)
    Tokenizer(WordLevel({"a": 0, "\u2581a": 1}, unk_token="a")).save(str(root / "tokenizer.json"))
    code = (f"import sys; from kvfuse.engine import Engine; from kvfuse.text.tokenizer import Tokenizer; "
            f"Tokenizer({str(root)!r}); Engine.load({str(root)!r}, precision={precision!r}, decodes='few'); "
            f"print([m for m in ('torch._dynamo', 'transformers') if m in sys.modules])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip().splitlines()[-1] == "[]"
