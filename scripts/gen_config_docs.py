"""Write ``docs/config.md``, the config reference, from the typed schemas themselves.

    python scripts/gen_config_docs.py            # rewrite docs/config.md
    python scripts/gen_config_docs.py --check    # exit 1 if docs/config.md is stale or a field has no doc

One source of truth per knob: the comment written after each field of its dataclass schema (``flowgrpo/config.py``
for the groups; ``flowgrpo/algorithms/<name>.py`` for each algorithm, found through the ``ALGORITHMS`` registry's
``config_class``), e.g.::

    group_size: int = _knob(8, ge=2)  # G: samples per prompt (advantages are relative within a group)

gives the row ``trainer.group_size | int | 8 | ≥ 2 | G: samples per prompt ...``. Types and defaults come from the
dataclass, the allowed values from the ``_knob`` metadata that ``flowgrpo.config.validate`` checks, the comment from
the source (a comment on the line(s) above the field counts when there is none after it; a subclass that overrides
a field without a comment keeps its parent's). The options of each group are listed with the first comment line of
their ``conf/<group>/<option>.yaml``.

``tests/test_docs.py`` fails when a schema field has no comment (:func:`undocumented`) or when ``docs/config.md``
differs from what this script writes (:func:`render`): change a schema, then run this script.
"""

from __future__ import annotations

import argparse
import ast
import collections
import dataclasses
import inspect
import io
import re
import sys
import textwrap
import tokenize
import typing
from functools import lru_cache
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

OUT = REPO / "docs" / "config.md"
CONF = REPO / "conf"

#: Config groups in the order the reference lists them (the keys of flowgrpo.config.GROUP_SCHEMAS).
GROUP_ORDER = ("model", "sampler", "algo", "reward", "data", "logger", "trainer")
#: Preset groups without a schema of their own (``# @package _global_`` files that set keys of the groups above).
PRESET_GROUPS = ("experiment", "experiment_algo", "debug", "model_defaults")


# ------------------------------------------------------------------------------------------ source comments


@lru_cache(maxsize=None)
def _own_comments(klass: type) -> dict[str, str]:
    """``{field: comment}`` for the annotated fields written in ``klass``'s own body (not inherited)."""
    try:
        lines, _ = inspect.getsourcelines(klass)
    except (OSError, TypeError):
        return {}
    src = textwrap.dedent("".join(lines))
    tree = ast.parse(src)
    node = tree.body[0]
    if not isinstance(node, ast.ClassDef):
        return {}
    comments: dict[int, str] = {}
    for tok in tokenize.generate_tokens(io.StringIO(src).readline):
        if tok.type == tokenize.COMMENT:
            comments[tok.start[0]] = tok.string.lstrip("#").strip()
    src_lines = src.splitlines()
    out: dict[str, str] = {}
    for stmt in node.body:
        if not (isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name)):
            continue
        text = [comments[n] for n in range(stmt.lineno, stmt.end_lineno + 1) if n in comments]
        if not text:  # whole-line comments right above the field
            n = stmt.lineno - 1
            above = []
            while n >= 1 and src_lines[n - 1].strip().startswith("#"):
                above.insert(0, comments.get(n, ""))
                n -= 1
            text = above
        doc = " ".join(t for t in text if t)
        if doc:
            out[stmt.target.id] = doc
    return out


def field_doc(schema: type, name: str) -> str:
    """The comment documenting field ``name`` of ``schema``: the most derived class's that has one."""
    for klass in schema.__mro__:
        if not dataclasses.is_dataclass(klass):
            continue
        doc = _own_comments(klass).get(name)
        if doc:
            return doc
    return ""


# ------------------------------------------------------------------------------------------ rendering


def _type_text(tp: Any) -> str:
    if tp is type(None):
        return "null"
    if tp is Any:
        return "any"
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin is typing.Union:
        parts = [_type_text(a) for a in args if a is not type(None)]
        return " or ".join(parts) + (" or null" if type(None) in args else "")
    if origin in (list, typing.List):
        return f"list[{_type_text(args[0])}]" if args else "list"
    if origin in (dict, typing.Dict):
        return f"dict[{_type_text(args[0])}, {_type_text(args[1])}]" if args else "dict"
    if dataclasses.is_dataclass(tp):
        return "group"
    return getattr(tp, "__name__", str(tp))


