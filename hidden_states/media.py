"""The media parts of a chat request (images, audio), checked before any engine work: no vLLM here.

`check_media` refuses, with a HiddenStatesRequestError (a 400) whose `param` names the part
(`messages[0].content[1].image_url`), what the engine would fail on later or should not do:

- a part type this server does not know (`video_url`, `image_embeds`, ...);
- a data URL that is not `data:<type>/<subtype>;base64,<payload>`, or a payload that is not strict
  base64 (the alphabet with `=` padding: no whitespace, no URL-safe alphabet, as vLLM decodes it);
- an image whose bytes are not a format vLLM's image loader opens (its header is read with Pillow and
  `verify()`ed; the pixels are not decoded);
- audio (`input_audio`, or an `audio_url` data URL) that vLLM's decoder cannot read (soundfile: WAV,
  FLAC, MP3, OGG; its header and first frame are read), with no samples, at a rate outside
  AUDIO_RATES, or declared in a `format` outside AUDIO_FORMATS (any rate inside is resampled to the
  model's: hidden_states/vllm/patches/audio_resampler.py);
- a part whose decoded bytes are above `max_media_bytes`;
- a remote (http/https) URL when `remote_media` is off: the engine would fetch it, while the request
  holds a replica; a file: URL unless the engine has an `allowed_local_media_path` (vLLM reads it
  there, and refuses paths outside it); any other URL scheme (ftp:, ...) always.

Text parts, string contents, and requests without `messages` pass untouched; a request with no media
part costs a walk over its parts' `type`s (nothing is decoded). `count_media` counts the media parts
per modality.
"""

from __future__ import annotations

import base64
import binascii
import io
import re
from collections.abc import Iterator, Mapping
from typing import Any

from hidden_states.params import HiddenStatesRequestError

DEFAULT_MAX_MEDIA_BYTES = 8 * 2**20

# Parts that carry no media: vLLM's text part types (renderers/chat_utils.py _TEXT_CONTENT_PART_TYPES).
TEXT_PART_TYPES = frozenset({"text", "input_text", "output_text", "refusal", "thinking", "tool_reference"})
# The media part types this server takes, and their modality.
MEDIA_PART_TYPES = {"image_url": "image", "input_audio": "audio", "audio_url": "audio"}
KNOWN_PART_TYPES = TEXT_PART_TYPES | set(MEDIA_PART_TYPES)
# Keys vLLM reads a media part by when it has no `type` (and those of the parts refused here).
_MEDIA_KEYS = (
    "image_url",
    "input_audio",
    "audio_url",
    "video_url",
    "image_embeds",
    "audio_embeds",
    "video_embeds",
    "prompt_embeds",
    "image_pil",
    "input_image",
)

# The formats vLLM's image loader opens (vllm/multimodal/image.py ALLOWED_IMAGE_FORMATS, vLLM 0.32;
# tests/unit/test_media.py checks they agree): Pillow's in-process raster readers.
IMAGE_FORMATS: tuple[str, ...] = (
    "AVIF",
    "BLP",
    "BMP",
    "CUR",
    "DCX",
    "DDS",
    "DIB",
    "FITS",
    "FLI",
    "FTEX",
    "GBR",
    "GIF",
    "ICNS",
    "ICO",
    "IM",
    "IMT",
    "IPTC",
    "JPEG",
    "JPEG2000",
    "MCIDAS",
    "MSP",
    "PCD",
    "PCX",
    "PIXAR",
    "PNG",
    "PPM",
    "PSD",
    "QOI",
    "SGI",
    "SPIDER",
    "SUN",
    "TGA",
    "TIFF",
    "WEBP",
    "XBM",
    "XPM",
    "XVTHUMB",
)
COMMON_FORMATS = "PNG, JPEG, WEBP, GIF or BMP"

_MIME = re.compile(r"[A-Za-z0-9][\w.+-]*/[\w.+-]+")
_DATA_URL = "data:<type>/<subtype>;base64,<payload>"
_PARTS = "`text`, `image_url` (a data URL) and `input_audio` ({data: base64, format})"


def _part_type(part: Mapping[str, Any]) -> Any:
    """The part's `type`; without one, the media key vLLM would read it by (None if it has none)."""
    if "type" in part:
        return part["type"]
    return next((key for key in _MEDIA_KEYS if key in part), None)


def media_parts(req: Mapping[str, Any]) -> Iterator[tuple[str, str, Mapping[str, Any]]]:
    """(where, type, part) of each content part that is not text, in order: `where` is
    `messages[i].content[j]`. Only list contents of object messages are read."""
    messages = req.get("messages")
    if not isinstance(messages, list):
        return
    for i, message in enumerate(messages):
        content = message.get("content") if isinstance(message, dict) else None
        if not isinstance(content, list):
            continue
        for j, part in enumerate(content):
            if isinstance(part, dict) and not (isinstance(kind := part.get("type"), str) and kind in TEXT_PART_TYPES):
                yield f"messages[{i}].content[{j}]", _part_type(part), part


