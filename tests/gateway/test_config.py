"""Config files: good ones load, bad ones give one clear line naming the problem."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from saltgate.config import (
    ConfigError,
    QueueConfig,
    create_master_key,
    load_config,
    load_master_key,
)

pytestmark = pytest.mark.unit

GOOD = """
[gateway]
port = 9000
state_dir = "st"

[[replicas]]
url = "http://127.0.0.1:8100"
weight = 2
api_key_env = "SG_TEST_BACKEND_KEY"

[prices.sim-model]
input = 1.0
cached_input = 0.1
output = 2
"""


def test_a_good_config_loads(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SG_TEST_BACKEND_KEY", "backend-secret")
    path = tmp_path / "g.toml"
    path.write_text(GOOD)
    config = load_config(path)
    assert config.port == 9000
    assert config.state_dir == tmp_path / "st"
    assert config.master_key_file == tmp_path / "st" / "master.key"
    assert config.replicas[0].weight == 2.0
    assert config.replicas[0].models is None  # learnt from the replica's /v1/models
    assert config.replicas[0].api_key == "backend-secret"
    assert config.prices["sim-model"].cached_input_per_mtok == 0.1
    assert config.salting
    assert (config.access_log, config.log_format, config.on_client_gone) == (
        "stderr",
        "text",
        "finish",
    )
    path.write_text(GOOD.replace("[gateway]", '[gateway]\naccess_log = "logs/access.log"'))
    assert load_config(path).access_log == str(tmp_path / "logs" / "access.log")
    assert config.cluster is None  # no [cluster]: the gateway routes on its own state
    path.write_text(GOOD.replace("weight = 2", 'weight = 2\nmodels = ["qwen3", "qwen3-lora"]'))
    assert load_config(path).replicas[0].models == ("qwen3", "qwen3-lora")
    path.write_text(
        GOOD + '[cluster]\nurl = "redis://bus@10.0.0.7:6379/0"\ngateway_id = "node-a"\n'
        'password_file = "secrets/bus"\n'
    )
    cluster = load_config(path).cluster
    assert cluster is not None and cluster.gateway_id == "node-a"
    assert cluster.password_file == tmp_path / "secrets" / "bus"
    assert config.trusted_proxies.networks == ()  # nobody's X-Forwarded-For is read
    path.write_text(GOOD.replace("[gateway]", '[gateway]\ntrusted_proxies = ["127.0.0.1", "::1"]'))
    networks = load_config(path).trusted_proxies.networks
    assert [str(n) for n in networks] == ["127.0.0.1/32", "::1/128"]
    assert config.limits_share == 1  # one gateway: the whole limit
    assert config.limits_lease_ttl_s == 600.0
    path.write_text(GOOD + "[limits]\nshare = 4\nlease_ttl_s = 120\n")
    assert (load_config(path).limits_share, load_config(path).limits_lease_ttl_s) == (4, 120.0)
    # On unless disabled, its prefill budget each replica's own engine step (None)
    assert config.queue == QueueConfig(True, 30.0, 2, 4096, None)
    path.write_text(GOOD + "[queue]\nenabled = false\n")
    assert load_config(path).queue == QueueConfig(False, 30.0, 2, 4096, None)
    path.write_text(
        GOOD + "[queue]\nenabled = true\nmax_queue_s = 5\nmax_waiting_per_replica = 0\n"
        "quantum_tokens = 0\nmax_prefill_tokens_per_replica = 8192\n"
    )
    assert load_config(path).queue == QueueConfig(True, 5.0, 0, 0, 8192)


@pytest.mark.parametrize(
    ("text", "needle"),
    [
        ("[gateway\n", "not valid TOML"),
        ("[gateway]\nport = 1\n", "replicas"),
        ('[[replicas]]\nurl = "ftp://x"\n', "replicas[0].url"),
        ('[[replicas]]\nurl = "http://h:1"\napi_key = "inline"\n', "do not put secrets"),
        ('[[replicas]]\nurl = "http://h:1"\napi_key_env = "SG_UNSET_VAR_X"\n', "not set"),
        ('[[replicas]]\nurl = "http://h:1"\nweight = -1\n', "weight"),
        ('[[replicas]]\nurl = "http://h:1"\nmodels = "m"\n', "replicas[0].models: expected"),
        ('[[replicas]]\nurl = "http://h:1"\nmodels = []\n', "replicas[0].models: expected"),
        ('[[replicas]]\nurl = "http://h:1"\nmodels = ["m", 1]\n', "non-empty string"),
        ('[[replicas]]\nurl = "http://h:1"\nmodels = ["m", "m"]\n', "listed twice"),
        ('[gateway]\nport = "80"\n[[replicas]]\nurl = "http://h:1"\n', "gateway.port"),
        ('[gateway]\nprot = 80\n[[replicas]]\nurl = "http://h:1"\n', "unknown keys"),
        ('[[replicas]]\nurl = "http://h:1"\n[prices.m]\ninput = 1\n', "cached_input"),
        ('[[replicas]]\nurl = "http://h:1"\n[extra]\n', "unknown sections"),
        ('[gateway]\nlog_format = "xml"\n[[replicas]]\nurl = "http://h:1"\n', "log_format"),
        ('[gateway]\non_client_gone = "x"\n[[replicas]]\nurl = "http://h:1"\n', "finish, abort"),
        ('[[replicas]]\nurl = "http://h:1"\n[cluster]\ngateway_id = "a"\n', "cluster.url"),
        ('[[replicas]]\nurl = "http://h:1"\n[cluster]\npassword = "inline"\n', "cluster.password"),
        ('[gateway]\ntrusted_proxies = "10.0.0.0/8"\n[[replicas]]\nurl = "http://h:1"\n', "list"),
        ('[gateway]\ntrusted_proxies = [10]\n[[replicas]]\nurl = "http://h:1"\n', "strings"),
        ('[[replicas]]\nurl = "http://h:1"\n[limits]\nshare = 0\n', "limits.share"),
        ('[[replicas]]\nurl = "http://h:1"\n[limits]\nshare = "2"\n', "limits.share"),
        ('[[replicas]]\nurl = "http://h:1"\n[limits]\nshares = 2\n', "limits: unknown keys"),
        ('[[replicas]]\nurl = "http://h:1"\n[limits]\nlease_ttl_s = 0\n', "limits.lease_ttl_s"),
        ('[[replicas]]\nurl = "http://h:1"\n[queue]\nenabled = 1\n', "queue.enabled"),
        ('[[replicas]]\nurl = "http://h:1"\n[queue]\nmax_queue_s = 0\n', "queue.max_queue_s"),
        ('[[replicas]]\nurl = "http://h:1"\n[queue]\nquantum_tokens = -1\n', "queue.quantum"),
        (
            '[[replicas]]\nurl = "http://h:1"\n[queue]\nmax_prefill_tokens_per_replica = -1\n',
            "queue.max_prefill_tokens_per_replica",
        ),
        ('[[replicas]]\nurl = "http://h:1"\n[queue]\nmax_waiting = 2\n', "queue: unknown keys"),
        ('queue = 2\n[[replicas]]\nurl = "http://h:1"\n', "queue: expected a table"),
        (
            '[gateway]\ntrusted_proxies = ["10.0.0.1/8"]\n[[replicas]]\nurl = "http://h:1"\n',
            "gateway.trusted_proxies: '10.0.0.1/8'",
        ),
    ],
)
def test_bad_configs_name_the_problem(tmp_path: Path, text: str, needle: str) -> None:
    path = tmp_path / "g.toml"
    path.write_text(text)
    with pytest.raises(ConfigError) as info:
        load_config(path)
    assert needle in str(info.value)
    assert "inline" not in str(info.value)


def test_missing_file_is_a_config_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="cannot read config file"):
        load_config(tmp_path / "nope.toml")


def test_master_key_is_created_private_and_checked(tmp_path: Path) -> None:
    path = tmp_path / "state" / "master.key"
    assert create_master_key(path)
    assert not create_master_key(path)  # never overwritten
    assert os.stat(path).st_mode & 0o777 == 0o600
    assert len(load_master_key(path)) == 32
    os.chmod(path, 0o644)
    with pytest.raises(ConfigError, match="readable by others"):
        load_master_key(path)
    short = tmp_path / "short.key"
    short.write_text("abcd")
    os.chmod(short, 0o600)
    with pytest.raises(ConfigError, match="too short") as info:
        load_master_key(short)
    assert "abcd" not in str(info.value)


def _private(path: Path, text: str) -> Path:
    path.write_text(text)
    path.chmod(0o600)
    return path


def test_api_key_file_is_relative_to_the_config_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    etc = tmp_path / "etc"
    etc.mkdir()
    _private(etc / "replica.key", "backend-secret\n")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    # The same name in the working directory: what a path resolved from there would read.
    _private(elsewhere / "replica.key", "the-wrong-key\n")
    monkeypatch.chdir(elsewhere)
    path = etc / "g.toml"
    path.write_text('[[replicas]]\nurl = "http://localhost:1"\napi_key_file = "replica.key"\n')
    assert load_config(path).replicas[0].api_key == "backend-secret"


def test_secret_files_must_be_private_regular_files(tmp_path: Path) -> None:
    """Master key and replica API key files alike: no symlink, no directory, not readable
    by others; the error never shows the content."""
    content = "ab" * 32
    real = _private(tmp_path / "real.key", content)
    link = tmp_path / "link.key"
    link.symlink_to(real)
    loose = _private(tmp_path / "loose.key", content)
    loose.chmod(0o640)
    config = tmp_path / "g.toml"
    assert len(load_master_key(real)) == 32  # the same content, from a proper file, is fine
    for path, needle in ((link, "symlink"), (loose, "readable by others"), (tmp_path, "regular")):
        with pytest.raises(ConfigError, match=needle) as info:
            load_master_key(path)
        assert content not in str(info.value)
        config.write_text(f'[[replicas]]\nurl = "http://h:1"\napi_key_file = "{path}"\n')
        with pytest.raises(ConfigError, match=needle) as info:
            load_config(config)
        assert "replicas[0].api_key_file" in str(info.value) and content not in str(info.value)


# -- links to the replicas: TLS, or plaintext on loopback only -----------------------------

REMOTE_HTTP = '[[replicas]]\nurl = "http://10.0.0.5:8000"\n'


def test_plain_http_off_loopback_is_refused_unless_allowed(tmp_path: Path) -> None:
    path = tmp_path / "g.toml"
    path.write_text(REMOTE_HTTP)
    with pytest.raises(ConfigError, match=r"replicas\[0\].url: plain http:// to 10.0.0.5"):
        load_config(path)
    path.write_text("[gateway]\nallow_plaintext_upstream = true\n" + REMOTE_HTTP)
    config = load_config(path)
    assert config.allow_plaintext_upstream
    assert config.replicas[0].plaintext_remote
    for host in ("127.0.0.1", "127.3.2.1", "[::1]", "localhost"):
        path.write_text(f'[[replicas]]\nurl = "http://{host}:8000"\n')
        assert not load_config(path).replicas[0].plaintext_remote, host


def test_kv_events_off_loopback_need_curve_unless_allowed(tmp_path: Path) -> None:
    path = tmp_path / "g.toml"
    kv = '[[replicas]]\nurl = "http://127.0.0.1:8000"\nkv_events_endpoint = "tcp://10.0.0.5:5557"\n'
    path.write_text(kv)
    with pytest.raises(ConfigError, match=r"replicas\[0\].kv_events_endpoint: a tcp:// link"):
        load_config(path)
    bound = kv.replace("tcp://10.0.0.5:5557", "tcp://*:5557") + "kv_events_bind = true\n"
    path.write_text(bound)
    with pytest.raises(ConfigError, match="kv_events_endpoint"):
        load_config(path)  # bound on every interface: vLLM may connect from anywhere
    path.write_text(kv.replace("10.0.0.5", "127.0.0.1"))
    assert not load_config(path).replicas[0].kv_plaintext_remote
    (tmp_path / "server.pub").write_text(
        "# the forwarder's key\n" + "rq:rM>}U?@Lns47E1%kR.o@n%FcmmsL/@{H8]yf7" + "\n"
    )
    path.write_text(kv + 'kv_events_curve_server_key_file = "server.pub"\n')
    replica = load_config(path).replicas[0]
    assert replica.kv_events_curve_server_key == "rq:rM>}U?@Lns47E1%kR.o@n%FcmmsL/@{H8]yf7"
    assert replica.kv_upstream is not None
    assert replica.kv_upstream.curve_server_key == replica.kv_events_curve_server_key
    (tmp_path / "server.pub").write_text("not a key\n")
    with pytest.raises(ConfigError, match=r"kv_events_curve_server_key_file: .* one key"):
        load_config(path)
    path.write_text("[gateway]\nallow_plaintext_upstream = true\n" + kv)
    assert load_config(path).replicas[0].kv_plaintext_remote


def test_https_replicas_take_a_ca_bundle_and_a_client_certificate(tmp_path: Path) -> None:
    for name in ("ca.pem", "client.pem"):
        (tmp_path / name).write_text("PEM")  # config.py checks the files, http/tls.py reads them
    key = _private(tmp_path / "client.key", "PEM")
    path = tmp_path / "g.toml"
    https = '[[replicas]]\nurl = "https://vllm-0.internal:8443/v1"\n'
    path.write_text(https)
    replica = load_config(path).replicas[0]
    assert replica.tls and not replica.plaintext_remote and replica.tls_ca_file is None
    assert replica.authority == ("vllm-0.internal", 8443, "/v1")
    path.write_text(
        https
        + 'tls_ca_file = "ca.pem"\ntls_cert_file = "client.pem"\ntls_key_file = "client.key"\n'
    )
    replica = load_config(path).replicas[0]
    assert (replica.tls_ca_file, replica.tls_cert_file, replica.tls_key_file) == (
        tmp_path / "ca.pem",
        tmp_path / "client.pem",
        key,
    )
    path.write_text('[[replicas]]\nurl = "https://vllm-0.internal"\n')
    assert load_config(path).replicas[0].authority == ("vllm-0.internal", 443, "")


@pytest.mark.parametrize(
    ("extra", "needle"),
    [
        ('tls_ca_file = "missing.pem"\n', "tls_ca_file: "),
        ('tls_cert_file = "client.pem"\n', "tls_cert_file and tls_key_file go together"),
        ('tls_cert_file = "client.pem"\ntls_key_file = "loose.key"\n', "readable by others"),
        ("tls_ca_file = 3\n", "tls_ca_file: expected str"),
        ('tls_ca_fil = "ca.pem"\n', "unknown keys"),
    ],
)
def test_bad_tls_settings_name_the_problem(tmp_path: Path, extra: str, needle: str) -> None:
    (tmp_path / "client.pem").write_text("PEM")
    (tmp_path / "loose.key").write_text("-----BEGIN PRIVATE KEY-----")
    (tmp_path / "loose.key").chmod(0o644)
    path = tmp_path / "g.toml"
    path.write_text('[[replicas]]\nurl = "https://127.0.0.1:8443"\n' + extra)
    with pytest.raises(ConfigError) as info:
        load_config(path)
    assert needle in str(info.value)
    assert "BEGIN PRIVATE KEY" not in str(info.value)


def test_tls_settings_need_https_and_urls_carry_no_credentials(tmp_path: Path) -> None:
    (tmp_path / "ca.pem").write_text("PEM")
    path = tmp_path / "g.toml"
    path.write_text('[[replicas]]\nurl = "http://127.0.0.1:8000"\ntls_ca_file = "ca.pem"\n')
    with pytest.raises(ConfigError, match="tls_ca_file: TLS settings need an https:// url"):
        load_config(path)
    path.write_text('[[replicas]]\nurl = "https://user:hunter2@127.0.0.1:8443"\n')
    with pytest.raises(ConfigError, match="no credentials in the URL") as info:
        load_config(path)
    assert "hunter2" not in str(info.value)


def test_replica_priority_scheduling_is_off_unless_set(tmp_path: Path) -> None:
    path = tmp_path / "g.toml"
    replica = '[[replicas]]\nurl = "http://127.0.0.1:8000"\n'
    path.write_text(replica)
    assert not load_config(path).replica_priority_scheduling
    path.write_text("[gateway]\nreplica_priority_scheduling = true\n" + replica)
    assert load_config(path).replica_priority_scheduling
    path.write_text('[gateway]\nreplica_priority_scheduling = "yes"\n' + replica)
    with pytest.raises(ConfigError, match="replica_priority_scheduling"):
        load_config(path)


def test_media_is_refused_unless_the_media_section_says_fetch(tmp_path: Path) -> None:
    path = tmp_path / "g.toml"
    replica = '[[replicas]]\nurl = "http://127.0.0.1:8000"\n'
    path.write_text(replica)
    assert not load_config(path).media.fetch  # remote media URLs: 400
    path.write_text(
        replica + '[media]\nremote = "fetch"\nhosts = ["*.cdn.example"]\n'
        'allow_networks = ["10.1.0.0/16"]\ntimeout_s = 5\ntls_ca_file = "ca.pem"\n'
    )
    media = load_config(path).media
    assert media.fetch and media.hosts == ("*.cdn.example",)
    assert [str(n) for n in media.allow_networks] == ["10.1.0.0/16"]
    assert (media.timeout_s, media.tls_ca_file) == (5.0, tmp_path / "ca.pem")
    for bad, needle in (
        ('[media]\nremote = "proxy"\n', "media.remote: expected one of refuse, fetch"),
        ('[media]\nallow_networks = ["10.0.0.1/8"]\n', "media.allow_networks: 10.0.0.1/8"),
        ("[media]\nmax_redirect = 1\n", "media.max_redirect: unknown key"),
        ("media = 1\n", "media: expected a table"),
    ):
        path.write_text(
            bad.replace("[media]", replica + "[media]") if "[" in bad else bad + replica
        )
        with pytest.raises(ConfigError) as info:
            load_config(path)
        assert str(info.value).startswith(needle), str(info.value)
