"""No stored string reaches a terminal as control codes (audit finding G3): the terminal
layer shows every control character but newline and tab, and the bidi controls, as a
visible character, in whatever it prints; nothing in the command line writes to the
terminal another way (the lint); and every command that shows stored text, given a study
imported from a file whose name holds escapes, prints none of them."""

from __future__ import annotations

import io
import json
import re
from pathlib import Path

import pytest
from conftest import isolated_env, posbench_cli, study_results
from rich.console import ColorSystem

from core.terminal import console, echo, run_progress, styled, visible

ESC, BEL = "\x1b", "\x07"
HOSTILE = (
    "a\x1b[2J"  # clear the screen
    "\x1b]0;owned\x07"  # the window title
    "\x1b]8;;http://evil.example/\x1b\\link\x1b]8;;\x1b\\"  # a hyperlink
    "\rforged line\n"
    "\u202eevil\u202c\x9b31m\x7f"  # bidi override, C1 CSI, DEL
)
SGR = re.compile(r"\x1b\[[0-9;]*m")  # the styles a console adds itself


def test_every_control_but_newline_and_tab_becomes_one_visible_character() -> None:
    shown = visible(HOSTILE)
    assert len(shown) == len(HOSTILE)  # styled spans keep lining up
    assert "\x1b" not in shown and "\r" not in shown and "\x07" not in shown
    assert "\u202e" not in shown and "\x9b" not in shown and "\x7f" not in shown
    assert shown.startswith("a\u241b[2J\u241b]0;owned\u2407")
    assert "\n" in shown and visible("a\tb\nc") == "a\tb\nc"
    assert visible("\u200f\u2066x\u2069") == "\ufffd\ufffdx\ufffd"


def test_the_console_shows_controls_and_keeps_its_own_styles() -> None:
    buffer = io.StringIO()
    shown = console()
    shown.file, shown.width = buffer, 200
    shown._force_terminal = True
    shown._color_system = ColorSystem.STANDARD  # as on a colour terminal
    shown.print(HOSTILE)
    shown.print(styled(("bold", "bold"), " ", HOSTILE))
    progress = run_progress(shown, label_width=20)
    progress.add_task(HOSTILE, total=1, status=HOSTILE)
    shown.print(progress.get_renderable())
    written = buffer.getvalue()
    assert SGR.search(written)  # its own styles pass
    assert ESC not in SGR.sub("", written) and BEL not in written
    assert "\u241b[2J" in written


def test_echo_writes_a_line_with_its_controls_shown(capsys) -> None:
    echo(HOSTILE, err=True)
    echo("plain")
    captured = capsys.readouterr()
    assert captured.out == "plain\n"
    assert captured.err == visible(HOSTILE) + "\n"


PLANTED = """\
import sys, typer, click
print("x")
typer.echo("x", err=True)
click.echo("x")
sys.stdout.write("x")
sys.stderr.write("x")
"""


def test_the_lint_refuses_every_other_way_to_the_terminal(tmp_path: Path, monkeypatch) -> None:
    from lint import terminal_output

    planted = tmp_path / "planted.py"
    planted.write_text(PLANTED)
    assert list(terminal_output.findings(planted)) == []  # outside jobs/ and db/: allowed
    monkeypatch.setattr(terminal_output, "ECHO_THROUGH_THE_LAYER", [tmp_path])
    found = [line.split(": ", 1)[1] for line in terminal_output.findings(planted)]
    assert [f.split("(")[0] for f in found] == [
        "print",
        "typer.echo",
        "click.echo",
        "stdout.write",
        "stderr.write",
    ]
    assert terminal_output.main([]) == 0  # the project's own code


def test_a_corpus_path_with_a_control_character_is_refused() -> None:
    from core.spec import parse_spec
    from core.spec.base import SpecError

    with pytest.raises(SpecError, match="control or separator character") as refused:
        parse_spec({"encodings": ["nope"], "task": {"name": "lm", "corpus": "text:a\x1b[2Jb"}})
    assert ESC not in str(refused.value)


@pytest.mark.slow
def test_no_command_prints_an_imported_files_escapes(tmp_path: Path) -> None:
    """The audit's reproduction: a results file named with a screen clear, a title, a
    hyperlink and a forged line, imported; every command that shows the stored name (or
    the study's other stored text) prints no control code."""
    document = study_results(
        {
            "name": "controls",
            "model": "tiny",
            "train": {"length": 16, "steps": 2, "batch_size": 2, "val_every": 0},
            "encodings": ["nope"],
            "eval": {"lengths": [16], "tokens": 64, "variants": ["none"]},
        },
        device="cpu",
    )
    folder = tmp_path / "drop"
    folder.mkdir()
    hostile = folder / f"{HOSTILE.replace('/', '_')}.json"
    hostile.write_text(json.dumps(document))
    env = isolated_env(tmp_path / "home", COLUMNS="200")
    assert posbench_cli("db", "upgrade", env=env).returncode == 0
    imported = posbench_cli("import", str(hostile), env=env)
    assert imported.returncode == 0, imported.stderr
    study = json.loads(posbench_cli("status", "--json", env=env).stdout)[0]["id"]
    commands = [
        ["import", str(hostile)],  # refused again: it names the file
        ["status"],
        ["status", str(study)],
        ["status", "--events"],
        ["results", "--study", str(study)],
        ["results", "--study", str(study), "--view", "summaries"],
        ["results", "--study", str(study), "--format", "csv"],
        ["results", "--study", str(study), "--format", "json"],
    ]
    shown_visibly = []
    for args in commands:
        done = posbench_cli(*args, env=env)
        output = done.stdout + done.stderr
        assert ESC not in output and BEL not in output and "\r" not in output, (args, output)
        assert "\u202e" not in output and "\x9b" not in output, args
        shown_visibly.append("\u241b[2J" in output)
    assert any(shown_visibly)  # the name is shown, visibly
