"""Images in data rows: reading and decoding them, and the `<image>` placeholders of prompts.

The conventions of verl / geo3k data, shared by preprocessing (`data.handlers`) and by the
vision-language adapters (`postrl.modality`): a row holds its images as bytes, a path (absolute, or
relative to the data file) or {bytes, path}, and its prompt text marks where each one goes with one
`<image>` placeholder (or holds chat content lists with {"type": "image"} parts).

A path in a row is data, not trusted: `read_row_file` opens it without blocking (a FIFO does not hang the
open), takes only a regular file of at most MAX_IMAGE_BYTES (not /dev/zero, a directory, a FIFO, a device,
a symlink to one), reads at most that many bytes plus one, and gives up past READ_TIMEOUT_S between chunks.
Anything else is a BadImageRow that the callers turn into an error naming the row, as is an image whose
header declares more than MAX_IMAGE_PIXELS (checked before decoding: a small file can decode to gigabytes). (A read blocked in the
kernel, e.g. on a hung network mount, cannot be interrupted from Python; the deadline is checked per chunk.)
"""

from __future__ import annotations

import io
import os
import stat
import time
from pathlib import Path
from typing import Any

IMAGE_PLACEHOLDER = "<image>"
MAX_IMAGE_BYTES = 32 * 2**20  # an encoded image; geo3k's are tens of KiB, a 4K PNG a few MiB
READ_TIMEOUT_S = 30.0
MAX_IMAGE_PIXELS = 8192 * 8192  # a few KiB of PNG can hold more; the VL processors resize to ~12.8M pixels anyway


class BadImageRow(Exception):
    """An image row that cannot be used: `str(exc)` says what is wrong and how to fix it."""


def read_image(item: Any, label: str, base_dir: Path | None = None) -> tuple[bytes, str | None]:
    """(bytes, path) of one image item: bytes, a path, or {bytes, path}; `label` names it in errors."""
    data, path = None, None
    if isinstance(item, (bytes, bytearray)):
        data = bytes(item)
    elif isinstance(item, dict):
        data, path = item.get("bytes"), item.get("path")
    elif isinstance(item, str):
        path = item
    else:
        raise BadImageRow(f"{label} is a {type(item).__name__}; expected bytes, a path or {{bytes, path}}.")
    if not data and path:
        if not isinstance(path, str) or "\0" in path:
            raise BadImageRow(f"{label}: the path {str(path)[:100]!r} is not a file name. Fix: correct the row.")
        p = Path(path).expanduser()
        if not p.is_absolute() and not p.exists() and base_dir is not None:
            p = base_dir / p
        data = read_row_file(p, label, path)
    if not data:
        raise BadImageRow(f"{label} has no bytes and no readable path. Fix: correct the row or drop it.")
    return bytes(data), str(path) if path else None


def read_row_file(path: Path, label: str, name: str | None = None, max_bytes: int = MAX_IMAGE_BYTES,
                  timeout_s: float = READ_TIMEOUT_S) -> bytes:  # fmt: skip
    """The bytes of the regular file at `path`, a file a data row names as `name` (module docstring); BadImageRow
    (`label` and the name in its message) else."""
    where = f"{label}: '{name or path}'"
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC)
    except OSError as exc:
        raise BadImageRow(f"{label}: cannot read '{name or path}' ({exc.strerror}). Fix: correct the path.") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            kind = ("a directory" if stat.S_ISDIR(st.st_mode) else "a FIFO" if stat.S_ISFIFO(st.st_mode)
                    else "a device" if stat.S_ISCHR(st.st_mode) or stat.S_ISBLK(st.st_mode) else "a special file")  # fmt: skip
            raise BadImageRow(f"{where} is {kind}, not a regular file. Fix: point the row at an image file.")
        too_big = (f"{where} has more than {max_bytes} bytes (modality.images.MAX_IMAGE_BYTES), more than an image a "
                   "prompt can hold. Fix: downscale or re-encode it, or drop the row.")  # fmt: skip
        if st.st_size > max_bytes:
            raise BadImageRow(too_big)
        chunks, got, deadline = [], 0, time.monotonic() + timeout_s
        while chunk := os.read(fd, min(2**20, max_bytes + 1 - got)):  # at most max_bytes + 1: a file that grew is caught
            chunks.append(chunk)
            got += len(chunk)
            if got > max_bytes:
                raise BadImageRow(too_big)
            if time.monotonic() > deadline:
                raise BadImageRow(f"{where} was not read within {timeout_s:g} s. Fix: copy the images to a local disk.")
        return b"".join(chunks)
    except OSError as exc:
        raise BadImageRow(f"{label}: cannot read '{name or path}' ({exc.strerror}). Fix: correct the path.") from None
    finally:
        os.close(fd)


