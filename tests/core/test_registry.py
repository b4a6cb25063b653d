"""Both factories: lazy and class registration, entry-point discovery, errors, `wt backends`."""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import pytest

from tests.core.conftest import MakeDist
from tests.core.helpers import EchoEngine, TinyModel
from weight_transfer import (
    TrainerInitInfo,
    WeightTransferConfig,
    WeightTransferEngine,
    WeightTransferEngineFactory,
    WeightTransferTrainerFactory,
    WorkerPosition,
    list_backends,
)
from weight_transfer.cli import main as wt_main
from weight_transfer.registry import FIRST_PARTY_WHEELS, BackendInfo, BackendRegistry

DIST, VERSION = "wt-throwaway", "0.3.1"

TRAINER_SRC = """
from dataclasses import dataclass
from typing import ClassVar

from weight_transfer import TrainerInitInfo, TrainerWeightTransferEngine


@dataclass
class ThrowawayInfo(TrainerInitInfo):
    backend: ClassVar[str] = "throwaway"

    endpoint: str = "here"


class ThrowawayTrainer(TrainerWeightTransferEngine):
    init_info_cls = ThrowawayInfo

    @classmethod
    def trainer_init(cls, init_info, *, client, source=None):
        engine = cls(client=client, source=source, is_sender=init_info.is_sender)
        engine.endpoint = init_info.endpoint
        return engine

    def send_weights(self, *args, **kwargs):
        pass
"""

ENGINE_SRC = """
from tests.core.helpers import EchoEngine


class ThrowawayEngine(EchoEngine):
    pass


class NotAnEngine:
    pass


not_a_class = 3
"""

LAZY_SRC = """
from tests.core.helpers import EchoEngine


class LazyEngine(EchoEngine):
    pass
"""

BROKEN_SRC = """
raise RuntimeError("plugin exploded at import")
"""


@dataclass
class Plugin:
    trainer_mod: str
    engine_mod: str
    broken_mod: str
    root: Path


@pytest.fixture
def plugin(make_dist: MakeDist, unique: str) -> Plugin:
    p = Plugin(
        f"wt_tmp_{unique}_trainer", f"wt_tmp_{unique}_engine", f"wt_tmp_{unique}_broken", Path()
    )
    p.root = make_dist(
        DIST,
        VERSION,
        entry_points={
            "weight_transfer.trainer": {
                "throwaway": f"{p.trainer_mod}:ThrowawayTrainer",
                "throwaway_broken": f"{p.broken_mod}:Trainer",
            },
            "weight_transfer.engine": {
                "throwaway": f"{p.engine_mod}:ThrowawayEngine",
                "throwaway_broken": f"{p.broken_mod}:Engine",
                "throwaway_notsub": f"{p.engine_mod}:NotAnEngine",
                "throwaway_notclass": f"{p.engine_mod}:not_a_class",
            },
        },
        modules={p.trainer_mod: TRAINER_SRC, p.engine_mod: ENGINE_SRC, p.broken_mod: BROKEN_SRC},
    )
    return p


def _create(backend: str) -> WeightTransferEngine[Any, Any]:
    return WeightTransferEngineFactory.create_engine(
        WeightTransferConfig(backend), WorkerPosition(), "cpu", TinyModel()
    )


# ---------------------------------------------------------------- entry points


def test_listing_reads_metadata_and_imports_no_plugin_module(plugin: Plugin) -> None:
    found = list_backends()
    assert found["engine"]["throwaway"] == BackendInfo(
        "throwaway", f"{plugin.engine_mod}:ThrowawayEngine", DIST, VERSION
    )
    assert found["trainer"]["throwaway"] == BackendInfo(
        "throwaway", f"{plugin.trainer_mod}:ThrowawayTrainer", DIST, VERSION
    )
    assert found["engine"]["throwaway_broken"].distribution == DIST
    assert found["engine"]["example_file"].distribution == "wt-example"
    assert list(found["engine"]) == sorted(found["engine"])
    for mod in (plugin.trainer_mod, plugin.engine_mod, plugin.broken_mod):
        assert mod not in sys.modules


def test_resolving_imports_only_that_backends_module(plugin: Plugin) -> None:
    cls = WeightTransferEngineFactory.get_engine_class("throwaway")
    assert cls.__name__ == "ThrowawayEngine" and cls.__module__ == plugin.engine_mod
    assert issubclass(cls, EchoEngine)
    assert plugin.engine_mod in sys.modules
    assert plugin.trainer_mod not in sys.modules
    assert plugin.broken_mod not in sys.modules
    assert WeightTransferEngineFactory.get_engine_class("throwaway") is cls  # cached

    engine = _create("throwaway")
    assert type(engine.backend) is cls
    assert engine.position == WorkerPosition()

    trainer_cls = WeightTransferTrainerFactory.get_engine_class("throwaway")
    assert trainer_cls.__module__ == plugin.trainer_mod
    info_cls = sys.modules[plugin.trainer_mod].ThrowawayInfo
    client = object()
    trainer = WeightTransferTrainerFactory.trainer_init(
        info_cls(endpoint="tcp://e", rank=1),
        client=client,  # type: ignore[arg-type]
    )
    assert type(trainer) is trainer_cls
    assert trainer.is_sender is False and trainer.client.inner is client  # type: ignore[attr-defined]
    assert trainer.endpoint == "tcp://e"  # type: ignore[attr-defined]
    assert plugin.broken_mod not in sys.modules


