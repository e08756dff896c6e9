"""The trainer as Vertex AI installs it: a pip-installable source archive, uploaded once per content hash.

A Vertex ``PythonPackageSpec`` names source archives in Cloud Storage (``package_uris``) and a module
(``python_module``); Vertex installs the archives with pip and runs ``python -m <module> <args>``
(clouds.md §2.1 [GAPIC PythonPackageSpec]). pip builds a ``.tar.gz`` as an sdist: one top-level
directory holding ``pyproject.toml`` (pip strips that directory when every member lies under it).
The SageMaker archive of :mod:`cloud_adapters.packaging` has no such root, so this module re-packs
the same files:

    trainboard-trainer-<sha256[:16] of the packaging archive>/pyproject.toml   (trainer_pkg's own)
    trainboard-trainer-<…>/__init__.py, launch.py, …                          (trainer_pkg's files)

``trainer_pkg/pyproject.toml`` maps the package ``trainer_pkg`` to its own directory
(``package-dir = {"trainer_pkg" = "."}``, it installs with ``pip install ./trainer_pkg``), so the
archive's root *is* that directory and pip installs the package ``trainer_pkg`` (dependencies
``torch>=2.4``, ``numpy``; the ``digits`` extra, scikit-learn, is not requested). The build backend
is setuptools (``requires = ["setuptools>=68"]``), fetched by pip's build isolation in the container.

File selection and the deterministic tar/gzip form are :mod:`cloud_adapters.packaging`'s: the same
trainer gives the same bytes, hence the same name, on any machine, and :func:`upload_once` uploads
nothing when the object is already in the bucket.

A job with the user's code (``JobSpec.code``) gets a second source archive in ``package_uris``,
:func:`build_code_sdist`, named ``trainboard-code-<sha256[:16] of its bytes>.tar.gz``::

    trainboard-code-<h>/pyproject.toml              project trainboard-code-<h>, dependencies = the
                                                    requirements.txt lines, one package:
    trainboard-code-<h>/trainboard_code_<h>/<file>  every file of the user's archive, as package data

where ``<h>`` is the first 16 hex digits of the user archive's SHA-256. pip installs the package beside
``trainer_pkg`` (both archives go to the same site-packages) and its ``dependencies`` with it, which is
how the requirements are installed the Vertex way. The job's ``code.dir`` is the package's directory
name, ``trainboard_code_<h>`` (:func:`code_dir`): relative, so taken relative to the directory that
holds ``trainer_pkg`` (:data:`cloud_adapters.packaging.CODE_DIR_HERE`), which on a replica is that
site-packages directory, wherever the image's Python keeps it.
"""

from __future__ import annotations

import glob
import io
import json
import re
import tarfile
from pathlib import Path
from typing import Any, Callable, TypeVar

from cloud_adapters import packaging
from cloud_adapters.base import CodeBundle, InvalidSpec

T = TypeVar("T")

PACKAGE_DIR = "trainer_pkg/"
CODE_PREFIX = "trainboard-code-"
"""Object name of a code sdist before its hash."""
_REQUIREMENT_NAME = re.compile(r"[A-Za-z0-9]([A-Za-z0-9._-]*[A-Za-z0-9])?(\s*\[|\s*[<>=!~;@(]|\s*$)")
"""The start of a PEP 508 requirement: a project name, then extras, a version, a marker or a URL."""


def build_sdist(source_root: Path | str | None = None) -> packaging.TrainerArchive:
    """The pip-installable archive of ``source_root/trainer_pkg`` (default: this checkout's).

    Members: ``<root>/<path inside trainer_pkg>`` for every file :func:`packaging.build_archive`
    ships under ``trainer_pkg/`` (its entry script and base config are SageMaker's and left out).
    Its :attr:`~cloud_adapters.packaging.TrainerArchive.name` is ``trainboard-trainer-<sha256[:16]>.tar.gz``
    of these bytes. Raises FileNotFoundError when there is no trainer package, ValueError when it has
    no ``pyproject.toml`` (pip could not install it).
    """
    base = packaging.build_archive(source_root)
    root = f"trainboard-trainer-{base.sha256[:16]}"
    with tarfile.open(fileobj=io.BytesIO(base.data), mode="r:gz") as src:
        files = [(m.name[len(PACKAGE_DIR):], src.extractfile(m).read())  # type: ignore[union-attr]
                 for m in src.getmembers() if m.isfile() and m.name.startswith(PACKAGE_DIR)]
    if not any(name == "pyproject.toml" for name, _ in files):
        raise ValueError("trainer_pkg has no pyproject.toml; Vertex AI installs package_uris with pip")
    return packaging.archive_of((f"{root}/{name}", data, 0o644) for name, data in files)


