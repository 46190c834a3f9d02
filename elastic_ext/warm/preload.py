"""What the server imports before it forks: the target's imports, found without running it.

Running the target's main file would start training in the server, so its imports
are read from its source (``ast``), anywhere in the file, function bodies included
(the bundled trainer imports torch inside ``main`` so that ``--help`` is fast); the
target's own package's modules are followed the same way. The target itself is never
imported: of ``-m pkg.mod`` only the packages ``python`` imports before it runs the
module (``pkg``; and ``pkg`` itself for ``-m pkg``, whose ``__main__`` runs). Each
import is tried on its own: one that fails here fails again, with its real traceback,
in the worker. An import after which this process has more threads is remembered
(:func:`thread_starters`), and so is the one that loaded the CUDA driver
(:func:`cuda_driver_importer`), so that a refusal to fork can name it.
"""

from __future__ import annotations

import ast
import importlib
import importlib.util
import logging
import os
import sys
from collections.abc import Callable, Iterable

from elastic_ext.warm.safety import cuda_driver_mapped
from elastic_ext.warm.target import Target

logger = logging.getLogger(__name__)

LAZY_HEAVY = ("torch._dynamo",)
"""Imported by torch lazily on first use (any optimizer's step), ~1 s each; thread-free."""


def _source_of(module: str) -> str | None:
    try:
        spec = importlib.util.find_spec(module)
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.origin or not spec.origin.endswith(".py"):
        return None
    if spec.submodule_search_locations is not None:  # a package: what -m runs is __main__
        main = os.path.join(os.path.dirname(spec.origin), "__main__.py")
        return main if os.path.exists(main) else spec.origin
    return spec.origin


def imports_in(path: str, package: str | None) -> list[str]:
    """Absolute names of every module ``path`` imports (relative ones resolved in
    ``package``), and ``X:a`` for what it takes from a module: ``from X import a``, and
    ``X.a`` where ``X`` was bound by ``import X`` (``X.a.b`` gives ``X:a`` and ``X.a:b``).
    What is taken from a package may be loaded only when asked for (a lazy package such
    as transformers, or ``elastic_ext.ElasticLoop``), or be a submodule."""
    try:
        with open(path, encoding="utf-8") as f:
            tree = ast.parse(f.read(), path)
    except (OSError, SyntaxError, ValueError):
        return []
    names: list[str] = []
    bound: dict[str, str] = {}  # a name ``import`` binds -> the module it is
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                names.append(alias.name)
                if alias.asname:
                    bound[alias.asname] = alias.name
                else:
                    top = alias.name.split(".")[0]
                    bound[top] = top
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                if not package:
                    continue
                try:
                    base = importlib.util.resolve_name("." * node.level + base, package)
                except (ImportError, ValueError):
                    continue
            if base:
                names.append(base)
                names.extend(f"{base}:{alias.name}" for alias in node.names
                             if alias.name != "*")
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute):
            names.extend(_taken_from_modules(node, bound))
    return list(dict.fromkeys(names))


def _taken_from_modules(node: ast.Attribute, bound: dict[str, str]) -> list[str]:
    """``X:a`` and ``X.a:b`` for ``alias.a.b`` where ``import`` bound ``alias`` to ``X``."""
    parts: list[str] = []
    value: ast.expr = node
    while isinstance(value, ast.Attribute):
        parts.insert(0, value.attr)
        value = value.value
    if not isinstance(value, ast.Name) or value.id not in bound:
        return []
    module = bound[value.id]
    return [".".join([module, *parts[:i]]) + f":{parts[i]}" for i in range(len(parts))]


_thread_starters: list[str] = []


def thread_starters() -> list[str]:
    """The modules after whose import (by this preload) the process had more threads."""
    return list(_thread_starters)


_cuda_driver_importer: str | None = None
_cuda_driver_seen = False


def cuda_driver_importer() -> str | None:
    """The module whose import (by this preload) loaded the CUDA driver, if one did."""
    return _cuda_driver_importer


def _cuda_driver() -> bool:
    """Whether the driver is loaded; ``/proc/self/maps`` is not read again once it was
    (torch never unloads it)."""
    global _cuda_driver_seen
    _cuda_driver_seen = _cuda_driver_seen or cuda_driver_mapped()
    return _cuda_driver_seen


