"""The project's one prepared GPU check, for the GPU test machine (one H200, no network, ~8 minutes).

    python scripts/gpu_carry.py          # here, with network: build/gpu-carry (wheels, tokenizer), size check
    scripts/gpu_check.sh [WORKDIR]       # there, with build/gpu-carry carried along
    GPU_CHECK_ALLOW_CPU=1 scripts/gpu_check.sh   # anywhere: a tiny shape on the CPU (tests/test_gpu_check.py)

It needs only what that machine has (Python 3.12, torch, transformers 5.17 or later,
nvidia-ml-py, numpy, pyarrow, pyyaml, jinja2, tqdm) plus build/gpu-carry. No snakemake:
the pipeline's jobs run as a cluster node runs them (``python -m mirageflow.jobs --config
<state_dir>/configs/<hash>.json ... index 0 ...``, then ``... shard 0``), after the
driver's own steps (validation, the config file, the records fingerprint) done here.
Each step prints ``== N. name``, then OK or FAILED with the reason; a failed step does not
stop the independent ones, and the exit status is 1 when any failed.

 1. environment: Python, torch sees a CUDA GPU, transformers, NVML, nvidia-smi.
 2. carried wheels: ``pip install --no-index --no-deps --target <workdir>/site
    build/gpu-carry/wheels/*.whl`` (what the machine lacks: scripts/gpu_carry.py), then
    jsonschema and jmespath must import from there (in the jobs too: PYTHONPATH).
 3. tokenizer: build/gpu-carry/tokenizer (SmolLM2-135M-Instruct's files).
 4. model: random weights in Qwen3-4B's shape (36 layers, hidden 2560, 32 heads, 8 KV
    heads, head dim 128, MLP 9728, tied embeddings) with the tokenizer's vocabulary, built
    on the GPU in bf16 and saved to local disk (safetensors), its pages then dropped from
    the page cache (fsync + posix_fadvise DONTNEED), so the pipeline loads it from disk.
 5. pipeline: ``GPU_CHECK_PROMPTS`` chat prompts (default 512), greedy, exactly
    ``GPU_CHECK_NEW_TOKENS`` output tokens each (``ignore_eos``; default 256), stats on,
    the transformers backend with continuous batching (``max_running_requests``
    ``GPU_CHECK_RUNNING``, default 256), one shard, run by the shard job; nvidia-smi polls
    utilisation and power meanwhile.
 6. imports: what the shard job imported from our code (``-X importtime``): a
    third-party distribution the GPU machine lacks must be among the carried ones.
 7. bare: the same prompts, as token ids, through a bare loop of the same library:
    transformers' continuous-batching manager with the same settings, in this process.
 8. roofline: ``scripts/bench/roofline.py --status`` on the pipeline's status.json.
 9. NVML vs nvidia-smi: our sampler's utilisation and energy (status.json) beside
    nvidia-smi's over the same window (its utilisation mean, its power integrated).
10. load: the shard's measured load phase (imports, tokenizer, the weights from local disk
    with their pages dropped from the cache, the manager's KV cache), the weights alone (the
    bare loop's load, cache dropped again), and the GPU-hours of loading that the shard's
    load gives for 1,000 shards, one engine per shard and one per 8 (BENCHMARKS.md section
    shared_engine assumed 90 s per load).

Printed last, one per line, ``name: value`` (``null (why)`` where a figure does not exist,
e.g. per-GPU figures on the CPU). ``GPU_CHECK_ALLOW_CPU=1`` runs every step on the CPU with
a tiny model of the same architecture (16 prompts, 8 tokens): the GPU assertions become
notes, and steps that need carried files use this environment's packages and a tokenizer
built offline when build/gpu-carry is absent. Only the Python standard library is imported
before step 1.
"""

from __future__ import annotations

