"""Run MMIRAGE 0.1.4's own shard code path once, with an instant fake SGLang engine.

Executed by pipeline_overhead.py with the Python of MMIRAGE's own venv (MMIRAGE needs
Python >= 3.12). Does what ``mmirage.shard_process.main`` does between marking the shard
running and marking it done: load the datasets, shard them, ``Dataset.map(rewrite_batch,
batched=True, batch_size=loading_params.batch_size)`` with its MMIRAGEMapper (LLMProcessor:
Jinja2 prompt, ``tokenizer.apply_chat_template``, ``sgl.Engine.generate``, JSON parsing) and
TemplateRenderer, then ``_save_dataset_atomic``. ``sglang`` is a stub module whose
``Engine.generate`` answers every prompt at once with the same fixed completion as our
InstantEngine. Building the mapper (tokenizer load = "model load") is not timed.

Usage: python _mmirage_driver.py CONFIG.yaml COMPLETION_JSON_STRING COMPLETION_TOKENS
Prints one JSON line: {"rows", "load_s", "map_s", "save_s", "cpu_s", "versions", "sample"}.
"""

import json
import sys
import time
import types

completion, completion_tokens = json.loads(sys.argv[2]), int(sys.argv[3])

sgl = types.ModuleType("sglang")


class Engine:  # the fake: same answer for every prompt, no waiting
    def __init__(self, **server_args):
        self.server_args = server_args

    def generate(self, prompt=None, sampling_params=None, image_data=None, **kw):
        return [
            {
                "text": completion,
                "output_ids": [],
                "meta_info": {"prompt_tokens": len(p) // 4, "completion_tokens": completion_tokens, "finish_reason": {"type": "stop"}},
            }
            for p in prompt
        ]

    def shutdown(self):
        pass


sgl.Engine = Engine
sys.modules["sglang"] = sgl

from importlib import metadata  # noqa: E402

from mmirage.config.utils import load_mmirage_config  # noqa: E402
from mmirage.core.loader.utils import load_datasets_from_configs  # noqa: E402
from mmirage.core.process.mapper import MMIRAGEMapper  # noqa: E402
from mmirage.core.writer.renderer import TemplateRenderer  # noqa: E402
from mmirage.shard_process import rewrite_batch  # noqa: E402
from mmirage.shard_utils import _count_rows, _dataset_out_dir, _remove_columns, _save_dataset_atomic, _shard_dataset  # noqa: E402


def main():
    cfg = load_mmirage_config(sys.argv[1])
    lp, pp = cfg.loading_params, cfg.processing_params
    shard_id, num_shards = lp.get_shard_id(), lp.get_num_shards()
    mapper = MMIRAGEMapper(cfg.processors, pp.inputs, pp.outputs)  # loads the tokenizer: not timed
    renderer = TemplateRenderer(pp.output_schema)

    c0 = time.process_time()
    t0 = time.perf_counter()
    ds_all = load_datasets_from_configs(lp.datasets)
    shards = [_shard_dataset(ds, num_shards, shard_id) for ds in ds_all]
    t1 = time.perf_counter()
    processed = []
    for ds_config, ds in zip(lp.datasets, shards):
        remove = _remove_columns(ds) if pp.remove_columns else []
        out = ds.map(
            rewrite_batch,
            batched=True,
            batch_size=lp.get_batch_size(),
            load_from_cache_file=False,
            fn_kwargs={"mapper": mapper, "renderer": renderer, "image_base_path": ds_config.image_base_path},
            remove_columns=remove,
        )
        processed.append(out)
    t2 = time.perf_counter()
    for ds_config, out in zip(lp.datasets, processed):
        _save_dataset_atomic(out, _dataset_out_dir(shard_id, ds_config))
    t3 = time.perf_counter()
    cpu = time.process_time() - c0
    rows = sum(_count_rows(ds) for ds in processed)
    vers = {p: metadata.version(p) for p in ("mmirage", "datasets", "transformers", "jinja2", "jmespath", "pyarrow")}
    vers["python"] = sys.version.split()[0]
    print(
        json.dumps(
            {
                "rows": rows,
                "load_s": t1 - t0,
                "map_s": t2 - t1,
                "save_s": t3 - t2,
                "cpu_s": cpu,
                "versions": vers,
                "sample": processed[0][0],
            }
        )
    )


if __name__ == "__main__":
    main()
