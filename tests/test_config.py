"""CacheConfig: defaults, size parsing, env / TOML / CLI sources and their precedence, validation."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from helpers.cli import parse_cli

from paged_cache.cli.main import main as cli_main
from paged_cache.config import CacheConfig, filesystem_space, parse_size

pytestmark = pytest.mark.unit


# ------------------------------------------------------------------------------ sizes

@pytest.mark.parametrize("text, expected", [
    (0, 0), (4096, 4096), ("4096", 4096), ("17B", 17), ("512MB", 512 * 10**6),
    ("8GB", 8 * 10**9), ("8gb", 8 * 10**9), ("1.5GiB", 3 * 2**29), ("1.5gib", 3 * 2**29),
    ("2KiB", 2048), ("3kb", 3000), (" 10 MiB ", 10 * 2**20), ("1TB", 10**12), ("2TiB", 2 * 2**40),
    (".5KiB", 512), (2.0, 2),
])
def test_sizes_parse_decimal_and_binary_units(text, expected):
    assert parse_size(text, "hot_cache_max_bytes") == expected


@pytest.mark.parametrize("bad", [-1, "-1", "-5MB", "12XB", "GB", "1e9", "1.5.2GB", "", True,
                                 None, [1], 1.5, float("nan"), float("inf")])
def test_bad_sizes_name_the_field_and_the_form(bad):
    with pytest.raises(ValueError, match=r"^hot_cache_max_bytes: expected .*"):
        CacheConfig(hot_cache_max_bytes=bad)


# ------------------------------------------------------------------------------ constructor

def test_defaults_are_resolved_and_marked_default():
    config = CacheConfig()
    assert config.block_size == 256
    assert 0 < config.hot_cache_max_bytes <= 8 * 2**30
    assert config.ssd_dir.name == "paged-cache"
    assert config.ssd_max_bytes == "auto"
    assert config.hot_cache_only is False
    assert (config.compression, config.write_policy, config.queue_full_policy) == \
        ("none", "write-through", "skip")
    assert config.ssd_admission == "all"
    assert config.write_queue_max_bytes == 256 * 2**20
    assert config.explicit == frozenset()
    assert set(config.sources.values()) == {"default"}


def test_constructor_normalizes_and_records_explicit_fields(tmp_path):
    config = CacheConfig(block_size=16, hot_cache_max_bytes="1.5GiB", ssd_dir=str(tmp_path),
                         ssd_max_bytes="2GB", compression="LZ4", write_policy="write-back",
                         write_queue_max_bytes="64MiB", queue_full_policy="write-on-caller")
    assert config.hot_cache_max_bytes == 3 * 2**29
    assert config.ssd_dir == tmp_path and isinstance(config.ssd_dir, Path)
    assert config.ssd_max_bytes == 2 * 10**9
    assert config.compression == "lz4"
    assert config.write_queue_max_bytes == 64 * 2**20
    assert config.explicit == {"block_size", "hot_cache_max_bytes", "ssd_dir", "ssd_max_bytes",
                               "compression", "write_policy", "write_queue_max_bytes",
                               "queue_full_policy"}
    assert config.sources["block_size"] == "constructor"
    assert config.sources["hot_cache_only"] == "default"
    assert config == CacheConfig(**{k: v for k, v in config.to_dict().items()})
    json.dumps(config.to_dict())


@pytest.mark.parametrize("kwargs, field", [
    (dict(block_size=0), "block_size"), (dict(block_size=-4), "block_size"),
    (dict(block_size=2.5), "block_size"), (dict(block_size="16x"), "block_size"),
    (dict(block_size=True), "block_size"),
    (dict(compression="zstd"), "compression"), (dict(compression=None), "compression"),
    (dict(write_policy="lazy"), "write_policy"), (dict(queue_full_policy="block"), "queue_full_policy"),
    (dict(ssd_admission="second"), "ssd_admission"),
    (dict(hot_cache_only="maybe"), "hot_cache_only"), (dict(hot_cache_only=2), "hot_cache_only"),
    (dict(ssd_dir=""), "ssd_dir"), (dict(ssd_dir=3), "ssd_dir"),
    (dict(ssd_max_bytes="lots"), "ssd_max_bytes"), (dict(ssd_max_bytes=0), "ssd_max_bytes"),
    (dict(write_queue_max_bytes="-1GB"), "write_queue_max_bytes"),
])
def test_invalid_values_raise_naming_the_field(kwargs, field):
    with pytest.raises(ValueError, match=rf"^{field}: "):
        CacheConfig(**kwargs)


@pytest.mark.parametrize("kwargs, field", [
    (dict(ssd_dir="/tmp/x"), "ssd_dir"), (dict(ssd_max_bytes="1GB"), "ssd_max_bytes"),
    (dict(ssd_max_bytes="auto"), "ssd_max_bytes"), (dict(compression="lz4"), "compression"),
    (dict(write_policy="write-back"), "write_policy"),
    (dict(ssd_admission="reused"), "ssd_admission"),
])
def test_hot_cache_only_makes_explicit_ssd_settings_inert(kwargs, field):
    config = CacheConfig(hot_cache_only=True, **kwargs)
    assert config.hot_cache_only and config.inert_fields() == {field: "constructor"}
    assert CacheConfig(**kwargs).inert_fields() == {}


def test_compression_stays_active_for_a_remote_tier():
    config = CacheConfig(hot_cache_only=True, remote_url="redis://127.0.0.1:6379",
                         compression="lz4", ssd_dir="/tmp/x")
    assert config.inert_fields() == {"ssd_dir": "constructor"}
    assert "compression" not in config.inactive_fields()


def test_hot_cache_only_accepts_the_no_op_ssd_values():
    config = CacheConfig(hot_cache_only=True, ssd_max_bytes=0, compression="none")
    assert config.hot_cache_only and config.ssd_max_bytes == 0


def test_no_ssd_space_names_the_source_of_each_value():
    with pytest.raises(ValueError, match=r"^ssd_max_bytes: 0 \(from env:PAGED_CACHE_SSD_MAX_BYTES\)"
                                         r" .*hot_cache_only=False \(from default\)"):
        CacheConfig.from_env({"PAGED_CACHE_SSD_MAX_BYTES": "0"})
    with pytest.raises(ValueError, match=r"^block_size: .* \(from env:PAGED_CACHE_BLOCK_SIZE\)$"):
        CacheConfig.from_env({"PAGED_CACHE_BLOCK_SIZE": "many"})


def test_ssd_budget_never_exceeds_the_filesystem(tmp_path, caplog):
    total, free_before = filesystem_space(tmp_path)
    auto = CacheConfig(ssd_dir=tmp_path / "not" / "yet")
    budget = auto.ssd_budget_bytes()
    low, high = sorted([free_before, filesystem_space(tmp_path)[1]])  # the disk is shared
    assert low // 2 <= budget <= high // 2
    assert auto.ssd_budget_bytes(cache_bytes=2**30) >= low // 2 + 2**29 - 64 * 2**20
    assert auto.ssd_budget_bytes(cache_bytes=10**30) <= total
    assert not (tmp_path / "not").exists()      # resolving the budget creates nothing
    huge = CacheConfig(ssd_dir=tmp_path, ssd_max_bytes=total * 10)
    assert huge.ssd_budget_bytes() == total
    assert "exceeds the filesystem size" in caplog.text
    assert CacheConfig(ssd_dir=tmp_path, ssd_max_bytes="1MB").ssd_budget_bytes() == 10**6


# ------------------------------------------------------------------------------ env

def test_from_env_reads_every_field(tmp_path):
    env = {"PAGED_CACHE_BLOCK_SIZE": "64", "PAGED_CACHE_HOT_CACHE_MAX_BYTES": "32MiB",
           "PAGED_CACHE_SSD_DIR": str(tmp_path), "PAGED_CACHE_SSD_MAX_BYTES": "auto",
           "PAGED_CACHE_COMPRESSION": "lz4", "PAGED_CACHE_WRITE_POLICY": "write-back",
           "PAGED_CACHE_WRITE_QUEUE_MAX_BYTES": "1MB", "PAGED_CACHE_SSD_ADMISSION": "Reused",
           "PAGED_CACHE_QUEUE_FULL_POLICY": "write-on-caller", "HOME_UNRELATED": "x"}
    config = CacheConfig.from_env(env)
    assert (config.block_size, config.hot_cache_max_bytes, config.ssd_dir) == \
        (64, 32 * 2**20, tmp_path)
    assert (config.compression, config.write_policy, config.write_queue_max_bytes,
            config.queue_full_policy) == ("lz4", "write-back", 10**6, "write-on-caller")
    assert config.ssd_admission == "reused"
    assert config.sources["block_size"] == "env:PAGED_CACHE_BLOCK_SIZE"
    assert config.sources["hot_cache_only"] == "default"


@pytest.mark.parametrize("word, value", [("1", True), ("true", True), ("YES", True), ("on", True),
                                         ("0", False), ("False", False), ("no", False),
                                         ("off", False)])
def test_env_bool_words(word, value):
    assert CacheConfig.from_env({"PAGED_CACHE_HOT_CACHE_ONLY": word}).hot_cache_only is value


@pytest.mark.parametrize("env, field", [
    ({"PAGED_CACHE_HOT_CACHE_ONLY": "sure"}, "hot_cache_only"),
    ({"PAGED_CACHE_BLOCK_SIZE": "0"}, "block_size"),
    ({"PAGED_CACHE_HOT_CACHE_MAX_BYTES": "8 parsecs"}, "hot_cache_max_bytes"),
    ({"PAGED_CACHE_BLOKC_SIZE": "64"}, "PAGED_CACHE_BLOKC_SIZE"),
])
def test_from_env_invalid(env, field):
    with pytest.raises(ValueError, match=rf"^{field}: "):
        CacheConfig.from_env(env)


def test_from_env_defaults_to_the_process_environment():
    # No PAGED_CACHE_* variables are set for the test run: the result equals the defaults.
    assert not any(k.startswith("PAGED_CACHE_") for k in os.environ)
    assert CacheConfig.from_env() == CacheConfig()


# ------------------------------------------------------------------------------ TOML

def test_from_toml_table_and_top_level(tmp_path):
    tabled = tmp_path / "pyproject.toml"
    tabled.write_text('[project]\nname = "x"\n\n[paged_cache]\nblock_size = 32\n'
                      'hot_cache_max_bytes = "1GiB"\nhot_cache_only = true\n')
    config = CacheConfig.from_toml(tabled)
    assert (config.block_size, config.hot_cache_max_bytes, config.hot_cache_only) == \
        (32, 2**30, True)
    assert config.sources["block_size"] == f"toml:{tabled}"
    flat = tmp_path / "cache.toml"
    flat.write_text(f'ssd_dir = "{tmp_path}"\nssd_max_bytes = 5000000\ncompression = "lz4"\n')
    config = CacheConfig.from_toml(flat)
    assert (config.ssd_dir, config.ssd_max_bytes, config.compression) == (tmp_path, 5 * 10**6, "lz4")


@pytest.mark.parametrize("text, field", [
    ("block_size = 0\n", "block_size"),
    ("compression = 'brotli'\n", "compression"),
    ("hot_cache_only = 'perhaps'\n", "hot_cache_only"),
    ("[paged_cache]\nhot_cache_max_bytes = -3\n", "hot_cache_max_bytes"),
    ("[paged_cache]\nblocksize = 64\n", "blocksize"),
    ("colour = 'blue'\n", "colour"),
    ("block_size = \n", "config file"),
])
def test_from_toml_invalid(tmp_path, text, field):
    path = tmp_path / "c.toml"
    path.write_text(text)
    with pytest.raises(ValueError, match=rf"^{field}: "):
        CacheConfig.from_toml(path)


def test_from_toml_missing_file(tmp_path):
    with pytest.raises(ValueError, match=r"^config file: cannot read TOML"):
        CacheConfig.from_toml(tmp_path / "absent.toml")


# ------------------------------------------------------------------------------ CLI and layering

def test_cli_flags_for_every_field(tmp_path):
    config = parse_cli(["--block-size", "128", "--hot-cache-max-bytes", "2GB", "--ssd-dir",
                        str(tmp_path), "--ssd-max-bytes", "3GiB", "--compression", "lz4",
                        "--write-policy", "write-back", "--ssd-admission", "reused",
                        "--tail-write-delay-s", "0.5", "--write-queue-max-bytes", "8MB",
                        "--queue-full-policy", "write-on-caller", "--remote-url",
                        "rediss://u:pw@cache.lan:6380/2", "--remote-ttl", "3600",
                        "--remote-timeout", "0.2", "--remote-queue-max-bytes", "16MiB",
                        "--remote-insecure",
                        "--remote-tls-ca", "/ca.pem",
                        "--remote-tls-cert", "/c.pem", "--remote-tls-key", "/k.pem",
                        "--cache-salt-from-user", "--ssd-read-threads", "4",
                        "--fetch-policy", "always-restore", "--no-fetch-overlap",
                        "--no-shared-prefill", "--prefill-tokens-per-s", "1500",
                        "--test-ssd-read-bytes-per-s", "2MB"])
    assert config.to_dict() == dict(
        block_size=128, hot_cache_max_bytes=2 * 10**9, ssd_dir=str(tmp_path),
        ssd_max_bytes=3 * 2**30, hot_cache_only=False, compression="lz4",
        write_policy="write-back", ssd_admission="reused", tail_write_delay_s=0.5,
        write_queue_max_bytes=8 * 10**6,
        queue_full_policy="write-on-caller", remote_url="rediss://u:***@cache.lan:6380/2",
        remote_cluster=False, remote_ttl=3600.0, remote_timeout=0.2,
        remote_queue_max_bytes=16 * 2**20, remote_secret=None, remote_insecure=True,
        remote_tls_ca="/ca.pem",
        remote_tls_cert="/c.pem", remote_tls_key="/k.pem", cache_salt_from_user=True,
        ssd_read_threads=4, fetch_policy="always-restore", fetch_overlap=False,
        shared_prefill=False, prefill_tokens_per_s=1500.0,
        test_ssd_read_bytes_per_s=2 * 10**6)
    assert config.remote_url == "rediss://u:pw@cache.lan:6380/2"
    assert config.sources["ssd_dir"] == "flag:--ssd-dir"
    assert parse_cli(["--hot-cache-only"]).hot_cache_only is True


def test_precedence_default_toml_env_flag(tmp_path):
    toml = tmp_path / "c.toml"
    toml.write_text("[paged_cache]\nblock_size = 32\nhot_cache_max_bytes = '10MB'\n"
                    "write_policy = 'write-back'\nssd_admission = 'reused'\n")
    env = {"PAGED_CACHE_HOT_CACHE_MAX_BYTES": "20MB", "PAGED_CACHE_BLOCK_SIZE": "48"}
    config = parse_cli(["--config", str(toml), "--block-size", "64"], env)
    assert config.block_size == 64 and config.sources["block_size"] == "flag:--block-size"
    assert config.hot_cache_max_bytes == 20 * 10**6
    assert config.sources["hot_cache_max_bytes"] == "env:PAGED_CACHE_HOT_CACHE_MAX_BYTES"
    assert config.write_policy == "write-back" and config.sources["write_policy"] == f"toml:{toml}"
    assert config.ssd_admission == "reused" and config.sources["ssd_admission"] == f"toml:{toml}"
    assert config.sources["compression"] == "default"
    # --no-hot-cache-only overrides an env that turns it on.
    assert not parse_cli(["--no-hot-cache-only"], {"PAGED_CACHE_HOT_CACHE_ONLY": "1"}).hot_cache_only


def test_hot_cache_only_flag_wins_over_a_toml_ssd_dir(tmp_path):
    toml = tmp_path / "c.toml"
    toml.write_text(f"ssd_dir = '{tmp_path / 'ssd'}'\ncompression = 'lz4'\n")
    config = parse_cli(["--config", str(toml), "--hot-cache-only"])
    assert config.inert_fields() == {"ssd_dir": f"toml:{toml}", "compression": f"toml:{toml}"}


def test_a_hot_budget_beside_the_model_weights(caplog):
    gib = 2**30
    explicit = CacheConfig(hot_cache_max_bytes="8GiB")
    assert explicit.beside_model(10 * gib, ram=24 * gib) is explicit          # fits: unchanged
    with pytest.raises(ValueError, match=r"^hot_cache_max_bytes: 8 GiB \(from constructor\) plus "
                                         r"the model's weights \(20 GiB\) exceed this machine's "
                                         r"RAM \(24 GiB\); give at most 4 GiB$"):
        explicit.beside_model(20 * gib, ram=24 * gib)
    default = CacheConfig()
    capped = default.beside_model(24 * gib - default.hot_cache_max_bytes + gib, ram=24 * gib)
    assert capped.hot_cache_max_bytes == default.hot_cache_max_bytes - gib
    assert capped.sources["hot_cache_max_bytes"] == "default, capped beside the model's weights"
    assert capped.explicit == frozenset() and capped.ssd_dir == default.ssd_dir
    assert "capping the hot tier at" in caplog.text
    assert default.beside_model(30 * gib, ram=24 * gib).hot_cache_max_bytes == 0


def test_cli_bad_size_raises_value_error():
    with pytest.raises(ValueError, match=r"^write_queue_max_bytes: expected"):
        parse_cli(["--write-queue-max-bytes", "lots"])


def test_config_subcommand_prints_values_and_sources(tmp_path, capsys):
    assert cli_main(["config", "--json", "--block-size", "64", "--ssd-dir", str(tmp_path)]) == 0
    shown = json.loads(capsys.readouterr().out)
    assert shown["block_size"] == {"value": 64, "source": "flag:--block-size", "active": True}
    assert shown["ssd_dir"]["value"] == str(tmp_path)
    assert shown["ssd_max_bytes"]["effective_bytes"] > 0
    assert cli_main(["config", "--hot-cache-only"]) == 0
    table = capsys.readouterr().out
    assert "hot_cache_only" in table and "[flag:--hot-cache-only]" in table
    assert cli_main(["config", "--block-size", "0"]) == 2
    assert "block_size: expected a positive int" in capsys.readouterr().err
