"""The docs stay true: the config reference is what the schema generates, every `molt`, `python -m` and bench command
in README.md and docs/ parses with the flags it shows, every REST path they name exists, every JSON config in them
validates, every link reaches its page and heading, the backup command works, troubleshooting quotes real errors,
and every page is reached from the README. The README's quick-start blocks (`<!-- ci: run -->`) run for real in
.ci/run, against the served wheel."""
import argparse
import json
import re
import runpy
import shlex
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]  # docs/history/ is a diary of past commands
OPERATORS = {"&&", "||", "|", ";", "(", ")", "$(", ">", ">>", "<", "&"}
# Placeholders the prose uses in inline commands, and a value of the right kind for each
PLACEHOLDERS = {"ID": "1", "N": "2", "I": "0", "DIR": "somewhere", "OUT": "out", "URL": "http://localhost:8000",
                "T": "token", "FILE": "data.jsonl", "HOST:PORT": "node0:29500"}  # nothing runs: only parsed


def fenced(text: str, language: str) -> list[str]:
    return re.findall(rf"^```{language}\n(.*?)^```", text, flags=re.S | re.M)


def logical_lines(block: str) -> list[str]:
    """A block's commands: continuation lines and quotes that span lines joined."""
    out, pending = [], ""
    for line in block.splitlines():
        pending = f"{pending}\n{line}" if pending else line
        if pending.endswith("\\"):
            pending = pending[:-1]
            continue
        try:
            shlex.split(pending, comments=True)
        except ValueError:  # a quote still open
            continue
        out.append(pending)
        pending = ""
    return out


def simple_commands(line: str) -> list[list[str]]:
    """`a && b | c > f` -> [a], [b], [c], [f]: each simple command's words."""
    lexer = shlex.shlex(line, posix=True, punctuation_chars="&|;()<>")
    lexer.whitespace_split, lexer.commenters = True, "#"
    commands, words = [], []
    for token in lexer:
        if token in OPERATORS or set(token) <= set("&|;()<>"):
            commands.append(words)
            words = []
        else:
            words.append(token)
    return [c for c in commands + [words] if c]


def documented_commands() -> list[tuple[str, list[str], bool]]:
    """(page, words, inline) of every command a reader types: in bash blocks, and `molt ...` spans of the prose."""
    found = []
    for page in PAGES:
        text = page.read_text()
        for block in fenced(text, "bash"):
            for line in logical_lines(block):
                found += [(page.name, words, False) for words in simple_commands(line)]
        for span in re.findall(r"`(molt [^`]+)`", text):
            # a synopsis (`molt runs list|get`) or a command's name (`molt runs`) is not a command line
            if not re.search(r"\[|\||…|\.\.\.", span) and len(span.split()) > 2:
                found.append((page.name, [PLACEHOLDERS.get(w, w) for w in shlex.split(span)], True))
    return found


def checked(words: list[str]) -> bool:
    if words[0] == "molt":
        return True
    if words[0] not in ("python", "python3") or len(words) < 2:
        return False
    ours = words[1] == "-m" and words[2].split(".")[0] in ("molt_engine", "molt_envs", "daemon", "app")  # not `-m pytest`
    return ours or words[1].startswith("bench/")


COMMANDS = [c for c in documented_commands() if checked(c[1])]


class Parsed(Exception):
    """Raised in place of running the command, once its arguments have parsed."""


def parse(words: list[str], monkeypatch) -> None:
    """Parses the command line as its program does, and stops there; argparse exits 2 on a flag it lacks."""
    if words[0] == "molt":
        from app.cli import main
        main(words[1:])
    elif words[1] == "-m":
        monkeypatch.setattr("molt_engine.envs.ENVS", {})  # the module runs again as __main__: its envs register anew
        monkeypatch.setattr(sys, "argv", [words[2], *words[3:]])
        runpy.run_module(words[2], run_name="__main__", alter_sys=True)
    else:
        monkeypatch.setattr("molt_engine.envs.ENVS", {})  # a script run before registered its envs (bench/agents.py)
        monkeypatch.setattr(sys, "argv", words[1:])
        runpy.run_path(str(ROOT / words[1]), run_name="__main__")


