"""Config loading and validation: types, ranges, overrides, did-you-mean, documentation,
round trip. The command-line side (exit codes, one line on stderr) is in test_cli.py."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from mpper import config as cfg
from mpper.algos.configs import ALGORITHM_CONFIGS, config_from_dict, describe_config, field_specs, load_config
from mpper.algos.dqn.config import DQNRunConfig
from mpper.algos.muzero.config import MuZeroRunConfig
from mpper.config import SHARED_SECTIONS, Config, ConfigError, config_to_dict, schema
from mpper.config.engine import value_at
from mpper.config_files import read_config_file

ROOT = Path(__file__).resolve().parents[1]
CARTPOLE = ROOT / "configs" / "cartpole.json"
CARTPOLE_DQN = ROOT / "configs" / "cartpole_dqn.json"


def write(tmp_path: Path, data, name: str = "c.json") -> Path:
    path = tmp_path / name
    path.write_text(data if isinstance(data, str) else json.dumps(data), encoding="utf-8")
    return path


def error_of(data, overrides=(), **kw) -> str:
    with pytest.raises(ConfigError) as ei:
        config_from_dict(data, "x.json", overrides, **kw)
    msg = str(ei.value)
    assert "\n" not in msg
    return msg


# ---- defaults and the shipped config ----------------------------------------------------------


MUZERO_DEFAULTS = MuZeroRunConfig()
DQN_DEFAULTS = DQNRunConfig()


def test_empty_object_gives_the_defaults_of_the_algorithm_and_only_its_sections():
    assert config_from_dict({}) == MUZERO_DEFAULTS
    assert config_from_dict({"algorithm": "dqn"}) == DQN_DEFAULTS
    assert config_from_dict({}, "x.json", ["algorithm=dqn"]) == DQN_DEFAULTS


def test_every_field_has_a_description_and_its_default_passes_its_own_checks():
    specs = field_specs()
    classes = [*SHARED_SECTIONS.values(), *(c for a in ALGORITHM_CONFIGS.values() for c in a.sections.values())]
    top = [f for f in dataclasses.fields(Config) if f.name == "algorithm"]
    assert len(specs) == len(top) + sum(len(dataclasses.fields(c)) for c in classes)
    assert len({s.key for s in specs}) == len(specs)
    for spec in specs:
        assert spec.doc.strip(), spec.key
    for defaults in (MUZERO_DEFAULTS, DQN_DEFAULTS):
        assert config_from_dict(config_to_dict(defaults)) == defaults


def keys_of(path: Path) -> set[str]:
    raw = json.loads(path.read_text())
    keys = {k for k, v in raw.items() if not isinstance(v, dict)}
    return keys | {f"{s}.{k}" for s, sec in raw.items() if isinstance(sec, dict) for k in sec}


def keys_for(algorithm: str) -> set[str]:
    """The top-level keys, the shared sections' and ``algorithm``'s own."""
    own = set(SHARED_SECTIONS) | set(ALGORITHM_CONFIGS[algorithm].sections)
    return {s.key for s in field_specs() if "." not in s.key or s.key.split(".")[0] in own}


def test_cartpole_json_sets_every_key_explicitly_and_is_valid():
    assert keys_of(CARTPOLE) == keys_for("muzero")
    c = load_config(CARTPOLE)
    assert c.algorithm == "muzero" and c.env.id == "CartPole-v1" and c.network.kind == "fc"
    assert c.training.batch_size <= c.training.min_buffer_steps <= c.replay.capacity


@pytest.mark.parametrize("path", sorted((ROOT / "mpper" / "configs").glob("*.json")), ids=lambda p: p.stem)
def test_every_shipped_config_sets_every_key_of_its_algorithm_and_loads(path):
    """A shipped config is whole, or a short diff of a whole one ("base"): resolved, it
    sets every key of its algorithm, and what loads is exactly what it says."""
    raw, _ = read_config_file(path)
    keys = {k for k, v in raw.items() if not isinstance(v, dict)}
    keys |= {f"{s}.{k}" for s, sec in raw.items() if isinstance(sec, dict) for k in sec}
    assert keys == keys_for(raw["algorithm"])
    assert config_to_dict(load_config(path)) == raw
    if "base" in json.loads(path.read_text()):
        assert len(path.read_text().splitlines()) < 50  # a diff, not a copy


WHOLE = json.loads((ROOT / "tests" / "data" / "shipped_configs_whole.json").read_text())


@pytest.mark.parametrize("name", sorted(WHOLE))
def test_a_shipped_variant_resolves_to_the_whole_config_it_replaced(name):
    """tests/data/shipped_configs_whole.json: the variants as whole files, before they
    became diffs of their base; each resolves to exactly that config."""
    path = ROOT / "mpper" / "configs" / f"{name}.json"
    assert "base" in json.loads(path.read_text())
    assert load_config(path, check_env=False) == config_from_dict(WHOLE[name], check_env=False)


def test_a_dqn_config_holds_every_dqn_key_and_no_muzero_key():
    assert keys_of(CARTPOLE_DQN) == keys_for("dqn")
    muzero_only = keys_for("muzero") - keys_for("dqn")
    assert muzero_only and not keys_of(CARTPOLE_DQN) & muzero_only
    c = load_config(CARTPOLE_DQN)
    assert list(c.sections) == ["dqn"] and list(config_to_dict(c)) == list(json.loads(CARTPOLE_DQN.read_text()))
    with pytest.raises(AttributeError, match="'DQNRunConfig' object has no attribute 'mcts'"):
        c.mcts  # type: ignore[attr-defined]  # noqa: B018


@pytest.mark.parametrize("data,overrides,expected", [
    ({"algorithm": "dqn", "mcts": {}}, [], 'x.json: mcts: a section of algorithm "muzero", not of "dqn" (whose '
                                           'sections are env, replay, training, runtime, dqn)'),
    ({"algorithm": "dqn"}, ["network.hidden=[8]"], '--set network.hidden=[8]: network: a section of algorithm '
                                                   '"muzero", not of "dqn"'),
    ({"mcts": {"num_simulations": 5}}, ["algorithm=dqn"], 'x.json: mcts: a section of algorithm "muzero"'),
    ({"dqn": {}}, [], 'x.json: dqn: a section of algorithm "dqn", not of "muzero" (whose sections are env, replay, '
                      'training, runtime, network, mcts, muzero, reanalyse)'),
])  # fmt: skip
def test_a_section_of_another_algorithm_names_its_owner(data, overrides, expected):
    assert expected in error_of(data, overrides)


@pytest.mark.parametrize("old,new", [
    ("training.num_unroll_steps", "muzero.num_unroll_steps"), ("training.td_steps", "muzero.td_steps"),
    ("training.stacked_observations", "muzero.stacked_observations"),
    ("training.value_loss_weight", "muzero.value_loss_weight"),
    ("training.symmetry_augmentation", "muzero.symmetry_augmentation"),
    ("training.priority_update", "muzero.priority_update"), ("runtime.reanalyse", "reanalyse.enabled"),
    ("runtime.reanalyse_batch_episodes", "reanalyse.batch_episodes"),
])  # fmt: skip
def test_a_key_that_moved_to_an_algorithm_section_names_its_new_place(old, new):
    section, key = old.split(".")
    assert error_of({section: {key: 1}}) == f"x.json: {old}: renamed to {new} (same meaning)"
    assert error_of({}, [f"{old}=1"]) == f"--set {old}=1: {old}: renamed to {new} (same meaning)"


def test_one_initial_priority_key_for_both_algorithms():
    msg = error_of({"algorithm": "dqn", "dqn": {"initial_priority": "td"}})
    assert msg == 'x.json: dqn.initial_priority: renamed to replay.initial_priority ("td" is now "actor")'
    for algorithm in ("muzero", "dqn"):
        assert config_from_dict({"algorithm": algorithm}).replay.initial_priority == "actor"
        c = config_from_dict({"algorithm": algorithm, "replay": {"initial_priority": "max"}})
        assert c.replay.initial_priority == c.replay.buffer_initial_priority == "max"
    assert config_from_dict({}).replay.buffer_initial_priority == "max"  # "actor": every step comes with its own
    assert 'expected "actor", "max" or a number >= 0, got "td"' in error_of({"replay": {"initial_priority": "td"}})


def test_an_algorithm_rule_names_its_keys():
    msg = error_of({"muzero": {"symmetry_augmentation": True, "stacked_observations": 2}})
    assert msg == ("x.json: muzero.symmetry_augmentation: needs muzero.stacked_observations 0 (stacked action "
                   "planes are not transformed), got 2")  # fmt: skip
    msg = error_of({"muzero": {"symmetry_augmentation": True}}, ["muzero.stacked_observations=1"])
    assert msg.startswith("--set muzero.stacked_observations=1: muzero.symmetry_augmentation: ")
    msg = error_of({"muzero": {"game_segment_length": 50, "stacked_observations": 4}})
    assert msg == ("x.json: muzero.game_segment_length: needs muzero.stacked_observations 0 (a piece's first rows "
                   "would miss the observations of the piece before), got 4")  # fmt: skip
    assert "game_segment_length: expected an integer in [1, 1000000]" in error_of({"muzero": {"game_segment_length": 0}})


def test_a_config_copies_and_pickles_with_its_sections():
    import copy
    import pickle

    c = load_config(CARTPOLE)
    assert copy.deepcopy(c) == c and pickle.loads(pickle.dumps(c)) == c
    assert pickle.loads(pickle.dumps(c)).mcts.num_simulations == c.mcts.num_simulations


def test_resolved_config_round_trips_through_json(tmp_path):
    c = load_config(CARTPOLE, ["training.batch_size=64", "mcts.pb_c_base=20000", "env.kwargs.sutton_barto_reward=true"],
                    workers=2, seed=3, time_limit_s=60)
    text = json.dumps(config_to_dict(c), indent=2)
    again = load_config(write(tmp_path, text))
    assert again == c
    assert config_to_dict(again) == config_to_dict(c)
    assert isinstance(again.mcts.pb_c_base, float) and isinstance(again.training.batch_size, int)


# ---- types and ranges --------------------------------------------------------------------------


@pytest.mark.parametrize(
    "section,key,value,fragment",
    [
        ("training", "batch_size", "128", 'expected an integer in [1, 65536], got "128"'),
        ("training", "batch_size", 12.0, "expected an integer in [1, 65536], got 12.0"),
        ("runtime", "workers", True, "expected an integer in [0, 4096], got true"),
        ("mcts", "discount", True, "expected a number in (0, 1], got true"),
        ("mcts", "discount", 0, "expected a number in (0, 1], got 0"),
        ("mcts", "discount", 1.0001, "in (0, 1]"),
        ("mcts", "root_exploration_fraction", -0.1, "expected a number in [0, 1]"),
        ("replay", "capacity", 1, "expected an integer in [2, "),
        ("training", "grad_clip", 0, "expected a number > 0 or null, got 0"),
        ("reanalyse", "enabled", 1, "expected true or false, got 1"),
        ("env", "kwargs", [], "expected an object, got []"),
        ("env", "id", 5, "expected a registered gymnasium id"),
        ("runtime", "solve_return", "high", "expected a number or null"),
        ("runtime", "device", "gpu", 'expected one of "auto", "cpu", "cuda", got "gpu"'),
    ],
)
def test_wrong_types_and_out_of_range_values(section, key, value, fragment):
    msg = error_of({section: {key: value}})
    assert msg.startswith(f"x.json: {section}.{key}: ")
    assert fragment in msg


@pytest.mark.parametrize(
    "section,key,value,expected",
    [
        ("mcts", "discount", 1, 1.0),  # int where a float is allowed
        ("mcts", "root_exploration_fraction", 0, 0.0),
        ("mcts", "root_exploration_fraction", 1, 1.0),
        ("replay", "initial_priority", 3, 3.0),
        ("replay", "initial_priority", "max", "max"),
        ("training", "grad_clip", None, None),
        ("runtime", "workers", 0, 0),
        ("muzero", "num_unroll_steps", 0, 0),
        ("replay", "initial_priority", "actor", "actor"),
        ("network", "hidden", [], []),
    ],
)
def test_boundary_values_are_accepted_and_normalised(section, key, value, expected):
    c = config_from_dict({section: {key: value}})
    got = getattr(getattr(c, section), key)
    assert got == expected and type(got) is type(expected)


def test_non_finite_numbers_are_refused():
    assert "got NaN" in error_of({"mcts": {"discount": float("nan")}})
    assert "got Infinity" in error_of({"replay": {"alpha": float("inf")}})


def test_cross_field_rules():
    msg = error_of({"training": {"batch_size": 600, "min_buffer_steps": 500}})
    assert msg == "x.json: training.batch_size: must be <= training.min_buffer_steps (500), got 600"
    msg = error_of({"replay": {"capacity": 400}})
    assert msg == "x.json: training.min_buffer_steps: must be <= replay.capacity (400), got 500"
    # equality is fine
    config_from_dict({"training": {"batch_size": 500}, "replay": {"capacity": 500}})


@pytest.mark.parametrize(
    "schedule,fragment",
    [
        ([], "at least one"),
        ([[0, 1], [0.5]], "mcts.temperature_schedule[1]: expected a [fraction, temperature] pair"),
        ([[0, 1], [1.5, 0.5]], "mcts.temperature_schedule[1][0]: expected a fraction of training in [0, 1], got 1.5"),
        ([[0, 1], [0.5, -1]], "mcts.temperature_schedule[1][1]: expected a temperature >= 0"),
        ([[0.1, 1]], "mcts.temperature_schedule[0][0]: the first fraction must be 0"),
        ([[0, 1], [0.75, 0.5], [0.5, 0.25]], "mcts.temperature_schedule[2][0]: fractions must increase"),
        ([[0, 1], [0.5, 0.5], [0.5, 0.25]], "fractions must increase"),
        ("hot", "mcts.temperature_schedule: expected a list of [fraction, T] pairs"),
    ],
)
def test_temperature_schedule(schedule, fragment):
    assert fragment in error_of({"mcts": {"temperature_schedule": schedule}})


def test_temperature_schedule_accepts_ints_and_stores_floats():
    c = config_from_dict({"mcts": {"temperature_schedule": [[0, 1], [1, 0]]}})
    assert c.mcts.temperature_schedule == [[0.0, 1.0], [1.0, 0.0]]
    assert all(type(x) is float for pair in c.mcts.temperature_schedule for x in pair)


def test_hidden_widths_name_the_bad_element():
    assert error_of({"network": {"hidden": [16, 0]}}) == "x.json: network.hidden[1]: expected an integer in [1, 65536], got 0"


# ---- env id and device --------------------------------------------------------------------------


def test_env_id_registered_or_module_callable():
    assert config_from_dict({"env": {"id": "MountainCar-v0"}}).env.id == "MountainCar-v0"
    factory = "gymnasium.envs.classic_control.cartpole:CartPoleEnv"
    assert config_from_dict({"env": {"id": factory}}).env.id == factory
    msg = error_of({"env": {"id": "CartPole-v9"}})
    assert msg.startswith("x.json: env.id: ") and 'did you mean "CartPole-v1"' in msg and "module:callable" in msg
    assert 'module "no_such_module_xyz" of' in error_of({"env": {"id": "no_such_module_xyz:make"}})
    assert "not a registered gymnasium id" in error_of({"env": {"id": "not an env!"}})
    # check_env=False skips only the env id check
    assert config_from_dict({"env": {"id": "Unknown-v0"}}, check_env=False).env.id == "Unknown-v0"


def test_cuda_device_without_cuda_is_an_error(monkeypatch):
    monkeypatch.setattr(schema, "_cuda_available", lambda: False)
    msg = error_of({"runtime": {"device": "cuda"}})
    assert msg.startswith("x.json: runtime.device: ") and "torch.cuda.is_available()" in msg
    msg = error_of({}, flags=[("--device", "runtime.device", "cuda")])
    assert msg.startswith("--device: runtime.device: ")
    assert config_from_dict({"runtime": {"device": "cuda"}}, check_device=False).runtime.device == "cuda"
    monkeypatch.setattr(schema, "_cuda_available", lambda: True)
    assert config_from_dict({"runtime": {"device": "cuda"}}).runtime.device == "cuda"


def test_cuda_check_uses_torch():
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():
        assert config_from_dict({"runtime": {"device": "cuda"}}).runtime.device == "cuda"
    else:
        assert "runtime.device" in error_of({"runtime": {"device": "cuda"}})


# ---- unknown keys and did you mean ---------------------------------------------------------------


@pytest.mark.parametrize(
    "data,expected",
    [
        ({"training": {"batch_sise": 1}}, "x.json: training.batch_sise: unknown key (did you mean training.batch_size?)"),
        ({"trainig": {}}, "x.json: trainig: unknown section (did you mean training?)"),
        ({"mcts": {"td_steps": 5}}, "x.json: mcts.td_steps: unknown key (did you mean muzero.td_steps?)"),
        ({"batch_size": 5}, "x.json: batch_size: unknown key (did you mean training.batch_size?)"),
        ({"runtime": {"num_workers": 2}}, "x.json: runtime.num_workers: unknown key (did you mean runtime.workers? "),
        ({"algorithm": "muzer"}, 'x.json: algorithm: expected one of "muzero", "dqn", "sampled_muzero", got "muzer" (did you mean "muzero"?)'),
        ({"training": {"optimizer": "Adam"}}, 'did you mean "adam"?'),
    ],
)
def test_did_you_mean(data, expected):
    assert expected in error_of(data)


def test_unknown_key_without_a_close_match_lists_the_allowed_keys():
    msg = error_of({"network": {"zzzz": 1}})
    assert "allowed in network: kind, encoding_size, hidden, blocks, support_size" in msg


def test_structure_errors():
    assert error_of([1, 2]) == "x.json: expected a JSON object at the top level, got a list"
    assert error_of({"training": 5}) == "x.json: training: expected an object (a section of keys), got 5"
    assert error_of({"training": None}).startswith("x.json: training: expected an object")


# ---- --set overrides ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "text,key,expected",
    [
        ("training.batch_size=64", "training.batch_size", 64),
        ("mcts.discount=1", "mcts.discount", 1.0),
        ("mcts.pb_c_base=2e4", "mcts.pb_c_base", 20000.0),
        ("training.grad_clip=null", "training.grad_clip", None),
        ("training.grad_clip=5", "training.grad_clip", 5.0),
        ("env.id=CartPole-v0", "env.id", "CartPole-v0"),  # not JSON: a plain string
        ('env.id="Acrobot-v1"', "env.id", "Acrobot-v1"),  # JSON string
        ("runtime.device=cpu", "runtime.device", "cpu"),
        ("reanalyse.enabled=false", "reanalyse.enabled", False),
        ("network.hidden=[32, 32]", "network.hidden", [32, 32]),
        ("replay.initial_priority=max", "replay.initial_priority", "max"),
        ("replay.initial_priority=2", "replay.initial_priority", 2.0),
        ("mcts.temperature_schedule=[[0,1],[0.5,0]]", "mcts.temperature_schedule", [[0.0, 1.0], [0.5, 0.0]]),
        ('env.kwargs={"sutton_barto_reward": true}', "env.kwargs", {"sutton_barto_reward": True}),
        ("env.kwargs.render_mode=rgb_array", "env.kwargs", {"render_mode": "rgb_array"}),
        ("algorithm=dqn", "algorithm", "dqn"),
        ("runtime.seed= 7", "runtime.seed", 7),
    ],
)
def test_set_is_parsed_and_typed_like_the_file(text, key, expected):
    c = config_from_dict({}, "x.json", [text])
    got = value_at(c, key)
    assert got == expected and type(got) is type(expected)


def test_set_merges_into_the_file_and_later_wins(tmp_path):
    path = write(tmp_path, {"env": {"kwargs": {"a": 1}}, "training": {"batch_size": 32}})
    c = load_config(path, ["training.batch_size=16", "training.batch_size=8", "env.kwargs.b=2"])
    assert c.training.batch_size == 8 and c.env.kwargs == {"a": 1, "b": 2}
    # flags are applied after --set
    c = load_config(path, ["runtime.workers=3", "runtime.seed=1"], workers=5, seed=9, training_steps=7, time_limit_s=2)
    assert (c.runtime.workers, c.runtime.seed, c.training.training_steps, c.runtime.time_limit_s) == (5, 9, 7, 2.0)


@pytest.mark.parametrize(
    "text,expected",
    [
        ("training.batch_size=abc", '--set training.batch_size=abc: training.batch_size: expected an integer in [1, 65536], got "abc"'),
        ("training.batch_size=0", "--set training.batch_size=0: training.batch_size: expected an integer in [1, 65536], got 0"),
        ("training.batch_sise=3", "--set training.batch_sise=3: training.batch_sise: unknown key (did you mean training.batch_size?)"),
        ("trainng.batch_size=3", "--set trainng.batch_size=3: trainng: unknown section (did you mean training?)"),
        ("batch_size=3", "--set batch_size=3: batch_size: unknown key (did you mean training.batch_size?)"),
        ("training.batch_size", "--set training.batch_size: expected section.key=value"),
        ("=3", "--set =3: expected section.key=value"),
        ("training..batch_size=3", "expected section.key=value"),
        ("training=3", "--set training=3: training: is a section"),
        ("algorithm.x=3", "--set algorithm.x=3: algorithm.x: algorithm is not a section"),
        ("training.batch_size.x=3", "training.batch_size is not an object"),
        ("training.min_buffer_steps=100", "--set training.min_buffer_steps=100: training.batch_size: must be <= training.min_buffer_steps (100), got 128"),
        ("replay.capacity=100", "--set replay.capacity=100: training.min_buffer_steps: must be <= replay.capacity (100)"),
        ("env.id=Nope-v0", "--set env.id=Nope-v0: env.id: "),
    ],
)
def test_set_errors_name_the_override(text, expected):
    assert expected in error_of({}, [text])


def test_flag_errors_name_the_flag():
    msg = error_of({}, flags=[("--workers", "runtime.workers", -1)])
    assert msg == "--workers: runtime.workers: expected an integer in [0, 4096], got -1"


# ---- the file itself --------------------------------------------------------------------------------


def test_file_errors(tmp_path):
    def err(path) -> str:
        with pytest.raises(ConfigError) as ei:
            load_config(path)
        assert "\n" not in str(ei.value)
        return str(ei.value)

    missing = tmp_path / "missing.json"
    assert err(missing) == f"{missing}: no such file"
    assert err(tmp_path) == f"{tmp_path}: is a directory, expected a JSON file"
    bad = write(tmp_path, '{\n  "training": {\n    "batch_size": 64,\n  }\n}')
    assert err(bad) == f"{bad}: invalid JSON at line 4, column 3: Expecting property name enclosed in double quotes"
    assert err(write(tmp_path, "  \n")).endswith("the file is empty, expected a JSON object")
    dup = write(tmp_path, '{"training": {"batch_size": 64, "batch_size": 32}}')
    assert err(dup) == f"{dup}: training.batch_size: duplicate key"
    latin = tmp_path / "latin.json"
    latin.write_bytes(b'{"env": {"id": "Cart\xe9"}}')
    assert "not UTF-8 text" in err(latin)


def test_string_values_with_newlines_stay_on_one_line():
    msg = error_of({"env": {"id": "a\nb"}})
    assert '"a\\nb"' in msg


# ---- documentation -------------------------------------------------------------------------------------


def test_describe_config_covers_every_field_within_100_columns():
    text = describe_config()
    lines = text.splitlines()
    assert max(len(ln) for ln in lines) <= 100
    starts = [i for i, ln in enumerate(lines) if ln and not ln.startswith((" ", "["))]
    blocks = {}  # key -> its lines joined (a key's line, then its indented, wrapped description)
    for i in starts:
        end = i + 1
        while end < len(lines) and lines[end].startswith(" "):
            end += 1
        blocks[lines[i].split(" ", 1)[0]] = " ".join(ln.strip() for ln in lines[i:end])
    for spec in field_specs():
        block = blocks[spec.key]
        assert block.startswith(f"{spec.key}  {spec.type_name}  default {json.dumps(spec.default)}  allowed ")
        assert spec.allowed_text in block and " ".join(spec.doc.split()) in block, spec.key
    flat = " ".join(ln.strip() for ln in lines)
    for a, op, b in cfg.CROSS_RULES:
        assert f"{a} {op} {b}" in flat


def test_describe_config_markdown_table_has_one_row_per_field():
    md = describe_config(markdown=True)
    rows = [ln for ln in md.splitlines() if ln.startswith("| `")]
    assert [r.split("`")[1] for r in rows] == [s.key for s in field_specs()]
    assert all(r.count(" | ") == 4 for r in rows)  # "|" inside cells is escaped
    assert "in (0, 1]" in md and 'one of "fc", "residual"' in md


def test_ranges_come_from_the_field_metadata():
    spec = {s.key: s for s in field_specs()}
    assert spec["mcts.discount"].allowed_text == "in (0, 1]"
    assert spec["training.batch_size"].expected() == "an integer in [1, 65536]"
    assert spec["training.grad_clip"].expected() == "a number > 0 or null"
    f = {f.name: f for f in dataclasses.fields(cfg.TrainingConfig)}["batch_size"]
    assert f.metadata["allowed"] == "[1, 65536]" and f.metadata["doc"]


def test_a_renamed_key_names_its_new_name(tmp_path):
    path = tmp_path / "old.json"
    path.write_text('{"training": {"checkpoint_interval": 5}}')
    with pytest.raises(ConfigError) as e:
        load_config(path)
    assert str(e.value) == f"{path}: training.checkpoint_interval: renamed to training.publish_interval (same meaning)"
    with pytest.raises(ConfigError, match=r"^--set training.checkpoint_interval=5: training.checkpoint_interval: "
                                          r"renamed to training.publish_interval \(same meaning\)$"):
        load_config(ROOT / "configs" / "cartpole.json", ["training.checkpoint_interval=5"])
    assert load_config(ROOT / "configs" / "cartpole.json", ["training.publish_interval=5"]).training.publish_interval == 5


# ---- the engine apart from the schema ----------------------------------------------------------


@dataclasses.dataclass
class _Part:
    """A shared section of a toy schema."""

    size: int = cfg.opt(1, ">= 1", "a size")


@dataclasses.dataclass
class _Root:
    """A toy schema's root: the algorithm and one shared section."""

    algorithm: str = cfg.opt("a", None, "which algorithm")
    part: _Part = dataclasses.field(default_factory=_Part)