def test_trainer_init_rejects_another_backends_info_class(plugin: Plugin) -> None:
    @dataclass
    class Impostor(TrainerInitInfo):
        backend: ClassVar[str] = "throwaway"

    with pytest.raises(TypeError, match=r"'throwaway' expects ThrowawayInfo, got Impostor"):
        WeightTransferTrainerFactory.trainer_init(Impostor(rank=0), client=object())  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("factory", "group"),
    [
        (WeightTransferEngineFactory, "weight_transfer.engine"),
        (WeightTransferTrainerFactory, "weight_transfer.trainer"),
    ],
)
def test_plugin_import_failure_names_distribution_entry_point_and_error(
    plugin: Plugin, factory: Any, group: str
) -> None:
    with pytest.raises(ImportError) as err:
        factory.get_engine_class("throwaway_broken")
    msg = str(err.value)
    assert f"from distribution {DIST} {VERSION}" in msg
    kind = "Engine" if group.endswith("engine") else "Trainer"
    assert f"entry point {group}: throwaway_broken = {plugin.broken_mod}:{kind}" in msg
    assert "RuntimeError: plugin exploded at import" in msg
    assert isinstance(err.value.__cause__, RuntimeError)


def test_plugin_that_is_not_a_subclass_raises_type_error(plugin: Plugin) -> None:
    with pytest.raises(TypeError, match=r"is not a subclass of WeightTransferEngine") as err:
        WeightTransferEngineFactory.get_engine_class("throwaway_notsub")
    assert f"{DIST} {VERSION}" in str(err.value)
    with pytest.raises(TypeError, match=r"throwaway_notclass = .*:not_a_class .*is not a class"):
        WeightTransferEngineFactory.get_engine_class("throwaway_notclass")


def test_two_distributions_advertising_one_name_is_refused(
    plugin: Plugin, make_dist: MakeDist, unique: str
) -> None:
    make_dist(
        "wt-rival",
        "9.0",
        entry_points={"weight_transfer.engine": {"throwaway": f"{plugin.engine_mod}:X"}},
        modules={},
    )
    with pytest.raises(
        ValueError, match=r"advertised by several distributions \(wt-rival, wt-throwaway\)"
    ):
        WeightTransferEngineFactory.get_engine_class("throwaway")


def test_entry_point_names_cannot_be_registered_over(plugin: Plugin) -> None:
    with pytest.raises(
        ValueError,
        match=r"'throwaway' is already registered \(throwaway \(wt-throwaway 0\.3\.1\)\)",
    ):
        WeightTransferEngineFactory.register_engine("throwaway", EchoEngine)
    with pytest.raises(
        ValueError, match=r"'example_file' is already registered .*wt-example 0\.1\.0"
    ):
        WeightTransferTrainerFactory.register_engine("example_file", "x.y", "Z")


# ---------------------------------------------------------- in-process registration


def test_lazy_registration_imports_on_first_use_only(make_dist: MakeDist, unique: str) -> None:
    mod = f"wt_tmp_{unique}_lazy"
    make_dist(
        "wt-lazy-holder",
        "0.0.1",
        entry_points={},
        modules={mod: LAZY_SRC},
    )
    name = f"lazy_{unique}"
    WeightTransferEngineFactory.register_engine(name, mod, "LazyEngine")
    assert mod not in sys.modules
    info = WeightTransferEngineFactory.available_backends()[name]
    assert info == BackendInfo(name, f"{mod}:LazyEngine")
    assert info.describe() == f"{name} (registered in-process)"
    assert mod not in sys.modules
    engine = _create(name)
    assert type(engine.backend).__name__ == "LazyEngine" and mod in sys.modules


def test_direct_class_registration_and_duplicates() -> None:
    WeightTransferEngineFactory.register_engine("echo_direct", EchoEngine)
    assert WeightTransferEngineFactory.get_engine_class("echo_direct") is EchoEngine
    assert type(_create("echo_direct").backend) is EchoEngine
    assert WeightTransferEngineFactory.available_backends()["echo_direct"].target == (
        "tests.core.helpers:EchoEngine"
    )
    with pytest.raises(
        ValueError,
        match=r"'echo_direct' is already registered \(echo_direct \(registered in-process\)\)",
    ):
        WeightTransferEngineFactory.register_engine(
            "echo_direct", "tests.core.helpers", "EchoEngine"
        )
    # the two registries are independent
    assert "echo_direct" not in WeightTransferTrainerFactory.available_backends()


def test_module_path_without_class_name_raises() -> None:
    with pytest.raises(ValueError, match="class_name is required"):
        WeightTransferEngineFactory.register_engine("no_class", "tests.core.helpers")
    assert "no_class" not in WeightTransferEngineFactory.available_backends()


