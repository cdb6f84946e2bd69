"""The tier config: documented defaults, and errors that name the offending key."""

from __future__ import annotations

import dataclasses

import pytest
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st

from datamover.policy.config import (
    GIB,
    ConfigError,
    TierConfig,
    default_config_yaml,
    load_config,
    parse_config,
    with_overrides,
)

SECTIONS = {f.name: f.default_factory for f in dataclasses.fields(TierConfig)}
SCALARS = [
    (section, f.name, f.type)
    for section, factory in SECTIONS.items()
    for f in dataclasses.fields(factory())
    if f.type in ("bool", "int", "float", "str")
]


def doc(section: str, values: dict) -> dict:
    return {"kv_cache_tiered": {section: values}}


def test_defaults_are_documented_and_round_trip():
    text = default_config_yaml()
    assert parse_config(yaml.safe_load(text)) == TierConfig()
    for section, factory in SECTIONS.items():
        for f in dataclasses.fields(factory()):
            assert f.metadata.get("doc"), f"{section}.{f.name} has no documentation"
            assert f"{f.name}:" in text


def test_empty_file_and_none_give_defaults(tmp_path):
    (tmp_path / "empty.yaml").write_text("")
    assert load_config(tmp_path / "empty.yaml") == TierConfig() == load_config(None)


@settings(max_examples=60, deadline=None)
@given(section=st.sampled_from(sorted(SECTIONS)), key=st.from_regex(r"[a-z_]{3,20}", fullmatch=True))
def test_unknown_key_is_named(section, key):
    known = {f.name for f in dataclasses.fields(SECTIONS[section]())}
    if key in known:
        return
    with pytest.raises(ConfigError) as err:
        parse_config(doc(section, {key: 1}))
    assert err.value.path == f"kv_cache_tiered.{section}.{key}"
    assert str(err.value).startswith(f"kv_cache_tiered.{section}.{key}: unknown key")


def _wrong_value(kind: str):
    if kind == "bool":
        return st.one_of(st.integers(), st.text(max_size=5), st.floats(allow_nan=False))
    if kind == "int":
        return st.one_of(st.booleans(), st.text(max_size=5), st.floats(allow_nan=False))
    if kind == "float":
        return st.one_of(st.booleans(), st.text(max_size=5), st.lists(st.integers(), max_size=2))
    return st.one_of(st.integers(), st.booleans(), st.floats(allow_nan=False))


@settings(max_examples=150, deadline=None)
@given(data=st.data(), field=st.sampled_from(SCALARS))
def test_wrong_type_is_named(data, field):
    section, name, kind = field
    value = data.draw(_wrong_value(kind))
    with pytest.raises(ConfigError) as err:
        parse_config(doc(section, {name: value}))
    assert err.value.path == f"kv_cache_tiered.{section}.{name}"
    assert "expected" in str(err.value)


@settings(max_examples=60, deadline=None)
@given(pool=st.integers(1, 1 << 20), page_kib=st.integers(1, 256), gb=st.floats(0.001, 64))
def test_valid_values_are_kept(pool, page_kib, gb):
    config = parse_config(
        {
            "kv_cache_tiered": {
                "l1_hbm": {"block_pool_size": pool, "page_size_bytes": page_kib * 4096},
                "l2_dram": {"pinned_pool_gb": gb},
            }
        }
    )
    assert config.l1_hbm.block_pool_size == pool
    assert config.capacity_chunks("l2_dram") == int(gb * GIB) // (page_kib * 4096)


