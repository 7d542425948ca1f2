"""Write docs/api.md, paramsync's API page, from the public names' own docstrings.

    python docs/api_page.py            # rewrite docs/api.md
    python docs/api_page.py --check    # exit 1 if docs/api.md is not what the code says

The page documents each name ``paramsync`` and ``paramsync.testing`` export, once, in the groups
their ``__all__`` lists name in its comments: a class with its signature, its docstring, its
fields (a dataclass) and its public methods' summaries; a function with its signature and
docstring; a constant with its value. ``tests/test_api_page.py`` keeps the page current.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import enum
import importlib
import inspect
import re
import sys
import types
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
PAGE = ROOT / "docs" / "api.md"
MODULES = ("paramsync", "paramsync.testing")
"""The modules whose ``__all__`` the page documents, in order."""
_ADDRESS = re.compile(r" at 0x[0-9a-f]+")


def groups(module: types.ModuleType) -> list[tuple[str, list[str]]]:
    """``module.__all__`` in the groups its source names in comments (``# the errors``)."""
    source = Path(inspect.getfile(module)).read_text()
    tree = ast.parse(source)
    (node,) = [
        n
        for n in tree.body
        if isinstance(n, ast.Assign)
        and any(isinstance(t, ast.Name) and t.id == "__all__" for t in n.targets)
    ]
    lines = source.splitlines()[node.lineno - 1 : node.end_lineno]
    found: list[tuple[str, list[str]]] = []
    for line in lines:
        text = line.strip()
        if text.startswith("#"):
            found.append((text.lstrip("# ").strip(), []))
        elif text.startswith('"'):
            if not found:
                found.append(("", []))
            found[-1][1].append(ast.literal_eval(text.rstrip(",")))
    listed = [name for _, names in found for name in names]
    if listed != list(module.__all__):
        raise SystemExit(f"{module.__name__}.__all__ could not be read in its groups")
    return found


def _signature(name: str, value: Any) -> str:
    try:
        signature = inspect.signature(value)
    except (TypeError, ValueError):
        return name
    public = [p for p in signature.parameters.values() if not p.name.startswith("_")]
    return _ADDRESS.sub("", f"{name}{signature.replace(parameters=public)}")


def _doc(value: Any) -> str:
    return inspect.cleandoc(value.__doc__ or "") if value.__doc__ else "(no docstring)"


def _summary(value: Any) -> str:
    doc = inspect.getdoc(value) or ""
    return " ".join(doc.split("\n\n")[0].split())


def _fields(cls: type) -> list[str]:
    rows = []
    for field in dataclasses.fields(cls):
        if field.default is not dataclasses.MISSING:
            default = repr(field.default)
        elif field.default_factory is not dataclasses.MISSING:
            default = f"{field.default_factory.__name__}()"
        else:
            default = "required"
        kind = field.type if isinstance(field.type, str) else getattr(field.type, "__name__", "")
        rows.append(f"| `{field.name}` | `{kind}` | `{_ADDRESS.sub('', default)}` |")
    return ["| field | type | default |", "|---|---|---|", *rows]


def _methods(cls: type) -> list[str]:
    rows = []
    for name, member in vars(cls).items():
        if name.startswith("_") or not (
            inspect.isfunction(member) or isinstance(member, property | classmethod | staticmethod)
        ):
            continue
        target = member.fget if isinstance(member, property) else member
        if isinstance(target, classmethod | staticmethod):
            target = target.__func__
        label = name if isinstance(member, property) else f"{name}()"
        rows.append(f"- `{label}`: {_summary(target) or '(no docstring)'}")
    return rows


def entry(qualified: str, value: Any) -> list[str]:
    """The page's text for one exported name."""
    if isinstance(value, types.ModuleType):
        exported = ", ".join(f"`{name}`" for name in getattr(value, "__all__", ()))
        lines = [f"### `{qualified}` (module)", "", _summary(value)]
        if exported:
            lines += ["", f"Exports: {exported}."]
        return [*lines, ""]
    short = qualified.rsplit(".", 1)[1]
    if inspect.isclass(value):
        kind = "exception" if issubclass(value, BaseException) else "class"
        if issubclass(value, enum.Enum):
            kind = "enum"
        lines = [f"### `{qualified}` ({kind})", "", f"`{_signature(short, value)}`", ""]
        if issubclass(value, BaseException):
            bases = ", ".join(f"`{base.__name__}`" for base in value.__bases__)
            lines += [f"Subclass of {bases}.", ""]
        lines += [_doc(value), ""]
        if dataclasses.is_dataclass(value):
            lines += [*_fields(value), ""]
        methods = [] if issubclass(value, BaseException) else _methods(value)
        if methods:
            lines += ["Methods and properties:", "", *methods, ""]
        lines.append(f"Defined in `{value.__module__}`.")
        return [*lines, ""]
    if callable(value):
        return [
            f"### `{qualified}` (function)",
            "",
            f"`{_signature(short, value)}`",
            "",
            _doc(value),
            "",
            f"Defined in `{value.__module__}`.",
            "",
        ]
    return [f"### `{qualified}` (constant)", "", f"`{short} = {value!r}`", ""]


def page() -> str:
    """The whole of docs/api.md, as the code says it."""
    out = [
        "# paramsync's API",
        "",
        "Generated from the docstrings by `python docs/api_page.py` (`tests/test_api_page.py`",
        "fails when this page and the code disagree). Everything not listed here is reachable",
        "from its module under `paramsync.runtime` (the engine) and `paramsync.actors` (the",
        "worker); docs/architecture.md maps them.",
        "",
    ]
    for name in MODULES:
        module = importlib.import_module(name)
        out += [f"## `{name}`", "", _summary(module), ""]
        for group, names in groups(module):
            if group:
                out += [f"**{group[0].upper()}{group[1:]}**: " + ", ".join(f"`{n}`" for n in names)]
                out.append("")
            for export in names:
                out += entry(f"{name}.{export}", getattr(module, export))
    return "\n".join(out).rstrip() + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="exit 1 if docs/api.md is stale")
    args = parser.parse_args(argv)
    text = page()
    if args.check:
        if not PAGE.exists() or PAGE.read_text() != text:
            print("docs/api.md is stale: run python docs/api_page.py", file=sys.stderr)
            return 1
        return 0
    PAGE.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
