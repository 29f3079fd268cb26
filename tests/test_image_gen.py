"""outputs of type image_gen: an OpenAI-style images endpoint (a stand-in on 127.0.0.1,
tests/fakes/fake_images.py), a tiny random diffusers pipeline on the CPU built offline, and
SGLang's diffusion server launched by the shard (a stand-in taking its flags; the real
package's flags and protocol checked in build/venv-sglang). Files written atomically and
never replacing another's, records holding the path and the seed, failures as row errors
with classes, and a resumed shard reusing the images it already wrote."""

from __future__ import annotations

import ast
import copy
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from fakes import FAKES, alive
from fakes.fake_images import Behaviour, FakeImages, bmp_bomb, png

from mirageflow.cluster.resources import shard_gpus
from mirageflow.config import ConfigError, load_config
from mirageflow.config.types import ImageGenProcessor
from mirageflow.engines.server_restarts import ServerSupervisor
from mirageflow.imagegen.http_images import GeneratorFailed, SGLangDiffusionServer, request_body, sglang_diffusion_missing
from mirageflow.imagegen.base import ImageError, ImageJob, decode_image
from mirageflow.shard import ShardFailed
from mirageflow.shard.runner import index_datasets, run_shard

HERE = Path(__file__).resolve().parent
TEXTS = ["a cat", "a dog FAIL_POLICY", "a fox BAD_IMAGE", "a cow SLOW", "an owl", "a bee NOT_B64", "a hen FAIL_SERVER", "a pig"]
CLASSES = {1: "content_filter", 2: "image_undecodable", 3: "image_timeout", 5: "image_undecodable", 6: "image_generation_failed"}


@pytest.fixture
def server(monkeypatch):
    for name in ("HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY", "http_proxy", "https_proxy", "all_proxy"):
        monkeypatch.delenv(name, raising=False)
    srv = FakeImages(Behaviour(slow_seconds=2.0)).start()
    yield srv
    srv.stop()


def _rows(path: Path, texts=TEXTS) -> Path:
    path.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    return path


def _config(tmp_path: Path, processor: dict, texts=TEXTS, **output) -> dict:
    return {
        "processors": [{"type": "image_gen", **processor}],
        "loading_params": {
            "datasets": [{"path": str(_rows(tmp_path / "in.jsonl", texts)), "type": "JSONL", "output_dir": str(tmp_path / "out")}],
            "state_dir": str(tmp_path / "state"),
        },
        "processing_params": {
            "inputs": [{"name": "text", "key": "text"}],
            "outputs": [
                {"name": "pic", "type": "image_gen", "prompt": "A drawing of {{ text }}", "width": 32, "height": 48, "seed": 5, **output}
            ],
            "remove_columns": True,
            "output_schema": {"caption": "{{ text }}", "image": "{{ pic }}"},
        },
        "shard_params": {"max_error_rate": 1.0, "checkpoint_rows": 2},
    }


def _external(srv: FakeImages, **extra) -> dict:
    return {
        "backend": "external",
        "external": {"base_url": srv.url + "/v1", "timeout_seconds": 0.5, "max_concurrent_requests": 4, **extra},
        "max_retries": 1,
    }


def _run(raw: dict) -> dict:
    cfg = load_config(raw)
    index_datasets(cfg)
    return run_shard(cfg, 0)


def _records(tmp_path: Path) -> list[dict]:
    import pyarrow.parquet as pq

    return sorted(
        (r for f in (tmp_path / "out" / "shard_0").glob("part-*.parquet") for r in pq.read_table(f).to_pylist()),
        key=lambda r: r["source_index"],
    )


def _errors(tmp_path: Path) -> dict[int, str]:
    path = tmp_path / "state" / "shard_0" / "errors.jsonl"
    return {e["source_index"]: e["error"] for e in map(json.loads, path.read_text().splitlines())} if path.exists() else {}