import datetime as dt
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
# what scripts/gpu_carry.py prepared (GPU_CHECK_CARRY: another folder of the same layout)
CARRY = Path(os.environ.get("GPU_CHECK_CARRY") or REPO / "build" / "gpu-carry").resolve()
SITE = CARRY  # replaced by <workdir>/site in main(): where the carried wheels are installed
sys.path.insert(0, str(REPO / "scripts"))
ALLOW_CPU = os.environ.get("GPU_CHECK_ALLOW_CPU") == "1"

# Qwen3-4B's config.json (Qwen/Qwen3-4B), but the vocabulary: the carried tokenizer's.
QWEN3_4B = {
    "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "hidden_size": 2560, "intermediate_size": 9728,
    "num_hidden_layers": 36, "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128, "hidden_act": "silu",
    "max_position_embeddings": 40960, "rms_norm_eps": 1e-6, "rope_theta": 1000000.0, "tie_word_embeddings": True,
    "attention_bias": False, "attention_dropout": 0.0, "use_sliding_window": False, "initializer_range": 0.02,
}  # fmt: skip
TINY = {**QWEN3_4B, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2, "head_dim": 16, "max_position_embeddings": 4096}  # fmt: skip

WORDS = (
    "river mountain data model token batch engine shard cluster passage summary city history science music garden "
    "ocean forest energy market language school travel bridge window computer planet winter summer harvest library"
).split()


def env_int(name: str, gpu: int, cpu: int) -> int:
    value = os.environ.get(name)
    return int(value) if value else (cpu if ALLOW_CPU else gpu)


class Check:
    def __init__(self, work: Path):
        self.work = work
        self.results: list[str] = []
        self.figures: dict[str, object] = {}
        self.failed = False
        self.facts: dict = {}  # what steps hand to later steps
        self.started = time.monotonic()

    def step(self, label: str, fn) -> bool:
        print(f"\n== {label} (t={time.monotonic() - self.started:.0f}s)", flush=True)
        try:
            note = fn(self)
        except StepFailed as e:
            return self._fail(label, str(e))
        except Exception as e:  # a step's own bug or a library error: say where
            traceback.print_exc()
            return self._fail(label, f"{type(e).__name__}: {e}")
        self.results.append(f"OK      {label}" + (f" ({note})" if note else ""))
        return True

    def _fail(self, label: str, why: str) -> bool:
        self.results.append(f"FAILED  {label}: {why}")
        self.failed = True
        print(f"GPU CHECK FAILED: {label}: {why}", file=sys.stderr, flush=True)
        return False

    def figure(self, name: str, value, why: str | None = None) -> None:
        if isinstance(value, float):
            value = round(value, 4)
        self.figures[name] = value if value is not None or why is None else f"null ({why})"

    def need(self, key: str):
        if key not in self.facts:
            raise StepFailed(f"needs the result of an earlier step ({key}), which failed")
        return self.facts[key]


class StepFailed(Exception):
    """A step's assertion: its message is the reason printed."""


def run(cmd: list[str], timeout: float, env: dict | None = None, what: str = "") -> subprocess.CompletedProcess:
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
    except subprocess.TimeoutExpired as e:
        raise StepFailed(f"{what or cmd[0]} did not finish within {timeout:.0f} s: {' '.join(cmd)}") from e
    if proc.returncode != 0:
        sys.stderr.write(proc.stdout[-4000:] + proc.stderr[-8000:])
        raise StepFailed(f"{what or cmd[0]} exited {proc.returncode}: {' '.join(cmd)} (output above)")
    return proc


def child_env() -> dict:
    """The environment of the jobs: the carried site folder (when installed) and our src first."""
    paths = [str(SITE)] if SITE.is_dir() else []
    paths += [str(REPO / "src"), os.environ.get("PYTHONPATH", "")]
    return {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in paths if p), "PYTHONUNBUFFERED": "1"}


# --------------------------------------------------------------------------- 1. environment