@pytest.mark.parametrize(
    ("section", "values", "path", "words"),
    [
        ("l1_hbm", {"page_size_bytes": 1000}, "l1_hbm.page_size_bytes", "multiple of 4096"),
        ("l1_hbm", {"block_pool_size": 0}, "l1_hbm.block_pool_size", "greater than 0"),
        ("l1_hbm", {"device": "tpu"}, "l1_hbm.device", "not one of"),
        ("l2_dram", {"high_watermark": 0.8, "low_watermark": 0.9}, "l2_dram.low_watermark", "above high_watermark"),
        ("l3_nvme", {"fsync_mode": "sometimes"}, "l3_nvme.fsync_mode", "not one of"),
        ("l4_pool", {"enabled": True, "bucket": ""}, "l4_pool.bucket", "needs a bucket"),
        ("l4_pool", {"replica_count": 0}, "l4_pool.replica_count", "at least 1"),
        ("l4_pool", {"prefix": "kv"}, "l4_pool.prefix", "ending in '/'"),
        ("l4_pool", {"prefix": "/kv/"}, "l4_pool.prefix", "not a key prefix"),
        ("l4_pool", {"prefix": "a b/"}, "l4_pool.prefix", "not a key prefix"),
        ("l4_pool", {"prefix": "a//"}, "l4_pool.prefix", "not a key prefix"),
        ("l4_pool", {"backend": "mooncake", "prefix": "mine/"}, "l4_pool.prefix", "shared"),
        ("policy", {"write_mode": "write_sometimes"}, "policy.write_mode", "not one of"),
        ("observability", {"span_fields": ["layer_id", "colour"]}, "observability.span_fields[1]", "unknown span"),
    ],
)
def test_bad_values_are_named(section, values, path, words):
    with pytest.raises(ConfigError) as err:
        parse_config(doc(section, values))
    assert err.value.path == f"kv_cache_tiered.{path}"
    assert words in str(err.value)


def test_capacity_that_holds_no_chunk_is_named():
    with pytest.raises(ConfigError) as err:
        parse_config({"kv_cache_tiered": {"l1_hbm": {"page_size_bytes": 1 << 30}, "l2_dram": {"pinned_pool_gb": 0.5}}})
    assert err.value.path == "kv_cache_tiered.l2_dram.pinned_pool_gb"


def test_capacity_that_does_not_fit_the_machine(tmp_path):
    config = with_overrides(TierConfig(), l1_hbm={"block_pool_size": 1 << 20, "device": "cuda"})
    with pytest.raises(ConfigError) as err:
        config.check_fits(gpu_bytes=1 << 30)  # 64 GiB of L1 on a 1 GiB GPU
    assert err.value.path == "kv_cache_tiered.l1_hbm.block_pool_size"
    with pytest.raises(ConfigError) as err:
        with_overrides(TierConfig(), l2_dram={"pinned_pool_gb": 1e7}).check_fits()
    assert err.value.path == "kv_cache_tiered.l2_dram.pinned_pool_gb"
    l3 = with_overrides(TierConfig(), l3_nvme={"enabled": True, "path": str(tmp_path / "l3"), "capacity_gb": 1e9})
    with pytest.raises(ConfigError) as err:
        l3.check_fits()
    assert err.value.path == "kv_cache_tiered.l3_nvme.capacity_gb"
    TierConfig().check_fits()  # the defaults fit any machine this runs on


def test_yaml_syntax_error_has_line(tmp_path):
    # The seed template writes alert windows as `- window: 5m, threshold: 800ms`, which is not YAML.
    path = tmp_path / "tiers.yaml"
    path.write_text(
        "kv_cache_tiered:\n  observability:\n    burn_rate_alerts:\n      p99_latency_ms:\n"
        "        - window: 5m, threshold: 800ms\n"
    )
    with pytest.raises(ConfigError) as err:
        load_config(path)
    assert err.value.path.startswith(f"{path}:5:")


def test_alert_rules_and_span_aliases(tmp_path):
    path = tmp_path / "tiers.yaml"
    path.write_text(
        "kv_cache_tiered:\n  observability:\n    span_fields: [layer_id, from_layer, to_layer]\n"
        "    burn_rate_alerts:\n"
        "      p99_latency_ms:\n        - {window: 5m, threshold: 800ms}\n        - {window: 1h, threshold: 1s}\n"
        "      hit_rate_hbm:\n        - {window: 30m, below: 0.6}\n"
        "      swap_eviction_rate_per_sec:\n        - {window: 15m, above: 10000}\n"
    )
    obs = load_config(path).observability
    assert obs.span_fields == ("layer_id", "from_tier", "to_tier")
    assert [(r.window, r.threshold) for r in obs.burn_rate_alerts.p99_latency_ms] == [("5m", 800.0), ("1h", 1000.0)]
    assert obs.burn_rate_alerts.hit_rate_hbm[0].threshold == 0.6
    assert obs.burn_rate_alerts.swap_eviction_rate_per_sec[0].threshold == 10000.0