def test_images_from_an_images_endpoint_are_files_with_their_path_and_seed_in_the_record(tmp_path, server):
    from PIL import Image

    status = _run(_config(tmp_path, _external(server)))
    records, errors = _records(tmp_path), _errors(tmp_path)
    assert errors == CLASSES and sorted([r["source_index"] for r in records] + list(errors)) == list(range(len(TEXTS)))
    out = tmp_path / "out"
    for r in records:
        assert r["image"] == r["pic_path"] and r["image"].startswith("images/generated_0_")
        with Image.open(out / r["image"]) as im:
            assert im.size == (32, 48) and im.format == "PNG"
        assert isinstance(r["pic_seed"], int)
    # __sample_index is the row's place in the shard, __source_hash the inputs' hash
    assert records[0]["image"].startswith(f"images/generated_0_{records[0]['source_index']}_")
    # the body the server got: size, the row's seed, the prompt rendered
    body = next(b for b in server.behaviour.bodies if b["prompt"] == "A drawing of a cat")
    assert (body["size"], body["seed"], body["response_format"]) == ("32x48", records[0]["pic_seed"], "b64_json")
    # only the images of the records are on disk (no temp file left), each listed in images.jsonl
    assert sorted(p.name for p in (out / "images").iterdir()) == sorted(Path(r["image"]).name for r in records)
    ledger = (tmp_path / "state" / "shard_0" / "images.jsonl").read_text().splitlines()
    assert json.loads(ledger[0])["fingerprint"] and len(ledger) - 1 == len(records)
    assert status["engines"]["image_gen"]["backend"] == "external"


def test_the_same_seed_gives_the_same_image_on_a_rerun_and_for_any_sharding(tmp_path, server):
    first, second = tmp_path / "a", tmp_path / "b"
    first.mkdir(), second.mkdir()
    texts = ["a cat", "a dog", "a fox", "an owl"]
    _run(_config(first, _external(server), texts))
    raw = _config(second, _external(server), texts)
    raw["loading_params"]["num_shards"] = 2
    cfg = load_config(raw)
    index_datasets(cfg)
    run_shard(cfg, 0), run_shard(cfg, 1)
    import pyarrow.parquet as pq

    one = {r["source_index"]: r["pic_seed"] for r in _records(first)}
    two = {
        r["source_index"]: r["pic_seed"]
        for d in (second / "out").glob("shard_*")
        for f in d.glob("*.parquet")
        for r in pq.read_table(f).to_pylist()
    }
    assert one == two and len(set(one.values())) == 4


def test_a_resumed_shard_reuses_the_images_it_wrote_and_a_foreign_file_is_never_replaced(tmp_path, server):
    texts = [f"animal {i}" for i in range(8)]
    server.behaviour.fatal_after = 5  # then every request is a 401: the shard fails
    # no timeouts here (the fixture's 0.5 s is for the SLOW rows; on a loaded machine an answer may take longer)
    raw = _config(tmp_path, {**_external(server, timeout_seconds=30), "max_retries": 0}, texts)
    raw["processors"][0]["external"]["max_concurrent_requests"] = 1
    raw["processing_params"]["outputs"][0]["filename_template"] = "img_{{ __source_index }}"
    raw["shard_params"]["checkpoint_rows"] = 100  # nothing committed before the failure
    with pytest.raises(ShardFailed, match="HTTP 401"):
        _run(raw)
    written = sorted(p.name for p in (tmp_path / "out" / "images").iterdir())
    assert len(written) == 5 and len(_records(tmp_path)) == 5  # the failing shard committed what was finished
    # as if the shard had been killed after writing the images and before committing their rows
    (tmp_path / "state" / "shard_0" / "checkpoint.json").unlink()
    foreign = tmp_path / "out" / "images" / "img_7.png"
    foreign.write_bytes(b"someone else's file")
    server.behaviour.fatal_after = None
    before = server.requests
    _run(raw)
    assert server.requests - before == 2  # rows 5 and 6: rows 0-4 reuse their images, row 7's name is taken
    assert _errors(tmp_path) == {7: "image_name_taken"} and foreign.read_bytes() == b"someone else's file"
    assert [r["image"] for r in _records(tmp_path)] == [f"images/img_{i}.png" for i in range(7)]


