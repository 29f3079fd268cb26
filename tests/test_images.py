"""Image inputs (VLMs): loading and canonicalisation, hostile images as row errors, the
request each engine sends, the tiny LLaVA generating on the CPU, config checks, and the
workflow end to end with image paths (JSONL) and a Hugging Face Image column (Parquet)."""

from __future__ import annotations

import base64
import dataclasses
import hashlib
import io
import json
import socket
import struct
import zlib
from pathlib import Path

import pytest
from PIL import Image

from conftest import run_workflow
from fakes import drive, stand_in_command
from fakes.configs import pipeline_config
from fakes.fake_http import Behaviour, FakeServer
from mirageflow.prompts import images
from mirageflow.config import ConfigError, DatasetConfig, LaunchedServer, ProcessorConfig, ServerArgs, load_config
from mirageflow.engines.wire import Request
from mirageflow.errors import RowError

RED, BLUE = (255, 0, 0), (0, 0, 255)


def png(size=(40, 20), color=RED, mode="RGB") -> bytes:
    buf = io.BytesIO()
    Image.new(mode, size, color).save(buf, format="PNG")
    return buf.getvalue()


def exif_rotated_jpeg() -> bytes:
    """A 40x20 JPEG, left half red, whose EXIF says 'rotate 90 degrees clockwise' (orientation 6)."""
    im = Image.new("RGB", (40, 20), BLUE)
    im.paste(RED, (0, 0, 20, 20))
    exif = Image.Exif()
    exif[0x0112] = 6
    buf = io.BytesIO()
    im.save(buf, format="JPEG", exif=exif, quality=95)
    return buf.getvalue()


def bomb_png(width=60000, height=60000) -> bytes:
    """A valid PNG header claiming 3.6 G pixels (a decompression bomb), with almost no data."""

    def chunk(kind, data):
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    return (
        b"\x89PNG\r\n\x1a\n"
        + chunk(b"IHDR", struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0))
        + chunk(b"IDAT", zlib.compress(b"\0" * 64))
        + chunk(b"IEND", b"")
    )


def load(value, base=".", **spec):
    return (
        images.RowImages([images.ImageInput("photo", **spec)])({"photo": value}, 0)
        if base == "."
        else images.RowImages([images.ImageInput("photo", **spec)], [DatasetConfig(0, str(base), "jsonl", "out", "jsonl", None)])(
            {"photo": value}, 0
        )
    )


def error_of(value, **spec) -> RowError:
    with pytest.raises(RowError) as info:
        load(value, **spec)
    assert info.value.stage == "image"
    return info.value


# --------------------------------------------------------------------------- canonicalisation


def test_exif_orientation_rgb_and_max_side(tmp_path):
    (tmp_path / "rot.jpg").write_bytes(exif_rotated_jpeg())
    (img,) = load(str(tmp_path / "rot.jpg"))["photo"]
    assert (img.width, img.height, img.mime) == (20, 40, "image/jpeg")  # turned upright, re-encoded as a JPEG
    top = img.pil().getpixel((10, 5))
    assert top[0] > 200 and top[2] < 60  # the red half is on top after the rotation
    assert img.sha256 == hashlib.sha256(img.data).hexdigest()

    rgba = png((30, 10), (0, 0, 0, 0), mode="RGBA")  # transparent: composited on white
    (img,) = load("data:image/png;base64," + base64.b64encode(rgba).decode())["photo"]
    assert img.pil().mode == "RGB" and img.pil().getpixel((0, 0)) == (255, 255, 255)

    (img,) = load("data:image/png;base64," + base64.b64encode(png((400, 100))).decode(), max_side=64)["photo"]
    assert (img.width, img.height) == (64, 16)


def test_a_canonical_image_is_sent_as_its_own_bytes(tmp_path):
    data = png((16, 16), BLUE)
    (tmp_path / "a.png").write_bytes(data)
    (img,) = load("a.png", base=tmp_path)["photo"]
    assert img.data == data and img.sha256 == hashlib.sha256(data).hexdigest()
    assert img.data_uri() == "data:image/png;base64," + base64.b64encode(data).decode()