def _value_text(value: Any) -> str:
    if value is None:
        return "`null`"
    if isinstance(value, bool):
        return f"`{str(value).lower()}`"
    if isinstance(value, str):
        return "required" if value == "???" else (f"`{value}`" if value else '`""`')
    if isinstance(value, (list, tuple)):
        return "`[" + ", ".join(_value_text(v).strip("`") for v in value) + "]`"
    if isinstance(value, dict):
        return "`{" + ", ".join(f"{k}: {_value_text(v).strip('`')}" for k, v in value.items()) + "}`"
    return f"`{value!r}`"


def _default(f: dataclasses.Field) -> Any:
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:  # type: ignore[misc]
        return f.default_factory()  # type: ignore[misc]
    return "???"


def _allowed(f: dataclasses.Field) -> str:
    meta = f.metadata
    parts = []
    if "choices" in meta:
        parts.append(" · ".join(_value_text(c) for c in meta["choices"]))
    for key, sign in (("ge", "≥"), ("gt", ">"), ("le", "≤")):
        if key in meta:
            parts.append(f"{sign} {meta[key]}")
    return ", ".join(parts)


_CODE = re.compile(r"(`+)(.+?)\1")


def _prose(text: str) -> str:
    return (text.replace("\\", "\\\\").replace("|", "\\|").replace("*", "\\*").replace("<", "&lt;")
            .replace("_", "\\_"))


def _cell(text: str) -> str:
    """Text for a Markdown table cell: reStructuredText ``code`` becomes `code`; outside code, no pipes, tags or
    emphasis markers are taken literally by Markdown; inside code only a pipe is escaped (a column separator)."""
    out, pos = [], 0
    for m in _CODE.finditer(text):
        out.append(_prose(text[pos:m.start()]))
        out.append("`" + m.group(2).replace("|", "\\|") + "`")
        pos = m.end()
    out.append(_prose(text[pos:]))
    return "".join(out)


def _nested(tp: Any) -> type | None:
    """The dataclass of a nested group field: ``LoraConfig`` or ``Optional[StreamModelConfig]``; else None."""
    if dataclasses.is_dataclass(tp):
        return tp
    args = [a for a in typing.get_args(tp) if a is not type(None)]
    if typing.get_origin(tp) is typing.Union and len(args) == 1 and dataclasses.is_dataclass(args[0]):
        return args[0]
    return None


def _same(schema: type, bases: tuple[type, ...], f: dataclasses.Field) -> bool:
    """The field is the nearest of ``bases`` (schemas whose tables come earlier) that has it, with the same default,
    meaning and bounds: that table already shows it."""
    base = next((b for b in bases if f.name in {x.name for x in dataclasses.fields(b)}), None)
    g = {x.name: x for x in dataclasses.fields(base)}.get(f.name) if base else None
    return g is not None and _value_text(_default(g)) == _value_text(_default(f)) and \
        field_doc(base, f.name) == field_doc(schema, f.name) and _allowed(g) == _allowed(f)


def _rows(schema: type, prefix: str, nested: list[tuple[str, type]], bases: tuple[type, ...] = ()) -> list[str]:
    hints = typing.get_type_hints(schema)
    rows = []
    for f in dataclasses.fields(schema):
        if _same(schema, bases, f):
            continue
        tp = hints.get(f.name, Any)
        key = f"{prefix}.{f.name}"
        doc = field_doc(schema, f.name)
        sub = _nested(tp)
        if sub is not None:
            nested.append((key, sub))
            see = f"see [`{key}.*`](#{key.replace('.', '')})"
            default = see if sub is tp else f"{_value_text(_default(f))}; {see}"
        else:
            default = _value_text(_default(f))
        rows.append(f"| `{key}` | {_type_text(tp)} | {default} | {_allowed(f)} | {_cell(doc) if doc else '**undocumented**'} |")
    return rows


