"""Security (DESIGN §2, README "Security model"): keygen, ZeroMQ CURVE with a ZAP handler on
the executor socket, gRPC TLS and mutual TLS, no pickle on any socket, and the refused
non-loopback bind.

One real cluster for the module: `pagedserve router --curve-keys K` with mutual TLS on gRPC
and one `pagedserve executor --curve-keys K`. Intruders are raw ZeroMQ DEALERs sending a
valid Hello: one without CURVE (NULL mechanism), one with an unknown key pair.
"""

from __future__ import annotations

import os
import re
import stat
import subprocess
import sys
import time
from pathlib import Path

import grpc
import pytest
import zmq
import zmq.auth
from cluster_harness import READY, Cluster, free_port, request
from pagedserve.protos import wire
from pagedserve.protos.codec import Codec
from pagedserve.protos.generated.pagedserve.v1 import generate_pb2 as pb
from pagedserve.protos.generated.pagedserve.v1 import generate_pb2_grpc as pb_grpc
from pagedserve.router.app import read_model_info

from pagedserve.cli import main as cli_main
from pagedserve.keygen import executor_keys, router_keys

ROOT = Path(__file__).resolve().parents[1]
CLI = [sys.executable, "-m", "pagedserve.cli"]
KEY_FILES = ["executor.key", "executor.key_secret", "router.key", "router.key_secret"]

pytestmark = pytest.mark.skipif(not zmq.has("curve"), reason="libzmq without CURVE")


def _env() -> dict:
    return {k: v for k, v in os.environ.items() if not k.startswith("PAGEDSERVE_")}


def _make_certs(d: Path) -> None:
    """A CA, and server and client certificates it signed (localhost, 127.0.0.1)."""
    def sh(*args):
        subprocess.run(args, check=True, capture_output=True, cwd=d, timeout=60)

    sh("openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1",
       "-keyout", "ca.key", "-out", "ca.pem", "-subj", "/CN=pagedserve-test-ca")
    for name in ("server", "client"):
        sh("openssl", "req", "-newkey", "rsa:2048", "-nodes", "-keyout", f"{name}.key",
           "-out", f"{name}.csr", "-subj", "/CN=localhost")
        (d / f"{name}.ext").write_text("subjectAltName=DNS:localhost,IP:127.0.0.1\n")
        sh("openssl", "x509", "-req", "-in", f"{name}.csr", "-CA", "ca.pem", "-CAkey", "ca.key",
           "-CAcreateserial", "-days", "1", "-out", f"{name}.pem", "-extfile", f"{name}.ext")


