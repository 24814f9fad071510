"""Mutual TLS on the client API: with `server.tls_client_ca`, the gRPC API and the HTTPS API both take
only clients presenting a certificate that CA signed (certificates made here by trustme), and the
bearer token is still required on top. The cluster runs with its default cluster secret, so its
internal channels (CURVE) carry every request here too."""

from __future__ import annotations

import http.client
import json
import ssl

import pytest
from cluster_helpers import manifest, pdserve

from pdserve.client import Client, Unauthenticated, Unavailable
from pdserve.cluster.launcher import Cluster

ARCH = "tiny-llama"
TOKEN = "sesame"


@pytest.fixture(scope="module")
def mtls_cluster(model_dirs, tmp_path_factory):
    trustme = pytest.importorskip("trustme")
    d = tmp_path_factory.mktemp("client-mtls")
    server_ca, client_ca, other_ca = trustme.CA(), trustme.CA(), trustme.CA()
    server = server_ca.issue_cert("127.0.0.1")
    server.private_key_pem.write_to_path(d / "server.key")
    server.cert_chain_pems[0].write_to_path(d / "server.pem")
    client_ca.cert_pem.write_to_path(d / "client-ca.pem")
    server_ca.cert_pem.write_to_path(d / "server-ca.pem")
    for name, ca in (("client", client_ca), ("stranger", other_ca)):
        cert = ca.issue_cert(f"{name}@example.org")
        cert.private_key_pem.write_to_path(d / f"{name}.key")
        cert.cert_chain_pems[0].write_to_path(d / f"{name}.pem")
    m = manifest(model_dirs[ARCH], server={"tls_cert": str(d / "server.pem"), "tls_key": str(d / "server.key"),
                                           "tls_client_ca": str(d / "client-ca.pem"), "auth_token": TOKEN})
    assert m.security.cluster_secret  # on by default
    c = Cluster(m, log=lambda _: None)
    c.start()
    yield c, d
    c.stop()


def grpc_client(cluster: Cluster, d, who: str | None, **kwargs) -> Client:
    pair = {} if who is None else {"client_cert": (d / f"{who}.pem").read_bytes(),
                                   "client_key": (d / f"{who}.key").read_bytes()}
    return Client(cluster.address, timeout=30, root_certificates=(d / "server-ca.pem").read_bytes(), **pair, **kwargs)


def test_grpc_takes_only_clients_with_a_certificate_of_the_client_ca(mtls_cluster):
    cluster, d = mtls_cluster
    with grpc_client(cluster, d, "client", token=TOKEN) as client:
        assert len(client.generate("hello", max_tokens=2, temperature=0).token_ids) == 2
    with grpc_client(cluster, d, "client") as no_token, pytest.raises(Unauthenticated):
        no_token.generate("hello", max_tokens=2)  # the certificate does not replace the token
    for who in (None, "stranger"):  # no certificate, or one of another CA: the handshake fails
        with grpc_client(cluster, d, who, token=TOKEN) as client, pytest.raises(Unavailable):
            client.generate("hello", max_tokens=2)


def test_client_cert_and_key_go_together():
    with pytest.raises(ValueError, match="together"):
        Client("127.0.0.1:1", root_certificates=b"", client_cert=b"x")


def https_get(cluster: Cluster, d, who: str | None, path: str = "/v1/models") -> tuple[int, dict]:
    context = ssl.create_default_context(cafile=str(d / "server-ca.pem"))
    if who is not None:
        context.load_cert_chain(d / f"{who}.pem", d / f"{who}.key")
    host, port = cluster.http_address.rsplit(":", 1)
    connection = http.client.HTTPSConnection(host, int(port), context=context, timeout=30)
    try:
        connection.request("GET", path, headers={"authorization": f"Bearer {TOKEN}"})
        response = connection.getresponse()
        return response.status, json.loads(response.read())
    finally:
        connection.close()


def test_https_takes_only_clients_with_a_certificate_of_the_client_ca(mtls_cluster):
    cluster, d = mtls_cluster
    status, body = https_get(cluster, d, "client")
    assert status == 200 and body["data"][0]["id"] == cluster.manifest.served_name
    for who in (None, "stranger"):
        # TLS 1.3 reports the refusal after the client's side of the handshake: on connect or first read.
        with pytest.raises((ssl.SSLError, ConnectionError)):
            https_get(cluster, d, who)


def test_the_manifest_checks_the_client_ca(tmp_path):
    from pdserve.cluster.manifest import ManifestError, load_manifest

    ca = tmp_path / "ca.pem"
    ca.write_text("-----BEGIN CERTIFICATE-----\n")
    with pytest.raises(ManifestError, match="tls_client_ca needs tls_cert"):
        load_manifest({"server": {"tls_client_ca": str(ca)}})
    with pytest.raises(ManifestError, match="does not exist"):
        load_manifest({"server": {"tls_cert": str(ca), "tls_key": str(ca), "tls_client_ca": str(tmp_path / "none")}})
    assert load_manifest({}).security.cluster_secret and not load_manifest(
        {"security": {"cluster_secret": False}}).security.cluster_secret


def test_the_cli_generates_over_mutual_tls(mtls_cluster):
    cluster, d = mtls_cluster
    tls = ["--address", cluster.address, "--tls-ca", str(d / "server-ca.pem"), "--token", TOKEN]
    ok = pdserve("generate", *tls, "--client-cert", str(d / "client.pem"), "--client-key", str(d / "client.key"),
                 "--max-tokens", "2", "--temperature", "0", "hello")
    assert ok.returncode == 0, ok.stderr
    assert "[2 tokens" in ok.stderr
    refused = pdserve("generate", *tls, "--timeout", "10", "hello")  # no client certificate
    assert refused.returncode == 1 and "UNAVAILABLE" in refused.stderr, refused.stderr