def _table(schema: type, prefix: str, level: int, bases: tuple[type, ...] = ()) -> list[str]:
    nested: list[tuple[str, type]] = []
    out = ["| key | type | default | allowed | meaning |", "|---|---|---|---|---|",
           *_rows(schema, prefix, nested, bases)]
    for key, sub in nested:
        out += ["", f"{'#' * level} `{key}.*` {{#{key.replace('.', '')}}}", "", _cell(_doc_line(sub)), ""]
        out += _table(sub, key, level + 1)
    return out


def _doc_line(schema: type) -> str:
    doc = inspect.getdoc(schema) or ""
    return " ".join(doc.split("\n\n")[0].split())


def _where(schema: type) -> str:
    return f"`{schema.__module__}.{schema.__qualname__}`"


def _option_line(path: Path) -> tuple[str, str]:
    """``(command, description)`` from an option file's first comment lines."""
    comments = []
    for line in path.read_text().splitlines():
        if not line.startswith("#"):
            break
        text = line[1:].strip()
        if text.startswith("@package") or not text:
            continue
        comments.append(text)
    if not comments:
        return "", ""
    first = comments[0]
    if "  # " in first:
        command, desc = first.split("  # ", 1)
        return command.strip(), desc.strip()
    second = comments[1] if len(comments) > 1 and "  # " not in comments[1] else ""
    if ". " in second:  # its first sentence
        second = second.split(". ", 1)[0] + "."
    return first, second


def _options(group: str) -> list[str]:
    files = sorted((CONF / group).rglob("*.yaml"))  # experiment_algo nests <experiment>/<algo>.yaml
    if not files:
        return []
    out = ["| option | command | what |", "|---|---|---|"]
    for path in files:
        command, desc = _option_line(path)
        out.append(f"| `{path.relative_to(CONF / group).with_suffix('').as_posix()}` | `{command}` | {_cell(desc)} |")
    return out


def _algorithm_tables(algorithms: dict, root: type) -> list[str]:
    """A table per algorithm of what it adds to or changes in the schemas above it: ``root`` (every algorithm's keys),
    a schema several algorithms share (a table of its own), or another algorithm's."""
    registered = {algorithms[n].config_class: n for n in sorted(algorithms)}
    uses = collections.Counter(b for c in registered for b in c.__mro__[1:] if dataclasses.is_dataclass(b))
    shared = sorted((b for b, n in uses.items() if n > 1 and b not in registered and b is not root),
                    key=lambda b: b.__name__)
    link_id = lambda c: "algo" if c is root else f"algo-{registered[c].replace('_', '-')}" if c in registered \
        else f"algo-{c.__name__.lower()}"  # noqa: E731
    label = lambda c: "the keys every algorithm has" if c is root else f"`algo={registered[c]}`" if c in registered \
        else f"`{c.__name__}`"  # noqa: E731
    out = []
    for cls in shared + list(registered):
        bases = tuple(b for b in cls.__mro__[1:] if b is root or b in registered or b in shared)
        nearest = [b for b in bases if not any(b in o.__mro__[1:] for o in bases)]  # the others are above these
        users = ", ".join(f"`algo={n}`" for c, n in registered.items() if cls in c.__mro__[1:])
        title = f"`algo={registered[cls]}`" if cls in registered else f"`{cls.__name__}`: keys shared by {users}"
        above = " and ".join(f"[{label(b)}](#{link_id(b)})" for b in nearest)
        out += ["", f"### {title} {{#{link_id(cls)}}}", "", f"Schema {_where(cls)}. {_cell(_doc_line(cls))} It has "
                f"every key of {above}; the table lists the keys it adds or sets differently.", ""]
        out += _table(cls, "algo", 4, bases)
    return out


