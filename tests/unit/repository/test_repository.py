"""Version policy, model names and version lookup of the repository manager."""

from __future__ import annotations

import shutil
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from kiln.config.loader import parse_config_text
from kiln.core.errors import KilnError, Status
from kiln.repository.manager import (
    RepositoryManager,
    check_model_name,
    select_versions,
    version_dirs,
)
from kiln.server.runtime import runtime_factory

AVAILABLE = [1, 2, 3, 7]


@pytest.mark.parametrize(
    ("policy", "expected"),
    [
        ("", [7]),  # default: latest 1
        ("version_policy { latest { num_versions: 2 } }", [3, 7]),
        ("version_policy { latest { num_versions: 10 } }", AVAILABLE),
        ("version_policy { all { } }", AVAILABLE),
        ("version_policy { specific { versions: [ 2, 1 ] } }", [1, 2]),
    ],
)
def test_select_versions(policy: str, expected: list[int]) -> None:
    cfg = parse_config_text(f'name: "m"\n{policy}')
    assert select_versions(cfg, list(reversed(AVAILABLE))) == expected


def test_specific_version_without_folder() -> None:
    cfg = parse_config_text('name: "m"\nversion_policy { specific { versions: [ 2, 5, 9 ] } }')
    with pytest.raises(KilnError) as info:
        select_versions(cfg, AVAILABLE)
    assert info.value.status is Status.INVALID_ARG
    assert "'m'" in info.value.message and "[5, 9]" in info.value.message


def test_version_dirs_ignore_non_numeric_and_leading_zero(tmp_path: Path) -> None:
    for name in ("1", "3", "003", "x", "0"):
        (tmp_path / name).mkdir()
    assert sorted(version_dirs(tmp_path)) == [0, 1, 3]


@pytest.mark.parametrize(
    "name",
    ["", ".", "..", ".hidden", "../etc", "a/b", "a\\b", "x\x00y", "a" * 256, "ünïcode", "a b"],
)
def test_check_model_name_refuses_escapes(name: str) -> None:
    with pytest.raises(KilnError) as info:
        check_model_name(name)
    assert info.value.status is Status.INVALID_ARG
    assert "invalid model name" in info.value.message


@pytest.mark.parametrize("name", ["simple", "my-model_2", "a.b", "a" * 255])
def test_check_model_name_accepts_folder_names(name: str) -> None:
    check_model_name(name)


@pytest.fixture
async def versioned(example_repo: Path, tmp_path: Path) -> AsyncIterator[RepositoryManager]:
    """``simple`` with versions 1, 2 and 3, serving the latest two."""
    model = tmp_path / "simple"
    shutil.copytree(example_repo / "simple", model)
    for v in (2, 3):
        shutil.copytree(model / "1", model / str(v))
    cfg = model / "config.pbtxt"
    cfg.write_text(cfg.read_text() + "version_policy { latest { num_versions: 2 } }\n")
    repo = RepositoryManager([tmp_path], runtime_factory())
    await repo.load("simple")
    yield repo
    await repo.unload_all()


async def test_lookup_by_version(versioned: RepositoryManager) -> None:
    assert versioned.get("simple").version == 3  # highest ready
    assert versioned.get("simple", "2").version == 2
    rows = versioned.index()
    assert [(r["version"], r["state"]) for r in rows] == [("2", "READY"), ("3", "READY")]


@pytest.mark.parametrize(
    ("name", "version", "status", "words"),
    [
        ("simple", "1", Status.NOT_FOUND, "'simple' version 1 is not found"),
        ("simple", "x", Status.INVALID_ARG, "must be an integer"),
        ("other", "", Status.NOT_FOUND, "Request for unknown model: 'other'"),
    ],
)
async def test_lookup_errors(
    versioned: RepositoryManager, name: str, version: str, status: Status, words: str
) -> None:
    with pytest.raises(KilnError) as info:
        versioned.get(name, version)
    assert info.value.status is status and words in info.value.message


async def test_failed_load_of_unknown_model_leaves_no_index_row(
    versioned: RepositoryManager,
) -> None:
    with pytest.raises(KilnError) as info:
        await versioned.load("nope")
    assert info.value.status is Status.NOT_FOUND
    assert "failed to load 'nope'" in info.value.message
    assert [r["name"] for r in versioned.index()] == ["simple", "simple"]


async def test_unload_then_index(versioned: RepositoryManager) -> None:
    await versioned.unload("simple")
    assert versioned.index() == [
        {"name": "simple", "version": "", "state": "UNAVAILABLE", "reason": "unloaded"}
    ]
    with pytest.raises(KilnError) as info:
        versioned.get("simple")
    assert info.value.status is Status.NOT_FOUND