def test_sources_paths_lists_hf_features_and_bases(tmp_path):
    (tmp_path / "imgs").mkdir()
    (tmp_path / "imgs" / "a.png").write_bytes(png(color=RED))
    (tmp_path / "imgs" / "b.png").write_bytes(png(color=BLUE))
    got = load(["imgs/a.png", "imgs/b.png"], base=tmp_path)["photo"]  # relative to the dataset's folder
    assert [im.pil().getpixel((0, 0)) for im in got] == [RED, BLUE]
    (feature,) = load({"bytes": png(color=BLUE), "path": "x.png"})["photo"]  # an HF Image value: bytes first
    assert feature.pil().getpixel((0, 0)) == BLUE
    (by_path,) = load({"bytes": None, "path": "imgs/a.png"}, base=tmp_path)["photo"]
    assert by_path.pil().getpixel((0, 0)) == RED

    ds = DatasetConfig(0, str(tmp_path / "data.jsonl"), "jsonl", "out", "jsonl", None)
    assert images.dataset_image_base(ds) == str(tmp_path)
    ds = dataclasses.replace(ds, image_base_path=str(tmp_path / "imgs"))
    assert images.dataset_image_base(ds) == str(tmp_path / "imgs")


# --------------------------------------------------------------------------- hostile images


def test_hostile_images_are_row_errors_naming_the_source(tmp_path):
    truncated = png((64, 64))
    (tmp_path / "cut.png").write_bytes(truncated[: len(truncated) // 2])
    (tmp_path / "text.png").write_text("this is not an image\n")
    (tmp_path / "bomb.png").write_bytes(bomb_png())
    (tmp_path / "big.png").write_bytes(png((100, 100)))
    (tmp_path / "dir.png").mkdir()
    cases = {
        "cut.png": "image_unreadable",
        "text.png": "image_unreadable",
        "bomb.png": "image_too_large",
        "missing.png": "image_missing",
        "dir.png": "image_unreadable",
    }
    for name, kind in cases.items():
        e = error_of(str(tmp_path / name))
        assert e.kind == kind and name in str(e) and "photo" in str(e), (name, e.kind, str(e))
    assert error_of(str(tmp_path / "big.png"), max_pixels=5000).kind == "image_too_large"
    assert "more than max_bytes" in str(error_of(str(tmp_path / "big.png"), max_bytes=100))
    assert error_of("data:image/png;base64,!!!notbase64").kind == "image_unreadable"
    assert error_of(42).kind == "image_invalid_value"
    assert error_of([]).kind == "image_invalid_value"
    assert error_of({"bytes": None, "path": None}).kind == "image_invalid_value"


def test_an_unreachable_url_says_there_may_be_no_network():
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    e = error_of(f"http://127.0.0.1:{port}/cat.png")
    assert e.kind == "image_remote_unreachable" and "no network" in str(e) and f"127.0.0.1:{port}/cat.png" in str(e)


def test_a_downloaded_image(monkeypatch):
    import http.server
    import threading

    body = png(color=BLUE)

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200 if self.path == "/cat.png" else 404)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    for name in ("HTTP_PROXY", "http_proxy", "ALL_PROXY", "all_proxy"):
        monkeypatch.delenv(name, raising=False)
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}"
        (img,) = load(url + "/cat.png")["photo"]
        assert img.data == body
        assert error_of(url + "/nope.png").kind == "image_missing"
        assert error_of(url + "/cat.png", max_bytes=10).kind == "image_too_large"
    finally:
        server.shutdown()


# --------------------------------------------------------------------------- placement in the messages


def _img(color) -> images.CanonicalImage:
    data = png(color=color)
    return images.CanonicalImage(data, "image/png", 40, 20, hashlib.sha256(data).hexdigest(), "test")


def test_images_go_where_the_prompt_names_them_inside_the_user_turn():
    a, b, c = _img(RED), _img(BLUE), _img((0, 255, 0))
    row = {"photo": [a, b], "logo": [c]}
    messages = [{"role": "system", "content": "be brief"},
                {"role": "user", "content": images.marked({"q": "x"}, row)["logo"] + " then " + images.marked({}, row)["photo"] + " what?"}]  # fmt: skip
    placed = images.attach(messages, row, row)
    assert placed == [c, a, b]
    assert messages[1]["content"] == [
        {"type": "image"},
        {"type": "text", "text": " then "},
        {"type": "image"},
        {"type": "image"},
        {"type": "text", "text": " what?"},
    ]
    assert messages[0] == {"role": "system", "content": "be brief"}

    plain = [{"role": "user", "content": "Describe."}]  # a prompt naming no image: all, first, in input order
    assert images.attach(plain, row, ["photo", "logo"]) == [a, b, c]
    assert plain[0]["content"] == [{"type": "image"}] * 3 + [{"type": "text", "text": "Describe."}]
    wire = images.openai_messages(plain, [a, b, c])
    assert [p["image_url"]["url"] for p in wire[0]["content"][:3]] == [a.data_uri(), b.data_uri(), c.data_uri()]
    assert plain[0]["content"][0] == {"type": "image"}  # the request's own messages are not changed

    with pytest.raises(RowError, match="filter"):
        images.attach([{"role": "user", "content": images.marked({}, row)["photo"].upper()}], row, row)


