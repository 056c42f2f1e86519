import pytest

from bicc.registry import Registry


def test_register_and_get():
    reg = Registry("thing")

    @reg.register("a")
    def a():
        return 1

    assert reg.get("a") is a and "a" in reg and reg.names() == ["a"]


def test_duplicate_name_fails():
    reg = Registry("thing")
    reg.register("a")(lambda: 1)
    with pytest.raises(ValueError, match="thing 'a' is already registered"):
        reg.register("a")(lambda: 2)


def test_unknown_name_lists_choices():
    reg = Registry("thing")
    reg.register("b")(lambda: 1)
    reg.register("a")(lambda: 1)
    with pytest.raises(KeyError, match="thing 'c' unknown; choose from: a, b"):
        reg.get("c")


def test_a_dotted_name_is_imported_on_first_use():
    """``package.module:attribute`` finds a component outside the library (a process that only receives the name,
    a rollout worker, imports it too); a module or attribute that is not there is an error naming both."""
    reg = Registry("thing")
    reg.register("a")(lambda: 1)
    assert reg.get("tests.rewards:first_right").__name__ == "first_right"
    assert "tests.rewards:first_right" in reg and reg.names() == ["a"]  # the choices stay the registered ones
    with pytest.raises(KeyError, match=r"thing 'tests.rewards:nothing': cannot import it \(AttributeError"):
        reg.get("tests.rewards:nothing")
    with pytest.raises(KeyError, match=r"thing 'no_such_pkg.mod:x': cannot import it \(ModuleNotFoundError"):
        reg.get("no_such_pkg.mod:x")
    assert "no_such_pkg.mod:x" not in reg
