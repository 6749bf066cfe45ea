"""The import contracts `make lint` runs: the layers hold, and the import-time contract
tells an import that runs when a module is imported from one inside a function."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LINT_IMPORTS = Path(sys.executable).with_name("lint-imports")


def _lint(folder: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(folder), str(ROOT)])}
    return subprocess.run(
        [str(LINT_IMPORTS), "--no-cache", *args],
        cwd=folder,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_the_project_keeps_its_contracts() -> None:
    result = _lint(ROOT)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "5 kept, 0 broken" in result.stdout


def _package(tmp_path: Path, files: dict[str, str]) -> Path:
    for name, text in files.items():
        path = tmp_path / "toy" / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text))
    (tmp_path / "pyproject.toml").write_text(
        textwrap.dedent(
            """
            [tool.importlinter]
            root_packages = ["toy"]
            include_external_packages = true
            contract_types = ["import_time: lint.import_time.ImportTimeContract"]

            [[tool.importlinter.contracts]]
            name = "toy.light does not load json when imported"
            type = "import_time"
            source_modules = ["toy.light"]
            forbidden_modules = ["json"]
            """
        )
    )
    return tmp_path


def test_an_import_inside_a_function_or_type_checking_block_is_allowed(tmp_path: Path) -> None:
    folder = _package(
        tmp_path,
        {
            "__init__.py": "",
            "light.py": """
                from typing import TYPE_CHECKING

                from toy import heavy

                if TYPE_CHECKING:
                    import json


                def later():
                    from toy import loader
            """,
            "heavy.py": "def f():\n    import json\n",
            "loader.py": "import json\n",
        },
    )
    result = _lint(folder)
    assert result.returncode == 0, result.stdout + result.stderr


def test_a_chain_at_import_time_breaks_the_contract_and_is_shown(tmp_path: Path) -> None:
    folder = _package(
        tmp_path,
        {
            "__init__.py": "",
            "light.py": "from toy import middle\n",
            "middle.py": "try:\n    import toy.deep.loader\nexcept ImportError:\n    pass\n",
            "deep/__init__.py": "",
            "deep/loader.py": "class Holder:\n    import json\n",
        },
    )
    result = _lint(folder)
    assert result.returncode == 1
    assert "toy.light loads json when imported" in result.stdout
    assert "toy.deep.loader -> json" in result.stdout


def test_a_parent_package_runs_when_a_submodule_is_imported(tmp_path: Path) -> None:
    folder = _package(
        tmp_path,
        {
            "__init__.py": "",
            "light.py": "import toy.sub.leaf\n",
            "sub/__init__.py": "import json\n",
            "sub/leaf.py": "",
        },
    )
    result = _lint(folder)
    assert result.returncode == 1
    assert "toy.sub -> json" in result.stdout
