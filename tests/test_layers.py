"""The package's import graph, read from the code (every `import`, function-level ones and a
module-level `__getattr__`'s included, and every `importlib.import_module` of a name written
out; only `if TYPE_CHECKING:` blocks left out): no import cycle and the layering rules of
docs/architecture.md.

What the code breaks is listed in `KNOWN` (empty from issue 34 to 48): a cycle or a broken rule
that is not listed fails, and so does a listed one that is gone, so the list stays exactly
the debt that is left and can only shrink."""

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "meshtrain"

# (who, what it may not import, why) — docs/architecture.md, "Layers".
RULES = [
    (("models",), ("*",), "models import nothing else of meshtrain"),
    (("parallel",), ("models", "recipe", "recipes", "cli", "train", "run_folder", "job"),
     "strategies name no model, recipe or command line (its config included)"),
    (("recipes",), ("hf", "cli", "train", "run_folder", "job", "lockstep", "verifier", "report"),
     "a model family's recipe is below Hugging Face interop, the API and the command line"),
    (("hf",), ("cli", "train", "run_folder", "job", "lockstep", "verifier", "report"),
     "Hugging Face interop is below the API and the command line"),
    (("checkpoint", "plan"), ("recipes", "hf", "cli", "train", "run_folder", "job"),
     "checkpoints and the planner take typed inputs, not a recipe or the command line's config"),
    (("bench",), ("cli", "train"),
     "bench takes typed options (bench.BenchOptions); the command line fills them from its config and hands in "
     "the train loop's step"),
    (("session", "job", "lockstep", "searched", "layout_search", "search_plan", "replicas", "replica_state"),
     ("cli", "train", "run_folder", "report", "bench"),
     "the API imports nothing of the command line (verifier, the comparison with one process, is both's)"),
]
# The debt left: each entry a cycle ("cycle: a, b, ...") or a broken rule ("a -> b"). Issue 34
# paid it off; a new one fails the test.
KNOWN: set[str] = set()


def module_name(path: Path, root: Path = PACKAGE) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _left_out(tree: ast.Module) -> set[int]:
    """Lines that are no dependency of the module's own code: `if TYPE_CHECKING:` blocks (read
    by type checkers only). A module-level `__getattr__` is code like any other: what it imports
    is read."""
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            out |= {n.lineno for n in ast.walk(node) if hasattr(n, "lineno")}
    return out


def import_graph(root: Path = PACKAGE) -> dict[str, set[str]]:
    """module -> the package's modules it imports (names relative to the package)."""
    files = {module_name(p, root): p for p in root.rglob("*.py")}

    def resolve(name: str) -> str | None:  # the longest module of the package `name` names
        while name and name not in files:
            name = name.rpartition(".")[0]
        return name or None

    graph = {m: set() for m in files}
    for module, path in files.items():
        tree = ast.parse(path.read_text())
        skip = _left_out(tree)
        for node in ast.walk(tree):
            if getattr(node, "lineno", None) in skip:
                continue
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and not node.level:
                names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
            elif (isinstance(node, ast.Call) and ast.unparse(node.func).endswith("import_module")
                  and node.args and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str)):
                names = [node.args[0].value]
            else:
                continue
            for name in names:
                head, _, rest = name.partition(".")
                if head == root.name and rest and (target := resolve(rest)) and target != module:
                    graph[module].add(target)
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan, iterative)."""
    index, low, on, stack, found, counter = {}, {}, set(), [], [], [0]
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = counter[0]
        counter[0] += 1
        stack.append(start)
        on.add(start)
        while work:
            v, children = work[-1]
            w = next(children, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = counter[0]
                    counter[0] += 1
                    stack.append(w)
                    on.add(w)
                    work.append((w, iter(sorted(graph[w]))))
                elif w in on:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                component = []
                while True:
                    w = stack.pop()
                    on.discard(w)
                    component.append(w)
                    if w == v:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def _under(module: str, prefixes) -> bool:
    return any(p == "*" or module == p or module.startswith(p + ".") for p in prefixes)


def broken_rules(graph: dict[str, set[str]]) -> dict[str, str]:
    """"a -> b" -> the rule it breaks."""
    out = {}
    for a, targets in graph.items():
        for who, forbidden, why in RULES:
            if _under(a, who):
                for b in targets:
                    if _under(b, forbidden) and not _under(b, who):
                        out[f"{a} -> {b}"] = why
    return out


def debt(root: Path = PACKAGE) -> dict[str, str]:
    graph = import_graph(root)
    found = {"cycle: " + ", ".join(c): "an import cycle" for c in cycles(graph)}
    found.update(broken_rules(graph))
    return found


def test_no_import_cycle_or_broken_layer_beyond_the_known_debt():
    found = debt()
    new = sorted(set(found) - KNOWN)
    assert not new, "new: " + "; ".join(f"{d} ({found[d]})" for d in new)
    gone = sorted(KNOWN - set(found))
    assert not gone, "fixed, so take them out of KNOWN in tests/test_layers.py: " + "; ".join(gone)


def test_the_reader_finds_a_reintroduced_cycle_and_a_model_importing_a_strategy(tmp_path):
    """The graph reader on a package of its own: a function-level import that closes a
    cycle, a model importing a strategy, and imports inside a module-level `__getattr__` (an
    `import` and an `importlib.import_module`) are all found; a TYPE_CHECKING import is not."""
    pkg = tmp_path / "meshtrain"
    (pkg / "models").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "models" / "__init__.py").write_text("")
    (pkg / "mesh.py").write_text("def comm():\n    from meshtrain.comm import Comm\n    return Comm\n")
    (pkg / "comm.py").write_text("from meshtrain.mesh import comm\n")
    (pkg / "parallel.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
                                     "    from meshtrain.models import gpt\n")
    (pkg / "models" / "gpt.py").write_text("import meshtrain.parallel\n")
    (pkg / "models" / "llama.py").write_text("def __getattr__(name):\n    from meshtrain.recipes import plan\n"
                                             "    return plan\n")
    (pkg / "models" / "mlp.py").write_text("def __getattr__(name):\n    import importlib\n"
                                           "    return importlib.import_module('meshtrain.comm')\n")
    (pkg / "recipes.py").write_text("")
    found = debt(pkg)
    assert set(found) == {"cycle: comm, mesh", "models.gpt -> parallel", "models.llama -> recipes",
                          "models.mlp -> comm"}
