"""Regenerate the key reference in config/README.md from workflow/schemas/config.schema.yaml.

python scripts/schema_docs.py          # rewrite the table
python scripts/schema_docs.py --check  # exit 1 when the README is out of date
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import yaml
from generated_block import write_or_check  # scripts/, this script's folder

from mirageflow.config.types import IGNORED_MMIRAGE_KEYS

REPO = Path(__file__).resolve().parents[1]
README = REPO / "config" / "README.md"
BEGIN, END = "<!-- keys:begin -->", "<!-- keys:end -->"
IGNORED_MARK = "*MMIRAGE's; changes nothing here.*"


def _rows(schema: dict, root: dict, prefix: str = ""):
    if "$ref" in schema:
        schema = {**root["definitions"][schema["$ref"].rsplit("/", 1)[-1]], **{k: v for k, v in schema.items() if k != "$ref"}}
    for name, sub in schema.get("properties", {}).items():
        path = f"{prefix}{name}"
        if "$ref" in sub:
            sub = {**root["definitions"][sub["$ref"].rsplit("/", 1)[-1]], **{k: v for k, v in sub.items() if k != "$ref"}}
        kind = sub.get("type", "any" if "oneOf" not in sub else " or ".join(o.get("type", "?") for o in sub["oneOf"]))
        kind = " or ".join(kind) if isinstance(kind, list) else kind
        if "enum" in sub:
            kind = " \\| ".join(f"`{v}`" for v in sub["enum"])
        default = f"`{json.dumps(sub['default'])}`" if "default" in sub else ("**required**" if name in schema.get("required", []) else "")
        desc = " ".join(str(sub.get("description", "")).split())
        if path in IGNORED_MMIRAGE_KEYS:
            desc = f"{IGNORED_MARK} {desc}"
        yield f"| `{path}` | {kind} | {default} | {desc} |"
        if sub.get("type") == "object" or "properties" in sub:
            yield from _rows(sub, root, f"{path}.")
        elif sub.get("type") == "array" and isinstance(sub.get("items"), dict):
            yield from _rows(sub["items"], root, f"{path}[].")


def table() -> str:
    schema = yaml.safe_load((REPO / "workflow" / "schemas" / "config.schema.yaml").read_text())
    lines = ["| key | type | default | description |", "|---|---|---|---|", *_rows(schema, schema)]
    return "\n".join(lines)


def main() -> int:
    return write_or_check(README, BEGIN, END, table(), "scripts/schema_docs.py", sys.argv)


if __name__ == "__main__":
    sys.exit(main())
