"""The package's layering, read from the source (nothing imported): every module of ``jax_dos`` imports only modules
below it (its import graph, counting imports inside functions and under ``TYPE_CHECKING``, has no cycle), and
``models/`` and ``train/`` use only ``jax_dos``'s public API (``import jax_dos``, no submodule)."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _modules() -> dict[str, Path]:
  out = {}
  for path in (ROOT / "jax_dos").rglob("*.py"):
    parts = path.relative_to(ROOT).with_suffix("").parts
    out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
  return out


def _imported(path: Path, package: str) -> set[str]:
  """The dotted names ``path`` imports, relative imports resolved against ``package``."""
  names = set()
  for node in ast.walk(ast.parse(path.read_text())):
    if isinstance(node, ast.Import):
      names.update(alias.name for alias in node.names)
    elif isinstance(node, ast.ImportFrom):
      base = node.module or ""
      if node.level:
        parts = package.split(".")[: len(package.split(".")) - node.level + 1]
        base = ".".join([*parts, base] if base else parts)
      names.update(f"{base}.{alias.name}" for alias in node.names)
      names.add(base)
  return names


def import_graph() -> dict[str, set[str]]:
  """``module -> the jax_dos modules it imports`` (a name resolves to its longest module prefix; a package's own
  ``__init__`` and the root package, which re-export, are left out)."""
  modules = _modules()

  def resolve(name: str) -> str | None:
    while name and name not in modules:
      name = name.rpartition(".")[0]
    return name or None

  graph = {}
  for name, path in modules.items():
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    targets = {resolve(n) for n in _imported(path, package) if n.startswith("jax_dos")}
    graph[name] = {t for t in targets if t and t != name and t != "jax_dos" and not name.startswith(t + ".")}
  return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
  state: dict[str, int] = {}
  stack: list[str] = []

  def visit(node: str) -> list[str] | None:
    state[node] = 1
    stack.append(node)
    for nxt in sorted(graph.get(node, ())):
      if state.get(nxt) == 1:
        return [*stack[stack.index(nxt) :], nxt]
      if not state.get(nxt) and (cycle := visit(nxt)):
        return cycle
    stack.pop()
    state[node] = 2
    return None

  for node in sorted(graph):
    if not state.get(node) and (cycle := visit(node)):
      return cycle
  return None


def test_jax_dos_modules_import_only_modules_below_them():
  graph = import_graph()
  assert len(graph) > 40 and sum(map(len, graph.values())) > 100  # the graph was read
  cycle = find_cycle(graph)
  assert cycle is None, "an import cycle: " + " -> ".join(cycle)


def test_the_cycle_finder_finds_one():
  assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
  assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_models_and_train_use_only_the_public_api():
  modules = set(_modules()) - {"jax_dos"}
  private = []
  for folder in ("models", "train"):
    for path in (ROOT / folder).rglob("*.py"):
      for name in _imported(path, folder):
        if any(name == m or name.startswith(m + ".") for m in modules):  # a submodule, not a name of the API
          private.append(f"{path.relative_to(ROOT)}: {name}")
  assert not private, private
