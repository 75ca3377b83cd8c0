"""The built-in engine's security rules against a real engine process over real HTTP: the
admin key (SGLang's --admin-api-key semantics), bad input answered 4xx while the engine
keeps serving, a body size limit, weight payloads unpickled through an allow-list only, and the
pause/continue ordering guard of a weight push."""

from __future__ import annotations

import base64
import os
import pickle
from pathlib import Path

import httpx
import pytest
from tinymodels import save_tiny_qwen2, start_engines, stop_engines

from milepost.core.engine.http_guard import PUBLIC_ROUTES
from milepost.core.engine.routes import create_app
from milepost.core.engine.scheduler import Scheduler
from milepost.core.fleet.client import EngineClient, EngineError
from milepost.core.weight_sync import DiskTransport

KEY = "test-admin-key-0123456789abcdef"
GREEDY = {"max_new_tokens": 4, "temperature": 0.0, "ignore_eos": True}
PROMPT = [3, 4, 5]
MAX_BODY_MB = 1


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> tuple[str, str]:
    root = tmp_path_factory.mktemp("models")
    return save_tiny_qwen2(root / "v0", 0, max_positions=256), save_tiny_qwen2(root / "v1", 1, max_positions=256)


@pytest.fixture(scope="module")
def key_file(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("secret") / "engine_admin_key"
    path.write_text(KEY + "\n")
    path.chmod(0o600)
    return path


@pytest.fixture(scope="module")
def started(models, key_file, tmp_path_factory):
    logs = tmp_path_factory.mktemp("logs")
    procs = start_engines(models[0], logs, 1, "--admin-api-key-file", str(key_file),
                          "--max-request-body-mb", str(MAX_BODY_MB))
    yield procs[0][0], procs[0][1].base_url, logs
    stop_engines(procs)


@pytest.fixture(scope="module")
def url(started) -> str:
    return started[1]


@pytest.fixture(scope="module")
def admin(url):
    client = EngineClient(url, timeout_s=60, admin_key=KEY)
    yield client
    client.close()


@pytest.fixture(scope="module")
def v0_output(admin) -> list[int]:
    return admin.generate(PROMPT, GREEDY)["output_ids"]


def _serves(url: str, expected: list[int]) -> None:
    """The engine answers a normal /generate (without any key) with the expected tokens."""
    reply = httpx.post(f"{url}/generate", json={"input_ids": PROMPT, "sampling_params": GREEDY}, timeout=30)
    assert reply.status_code == 200, reply.text
    assert reply.json()["output_ids"] == expected


# --- the admin key --------------------------------------------------------------------------

def _admin_calls(models) -> list[tuple[str, str, dict | None]]:
    """Every state-changing endpoint, with a body that would change state if it were let in."""
    return [
        ("POST", "/update_weights_from_disk", {"model_path": models[1], "weight_version": "evil"}),
        ("POST", "/pause_generation", {"mode": "abort"}),
        ("POST", "/continue_generation", {}),
        ("POST", "/flush_cache", None),
        ("GET", "/flush_cache", None),
        ("POST", "/update_weight_version", {"new_version": "evil"}),
        ("POST", "/abort_request", {"abort_all": True}),
        ("POST", "/begin_weight_update", {"selector": "all"}),
        ("POST", "/end_weight_update", {}),
        ("POST", "/update_weights_from_tensor", {"serialized_named_tensors": ["e30="]}),
        ("POST", "/init_weights_update_group", {"master_address": "127.0.0.1", "master_port": 1, "rank_offset": 1,
                                                "world_size": 2, "backend": "gloo"}),
        ("POST", "/update_weights_from_distributed", {"names": [], "dtypes": [], "shapes": []}),
        ("POST", "/destroy_weights_update_group", {"group_name": "weight_update_group"}),
        ("POST", "/release_memory_occupation", {"tags": ["weights", "kv_cache"]}),
        ("POST", "/resume_memory_occupation", {"tags": ["weights", "kv_cache"]}),
    ]


BAD_CREDENTIALS = [None, "Bearer wrong-key", f"Basic {KEY}", KEY, f"Bearer {KEY}x", "Bearer"]


@pytest.mark.parametrize("authorization", BAD_CREDENTIALS,
                         ids=["none", "wrong", "basic-scheme", "no-scheme", "longer", "empty"])
def test_admin_endpoints_without_the_key_get_401_and_change_nothing(authorization, url, admin, models,
                                                                   v0_output):
    headers = {"Authorization": authorization} if authorization else {}
    for method, path, body in _admin_calls(models):
        reply = httpx.request(method, f"{url}{path}", json=body, headers=headers, timeout=30)
        assert reply.status_code == 401, (path, reply.status_code, reply.text)
        assert reply.json() == {"error": "Unauthorized"}
    info = admin.model_info()
    assert info["weight_version"] == "0" and info["model_path"] == models[0]  # no load, no version
    _serves(url, v0_output)  # not paused, not released, same weights
    admin.begin_weight_update()  # no session was left open
    admin.end_weight_update(abort=True)


def test_every_route_but_the_read_only_ones_needs_the_key(url, models):
    """Default-deny: enumerate the app's real routes; a route added later is protected unless
    listed public (http_guard.PUBLIC_ROUTES)."""
    app = create_app(Scheduler(models[0]))
    checked = 0
    for route in app.routes:
        path = getattr(route, "path", "")
        if path in PUBLIC_ROUTES or path.startswith("/health"):
            continue
        for method in sorted(getattr(route, "methods", None) or ()):
            reply = httpx.request(method, f"{url}{path}", json={}, timeout=30)
            assert reply.status_code == 401, (method, path, reply.status_code)
            checked += 1
    assert checked >= 15


def test_read_only_endpoints_answer_without_a_key(url):
    """As SGLang with only --admin-api-key set: health, info and /generate need no key."""
    for path in ("/health", "/health_generate", "/model_info", "/get_model_info", "/server_info",
                 "/get_server_info", "/get_load"):
        assert httpx.get(f"{url}{path}", timeout=30).status_code == 200, path
    reply = httpx.post(f"{url}/generate", json={"input_ids": PROMPT, "sampling_params": GREEDY}, timeout=30)
    assert reply.status_code == 200


def test_the_key_accepted_as_sglang_sends_it_drives_a_push(url, admin, models, v0_output):
    other_scheme_case = {"Authorization": f"bearer {KEY}"}  # SGLang compares the scheme case-insensitively
    assert httpx.post(f"{url}/continue_generation", json={}, headers=other_scheme_case, timeout=30).status_code == 200
    DiskTransport(timeout_s=60).push([admin], models[1], "1")
    assert admin.model_info()["weight_version"] == "1"
    DiskTransport(timeout_s=60).push([admin], models[0], "0")
    _serves(url, v0_output)


def test_the_key_is_not_on_the_engine_command_line(started):
    proc, _, logs = started
    cmdline = Path(f"/proc/{proc.pid}/cmdline").read_bytes()
    assert KEY.encode() not in cmdline and b"--admin-api-key-file" in cmdline
    assert all(KEY not in p.read_text(errors="replace") for p in logs.iterdir())


def test_an_unauthorized_client_error_names_401(url):
    with pytest.raises(EngineError) as err:
        EngineClient(url, timeout_s=30).pause()
    assert err.value.status == 401 and KEY not in str(err.value)


# --- the pause/continue ordering guard ---------------------------------------------------------

def test_a_pause_arriving_after_the_continue_of_its_push_is_ignored(url, admin, v0_output):
    """The order a stopped engine may see after SIGCONT, made deterministic: continue(P) is
    handled before the stale pause(P). The engine stays unpaused; a pause of another push
    still pauses; pauses without a push id (SGLang's clients) behave as SGLang's."""
    auth = {"Authorization": f"Bearer {KEY}"}

    def post(path: str, body: dict) -> httpx.Response:
        return httpx.post(f"{url}{path}", json=body, headers=auth, timeout=30)

    assert post("/continue_generation", {"push_id": "push-a"}).status_code == 200
    stale = post("/pause_generation", {"mode": "abort", "push_id": "push-a"})
    assert stale.status_code == 409 and "push-a" in stale.json()["message"]
    _serves(url, v0_output)  # would hang if the stale pause had paused it

    assert post("/pause_generation", {"mode": "abort", "push_id": "push-b"}).status_code == 200
    with pytest.raises(httpx.ReadTimeout):  # paused: new requests wait
        httpx.post(f"{url}/generate", json={"input_ids": PROMPT, "sampling_params": GREEDY}, timeout=1.5)
    assert post("/continue_generation", {"push_id": "push-b"}).status_code == 200
    _serves(url, v0_output)

    assert post("/pause_generation", {"mode": "abort"}).status_code == 200  # no push id: SGLang's behaviour
    assert post("/continue_generation", {}).status_code == 200
    assert post("/pause_generation", {"mode": "abort", "push_id": 7}).status_code == 400
    _serves(url, v0_output)
    assert admin.server_info()["accepts_push_id"] is True


# --- weight payloads: only allow-listed pickles (SGLang's format, sglang_wire) -------------------

class _RunsCode:
    """A real malicious pickle: unpickling it runs os.system."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


@pytest.mark.parametrize("load_format", ["flattened_bucket", None])
def test_a_pickled_payload_is_refused_and_runs_nothing(load_format, url, admin, tmp_path, v0_output):
    marker = tmp_path / "pwned"
    blob = base64.b64encode(pickle.dumps([("model.norm.weight", _RunsCode(marker))])).decode()
    admin.begin_weight_update()
    try:
        reply = httpx.post(f"{url}/update_weights_from_tensor", headers={"Authorization": f"Bearer {KEY}"},
                           json={"serialized_named_tensors": [blob], "load_format": load_format}, timeout=30)
    finally:
        admin.end_weight_update(abort=True)
    assert reply.status_code == 400, reply.text
    assert not marker.exists()
    assert "pickle" in reply.text or "load_format" in reply.text
    _serves(url, v0_output)


# --- bad input: 4xx, and the engine keeps serving ---------------------------------------------------

def _nested(depth: int) -> bytes:
    return b'{"input_ids": ' + b"[" * depth + b"]" * depth + b"}"


BAD_GENERATE = {  # name: (raw body or JSON object, expected status)
    "malformed-json": (b'{"input_ids": [3, 4', 400),
    "not-utf8": (b'{"input_ids": [3, \xff\xfe]}', 400),
    "body-is-a-list": ([1, 2, 3], 400),
    "missing-prompt": ({"sampling_params": GREEDY}, 400),
    "input-ids-string": ({"input_ids": "abc"}, 400),
    "input-ids-empty": ({"input_ids": []}, 400),
    "input-id-negative": ({"input_ids": [3, -1]}, 400),
    "input-id-over-vocab": ({"input_ids": [3, 10**12]}, 400),
    "input-id-float": ({"input_ids": [3, 4.5]}, 400),
    "input-id-bool": ({"input_ids": [True, 4]}, 400),
    "max-new-tokens-string": ({"input_ids": PROMPT, "sampling_params": {"max_new_tokens": "ten"}}, 400),
    "max-new-tokens-negative": ({"input_ids": PROMPT, "sampling_params": {"max_new_tokens": -5}}, 400),
    "max-new-tokens-huge": ({"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 10**12}}, 400),
    "prompt-over-context": ({"input_ids": [3] * 300, "sampling_params": {"max_new_tokens": 1}}, 400),
    "n-huge": ({"input_ids": PROMPT, "sampling_params": {"n": 10**9, "max_new_tokens": 1}}, 400),
    "temperature-nan": (b'{"input_ids": [3, 4], "sampling_params": {"temperature": NaN}}', 400),
    "temperature-negative": ({"input_ids": PROMPT, "sampling_params": {"temperature": -1}}, 400),
    "top-p-zero": ({"input_ids": PROMPT, "sampling_params": {"top_p": 0}}, 400),
    "top-k-zero": ({"input_ids": PROMPT, "sampling_params": {"top_k": 0}}, 400),
    "sampling-params-list": ({"input_ids": PROMPT, "sampling_params": [1]}, 400),
    "unknown-sampling-key": ({"input_ids": PROMPT, "sampling_params": {"beam_width": 4}}, 400),
    "stop-token-ids-strings": ({"input_ids": PROMPT, "sampling_params": {"stop_token_ids": ["a"]}}, 400),
    "seed-string": ({"input_ids": PROMPT, "sampling_params": {"sampling_seed": "s"}}, 400),
    "logprob-start-too-far": ({"input_ids": PROMPT, "logprob_start_len": 99}, 400),
    "logprob-start-negative": ({"input_ids": PROMPT, "logprob_start_len": -7}, 400),
    "stream": ({"input_ids": PROMPT, "stream": True}, 400),
    "deeply-nested": (_nested(100_000), 400),
}


@pytest.mark.parametrize("case", sorted(BAD_GENERATE))
def test_bad_generate_requests_are_4xx_and_the_engine_keeps_serving(case, url, v0_output):
    body, status = BAD_GENERATE[case]
    kwargs = {"content": body, "headers": {"content-type": "application/json"}} if isinstance(body, bytes) \
        else {"json": body}
    reply = httpx.post(f"{url}/generate", timeout=30, **kwargs)
    assert reply.status_code == status, reply.text
    assert reply.json()["error"]["message"]
    _serves(url, v0_output)


BAD_ADMIN = {  # name: (path, body, expected status): authorised, but wrong
    "pause-mode": ("/pause_generation", {"mode": "nap"}, 400),
    "disk-path-type": ("/update_weights_from_disk", {"model_path": ["/"]}, 400),
    "disk-path-missing": ("/update_weights_from_disk", {"model_path": "/nonexistent/weights"}, 400),
    "version-type": ("/update_weight_version", {"new_version": [1]}, 400),
    "abort-body-list": ("/abort_request", [1], 400),
    "selector-type": ("/begin_weight_update", {"selector": 3}, 400),
    "tensor-no-session": ("/update_weights_from_tensor", {"serialized_named_tensors": ["e30="]}, 400),
    "memory-tags": ("/release_memory_occupation", {"tags": ["everything"]}, 400),
    "group-backend": ("/init_weights_update_group", {"master_address": "127.0.0.1", "master_port": 1,
                                                     "rank_offset": 1, "world_size": 2, "backend": "nccl"}, 400),
    "group-port-type": ("/init_weights_update_group", {"master_address": "127.0.0.1", "master_port": "x",
                                                       "rank_offset": 1, "world_size": 2, "backend": "gloo"}, 400),
    "destroy-unknown-group": ("/destroy_weights_update_group", {"group_name": "nope"}, 400),
}


@pytest.mark.parametrize("case", sorted(BAD_ADMIN))
def test_bad_admin_requests_are_4xx_and_the_engine_keeps_serving(case, url, admin, v0_output):
    path, body, status = BAD_ADMIN[case]
    reply = httpx.post(f"{url}{path}", json=body, headers={"Authorization": f"Bearer {KEY}"}, timeout=30)
    assert reply.status_code == status, reply.text
    assert admin.model_info()["weight_version"] == "0"
    _serves(url, v0_output)


def test_unknown_endpoints_and_methods_are_404_and_405(url, v0_output):
    assert httpx.post(f"{url}/no_such_endpoint", json={}, timeout=30).status_code == 404
    assert httpx.get(f"{url}/docs", timeout=30).status_code == 404  # no generated API pages
    assert httpx.get(f"{url}/generate", timeout=30).status_code == 405
    _serves(url, v0_output)


def test_huge_bodies_get_413_declared_or_streamed(url, v0_output):
    too_big = MAX_BODY_MB * 2**20 + 1
    reply = httpx.post(f"{url}/generate", content=b" " * too_big, timeout=60)
    assert reply.status_code == 413 and "--max-request-body-mb" in reply.json()["error"]["message"]

    def chunks():  # no Content-Length: counted as it arrives
        yield b'{"input_ids": ['
        for _ in range(too_big // 2**16 + 1):
            yield b"3," * 2**15
        yield b"3]}"

    assert httpx.post(f"{url}/generate", content=chunks(), timeout=60).status_code == 413
    unauthorized = httpx.post(f"{url}/update_weights_from_disk", content=b" " * too_big, timeout=60)
    assert unauthorized.status_code == 401  # the key is checked first
    _serves(url, v0_output)