def render() -> str:
    """The whole of docs/config.md."""
    from flowgrpo.algorithms import ALGORITHMS
    from flowgrpo.config import GROUP_SCHEMAS, AlgoConfig

    lines = [
        "# Config reference",
        "",
        "<!-- Generated by scripts/gen_config_docs.py from the schemas' field comments: edit those, then run",
        "     `python scripts/gen_config_docs.py`. tests/test_docs.py fails when this page is stale. -->",
        "",
        "Every knob of `python train.py`, generated from the typed schemas (`flowgrpo/config.py`, and",
        "`flowgrpo/algorithms/<name>.py` for each algorithm): the comment after a field in its dataclass is the",
        "*meaning* column below, so there is one place to change it. Set any key on the command line",
        "(`python train.py trainer.group_size=16`), pick a group option (`model=sd35_medium`) or a preset",
        "(`experiment=flow_grpo_shapes`). *default* is the schema's; an option file or a preset may set another",
        "value, and `python train.py [overrides] --cfg job` prints the composed config and checks it (a config a",
        "run would refuse exits 1 with the reasons). *allowed* lists what `flowgrpo.config.validate` checks before",
        "anything is built; an unknown key or a wrong type fails naming the key.",
        "",
        "| group | schema | what |",
        "|---|---|---|",
    ]
    for group in GROUP_ORDER:
        schema = GROUP_SCHEMAS[group]
        lines.append(f"| [`{group}`](#{group}) | {_where(schema)} | {_cell(_doc_line(schema))} |")
    lines += ["", "Presets, which set keys of several groups: [`experiment=`, `debug=`](#presets).", ""]
    for group in GROUP_ORDER:
        schema = GROUP_SCHEMAS[group]
        lines += [f"## `{group}` {{#{group}}}", "", f"Schema {_where(schema)}. {_cell(_doc_line(schema))}", ""]
        if group == "algo":
            lines += ["Keys every algorithm has:", ""]
            lines += _table(AlgoConfig, "algo", 3)
            lines += ["", "Options (`algo=NAME`):", ""] + _options(group)
            lines += _algorithm_tables(ALGORITHMS, AlgoConfig)
        else:
            lines += _table(schema, group, 3)
            opts = _options(group)
            if opts:
                lines += ["", f"Options (`{group}=NAME`):", ""] + opts
        lines.append("")
    lines += ["## Presets {#presets}", "",
              "`experiment=NAME` applies a named recipe after the groups; `debug=NAME` applies a debugging preset "
              "last; `model_defaults/<model>.yaml` is applied automatically with its model, before both (trainer defaults "
              "only: keys no group option sets, so it never overrides a choice); "
              "`experiment_algo/<experiment>/<algo>.yaml` holds a recipe's knobs for one algorithm on its world and is "
              "applied only while that algorithm is chosen (`experiment=E algo=X` runs X at its defaults unless such a "
              "file exists). The command "
              "line wins over all of them.", ""]
    for group in PRESET_GROUPS:
        lines += [f"### `{group}`", ""] + _options(group) + [""]
    return "\n".join(lines).rstrip("\n") + "\n"


def undocumented() -> list[str]:
    """Keys of schema fields without a comment (groups, nested groups and every registered algorithm)."""
    from flowgrpo.algorithms import ALGORITHMS
    from flowgrpo.config import GROUP_SCHEMAS

    missing: list[str] = []

    def walk(schema: type, prefix: str) -> None:
        hints = typing.get_type_hints(schema)
        for f in dataclasses.fields(schema):
            key = f"{prefix}.{f.name}"
            if not field_doc(schema, f.name):
                missing.append(f"{key} ({schema.__module__}.{schema.__qualname__})")
            sub = _nested(hints.get(f.name))
            if sub is not None:
                walk(sub, key)

    for group, schema in GROUP_SCHEMAS.items():
        walk(schema, group)
    for name, cls in sorted(ALGORITHMS.items()):
        walk(cls.config_class, f"algo[{name}]")
    return sorted(set(missing))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="do not write; exit 1 if docs/config.md is stale")
    args = parser.parse_args(argv)
    missing = undocumented()
    text = render()
    status = 0
    if missing:
        print("schema fields without a comment (write one after the field):\n  " + "\n  ".join(missing),
              file=sys.stderr)
        status = 1
    if args.check:
        if not OUT.exists() or OUT.read_text() != text:
            print(f"{OUT.relative_to(REPO)} is stale: run python scripts/gen_config_docs.py", file=sys.stderr)
            status = 1
    else:
        OUT.parent.mkdir(parents=True, exist_ok=True)
        OUT.write_text(text)
        print(f"wrote {OUT.relative_to(REPO)}")
    return status


if __name__ == "__main__":
    raise SystemExit(main())
