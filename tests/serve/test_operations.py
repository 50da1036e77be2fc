"""Operations around the routes (issue 38): X-Request-Id kept or generated and returned in
headers and error bodies; the access log line (--enable-log-requests) with tokens and timing but
never the prompt; CORS preflights for --allowed-origins answered before the API key; TLS with a
certificate made here; `fivefold serve MODEL` positional, and its one-line refusals; a Hugging
Face id resolved from the local cache only."""

import datetime
import io
import logging
import socket
import ssl
import threading
import time
from types import SimpleNamespace

import httpx
import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient

from fivefold.cli import build_parser
from fivefold.cli.serve import check_operations
from fivefold.errors import FivefoldError, ModelLoadError
from fivefold.models.registry import DEFAULT_LLM, resolve_model_path
from fivefold.serve.http_base import APIError, build_base_app
from fivefold.serve.operations import ACCESS_LOGGER, allow_origins, enable_access_log, note_output, request_id_for

KEY = "sk-test-key-123456"


async def _no_metrics() -> str:
    return ""


def _app(api_key=None) -> FastAPI:
    app = build_base_app("m", _no_metrics, api_key=api_key)

    @app.post("/v1/completions")
    async def completions(body: dict):
        if body.get("fail"):
            raise APIError(400, "prompt: too long")
        # what the engine reports for a finished request (async_engine.generate calls it)
        note_output(SimpleNamespace(prompt_token_ids=[1, 2, 3], outputs=[SimpleNamespace(token_ids=[4, 5])],
                                    metrics=SimpleNamespace(ttft=0.0123)))
        return {"ok": True}

    return app


def test_request_id_is_kept_or_generated_and_returned_in_errors_too():
    client = TestClient(_app(api_key=KEY))
    auth = {"Authorization": f"Bearer {KEY}"}
    r = client.post("/v1/completions", json={}, headers=auth | {"X-Request-Id": "abc-123"})
    assert r.status_code == 200 and r.headers["x-request-id"] == "abc-123"
    r = client.post("/v1/completions", json={}, headers=auth)
    assert r.headers["x-request-id"].startswith("req-") and len(r.headers["x-request-id"]) == 36
    for bad in ("x" * 129, "two words", "new\\nline"):
        rid = client.post("/v1/completions", json={}, headers=auth | {"X-Request-Id": bad}).headers["x-request-id"]
        assert rid != bad and rid.startswith("req-")
    # an error from a route, a refusal of the guard (no key) and the router's 404 all carry it
    for r in (client.post("/v1/completions", json={"fail": 1}, headers=auth | {"X-Request-Id": "e1"}),
              client.post("/v1/completions", json={}, headers={"X-Request-Id": "e1"}),
              client.get("/v1/nowhere", headers=auth | {"X-Request-Id": "e1"})):
        assert r.status_code in (400, 401, 404)
        assert r.headers["x-request-id"] == "e1" and r.json()["error"]["request_id"] == "e1"
    assert len({request_id_for(None) for _ in range(100)}) == 100


def test_access_log_has_one_line_per_request_with_tokens_and_never_the_prompt():
    stream = io.StringIO()
    logger = logging.getLogger(ACCESS_LOGGER)
    client = TestClient(_app())
    client.post("/v1/completions", json={"prompt": "secret words"})
    assert stream.getvalue() == ""  # off unless asked for
    enable_access_log(stream)
    try:
        client.post("/v1/completions", json={"prompt": "secret words"}, headers={"X-Request-Id": "r7"})
        client.get("/v1/nowhere")
    finally:
        logger.handlers.clear()
        logger.setLevel(logging.WARNING)
    lines = stream.getvalue().splitlines()
    assert len(lines) == 2
    assert "request_id=r7 method=POST route=/v1/completions status=200 prompt_tokens=3 completion_tokens=2 " \
           "ttft_ms=12.3 total_ms=" in lines[0]
    assert "route=/v1/nowhere status=404" in lines[1] and "secret" not in stream.getvalue()


