"""Issue 22, inputs: what a dataset row can point at (FIFOs, slow servers, files outside the
image folder, odd values), and what error messages may say about it. Each test names the
issue's item it covers."""

from __future__ import annotations

import http.server
import io
import os
import socketserver
import threading
import time

import pytest
from fakes.deadlines import run_with_deadline
from PIL import Image

from mirageflow.prompts import images
from mirageflow.errors import RowError


def png(size=(8, 8), color=(255, 0, 0)) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", size, color).save(buf, format="PNG")
    return buf.getvalue()


class _Dataset:
    def __init__(self, path, image_base_path=None, allow=False):
        self.index, self.path, self.image_base_path, self.allow_images_outside_base = 0, str(path), image_base_path, allow


def load(value, dataset, name="img"):
    return images.RowImages([images.ImageInput(name)], [dataset])({name: value}, 0)


def error_of(value, dataset) -> RowError:
    with pytest.raises(RowError) as e:
        load(value, dataset)
    return e.value


# --------------------------------------------------------------------------- item 1


def test_item1_a_fifo_image_path_is_refused_without_being_opened(tmp_path):
    """Item 1: an image path that is a FIFO blocked in open() forever; now a row error at once."""
    os.mkfifo(tmp_path / "pipe.png")
    finished, result = run_with_deadline(lambda: load("pipe.png", _Dataset(tmp_path / "d.jsonl")), 10)
    assert finished, "loading a FIFO image hung"
    assert isinstance(result, RowError) and result.kind == "image_unreadable", result
    assert "FIFO" in str(result) and "not a regular file" in str(result)


def test_item1_a_fifo_dataset_or_script_is_refused_at_dag_build(tmp_path):
    """Item 1 (datasets, scripts): a FIFO given as a JSONL dataset or a custom step's script is
    named as not a regular file by the config check, never opened."""
    from mirageflow.config import ConfigError, load_config

    os.mkfifo(tmp_path / "data.jsonl")
    os.mkfifo(tmp_path / "steps.py")
    cfg = {
        "processors": [{"type": "custom", "script_path": str(tmp_path / "steps.py"), "function_name": "f"}],
        "loading_params": {"datasets": [{"path": str(tmp_path / "data.jsonl"), "type": "jsonl", "output_dir": str(tmp_path / "out")}]},
        "processing_params": {"inputs": [{"name": "q", "key": "q"}], "outputs": [{"name": "c", "type": "custom"}]},
    }

    def check():
        with pytest.raises(ConfigError) as e:
            load_config(cfg)
        return str(e.value)

    finished, text = run_with_deadline(check, 20)
    assert finished, "the config check hung on a FIFO"
    assert "datasets[0].path" in text and "FIFO" in text, text
    assert "processors[0].script_path" in text and "FIFO" in text, text


def test_item1_a_fifo_jsonl_is_not_opened_by_the_reader(tmp_path):
    """Item 1 (datasets): the reader refuses a FIFO before reading (a DatasetReadError naming it)."""
    from mirageflow.data import readers

    os.mkfifo(tmp_path / "data.jsonl")
    ds = type("D", (), {"index": 0, "path": str(tmp_path / "data.jsonl"), "type": "jsonl"})()

    def read():
        return list(readers.read_shard(ds, readers.ShardSlice(0, 3, 0, 1)))

    finished, result = run_with_deadline(read, 10)
    assert finished, "reading a FIFO dataset hung"
    assert isinstance(result, OSError) and "not a regular file" in str(result), result


# --------------------------------------------------------------------------- item 2


class _Trickle(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        body = png()
        self.send_response(200)
        self.send_header("Content-Type", "image/png")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        for i in range(len(body)):  # one byte every 0.2 s: every read answers well within any read timeout
            try:
                self.wfile.write(body[i : i + 1])
                self.wfile.flush()
            except OSError:
                return
            time.sleep(0.2)

    def log_message(self, *args):
        pass


@pytest.fixture
def trickle_url():
    class Server(socketserver.ThreadingMixIn, http.server.HTTPServer):
        daemon_threads = True

    server = Server(("127.0.0.1", 0), _Trickle)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}/slow.png"
    server.shutdown()
    server.server_close()


def test_item2_a_trickling_image_server_is_cut_at_the_total_deadline(trickle_url, monkeypatch):
    """Item 2: a URL answering 1 byte at a time never timed out (httpx's timeout is per read);
    now the whole download has a deadline."""
    monkeypatch.setenv("NO_PROXY", "127.0.0.1")
    monkeypatch.setattr(images, "REMOTE_DEADLINE_SECONDS", 1.5, raising=False)
    started = time.monotonic()
    finished, result = run_with_deadline(lambda: load(trickle_url, _Dataset("d.jsonl")), 15)
    took = time.monotonic() - started
    assert finished and took < 5, f"the download of a trickling URL ran {took:.1f} s"
    assert isinstance(result, RowError) and result.kind == "image_remote_unreachable", result
    assert "within 1.5 s" in str(result)


def test_item2_a_declared_oversized_answer_is_refused_before_its_body(monkeypatch):
    """Item 2 (size cap): a Content-Length above max_bytes is refused without reading the body."""

    class Big(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200)
            self.send_header("Content-Length", str(10**12))
            self.end_headers()
            time.sleep(5)

        def log_message(self, *args):
            pass

    server = http.server.HTTPServer(("127.0.0.1", 0), Big)
    threading.Thread(target=server.handle_request, daemon=True).start()
    monkeypatch.setenv("NO_PROXY", "127.0.0.1")
    url = f"http://127.0.0.1:{server.server_address[1]}/big.png"
    try:
        started = time.monotonic()
        e = error_of(url, _Dataset("d.jsonl"))
        assert e.kind == "image_too_large" and "Content-Length" in str(e)
        assert time.monotonic() - started < 4
    finally:
        server.server_close()