# --------------------------------------------------------------------------- engines


def _request(prompt_images, prompt=None):
    content = [{"type": "image"} for _ in prompt_images] + [{"type": "text", "text": "Describe."}]
    return Request(0, [{"role": "user", "content": content}], prompt, {"max_new_tokens": 4}, images=list(prompt_images))


def test_openai_sends_content_parts_with_data_uris(monkeypatch):
    from mirageflow.engines.openai_engine import OpenAIEngine

    for name in ("HTTP_PROXY", "http_proxy", "ALL_PROXY", "all_proxy"):
        monkeypatch.delenv(name, raising=False)
    server = FakeServer(Behaviour()).start()
    a, b = _img(RED), _img(BLUE)
    try:
        proc = ProcessorConfig(type="llm", backend="openai", server_args=ServerArgs("m"), sampling_params={},
                               chat_template_kwargs={}, apply_chat_template=True, torch_threads=None,
                               base_url=server.url + "/v1", request_timeout=10.0, max_retries=0)  # fmt: skip
        engine = OpenAIEngine(proc)
        engine.load()
        try:
            request = _request([a, b])
            request.messages.insert(0, {"role": "system", "content": "be brief"})
            (c,) = drive(engine, [request])
        finally:
            engine.close()
    finally:
        server.stop()
    assert c.error_kind is None and c.text
    (record,) = server.records
    assert record["body"]["messages"] == [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": a.data_uri()}},
            {"type": "image_url", "image_url": {"url": b.data_uri()}},
            {"type": "text", "text": "Describe."},
        ]},
    ]  # fmt: skip


def _sglang_processor(model, backend="sglang", **fields) -> ProcessorConfig:
    args = {"model_path": str(model), "tp_size": 1, "dp_size": 1, "trust_remote_code": False, "extra_engine_args": {}}
    return ProcessorConfig(type="llm", backend=backend, server_args=ServerArgs(**args), sampling_params={}, chat_template_kwargs={},
                           apply_chat_template=True, torch_threads=None, **fields)  # fmt: skip


def test_sglang_in_process_aligns_image_data_with_placeholders(fake_sglang, tiny_vlm):
    from mirageflow.engines.sglang_engine import SGLangEngine
    from mirageflow.shard.steps.llm import LLMStep

    a, b = _img(RED), _img(BLUE)
    engine = SGLangEngine(_sglang_processor(tiny_vlm))
    engine.load()
    try:
        output = load_config(_vlm_config(tiny_vlm, Path("unused.jsonl"), check_paths=False), check_paths=False).outputs[0]
        step = LLMStep(output, engine.processor, engine)
        request = step.request(0, {"photo": "x", "q": "what?"}, images={"photo": [a, b]})
        one = step.request(1, {"photo": "x", "q": "and?"}, images={"photo": [a]})
        bad = Request(2, request.messages, request.prompt.replace("<image>", "", 1), {}, images=[a, b])
        done, single, mismatch = drive(engine, [request, one, bad])
    finally:
        engine.close()
    (fake,) = fake_sglang.ENGINES
    call = fake.calls[0]
    assert call["image_data"] == [a.data_uri(), b.data_uri()] and call["input_ids"].count(1) == 1  # one BOS
    prompt = call["prompt"]
    # both placeholders inside the user turn, before the generation prompt (not after it, as MMIRAGE)
    assert prompt.count("<image>") == 2 and prompt.rindex("<image>") < prompt.index("<|assistant|>")
    assert prompt.index("<|user|>") < prompt.index("<image>")
    assert done.error_kind is None and done.image_tokens == 2 * fake_sglang.TOKENS_PER_IMAGE
    assert single.error_kind is None and single.image_tokens == fake_sglang.TOKENS_PER_IMAGE
    assert mismatch.error_kind == "image_placeholders" and "1 image placeholder" in mismatch.error
    assert len(fake.calls) == 2  # the mismatched request never reached SGLang


