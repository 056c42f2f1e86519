"""The docs name what the code logs: every metric name written in ``bicc/`` has its line in docs/metrics.md."""

import re

from tests.helpers import ROOT

GROUPS = "train|rollout|reward|bicc|rcc|perf"
LITERAL = re.compile(rf'f?"((?:{GROUPS})/[A-Za-z0-9_@{{}}]+)"')
EVAL_SUFFIX = re.compile(r'prefix \+ f?"([A-Za-z0-9_@{}]+)"')


def logged_names() -> set[str]:
    names = set()
    for path in (ROOT / "bicc").rglob("*.py"):
        text = path.read_text()
        names |= set(LITERAL.findall(text))
        names |= {f"eval/{suffix}" for suffix in EVAL_SUFFIX.findall(text)}
    return names


def documented(name: str, page: str) -> bool:
    """A literal name appears in backticks; a templated one (``bicc/log_w_{name}``) matches a documented name."""
    if "{" not in name:
        return f"`{name}`" in page
    pattern = re.escape(name)
    pattern = re.sub(r"\\\{[^}]*\\\}", r"[A-Za-z0-9_]+", pattern)
    return re.search(f"`{pattern}`", page) is not None


def test_every_logged_metric_is_in_the_glossary():
    page = (ROOT / "docs" / "metrics.md").read_text()
    names = logged_names()
    assert {"train/loss", "rcc/cov", "bicc/log_w_{name}", "perf/update_tokens", "eval/pass@1"} <= names  # the scan works
    missing = sorted(n for n in names if not documented(n, page))
    assert not missing, f"docs/metrics.md lacks: {missing}"