def test_lazy_registration_of_a_non_subclass_fails_at_resolution() -> None:
    WeightTransferEngineFactory.register_engine("tiny_model", "tests.core.helpers", "TinyModel")
    with pytest.raises(
        TypeError, match=r"'tiny_model' \(tests\.core\.helpers:TinyModel, .*is not a subclass"
    ):
        WeightTransferEngineFactory.get_engine_class("tiny_model")


def test_create_engine_needs_a_backend_name() -> None:
    with pytest.raises(ValueError, match=r"config\.backend must name"):
        WeightTransferEngineFactory.create_engine(object(), None, "cpu", TinyModel())


# ---------------------------------------------------------------- unknown names


def test_unknown_backend_lists_installed_backends() -> None:
    for factory in (WeightTransferEngineFactory, WeightTransferTrainerFactory):
        with pytest.raises(ValueError) as err:
            factory.get_engine_class("no_such_backend")
        msg = str(err.value)
        assert "backend 'no_such_backend'" in msg
        assert "Installed: " in msg and "example_file (wt-example 0.1.0)" in msg
        assert "entry-point group 'weight_transfer." in msg
        assert "pip install" not in msg


@pytest.mark.parametrize("name", sorted(FIRST_PARTY_WHEELS))
def test_unknown_first_party_backend_names_its_wheel(name: str) -> None:
    wheel = FIRST_PARTY_WHEELS[name]
    assert wheel.startswith("wt-")
    registry: BackendRegistry[WeightTransferEngine[Any, Any]] = BackendRegistry(
        "engine", "weight_transfer.no_such_group_for_tests", WeightTransferEngine
    )
    with pytest.raises(ValueError) as err:
        registry.resolve(name)
    assert f"backend {name!r}. Installed: none." in str(err.value)
    assert f"provided by the wheel {wheel}: pip install {wheel}" in str(err.value)


@pytest.mark.parametrize("factory", [WeightTransferEngineFactory, WeightTransferTrainerFactory])
def test_factories_name_the_wheel_for_missing_first_party_backends(factory: Any) -> None:
    missing = [n for n in sorted(FIRST_PARTY_WHEELS) if n not in factory.available_backends()]
    if not missing:
        pytest.skip("every first-party backend is installed here")
    for name in missing:
        with pytest.raises(ValueError, match=rf"pip install {FIRST_PARTY_WHEELS[name]}$"):
            factory.get_engine_class(name)
    assert FIRST_PARTY_WHEELS["nccl"] == "wt-nccl"


# ---------------------------------------------------------------------- CLI


def _row(out: str, name: str) -> list[str]:
    for line in out.splitlines():
        if line.split(" ", 1)[0] == name:
            return [c for c in line[16:].split("  ") if c.strip()]
    raise AssertionError(f"no row for {name!r} in:\n{out}")


def test_wt_backends_lists_distributions_and_versions(
    plugin: Plugin, capsys: pytest.CaptureFixture[str]
) -> None:
    WeightTransferEngineFactory.register_engine("zz_inproc", EchoEngine)
    assert wt_main(["backends"]) == 0
    out = capsys.readouterr().out
    assert out.splitlines()[0].split() == ["backend", "trainer", "engine"]
    assert [c.strip() for c in _row(out, "example_file")] == ["wt-example 0.1.0"] * 2
    assert [c.strip() for c in _row(out, "throwaway")] == [f"{DIST} {VERSION}"] * 2
    assert [c.strip() for c in _row(out, "throwaway_notsub")] == ["-", f"{DIST} {VERSION}"]
    assert [c.strip() for c in _row(out, "zz_inproc")] == ["-", "registered in-process"]
    for mod in (plugin.trainer_mod, plugin.engine_mod, plugin.broken_mod):
        assert mod not in sys.modules


def test_wt_backends_console_script(plugin: Plugin) -> None:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(plugin.root), *sys.path])}
    wt = Path(sys.executable).with_name("wt")
    cmd = (
        [str(wt), "backends"]
        if wt.exists()
        else [sys.executable, "-m", "weight_transfer.cli", "backends"]
    )
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=60, env=env, check=False)
    assert proc.returncode == 0, proc.stderr
    assert [c.strip() for c in _row(proc.stdout, "example_file")] == ["wt-example 0.1.0"] * 2
    assert [c.strip() for c in _row(proc.stdout, "throwaway")] == [f"{DIST} {VERSION}"] * 2


@pytest.mark.parametrize(("tool", "option"), [("demo", "--backend"), ("bench", "--layers")])
def test_wt_runs_the_tools_of_wt_tools(
    tool: str, option: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as done:
        wt_main([tool, "--help"])
    assert done.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith(f"usage: wt {tool}") and option in out


def test_wt_says_which_wheel_a_missing_tool_needs(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    for module in ("wt_tools", "wt_tools.demo"):  # as if wt-tools were not installed
        monkeypatch.setitem(sys.modules, module, None)  # type: ignore[arg-type]
    assert wt_main(["demo"]) == 2
    assert "pip install wt-tools" in capsys.readouterr().err