def test_sglang_server_sends_text_and_image_data(tmp_path, tiny_vlm, monkeypatch):
    from mirageflow.engines.sglang_server import SGLangServerEngine

    monkeypatch.setattr(SGLangServerEngine, "health_poll_interval", 0.05)
    for name in ("HTTP_PROXY", "http_proxy", "ALL_PROXY", "all_proxy"):
        monkeypatch.delenv(name, raising=False)
    a = _img(RED)
    proc = _sglang_processor(tiny_vlm, "sglang_server", launch=LaunchedServer(stand_in_command(), start_timeout=20.0),
                             request_timeout=10.0, max_retries=0)  # fmt: skip
    engine = SGLangServerEngine(proc, log_dir=tmp_path)
    engine.load()
    try:
        messages = [{"role": "user", "content": [{"type": "text", "text": "Look: "}, {"type": "image"}, {"type": "text", "text": " ok?"}]}]
        prompt = engine.chat_prompt(messages, {})
        (c,) = drive(engine, [Request(0, messages, prompt, {"max_new_tokens": 3}, images=[a])])
        import httpx2

        seen = httpx2.get(f"{engine.base_url}/get_server_info", trust_env=False).json()
    finally:
        engine.close()
    assert c.error_kind is None, c.error
    assert seen["texts"] == [prompt] and seen["image_data"] == [[a.data_uri()]] and seen["input_ids"] == [None]
    assert c.image_tokens is not None and c.image_tokens > 0
    assert prompt == "<|im_start|>user\nLook: <image> ok?<|im_end|>\n<|im_start|>assistant\n"


# --------------------------------------------------------------------------- the tiny VLM on the CPU


def test_tiny_vlm_generates_from_images_on_the_cpu(tiny_vlm):
    from mirageflow.engines.transformers_engine import TransformersEngine

    engine = TransformersEngine(ServerArgs(str(tiny_vlm)), batch_size=4)
    engine.load()
    try:
        assert type(engine.model).__name__ == "LlavaForConditionalGeneration"
        red, blue = _img(RED), _img(BLUE)

        def request(i, imgs):
            messages = [{"role": "user", "content": [*({"type": "image"} for _ in imgs), {"type": "text", "text": "What is it?"}]}]
            return Request(i, messages, engine.chat_prompt(messages, {}), {"max_new_tokens": 6, "temperature": 0}, images=imgs)

        text_only = [{"role": "user", "content": "Hello"}]
        reqs = [request(0, [red]), request(1, [blue]), request(2, [red, blue]), request(3, [red]),
                Request(4, text_only, engine.chat_prompt(text_only, {}), {"max_new_tokens": 6, "temperature": 0})]  # fmt: skip
        bad = request(5, [red, blue])
        bad.prompt = bad.prompt.replace("<image>", "", 1)
        out = drive(engine, [*reqs, bad])
    finally:
        engine.close()
    assert [c.error_kind for c in out[:5]] == [None] * 5
    assert [c.image_tokens for c in out[:4]] == [16, 16, 32, 16]  # 16 patches per 32x32 image
    assert out[4].image_tokens is None and out[4].completion_tokens > 0  # text rows still work on a VLM
    assert out[0].text == out[3].text and out[0].completion_tokens == 6  # greedy: deterministic
    assert out[0].prompt_tokens == out[3].prompt_tokens > 16 and out[2].prompt_tokens == out[0].prompt_tokens + 16
    assert out[5].error_kind == "image_placeholders"


# --------------------------------------------------------------------------- config


def _vlm_config(model, data, check_paths=True, **input_fields) -> dict:
    return pipeline_config(
        data, model=model, output_dir="out/jsonl", num_shards=2, loading={"batch_size": 4},
        inputs=[{"name": "photo", "key": "image", "type": "image", **input_fields}, {"name": "q", "key": "question"}],
        outputs=[{"name": "answer", "prompt": "{{ q }} {{ photo }} Answer briefly."}],
        processor={"backend": "transformers", "default_sampling_params": {"temperature": 0.0, "max_new_tokens": 6}},
        processing={"remove_columns": False}, shard_params={"max_error_rate": 0.9},
    )  # fmt: skip


def test_config_checks_name_the_key(tmp_path, tiny_model, tiny_vlm):
    from mirageflow.config.preflight import validate

    data = tmp_path / "d.jsonl"
    data.write_text(json.dumps({"image": "a.png", "question": "q"}) + "\n" + json.dumps({"image": "b.png", "question": "r"}) + "\n")
    cfg = _vlm_config(tiny_vlm, data)
    cfg["processors"][0]["apply_chat_template"] = False
    cfg["processing_params"]["outputs"][0]["system"] = "Look at {{ photo }}"
    cfg["processing_params"]["inputs"][1]["max_side"] = 10
    with pytest.raises(ConfigError) as info:
        load_config(cfg)
    text = str(info.value)
    assert "processors[0].apply_chat_template: false, but image inputs (photo) need the chat template" in text
    assert "processing_params.outputs[0].system: image input 'photo' can only be used in the prompt" in text
    assert "processing_params.inputs[1].max_side: only image inputs have max_side" in text

    with pytest.raises(
        ConfigError,
        match=r"processing_params.inputs\[0\].type: image input 'photo', but processors\[0\].server_args.model_path .* is a text-only model",
    ):
        validate(_vlm_config(tiny_model, data))
    validate(_vlm_config(tiny_vlm, data))  # a VLM passes