# ---- unload_dependents: an ensemble's composing models go with it -------------------------
def _ensemble(name: str, first: str, second: str) -> str:
    """INPUT0/INPUT1 through ``first`` (add, sub), then ``second`` on its outputs."""
    io = "data_type: TYPE_INT32 dims: [ 16 ]"
    return f"""
name: "{name}"
platform: "ensemble"
max_batch_size: 8
input [ {{ name: "INPUT0" {io} }}, {{ name: "INPUT1" {io} }} ]
output [ {{ name: "OUTPUT0" {io} }}, {{ name: "OUTPUT1" {io} }} ]
ensemble_scheduling {{ step [
  {{ model_name: "{first}" model_version: -1
     input_map {{ key: "INPUT0" value: "INPUT0" }} input_map {{ key: "INPUT1" value: "INPUT1" }}
     output_map {{ key: "OUTPUT0" value: "s" }} output_map {{ key: "OUTPUT1" value: "d" }} }},
  {{ model_name: "{second}" model_version: -1
     input_map {{ key: "INPUT0" value: "s" }} input_map {{ key: "INPUT1" value: "d" }}
     output_map {{ key: "OUTPUT0" value: "OUTPUT0" }}
     output_map {{ key: "OUTPUT1" value: "OUTPUT1" }} }}
] }}
"""


@pytest.fixture
async def ensembles(example_repo: Path, tmp_path: Path) -> AsyncIterator[RepositoryManager]:
    """Copies of ``simple`` named shared, first_only, second_only and by_name; ensembles
    ``first`` (shared -> first_only), ``second`` (shared -> second_only), ``third``
    (by_name twice) and ``outer`` (the ensemble ``first`` -> second_only)."""
    for model in ("shared", "first_only", "second_only", "by_name"):
        shutil.copytree(example_repo / "simple", tmp_path / model)
        config = tmp_path / model / "config.pbtxt"
        config.write_text(config.read_text().replace('name: "simple"', f'name: "{model}"'))
    for name, steps in {"first": ("shared", "first_only"),
                        "second": ("shared", "second_only"),
                        "third": ("by_name", "by_name"),
                        "outer": ("first", "second_only")}.items():  # fmt: skip
        (tmp_path / name / "1").mkdir(parents=True)
        (tmp_path / name / "config.pbtxt").write_text(_ensemble(name, *steps))
    repo = RepositoryManager([tmp_path], runtime_factory())
    yield repo
    await repo.unload_all()


def _ready(repo: RepositoryManager) -> set[str]:
    return {row["name"] for row in repo.index() if row["state"] == "READY"}


async def test_unload_dependents_unloads_what_only_the_ensemble_loaded(
    ensembles: RepositoryManager,
) -> None:
    await ensembles.load("first")
    await ensembles.load("second")
    assert _ready(ensembles) == {"first", "second", "shared", "first_only", "second_only"}
    await ensembles.unload("first", unload_dependents=True)
    # first_only went with it; shared stays: the loaded "second" still uses it
    assert _ready(ensembles) == {"second", "shared", "second_only"}
    await ensembles.unload("second", unload_dependents=True)
    assert _ready(ensembles) == set()


async def test_unload_dependents_keeps_models_loaded_by_name(
    ensembles: RepositoryManager,
) -> None:
    await ensembles.load("by_name")
    await ensembles.load("third")
    await ensembles.load("first")
    await ensembles.load("first_only")  # loaded again by its own name: no longer a dependency
    await ensembles.unload("third", unload_dependents=True)
    await ensembles.unload("first", unload_dependents=True)
    assert _ready(ensembles) == {"by_name", "first_only"}


async def test_unload_without_dependents_leaves_the_composing_models(
    ensembles: RepositoryManager,
) -> None:
    await ensembles.load("first")
    await ensembles.unload("first")
    assert _ready(ensembles) == {"shared", "first_only"}
    # a later unload of the ensemble with dependents finds it unloaded: nothing else moves
    await ensembles.unload("first", unload_dependents=True)
    assert _ready(ensembles) == {"shared", "first_only"}


async def test_unload_dependents_goes_down_nested_ensembles(ensembles: RepositoryManager) -> None:
    await ensembles.load("outer")  # brings first, which brings shared and first_only
    assert _ready(ensembles) == {"outer", "first", "shared", "first_only", "second_only"}
    await ensembles.unload("outer", unload_dependents=True)
    assert _ready(ensembles) == set()