@pytest.mark.parametrize(
    ("name", "rule", "path"),
    [
        ("hit_rate_hbm", {"window": "30m", "above": 0.6}, "hit_rate_hbm[0].above"),
        ("p99_latency_ms", {"window": "5 minutes", "threshold": 800}, "p99_latency_ms[0].window"),
        ("p99_latency_ms", {"threshold": 800}, "p99_latency_ms[0]"),
        ("swap_eviction_rate_per_sec", {"window": "15m", "above": "lots"}, "swap_eviction_rate_per_sec[0].above"),
    ],
)
def test_bad_alert_rules_are_named(name, rule, path):
    with pytest.raises(ConfigError) as err:
        parse_config(doc("observability", {"burn_rate_alerts": {name: [rule]}}))
    assert err.value.path == f"kv_cache_tiered.observability.burn_rate_alerts.{path}"


def test_top_level_must_be_kv_cache_tiered():
    with pytest.raises(ConfigError) as err:
        parse_config({"kv_cache": {}})
    assert err.value.path == "kv_cache"
    with pytest.raises(ConfigError, match="no tier is enabled"):
        parse_config({"kv_cache_tiered": {"l1_hbm": {"enabled": False}, "l2_dram": {"enabled": False}}})


FLOATS = [(section, name) for section, name, kind in SCALARS if kind == "float"]


@pytest.mark.parametrize("text", [".nan", ".inf", "-.inf"])
@pytest.mark.parametrize(("section", "name"), FLOATS)
def test_non_finite_numbers_are_named(section, name, text):
    """YAML's .nan and .inf are floats: each float field refuses them naming the field (NaN passed every range
    check, and a NaN or infinite capacity crashed later turning GiB into chunks)."""
    with pytest.raises(ConfigError) as err:
        parse_config(yaml.safe_load(f"kv_cache_tiered:\n  {section}:\n    {name}: {text}\n"))
    assert err.value.path == f"kv_cache_tiered.{section}.{name}"
    assert "finite" in str(err.value)


@pytest.mark.parametrize(
    ("config", "path", "words"),
    [
        (lambda: TierConfig(l2_dram=dataclasses.replace(TierConfig().l2_dram, pinned_pool_gb=float("nan"))),
         "kv_cache_tiered.l2_dram.pinned_pool_gb", "finite"),
        (lambda: TierConfig(l1_hbm=dataclasses.replace(TierConfig().l1_hbm, block_pool_size=-5)),
         "kv_cache_tiered.l1_hbm.block_pool_size", "greater than 0"),
        (lambda: TierConfig(l1_hbm=dataclasses.replace(TierConfig().l1_hbm, block_pool_size="8")),
         "kv_cache_tiered.l1_hbm.block_pool_size", "expected an integer"),
        (lambda: {"kv_cache_tiered": {"l2_dram": {"pinned_pool_gb": -1}}},
         "kv_cache_tiered.l2_dram.pinned_pool_gb", "greater than 0"),
        (lambda: 5, "kv_cache_tiered", "expected a TierConfig or a mapping"),
    ],
)  # fmt: skip
def test_the_cache_checks_the_config_it_is_given(config, path, words):
    """TieredCache checks what it is handed as a file is checked: a TierConfig built in code with bad values,
    or a mapping (before: numpy's "negative dimensions", a TypeError adding str to int, float NaN to integer,
    or AttributeError "'dict' object has no attribute 'l1_hbm'")."""
    from datamover.policy.cache import TieredCache

    with pytest.raises(ConfigError) as err:
        TieredCache(config())
    assert err.value.path == path and words in str(err.value)


def test_the_cache_takes_a_mapping():
    from datamover.policy.cache import TieredCache

    cache = TieredCache({"kv_cache_tiered": {"l1_hbm": {"device": "dram", "block_pool_size": 8}}})
    try:
        assert cache.config.l1_hbm.block_pool_size == 8
    finally:
        cache.close()


