"""The manifest's reference page, generated from its pydantic schema so that it cannot drift from it.

`python -m pdserve.cluster.manifest_docs` writes docs/configuration-reference.md: one table per section
of the manifest (field path, type and bounds, default, description). tests/test_docs.py fails when a
field has no description or when the committed page differs from what this renders.
"""

from __future__ import annotations

import argparse
import types
import typing
from pathlib import Path
from typing import Any, Literal

from annotated_types import Ge, Gt, Le, Lt
from pydantic import BaseModel, SecretStr
from pydantic.fields import FieldInfo

from pdserve.cluster.manifest import Manifest

REFERENCE_PAGE = Path(__file__).resolve().parent.parent / "docs" / "configuration-reference.md"
HEADER = """# Configuration reference

Every field of a manifest, generated from the schema `pdserve up` checks manifests against
(`cluster/manifest.py`) by `python -m pdserve.cluster.manifest_docs`; do not edit it by hand. How to
write a manifest, with examples: [Configuration](configuration.md). `deploy/local.yaml` is the default.

A field's path is how it nests in the YAML: `pools.decode.replicas` is

```yaml
pools:
  decode:
    replicas: 2
```
"""

_BOUNDS = ((Ge, "≥", "ge"), (Gt, ">", "gt"), (Le, "≤", "le"), (Lt, "<", "lt"))


def _submodel(annotation: Any) -> type[BaseModel] | None:
    """The section model a field holds (also through `X | None`), else None."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    if isinstance(annotation, types.UnionType) or typing.get_origin(annotation) is typing.Union:
        models = [a for a in typing.get_args(annotation) if isinstance(a, type) and issubclass(a, BaseModel)]
        return models[0] if models else None
    return None


def type_name(annotation: Any) -> str:
    """YAML's view of a type: `int`, `"exact" | "approximate"`, `list[str] | null`, `path`."""
    if annotation is type(None):
        return "null"
    if typing.get_origin(annotation) is Literal:
        return " | ".join(f'"{v}"' for v in typing.get_args(annotation))
    if isinstance(annotation, types.UnionType) or typing.get_origin(annotation) is typing.Union:
        return " | ".join(type_name(a) for a in typing.get_args(annotation))
    if (container := typing.get_origin(annotation)) in (list, dict):
        return f"{container.__name__}[{', '.join(type_name(a) for a in typing.get_args(annotation))}]"
    if annotation is SecretStr:
        return "str (secret)"
    if isinstance(annotation, type) and issubclass(annotation, Path):
        return "path"
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return "section"
    return getattr(annotation, "__name__", str(annotation))


def bounds(field: FieldInfo) -> str:
    """`≥ 0, ≤ 64` from the field's constraints."""
    found = []
    for kind, sign, attribute in _BOUNDS:
        found += [f"{sign} {getattr(m, attribute)}" for m in field.metadata if isinstance(m, kind)]
    return ", ".join(found)


def default_text(field: FieldInfo) -> str:
    """The default as YAML would spell it; `required` when there is none."""
    if field.is_required():
        return "required"
    value = field.get_default(call_default_factory=True)
    if isinstance(value, BaseModel):
        return "(section)"
    if value is None:
        return "`null`"
    if isinstance(value, bool):
        return f"`{str(value).lower()}`"
    return f"`{value}`"


def undocumented(model: type[BaseModel] = Manifest, prefix: str = "") -> list[str]:
    """The paths of the fields, in `model` and every section under it, that have no description."""
    missing = []
    for name, field in model.model_fields.items():
        path = f"{prefix}{name}"
        if not (field.description or "").strip():
            missing.append(path)
        if (sub := _submodel(field.annotation)) is not None:
            missing += undocumented(sub, path + ".")
    return missing


def _section(model: type[BaseModel], path: str) -> list[str]:
    """One section's table, then the sections it holds."""
    lines = [f"## {path or 'Top level'}", ""]
    if model.__doc__ and model is not Manifest:
        lines += [" ".join(model.__doc__.split()), ""]
    lines += ["| field | type | default | description |", "|---|---|---|---|"]
    subsections = []
    for name, field in model.model_fields.items():
        full = f"{path}.{name}" if path else name
        kind = type_name(field.annotation)
        if extra := bounds(field):
            kind += f", {extra}"
        description = " ".join((field.description or "").split()).replace("|", "\\|")
        if (sub := _submodel(field.annotation)) is not None:
            anchor = full.replace(".", "")
            description += f" See [{full}](#{anchor})."
            subsections.append((sub, full))
        lines.append(f"| `{full}` | {kind.replace('|', chr(92) + '|')} | {default_text(field)} | {description} |")
    lines.append("")
    for sub, full in subsections:
        lines += _section(sub, full)
    return lines


def render() -> str:
    """The whole reference page."""
    return "\n".join([HEADER, *_section(Manifest, "")]).rstrip("\n") + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m pdserve.cluster.manifest_docs",
        description="Write the manifest's reference page from its schema.",
        epilog="example:\n  python -m pdserve.cluster.manifest_docs            # docs/configuration-reference.md",
        formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out", nargs="?", type=Path, default=REFERENCE_PAGE,
                        help="the page to write (default: docs/configuration-reference.md)")
    args = parser.parse_args(argv)
    if missing := undocumented():
        raise SystemExit(f"manifest fields without a description (Field(description=...)): {', '.join(missing)}")
    args.out.write_text(render())
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