@pytest.mark.parametrize("doc, words, inline", COMMANDS, ids=[f"{p}: {' '.join(w)[:80]}" for p, w, _ in COMMANDS])
def test_every_documented_command_parses(doc, words, inline, monkeypatch, capsys, tmp_path):
    """A command of a code block must parse whole. One named in the prose (`molt train --report-to`) may leave out
    values and required flags, so there it is enough that its program has every flag it names."""
    monkeypatch.chdir(tmp_path)  # where relative paths land, should a program act before it parses
    monkeypatch.setenv("MOLT_HOME", str(tmp_path / "home"))
    parse_args, parse_known_args = argparse.ArgumentParser.parse_args, argparse.ArgumentParser.parse_known_args
    parsing = []  # the program's own parse in progress: argparse's inner calls (subcommands) go through untouched

    def parse_then_stop(self, args=None, namespace=None, parse=parse_args):
        if parsing:
            return parse(self, args, namespace)
        parsing.append(self)
        try:
            parse(self, args, namespace)
        finally:
            parsing.pop()
        raise Parsed

    def parse_known_then_stop(self, args=None, namespace=None):  # `molt daemon start` passes the rest on
        return parse_then_stop(self, args, namespace, parse=parse_known_args)

    monkeypatch.setattr(argparse.ArgumentParser, "parse_args", parse_then_stop)
    monkeypatch.setattr(argparse.ArgumentParser, "parse_known_args", parse_known_then_stop)
    monkeypatch.syspath_prepend(str(ROOT / "bench"))
    try:
        with pytest.raises(Parsed):
            parse(words, monkeypatch)
        return
    except SystemExit:
        error = capsys.readouterr().err.strip()
    assert inline, f"{doc}: `{' '.join(words)}` does not parse: {error}"
    path = [w for w in words[1:words.index(next((w for w in words if w.startswith("-")), words[-1]))]]
    if not all(re.fullmatch(r"[a-z][a-z-]*", w) for w in path):
        return  # prose quoting an error message (`molt runs: cannot reach ...`), not a command
    with pytest.raises(SystemExit):
        parse([words[0], *path, "--help"], monkeypatch)
    usage = capsys.readouterr().out
    missing = [w.split("=")[0] for w in words if w.startswith("--") and w.split("=")[0] not in usage]
    assert not missing, f"{doc}: `{' '.join(words)}`: `{' '.join([words[0], *path])}` has no {missing}"


def test_the_docs_show_commands_of_every_kind():
    kinds = {(w[0], w[1] if w[0] == "molt" else w[1].split("/")[0]) for _, w, _ in COMMANDS}
    for kind in [("molt", "serve"), ("molt", "train"), ("molt", "runs"), ("molt", "eval"), ("molt", "daemon"),
                 ("python", "bench"), ("python", "-m")]:
        assert kind in kinds, f"no {' '.join(kind)} command found in the docs: the extraction broke"


def rest_paths() -> list[tuple[str, str, str]]:
    """(page, method, path) of every /api/v1 path the docs name: `GET /api/v1/...` in prose, and curl URLs."""
    found = []
    for page in PAGES:
        text = page.read_text()
        for method, path in re.findall(r"\b(GET|POST|PATCH|DELETE|PUT) (/api/v1/[^\s`?]*)", text):
            found.append((page.name, method, path))
        for block in fenced(text, "bash"):
            for line in logical_lines(block):
                for words in simple_commands(line):
                    if words[0] != "curl":
                        continue
                    method = "POST" if {"-d", "--data"} & set(words) else "GET"
                    if "-X" in words:
                        method = words[words.index("-X") + 1]
                    for url in (w for w in words if "/api/v1/" in w):
                        found.append((page.name, method, "/api/v1/" + url.split("/api/v1/", 1)[1].split("?")[0]))
    return found


def test_every_documented_rest_path_exists(tmp_path):
    from app.main import create_app
    schema = create_app(tmp_path, "a-token").openapi()["paths"]
    routes = [(re.compile("^" + re.sub(r"\{[^}]+\}", "[^/]+", path) + "$"), methods)  # {run_id} matches 3 or $id
              for path, methods in schema.items()]
    found = rest_paths()
    assert len(found) > 10, "the extraction of REST paths broke"
    missing = [f"{page}: {method} {path}" for page, method, path in found
               if not any(pattern.match(path) and method.lower() in methods for pattern, methods in routes)]
    assert not missing, f"the docs name paths the API does not have: {missing}"


def test_every_json_config_in_the_docs_validates():
    from molt_engine.config import RunConfig
    configs = [(page.name, json.loads(block)) for page in PAGES for block in fenced(page.read_text(), "json")]
    configs = [(page, c) for page, c in configs if isinstance(c, dict) and "env" in c]
    assert configs, "no JSON config found in the docs: the extraction broke"
    for page, config in configs:
        RunConfig.model_validate(config)  # raises naming the field


