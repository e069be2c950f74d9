"""Tests for the strict target-file loader (ipubuild/targets.py)."""

from __future__ import annotations

import tomllib
from pathlib import Path

import pytest
import tomli_w
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ipubuild.errors import UserError
from ipubuild.targets import (
    CORE_SCHEMA,
    Field,
    check_table,
    discover,
    dump_resolved,
    load_target,
)

ROOT = Path(__file__).resolve().parents[1]

GOOD = """\
[target]
tile_count = 64
device = "ipumodel"

[model]
family = "vit"
width = 192

[casts]
policy = "f143"
"""

KNOWN = {"device": ["ipumodel"], "policy": ["f143", "f152"], "family": ["vit"]}


def _write(tmp_path: Path, text: str | bytes, name: str = "bad.toml") -> str:
    """Write a target under tmp_path/targets and return its path relative to tmp_path."""
    (tmp_path / "targets").mkdir(exist_ok=True)
    p = tmp_path / "targets" / name
    p.write_bytes(text if isinstance(text, bytes) else text.encode("utf-8"))
    return f"targets/{name}"


@pytest.fixture
def in_tmp(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    return tmp_path


# --- the real target file -------------------------------------------------------------------


def test_real_target_loads(monkeypatch):
    monkeypatch.chdir(ROOT)
    t = load_target("targets/vit_fp8.toml")
    assert t["name"] == "vit_fp8"
    assert t["path"] == "targets/vit_fp8.toml"
    assert t["target"] == {"tile_count": 64, "machine": "ipu21", "device": "ipumodel", "seed": 0, "default": True}
    assert t["model"] == {
        "family": "vit", "passes": ["fold_activations", "fold_adds"], "image_size": 224, "channels": 3,
        "patch": 16, "width": 192,
        "heads": 3, "mlp": 768, "blocks": 1, "classes": 1000,
    }
    assert t["casts"] == {
        "policy": "f143", "scaling": "amax_pow2",
        "fuse": ["attention_context", "gelu", "layernorm", "matmul", "patchify", "slice_rows", "softmax"],
        "storage": {"default": "separate", "operators": {}, "sites": {}},
    }
    assert t["numerics"] == {"min_cosine": 0.999, "max_abs_error": 0.15, "blas_threads": 1, "compare": "auto"}
    assert t["search"] == {
        "rounds": 3, "shortlist": 3, "workers": 2, "evaluations": 100, "seed": 0, "proposals": 640,
    }
    assert t["profile"] == {"kernel_counts": "auto"}
    assert list(t) == ["name", "path", "target", "model", "casts", "numerics", "profile", "search"]


def test_real_target_loads_with_known_names():
    t = load_target(ROOT / "targets" / "vit_fp8.toml", known=KNOWN)
    assert t["path"] == str(ROOT / "targets" / "vit_fp8.toml")


def test_dump_resolved_round_trips():
    t = load_target(ROOT / "targets" / "vit_fp8.toml")
    blob = dump_resolved(t)
    assert isinstance(blob, bytes)
    back = tomllib.loads(blob.decode("utf-8"))
    assert set(back) == {"target", "model", "casts", "numerics", "profile", "search"}
    for section in back:
        assert back[section] == t[section]
    assert dump_resolved(t) == blob  # deterministic
    # sorted keys regardless of input order
    shuffled = {k: dict(reversed(list(v.items()))) if isinstance(v, dict) else v for k, v in t.items()}
    assert dump_resolved(dict(reversed(list(shuffled.items())))) == blob


def test_dumped_target_reloads_identically(in_tmp):
    t = load_target(ROOT / "targets" / "vit_fp8.toml")
    rel = _write(in_tmp, dump_resolved(t), "vit_fp8.toml")
    again = load_target(rel)
    assert {k: v for k, v in again.items() if k != "path"} == {
        k: v for k, v in t.items() if k != "path"
    }


def test_defaults_filled_and_order(in_tmp):
    rel = _write(in_tmp, "[target]\ntile_count = 1\n[model]\nfamily = 'vit'\n", "min.toml")
    t = load_target(rel)
    assert t["target"] == {"tile_count": 1, "machine": "ipu21", "device": "ipumodel", "seed": 0,
                           "default": True}
    assert t["model"] == {"family": "vit", "passes": []}
    assert t["casts"]["storage"] == {"default": "separate", "operators": {}, "sites": {}}
    assert t["search"]["proposals"] == 640
    assert list(t["search"]) == [k for k in CORE_SCHEMA["search"] if k != "seconds"]   # read, ignored


def test_max_tiles_argument(in_tmp):
    rel = _write(in_tmp, GOOD, "ok.toml")
    assert load_target(rel, max_tiles=64)["target"]["tile_count"] == 64
    with pytest.raises(UserError) as ei:
        load_target(rel, max_tiles=32)
    assert ei.value.where == f"{rel}: target.tile_count"
    assert "expected an integer from 1 to 32, got 64" in ei.value.message


def test_storage_overrides_accepted(in_tmp):
    text = GOOD + '[casts.storage]\ndefault = "inplace"\noperators = { matmul = "inplace" }\n' \
                  'sites = { "block0.attn.q" = "separate" }\n'
    t = load_target(_write(in_tmp, text, "st.toml"))
    assert t["casts"]["storage"] == {
        "default": "inplace", "operators": {"matmul": "inplace"}, "sites": {"block0.attn.q": "separate"},
    }


def test_discover(tmp_path):
    for name in ("b.toml", "a.toml", "notes.txt"):
        _write(tmp_path, GOOD, name)
    assert discover(tmp_path) == [tmp_path / "targets" / "a.toml", tmp_path / "targets" / "b.toml"]
    assert discover(tmp_path / "nowhere") == []


# --- check_table directly (as model plugins use it) ---------------------------------------------

MODEL_SCHEMA = {
    "family": Field(str),
    "width": Field(int, min=1, doc="embedding width"),
    "dropout": Field(float, 0.0, min=0, max=1),
    "tags": Field("list_str", []),
    "bias": Field(bool, True),
}


def test_check_table_fills_defaults_new_dict():
    table = {"width": 8, "family": "vit", "dropout": 0}
    out = check_table(table, MODEL_SCHEMA, "targets/m.toml", "model")
    assert out == {"family": "vit", "width": 8, "dropout": 0.0, "tags": [], "bias": True}
    assert list(out) == list(MODEL_SCHEMA)
    assert out is not table and table == {"width": 8, "family": "vit", "dropout": 0}
    assert isinstance(out["dropout"], float)
    out["tags"].append("x")
    assert check_table(table, MODEL_SCHEMA, "f", "model")["tags"] == []  # defaults not shared


@pytest.mark.parametrize(
    "table, key, fragment",
    [
        ({"family": "vit", "width": 8, "depth": 2}, "model.depth", "known keys: family, width, dropout, tags, bias"),
        ({"family": "vit"}, "model.width", "missing required key"),
        ({"family": "vit", "width": True}, "model.width", "expected an integer >= 1, got true"),
        ({"family": "vit", "width": 8, "bias": 1}, "model.bias", "expected true or false, got 1"),
        ({"family": "vit", "width": 8, "tags": ["a", 3]}, "model.tags[1]", "expected a string, got 3"),
        ({"family": "vit", "width": 8, "dropout": True}, "model.dropout", "expected a number"),
        ({"family": "vit", "width": 8, "dropout": float("nan")}, "model.dropout", "expected a number"),
        ({"family": 3, "width": 8}, "model.family", "expected a string, got 3"),
    ],
)
def test_check_table_errors(table, key, fragment):
    with pytest.raises(UserError) as ei:
        check_table(table, MODEL_SCHEMA, "targets/m.toml", "model")
    assert ei.value.where == f"targets/m.toml: {key}"
    assert fragment in ei.value.message
    assert "\n" not in str(ei.value)


# --- malformed targets ------------------------------------------------------------------------


def _good_with(section: str, line: str) -> str:
    """GOOD with ``line`` added to ``[section]`` (appended as a new table if GOOD lacks it)."""
    header = f"[{section}]\n"
    if header in GOOD:
        return GOOD.replace(header, header + line + "\n", 1)
    return GOOD + "\n" + header + line + "\n"


MALFORMED = [
    # id, file name, content, key (None: file only), message fragment, known
    ("syntax", "bad.toml", "[target\ntile_count = 64\n", None, "not valid TOML: ", None),
    ("syntax-line-col", "bad.toml", "[target]\ntile_count = = 64\n", None, "(at line 2, column", None),
    ("empty", "bad.toml", "", None, "no [target] table; see targets/vit_fp8.toml", None),
    ("only-comments", "bad.toml", "# nothing here\n\n", None, "no [target] table", None),
    ("non-utf8", "bad.toml", b"[target]\ntile_count = 64 # \xff\xfe\n", None, "not valid TOML", None),
    ("missing-target", "bad.toml", "[model]\nfamily = 'vit'\n", "target", "missing required table [target]", None),
    ("missing-model", "bad.toml", "[target]\ntile_count = 4\n", "model", "missing required table [model]", None),
    ("target-not-table", "bad.toml", "target = 3\n[model]\nfamily='vit'\n", "target", "expected a table, got 3", None),
    ("missing-tile-count", "bad.toml", "[target]\nseed = 1\n[model]\nfamily = 'vit'\n",
     "target.tile_count", "missing required key (expected an integer from 1 to 1472)", None),
    ("missing-family", "bad.toml", "[target]\ntile_count = 4\n[model]\nwidth = 3\n",
     "model.family", "missing required key", None),
    ("tile-count-string", "bad.toml", GOOD.replace("tile_count = 64", 'tile_count = "64"'),
     "target.tile_count", "expected an integer from 1 to 1472, got '64'", None),
    ("tile-count-bool", "bad.toml", GOOD.replace("tile_count = 64", "tile_count = true"),
     "target.tile_count", "expected an integer from 1 to 1472, got true", None),
    ("tile-count-float", "bad.toml", GOOD.replace("tile_count = 64", "tile_count = 64.0"),
     "target.tile_count", "expected an integer from 1 to 1472, got 64.0", None),
    ("tile-count-zero", "bad.toml", GOOD.replace("tile_count = 64", "tile_count = 0"),
     "target.tile_count", "expected an integer from 1 to 1472, got 0", None),
    ("tile-count-negative", "bad.toml", GOOD.replace("tile_count = 64", "tile_count = -3"),
     "target.tile_count", "expected an integer from 1 to 1472, got -3", None),
    ("tile-count-too-big", "bad.toml", GOOD.replace("tile_count = 64", "tile_count = 2000"),
     "target.tile_count", "expected an integer from 1 to 1472, got 2000", None),
    ("target-seed-negative", "bad.toml", _good_with("target", "seed = -1"),
     "target.seed", "expected an integer >= 0, got -1", None),
    ("unknown-section", "bad.toml", GOOD + "\n[serach]\nrounds = 3\n",
     "serach", "unknown section 'serach' (did you mean 'search'?); known sections: target, model, casts, numerics, profile, search", None),
    ("unknown-top-level-key", "bad.toml", "tiles = 4\n" + GOOD, "tiles", "unknown section 'tiles'", None),
    ("unknown-search-key", "bad.toml", _good_with("search", "round = 3"),
     "search.round", "unknown key 'round' (did you mean 'rounds'?); known keys: rounds, shortlist, workers, evaluations, seconds, seed, proposals", None),
    ("unknown-quoted-key", "bad.toml", _good_with("search", '"a\\nb" = 3'),
     'search."a\\nb"', "unknown key 'a\\nb'", None),
    ("kernel-counts-bad", "bad.toml", _good_with("profile", 'kernel_counts = "yes"'),
     "profile.kernel_counts", "'yes'", None),
    ("min-cosine-too-big", "bad.toml", _good_with("numerics", "min_cosine = 1.5"),
     "numerics.min_cosine", "expected a number greater than 0 and at most 1, got 1.5", None),
    ("min-cosine-zero", "bad.toml", _good_with("numerics", "min_cosine = 0"),
     "numerics.min_cosine", "greater than 0 and at most 1, got 0", None),
    ("min-cosine-nan", "bad.toml", _good_with("numerics", "min_cosine = nan"),
     "numerics.min_cosine", "expected a number greater than 0", None),
    ("max-abs-error-zero", "bad.toml", _good_with("numerics", "max_abs_error = 0"),
     "numerics.max_abs_error", "expected a number greater than 0, got 0", None),
    ("max-abs-error-string", "bad.toml", _good_with("numerics", "max_abs_error = '0.1'"),
     "numerics.max_abs_error", "expected a number greater than 0, got '0.1'", None),
    ("blas-threads-zero", "bad.toml", _good_with("numerics", "blas_threads = 0"),
     "numerics.blas_threads", "expected an integer from 1 to 256, got 0", None),
    ("compare-bad", "bad.toml", _good_with("numerics", 'compare = "ops"'),
     "numerics.compare", "expected one of 'auto', 'operations', 'outputs', got 'ops'", None),
    ("scaling-bad", "bad.toml", _good_with("casts", 'scaling = "max"'),
     "casts.scaling", "expected one of 'amax_pow2', 'none', got 'max'", None),
    ("fuse-unknown", "bad.toml", _good_with("casts", 'fuse = ["add"]'),
     "casts.fuse[0]", "expected one of 'attention_context', 'gelu', 'layernorm', 'matmul', 'patchify', "
     "'slice_rows', 'softmax', got 'add'", None),
    ("storage-default-bad", "bad.toml", GOOD + '[casts.storage]\ndefault = "inplace2"\n',
     "casts.storage.default", "expected one of 'separate', 'inplace', got 'inplace2'", None),
    ("storage-unknown-key", "bad.toml", GOOD + '[casts.storage]\nmode = "inplace"\n',
     "casts.storage.mode", "known keys: default, operators, sites", None),
    ("storage-operators-bad", "bad.toml", GOOD + '[casts.storage.operators]\nmatmul = "fast"\n',
     "casts.storage.operators.matmul", "expected one of 'separate', 'inplace', got 'fast'", None),
    ("storage-operators-not-table", "bad.toml", GOOD + '[casts.storage]\noperators = "inplace"\n',
     "casts.storage.operators", "expected a table of strings", None),
    ("storage-sites-not-string", "bad.toml", GOOD + '[casts.storage.sites]\n"block0.q" = 1\n',
     'casts.storage.sites."block0.q"', "got 1", None),
    ("workers-zero", "bad.toml", _good_with("search", "workers = 0"),
     "search.workers", "expected an integer from 1 to 64, got 0", None),
    ("seconds-negative", "bad.toml", _good_with("search", "seconds = -1.0"),
     "search.seconds", "expected a number >= 0, got -1.0", None),
    ("evaluations-zero", "bad.toml", _good_with("search", "evaluations = 0"),
     "search.evaluations", "expected an integer from 1 to 100000, got 0", None),
    ("unknown-device", "bad.toml", GOOD.replace('device = "ipumodel"', 'device = "foo"'),
     "target.device", "unknown device 'foo'; known: ipumodel", KNOWN),
    ("unknown-policy", "bad.toml", GOOD.replace('policy = "f143"', 'policy = "e5m2"'),
     "casts.policy", "unknown policy 'e5m2'; known: f143, f152", KNOWN),
    ("unknown-family", "bad.toml", GOOD.replace('family = "vit"', 'family = "resnet"'),
     "model.family", "unknown family 'resnet'; known: vit", KNOWN),
    ("deeply-nested", "bad.toml", "x = " + "[" * 5000, None, "not valid TOML", None),
    ("huge-integer", "bad.toml", "x = " + "9" * 5000, None, "not valid TOML", None),
    ("bad-name-space", "bad name.toml", GOOD, None, "target name 'bad name' must match", None),
    ("bad-name-dot", ".hidden.toml", GOOD, None, "target name '.hidden' must match", None),
]


@pytest.mark.parametrize(
    "name, content, key, fragment, known",
    [case[1:] for case in MALFORMED],
    ids=[case[0] for case in MALFORMED],
)
def test_malformed_target(in_tmp, name, content, key, fragment, known):
    rel = _write(in_tmp, content, name)
    with pytest.raises(UserError) as ei:
        load_target(rel, known=known)
    err = ei.value
    assert err.where == (rel if key is None else f"{rel}: {key}")
    assert fragment in err.message, err.message
    assert str(err) == f"{err.where}: {err.message}"
    assert "\n" not in str(err) and "\r" not in str(err)


def test_malformed_table_is_big_enough():
    assert len(MALFORMED) >= 18


def test_missing_file_is_user_error(in_tmp):
    with pytest.raises(UserError) as ei:
        load_target("targets/nope.toml")
    assert ei.value.where == "targets/nope.toml"
    assert "\n" not in str(ei.value)


def test_absolute_path_shown_as_given(tmp_path):
    p = tmp_path / "x.toml"
    p.write_text("[target]\ntile_count = 0\n[model]\nfamily = 'vit'\n")
    with pytest.raises(UserError) as ei:
        load_target(p)
    assert ei.value.where == f"{p}: target.tile_count"


# --- fuzzing: load_target only ever raises UserError --------------------------------------------

_FUZZ_SETTINGS = settings(
    max_examples=150, deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)

_scalars = (
    st.integers(min_value=-(2**63), max_value=2**63 - 1)
    | st.floats()
    | st.booleans()
    | st.text(max_size=8)
    | st.sampled_from(["vit", "ipumodel", "f143", "amax_pow2", "none", "separate", "inplace"])
)
_keys = st.sampled_from(
    ["target", "model", "casts", "numerics", "search", "storage", "operators", "sites", "tile_count",
     "family", "device", "policy", "scaling", "default", "min_cosine", "workers", "seconds", "seed"]
) | st.text(max_size=6)
_values = st.recursive(
    _scalars,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(_keys, inner, max_size=4),
    max_leaves=12,
)
_documents = st.dictionaries(_keys, st.dictionaries(_keys, _values, max_size=5) | _values, max_size=5)
_known = st.none() | st.just(KNOWN)


def _never_crashes(path: str, known) -> None:
    try:
        t = load_target(path, known=known)
    except UserError as err:
        assert "\n" not in str(err)
    else:
        tomllib.loads(dump_resolved(t).decode("utf-8"))


@_FUZZ_SETTINGS
@given(text=st.text(max_size=200), known=_known)
def test_fuzz_arbitrary_text(in_tmp, text, known):
    _never_crashes(_write(in_tmp, text, "fuzz.toml"), known)


@_FUZZ_SETTINGS
@given(text=st.binary(max_size=100))
def test_fuzz_arbitrary_bytes(in_tmp, text):
    _never_crashes(_write(in_tmp, text, "fuzz.toml"), None)


@_FUZZ_SETTINGS
@given(doc=_documents, known=_known)
def test_fuzz_arbitrary_dicts(in_tmp, doc, known):
    _never_crashes(_write(in_tmp, tomli_w.dumps(doc), "fuzz.toml"), known)


@_FUZZ_SETTINGS
@given(
    tile_count=_values, section=st.sampled_from(sorted(CORE_SCHEMA)), key=_keys, value=_values,
    known=_known,
)
def test_fuzz_near_valid(in_tmp, tile_count, section, key, value, known):
    doc = {"target": {"tile_count": tile_count}, "model": {"family": "vit"}}
    doc.setdefault(section, {})[key] = value
    _never_crashes(_write(in_tmp, tomli_w.dumps(doc), "fuzz.toml"), known)


def test_a_wall_clock_budget_of_an_older_file_is_read_and_ignored(in_tmp):
    """``[search] seconds`` (older target files) loads, has no effect and stays out of the
    resolved configuration (so out of every action key): the budget is counted, never timed."""
    old = _good_with("search", "seconds = 120")
    Path("old.toml").write_text(old)
    Path("new.toml").write_text(GOOD)
    with_seconds, without = load_target("old.toml"), load_target("new.toml")
    assert "seconds" not in with_seconds["search"]
    assert with_seconds["search"] == without["search"]
    assert with_seconds["search"]["evaluations"] == 100
