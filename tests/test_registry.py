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
