"""The package's import graph, read from the source: every module imports only from its own
layer or the layers to its left (kernels <- layers <- models <- engine <- entrypoints, with the
shared helpers below them all), no two modules import each other through any chain, and no
module imports another module's private names."""
import ast
from pathlib import Path

import nanovllm

ROOT = Path(nanovllm.__file__).parent
# Longest matching prefix wins; a module may import from its own layer and the ones below.
LAYERS = {
    "nanovllm.distributed": 0, "nanovllm.sampling_params": 0, "nanovllm.utils": 0,
    "nanovllm.kernels": 1,
    "nanovllm.layers": 2,
    "nanovllm.models": 3,
    "nanovllm.config": 4, "nanovllm.engine": 4, "nanovllm.llm": 4,
    "nanovllm.entrypoints": 5, "nanovllm.integrations": 5, "nanovllm.serve": 5, "nanovllm.__main__": 5,
    "nanovllm": 5,
}


def module_name(path: Path) -> str:
    parts = ("nanovllm",) + path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(p): p for p in ROOT.rglob("*.py")}


def layer(module: str) -> int:
    prefix = max((p for p in LAYERS if module == p or module.startswith(p + ".")), key=len)
    return LAYERS[prefix]


def imports(module: str) -> list[tuple[str, list[str]]]:
    """(imported module, names taken from it) for every nanovllm import in the module's file,
    at any depth: a lazy import inside a function is an edge all the same."""
    found = []
    package = module if MODULES[module].name == "__init__.py" else module.rpartition(".")[0]
    for node in ast.walk(ast.parse(MODULES[module].read_text())):
        if isinstance(node, ast.Import):
            found += [(alias.name, []) for alias in node.names if alias.name.startswith("nanovllm")]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package.split(".")[:len(package.split(".")) - node.level + 1] + ([base] if base else []))
            if not base.startswith("nanovllm"):
                continue
            for alias in node.names:  # `from package import submodule` imports the submodule
                sub = f"{base}.{alias.name}"
                found.append((sub, []) if sub in MODULES else (base, [alias.name]))
    return found


def test_every_import_points_left():
    back_edges = [f"{m} ({layer(m)}) imports {target} ({layer(target)})"
                  for m in MODULES for target, _ in imports(m) if layer(target) > layer(m)]
    assert back_edges == []


def test_no_import_cycle():
    graph = {m: {t for t, _ in imports(m) if t in MODULES and t != m} for m in MODULES}
    cycles, state = [], {}

    def visit(m, path):
        state[m] = "open"
        for t in sorted(graph[m]):
            if state.get(t) == "open":
                cycles.append(" -> ".join(path[path.index(t):] + [t]))
            elif t not in state:
                visit(t, path + [t])
        state[m] = "done"

    for m in sorted(MODULES):
        if m not in state:
            visit(m, [m])
    assert cycles == []


def test_no_private_name_crosses_a_file():
    private = [f"{m} imports {target}:{name}" for m in MODULES for target, names in imports(m)
               for name in names + [target.rpartition(".")[2]]
               if name.startswith("_") and not name.startswith("__") and target != m]
    assert private == []


def test_the_graph_is_read():
    """The walk above sees the imports it judges: a known edge of each kind is found."""
    assert ("nanovllm.kernels", []) in imports("nanovllm.layers.sampler")
    assert ("nanovllm.engine.model_runner", ["ModelRunner"]) in imports("nanovllm.llm")
    assert layer("nanovllm.kernels.cuda.sampling") == 1 and layer("nanovllm.config") == 4