def test_two_rows_one_file_name_is_a_row_error_not_a_replaced_file(tmp_path, server):
    raw = _config(tmp_path, _external(server), ["a cat", "a dog", "a fox"])
    raw["processing_params"]["outputs"][0]["filename_template"] = "same"
    raw["processors"][0]["external"]["max_concurrent_requests"] = 1
    _run(raw)
    errors = _errors(tmp_path)
    assert len(errors) == 2 and set(errors.values()) == {"image_name_taken"} and len(_records(tmp_path)) == 1


def test_a_decompression_bomb_and_a_name_the_filesystem_refuses_fail_their_row_the_same_on_every_rerun(tmp_path, server):
    """One row boundary: a bomb image (58 bytes claiming 100000 x 100000 pixels) and a file
    name longer than a filesystem takes are row errors with their class, never the shard's
    failure; a retry of those rows fails them the same way."""
    long_name = "x" * 300
    texts = ["a cat", "a bomb BOMB_IMAGE", f"a {long_name}", "an owl"]
    raw = _config(tmp_path, _external(server), texts)
    raw["processing_params"]["outputs"][0]["filename_template"] = "img_{{ __source_index }}_{{ text }}"
    expected = {1: "image_too_large", 2: "image_name_refused"}
    _run(raw)
    assert _errors(tmp_path) == expected and len(_records(tmp_path)) == 2
    messages = {
        e["source_index"]: e["message"] for e in map(json.loads, (tmp_path / "state/shard_0/errors.jsonl").read_text().splitlines())
    }
    assert "decompression bomb" in messages[1] and "more than a filesystem takes (255)" in messages[2]
    _run({**raw, "retry_failed_rows": True})
    assert _errors(tmp_path) == expected and len(_records(tmp_path)) == 2
    assert sorted(p.name for p in (tmp_path / "out" / "images").iterdir()) == ["img_0_a_cat.png", "img_3_an_owl.png"]


@pytest.mark.parametrize(
    "data",
    [b"", b"not an image", bmp_bomb(), bmp_bomb(9000, 9000), png(8, 8, 1)[:40], b"GIF89a" + b"\xff" * 20, b"\x89PNG\r\n\x1a\n" * 3],
    ids=["empty", "text", "bomb", "above_max_output_pixels", "truncated_png", "broken_gif", "png_magic_only"],
)
def test_whatever_an_answers_bytes_do_decoding_them_is_an_image_error(data):
    """The decoder is the boundary of one answer's image: any exception in it is the row's ImageError."""
    with pytest.raises(ImageError) as e:
        decode_image(data, "answer")
    assert e.value.kind in ("image_undecodable", "image_too_large")


def test_an_edit_replaces_exactly_the_images_of_the_rows_it_changed_and_an_undo_works(tmp_path, server):
    """The image ledger is read from the state layout's paths and kept across edits: a prompt
    edit makes every image again in place of the old one, an edit of one row makes that
    row's, an undo makes them as they were; every row is ok each time."""
    texts = [f"animal {i}" for i in range(6)]
    raw = _config(tmp_path, _external(server), texts)
    raw["processing_params"]["outputs"][0]["filename_template"] = "img_{{ __source_index }}"
    images = tmp_path / "out" / "images"

    def run_and_check(sent: int, config: dict) -> dict[str, bytes]:
        before = server.requests
        _run(config)
        assert server.requests - before == sent
        assert _errors(tmp_path) == {} and len(_records(tmp_path)) == len(texts)
        files = {p.name: p.read_bytes() for p in images.iterdir()}
        assert sorted(files) == [f"img_{i}.png" for i in range(len(texts))]
        return files

    first = run_and_check(6, raw)
    edited = copy.deepcopy(raw)
    edited["processing_params"]["outputs"][0]["prompt"] = "A painting of {{ text }}"
    edited["processing_params"]["outputs"][0]["seed"] = 6  # another seed: other images (the fake draws them from it)
    second = run_and_check(6, edited)
    assert all(second[name] != first[name] for name in first)
    _rows(tmp_path / "in.jsonl", [*texts[:2], "a new animal", *texts[3:]])
    third = run_and_check(1, edited)  # only row 2's request changed (the fake's image is its seed's colour)
    assert server.behaviour.bodies[-1]["prompt"] == "A painting of a new animal" and third == second
    _rows(tmp_path / "in.jsonl", texts)
    assert run_and_check(6, raw) == first  # the undo: the first run's images again