def test_cors_preflight_is_answered_for_allowed_origins_only_and_before_the_key():
    app = _app(api_key=KEY)
    allow_origins(app, ["https://app.example.com"])
    client = TestClient(app)
    preflight = {"Access-Control-Request-Method": "POST", "Access-Control-Request-Headers": "authorization,content-type"}
    r = client.options("/v1/completions", headers=preflight | {"Origin": "https://app.example.com"})
    assert r.status_code == 200 and r.headers["access-control-allow-origin"] == "https://app.example.com"
    assert "POST" in r.headers["access-control-allow-methods"]
    r = client.options("/v1/completions", headers=preflight | {"Origin": "https://evil.example.com"})
    assert r.status_code == 400 and "access-control-allow-origin" not in r.headers
    r = client.post("/v1/completions", json={}, headers={"Origin": "https://app.example.com",
                                                          "Authorization": f"Bearer {KEY}"})
    assert r.status_code == 200 and r.headers["access-control-allow-origin"] == "https://app.example.com"
    assert "x-request-id" in r.headers["access-control-expose-headers"].lower()
    bare = TestClient(_app())  # without --allowed-origins: no CORS headers at all
    assert "access-control-allow-origin" not in bare.post("/v1/completions", json={},
                                                          headers={"Origin": "https://app.example.com"}).headers


def _self_signed(tmp_path):
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "localhost")])
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
            .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(minutes=1))
            .not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.SubjectAlternativeName([x509.DNSName("localhost")]), critical=False)
            .sign(key, hashes.SHA256()))
    key_file, cert_file = tmp_path / "key.pem", tmp_path / "cert.pem"
    key_file.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                           serialization.NoEncryption()))
    cert_file.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    return str(key_file), str(cert_file)


def test_tls_serves_https_with_the_given_certificate(tmp_path):
    import uvicorn

    from fivefold.cli.serve import _run_uvicorn

    key_file, cert_file = _self_signed(tmp_path)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    args = build_parser().parse_args(["serve", "--port", str(port), "--ssl-keyfile", key_file,
                                      "--ssl-certfile", cert_file])
    check_operations(args)
    servers = []
    real_server = uvicorn.Server

    class Recorded(real_server):
        def __init__(self, config):
            super().__init__(config)
            servers.append(self)

        def install_signal_handlers(self):  # not the main thread
            pass

    uvicorn.Server = Recorded
    try:
        thread = threading.Thread(target=_run_uvicorn, args=(_app(), args), daemon=True)
        thread.start()
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline and not (servers and servers[0].started):
            time.sleep(0.05)
        r = httpx.post(f"https://localhost:{port}/v1/completions", json={}, verify=ssl.create_default_context(cafile=cert_file))
        assert r.status_code == 200 and r.json() == {"ok": True}
        with pytest.raises(httpx.HTTPError):  # plain HTTP on the TLS port fails
            httpx.post(f"http://localhost:{port}/v1/completions", json={}, timeout=5)
    finally:
        uvicorn.Server = real_server
        if servers:
            servers[0].should_exit = True
        thread.join(10)


def test_serve_takes_the_model_positionally_and_refuses_in_one_line(tmp_path):
    parse = lambda *a: build_parser().parse_args(["serve", *a])  # noqa: E731
    args = parse("some/dir")
    check_operations(args)
    assert args.model == "some/dir"
    args = parse("--model", "some/dir")
    check_operations(args)
    assert args.model == "some/dir"
    args = parse()
    check_operations(args)
    assert args.model == DEFAULT_LLM
    for argv, message in ((["a", "--model", "b"], "the model is given twice"),
                          (["--ssl-keyfile", "k.pem"], "TLS needs both"),
                          (["--ssl-keyfile", str(tmp_path / "k"), "--ssl-certfile", str(tmp_path / "c")], "no such file"),
                          (["--allowed-origins", " , "], "--allowed-origins"),
                          (["--dashboard", "--replicas", "2"], "--dashboard shows one engine's metrics")):
        with pytest.raises(FivefoldError, match=message):
            check_operations(parse(*argv))


def test_hugging_face_ids_resolve_from_the_local_cache_only(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(ModelLoadError, match="not in the local Hugging Face cache"):
        resolve_model_path("Qwen/Qwen3-0.6B")
    # a snapshot laid out as huggingface_hub leaves it
    snapshot = tmp_path / "models--org--tiny" / "snapshots" / "0123abcd"
    snapshot.mkdir(parents=True)
    (snapshot / "config.json").write_text("{}")
    (tmp_path / "models--org--tiny" / "refs").mkdir()
    (tmp_path / "models--org--tiny" / "refs" / "main").write_text("0123abcd")
    assert resolve_model_path("org/tiny") == snapshot
