"""The package's shape, checked: no import cycles, the rank side free of Spark and of the driver,
no private name used across modules, the process contract declared once (spark_dl/protocol.py),
no module much over 500 lines, and every documented import path still importing."""
from __future__ import annotations

import ast
import importlib
import pathlib
import re
import subprocess
import sys

import pytest

import spark_dl
from spark_dl import protocol

PACKAGE = pathlib.Path(spark_dl.__file__).parent
MAX_LINES = 520
# spark_dl._native is the C extension; compression/native.py is the one module that wraps it
PRIVATE_OK = {("spark_dl.compression.native", "spark_dl._native")}
# what code in spark_dl.rank may not import, at any depth of its own imports
RANK_FORBIDDEN = ("pyspark", "py4j", "spark_dl.driver", "spark_dl.task", "spark_dl.tracking.driver")


def _name(path: pathlib.Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def _imports(module: str) -> list[tuple[str, str | None, bool]]:
    """(module imported, name taken from it or None, at module level) for every import in
    ``module``, relative ones resolved, those under ``if TYPE_CHECKING:`` left out."""
    path = MODULES[module]
    tree = ast.parse(path.read_text())
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    typing_only = {id(n) for node in ast.walk(tree) if isinstance(node, ast.If)
                   and getattr(node.test, "id", getattr(node.test, "attr", None)) == "TYPE_CHECKING"
                   for n in ast.walk(node)}
    top = {id(n) for n in tree.body}
    out = []
    for node in ast.walk(tree):
        if id(node) in typing_only:
            continue
        if isinstance(node, ast.Import):
            out += [(a.name, None, id(node) in top) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                parts = parts[: len(parts) - node.level + 1]
                base = ".".join(parts + ([node.module] if node.module else []))
            for a in node.names:
                sub = f"{base}.{a.name}"
                out.append((sub, None, id(node) in top) if sub in MODULES else (base, a.name, id(node) in top))
    return out


def _graph() -> dict[str, set[str]]:
    return {m: {t for t, _, _ in _imports(m) if t in MODULES and t != m} for m in MODULES}


def test_the_package_has_no_import_cycles():
    graph = _graph()
    cycles, index, low, stack, on_stack = [], {}, {}, [], set()

    def visit(v: str) -> None:  # Tarjan's strongly connected components
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for v in graph:
        if v not in index:
            visit(v)
    assert cycles == [], f"import cycles (function-level imports count too): {cycles}"


def test_the_rank_side_imports_no_spark_and_nothing_of_the_driver_or_the_task():
    graph = _graph()
    externals = {m: {t for t, _, _ in _imports(m) if t not in MODULES} for m in MODULES}
    bad = []
    for start in (m for m in MODULES if m == "spark_dl.rank" or m.startswith("spark_dl.rank.")):
        seen, todo = {start}, [start]
        while todo:
            m = todo.pop()
            for t in graph[m] | externals[m]:
                if t.startswith(RANK_FORBIDDEN):
                    bad.append(f"{start} -> ... -> {m} imports {t}")
                if t in MODULES and t not in seen:
                    seen.add(t)
                    todo.append(t)
    assert bad == []


def test_a_rank_process_never_imports_pyspark():
    code = ("import sys, spark_dl.rank.main, spark_dl.tracking.rank.lifecycle, spark_dl.horovod, spark_dl.compression;"
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('pyspark', 'py4j')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_the_transport_imports_only_the_protocol_and_the_errors():
    bad = [f"{m} imports {t}" for m in MODULES if m.startswith("spark_dl.transport")
           for t, _, _ in _imports(m) if t.startswith("spark_dl") and t not in (
               "spark_dl", "spark_dl.protocol", "spark_dl.errors") and not t.startswith("spark_dl.transport")]
    assert bad == []


def test_no_private_name_is_imported_from_another_module():
    bad = [f"{m} takes {name} from {target}" for m in MODULES for target, name, _ in _imports(m)
           if target.startswith("spark_dl") and target != m
           and ((name or target.rpartition(".")[2]).startswith("_") and not (name or "").startswith("__"))
           and (m, target if name is None else f"{target}.{name}") not in PRIVATE_OK
           and not (name is None and target.rpartition(".")[2] == "__init__")]
    assert bad == []


def test_compatibility_layers_use_no_private_core_module():
    bad = [f"{m} imports {t}" for m in MODULES if m.startswith("spark_dl.compat")
           for t, _, _ in _imports(m) if t.startswith("spark_dl.") and any(p.startswith("_") for p in t.split("."))]
    assert bad == []


def test_no_module_is_much_over_500_lines():
    long = {m: n for m, p in MODULES.items() if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert long == {}


def test_message_kinds_and_variable_names_are_written_only_in_the_protocol():
    kinds = {v for k, v in vars(protocol).items() if k.isupper() and isinstance(v, str) and "/" in v}
    found = []
    for m, p in MODULES.items():
        if m == "spark_dl.protocol":
            continue
        for node in ast.walk(ast.parse(p.read_text())):
            if isinstance(node, ast.Constant) and isinstance(node.value, str):
                if re.fullmatch(r"SPARK_DL_[A-Z_]+", node.value) or node.value in kinds:
                    found.append(f"{m}:{node.lineno}: {node.value!r}")
    assert found == []


def test_every_message_kind_is_declared_with_its_sender_and_payload():
    kinds = {v for k, v in vars(protocol).items()
             if k.isupper() and isinstance(v, str) and not k.endswith(("_ENV", "_PREFIX"))}
    assert kinds == set(protocol.MESSAGES)


def test_every_variable_a_task_sets_in_a_rank_is_reserved():
    from spark_dl.task.layout import RankSpec

    spec = RankSpec(0, 2, 0, 2, 0, 1, "h", "127.0.0.1", 1, gpus=["0"], cuda_device=0)
    user_settable = {"CUDA_VISIBLE_DEVICES", "OMP_NUM_THREADS"}
    assert set(spec.env()) - user_settable <= protocol.RESERVED_ENV
    barrier = (PACKAGE / "task" / "barrier.py").read_text()
    for name in re.findall(r'env\[protocol\.(\w+)\]', barrier):
        assert getattr(protocol, name) in protocol.RESERVED_ENV, name


@pytest.mark.parametrize("name", sorted(protocol.JOB_ENV))
def test_env_refuses_every_variable_of_the_runs_own(name):
    with pytest.raises(spark_dl.LaunchRefused, match=name):
        spark_dl.HorovodRunner(np=-1, env={name: "x"})


def test_the_architecture_page_lists_every_module():
    page = (PACKAGE.parent / "docs" / "architecture.md").read_text()
    missing = [str(p.relative_to(PACKAGE.parent)) for p in MODULES.values()
               if f"`{p.relative_to(PACKAGE.parent)}`" not in page]
    assert missing == [], "docs/architecture.md's Modules section lacks these"


DOCUMENTED = [
    "spark_dl.horovod", "spark_dl.horovod.spark", "spark_dl.horovod.staging", "spark_dl.horovod.store",
    "spark_dl.horovod.elastic", "spark_dl.horovod.checks", "spark_dl.horovod_imports", "spark_dl.estimator",
    "spark_dl.ray_train", "spark_dl.ray_train.torch", "spark_dl.ray_train.lightning", "spark_dl.data",
    "spark_dl.submit", "spark_dl.callbacks", "spark_dl.distributor", "spark_dl.tracking", "spark_dl.tracking.lightning",
    "spark_dl.compression", "spark_dl.compression.stats", "spark_dl.train", "spark_dl.errors", "spark_dl.rank",
    "spark_dl.examples.digits",
]


@pytest.mark.parametrize("name", DOCUMENTED)
def test_documented_import_paths_import(name):
    module = importlib.import_module(name)
    assert module is sys.modules[name]


def test_a_short_name_is_the_same_module_as_its_home():
    import spark_dl.horovod
    import spark_dl.horovod.spark

    import spark_dl.compat.horovod
    import spark_dl.compat.horovod.spark

    assert spark_dl.horovod is spark_dl.compat.horovod
    assert spark_dl.horovod.spark is spark_dl.compat.horovod.spark
    assert spark_dl.horovod.spark.__spec__.name == "spark_dl.compat.horovod.spark"
    from spark_dl.data import shards
    from spark_dl.rank import scratch_dir

    assert callable(shards) and callable(scratch_dir)