def alias_bomb(depth: int) -> str:
    """A YAML flow sequence of 9**depth items in a few hundred bytes: each level is nine aliases of the last."""
    text = "&a0 [" + ", ".join(["x"] * 9) + "]"
    for d in range(1, depth):
        text = f"&a{d} [{text}, " + ", ".join([f"*a{d - 1}"] * 8) + "]"
    return text


BOMB = alias_bomb(6)  # nine deep took 38 s and a MemoryError; six (531,441 items) keeps the test quick either way


@pytest.mark.parametrize(
    ("where", "path"),
    [
        ("l1_hbm: {}", "l1_hbm"),
        ("l1_hbm: {block_pool_size: %s}", "l1_hbm.block_pool_size"),
        ("observability: {span_exporter: %s}", "observability.span_exporter"),
        ("observability: {burn_rate_alerts: {hit_rate_hbm: [%s]}}", "observability.burn_rate_alerts.hit_rate_hbm[0]"),
        (
            "observability: {burn_rate_alerts: {hit_rate_hbm: [{window: %s, threshold: 1}]}}",
            "observability.burn_rate_alerts.hit_rate_hbm[0].window",
        ),
    ],
)
def test_a_huge_value_is_quoted_short(tmp_path, where, path):
    """A value YAML aliases blow up was quoted whole in the error: gigabytes, nine aliases deep."""
    file = tmp_path / "bomb.yaml"
    file.write_text("kv_cache_tiered:\n  " + (where % BOMB if "%s" in where else where.replace("{}", BOMB)) + "\n")
    with pytest.raises(ConfigError) as err:
        load_config(file)
    assert err.value.path == f"kv_cache_tiered.{path}"
    assert len(str(err.value)) < 400


@pytest.mark.parametrize(
    ("text", "said"),
    [
        (b"kv_cache_tiered:\n  l1_hbm: {block_pool_size: \xff}\n", "not UTF-8 text: byte 0xff at offset 45"),
        (b"kv_cache_tiered: " + b"[" * 20_000 + b"]" * 20_000 + b"\n", "YAML nested too deeply"),
        (b"kv_cache_tiered:\n  l1_hbm: {block_pool_size: 1" + b"0" * 5000 + b"}\n", "a value YAML cannot build"),
        (b"kv_cache_tiered:\n  observability: {span_path: 2001-02-30}\n", "a value YAML cannot build: day is out"),
    ],
)
def test_a_file_yaml_cannot_build_is_named(tmp_path, text, said):
    """Were a UnicodeDecodeError, a RecursionError and ValueErrors from YAML's constructors, file unnamed."""
    path = tmp_path / "bad.yaml"
    path.write_bytes(text)
    with pytest.raises(ConfigError) as err:
        load_config(path)
    assert err.value.path == str(path) and said in str(err.value)


@pytest.mark.parametrize(
    ("section", "name"),
    [("l2_dram", "pinned_pool_gb"), ("l3_nvme", "capacity_gb"), ("l4_pool", "capacity_gb"), ("l4_pool", "segment_gb")],
)
@pytest.mark.parametrize("gb", [1e308, 1e300, 2.0**34 + 1])
def test_a_size_past_2_to_the_64_bytes_is_named(section, name, gb):
    """1e308 GiB was an OverflowError (bytes as float: infinity) while the config was checked, enabled or not."""
    values = {name: gb, **({"backend": "mooncake"} if name == "segment_gb" else {})}
    with pytest.raises(ConfigError, match="must be at most") as err:
        parse_config(doc(section, values))
    assert err.value.path == f"kv_cache_tiered.{section}.{name}"
    assert parse_config(doc(section, {**values, name: 2.0**34})).tier(section) is not None


@pytest.mark.parametrize("item", [["layer_id"], {"layer_id": 1}, 7, None])
def test_a_span_field_that_is_not_a_name_is_named(item):
    """A list or mapping was a TypeError (unhashable type) from the alias lookup."""
    with pytest.raises(ConfigError, match="unknown span field") as err:
        parse_config(doc("observability", {"span_fields": ["head_id", item]}))
    assert err.value.path == "kv_cache_tiered.observability.span_fields[1]"