def _threads() -> int:
    try:
        return len(os.listdir("/proc/self/task"))
    except OSError:
        return 0


def _import(name: str) -> None:
    """``import name``, or for ``X:a`` what ``from X import a`` does: the attribute (which a
    lazy package loads when asked), else the submodule ``X.a``."""
    module, _, attribute = name.partition(":")
    loaded = importlib.import_module(module)
    if attribute:
        try:
            getattr(loaded, attribute)
        except AttributeError:
            importlib.import_module(f"{module}.{attribute}")


def _try_import(name: str) -> bool:
    global _cuda_driver_importer
    before = _threads()
    driver_before = _cuda_driver()
    try:
        _import(name)
        return True
    except BaseException as exc:  # noqa: BLE001 - a SystemExit at import is the worker's business
        logger.debug("warm preload: import %s failed (%s); the worker will import it itself",
                     name, exc)
        return False
    finally:
        if _threads() > before and name not in _thread_starters:
            _thread_starters.append(name)
        if not driver_before and _cuda_driver():
            _cuda_driver_importer = name
            logger.debug("warm preload: importing %s loaded the CUDA driver", name)


def _walk(start: Iterable[tuple[str, str | None]], home: str | None, *, skip: str,
          keep_going: Callable[[], bool]) -> list[str]:
    """Import what each file imports, following modules of the ``home`` top-level package;
    never ``skip`` (the target: importing it would run it), and nothing more once
    ``keep_going`` says no."""
    done: list[str] = []
    seen_files: set[str] = set()
    todo = list(start)
    while todo:
        path, package = todo.pop(0)
        if path in seen_files:
            continue
        seen_files.add(path)
        for name in imports_in(path, package):
            if name in done or name.partition(":")[0] in ("__main__", skip):
                continue
            if not keep_going():
                return done
            if _try_import(name):
                done.append(name)
            if home and ":" not in name and name.split(".")[0] == home:
                source = _source_of(name)
                if source is not None:
                    is_package = source.endswith("__init__.py")
                    todo.append((source, name if is_package else name.rpartition(".")[0]))
    return done


def _is_package(module: str) -> bool:
    try:
        spec = importlib.util.find_spec(module)
    except (ImportError, ValueError):
        return False
    return spec is not None and spec.submodule_search_locations is not None


def preload(target: Target, extra: Iterable[str] = (),
            keep_going: Callable[[], bool] = lambda: True) -> list[str]:
    """Import ``target``'s imports and ``extra`` modules; the names imported. Stops early
    (with what it has) once ``keep_going`` returns False: nobody will use it any more."""
    done: list[str] = []
    if target.kind == "module":
        top = target.name.split(".")[0]
        spec_source = _source_of(target.name)
        parent = target.name.rpartition(".")[0]
        # What ``python -m`` imports before it runs the target: its parent packages, and
        # the target itself only when it is a package (``__main__`` is what runs). A plain
        # module is the main file: importing it would run it.
        packages = [parent] if parent else []
        skip = target.name
        if _is_package(target.name):
            packages.append(target.name)
            skip = f"{target.name}.__main__"
        for package in packages:
            if _source_of(package) is not None and _try_import(package):
                done.append(package)
        package = target.name if spec_source and spec_source.endswith("__main__.py") else parent
        if spec_source is not None:
            done += _walk([(spec_source, package or None)], top, skip=skip,
                          keep_going=keep_going)
    else:
        script = os.path.abspath(target.name)
        saved_path = list(sys.path)
        sys.path.insert(0, os.path.dirname(script))  # where the script's own imports live
        try:
            # A sibling module that imports the script by name would run it: never that name.
            stem = os.path.splitext(os.path.basename(script))[0]
            done += _walk([(script, None)], None, skip=stem, keep_going=keep_going)
        finally:
            sys.path[:] = saved_path  # a worker's sys.path is python's, not the server's
    for name in (*extra, *(LAZY_HEAVY if "torch" in sys.modules else ())):
        if not keep_going():
            break
        if name and name not in done and _try_import(name):
            done.append(name)
    return [name for name in done if ":" not in name]  # modules, not what they gave