def count_media(req: Mapping[str, Any]) -> dict[str, int]:
    """Media parts per modality, e.g. {"image": 2, "audio": 1}; parts of unknown types are not counted."""
    counts: dict[str, int] = {}
    for _, kind, _ in media_parts(req):
        if isinstance(kind, str) and kind in MEDIA_PART_TYPES:
            modality = MEDIA_PART_TYPES[kind]
            counts[modality] = counts.get(modality, 0) + 1
    return counts


def check_media(
    req: Mapping[str, Any],
    *,
    max_media_bytes: int = DEFAULT_MAX_MEDIA_BYTES,
    remote_media: bool = False,
    local_media: bool = False,
) -> None:
    """Refuse (HiddenStatesRequestError, `param` the part) the first bad media part (module docstring)."""
    for where, kind, part in media_parts(req):
        if kind is None:
            raise HiddenStatesRequestError(f"{where} has no `type`: this server takes {_PARTS} parts", f"{where}.type")
        if not isinstance(kind, str) or kind not in MEDIA_PART_TYPES:
            raise HiddenStatesRequestError(
                f"{where} is a {kind!r} part, which this server does not take: it takes {_PARTS} parts", f"{where}.type"
            )
        field = f"{where}.{kind}"
        value = part.get(kind)
        cached = part.get("uuid") is not None  # vLLM's media cache: a uuid alone names media sent before
        if kind == "input_audio":
            data = value.get("data") if isinstance(value, dict) else None
            if not data and cached and (value is None or isinstance(value, dict)):
                continue
            if not isinstance(value, dict) or not isinstance(data, str) or not data:
                raise HiddenStatesRequestError(
                    f'{field} must be an object {{"data": <base64 of the audio file>, "format": one of '
                    f"{', '.join(AUDIO_FORMATS)}}} with non-empty data",
                    field,
                )
            fmt = value.get("format")
            _check_audio(_decode(data, field, "audio", max_media_bytes), field, None if fmt is None else str(fmt))
            continue
        url = value.get("url") if isinstance(value, dict) else value if "type" not in part else None
        if url is None and cached:
            continue
        if not isinstance(url, str):
            raise HiddenStatesRequestError(f'{field} must be an object {{"url": "{_DATA_URL}"}}', field)
        modality = MEDIA_PART_TYPES[kind]
        got = _url_bytes(url, field, modality, max_media_bytes, remote_media, local_media)
        if got is not None and modality == "image":
            _check_image(got[1], got[0], field)
        elif got is not None:
            _check_audio(got[1], field)


def _url_bytes(
    url: str, field: str, modality: str, max_bytes: int, remote_media: bool, local_media: bool = False
) -> tuple[str, bytes] | None:
    """(declared media type, decoded bytes) of a data URL; None for a URL the engine may read itself (a
    remote one with remote_media, a file: one where the engine has an allowed_local_media_path)."""
    if url[:5].lower() != "data:":
        scheme = url.partition(":")[0].lower() if re.match(r"[A-Za-z][\w+.-]*:", url) else ""
        if scheme == "file" and local_media:
            return None
        if scheme in ("http", "https"):
            if remote_media:
                return None
            raise HiddenStatesRequestError(
                f"{field}: this server does not fetch remote media (remote_media is off); send the {modality} "
                f"as a data URL: {_DATA_URL}",
                field,
            )
        raise HiddenStatesRequestError(
            f"{field}: the url is not a data URL ({_DATA_URL})"
            + (f"; {scheme}: URLs are not read" if scheme else "")
            + (", nor http(s) URLs fetched (remote_media is off)" if not remote_media else ""),
            field,
        )
    header, comma, payload = url[5:].partition(",")
    if not comma:
        raise HiddenStatesRequestError(
            f"{field}: malformed data URL: no ',' before the payload; expected {_DATA_URL}", field
        )
    params = header.split(";")
    if len(params) < 2 or params[-1].lower() != "base64":
        raise HiddenStatesRequestError(
            f"{field}: malformed data URL: only base64 data URLs are taken (`;base64` before the ','): {_DATA_URL}",
            field,
        )
    mime = params[0]
    if not _MIME.fullmatch(mime):
        raise HiddenStatesRequestError(
            f"{field}: malformed data URL: {mime!r} is not a media type "
            f"(type/subtype, e.g. {'image/png' if modality == 'image' else 'audio/wav'}): "
            f"{_DATA_URL}",
            field,
        )
    return mime, _decode(payload, field, modality, max_bytes)