@dataclasses.dataclass
class _Extra:
    """Algorithm a's section."""

    k: float = cfg.opt(0.5, "[0, 1]", "a fraction")


@dataclasses.dataclass
class _RootA(_Root):
    extra: _Extra = dataclasses.field(default_factory=_Extra)


def _small_enough(config: _RootA) -> str | None:
    return "k * size must be <= 1" if config.extra.k * config.part.size > 1 else None


def test_the_engine_checks_any_schema_it_is_given():
    """mpper.config.engine knows no section: a toy root and one algorithm's class are
    parsed, typed and checked the way the real ones are."""
    from mpper.config.engine import parse_config

    rule = cfg.Rule(("extra.k", "part.size"), _small_enough)
    schema = cfg.ConfigSchema(_Root, {"a": cfg.AlgorithmConfig(_RootA, (rule,))})
    assert schema.algorithms["a"].sections == {"extra": _Extra}
    config, _ = parse_config(schema, {"part": {"size": 2}}, "x.json", ["extra.k=0.25"])
    assert config == _RootA(part=_Part(2), extra=_Extra(0.25))
    with pytest.raises(ConfigError, match=r"^x.json: part.sise: unknown key \(did you mean part.size\?\)$"):
        parse_config(schema, {"part": {"sise": 2}}, "x.json")
    with pytest.raises(ConfigError, match=r"^--set extra.k=1: extra.k: k \* size must be <= 1$"):
        parse_config(schema, {"part": {"size": 2}}, "x.json", ["extra.k=1"])
    with pytest.raises(TypeError, match="its config class _Extra does not extend _Root"):
        cfg.ConfigSchema(_Root, {"b": cfg.AlgorithmConfig(_Extra)})
