"""A command that needs a module of a missing extra says which extra, in one line, exit 2."""

from __future__ import annotations

import subprocess
import sys
import types

import pytest

from splitinfer import cli

# Imports a command hidden as if the cloud, planner and plots extras were not installed.
_HIDE = ("ray", "kubernetes", "prometheus_client", "matplotlib", "scipy", "sympy")
_RUN_WITHOUT_EXTRAS = (
    "import sys\n"
    f"for m in {_HIDE!r}: sys.modules[m] = None\n"
    "from splitinfer.cli import main\n"
    "sys.exit(main(sys.argv[1:]))\n"
)


def _run_without_extras(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", _RUN_WITHOUT_EXTRAS, *args], capture_output=True, text=True,
                          timeout=60)


def test_hint_names_the_extra_and_the_pip_command() -> None:
    hint = cli.missing_extra_hint(ModuleNotFoundError("No module named 'ray'", name="ray"))
    assert hint == "needs the 'cloud' extra (missing module 'ray'): pip install 'splitinfer[cloud]'"


def test_hint_follows_the_error_a_wrapper_was_raised_from() -> None:
    try:
        try:
            raise ModuleNotFoundError("No module named 'matplotlib.pyplot'", name="matplotlib.pyplot")
        except ImportError as e:
            raise ImportError("plots need matplotlib") from e
    except ImportError as wrapped:
        assert cli.missing_extra_hint(wrapped) == (
            "needs the 'plots' extra (missing module 'matplotlib'): pip install 'splitinfer[plots]'")


def test_a_module_no_extra_installs_gets_no_hint() -> None:
    assert cli.missing_extra_hint(ModuleNotFoundError("No module named 'nosuch'", name="nosuch")) is None
    assert cli.missing_extra_hint(ImportError("cannot import name 'x'")) is None


def test_hint_for_several_extras_lists_each_once() -> None:
    assert cli.extras_hint(["ray", "kubernetes", "matplotlib.pyplot"]) == (
        "needs the 'cloud' and 'plots' extras (missing modules 'kubernetes', 'matplotlib', 'ray'): "
        "pip install 'splitinfer[cloud,plots]'")


def test_check_extras_is_none_when_installed_and_a_hint_when_not(monkeypatch: pytest.MonkeyPatch) -> None:
    assert cli.check_extras(["yaml"]) is None
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    assert cli.check_extras(["matplotlib"]) == (
        "needs the 'plots' extra (missing module 'matplotlib'): pip install 'splitinfer[plots]'")


def _command_importing(monkeypatch: pytest.MonkeyPatch, missing: str) -> None:
    """Registers `splitinfer fake`, whose function imports `missing` (hidden) when it runs."""
    mod = types.ModuleType("_fake_cmd")

    def fake_main(argv: list[str]) -> int:
        __import__(missing)
        return 0

    mod.fake_main = fake_main  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "_fake_cmd", mod)
    monkeypatch.setitem(sys.modules, missing, None)
    monkeypatch.setitem(cli.COMMANDS, "fake", ("_fake_cmd", "fake_main", "a command that needs an extra"))


def test_a_command_missing_an_extra_exits_2_with_one_line(monkeypatch: pytest.MonkeyPatch,
                                                          capsys: pytest.CaptureFixture[str]) -> None:
    _command_importing(monkeypatch, "kubernetes")
    assert cli.main(["fake"]) == 2
    err = capsys.readouterr().err
    assert err == ("splitinfer fake: needs the 'cloud' extra (missing module 'kubernetes'): "
                   "pip install 'splitinfer[cloud]'\n")


def test_a_missing_module_of_no_extra_is_still_a_traceback(monkeypatch: pytest.MonkeyPatch) -> None:
    _command_importing(monkeypatch, "nosuch_module_of_no_extra")
    with pytest.raises(ModuleNotFoundError):
        cli.main(["fake"])


@pytest.mark.parametrize(("args", "extra", "module"), [
    (("gateway", "--port", "0", "--registry", "X"), "cloud", "prometheus_client"),
    (("cluster", "status"), "cloud", "kubernetes"),
])
def test_cloud_commands_without_the_cloud_extra_exit_2(args: tuple[str, ...], extra: str, module: str) -> None:
    r = _run_without_extras(*args)
    assert r.returncode == 2, r.stderr
    assert r.stderr == (f"splitinfer {args[0]}: needs the {extra!r} extra (missing module {module!r}): "
                        f"pip install 'splitinfer[{extra}]'\n")


def test_demo_without_the_cloud_and_plots_extras_says_so_before_any_work() -> None:
    r = _run_without_extras("demo", "--no-ray")
    assert r.returncode == 2, r.stderr
    assert r.stdout == ""
    assert "needs the 'cloud' and 'plots' extras" in r.stderr and "Traceback" not in r.stderr


def test_command_modules_load_no_module_of_an_extra() -> None:
    """Each command imports its extras where it uses them (matplotlib when it draws), so
    loading a command, as `splitinfer COMMAND --help` does, never needs an extra."""
    probe = ("import importlib, json, sys\n"
             "from splitinfer.cli import COMMANDS, EXTRA_OF_MODULE\n"
             "for module, _, _ in COMMANDS.values(): importlib.import_module(module)\n"
             "print(json.dumps(sorted(m for m in EXTRA_OF_MODULE if m in sys.modules)))\n")
    r = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "[]"