def test_a_record_whose_image_is_gone_fails_the_shard_naming_it(tmp_path, server):
    raw = _config(tmp_path, _external(server), ["a cat", "a dog"])
    _run(raw)
    image = tmp_path / "out" / _records(tmp_path)[0]["image"]
    image.unlink()
    (tmp_path / "state" / "shard_0" / "status.json").unlink()
    with pytest.raises(ShardFailed, match=f"not there or not the one written.*{image.name}"):
        _run(raw)


# --------------------------------------------------------------------------- diffusers


@pytest.fixture(scope="session")
def tiny_diffusion(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("models") / "tiny-diffusion"
    subprocess.run([sys.executable, "-m", "mirageflow.model_prep", "tiny-diffusion", str(out)], check=True, capture_output=True)
    return out


def test_a_tiny_diffusers_pipeline_on_the_cpu_makes_deterministic_images(tmp_path, tiny_diffusion):
    from PIL import Image

    processor = {"backend": "diffusers", "pipeline_args": {"model_path": str(tiny_diffusion), "device": "cpu"},
                 "default_sampling_params": {"num_inference_steps": 2}, "parallel_chunk_size": 2}  # fmt: skip
    texts = ["a cat", "a dog", "a fox"]
    runs = []
    for name in ("a", "b"):
        root = tmp_path / name
        root.mkdir()
        raw = _config(root, processor, texts, width=64, height=64)
        status = _run(raw)
        records = _records(root)
        assert [r["source_index"] for r in records] == [0, 1, 2] and _errors(root) == {}
        for r in records:
            with Image.open(root / "out" / r["image"]) as im:
                assert im.size == (64, 64)
        runs.append([(root / "out" / r["image"]).read_bytes() for r in records])
        assert status["engines"]["image_gen"]["pipeline"] == "StableDiffusionPipeline"
    assert runs[0] == runs[1] and len(set(runs[0])) == 3  # same seeds, same images; rows differ


# --------------------------------------------------------------------------- SGLang's diffusion server


def test_backend_sglang_launches_the_diffusion_server_and_stops_it(tmp_path, monkeypatch):
    for name in ("HTTP_PROXY", "HTTPS_PROXY", "http_proxy", "https_proxy"):
        monkeypatch.delenv(name, raising=False)
    model = tmp_path / "model"
    model.mkdir()
    (model / "model_index.json").write_text("{}")
    processor = {
        "backend": "sglang",
        "sglang": {
            "model_path": str(model),
            "num_gpus": 2,
            "server_command": [sys.executable, str(FAKES / "fake_images.py")],
            "startup_timeout_seconds": 60,
        },
    }
    raw = _config(tmp_path, processor, ["a cat", "a dog"])
    status = _run(raw)
    info = status["engines"]["image_gen"]
    assert info["backend"] == "sglang" and "--num-gpus" in info["server_command"] and len(_records(tmp_path)) == 2
    import psutil

    assert not psutil.pid_exists(info["pid"]) or psutil.Process(info["pid"]).status() == psutil.STATUS_ZOMBIE
    assert shard_gpus(load_config(raw)) == 2


def _healing_diffusion_server(tmp_path: Path, monkeypatch, deaths: str, max_restarts: int, texts: list[str]) -> dict:
    """A config of backend sglang on the stand-in diffusion server whose k-th start dies as
    ``deaths`` says (FAKE_IMAGES_DEATHS), restarted quickly, two image requests at once."""
    for name in ("HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY", "http_proxy", "https_proxy", "all_proxy"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(SGLangDiffusionServer, "kill_grace", 2.0)
    monkeypatch.setattr(SGLangDiffusionServer, "health_poll_interval", 0.05)
    monkeypatch.setattr(ServerSupervisor, "restart_base_delay", 0.05)
    monkeypatch.setenv("FAKE_IMAGES_DEATHS", deaths)
    monkeypatch.setenv("FAKE_IMAGES_STARTS", str(tmp_path / "starts"))
    monkeypatch.setenv("FAKE_IMAGES_REQUEST_LOG", str(tmp_path / "requests.jsonl"))
    model = tmp_path / "model"
    model.mkdir()
    processor = {
        "backend": "sglang",
        "sglang": {
            "model_path": str(model),
            "server_command": [sys.executable, str(FAKES / "fake_images.py"), "--warmup-seconds", "0.1"],
            "startup_timeout_seconds": 30,
            "timeout_seconds": 60,
            "max_concurrent_requests": 2,
        },
        "max_retries": 0,
        "max_restarts": max_restarts,
        "hang_seconds": 1.5,
    }
    return _config(tmp_path, processor, texts)


def test_a_diffusion_server_killed_and_frozen_mid_shard_is_restarted_and_every_image_made_once(tmp_path, monkeypatch):
    texts = [f"animal {i}" for i in range(12)]
    raw = _healing_diffusion_server(tmp_path, monkeypatch, "kill:3,freeze:2", max_restarts=3, texts=texts)
    status = _run(raw)

    st = status["stats"]
    assert [(a["attempt"], a["outcome"]) for a in st["attempts"]] == [(1, "success")]  # one job attempt
    assert st["engine_restarts"] == 2 and st["rows_failed"] == 0
    deaths = st["engine_deaths"]
    assert [(d["processor"], d["class"]) for d in deaths] == [("image_gen", "killed_by_signal"), ("image_gen", "frozen")]
    assert "hang_seconds=1.5" in deaths[1]["cause"] and all(d["restarted_after_seconds"] is not None for d in deaths)
    pids = [int(p) for p in (tmp_path / "starts").read_text().split()]
    assert [d["pid"] for d in deaths] == pids[:2] and len(pids) == 3
    assert not any(alive(p) for p in pids)

    records = _records(tmp_path)  # every row's image once, with its file
    assert [r["caption"] for r in records] == texts
    assert sorted(p.name for p in (tmp_path / "out" / "images").iterdir()) == sorted(Path(r["image"]).name for r in records)
    seed_of = {f"A drawing of {r['caption']}": r["pic_seed"] for r in records}
    asked: dict[str, list] = {}
    answered: dict[str, list] = {}
    for line in map(json.loads, (tmp_path / "requests.jsonl").read_text().splitlines()):
        (asked if line["event"] == "asked" else answered).setdefault(line["prompt"], []).append(line)
    assert len(asked) == len(texts) and all(len(a) == 1 for a in answered.values())  # never answered twice
    for prompt, asks in asked.items():
        assert {a["seed"] for a in asks} == {seed_of[prompt]}  # the same request again: the row's seed
        assert all(a["pid"] in pids[:2] for a in asks[:-1])  # asked again only of a later server, after its server died
        assert [pids.index(a["pid"]) for a in asks] == sorted({pids.index(a["pid"]) for a in asks})
    # each death held at least the request that killed or froze it, sent again to its successor
    assert any(len(asks) > 1 for asks in asked.values()) and all(d["requests_resent"] >= 1 for d in deaths), deaths


def test_a_diffusion_server_that_cannot_come_back_fails_the_shard_with_its_death_class(tmp_path, monkeypatch):
    raw = _healing_diffusion_server(tmp_path, monkeypatch, "kill:1,exit", max_restarts=1, texts=["a cat", "a dog", "an owl"])
    with pytest.raises(ShardFailed, match="SGLang's diffusion server died 2 times during the run and was restarted 1 times"):
        _run(raw)
    failure = json.loads((tmp_path / "state" / "shard_0" / "failure.json").read_text())
    assert failure["failure_class"] == "failed_to_start" and failure["stats"]["engine_restarts"] == 1
    assert [d["class"] for d in failure["stats"]["engine_deaths"]] == ["killed_by_signal", "failed_to_start"]
    assert not any(alive(int(p)) for p in (tmp_path / "starts").read_text().split())


def test_backend_sglang_refuses_clearly_without_a_diffusion_server(tmp_path, monkeypatch):
    import importlib.util

    if importlib.util.find_spec("sglang") is not None:
        pytest.skip("sglang is installed here")
    assert "sglang package is not installed" in sglang_diffusion_missing()
    gen = SGLangDiffusionServer(ImageGenProcessor(type="image_gen", backend="sglang", model_path=str(tmp_path)), tmp_path)
    with pytest.raises(
        GeneratorFailed,
        match=r"image_gen backend sglang: the sglang package is not installed here \(pip install \"sglang\[diffusion\]==0.5.23\"",
    ):
        gen.load()


@pytest.mark.real_sglang
def test_the_real_sglang_package_has_the_flags_and_takes_the_request_we_send():
    import real_sglang_env

    error = real_sglang_env.check()
    if error is not None:
        if os.environ.get("MIRAGEFLOW_REQUIRE_REAL_SGLANG") == "1":
            pytest.fail(error)
        pytest.skip(f"REAL SGLANG TESTS NOT RUN: {error}")
    site = next(real_sglang_env.VENV.glob("lib/python3*/site-packages/sglang"))
    # the launcher we run and the flags we pass (its parser imports GPU-only packages: read, not run)
    assert (site / "multimodal_gen" / "runtime" / "launch_server.py").is_file()
    source = (site / "multimodal_gen" / "runtime" / "server_args" / "server_args.py").read_text()
    flags = {
        n.value
        for n in ast.walk(ast.parse(source))
        if isinstance(n, ast.Constant) and isinstance(n.value, str) and n.value.startswith("--")
    }
    assert {"--model-path", "--host", "--port", "--num-gpus"} <= flags and "--dtype" not in flags
    assert '@health_router.get("/health")' in (site / "multimodal_gen" / "runtime" / "entrypoints" / "http_server.py").read_text()
    body = request_body(ImageJob("a cat", "blurry", 64, 48, 7, {"num_inference_steps": 3, "guidance_scale": 4.0}), "m")
    from fakes.fake_images import png
    import base64

    answer = {"id": "x", "created": 1, "data": [{"b64_json": base64.b64encode(png(8, 8, 1)).decode()}]}
    code = (
        "import json, sys\n"
        "from sglang.multimodal_gen.runtime.entrypoints.openai.protocol import ImageGenerationsRequest, ImageResponse\n"
        "body, answer = json.loads(sys.argv[1]), json.loads(sys.argv[2])\n"
        "r = ImageGenerationsRequest(**body)\n"
        "assert (r.prompt, r.size, r.seed, r.negative_prompt, r.num_inference_steps, r.guidance_scale, r.response_format, r.n, r.model) == "
        "('a cat', '64x48', 7, 'blurry', 3, 4.0, 'b64_json', 1, 'm'), r\n"
        "assert not (set(body) - set(ImageGenerationsRequest.model_fields)), 'unknown fields'\n"
        "ImageResponse(**answer)\n"
        "print('ok')\n"
    )
    out = subprocess.run(
        [str(real_sglang_env.PYTHON), "-c", code, json.dumps(body), json.dumps(answer)], capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-3000:]


# --------------------------------------------------------------------------- config


def _raw(processor: dict | None = None, **output) -> dict:
    return {
        "processors": [{"type": "image_gen", **(processor or {"external": {"base_url": "http://x/v1"}})}],
        "loading_params": {"datasets": [{"path": "in.jsonl", "type": "JSONL", "output_dir": "out"}]},
        "processing_params": {
            "inputs": [{"name": "t", "key": "t"}, {"name": "im", "key": "im", "type": "image"}],
            "outputs": [{"name": "pic", "type": "image_gen", "prompt": "{{ t }}", **output}],
        },  # fmt: skip
    }


@pytest.mark.parametrize(
    "processor, output, problem",
    [
        (None, {"output_mode": "pil"}, "processing_params.outputs[0].output_mode: 'pil' keeps images in memory"),
        (None, {"filename_template": "{{ nope }}"}, "processing_params.outputs[0].filename_template: unknown variable 'nope'"),
        (
            None,
            {"prompt": "{{ im }} in oil"},
            "processing_params.outputs[0].prompt: image input(s) im: image generation takes text prompts only",
        ),
        (None, {"output_type": "JSON"}, "processing_params.outputs[0].output_type: an image_gen output is an image file"),
        (None, {"response_prefix": "x"}, "processing_params.outputs[0].response_prefix: only LLM outputs have a response_prefix"),
        (
            {"external": {"base_url": "http://x/v1", "api_key": "sk-live"}},
            {},
            "processors[0].external.api_key: a key written in the config",
        ),
        ({"backend": "diffusers"}, {}, "processors[0].pipeline_args: required key is missing (backend diffusers)"),
        ({"backend": "openai", "external": {"base_url": "http://x"}}, {}, "processors[0].backend: 'openai' runs language models"),
        (
            {"external": {"base_url": "http://x"}, "default_sampling_params": {"max_new_tokens": 5}},
            {},
            "processors[0].default_sampling_params.max_new_tokens: not an image generation parameter",
        ),
        (
            {"backend": "sglang", "sglang": {"model_path": "m", "dtype": "float16"}},
            {},
            "processors[0].sglang.dtype: sglang 0.5.23's diffusion server has no --dtype",
        ),
    ],
)
def test_image_gen_config_mistakes_are_refused_with_the_key(processor, output, problem):
    with pytest.raises(ConfigError) as e:
        load_config(_raw(processor, **output), check_paths=False)
    assert any(p.startswith(problem) for p in e.value.problems), e.value.problems


def test_gpus_of_an_image_pipeline_follow_its_backend():
    assert shard_gpus(load_config(_raw(), check_paths=False)) == 0  # an external server: nothing on the node
    assert shard_gpus(load_config(_raw({"backend": "diffusers", "pipeline_args": {"model_path": "m"}}), check_paths=False)) == 1
    assert (
        shard_gpus(load_config(_raw({"backend": "diffusers", "pipeline_args": {"model_path": "m", "device": "cpu"}}), check_paths=False))
        == 0
    )


def test_preview_shows_an_image_outputs_prompt_and_generates_nothing(tmp_path, server):
    from mirageflow.shard.preview import preview

    raw = _config(tmp_path, _external(server), ["a cat", "a dog"])
    result = preview(load_config(raw), rows=2, generate=True)
    rows = result["datasets"][0]["rows"]
    assert [r["outputs"][0]["prompt"] for r in rows] == ["A drawing of a cat", "A drawing of a dog"]
    assert rows[0]["record"]["image"] == "<pic: not generated>" and server.requests == 0
    assert not (tmp_path / "out").exists() and not (tmp_path / "state").exists()


def test_an_image_url_on_another_origin_is_fetched_without_the_key(tmp_path, server, monkeypatch):
    """Issue 33 item 2: an answer {"data": [{"url": "<another host:port>/x.png"}]} makes the shard
    fetch the image there without the Authorization header that goes to base_url."""
    monkeypatch.setenv("IMAGES_TEST_KEY", "sk-images")
    server.behaviour.api_key = "sk-images"
    image_host = FakeImages().start()
    try:
        server.behaviour.url_base = image_host.url
        texts = ["a cat", "a dog"]
        _run(_config(tmp_path, {**_external(server, api_key_env="IMAGES_TEST_KEY")}, texts))
        assert len(_records(tmp_path)) == 2 and not _errors(tmp_path)  # the images were fetched from the other origin
        assert len(image_host.get_headers) == 2
        assert all("authorization" not in h for h in image_host.get_headers), image_host.get_headers
    finally:
        image_host.stop()


def test_an_image_servers_key_and_url_password_are_masked_like_an_llm_servers(monkeypatch):
    """register_config_secrets covers image_gen processors too: their api_key_env value and the
    password and query values of their base_url never reach a log or a state file unmasked."""
    from mirageflow.redact import register_config_secrets, redact_text

    monkeypatch.setenv("IMAGES_TOKEN_FOR_MASKING", "img-key-3f9a1c")
    external = {"base_url": "http://user:img-pw-77e2@images:8000/v1?sig=img-sig-5b0d", "api_key_env": "IMAGES_TOKEN_FOR_MASKING"}
    register_config_secrets(load_config(_raw({"external": external}), check_paths=False))
    said = redact_text("sent img-key-3f9a1c to images; password img-pw-77e2, signature img-sig-5b0d")
    assert "img-key-3f9a1c" not in said and "img-pw-77e2" not in said and "img-sig-5b0d" not in said, said