def decode_image(data: bytes, label: str):
    """The RGB PIL image of encoded bytes, decoded fully so that a truncated file fails here."""
    from PIL import Image

    try:
        with Image.open(io.BytesIO(data)) as im:  # reads the header only: the size is known before decoding
            if im.width * im.height > MAX_IMAGE_PIXELS:
                raise BadImageRow(
                    f"{label} is {im.width}x{im.height} pixels, over {MAX_IMAGE_PIXELS} (modality.images.MAX_IMAGE_PIXELS; "
                    f"decoded it would take {im.width * im.height * 3 / 2**30:.1f} GiB). Fix: downscale it or drop the row."
                )
            return im.convert("RGB")
    except BadImageRow:
        raise
    except Exception as exc:  # noqa: BLE001 - PIL raises many types for bad data
        raise BadImageRow(
            f"{label} cannot be decoded ({type(exc).__name__}: {exc}). "
            "Fix: re-export the image (PNG or JPEG) or drop the row."
        ) from None


def open_image(item: Any, label: str, base_dir: Path | None = None):
    """One image of a row as an RGB PIL image (a PIL image is taken as is)."""
    if hasattr(item, "convert") and hasattr(item, "size"):  # already a PIL image
        return item.convert("RGB")
    return decode_image(read_image(item, label, base_dir)[0], label)


def has_image_data(images: Any) -> bool:
    """Whether a row's image column holds anything (None and empty lists / arrays do not)."""
    return images is not None and not (hasattr(images, "__len__") and len(images) == 0)


def image_list(images: Any) -> list:
    """A row's image column as a list of items (one image, a list, a tuple or a numpy array of them)."""
    if images is None:
        return []
    if isinstance(images, (bytes, bytearray, str, dict)) or hasattr(images, "convert"):  # one image (PIL has convert)
        return [images]
    return list(images)


def mentions_images(prompt: Any) -> bool:
    """Whether a prompt asks for images: `<image>` placeholders, or {"type": "image"} content parts."""
    messages = [{"content": prompt}] if isinstance(prompt, str) else prompt
    return any(
        IMAGE_PLACEHOLDER in m["content"] if isinstance(m.get("content"), str) else any(p.get("type") == "image" for p in m["content"])
        for m in messages
    )


def image_messages(prompt: Any) -> tuple[list[dict], int]:
    """Chat messages with each `<image>` in the text turned into an image part; and the placeholder count."""
    if isinstance(prompt, str):
        prompt = [{"role": "user", "content": prompt}]
    messages, n = [], 0
    for m in prompt:
        content = m["content"]
        if not isinstance(content, str):  # already a content list
            n += sum(1 for part in content if part.get("type") == "image")
            messages.append({"role": m["role"], "content": list(content)})
            continue
        parts: list[dict] = []
        for i, text in enumerate(content.split(IMAGE_PLACEHOLDER)):
            if i:
                parts.append({"type": "image"})
                n += 1
            if text:
                parts.append({"type": "text", "text": text})
        messages.append({"role": m["role"], "content": parts if i else content})
    return messages, n


def row_images(prompt: Any, images: Any, base_dir: Path | None = None) -> tuple[list[dict], list]:
    """(chat messages with image parts, decoded RGB images) of one row; BadImageRow if they do not match."""
    items = image_list(images)
    messages, n_placeholders = image_messages(prompt)
    if n_placeholders != len(items):
        raise BadImageRow(
            f"the prompt has {n_placeholders} '{IMAGE_PLACEHOLDER}' placeholder(s) but the row has {len(items)} image(s); "
            f"each image needs exactly one placeholder where it goes. Fix: correct the row, or preprocess the data with "
            "`postrl preprocess` (handler geo3k adds missing placeholders)."
        )
    return messages, [open_image(item, f"image {k}", base_dir) for k, item in enumerate(items)]