def code_dir(code: CodeBundle) -> str:
    """``trainboard_code_<sha256[:16]>``: the code package's import name, and the job's ``code.dir``."""
    return f"trainboard_code_{code.sha256[:16]}"


def pip_dependencies(requirements: str) -> list[str]:
    """The requirement lines of ``requirements`` (:func:`cloud_adapters.packaging.requirement_lines`) as
    a package's ``dependencies``, each a PEP 508 requirement.

    Raises :class:`InvalidSpec` naming the first line that is a pip option (``-r``, ``--index-url``,
    ``-e``, ``--hash``: a package's metadata cannot carry them) or does not start with a project name.
    """
    out = []
    for line in packaging.requirement_lines(requirements):
        if line.startswith("-") or re.search(r"\s--?[a-z]", line.split(";", 1)[0]):
            raise InvalidSpec(
                f"requirements.txt line {line!r}: Vertex AI installs the code's requirements as its package's "
                f"dependencies, which hold requirements only, not pip options; remove the option (put an index "
                f"or a private package into the executor image instead).")
        if not _REQUIREMENT_NAME.match(line):
            raise InvalidSpec(f"requirements.txt line {line!r}: expected a requirement such as 'requests==2.32.3' "
                              f"or 'numpy>=2; python_version >= \"3.10\"'.")
        out.append(line)
    return out


def build_code_sdist(code: CodeBundle) -> packaging.TrainerArchive:
    """The pip-installable source archive of the user's code (layout: the module docstring).

    Deterministic for the same archive and requirements. Raises :class:`InvalidSpec` when the stored
    archive cannot be read or changed (:func:`cloud_adapters.packaging.code_files`), a member is named
    like ours (:func:`~cloud_adapters.packaging.refuse_ours`) or a requirement cannot be a dependency
    (:func:`pip_dependencies`).
    """
    files = packaging.code_files(code)
    # code.dir goes first on sys.path: a trainer_pkg/ of the user's there would shadow ours.
    packaging.refuse_ours(files, ())
    deps = pip_dependencies(code.requirements)
    package = code_dir(code)
    root = f"{CODE_PREFIX}{code.sha256[:16]}"

    def toml_list(items: list[str]) -> str:  # JSON strings are TOML basic strings
        return "[" + "".join(f"\n    {json.dumps(i)}," for i in items) + ("\n]" if items else "]")

    # Each file named exactly (glob-escaped), so dotfiles and files in any folder are all installed.
    pyproject = (
        "# The user's code archive as a package: Vertex AI pip-installs it from package_uris.\n"
        '[build-system]\nrequires = ["setuptools>=68"]\nbuild-backend = "setuptools.build_meta"\n\n'
        f'[project]\nname = "{root}"\nversion = "0"\ndescription = "Trainboard code archive {code.sha256}"\n'
        f"dependencies = {toml_list(deps)}\n\n"
        f'[tool.setuptools]\npackages = ["{package}"]\ninclude-package-data = false\n\n'
        f"[tool.setuptools.package-data]\n{package} = {toml_list([glob.escape(n) for n, _, _ in files])}\n")
    entries = [(f"{root}/pyproject.toml", pyproject.encode(), 0o644)]
    entries += [(f"{root}/{package}/{name}", data, mode) for name, data, mode in files]
    return packaging.archive_of(entries, prefix=CODE_PREFIX)


def object_name(prefix: str, *parts: str) -> str:
    """``<prefix>/<parts…>`` without empty segments or doubled slashes."""
    return "/".join(p.strip("/") for p in (prefix, *parts) if p.strip("/"))


def upload_once(bucket: Any, archive: packaging.TrainerArchive, *, prefix: str,
                call: Callable[[Callable[[], T]], T] = lambda fn: fn()) -> tuple[str, bool]:
    """Put ``archive`` at ``gs://<bucket>/<prefix>/code/<archive.name>`` unless it is there already.

    ``bucket`` is a ``google.cloud.storage.Bucket``; ``call`` wraps each request (the adapter's retry
    and rate limit). Returns ``(gs:// URI, uploaded)``; ``uploaded`` is False when the object exists
    (same name = same bytes). The upload is conditional (``ifGenerationMatch=0``), so a concurrent
    upload of the same archive answered 412 counts as present.
    """
    from google.api_core import exceptions as gexc

    name = object_name(prefix, "code", archive.name)
    blob = bucket.blob(name)
    uri = f"gs://{bucket.name}/{name}"
    if call(lambda: blob.exists(retry=None, timeout=30)):
        return uri, False
    blob.metadata = {"trainboard-sha256": archive.sha256}

    def upload() -> bool:
        try:
            blob.upload_from_string(archive.data, content_type="application/gzip", if_generation_match=0,
                                    retry=None, timeout=120)
            return True
        except gexc.PreconditionFailed:
            return False

    return uri, call(upload)