@pytest.mark.parametrize(
    ("name", "rule", "path"),
    [
        ("p99_latency_ms", {"window": "5m", "threshold": float("nan")}, "threshold"),  # never fires
        ("p99_latency_ms", {"window": "5m", "threshold": float("inf")}, "threshold"),
        ("p99_latency_ms", {"window": "5m", "threshold": "9" * 400 + "s"}, "threshold"),  # inf ms
        ("p99_latency_ms", {"window": "5m", "threshold": 10**400}, "threshold"),  # was an OverflowError
        ("p99_latency_ms", {"window": "5m", "threshold": -1}, "threshold"),  # always fires
        ("hit_rate_hbm", {"window": "30m", "below": 1.5}, "below"),  # always fires
        ("hit_rate_hbm", {"window": "30m", "threshold": -0.1}, "threshold"),  # never fires
        ("swap_eviction_rate_per_sec", {"window": "15m", "above": -5}, "above"),
        ("hit_rate_hbm", {"window": "0m", "below": 0.5}, "window"),  # Prometheus refuses rate(x[0m])
        ("p99_latency_ms", {"window": "00s", "threshold": 1}, "window"),
    ],
)
def test_alert_thresholds_that_never_or_always_fire_are_named(name, rule, path):
    """Each was taken, and written into a rule that never fires, always fires or Prometheus refuses."""
    with pytest.raises(ConfigError) as err:
        parse_config(doc("observability", {"burn_rate_alerts": {name: [rule]}}))
    assert err.value.path == f"kv_cache_tiered.observability.burn_rate_alerts.{name}[0].{path}"


def test_alert_thresholds_at_their_bounds_are_kept():
    rules = {
        "p99_latency_ms": [{"window": "1s", "threshold": 0}],
        "hit_rate_hbm": [{"window": "1m", "below": 1}, {"window": "2m", "threshold": 0.0}],
        "swap_eviction_rate_per_sec": [{"window": "1d", "above": 1e12}],
    }
    alerts = parse_config(doc("observability", {"burn_rate_alerts": rules})).observability.burn_rate_alerts
    assert [r.threshold for r in alerts.hit_rate_hbm] == [1.0, 0.0]
    assert alerts.p99_latency_ms[0].threshold == 0.0 and alerts.swap_eviction_rate_per_sec[0].threshold == 1e12


@pytest.mark.parametrize("value", ["", "  ", "/var/tmp/a\0b"])
@pytest.mark.parametrize(("section", "name"), [("l3_nvme", "path"), ("observability", "span_path")])
def test_a_path_that_is_no_path_is_named(section, name, value):
    """An empty l3_nvme.path put L3's chunk file in the working directory; a NUL was os's bare ValueError."""
    with pytest.raises(ConfigError, match="is not a file path") as err:
        parse_config(doc(section, {name: value}))
    assert err.value.path == f"kv_cache_tiered.{section}.{name}"


def test_a_key_given_twice_is_named_with_its_line(tmp_path):
    """YAML kept the last of the two silently: an edit of the first did nothing."""
    path = tmp_path / "tiers.yaml"
    path.write_text("kv_cache_tiered:\n  l1_hbm:\n    block_pool_size: 100\n    block_pool_size: 200\n")
    with pytest.raises(ConfigError, match="'block_pool_size' is given twice in one mapping") as err:
        load_config(path)
    assert err.value.path == f"{path}:4:5"
    path.write_text("kv_cache_tiered:\n  l2_dram: {}\n  l2_dram: {enabled: false}\n")
    with pytest.raises(ConfigError, match="'l2_dram' is given twice"):
        load_config(path)
    # a merge key is no repeat, and the keys beside it override what it merges
    path.write_text(
        "kv_cache_tiered:\n  l2_dram: &marks {high_watermark: 0.9, low_watermark: 0.5}\n"
        "  l3_nvme: {<<: *marks, low_watermark: 0.7, enabled: false}\n"
    )
    config = load_config(path)
    assert (config.l3_nvme.high_watermark, config.l3_nvme.low_watermark) == (0.9, 0.7)
