"""Image bytes from a client turned into pixels, within bounds checked before anything is decoded.

Pillow reads the header first (format and size, a few hundred bytes), so a small file that declares a
huge image is refused before its pixels are allocated. The content hash is over the decoded pixels,
not the file: the same picture sent as PNG and as lossless WebP is one image to the embedding cache.
"""

from __future__ import annotations

import hashlib
import io
import warnings
from dataclasses import dataclass

from PIL import Image

from pdserve.engine.sampling_params import BadParameter

# Formats decoded; others (PSD, EPS through Ghostscript, ...) are refused: less decoder surface.
ALLOWED_FORMATS = frozenset({"PNG", "JPEG", "WEBP", "GIF", "BMP"})
# Longest side over shortest: past it an image processor that scales the short side up to its size
# (CLIP's) would make gigapixels of a strip of a few kilobytes.
MAX_ASPECT_RATIO = 50


@dataclass(frozen=True)
class ImageLimits:
    """Bounds on a request's images, checked before decoding."""

    max_images: int = 8
    max_bytes: int = 8 << 20  # one encoded image
    max_pixels: int = 4096 * 4096  # one image, width x height

    def check_count(self, count: int) -> None:
        if count > self.max_images:
            raise BadParameter("images", f"a request may carry at most {self.max_images} images, got {count}")


@dataclass(frozen=True)
class DecodedImage:
    pixels: Image.Image  # RGB
    content_hash: bytes  # 16 bytes over the mode, size and pixels

    @property
    def size(self) -> tuple[int, int]:
        return self.pixels.size


def check_image_header(data: bytes, limits: ImageLimits, index: int = 0) -> None:
    """What the router checks before a request is placed: the size in bytes, the format and the
    declared pixel count (Pillow reads only the header). BadParameter saying what is wrong."""
    _open(data, limits, index).close()


def decode_image(data: bytes, limits: ImageLimits, index: int = 0) -> DecodedImage:
    """Decode one image, or raise BadParameter saying what is wrong with it (never the peer's bytes)."""
    image = _open(data, limits, index)
    try:
        image.load()
        rgb = image.convert("RGB")
    except (OSError, SyntaxError, ValueError, Image.DecompressionBombError) as e:
        raise _undecodable(index, e) from None
    return DecodedImage(rgb, pixel_hash(rgb))


def _open(data: bytes, limits: ImageLimits, index: int) -> Image.Image:
    what = f"image {index}"
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise BadParameter("images", f"{what} must be bytes, got {type(data).__name__}")
    if len(data) > limits.max_bytes:
        raise BadParameter("images", f"{what} has {len(data)} bytes, more than the {limits.max_bytes} allowed")
    try:
        with warnings.catch_warnings():  # Pillow's own bound warns below twice its limit: ours is the bound
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)
            image = Image.open(io.BytesIO(data), formats=sorted(ALLOWED_FORMATS))
    except Image.DecompressionBombError:  # past twice Pillow's own bound, far past any of ours
        raise BadParameter("images", f"{what} declares more than the {limits.max_pixels} pixels allowed") from None
    except (OSError, SyntaxError, ValueError) as e:
        raise _undecodable(index, e) from None
    width, height = image.size
    if width * height > limits.max_pixels:
        raise BadParameter("images", f"{what} is {width}x{height} pixels, more than the {limits.max_pixels} allowed")
    if width == 0 or height == 0:
        raise BadParameter("images", f"{what} is empty ({width}x{height} pixels)")
    if max(width, height) > MAX_ASPECT_RATIO * min(width, height):
        raise BadParameter("images", f"{what} is {width}x{height} pixels: its sides differ more than "
                                     f"{MAX_ASPECT_RATIO} times")
    return image


def _undecodable(index: int, error: BaseException) -> BadParameter:
    # Pillow's message may quote the file; its type says enough.
    return BadParameter("images", f"image {index} is not a decodable {'/'.join(sorted(ALLOWED_FORMATS))} image "
                                  f"({type(error).__name__})")


def pixel_hash(image: Image.Image) -> bytes:
    h = hashlib.blake2b(digest_size=16)
    h.update(f"{image.mode}:{image.width}x{image.height}:".encode())
    h.update(image.tobytes())
    return h.digest()