def test_the_config_reference_is_generated_from_the_schema():
    generate = runpy.run_path(str(ROOT / "docs" / "gen_config_reference.py"))
    written = (ROOT / "docs" / "config.md").read_text()
    assert written == generate["render"](), (
        f"docs/config.md is out of date with molt_engine/config.py: regenerate it with `{generate['COMMAND']}`")


def test_every_docs_page_is_reached_from_the_readme():
    readme = (ROOT / "README.md").read_text()
    unlinked = [p.name for p in PAGES[1:] if f"](docs/{p.name})" not in readme]
    assert not unlinked, f"pages the README does not link to (add a row to its Documentation table): {unlinked}"
    assert len(readme.splitlines()) <= 200, "the README is a short start: move detail into docs/"


def test_the_readme_marks_its_quick_start_for_ci():
    readme = (ROOT / "README.md").read_text()
    blocks = re.findall(r"<!-- ci: run -->\n```bash\n(.*?)^```", readme, flags=re.S | re.M)
    assert any("molt runs create" in b for b in blocks) and any("curl" in b for b in blocks)
    assert "<!-- ci: run -->" in (ROOT / ".ci" / "run").read_text()


def slug(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation dropped, spaces as hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def test_every_link_in_the_docs_reaches_its_file_and_heading():
    broken = []
    for page in [*PAGES, *sorted((ROOT / "docs" / "history").glob("*.md")), ROOT / "CHANGELOG.md"]:
        for target in re.findall(r"\]\(([^)\s]+)\)", page.read_text()):
            if re.match(r"https?://", target):
                continue
            path, _, anchor = target.partition("#")
            file = (page.parent / path).resolve() if path else page
            if not file.exists():
                broken.append(f"{page.name}: {target}")
            elif anchor and file.suffix == ".md":
                prose = re.sub(r"^```.*?^```", "", file.read_text(), flags=re.S | re.M)  # a `# comment` is no heading
                headings = re.findall(r"^#+ (.+)$", prose, re.M)
                if anchor not in {slug(h) for h in headings}:
                    broken.append(f"{page.name}: {target} (no such heading)")
    assert not broken, f"links to nowhere: {broken}"


def test_the_backup_command_copies_a_live_database(tmp_path):
    """docs/operations.md's backup, run as written in a data directory whose database the daemon has open."""
    import subprocess

    from daemon.records import Records
    block = next(b for b in fenced((ROOT / "docs" / "operations.md").read_text(), "bash") if "backup" in b)
    records = Records(tmp_path)
    run = records.create_run({"env": "max_digit"}, name="kept")
    subprocess.run(["bash", "-euo", "pipefail", "-c", block], cwd=tmp_path, check=True)
    (tmp_path / "restored").mkdir()
    (tmp_path / "molt-backup.db").rename(tmp_path / "restored" / "molt.db")  # restored: the copy as the database
    assert Records(tmp_path / "restored").get_run(run["id"])["name"] == "kept"


# The troubleshooting page's refused configs: each message as the page quotes it, and a config that gets it
REFUSALS = {
    "loop.stpes: Extra inputs are not permitted": {"env": "max_digit", "loop": {"stpes": 3}},
    "loop.steps: Input should be a valid integer": {"env": "max_digit", "loop": {"steps": "3"}},
    "unknown env 'x'; known: ": {"env": "x"},
    "env_args: env 'calculator' got unknown args: ": {"env": "calculator", "env_args": {"foo": 1}},
    "env 'chat_calculator' speaks chat messages, but the policy's tokenizer has no chat template":
        {"env": "chat_calculator"},
    "loop.group_size must be >= 2 with the group estimator 'grpo'": {"env": "max_digit", "loop": {"group_size": 1}},
    "unknown preset 'x'": {"env": "max_digit", "model": {"preset": "x"}},
}


@pytest.mark.parametrize("message", REFUSALS)
def test_the_troubleshooting_page_quotes_the_errors_as_they_are(message):
    from molt_engine.config import RunConfig, ValidationError, config_errors
    assert message in (ROOT / "docs" / "troubleshooting.md").read_text()
    with pytest.raises(ValidationError) as refused:
        RunConfig.model_validate(REFUSALS[message])
    assert any(message in line for line in config_errors(refused.value)), config_errors(refused.value)