@pytest.fixture(scope="module")
def certs(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("tls")
    try:
        _make_certs(d)
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("the openssl command is not available")
    return d


def _creds(certs: Path, client_cert: bool = True) -> grpc.ChannelCredentials:
    read = lambda n: (certs / n).read_bytes()  # noqa: E731
    if client_cert:
        return grpc.ssl_channel_credentials(read("ca.pem"), read("client.key"),
                                            read("client.pem"))
    return grpc.ssl_channel_credentials(read("ca.pem"))


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    from pagedserve.tinymodels import build_model
    return str(build_model(tmp_path_factory.mktemp("sec") / "tiny", hidden_size=64,
                           num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=128))


@pytest.fixture(scope="module")
def keys(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("keys") / "k"
    assert cli_main(["keygen", str(d)]) == 0
    return d


class SecureCluster(Cluster):
    """The harness's cluster, with its status calls over a TLS channel."""

    def __init__(self, *args, credentials: grpc.ChannelCredentials, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.credentials = credentials
        self.secure_channel: grpc.Channel | None = None

    def status(self) -> pb.ClusterStatus:
        if self.secure_channel is None:
            self.secure_channel = grpc.secure_channel(self.address, self.credentials)
            self.stub = pb_grpc.GeneratorStub(self.secure_channel)
        return self.stub.GetClusterStatus(pb.ClusterStatusRequest(), timeout=10)

    def stop(self) -> None:
        if self.secure_channel is not None:
            self.secure_channel.close()
        super().stop()


@pytest.fixture(scope="module")
def cluster(model_dir, keys, certs):
    tls = ["--tls-cert", str(certs / "server.pem"), "--tls-key", str(certs / "server.key"),
           "--tls-client-ca", str(certs / "ca.pem")]
    c = SecureCluster(model_dir, num_executors=1, credentials=_creds(certs),
                      router_args=["--curve-keys", str(keys), *tls],
                      executor_args=["--curve-keys", str(keys), "--num-gpu-blocks", "64"])
    try:
        c.start(timeout_s=60)
    except Exception:
        c.stop()
        raise
    yield c
    c.stop()


def _router_log(c: Cluster) -> str:
    return "\n".join(c.readers[0].lines)


def _wait_log(c: Cluster, pattern: str, timeout_s: float = 5.0) -> re.Match | None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        m = re.search(pattern, _router_log(c))
        if m:
            return m
        time.sleep(0.05)
    return None


def _hello(model_dir: str, executor_id: str) -> wire.Hello:
    """A Hello the router would accept from a real executor of this model."""
    info, fingerprint = read_model_info(model_dir, 16, None)
    return wire.Hello(executor_id=executor_id, model_fingerprint=fingerprint, device="cpu",
                      dtype="float32", block_size=16, num_gpu_blocks=64, num_cpu_blocks=0,
                      max_model_len=info.max_model_len, pid=os.getpid(), hostname="intruder")


def _try_register(endpoint: str, hello: wire.Hello, keys=None, wait_s: float = 2.0):
    """Send `hello` from a fresh DEALER (CURVE client when `keys` = (public, secret, server
    public)); the decoded reply, or None when nothing came back within `wait_s`."""
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.linger = 0
    if keys is not None:
        sock.curve_publickey, sock.curve_secretkey, sock.curve_serverkey = keys
    try:
        sock.connect(endpoint)
        codec = Codec()
        try:  # a refused handshake can drop the only pipe before the send: then it blocks
            sock.send_multipart(codec.encode(hello), flags=zmq.NOBLOCK)
        except zmq.Again:
            return None
        if not sock.poll(int(wait_s * 1000)):
            return None
        return codec.decode(sock.recv_multipart())
    finally:
        sock.close(0)
        ctx.term()


# ------------------------------------------------------------------------------ keygen


def test_keygen_writes_four_files_secrets_0600_and_refuses_overwrite(tmp_path, capsys):
    d = tmp_path / "keys"
    assert cli_main(["keygen", str(d)]) == 0
    out = capsys.readouterr().out
    assert sorted(os.listdir(d)) == KEY_FILES
    for name in KEY_FILES:
        assert str(d / name) in out
        mode = stat.S_IMODE(os.stat(d / name).st_mode)
        if name.endswith("_secret"):
            assert mode == 0o600, (name, oct(mode))
        else:
            assert mode & 0o077 <= 0o044, (name, oct(mode))  # public: never writable by others
    # ZeroMQ's certificate format: zmq.auth reads it; the pairs are real CURVE pairs
    public, secret = zmq.auth.load_certificate(str(d / "router.key_secret"))
    assert zmq.auth.load_certificate(str(d / "router.key")) == (public, None)
    assert zmq.curve_public(secret) == public
    e_public, e_secret, server = executor_keys(str(d))
    assert server == public and zmq.curve_public(e_secret) == e_public
    assert router_keys(str(d))[2] == {e_public: "executor.key"}

    before = (d / "router.key_secret").read_bytes()
    assert cli_main(["keygen", str(d)]) == 1
    assert "already exist" in capsys.readouterr().err
    assert (d / "router.key_secret").read_bytes() == before
    assert cli_main(["keygen", str(d), "--exist-ok"]) == 0  # compose: idempotent
    assert (d / "router.key_secret").read_bytes() == before
    assert cli_main(["keygen", str(d), "--force"]) == 0
    assert (d / "router.key_secret").read_bytes() != before
    assert stat.S_IMODE(os.stat(d / "router.key_secret").st_mode) == 0o600


def test_keygen_per_executor_pairs(tmp_path):
    d = tmp_path / "keys"
    assert cli_main(["keygen", str(d), "--executors", "2"]) == 0
    _, _, allowed = router_keys(str(d))
    assert sorted(allowed.values()) == ["executor-1.key", "executor-2.key"]
    # a host's folder: the router's public key and that executor's pair only
    host = tmp_path / "host2"
    host.mkdir()
    for name in ("router.key", "executor-2.key_secret"):
        (host / name).write_bytes((d / name).read_bytes())
    public, _, _ = executor_keys(str(host))
    assert allowed[public] == "executor-2.key"


# ------------------------------------------------------------------------ CURVE + ZAP


def test_curve_executor_registers_and_serves_over_mutual_tls(cluster, certs):
    status = cluster.status()
    assert [e.id for e in status.executors if e.healthy] == ["exec0"]
    resp = cluster.stub.Generate(request("Hello, secure world", max_tokens=5, temperature=0),
                                 timeout=30)
    assert len(resp.completions[0].token_ids) == 5
    assert "CURVE with 1 authorized executor key(s)" in _router_log(cluster)


def test_mutual_tls_refuses_a_client_without_certificate_and_plaintext(cluster, certs):
    for channel in (grpc.secure_channel(cluster.address, _creds(certs, client_cert=False)),
                    grpc.insecure_channel(cluster.address)):
        with channel:
            stub = pb_grpc.GeneratorStub(channel)
            with pytest.raises(grpc.RpcError) as info:
                stub.GetClusterStatus(pb.ClusterStatusRequest(), timeout=5)
            assert info.value.code() == grpc.StatusCode.UNAVAILABLE


def test_null_security_client_gets_no_welcome_and_is_logged(cluster, model_dir):
    reply = _try_register(cluster.zmq, _hello(model_dir, "null-intruder"))
    assert reply is None
    assert _wait_log(cluster, r"refused an executor connection .*a client without CURVE"), \
        cluster.logs()
    assert "null-intruder" not in _router_log(cluster)  # its Hello never reached the router
    assert [e.id for e in cluster.status().executors] == ["exec0"]


def test_unknown_curve_key_is_refused_and_logged(cluster, model_dir, keys):
    public, secret = zmq.curve_keypair()
    server = zmq.auth.load_certificate(str(keys / "router.key"))[0]
    reply = _try_register(cluster.zmq, _hello(model_dir, "key-intruder"),
                          keys=(public, secret, server))
    assert reply is None
    m = _wait_log(cluster, r"CURVE key (\S+) is not authorized")
    assert m and m.group(1) == public.decode()
    assert "key-intruder" not in _router_log(cluster)


def test_authorized_key_gets_welcome(cluster, model_dir, keys):
    """The control for the two refusals above: the same Hello with the real executor pair is
    answered (accepted; then the test's socket goes away and the router declares it dead)."""
    reply = _try_register(cluster.zmq, _hello(model_dir, "keyed-probe"),
                          keys=executor_keys(str(keys)), wait_s=5)
    assert isinstance(reply, wire.Welcome) and reply.accepted, reply


# ---------------------------------------------------------------------------- gRPC TLS


def test_tls_round_trip_and_plaintext_refused(model_dir, certs):
    proc = subprocess.Popen(
        CLI + ["router", "--model", model_dir, "--port", "0", "--metrics-port", "-1", "--http-port", "-1",
               "--executor-bind", f"tcp://127.0.0.1:{free_port()}",
               "--tls-cert", str(certs / "server.pem"), "--tls-key", str(certs / "server.key")],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=_env())
    try:
        address = None
        for line in proc.stdout:
            m = READY.search(line)
            if m:
                address = m.group(1)
                break
        assert address, "router did not start"
        with grpc.secure_channel(address, _creds(certs, client_cert=False)) as channel:
            info = pb_grpc.GeneratorStub(channel).GetModelInfo(pb.ModelInfoRequest(), timeout=10)
            assert info.block_size == 16
        with grpc.insecure_channel(address) as channel:
            with pytest.raises(grpc.RpcError) as err:
                pb_grpc.GeneratorStub(channel).GetModelInfo(pb.ModelInfoRequest(), timeout=5)
            assert err.value.code() == grpc.StatusCode.UNAVAILABLE
    finally:
        proc.terminate()
        proc.wait(timeout=30)


# ------------------------------------------------------------------- refused start-ups


def test_non_loopback_bind_without_keys_or_allow_insecure_is_one_line(model_dir):
    result = subprocess.run(
        CLI + ["router", "--model", model_dir, "--port", "0", "--metrics-port", "-1", "--http-port", "-1",
               "--executor-bind", f"tcp://0.0.0.0:{free_port()}"],
        capture_output=True, text=True, env=_env(), timeout=60)
    assert result.returncode != 0
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in result.stderr, result.stderr
    assert lines[0].startswith("pagedserve router: refusing to bind")
    assert "--curve-keys" in lines[0] and "--allow-insecure" in lines[0]


def test_unusable_key_folder_is_one_line(model_dir, tmp_path):
    result = subprocess.run(
        CLI + ["router", "--model", model_dir, "--port", "0", "--metrics-port", "-1", "--http-port", "-1",
               "--executor-bind", f"tcp://127.0.0.1:{free_port()}",
               "--curve-keys", str(tmp_path / "missing")],
        capture_output=True, text=True, env=_env(), timeout=60)
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "router.key_secret not found" in lines[0], result.stderr


# ---------------------------------------------------------------------------- no pickle


def test_no_pickle_on_any_socket():
    """Every package folder is free of pickle-based (de)serialization: a message from the
    network is decoded by msgspec into typed structs, never executed (CVE-2024-11041,
    CVE-2025-30165 were pickle on vLLM's ZeroMQ sockets)."""
    banned = re.compile(r"send_pyobj|recv_pyobj|pickle\.loads?|pickle\.dumps?|cloudpickle|"
                        r"import pickle|from pickle|dill\.")
    found = []
    for folder in ("router", "executor", "kvmanager", "kernels", "protos", "pagedserve"):
        for path in (ROOT / folder).rglob("*.py"):
            for n, line in enumerate(path.read_text().splitlines(), 1):
                if banned.search(line):
                    found.append(f"{path.relative_to(ROOT)}:{n}: {line.strip()}")
    assert not found, "\n".join(found)