def environment(c: Check) -> str | None:
    import platform

    c.figure("python", platform.python_version())
    import torch
    import transformers

    c.figure("torch", torch.__version__)
    c.figure("transformers", transformers.__version__)
    cuda = torch.cuda.is_available()
    c.facts["device"] = "cuda" if cuda else "cpu"
    if cuda:
        c.figure("gpu", torch.cuda.get_device_name(0))
    elif not ALLOW_CPU:
        raise StepFailed(
            f"torch {torch.__version__} (CUDA {torch.version.cuda}) sees no CUDA device: no GPU, a CPU build, or a driver older than it needs"
        )
    notes = []
    try:
        import pynvml

        pynvml.nvmlInit()
        c.figure("nvidia_driver", pynvml.nvmlSystemGetDriverVersion())
        pynvml.nvmlShutdown()
    except Exception as e:  # NVMLError, ImportError
        if not ALLOW_CPU:
            raise StepFailed(f"NVML does not work (nvidia-ml-py and the driver): {type(e).__name__}: {e}") from e
        notes.append(f"no NVML ({type(e).__name__})")
    c.facts["nvidia_smi"] = shutil.which("nvidia-smi")
    if not c.facts["nvidia_smi"]:
        if not ALLOW_CPU:
            raise StepFailed("nvidia-smi is not on PATH")
        notes.append("no nvidia-smi")
    return "; ".join(["cpu mode (GPU_CHECK_ALLOW_CPU=1)"] + notes) if not cuda else None


# --------------------------------------------------------------------------- 2. carried wheels


def carried_wheels(c: Check) -> str | None:
    wheels = sorted((CARRY / "wheels").glob("*.whl"))
    note = None
    shutil.rmtree(SITE, ignore_errors=True)
    if wheels:
        run([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile", "--target", str(SITE),
             *map(str, wheels)], timeout=120, what="pip install of the carried wheels")  # fmt: skip
    elif not ALLOW_CPU:
        raise StepFailed(
            f"no wheels in {CARRY / 'wheels'}: run `python scripts/gpu_carry.py` where there is network and carry build/gpu-carry"
        )
    else:
        note = "no carried wheels: this environment's packages"
    c.figure("carried_wheels", ", ".join(w.name.split("-")[0] for w in wheels) or None, "none carried")
    probe = "import jmespath, jsonschema, mirageflow.config; print(jsonschema.__file__); print(jmespath.__file__)"
    files = run(
        [sys.executable, "-c", probe], timeout=120, env=child_env(), what="importing our package with the carried wheels"
    ).stdout.split()
    if wheels and not all(f.startswith(str(SITE)) for f in files):
        raise StepFailed(f"jsonschema/jmespath were not imported from the carried wheels ({SITE}): {files}")
    if str(SITE) not in sys.path and SITE.exists():
        sys.path.insert(0, str(SITE))
    sys.path.insert(0, str(REPO / "src"))
    c.facts["wheels"] = [w.name for w in wheels]
    return note


# --------------------------------------------------------------------------- 3. tokenizer


def tokenizer(c: Check) -> str | None:
    from transformers import AutoTokenizer

    src = CARRY / "tokenizer"
    note = None
    if not (src / "tokenizer.json").exists():
        if not ALLOW_CPU:
            raise StepFailed(
                f"no tokenizer in {src}: run `python scripts/gpu_carry.py` (SmolLM2's tokenizer files) and carry build/gpu-carry"
            )
        from mirageflow.model_prep import _train_tiny_tokenizer

        src = c.work / "tokenizer"
        _train_tiny_tokenizer().save_pretrained(src)
        note = "not carried: the tiny test tokenizer, built offline"
    tok = AutoTokenizer.from_pretrained(str(src))
    if tok.eos_token_id is None or not tok.chat_template:
        raise StepFailed(f"{src}: the tokenizer has no EOS token or no chat template")
    c.facts["tokenizer_dir"] = src
    c.figure("tokenizer", "SmolLM2-135M-Instruct" if note is None else "tiny (offline)")
    c.figure("tokenizer_vocab", len(tok))
    return note


# --------------------------------------------------------------------------- 4. model


