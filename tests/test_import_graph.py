"""Who imports whom, read from the source (every import, at module level or inside a function): no circles, the
serving path never reaches a measurement tool, and `qflash serve --help` loads no torch."""

import ast
import tomllib

import pytest

from conftest import REPO, run_python

PACKAGE_DIRS = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"]
TOOLS = "qflash.server.tools"
# What a running server loads: the plugin (with the hooks, the model class and the quantization method it
# registers), and what those reach.
SERVING = ("qflash.server.plugin",)


def modules() -> dict[str, "Path"]:  # noqa: F821
    found = {}
    for package, folder in PACKAGE_DIRS.items():
        for path in (REPO / folder).rglob("*.py"):
            parts = path.relative_to(REPO / folder).with_suffix("").parts
            found[".".join((package, *parts[:-1])) if parts[-1] == "__init__" else ".".join((package, *parts))] = path
    return found


MODULES = modules()


def imports(name: str) -> set[str]:
    """The qflash modules `name` imports anywhere in its source."""
    tree, out = ast.parse(MODULES[name].read_text()), set()
    package = name if MODULES[name].name == "__init__.py" else name.rpartition(".")[0]
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1] + ([base] if base else []))
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in MODULES else base for a in node.names]
        else:
            continue
        for target in targets:
            while target and target not in MODULES:  # `import qflash.x.y` names a module or an attribute of one
                target = target.rpartition(".")[0]
            if target and target != name:
                out.add(target)
    return out


GRAPH = {name: imports(name) for name in MODULES}


def reach(start: str) -> set[str]:
    seen, todo = set(), [start]
    while todo:
        for nxt in GRAPH[todo.pop()] - seen:
            seen.add(nxt)
            todo.append(nxt)
    return seen


def test_the_graph_sees_the_packages():
    assert {"qflash.server.plugin", "qflash.server.hooks", "qflash.kernels.w8a8_gemm", "qflash.quant.method",
            "qflash.graphs.policy", f"{TOOLS}.bench"} <= set(MODULES)
    assert "qflash.kernels.config_table" in GRAPH["qflash.kernels.w8a8_gemm"]


def test_no_module_imports_itself_through_others():
    cycles = sorted(name for name in MODULES if name in reach(name))
    assert not cycles, {name: sorted(GRAPH[name] & {c for c in cycles}) for name in cycles}


@pytest.mark.parametrize("start", SERVING + tuple(m for m in MODULES if m.startswith(("qflash.kernels", "qflash.graphs", "qflash.server.hooks"))))
def test_the_serving_path_never_reaches_a_measurement_tool(start):
    assert not sorted(m for m in reach(start) | {start} if m.startswith(TOOLS))


def test_the_cli_imports_a_subcommand_only_when_it_runs():
    assert GRAPH["qflash.server.cli"] == {"qflash.server.errors"}


def test_serve_help_loads_no_torch():
    code = ("import sys\nfrom qflash.server.cli import main\ntry:\n    main(['serve', '--help'])\nexcept SystemExit:\n    pass\n"
            "print(sorted(m for m in ('torch', 'sglang', 'transformers', 'triton') if m in sys.modules))")
    result = run_python(code)
    assert result.returncode == 0 and "--api-key" in result.stdout, result.stderr[-2000:]
    assert result.stdout.strip().splitlines()[-1] == "[]"