# --------------------------------------------------------------------------- end to end


def test_workflow_with_image_paths_and_an_hf_image_column(tmp_path, tiny_vlm):
    import datasets

    (tmp_path / "imgs").mkdir()
    (tmp_path / "imgs" / "red.png").write_bytes(png(color=RED))
    (tmp_path / "imgs" / "rot.jpg").write_bytes(exif_rotated_jpeg())
    (tmp_path / "imgs" / "broken.png").write_text("not a png")
    rows = [
        {"image": "red.png", "question": "Color?"},
        {"image": ["red.png", "rot.jpg"], "question": "Same?"},
        {"image": "missing.png", "question": "Where?"},
        {"image": "broken.png", "question": "What?"},
        {"image": "rot.jpg", "question": "Which way?"},
    ]
    data = tmp_path / "rows.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    features = datasets.Features({"picture": datasets.Image(), "question": datasets.Value("string")})
    hf = datasets.Dataset.from_dict(
        {"picture": [{"bytes": png(color=BLUE), "path": None}] * 3, "question": ["a", "b", "c"]}, features=features
    )
    hf.to_parquet(str(tmp_path / "hf.parquet"))

    cfg = _vlm_config(tiny_vlm, data, max_side=24)
    cfg["loading_params"]["num_shards"] = 1  # one model load: the CPU time of this test
    cfg["loading_params"]["datasets"][0]["image_base_path"] = str(tmp_path / "imgs")
    cfg["loading_params"]["datasets"].append({"path": str(tmp_path / "hf.parquet"), "type": "parquet", "output_dir": "out/hf"})
    cfg["processing_params"]["inputs"][0]["key"] = "image || picture"
    cfg["processing_params"]["remove_columns"] = True
    cfg["processing_params"]["output_schema"] = {"question": "{{ q }}", "answer": "{{ answer }}"}
    run_workflow(tmp_path, cfg)

    import pandas as pd

    out = pd.read_parquet(tmp_path / "out/jsonl/merged")
    assert out["source_index"].tolist() == [0, 1, 4] and all(isinstance(a, str) and a for a in out["answer"])
    hf_out = pd.read_parquet(tmp_path / "out/hf/merged")
    assert hf_out["source_index"].tolist() == [0, 1, 2]
    errors = [json.loads(line) for line in (tmp_path / "state" / "shard_0" / "errors.jsonl").read_text().splitlines()]
    by_row = {(e["source_index"], e["error"]) for e in errors}
    assert by_row == {(2, "image_missing"), (3, "image_unreadable")}
    assert all(e["stage"] == "image" for e in errors) and any("missing.png" in e["message"] for e in errors)
    stats = json.loads((tmp_path / "state" / "shard_0" / "status.json").read_text())["stats"]
    assert stats["images"] == 4 + 3  # rows 0, 1 (two), 4 and the three HF rows
    assert stats["image_tokens"] == 16 * 7 and stats["input_tokens"] > stats["image_tokens"]


def test_preview_shows_where_the_images_go(tmp_path, tiny_vlm):
    from mirageflow.shard import preview

    (tmp_path / "red.png").write_bytes(png(color=RED))
    data = tmp_path / "rows.jsonl"
    data.write_text(
        json.dumps({"image": "red.png", "question": "Color?"}) + "\n" + json.dumps({"image": "gone.png", "question": "?"}) + "\n"
    )
    result = preview.preview(load_config(_vlm_config(tiny_vlm, data)), rows=2)
    ok, missing = result["datasets"][0]["rows"]
    (out,) = ok["outputs"]
    assert out["messages"][-1]["content"] == [
        {"type": "text", "text": "Color? "},
        {"type": "image"},
        {"type": "text", "text": " Answer briefly."},
    ]
    assert out["prompt"].count("<image>") == 1 and out["images"][0]["source"] == "red.png"
    assert missing["error"]["error"] == "image_missing" and "gone.png" in missing["error"]["message"]
