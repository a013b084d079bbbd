"""A plain install runs: every module the package imports is a declared runtime dependency.

The image (Dockerfile) and an operator's ``pip install jsqueue`` get the runtime dependencies of
pyproject.toml and nothing else; the development extras that ``make install`` adds (trustme,
pytest, ...) must not be what makes a module importable (DESIGN.md §6, "Installs").
"""

from __future__ import annotations

import ast
import asyncio
import os
import re
import signal
import smtplib
import subprocess
import sys
import tomllib
from importlib.metadata import packages_distributions
from pathlib import Path

import pytest

from support.mx import SmtpdMx
from support.nats import up_env

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "jsqueue"


def _norm(name: str) -> str:
    """A distribution name as PEP 503 compares them."""
    return re.sub(r"[-_.]+", "-", name).lower()


def _declared() -> set[str]:
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    return {_norm(re.split(r"[<>=!~\[; ]", d, maxsplit=1)[0]) for d in deps}


def _top_level_imports(path: Path) -> set[str]:
    """Top-level module names ``path`` imports anywhere (functions included)."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.add(node.module.split(".")[0])
    return found


def test_every_third_party_import_is_a_declared_runtime_dependency() -> None:
    """Each import outside the standard library names a distribution that pyproject.toml
    lists in ``dependencies`` itself (not one that only a dev extra, or another
    dependency's own requirements, happens to bring)."""
    declared = _declared()
    owners = packages_distributions()
    undeclared: dict[str, str] = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        for top in _top_level_imports(path):
            if top in sys.stdlib_module_names or top == "jsqueue":
                continue
            dists = {_norm(d) for d in owners.get(top, [])}
            assert dists, f"{path.relative_to(ROOT)} imports {top}, which no installed dist has"
            if not dists & declared:
                undeclared[top] = str(path.relative_to(ROOT))
    assert undeclared == {}, f"imported but not declared in [project] dependencies: {undeclared}"


def test_the_check_sees_an_undeclared_import(tmp_path: Path) -> None:
    """The check above is not vacuous: a dev-only module (trustme) is found and is not
    declared."""
    module = tmp_path / "m.py"
    module.write_text("def f():\n    import trustme\n    from cryptography import x509\n")
    assert _top_level_imports(module) == {"trustme", "cryptography"}
    assert not {_norm(d) for d in packages_distributions()["trustme"]} & _declared()


def _run(args: list[str], env: dict[str, str] | None = None, cwd: Path | None = None) -> str:
    done = subprocess.run(args, capture_output=True, text=True, check=False, env=env, cwd=cwd)
    assert done.returncode == 0, f"{args} exited {done.returncode}:\n{done.stdout}\n{done.stderr}"
    return done.stdout


def _plain_env(tmp_path: Path) -> dict[str, str]:
    """The environment without this checkout or its virtualenv on any path."""
    env = {k: v for k, v in os.environ.items() if k not in {"PYTHONPATH", "VIRTUAL_ENV"}}
    env["PATH"] = os.pathsep.join(
        p for p in env.get("PATH", "").split(os.pathsep) if not p.startswith(str(ROOT))
    )
    env["HOME"] = env.get("HOME", str(tmp_path))
    return env


@pytest.mark.slow
@pytest.mark.timeout(900)
async def test_a_plain_install_imports_every_module_and_delivers(tmp_path: Path) -> None:
    """The wheel, installed into a fresh virtualenv without extras: every ``jsqueue.*``
    module imports, and ``jsqueue up`` answers ``250`` and delivers to a smarthost."""
    env = _plain_env(tmp_path)
    dist = tmp_path / "dist"
    _run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", str(dist), str(ROOT)])
    [wheel] = dist.glob("jsqueue-*.whl")
    venv = tmp_path / "venv"
    _run([sys.executable, "-m", "venv", str(venv)])
    py = venv / "bin" / "python"
    _run(
        [str(py), "-m", "pip", "install", "-q", "--disable-pip-version-check", str(wheel)], env=env
    )
    installed = _run([str(py), "-m", "pip", "list", "--format=freeze"], env=env).lower()
    assert "jsqueue==" in installed
    assert "trustme" not in installed and "pytest" not in installed, "no dev extra came along"
    imported = _run(
        [
            str(py),
            "-c",
            "import importlib, pkgutil, jsqueue\n"
            "names = [m.name for m in pkgutil.walk_packages(jsqueue.__path__, 'jsqueue.')\n"
            "         if not m.name.endswith('.__main__')]  # programs, not modules\n"
            "for n in names: importlib.import_module(n)\n"
            "print(jsqueue.__file__); print(len(names))",
        ],
        env=env,
        cwd=tmp_path,
    ).split()
    assert imported[0].startswith(str(venv)), "the installed copy, not this checkout"
    assert int(imported[1]) > 100

    async with SmtpdMx("127.0.0.1") as sink:
        jsqueue_env, smtp_port = up_env(tmp_path, env, sink.port)
        proc = await asyncio.create_subprocess_exec(
            str(venv / "bin" / "jsqueue"),
            "up",
            env=jsqueue_env,
            cwd=tmp_path,
            stderr=asyncio.subprocess.PIPE,
        )
        try:
            reply: tuple[int, bytes] | None = None
            async with asyncio.timeout(60):
                while reply is None:
                    try:
                        reply = await asyncio.to_thread(_send, smtp_port)
                    except OSError:
                        await asyncio.sleep(0.2)
            assert reply[0] == 250 and b"queued as" in reply[1], reply
            await sink.wait_for(lambda: len(sink.delivered) == 1, timeout_s=60)
            assert sink.delivered[0].rcpt_to == ["bob@example.test"]
        finally:
            proc.send_signal(signal.SIGTERM)
            _, stderr = await asyncio.wait_for(proc.communicate(), 60)
        assert proc.returncode == 0, stderr.decode(errors="replace")[-2000:]


def _send(port: int) -> tuple[int, bytes]:
    """One message through the front end; the reply to the end of data."""
    with smtplib.SMTP("127.0.0.1", port, timeout=10) as client:
        client.ehlo("client.example.test")
        client.mail("alice@example.test")
        client.rcpt("bob@example.test")
        return client.data(b"Subject: plain install\r\n\r\nhello\r\n")
