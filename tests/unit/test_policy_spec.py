"""``PolicySpec.parse``: the one parser of policy strings (round trip and every error)."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from hybridkv import CacheConfig, FullAttentionSpec, KVCacheManager, RecurrentStateSpec
from hybridkv.errors import ConfigError
from hybridkv.eviction import EvictionOptions
from hybridkv.policies import (
    BLOCK_CHECKPOINTS,
    CHUNK_CHECKPOINTS,
    PolicySpec,
    policy_name,
)

RETENTIONS = ("dense", "reachable", "prepend", "latest", "bounded-replay", "interval:32768",
              "pin:4096")
COMPONENTS = ("scan", "chain", "session", "predict", "flops")
CHECKPOINTS = ("ckpt:chunk", "ckpt:block", "ckpt:branch", "ckpt:branch:32")


def test_parse_reads_every_part() -> None:
    spec = PolicySpec.parse(" interval:32768 + predict + recompute + ckpt:block + scan ")
    assert spec == PolicySpec("interval:32768", EvictionOptions(scan=True, predict=True),
                              True, BLOCK_CHECKPOINTS)
    assert spec.name == "interval:32768+scan+predict+recompute+ckpt:block"
    assert PolicySpec.parse("latest") == PolicySpec("latest", None, False, CHUNK_CHECKPOINTS)


def test_lru_and_the_default_checkpoints_name_nothing() -> None:
    assert PolicySpec.parse("latest+lru+ckpt:chunk") == PolicySpec.parse("latest")
    assert PolicySpec.parse("latest+lru+ckpt:chunk").name == "latest"


def test_the_last_checkpoint_policy_applies() -> None:
    assert PolicySpec.parse("latest+ckpt:block+ckpt:branch:32").checkpoints == "ckpt:branch:32"


def test_retention_policy_is_built_fresh() -> None:
    spec = PolicySpec.parse("pin:4096+chain")
    first, second = spec.retention_policy(), spec.retention_policy()
    assert first is not second
    assert first.name == second.name == "pin:4096"


@given(retention=st.sampled_from(RETENTIONS),
       components=st.lists(st.sampled_from((*COMPONENTS, "lru")), max_size=4, unique=True),
       recompute=st.booleans(), checkpoints=st.lists(st.sampled_from(CHECKPOINTS), max_size=2),
       order=st.randoms(use_true_random=False))
def test_round_trip(retention: str, components: list[str], recompute: bool,
                    checkpoints: list[str], order: object) -> None:
    modifiers = [*components, *(["recompute"] if recompute else [])]
    order.shuffle(modifiers)  # type: ignore[attr-defined]
    text = "+".join([retention, *modifiers, *checkpoints])
    spec = PolicySpec.parse(text)
    assert PolicySpec.parse(spec.name) == spec
    assert PolicySpec.parse(spec.name).name == spec.name
    assert spec.recompute == recompute
    assert spec.checkpoints == (checkpoints[-1] if checkpoints else CHUNK_CHECKPOINTS)
    named = {c for c in components if c != "lru"}
    assert (spec.eviction.name.split("+") if spec.eviction else []) == \
        [c for c in COMPONENTS if c in named]


def test_the_manager_reports_the_canonical_name() -> None:
    config = CacheConfig.from_layers([FullAttentionSpec(4, 1), RecurrentStateSpec(4, 8)], 64)
    for text in ("latest", "interval:32+recompute+chain", "prepend+ckpt:block+lru+scan"):
        spec = PolicySpec.parse(text)
        assert KVCacheManager(config, text).policy_name == spec.name
        assert KVCacheManager(config, spec).policy_name == spec.name
    assert policy_name("latest", EvictionOptions(), False, CHUNK_CHECKPOINTS) == "latest"


def test_an_eviction_argument_applies_when_the_string_names_none() -> None:
    config = CacheConfig.from_layers([FullAttentionSpec(4, 1)], 64)
    scan = EvictionOptions(scan=True)
    assert KVCacheManager(config, "latest+lru", scan).policy_name == "latest+scan"
    assert KVCacheManager(config, "latest+chain", scan).policy_name == "latest+chain"


@pytest.mark.parametrize(("text", "message"), [
    ("lateste", "policy='lateste' is invalid: choose one of dense, reachable, prepend, latest, "
                "interval:N, pin:T, bounded-replay"),
    ("", "policy='' is invalid: choose one of dense, reachable, prepend, latest, "
         "interval:N, pin:T, bounded-replay"),
    ("interval:x+scan", "policy='interval:x' is invalid: interval needs a token count, "
                        "e.g. interval:32768"),
    ("pin:", "policy='pin:' is invalid: pin needs a token count, e.g. pin:32768"),
    ("pin:0", "pin=0 is invalid: must be a positive number of tokens, e.g. pin:32768"),
    ("latest+ckpt:often", "policy='ckpt:often' is invalid: unknown checkpoint policy; choose "
                          "ckpt:chunk, ckpt:block, ckpt:branch or ckpt:branch:U (U = hit unit "
                          "in tokens, e.g. ckpt:branch:16)"),
    ("latest+ckpt:branch:0", "policy='ckpt:branch:0' is invalid: unknown checkpoint policy"),
    ("latest+sacn", "policy='sacn' is invalid: unknown eviction policy; choose from lru, scan, "
                    "chain, session, predict, flops"),
    ("latest+", "policy='' is invalid: unknown eviction policy"),
    ("latest+ckpt:block+recompute+chain+x", "policy='x' is invalid: unknown eviction policy"),
    ("latest+predict+predict", "policy='predict' is invalid: is given twice"),
    ("latest+recompute+chain+ recompute", "policy='recompute' is invalid: is given twice"),
])
def test_every_error_names_the_part(text: str, message: str) -> None:
    with pytest.raises(ConfigError) as caught:
        PolicySpec.parse(text)
    assert str(caught.value).startswith(message)