def build_model(c: Check) -> str | None:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    tok_dir, device = c.need("tokenizer_dir"), c.need("device")
    tok = AutoTokenizer.from_pretrained(str(tok_dir))
    tiny = device == "cpu"  # only with GPU_CHECK_ALLOW_CPU=1 (step 1)
    shape = dict(TINY if tiny else QWEN3_4B)
    shape["vocab_size"] = -(-len(tok) // 64) * 64
    config = AutoConfig.for_model(**{k: v for k, v in shape.items() if k not in ("architectures", "model_type")}, model_type="qwen3")
    config.architectures = shape["architectures"]
    config.eos_token_id = tok.eos_token_id
    config.pad_token_id = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    config.bos_token_id = tok.bos_token_id
    out = c.work / "model"
    shutil.rmtree(out, ignore_errors=True)
    t0 = time.perf_counter()
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    if device == "cuda":
        torch.cuda.synchronize()
    c.figure("model_build_seconds", time.perf_counter() - t0)
    model.generation_config = GenerationConfig(eos_token_id=config.eos_token_id, pad_token_id=config.pad_token_id)
    params = sum(p.numel() for p in model.parameters())
    t0 = time.perf_counter()
    model.save_pretrained(out)
    tok.save_pretrained(out)
    evicted = drop_from_page_cache(out)
    c.figure("model_save_seconds", time.perf_counter() - t0)
    del model
    if device == "cuda":
        torch.cuda.empty_cache()
    weights = sum(p.stat().st_size for p in out.glob("*.safetensors"))
    c.facts["model_dir"] = out
    c.figure("model_shape", "tiny (Qwen3 architecture)" if tiny else "Qwen3-4B")
    c.figure("model_parameters", params)
    c.figure("model_weight_bytes", weights)
    c.figure("model_page_cache_drop_requested", evicted)
    return None


def drop_from_page_cache(folder: Path) -> bool:
    """fsync each file, then ask the kernel to drop its pages (clean pages: no root needed). True
    when asked; a kernel may ignore the advice (then the load reads from the page cache)."""
    if not hasattr(os, "posix_fadvise"):
        return False
    for path in folder.iterdir():
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
    return True


# --------------------------------------------------------------------------- 5. the pipeline, as a cluster node runs it


def prompts(n: int) -> list[str]:
    import random

    rng = random.Random(0)
    return [f"Write about item {i}: " + " ".join(rng.choice(WORDS) for _ in range(rng.randint(40, 120))) + "." for i in range(n)]


def pipeline_config(c: Check) -> dict:
    running, new = c.facts["running"], c.facts["new_tokens"]
    return {
        "stats": True,
        "processors": [{
            "type": "llm", "backend": "transformers",
            "server_args": {"model_path": str(c.need("model_dir")),
                            "extra_engine_args": {"continuous_batching": True, "max_running_requests": running}},
            "default_sampling_params": {"temperature": 0.0, "max_new_tokens": new, "ignore_eos": True},
        }],
        "loading_params": {
            "state_dir": str(c.work / "state"), "num_shards": 1, "batch_size": running,
            "datasets": [{"path": str(c.work / "prompts.jsonl"), "type": "JSONL", "output_dir": str(c.work / "out")}],
        },
        "processing_params": {
            "inputs": [{"name": "text", "key": "text"}],
            # random weights: the text is noise, possibly blank; the check measures tokens
            "outputs": [{"name": "answer", "prompt": "{{ text }}", "allow_empty_output": True}],
        },
        "shard_params": {"gpu_sample_interval_seconds": 0.5},
    }  # fmt: skip


class NvidiaSmi:
    """nvidia-smi's own utilisation and power readings, every 500 ms, with this host's clock."""

    def __init__(self, exe: str | None):
        self.samples: list[tuple[float, float, float]] = []  # (unix time, util %, watts) of GPU 0
        self.proc = None
        self.error = None if exe else "nvidia-smi not found"
        if exe:
            cmd = [exe, "--query-gpu=index,utilization.gpu,power.draw", "--format=csv,noheader,nounits", "-lms", "500"]
            self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            self.thread = threading.Thread(target=self._read, daemon=True)
            self.thread.start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            parts = [p.strip() for p in line.split(",")]
            try:
                if parts[0] == "0":
                    self.samples.append((time.time(), float(parts[1]), float(parts[2])))
            except (ValueError, IndexError):
                self.error = f"unexpected nvidia-smi line {line.strip()!r}"

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
            if not self.samples and self.error is None:
                self.error = f"nvidia-smi gave no samples: {self.proc.stderr.read()[-500:]}"

    def over(self, start: float, end: float) -> dict | None:
        """Mean utilisation and integrated energy (J) between two unix times."""
        pts = [s for s in self.samples if start <= s[0] <= end]
        if len(pts) < 2:
            return None
        joules = sum((b[0] - a[0]) * (a[2] + b[2]) / 2 for a, b in zip(pts, pts[1:]))
        return {"util_mean": sum(p[1] for p in pts) / len(pts), "energy_joules": joules, "samples": len(pts)}


def pipeline(c: Check) -> str | None:
    from mirageflow.config.preflight import validate
    from mirageflow.state import pipeline as pipeline_state

    n = c.facts["prompts"]
    for old in ("state", "out"):  # a rerun in the same workdir starts afresh (no resume)
        shutil.rmtree(c.work / old, ignore_errors=True)
    (c.work / "prompts.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in prompts(n)))
    config = pipeline_config(c)
    cfg = validate(config, preflight=True)  # the driver's validation (snakemake does the same)
    for note in pipeline_state.prepare(config, cfg):  # the config file, the output_dir claim, the fingerprint
        print(note)
    config_file = pipeline_state.config_path(config, cfg.state_dir)
    logs = c.work / "state" / "logs"
    env = child_env()
    jobs = [sys.executable, "-m", "mirageflow.jobs", "--config", str(config_file)]
    index = c.work / "state" / "datasets" / "dataset_0.index.json"
    run(jobs + ["--log", str(logs / "index_dataset_0.log"), "index", "0", str(index)], timeout=120, env=env, what="the index job")
    smi = NvidiaSmi(c.facts.get("nvidia_smi"))
    shard_log = logs / "shard_0.log"
    try:
        proc = run(jobs + ["--log", str(shard_log), "shard", "0"], timeout=c.facts["shard_timeout"],
                   env={**env, "PYTHONPROFILEIMPORTTIME": "1"}, what="the shard job")  # fmt: skip
    except StepFailed:
        failure = c.work / "state" / "shard_0" / "failure.json"
        if failure.exists():
            sys.stderr.write(failure.read_text()[-4000:])
        if shard_log.exists():
            sys.stderr.write(
                "".join(line for line in shard_log.read_text().splitlines(True) if not line.startswith("import time:"))[-6000:]
            )
        raise
    finally:
        smi.stop()
    c.facts["smi"] = smi
    c.facts["importtime"] = proc.stderr + (shard_log.read_text() if shard_log.exists() else "")
    status_path = c.work / "state" / "shard_0" / "status.json"
    status = json.loads(status_path.read_text())
    c.facts["status_path"], c.facts["status"] = status_path, status
    st, eng = status["stats"], status["engines"]["llm"]
    cb = eng["details"].get("continuous_batching") or {}
    c.figure("pipeline_device", eng["device"])
    c.figure("pipeline_rows", st["rows_processed"])
    c.figure("pipeline_output_tokens", st["output_tokens"])
    c.figure("pipeline_requests_continuous_batching", cb.get("requests"))
    c.figure("pipeline_attn_implementation", cb.get("attn_implementation"))
    c.figure("pipeline_model_load_seconds", st["model_load_seconds"])
    c.figure("pipeline_warmup_seconds", st["warmup_seconds"])
    c.figure("pipeline_inference_seconds", st["inference_runtime_seconds"])
    c.figure("pipeline_peak_inflight", st["peak_inflight"])
    c.figure("pipeline_tokens_per_sec", st["tokens_per_sec"])
    c.figure("pipeline_tokens_per_sec_per_gpu", st["tokens_per_sec_per_gpu"], "no GPU")
    problems = []
    if st["rows_failed"]:
        problems.append(f"{st['rows_failed']} rows failed: {st['rows_failed_by_class']}")
    if st["output_tokens"] != n * c.facts["new_tokens"]:
        problems.append(f"{st['output_tokens']} output tokens, expected {n} x {c.facts['new_tokens']} (ignore_eos)")
    if cb.get("requests") != n:
        problems.append(f"{cb.get('requests')} of {n} requests went through continuous batching: {cb}")
    if c.facts["device"] == "cuda" and (eng["device"] == "cpu" or st["num_gpus"] != 1 or st.get("gpu_util_mean") is None):
        problems.append(
            f"not measured on the GPU: engine device {eng['device']!r}, num_gpus {st['num_gpus']}, gpu_util_mean {st.get('gpu_util_mean')}"
        )
    if problems:
        raise StepFailed("; ".join(problems))
    return None


# --------------------------------------------------------------------------- 6. imports


def importtime_distributions(text: str) -> dict[str, str]:
    """Top-level module -> what imported it, for the imports our code made (``-X importtime`` output):
    those whose enclosing import is a mirageflow module, or none (imports inside functions)."""
    entries = []
    for line in text.splitlines():
        if line.startswith("import time:") and "self [us]" not in line:
            name = line.split("|", 2)[2].rstrip()
            entries.append(((len(name) - len(name.lstrip())) // 2, name.strip()))
    found: dict[str, str] = {}
    for i, (depth, name) in enumerate(entries):
        parent = next((n for d, n in entries[i + 1 :] if d < depth), None)  # importtime prints children first
        top = name.split(".")[0]
        if top in sys.stdlib_module_names or top.startswith("_") or top == "mirageflow":
            continue
        if parent is None or parent.startswith("mirageflow"):
            found.setdefault(top, parent or "(top level)")
    return found


def imports(c: Check) -> str | None:
    from importlib import metadata

    import gpu_carry

    modules = importtime_distributions(c.need("importtime"))
    if "torch" not in modules:
        raise StepFailed("no -X importtime output from the shard job (PYTHONPROFILEIMPORTTIME)")
    by_module = metadata.packages_distributions()
    dists = {gpu_carry.canonical(d) for m in modules for d in by_module.get(m, [m])}
    missing = sorted(d for d in dists if d not in gpu_carry.GPU_MACHINE_PACKAGES)
    c.figure("shard_job_imports", ", ".join(sorted(dists)))
    c.figure("shard_job_imports_missing_on_gpu_machine", ", ".join(missing) or "none")
    unknown = sorted(dists - {gpu_carry.canonical(d) for d in gpu_carry.SHARD_JOB_DISTRIBUTIONS} - gpu_carry.GPU_MACHINE_PACKAGES)
    if unknown:
        raise StepFailed(f"the shard job imports {unknown}, which scripts/gpu_carry.py neither carries nor finds on the GPU machine: "
                         "add them to its SHARD_JOB_DISTRIBUTIONS (or import them lazily)")  # fmt: skip
    carried = set(gpu_carry.missing_on_gpu_machine())
    if not set(missing) <= carried:
        raise StepFailed(f"{sorted(set(missing) - carried)} are missing on the GPU machine and not carried")
    return None


# --------------------------------------------------------------------------- 7. bare loop


def bare(c: Check) -> str | None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig
    from transformers.generation.configuration_utils import ContinuousBatchingConfig

    from mirageflow.engines.transformers_cb import manager_config

    model_dir, device = c.need("model_dir"), c.need("device")
    c.need("status")  # after the pipeline: its GPU memory is free again
    n, new, running = c.facts["prompts"], c.facts["new_tokens"], c.facts["running"]
    tok = AutoTokenizer.from_pretrained(str(model_dir))
    ids = [
        tok.apply_chat_template([{"role": "user", "content": t}], add_generation_prompt=True, tokenize=True, return_dict=False)
        for t in prompts(n)
    ]
    dropped = drop_from_page_cache(model_dir)  # the pipeline's load read it: from disk again
    t0 = time.perf_counter()
    dtype = torch.bfloat16 if device == "cuda" else torch.float32  # as the engine: float32 on a CPU
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=dtype).to(device).eval()
    if device == "cuda":
        torch.cuda.synchronize()
    c.facts["weights_load_seconds"] = time.perf_counter() - t0
    c.figure("bare_model_load_seconds", c.facts["weights_load_seconds"])
    c.figure("bare_model_load_page_cache_drop_requested", dropped)
    gen = GenerationConfig(max_new_tokens=new, do_sample=False, eos_token_id=-1, pad_token_id=tok.pad_token_id)
    manager = model.init_continuous_batching(
        generation_config=gen,
        continuous_batching_config=ContinuousBatchingConfig(**manager_config(running, device, model.config.max_position_embeddings)),
    )
    if device == "cuda":
        manager.warmup()
    manager.start()
    try:
        t0 = time.perf_counter()
        for i, x in enumerate(ids):
            manager.add_request(x, request_id=f"bare-{i}", max_new_tokens=new, eos_token_id=-1)
        tokens, done, deadline = 0, 0, time.monotonic() + c.facts["shard_timeout"]
        while done < n:
            out = manager.get_result(timeout=1.0)
            if out is None:
                if time.monotonic() > deadline or not manager.is_running():
                    raise StepFailed(f"the bare loop got {done} of {n} results (manager running: {manager.is_running()})")
                continue
            if out.is_finished():
                if out.error:
                    raise StepFailed(f"the bare loop's request {out.request_id} failed: {out.error}")
                done += 1
                tokens += len(out.generated_tokens)
        seconds = time.perf_counter() - t0
    finally:
        manager.stop(block=True, timeout=60, hard_stop=True)
    del model, manager
    if device == "cuda":
        torch.cuda.empty_cache()
    ours = c.need("status")["stats"]["tokens_per_sec"]
    c.figure("bare_output_tokens", tokens)
    c.figure("bare_tokens_per_sec", tokens / seconds)
    c.figure("pipeline_vs_bare_ratio", ours / (tokens / seconds))
    if tokens != n * new:
        raise StepFailed(f"the bare loop generated {tokens} tokens, expected {n} x {new}")
    return None


# --------------------------------------------------------------------------- 8. roofline


def roofline(c: Check) -> str | None:
    status_path = c.need("status_path")
    cmd = [sys.executable, str(REPO / "scripts" / "bench" / "roofline.py"), "--status", str(status_path)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=child_env())
    lines = dict(line.split(": ", 1) for line in proc.stdout.splitlines() if ": " in line)
    if proc.returncode != 0:
        why = (proc.stderr.strip().splitlines() or ["no output"])[-1]
        if c.facts["device"] == "cpu" and "no GPU name" in why:
            c.figure("roofline_fraction", None, f"no GPU: {why}")
            return "cpu: roofline.py refuses a run without a GPU, as it should"
        raise StepFailed(f"roofline.py --status failed: {why}")
    for key in ("gpu", "batch", "mean_context", "roofline_tokens_per_s_per_gpu", "status_roofline_fraction", "roofline_fraction"):
        c.figure(key if key.startswith("roofline") or key.startswith("status") else f"roofline_{key}", lines.get(key))
    return None


# --------------------------------------------------------------------------- 9. NVML vs nvidia-smi


def nvml_vs_smi(c: Check) -> str | None:
    st = c.need("status")["stats"]
    c.figure("sampler_gpu_util_mean_pct", st.get("gpu_util_mean"), "no NVML")
    c.figure("sampler_gpu_energy_joules", st.get("gpu_energy_joules"), "no NVML")
    c.figure("sampler_gpu_util_samples", st.get("gpu_util_samples"), "no NVML")
    smi: NvidiaSmi = c.need("smi")
    samples_file = c.work / "state" / "shard_0" / "gpu_samples.json"
    if smi.error or not samples_file.exists():
        why = smi.error or "no gpu_samples.json (the sampler read nothing)"
        c.figure("nvidia_smi_gpu_util_mean_pct", None, why)
        c.figure("nvidia_smi_energy_joules", None, why)
        if c.facts["device"] == "cuda":
            raise StepFailed(why)
        return f"cpu: {why}"
    timeline = json.loads(samples_file.read_text())
    start = dt.datetime.fromisoformat(timeline["started_at"]).timestamp()
    end = start + timeline["t"][-1] + timeline["duration"][-1]
    window = smi.over(start, end)
    if window is None:
        raise StepFailed(f"nvidia-smi has fewer than 2 samples in the sampler's window ({end - start:.1f} s)")
    c.figure("sampler_window_seconds", end - start)
    c.figure("nvidia_smi_gpu_util_mean_pct", window["util_mean"])
    c.figure("nvidia_smi_energy_joules", window["energy_joules"])
    c.figure("nvidia_smi_samples", window["samples"])
    return None


# --------------------------------------------------------------------------- 10. load time


def load_time(c: Check) -> str | None:
    """A shard pays its whole load phase (imports, tokenizer, weights from disk, the manager's KV
    cache); the weights alone are the bare loop's from_pretrained + .to(device)."""
    load = c.need("status")["stats"]["model_load_seconds"]
    c.figure("model_load_seconds", load)
    c.figure("model_weights_load_seconds", c.facts.get("weights_load_seconds"), "the bare loop did not load")
    c.figure("gpu_hours_loading_1000_shards_unshared", 1000 * load / 3600)
    c.figure("gpu_hours_loading_1000_shards_shared_8", 125 * load / 3600)
    c.figure("assumed_load_seconds_before", 90)
    return None if c.facts["device"] == "cuda" else "cpu: the tiny model's load, not Qwen3-4B's"


def main() -> int:
    work = Path(sys.argv[1]) if len(sys.argv) > 1 else Path(tempfile.mkdtemp(prefix="mirageflow-gpu-check-"))
    work.mkdir(parents=True, exist_ok=True)
    c = Check(work.resolve())
    global SITE
    SITE = c.work / "site"
    c.facts.update(
        prompts=env_int("GPU_CHECK_PROMPTS", 512, 16), new_tokens=env_int("GPU_CHECK_NEW_TOKENS", 256, 8),
        running=env_int("GPU_CHECK_RUNNING", 256, 8), shard_timeout=env_int("GPU_CHECK_SHARD_TIMEOUT", 300, 300),
    )  # fmt: skip
    print(f"workdir {c.work}; {c.facts['prompts']} prompts x {c.facts['new_tokens']} tokens, {c.facts['running']} running"
          + ("; GPU_CHECK_ALLOW_CPU=1" if ALLOW_CPU else ""), flush=True)  # fmt: skip
    steps = [
        ("1. environment", environment), ("2. carried wheels", carried_wheels), ("3. tokenizer", tokenizer),
        ("4. model", build_model), ("5. pipeline", pipeline), ("6. imports", imports), ("7. bare loop", bare),
        ("8. roofline", roofline), ("9. NVML vs nvidia-smi", nvml_vs_smi), ("10. load time", load_time),
    ]  # fmt: skip
    for label, fn in steps:
        if not c.step(label, fn) and label.startswith("1."):
            break  # no torch or no GPU: nothing else can run
    print(f"\n== summary ({time.monotonic() - c.started:.0f} s; budget 480 s on the GPU machine)")
    print("\n".join(c.results))
    print("\n== figures")
    for k, v in c.figures.items():
        print(f"{k}: {v}")
    return 1 if c.failed else 0


if __name__ == "__main__":
    sys.exit(main())
