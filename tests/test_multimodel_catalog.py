"""The parts of several-model serving that need no process: the catalog read from flags,
a models folder and the TOML file; the flags a model's process inherits; the memory
estimate; and which idle models are evicted to make room."""

import pytest

from server.multimodel.catalog import build_catalog
from server.multimodel.memory import NoRoom, Resident, estimate_bytes, plan_room
from server.multimodel.serving import check_model_flags
from server.startup.cli import main, serve_parser
from server.startup.flags import UsageError
from server.startup.multimodel_flags import inherited_flags, serves_several

GiB = 2**30


def test_catalog_from_flags_folder_and_config_file(tmp_path) -> None:
    (tmp_path / "dir").mkdir()
    (tmp_path / "dir" / "small.gguf").write_bytes(b"GGUF")
    (tmp_path / "dir" / "coder").mkdir()
    (tmp_path / "dir" / "coder" / "config.json").write_text("{}")
    (tmp_path / "dir" / "notes.txt").write_text("not a model")
    config = tmp_path / "models.toml"
    config.write_text(
        '[models.chat]\nmodel = "dir/coder"\nload_at_start = true\n'
        "flags = { max-model-len = 2048, no-prefix-caching = true, enforce-eager = false, "
        'served-model-name = ["a", "b"] }\n'
    )
    catalog = build_catalog(["/x/other.gguf"], str(tmp_path / "dir"), str(config), False)
    assert sorted(catalog.models) == ["chat", "coder", "other", "small"]
    chat = catalog.models["chat"]
    assert chat.source == str(tmp_path / "dir" / "coder") and chat.load_at_start
    assert chat.flags == (
        "--max-model-len", "2048", "--no-prefix-caching", "--served-model-name", "a", "b",
    )  # fmt: skip
    assert not catalog.models["small"].load_at_start


@pytest.mark.parametrize(
    "text, message",
    [
        ("[models.a]\nflags = {}\n", "needs `model`"),
        ('[models.a]\nmodel = "x"\ncolour = 1\n', "unknown keys"),
        ("models = 3\n", "no [models.NAME] table"),
        ("[models.a\n", "cannot be read"),
        ('[models.a]\nmodel = "x"\nflags = { k = { a = 1 } }\n', "takes a value"),
    ],
)
def test_a_bad_config_file_is_one_sentence(tmp_path, text, message) -> None:
    (tmp_path / "m.toml").write_text(text)
    with pytest.raises(UsageError, match=message.replace("[", r"\[")):
        build_catalog([], None, str(tmp_path / "m.toml"), False)


def test_two_files_with_one_name_are_refused() -> None:
    with pytest.raises(UsageError, match="already taken"):
        build_catalog(["/a/m.gguf", "/b/m.gguf"], None, None, False)


def test_a_models_process_inherits_all_but_the_fronts_flags() -> None:
    argv = [
        "--model", "a", "--model=b", "--port", "9000", "--threads", "1", "--api-key", "k1",
        "k2", "--dtype=float32", "--no-prefix-caching", "--models-max", "2", "--lora-modules",
        "x=/p", "y=/q", "--served-model-name", "n", "--max-model-len", "512",
    ]  # fmt: skip
    assert inherited_flags(argv, serve_parser()) == (
        "--threads", "1", "--dtype=float32", "--no-prefix-caching", "--lora-modules", "x=/p",
        "y=/q", "--max-model-len", "512",
    )  # fmt: skip
    args = serve_parser().parse_args(argv)
    assert serves_several(args)
    assert not serves_several(serve_parser().parse_args(["--model", "a"]))


def test_a_wrong_per_model_flag_stops_the_start_naming_the_model(tmp_path) -> None:
    (tmp_path / "m.toml").write_text(
        '[models.coder]\nmodel = "x"\nflags = { max-num-seqs = "many" }\n'
    )
    catalog = build_catalog([], None, str(tmp_path / "m.toml"), False)
    with pytest.raises(UsageError, match="model coder: .*max-num-seqs"):
        check_model_flags(catalog, ("--threads", "1"), serve_parser)


def test_several_models_are_for_serve_alone(capsys) -> None:
    assert main(["generate", "hi", "--model", "a", "--model", "b"]) == 2
    assert "several are for `serve`" in capsys.readouterr().err


def test_the_estimate_is_weights_plus_kv_cache_plus_a_process(tmp_path) -> None:
    (tmp_path / "model.gguf").write_bytes(b"\0" * 1000)
    path = str(tmp_path / "model.gguf")
    base = estimate_bytes(path, ["serve", path, "--kv-cache-memory", "1MiB"]) - 1000 - 2**20
    assert base > 100 * 2**20  # a process with torch holds hundreds of MB before any model
    assert estimate_bytes(path, ["serve", path]) == base + 1000 + 2 * GiB  # the CPU default
    assert estimate_bytes(path, ["serve", path, "--task", "embed"]) == base + 1000


def resident(name: str, gib: float, evictable: bool, last_used: float) -> Resident:
    return Resident(name, int(gib * GiB), evictable, last_used)


def test_room_is_made_from_the_least_recently_used_idle_models() -> None:
    residents = [
        resident("old", 2, True, 1.0),
        resident("busy", 2, False, 0.0),  # older still, but a request is in flight
        resident("recent", 2, True, 5.0),
    ]
    assert plan_room(GiB, 10 * GiB, residents, None) == []
    assert plan_room(GiB, 10 * GiB, residents, 3) == ["old"]  # --models-max
    assert plan_room(5 * GiB, 10 * GiB, residents, None) == ["old"]
    assert plan_room(7 * GiB, 10 * GiB, residents, None) == ["old", "recent"]
    with pytest.raises(NoRoom, match="in use hold"):
        plan_room(9 * GiB, 10 * GiB, residents, None)  # the busy one cannot go
    with pytest.raises(NoRoom, match="whole budget"):
        plan_room(11 * GiB, 10 * GiB, [], None)
    with pytest.raises(NoRoom, match="in flight"):
        plan_room(GiB, 10 * GiB, [resident("busy", 1, False, 0.0)], 1)
