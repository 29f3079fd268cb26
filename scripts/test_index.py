"""Regenerate the index of tests by package module in tests/README.md.

python scripts/test_index.py          # rewrite the index
python scripts/test_index.py --check  # exit 1 when it is out of date, or a module has no test

Test files are named by what a user sees (a feature, a hostile case, a backend), not by
module; this index says, for every module of src/mirageflow, which test files exercise it:
those that import it (read from their import statements), and, for a module only reached
through a public path (a backend chosen by name, a stage of a shard, a subprocess),
the files named in ``THROUGH`` below with how they reach it.
"""

from __future__ import annotations

import ast
import sys
from collections import defaultdict
from pathlib import Path

from generated_block import write_or_check  # scripts/, this script's folder

REPO = Path(__file__).resolve().parents[1]
SRC = REPO / "src"
TESTS = REPO / "tests"
README = TESTS / "README.md"
BEGIN, END = "<!-- test-index:begin -->", "<!-- test-index:end -->"

# module -> (test files, how they reach it) for modules no test imports
THROUGH: dict[str, tuple[list[str], str]] = {
    "mirageflow.cluster.engine_groups": (["test_shared_engine.py", "test_cluster.py"], "execution_params.shards_per_engine's groups"),
    "mirageflow.cluster.engine_service": (["test_shared_engine.py", "test_engine_vllm_server.py"], "execution_params.shards_per_engine"),
    "mirageflow.cluster.service_restarts": (["test_shared_engine.py"], "the engine job of execution_params.shards_per_engine"),
    "mirageflow.engines.batch_api": (["test_batch_api.py"], "the batch_api backend"),
    "mirageflow.engines.batch_providers": (["test_batch_api.py"], "the batch_api backend's providers"),
    "mirageflow.engines.batch_budget": (["test_cost.py", "test_batch_api.py"], "a batch_api run under max_cost_usd"),
    "mirageflow.engines.batch_polling": (["test_batch_api.py"], "the batch_api backend's polls"),
    "mirageflow.engines.loop": (["test_engine_sglang.py", "test_engine_http.py"], "the engines that run a private loop"),
    "mirageflow.engines.reloads": (["test_engine_sglang.py", "test_engine_restarts.py"], "in-process engines reloaded in the job"),
    "mirageflow.engines.tokens": (["test_engine_transformers.py"], "the transformers engine's prompt ids"),
    "mirageflow.engines.transformers_generate": (["test_engine_transformers.py", "test_images.py"], "the transformers engine's batches"),
    "mirageflow.engines.transformers_static": (["test_engine_transformers.py"], "the transformers engine's static path"),
    "mirageflow.imagegen": (["test_image_gen.py"], "image_gen outputs"),
    "mirageflow.imagegen.diffusers_images": (["test_image_gen.py"], "the diffusers image backend"),
    "mirageflow.model_config": (["test_images.py", "test_engine_transformers_cb.py"], "vision models and context checks"),
    "mirageflow.shard.steps.image": (["test_image_gen.py"], "image_gen outputs"),
    "mirageflow.prompts.user_code": (["test_user_code_boundary.py", "test_filter_custom_steps.py"], "custom steps' workers"),
    "mirageflow.publish": (["test_publish.py"], "mmirage publish and the card rule"),
    "mirageflow.publish.hub": (["test_publish.py"], "mmirage publish against the stand-in hub"),
    "mirageflow.report.servers": (["test_engine_vllm_server.py", "test_real_vllm.py"], "the report's inference servers section"),
    "mirageflow.report.wording": (["test_report.py"], "the report's labels"),
    "mirageflow.shard.cached_answers": (["test_request_cache.py"], "a shard answered from the request cache"),
    "mirageflow.shard.feed": (["test_shard.py", "test_n_samples.py", "test_preview.py"], "the rows and samples a shard feeds"),
    "mirageflow.shard.steps": (["test_filter_custom_steps.py", "test_image_gen.py", "test_state_contract.py"], "the steps of the row path"),
    "mirageflow.shard.error_lines": (["test_checkpoint.py", "test_shard.py"], "the checkpoint's row errors"),
    "mirageflow.shard.part_recovery": (["test_checkpoint.py", "test_shard.py"], "the checkpoint's restore"),
    "mirageflow.shard.shard_engines": (["test_shard.py", "test_cost.py"], "a shard's engines"),
    "mirageflow.shard.ledger": (["test_image_gen.py"], "images kept across attempts"),
    "mirageflow.shard.tally": (["test_tally.py", "test_shard_parts.py"], "the record tallies of finished shards"),
    "mirageflow.transport.shared_state": (["test_rate_limits.py", "test_cost.py"], "the rate limits' and the spend ledger's shared files"),
    "mirageflow.state.inputs": (["test_canary.py", "test_data_integrity.py"], "edits seen by the workflow"),
    "mirageflow.transport": (["test_transport.py", "test_http_client.py"], "the HTTP layer"),
}


def modules() -> list[str]:
    out = []
    for path in sorted((SRC / "mirageflow").rglob("*.py")):
        name = ".".join(path.relative_to(SRC).with_suffix("").parts)
        out.append(name.removesuffix(".__init__"))
    return out


def importers(known: set[str]) -> dict[str, set[str]]:
    """module -> the test files that import it (``import m``, ``from m import x``, ``from p import m``)."""
    found: dict[str, set[str]] = defaultdict(set)
    for test in sorted(TESTS.glob("test_*.py")):
        for node in ast.walk(ast.parse(test.read_text())):
            names = []
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("mirageflow"):
                names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
            elif isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            for name in names:
                if name in known:
                    found[name].add(test.name)
    return found


def index() -> tuple[str, list[str]]:
    """The Markdown index and the problems (a module without tests, a named file that is gone)."""
    mods = modules()
    direct = importers(set(mods))
    problems, rows = [], ["| module | tests |", "|---|---|"]
    for mod in mods:
        files = sorted(direct.get(mod, ()))
        cell = ", ".join(f"[{f}]({f})" for f in files)
        if mod in THROUGH:
            named, how = THROUGH[mod]
            problems += [f"{mod}: THROUGH names {f}, which does not exist" for f in named if not (TESTS / f).exists()]
            cell = "; ".join(x for x in (cell, f"through {how}: " + ", ".join(f"[{f}]({f})" for f in named)) if x)
        if not cell:
            problems.append(f"{mod}: no test imports it; name the tests that reach it in scripts/test_index.py THROUGH")
        rows.append(f"| `{mod}` | {cell} |")
    problems += [f"THROUGH names {m}, which is not a module" for m in THROUGH if m not in mods]
    return "\n".join(rows), problems


def main() -> int:
    body, problems = index()
    for p in problems:
        print(p, file=sys.stderr)
    status = write_or_check(README, BEGIN, END, body, "scripts/test_index.py", sys.argv)
    return 1 if problems else status


if __name__ == "__main__":
    sys.exit(main())