# --------------------------------------------------------------------------- item 10


def test_item10_no_file_bytes_in_image_error_messages(tmp_path):
    """Item 10: 'not an image Pillow can read (631 bytes, starting b'root:*:2')' quoted the
    first bytes of whatever file a row named; no message shows file content now."""
    (tmp_path / "shadow.png").write_bytes(b"root:*:20000:0:99999:7:::\nsk-live-0123456789\n")
    e = error_of("shadow.png", _Dataset(tmp_path / "d.jsonl"))
    assert e.kind == "image_unreadable" and "bytes in no image format" in str(e)
    for leaked in ("root", "sk-live", "b'"):
        assert leaked not in str(e), str(e)


def test_item10_a_data_uri_error_does_not_quote_its_payload(tmp_path):
    """Item 10: a bad data: URI was quoted (its first 40 characters, the image data)."""
    e = error_of("data:image/png;base64,c2stbGl2ZS1zZWNyZXQ=!!", _Dataset(tmp_path / "d.jsonl"))
    assert e.kind == "image_unreadable" and "c2stbGl2" not in str(e)


# --------------------------------------------------------------------------- item 11


@pytest.fixture
def layout(tmp_path):
    base = tmp_path / "images"
    base.mkdir()
    (base / "ok.png").write_bytes(png())
    outside = tmp_path / "private"
    outside.mkdir()
    (outside / "secret.png").write_bytes(png(color=(0, 0, 255)))
    (base / "link.png").symlink_to(outside / "secret.png")
    (base / "dirlink").symlink_to(outside)
    return tmp_path, base, outside


@pytest.mark.parametrize("value", ["../private/secret.png", "{abs}", "link.png", "dirlink/secret.png", "file://{abs}"])
def test_item11_image_paths_outside_image_base_path_are_row_errors(layout, value):
    """Item 11: '../x.png', absolute paths and symbolic links out of image_base_path were read
    and sent to the endpoint; now each is its row's error, image_outside_base."""
    root, base, outside = layout
    value = value.format(abs=outside / "secret.png")
    e = error_of(value, _Dataset(root / "d.jsonl", image_base_path=str(base)))
    assert e.kind == "image_outside_base" and "allow_images_outside_base" in str(e)
    assert load("ok.png", _Dataset(root / "d.jsonl", image_base_path=str(base)))["img"][0].width == 8


def test_item11_a_documented_key_allows_paths_anywhere(layout):
    """Item 11: datasets[].allow_images_outside_base: true lets a dataset read images anywhere."""
    root, base, outside = layout
    got = load(str(outside / "secret.png"), _Dataset(root / "d.jsonl", image_base_path=str(base), allow=True))
    assert got["img"][0].width == 8


def test_item11_the_default_base_is_the_dataset_folder(layout):
    """Item 11: without image_base_path, paths stay in the dataset's own folder."""
    root, base, outside = layout
    assert load("ok.png", _Dataset(base / "d.jsonl"))["img"][0].width == 8
    assert error_of("../private/secret.png", _Dataset(base / "d.jsonl")).kind == "image_outside_base"


# --------------------------------------------------------------------------- item 20 (images)


def test_item20_a_nul_byte_in_an_image_path_is_an_invalid_value(tmp_path):
    """Item 20: a NUL byte in an image path was an internal_error."""
    e = error_of("a\0b.png", _Dataset(tmp_path / "d.jsonl"))
    assert e.kind == "image_invalid_value" and "NUL" in str(e)


def test_item20_an_hf_image_whose_bytes_are_text_is_an_invalid_value(tmp_path):
    """Item 20: an HF image {"bytes": "<str>"} was an internal_error."""
    e = error_of({"bytes": "iVBORw0KGgo=", "path": None}, _Dataset(tmp_path / "d.jsonl"))
    assert e.kind == "image_invalid_value" and "'bytes' is a str" in str(e)


# --------------------------------------------------------------------------- item 14 (source columns)


def test_item14_a_source_column_named_like_a_record_field_is_refused_by_preflight(tmp_path):
    """Item 14: with remove_columns: false, a dataset column named source_index was silently
    overwritten by the row index in every record; preflight now refuses it, naming the key."""
    from mirageflow.config import ConfigError
    from mirageflow.config.preflight import validate

    (tmp_path / "in.jsonl").write_text('{"text": "a", "source_index": "mine"}\n')
    cfg = {
        "processors": [{"type": "llm", "backend": "openai", "base_url": "http://127.0.0.1:9/v1", "server_args": {"model_path": "m"}}],
        "loading_params": {"datasets": [{"path": str(tmp_path / "in.jsonl"), "type": "jsonl", "output_dir": str(tmp_path / "out")}]},
        "processing_params": {"inputs": [{"name": "text", "key": "text"}], "outputs": [{"name": "a", "prompt": "{{ text }}"}],
                              "remove_columns": False},
    }  # fmt: skip
    with pytest.raises(ConfigError, match=r"processing_params\.remove_columns: false, but the rows .* have a column 'source_index'"):
        validate(cfg)
