"""The docs name what the code logs: every metric name written in ``bicc/`` has its line in docs/metrics.md, or, for a
variant's own metric, in its loss module's docstring (a variant is its module, its YAML and its test)."""

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
    import ast

    page = (ROOT / "docs" / "metrics.md").read_text()
    page += "".join(ast.get_docstring(ast.parse(p.read_text(encoding="utf-8"))) or ""
                    for p in (ROOT / "bicc" / "method" / "losses").glob("*.py"))
    names = logged_names()
    assert {"train/loss", "rcc/cov", "bicc/log_w_{name}", "perf/update_tokens", "eval/pass@1"} <= names  # the scan works
    missing = sorted(n for n in names if not documented(n, page))
    assert not missing, f"docs/metrics.md lacks: {missing}"


# A figure in the README: a decimal (84.4, 0.422) or a quantity with its unit (590 s, 29 min, 107 GiB, 96%).
FIGURE = re.compile(r"(?<![\w.,-])(\d+\.\d+|\d[\d,]*(?:\.\d+)? ?(?:s|min|GiB|%)(?![\w]))")
LINK = re.compile(r"\]\((docs/[\w/.-]+\.md)\)")


def readme_blocks() -> list[str]:
    """The README's prose and table rows, a paragraph or a row each, without code blocks or `code spans`."""
    text = re.sub(r"```.*?```", "", (ROOT / "README.md").read_text(encoding="utf-8"), flags=re.S)
    blocks = []
    for paragraph in re.split(r"\n\s*\n", text):
        lines = paragraph.splitlines()
        blocks += lines if all(line.startswith("|") for line in lines) else [paragraph]
    return [re.sub(r"`[^`]*`", "", block) for block in blocks]


def test_every_figure_in_the_readme_is_in_the_doc_it_cites():
    """Each figure the README states appears, as written, in a doc linked from the same paragraph or table row
    (any doc the README links, where the block links none): a figure that a later run changed is then changed
    where it was measured first, or it goes."""
    every_doc = set(LINK.findall((ROOT / "README.md").read_text(encoding="utf-8")))
    stale = []
    for block in readme_blocks():
        docs = set(LINK.findall(block)) or every_doc
        pages = "\n".join((ROOT / doc).read_text(encoding="utf-8") for doc in docs)
        stale += [f"{figure!r} (cited: {', '.join(sorted(docs))})" for figure in FIGURE.findall(block)
                  if figure not in pages]
    assert not stale, "figures in the README that no doc it cites states:\n" + "\n".join(stale)


def test_the_readme_and_performance_page_stay_short():
    assert len((ROOT / "README.md").read_text(encoding="utf-8").splitlines()) <= 150
    assert len((ROOT / "docs" / "performance.md").read_text(encoding="utf-8").splitlines()) <= 250


# A hexadecimal word of 7-12 characters with a digit and a letter: how a commit is cited.
HASH = re.compile(r"\b(?=[0-9a-f]*[0-9])(?=[0-9a-f]*[a-f])[0-9a-f]{7,12}\b")
# the authors' released repository, read at its own commit (docs/method.md, "The released code")
OTHER_REPOSITORIES = {"0c14b23"}


def test_commits_are_cited_in_the_results_page_only():
    """The README and the reference pages say how things work; which commit measured what is docs/results.md's
    (and the dated pages under docs/history/). A hash elsewhere goes there, with what it measured."""
    pages = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    cited = [f"{page.relative_to(ROOT)}: {h}" for page in pages if page.name != "results.md"
             for h in HASH.findall(page.read_text(encoding="utf-8")) if h not in OTHER_REPOSITORIES]
    assert not cited, cited
    assert HASH.findall((ROOT / "docs" / "results.md").read_text(encoding="utf-8"))  # the pattern finds them there