def _decode(payload: str, field: str, modality: str, max_bytes: int) -> bytes:
    """Strict base64 (as vLLM's pybase64.b64decode(validate=True)), within the size limit."""
    # The decoded size from the length, before decoding: a payload above the limit is not decoded.
    size = len(payload) // 4 * 3 - (len(payload) - len(payload.rstrip("=")) if len(payload) % 4 == 0 else 0)
    if size > max_bytes:
        raise _too_large(field, modality, size, max_bytes)
    try:
        data = base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError) as e:  # ValueError: a str with non-ASCII characters
        raise HiddenStatesRequestError(
            f"{field}: the {modality} payload is not valid base64 ({e}); send standard base64 (A-Z a-z 0-9 + /, "
            f"'=' padding, no whitespace)",
            field,
        ) from None
    if len(data) > max_bytes:
        raise _too_large(field, modality, len(data), max_bytes)
    return data


# The audio files vLLM's decoder reads (soundfile, libsndfile 1.2: its own sniffing, whatever the declared
# format), by the names `input_audio.format` takes; any sample rate in AUDIO_RATES is resampled to the
# model's (hidden_states/vllm/patches/audio_resampler.py: soxr).
AUDIO_FORMATS = ("wav", "flac", "mp3", "ogg")
AUDIO_RATES = (1000, 384000)  # Hz: outside, a clip is refused (soxr's ratios stay sane; nothing real is cut)


def _check_audio(data: bytes, field: str, declared: str | None = None) -> None:
    """The bytes are an audio file vLLM's decoder reads (header and a first frame, not the whole clip),
    with frames, at a rate this server resamples; `declared`: input_audio's `format`, one of AUDIO_FORMATS."""
    import soundfile

    if declared is not None and declared.lower() not in AUDIO_FORMATS:
        raise HiddenStatesRequestError(
            f"{field}: unknown audio format {declared!r}: send one of {', '.join(AUDIO_FORMATS)}", f"{field}.format"
        )
    try:
        with soundfile.SoundFile(io.BytesIO(data)) as f:
            rate, frames, kind = f.samplerate, f.frames, f.format
            f.read(1, dtype="float32")
    except Exception as e:  # noqa: BLE001 - libsndfile's errors (unknown format, truncated, corrupt)
        raise HiddenStatesRequestError(
            f"{field}: the data is not a readable audio file ({str(e).strip() or type(e).__name__}): send "
            f"{', '.join(f.upper() for f in AUDIO_FORMATS)}",
            field,
        ) from None
    if frames == 0:
        raise HiddenStatesRequestError(f"{field}: the {kind} clip has no samples", field)
    if not AUDIO_RATES[0] <= rate <= AUDIO_RATES[1]:
        raise HiddenStatesRequestError(
            f"{field}: the clip is sampled at {rate} Hz; this server resamples clips of {AUDIO_RATES[0]} to "
            f"{AUDIO_RATES[1]} Hz",
            field,
        )


def _too_large(field: str, modality: str, size: int, max_bytes: int) -> HiddenStatesRequestError:
    return HiddenStatesRequestError(
        f"{field}: the {modality} is {size} bytes (decoded), above this server's limit "
        f"of {max_bytes} bytes per media part (max_media_bytes)",
        field,
    )


def _check_image(data: bytes, mime: str, field: str) -> None:
    """The bytes open as a format vLLM reads, and their structure verifies (no pixels are decoded)."""
    from PIL import Image, UnidentifiedImageError

    Image.init()
    allowed = [f for f in IMAGE_FORMATS if f in Image.OPEN]
    fmt = None
    try:
        with Image.open(io.BytesIO(data), formats=allowed) as image:
            fmt = image.format
            image.verify()
    except UnidentifiedImageError:
        found = _format_of(data)
        if found:
            raise HiddenStatesRequestError(
                f"{field}: unsupported image format {found}: vLLM's image loader does not "
                f"read it; send {COMMON_FORMATS}",
                field,
            ) from None
        raise HiddenStatesRequestError(
            f"{field}: the data is not a readable image (declared {mime}): no format vLLM's "
            f"image loader reads recognises it, or it is cut short; send {COMMON_FORMATS}",
            field,
        ) from None
    except Image.DecompressionBombError as e:
        raise HiddenStatesRequestError(f"{field}: the image has too many pixels: {e}", field) from None
    except Exception as e:  # verify(): a broken file (a bad checksum, truncated chunks, ...)
        raise HiddenStatesRequestError(
            f"{field}: the {fmt or 'image'} image is corrupt ({type(e).__name__}: {e})", field
        ) from None


def _format_of(data: bytes) -> str | None:
    """The format Pillow identifies from any of its readers (only to name it in a refusal)."""
    from PIL import Image

    try:
        with Image.open(io.BytesIO(data)) as image:
            return image.format
    except Exception:
        return None
